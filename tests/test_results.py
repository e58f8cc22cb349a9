"""The result documents agree with their data: every table that ``experiments/<paper>/report.py``
computes from ``docs/results/<paper>.json`` is in ``docs/results/<paper>.md`` as printed (bold
aside), and every figure a document shows is there. No training: the result files are read."""

from __future__ import annotations

import importlib
import json
import re
import sys
from pathlib import Path

import pytest

from experiments import results

DOCS = Path(__file__).resolve().parents[1] / "docs" / "results"
PAPERS = ("feddeper", "feddro", "fedproxvr", "pefll", "raga", "scaffold")
#: a paper's other result files whose runs its page's tables show too (a study kept in a file of its own)
MORE = {"feddro": ("feddro_paper_length.json",)}


def plain(line: str) -> str:
    return line.strip().replace("**", "")


def contains(doc: list[str], table: list[str]) -> bool:
    """Whether the lines of ``table`` are in ``doc`` one after the other (each within its document line)."""
    return any(all(t in doc[i + j] for j, t in enumerate(table)) for i in range(len(doc) - len(table) + 1))


@pytest.mark.parametrize("paper", PAPERS)
def test_every_table_is_computed_from_the_result_file(paper):
    report = importlib.import_module(f"experiments.{paper}.report")
    doc = [plain(line) for line in (DOCS / f"{paper}.md").read_text().splitlines()]
    runs = [run for name in (f"{paper}.json", *MORE.get(paper, ())) for run in results.load(DOCS / name)]
    tables = report.tables(runs)
    missing = [table for table in tables if not contains(doc, [plain(line) for line in table.splitlines()])]
    assert not missing, "\n\n".join(missing)


@pytest.mark.parametrize("document", sorted(DOCS.glob("*.md")), ids=lambda p: p.name)
def test_every_figure_shown_is_there(document):
    shown = re.findall(r"!\[[^\]]*\]\(([^)]+)\)", document.read_text())
    assert [target for target in shown if not (document.parent / target).is_file()] == []


def test_the_index_counts_where_the_records_come_from_as_the_files_say():
    """docs/results/index.md's table is the one ``experiments.provenance`` computes from the result files
    (``python -m experiments.provenance --update`` after a file changed)."""
    from experiments import provenance

    assert provenance.table(DOCS.glob("*.json")) in (DOCS / "index.md").read_text()


def test_provenance_counts_clean_commits_environments_devices_and_the_cost_of_the_rest(tmp_path):
    from experiments import provenance

    env = {"torch": "2.14.1"}
    runs = {"runs": [{"name": "a", "commit": "abc", "env": env, "device": "cpu", "wall_s": 7200.0},
                     {"name": "b", "commit": "abc+", "env": env, "device": "cpu", "wall_s": 3600.0},
                     {"name": "c", "commit": "abc", "commits": ["abc", "def+"], "wall_s": 1800.0},
                     {"name": "d", "commit": "abc", "wall_s": 1800.0}]}
    measured = {"commit": "f00", "measurements": [{"x": 1}], "aggregates": [{"commit": "f01+", "env": env, "y": 2}]}
    (tmp_path / "runs.json").write_text(json.dumps(runs))
    (tmp_path / "measured.json").write_text(json.dumps(measured))
    (tmp_path / "whole.json").write_text(json.dumps({"setting": "s"}))
    assert [r.get("commit") for r in provenance.records(measured)] == ["f00", "f01+"]
    assert provenance.table(tmp_path.glob("*.json")).splitlines()[2:] == [
        "| measured.json | 2 | 1 | 1 | not recorded 2 | 2, 0.0 (2 with no wall time) |",
        "| runs.json | 4 | 2 | 2 | cpu 2, not recorded 2 | 3, 2.0 |",
        "| whole.json | 1 | 0 | 0 | not recorded 1 | 1, 0.0 (1 with no wall time) |",
        "| all | 7 | 3 | 3 | cpu 2, not recorded 5 | 6, 2.0 (3 with no wall time) |"]
    page = f"# results\n\nintro\n\n{provenance.HEADER}\n|---|\n| old | row |\n\nafter\n"
    assert provenance.update(page, "NEW") == "# results\n\nintro\n\nNEW\n\nafter\n"
    with pytest.raises(ValueError, match="no table headed"):
        provenance.update("# results\n", "NEW")


def test_the_queue_lists_the_records_to_rerun_by_study_cheapest_first(tmp_path):
    from experiments import provenance

    env = {"torch": "2.14.1"}
    stopped = {"stopped": "time limit"}
    runs = {"runs": [{"name": "long/a_s0", "commit": "abc+", "wall_s": 3600.0, "history": [{"round": 90}], **stopped},
                     {"name": "long/a_s1", "commit": "abc+", "wall_s": 1800.0, "history": [{"round": 110}], **stopped},
                     {"name": "short/b_s0", "commit": "abc", "device": "cpu", "wall_s": 600.0},
                     {"name": "short/b_s1", "commit": "abc", "env": env, "device": "cpu", "wall_s": 600.0}]}
    (tmp_path / "runs.json").write_text(json.dumps(runs))
    (tmp_path / "whole.json").write_text(json.dumps({"setting": "s"}))
    assert provenance.queue(tmp_path.glob("*.json")).splitlines()[2:] == [
        "| whole.json | - | 1 | 0.00 | 0 | - | not recorded 1 |",
        "| runs.json | short | 1 | 0.17 | 10 | - | cpu 1 |",
        "| runs.json | long | 2 | 1.50 | 60 | 90-110 | not recorded 2 |"]


def test_refresh_replaces_each_shown_table_by_its_new_counterpart():
    """Tables are matched in order by their column header and row labels; bold does not hide a
    table; new tables and tables the page does not show are listed, not placed."""
    from experiments.refresh_tables import refresh

    a5, a10 = "| diff | x |\n|---|---|\n| A − B | 1 |", "| diff | x |\n|---|---|\n| A − B | 2 |"
    doc = f"# page\n\nm = 5:\n\n{a5.replace('| 1 |', '| **1** |')}\n\nm = 10:\n\n{a10}\n"
    new5, new10, extra = a5.replace("| 1 |", "| 3 |"), a10.replace("| 2 |", "| 4 |"), "| other | y |\n|---|---|\n| C | 5 |"
    gone = "| gone | z |\n|---|---|\n| D | 6 |"
    text, unplaced, absent = refresh(doc, [a5, a10, gone], [new5, new10, extra])
    assert text == f"# page\n\nm = 5:\n\n{new5}\n\nm = 10:\n\n{new10}\n"
    assert unplaced == [extra] and absent == []
    grown = new10 + "\n| A − C | 7 |"  # a row that appeared: the same header, the same rank
    text, unplaced, absent = refresh(text, [new5, new10], [new5, grown])
    assert text == f"# page\n\nm = 5:\n\n{new5}\n\nm = 10:\n\n{grown}\n" and unplaced == absent == []
    # a third table of that header: ranks no longer tell which is which, so it is listed
    text, unplaced, absent = refresh(text, [new5, grown], [new5, grown, a5])
    assert text.count("| 3 |") == 1 and unplaced == [a5] and absent == []
    assert refresh("nothing\n", [a5], [new5]) == ("nothing\n", [new5], [a5])


def test_refresh_matches_a_table_whose_caption_changed_to_its_own_counterpart():
    """A run's new rounds change a table's caption (``rounds=50`` -> ``rounds=100``) but not its
    identity: the table is still matched to its own counterpart, not to a later table of the same
    columns and rows (FedProxVR's Table 2 had once been replaced by a Fig. 3 table that way)."""
    from experiments.refresh_tables import refresh

    rows = "| method | acc |\n|---|---|\n| FedAvg | {} |\n| SVRG | {} |"
    table2, fig3a, fig3b = (f"rounds=50 clients=10\n\n{rows.format(*v)}" for v in ((95, 91), (80, 79), (81, 78)))
    doc = f"# Table 2\n\n{table2}\n\n# Fig. 3\n\n{fig3a}\n\n{fig3b}\n"
    table2_now = f"rounds=100 clients=10\n\n{rows.format(96, 95)}"
    text, unplaced, absent = refresh(doc, [table2, fig3a, fig3b], [table2_now, fig3a, fig3b])
    assert text == doc.replace(table2, table2_now) and unplaced == absent == []


def test_a_report_without_scipy_names_the_extra_that_installs_it(monkeypatch, capsys):
    """The reports' intervals need scipy, which only the extras install: a report run without it says
    which extra to install, and prints no table."""
    from experiments.raga import report

    monkeypatch.setitem(sys.modules, "scipy", None)  # import scipy fails as if it were not installed
    with pytest.raises(ModuleNotFoundError, match=re.escape('pip install -e ".[experiments]"')):
        report.main([])
    assert capsys.readouterr().out == ""


def test_the_figures_without_matplotlib_name_the_extra_that_installs_it(monkeypatch):
    monkeypatch.delitem(sys.modules, "experiments.plots", raising=False)
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(ModuleNotFoundError, match=re.escape('pip install -e ".[experiments]"')):
        importlib.import_module("experiments.plots")


def test_the_experiments_extra_installs_what_the_reports_import_and_the_test_extra_holds_it():
    tomllib = pytest.importorskip("tomllib")
    extras = tomllib.loads((DOCS.parents[1] / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert {re.split("[<>=]", r)[0] for r in extras["experiments"]} == {"scipy", "matplotlib"}
    assert set(extras["experiments"]) <= set(extras["test"])


def test_compare_records_names_what_moved_and_replaces_the_records(tmp_path, capsys):
    """experiments.compare_records: a re-run's figures against the record's (NaN equal to NaN, a point
    missing on one side a difference), and ``--replace`` writing the new records in the old places."""
    from experiments import results
    from experiments.compare_records import differences, main

    old = [{"name": "a", "history": [{"round": 1, "acc": 0.5, "loss": float("nan")}, {"round": 2, "acc": 0.6}]},
           {"name": "b", "history": [{"round": 1, "acc": 0.1}]}, {"name": "c", "history": []}]
    new = [{"name": "b", "history": [{"round": 1, "acc": 0.1}]},
           {"name": "a", "history": [{"round": 1, "acc": 0.5, "loss": float("nan")}, {"round": 2, "acc": 0.65}]}]
    assert differences(old[0], new[1]) == {"acc": (pytest.approx(0.05), [2])}
    assert differences(old[1], {"name": "b", "history": []}) == {"acc": (float("inf"), [1])}
    results.save(tmp_path / "old.json", old)
    results.save(tmp_path / "new.json", new)
    main([str(tmp_path / "old.json"), str(tmp_path / "new.json"), "--replace"])
    out = capsys.readouterr().out
    assert "a: acc by up to 0.05 at 1 evaluation(s) (first round 2)" in out
    assert "2 runs compared: 1 identical, 1 moved" in out and "2 records replaced" in out
    assert [r["name"] for r in results.load(tmp_path / "old.json")] == ["a", "b", "c"]
    assert results.load(tmp_path / "old.json")[0]["history"][1]["acc"] == 0.65
