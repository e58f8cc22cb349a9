"""Where the records of ``docs/results/`` come from: for each result file, how many of its records name a
commit of the repository (one made from a clean tree, not ``<sha>+``), how many name the environment they
ran in (:func:`experiments.results.environment`), the devices they trained on, and the training time of
the records that lack either (what re-running them costs, by their own ``wall_s``, where they have one).

    python -m experiments.provenance             # the table of docs/results/index.md
    python -m experiments.provenance --update    # put it there
    python -m experiments.provenance --queue     # the records to re-run, by study, cheapest first

A record is a run of a result file (:mod:`experiments.results`); in a file of another form, an entry of
its ``measurements`` or ``aggregates`` (which may take the file's commit and environment), or else the
file as a whole.
"""

from __future__ import annotations

import argparse
import json
from collections import Counter
from pathlib import Path
from typing import Any, Iterable, Optional, Sequence

from experiments.results import ROOT

RESULTS = ROOT / "docs" / "results"
#: the page whose table this prints
INDEX = RESULTS / "index.md"
HEADER = ("| result file | records | on a clean commit | with environment | devices "
          "| to re-run: records, training hours |")


def records(data: dict[str, Any]) -> list[dict[str, Any]]:
    """The records of a result file's contents: its runs; else the entries of its ``measurements`` and
    ``aggregates``, each with the file's ``commit``, ``device`` and ``env`` where it has none of its own;
    else the file as one record."""
    if "runs" in data:
        return list(data["runs"])
    inherited = {key: data[key] for key in ("commit", "device", "env") if key in data}
    entries = [*data.get("measurements", []), *data.get("aggregates", [])]
    return [{**inherited, **entry} for entry in entries] if entries else [data]


def clean(record: dict[str, Any]) -> bool:
    """Whether a record names a commit made from a clean tree (every commit it ran on, where it names several)."""
    commits = record.get("commits") or [record.get("commit")]
    return all(isinstance(c, str) and c and not c.endswith("+") for c in commits)


def device(record: dict[str, Any]) -> str:
    """The device a record names, or ``not recorded``."""
    return record.get("device") or "not recorded"


def pending(record: dict[str, Any]) -> bool:
    """Whether a record is to be re-run: it lacks a clean commit or its environment."""
    return not (clean(record) and "env" in record)


def hours(entries: Iterable[dict[str, Any]]) -> float:
    """The training hours of ``entries`` by their own ``wall_s`` (a record without one adds nothing)."""
    return sum(e.get("wall_s", 0.0) for e in entries) / 3600


def devices(entries: Iterable[dict[str, Any]]) -> str:
    """The devices ``entries`` name, each with its count."""
    return ", ".join(f"{d} {n}" for d, n in sorted(Counter(map(device, entries)).items()))


def row(name: str, entries: Sequence[dict[str, Any]]) -> str:
    """One file's row of the table."""
    rest = [r for r in entries if pending(r)]
    unmeasured = sum("wall_s" not in r for r in rest)
    cost = f"{len(rest)}, {hours(rest):.1f}" + (f" ({unmeasured} with no wall time)" if unmeasured else "")
    return (f"| {name} | {len(entries)} | {sum(map(clean, entries))} | {sum('env' in r for r in entries)} "
            f"| {devices(entries)} | {cost} |")


def table(paths: Iterable[Path]) -> str:
    """The table of the result files at ``paths``: a row per file and their total."""
    rows, everything = [], []
    for path in sorted(paths):
        entries = records(json.loads(path.read_text()))
        rows.append(row(path.name, entries))
        everything += entries
    return "\n".join([HEADER, "|---|---|---|---|---|---|", *rows, row("all", everything)])


def queue(paths: Iterable[Path]) -> str:
    """The records of the result files at ``paths`` that are to be re-run, a row per file and study (a run's
    name up to its first ``/``), cheapest first: their number, training hours, longest run, the rounds of
    the stopped ones (to re-run with ``--until-round``), and the devices they name."""
    studies: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for path in sorted(paths):
        for entry in records(json.loads(path.read_text())):
            if pending(entry):
                study = str(entry.get("name", "")).partition("/")[0] or "-"
                studies.setdefault((path.name, study), []).append(entry)
    lines = ["| result file | study | records | training hours | longest run (min) | stopped at round | devices |",
             "|---|---|---|---|---|---|---|"]
    for (name, study), entries in sorted(studies.items(), key=lambda kv: (hours(kv[1]), kv[0])):
        stopped = sorted({e["history"][-1]["round"] for e in entries if "stopped" in e and e.get("history")})
        rounds = "-".join(map(str, sorted({stopped[0], stopped[-1]}))) if stopped else "-"
        longest = max(e.get("wall_s", 0.0) for e in entries) / 60
        lines.append(f"| {name} | {study} | {len(entries)} | {hours(entries):.2f} | {longest:.0f} | {rounds} "
                     f"| {devices(entries)} |")
    return "\n".join(lines)


def update(page: str, new: str) -> str:
    """``page`` with its table (from :data:`HEADER` to the first line that is not a table row) replaced by ``new``.

    Raises:
        ValueError: the page holds no such table.
    """
    lines = page.splitlines()
    if HEADER not in lines:
        raise ValueError(f"no table headed {HEADER!r} in the page: add one where it should go")
    start = lines.index(HEADER)
    end = start
    while end < len(lines) and lines[end].startswith("|"):
        end += 1
    return "\n".join([*lines[:start], new, *lines[end:]]) + ("\n" if page.endswith("\n") else "")


def main(argv: Optional[Sequence[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--update", action="store_true", help=f"write the table into {INDEX.relative_to(ROOT)}")
    parser.add_argument("--queue", action="store_true",
                        help="print the records to re-run instead, by study, cheapest first")
    opts = parser.parse_args(argv)
    if opts.queue:
        print(queue(RESULTS.glob("*.json")))
        return
    new = table(RESULTS.glob("*.json"))
    if opts.update:
        INDEX.write_text(update(INDEX.read_text(), new))
    print(new)


if __name__ == "__main__":
    main()
