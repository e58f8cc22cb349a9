"""Where the records of ``docs/results/`` come from: for each result file, how many of its records name a
commit of the repository (one made from a clean tree, not ``<sha>+``), how many name the environment they
ran in (:func:`experiments.results.environment`), the devices they trained on, and the training time of
the records that lack either (what re-running them costs, by their own ``wall_s``, where they have one).

    python -m experiments.provenance             # the table of docs/results/index.md
    python -m experiments.provenance --update    # put it there

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


def row(name: str, entries: Sequence[dict[str, Any]]) -> str:
    """One file's row of the table."""
    devices = Counter(device(r) for r in entries)
    rest = [r for r in entries if not (clean(r) and "env" in r)]
    hours = sum(r.get("wall_s", 0.0) for r in rest) / 3600
    unmeasured = sum("wall_s" not in r for r in rest)
    cost = f"{len(rest)}, {hours:.1f}" + (f" ({unmeasured} with no wall time)" if unmeasured else "")
    return (f"| {name} | {len(entries)} | {sum(map(clean, entries))} | {sum('env' in r for r in entries)} "
            f"| {', '.join(f'{d} {n}' for d, n in sorted(devices.items()))} | {cost} |")


def table(paths: Iterable[Path]) -> str:
    """The table of the result files at ``paths``: a row per file and their total."""
    rows, everything = [], []
    for path in sorted(paths):
        entries = records(json.loads(path.read_text()))
        rows.append(row(path.name, entries))
        everything += entries
    return "\n".join([HEADER, "|---|---|---|---|---|---|", *rows, row("all", everything)])


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
    opts = parser.parse_args(argv)
    new = table(RESULTS.glob("*.json"))
    if opts.update:
        INDEX.write_text(update(INDEX.read_text(), new))
    print(new)


if __name__ == "__main__":
    main()
