"""The table of ``docs/results/scaffold.md`` from its result file: SCAFFOLD's global test accuracy on the
MNIST config after rounds 50-200, mean ± sample std over seeds, per control-delta mean.

    python -m experiments.scaffold.report docs/results/scaffold.json
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

from experiments import results

RESULTS = Path(__file__).resolve().parents[2] / "docs" / "results" / "scaffold.json"
#: the rows, in the table's order
LABELS = {"sample_weighted": "sample-weighted (the engine before Engine v2)", "uniform": "uniform (Algorithm 1, now)"}


def tables(runs: list[results.Run]) -> list[str]:
    """One table: a row per control mean that has runs (its seeds in seed order), a column per measured round."""
    groups = {control: sorted(results.select(runs, control=control), key=lambda r: r["params"]["seed"])
              for control in LABELS}
    groups = {control: group for control, group in groups.items() if group}
    if not groups:
        return []
    rounds = [h["round"] for h in next(iter(groups.values()))[0]["history"]]
    lines = ["| control mean | seeds | " + " | ".join(f"round {r}" for r in rounds) + " |",
             "|---|---|" + "---|" * len(rounds)]
    for control, group in groups.items():
        acc = 100 * np.array([[h["test_acc"] for h in run["history"]] for run in group])
        cells = [f"{m:.2f} ± {s:.2f}" for m, s in zip(acc.mean(0), acc.std(0, ddof=1))]
        lines.append(f"| {LABELS[control]} | {len(acc)} | " + " | ".join(cells) + " |")
    return ["\n".join(lines)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("results", nargs="?", type=Path, default=RESULTS)
    print("\n\n".join(tables(results.load(parser.parse_args().results))))


if __name__ == "__main__":
    main()
