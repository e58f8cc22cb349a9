"""Compare the records of the same runs in two result files: did re-running them move any figure?

    python -m experiments.compare_records docs/results/raga.json runs/rerun/raga.json
    python -m experiments.compare_records docs/results/raga.json runs/rerun/raga.json --replace

For each run of the second file that the first also holds, every metric at every evaluated round
is compared; the report gives, per run, the largest absolute difference of each metric that moved
and the rounds where it did (identical histories are counted, not listed). ``--replace`` then writes
the second file's records over the first's (same names, same places in the file).
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path
from typing import Optional, Sequence

from experiments import results


def differences(old: results.Run, new: results.Run) -> dict[str, tuple[float, list[int]]]:
    """Metric -> (largest absolute difference, rounds where it differs) between two records of one run;
    a metric or round present in one only counts as an infinite difference; NaN equals NaN."""
    before = {point["round"]: point for point in old["history"]}
    after = {point["round"]: point for point in new["history"]}
    moved: dict[str, tuple[float, list[int]]] = {}
    for round_number in sorted(set(before) | set(after)):
        a, b = before.get(round_number, {}), after.get(round_number, {})
        for key in sorted((set(a) | set(b)) - {"round"}):
            x, y = a.get(key), b.get(key)
            if x is None or y is None:
                gap = math.inf
            elif isinstance(x, float) and isinstance(y, float) and math.isnan(x) and math.isnan(y):
                continue
            else:
                gap = abs(float(x) - float(y))
            if gap > 0 or math.isnan(gap):
                largest, rounds = moved.get(key, (0.0, []))
                moved[key] = (max(largest, gap), [*rounds, round_number])
    return moved


def report(old_path: Path, new_path: Path) -> tuple[list[str], int]:
    """The report's lines, and how many runs of the second file the first holds."""
    old = {run["name"]: run for run in results.load(old_path)}
    lines, compared = [], 0
    for run in results.load(new_path):
        if run["name"] not in old:
            lines.append(f"{run['name']}: not in {old_path}")
            continue
        compared += 1
        moved = differences(old[run["name"]], run)
        if moved:
            parts = [f"{key} by up to {gap:.6g} at {len(rounds)} evaluation(s) (first round {rounds[0]})"
                     for key, (gap, rounds) in moved.items()]
            lines.append(f"{run['name']}: " + "; ".join(parts))
    same = compared - sum(1 for line in lines if not line.endswith(f"not in {old_path}"))
    lines.append(f"{compared} runs compared: {same} identical, {compared - same} moved")
    return lines, compared


def replace(old_path: Path, new_path: Path) -> int:
    """Write ``new_path``'s records over ``old_path``'s records of the same runs (in place); returns how many."""
    new = {run["name"]: run for run in results.load(new_path)}
    runs = results.load(old_path)
    replaced = sum(run["name"] in new for run in runs)
    results.save(old_path, [new.get(run["name"], run) for run in runs])
    return replaced


def main(argv: Optional[Sequence[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("old", type=Path, help="the result file holding the records so far (docs/results/<paper>.json)")
    parser.add_argument("new", type=Path, help="a result file of the same runs run again")
    parser.add_argument("--replace", action="store_true", help="then write the new records over the old ones")
    opts = parser.parse_args(argv)
    lines, _ = report(opts.old, opts.new)
    print("\n".join(lines))
    if opts.replace:
        print(f"{replace(opts.old, opts.new)} records replaced in {opts.old}")


if __name__ == "__main__":
    main()
