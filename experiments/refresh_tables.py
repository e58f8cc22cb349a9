"""Put a paper's tables, computed again from its result file, into its document, where new runs
changed them:

    python -m experiments.refresh_tables feddeper                 # against the committed result file
    python -m experiments.refresh_tables feddeper --before old.json

``experiments/<paper>/report.py``'s ``tables()`` is computed twice: from the result file as it was
(``--before``, default: the committed ``docs/results/<paper>.json``), which is what the document
shows, and from the file as it is now. Each table of the document that the first computation gives
is replaced by its counterpart in the second. The two lists of tables are aligned in order (both
follow the document) by each table's identity, its column header and its row labels (first
column), which new rounds do not change (a caption such as ``rounds=50 ...`` may); a stretch of
tables whose identities differ but which are as many on both sides and have the same column
headers (a row appeared) is paired in order. What cannot be matched is listed: new tables (a
study's first runs) for the author to place, with the prose around them, which this does not
touch. Bold set by hand in a changed table goes.
"""

from __future__ import annotations

import argparse
import importlib
import json
import subprocess
from difflib import SequenceMatcher
from pathlib import Path
from typing import Optional, Sequence

from experiments import results

ROOT = Path(__file__).resolve().parents[1]

Identity = tuple[str, tuple[str, ...]]


def identity(table: str) -> Identity:
    """What tells a table from the others whatever its numbers: its column header (its first row)
    and its rows' first cells. A caption line above the rows (``rounds=50 ...``) is not part of it."""
    rows = [line for line in table.splitlines() if line.startswith("|") and line.count("|") > 2]
    return rows[0], tuple(row.split("|")[1].strip() for row in rows[1:])


def plain(line: str) -> str:
    """A line as the documents' tables are compared (bold aside)."""
    return line.strip().replace("**", "")


def find(doc: list[str], table: list[str]) -> Optional[int]:
    """Where the lines of ``table`` begin in ``doc`` (compared :func:`plain`), or None."""
    wanted = [plain(line) for line in table]
    for i in range(len(doc) - len(wanted) + 1):
        if all(plain(doc[i + j]) == w for j, w in enumerate(wanted)):
            return i
    return None


def pairs(before: Sequence[str], after: Sequence[str]) -> dict[int, int]:
    """``after`` index -> the ``before`` index of the same table: the two lists aligned in order by
    :func:`identity`; in a stretch that differs but holds as many tables on both sides, the tables
    with the same column header are paired in order (their rows changed)."""
    old, new = [identity(t) for t in before], [identity(t) for t in after]
    matched: dict[int, int] = {}
    for tag, i1, i2, j1, j2 in SequenceMatcher(None, old, new, autojunk=False).get_opcodes():
        if tag == "equal" or (tag == "replace" and i2 - i1 == j2 - j1):
            matched.update((j, i) for i, j in zip(range(i1, i2), range(j1, j2)) if old[i][0] == new[j][0])
    return matched


def refresh(doc: str, before: Sequence[str], after: Sequence[str]) -> tuple[str, list[str], list[str]]:
    """``doc`` with each of the ``before`` tables it shows replaced by its ``after`` counterpart
    (:func:`pairs`); also the ``after`` tables that replaced nothing and the ``before`` tables that
    were not found in ``doc``."""
    lines = doc.splitlines()
    placed, absent = set(), []
    for j, i in sorted(pairs(before, after).items()):
        at = find(lines, before[i].splitlines())
        if at is None:
            absent.append(before[i])
            continue
        if after[j] != before[i]:  # an unchanged table keeps the page's bold
            lines[at: at + len(before[i].splitlines())] = after[j].splitlines()
        placed.add(j)
    unplaced = [table for j, table in enumerate(after) if j not in placed and find(lines, table.splitlines()) is None]
    return "\n".join(lines) + ("\n" if doc.endswith("\n") else ""), unplaced, absent


def committed(path: Path) -> list[results.Run]:
    """The runs of result file ``path`` as committed (HEAD)."""
    relative = path.resolve().relative_to(ROOT)
    text = subprocess.run(["git", "show", f"HEAD:{relative.as_posix()}"], capture_output=True, text=True, check=True,
                          cwd=ROOT).stdout
    return json.loads(text)["runs"]


def main(argv: Optional[Sequence[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("paper", help="the report: experiments/<paper>/report.py, docs/results/<paper>.{json,md}")
    parser.add_argument("--before", type=Path, help="the result file the document shows (default: the committed one)")
    opts = parser.parse_args(argv)
    report = importlib.import_module(f"experiments.{opts.paper}.report")
    data, page = ROOT / "docs" / "results" / f"{opts.paper}.json", ROOT / "docs" / "results" / f"{opts.paper}.md"
    before = report.tables(results.load(opts.before) if opts.before else committed(data))
    text, unplaced, absent = refresh(page.read_text(), before, report.tables(results.load(data)))
    page.write_text(text)
    for table in absent:
        print(f"not in {page.name} (left as it is):\n{table}\n")
    for table in unplaced:
        print(f"new, to place by hand:\n{table}\n")
    print(f"{page}: {len(unplaced)} tables to place, {len(absent)} not found")


if __name__ == "__main__":
    main()
