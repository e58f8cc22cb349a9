"""Put a paper's tables, computed again from its result file, into its document, where new runs
changed them:

    python -m experiments.refresh_tables feddeper                 # against the committed result file
    python -m experiments.refresh_tables feddeper --before old.json

``experiments/<paper>/report.py``'s ``tables()`` is computed twice: from the result file as it was
(``--before``, default: the committed ``docs/results/<paper>.json``), which is what the document
shows, and from the file as it is now. Each table of the document that the first computation gives
is replaced by its counterpart in the second: the table with the same header and the same row
labels (its first column), in the same order among tables that share both; failing that (a row
appeared), the table with the same header in the same order, where both computations give as many
tables with that header. What cannot be matched is listed: new tables (a study's first runs) for
the author to place, with the prose around them, which this does not touch. Bold set by hand in a changed table goes.
"""

from __future__ import annotations

import argparse
import importlib
import json
import subprocess
from collections import Counter, defaultdict
from pathlib import Path
from typing import Optional, Sequence

from experiments import results

ROOT = Path(__file__).resolve().parents[1]

Key = tuple[str, tuple[str, ...], int]


def keys(tables: Sequence[str]) -> list[Key]:
    """Each table's identity: its first line, its rows' first cells, and its rank among the tables
    that share both."""
    seen: dict[tuple[str, tuple[str, ...]], int] = defaultdict(int)
    out = []
    for table in tables:
        lines = table.splitlines()
        labels = tuple(line.split("|")[1].strip() for line in lines if line.startswith("|") and line.count("|") > 2)
        seen[lines[0], labels] += 1
        out.append((lines[0], labels, seen[lines[0], labels]))
    return out


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


def by_header(tables: Sequence[str]) -> list[tuple[str, int]]:
    """Each table's first line and its rank among the tables that share it."""
    seen: dict[str, int] = defaultdict(int)
    out = []
    for table in tables:
        seen[table.splitlines()[0]] += 1
        out.append((table.splitlines()[0], seen[table.splitlines()[0]]))
    return out


def pairs(before: Sequence[str], after: Sequence[str]) -> dict[int, int]:
    """``after`` index -> the ``before`` index of the same table: the same :func:`keys`; else, for a
    table whose rows changed (a row that appeared), the same header and rank among the tables with
    that header, where before and after have as many of them."""
    old = {key: i for i, key in enumerate(keys(before))}
    matched = {j: old[key] for j, key in enumerate(keys(after)) if key in old}
    count_before = Counter(header for header, _ in by_header(before))
    count_after = Counter(header for header, _ in by_header(after))
    old_headers = {key: i for i, key in enumerate(by_header(before)) if i not in matched.values()}
    for j, key in enumerate(by_header(after)):
        if j not in matched and key in old_headers and count_before[key[0]] == count_after[key[0]]:
            matched[j] = old_headers[key]
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
