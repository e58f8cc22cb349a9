"""The table of ``docs/results/scaffold.md`` from its result file: SCAFFOLD's global test accuracy on the
MNIST config after rounds 50-200, mean ± sample std over seeds, per control-delta mean.

    python -m experiments.scaffold.report docs/results/scaffold.json
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

from experiments import results
from experiments.scaffold.run import CONTROLS

RESULTS = Path(__file__).resolve().parents[2] / "docs" / "results" / "scaffold.json"
LABELS = {"sample_weighted": "sample-weighted (the engine before Engine v2)", "uniform": "uniform (Algorithm 1, now)"}


def tables(runs: list[results.Run]) -> list[str]:
    """One table: a row per control mean (its seeds in seed order), a column per measured round."""
    groups = {c: sorted(results.select(runs, control=c), key=lambda r: r["params"]["seed"]) for c in CONTROLS}
    groups = {c: g for c, g in groups.items() if g}
    if not groups:
        return []
    rounds = [h["round"] for h in next(iter(groups.values()))[0]["history"]]
    lines = ["| control mean | seeds | " + " | ".join(f"round {r}" for r in rounds) + " |",
             "|---|---|" + "---|" * len(rounds)]
    for control in ("sample_weighted", "uniform"):
        if control in groups:
            acc = 100 * np.array([[h["test_acc"] for h in run["history"]] for run in groups[control]])
            cells = [f"{m:.2f} ± {s:.2f}" for m, s in zip(acc.mean(0), acc.std(0, ddof=1))]
            lines.append(f"| {LABELS[control]} | {len(acc)} | " + " | ".join(cells) + " |")
    return ["\n".join(lines)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("results", nargs="?", type=Path, default=RESULTS)
    print("\n\n".join(tables(results.load(parser.parse_args().results))))


if __name__ == "__main__":
    main()
