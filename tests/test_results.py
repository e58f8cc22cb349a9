"""The result documents agree with their data: every table that ``experiments/<paper>/report.py``
computes from ``docs/results/<paper>.json`` is in ``docs/results/<paper>.md`` as printed (bold
aside), and every figure a document shows is there. No training: the result files are read."""

from __future__ import annotations

import importlib
import re
from pathlib import Path

import pytest

from experiments import results

DOCS = Path(__file__).resolve().parents[1] / "docs" / "results"
PAPERS = ("feddeper", "feddro", "fedproxvr", "pefll", "raga")


def plain(line: str) -> str:
    return line.strip().replace("**", "")


def contains(doc: list[str], table: list[str]) -> bool:
    """Whether the lines of ``table`` are in ``doc`` one after the other (each within its document line)."""
    return any(all(t in doc[i + j] for j, t in enumerate(table)) for i in range(len(doc) - len(table) + 1))


@pytest.mark.parametrize("paper", PAPERS)
def test_every_table_is_computed_from_the_result_file(paper):
    report = importlib.import_module(f"experiments.{paper}.report")
    doc = [plain(line) for line in (DOCS / f"{paper}.md").read_text().splitlines()]
    tables = report.tables(results.load(DOCS / f"{paper}.json"))
    missing = [table for table in tables if not contains(doc, [plain(line) for line in table.splitlines()])]
    assert not missing, "\n\n".join(missing)


@pytest.mark.parametrize("document", sorted(DOCS.glob("*.md")), ids=lambda p: p.name)
def test_every_figure_shown_is_there(document):
    shown = re.findall(r"!\[[^\]]*\]\(([^)]+)\)", document.read_text())
    assert [target for target in shown if not (document.parent / target).is_file()] == []
