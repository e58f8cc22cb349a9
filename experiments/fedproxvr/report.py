"""Summarize the JSON curves written by ``run.py``: markdown tables (mean and spread over seeds)
and a PNG of the training-loss and test-accuracy curves.

    python experiments/fedproxvr/report.py experiments/fedproxvr/results/mu.json
    python experiments/fedproxvr/report.py results/table1_r100.json results/table1_r100_sarah.json  # merged
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path
from typing import Any

import numpy as np


def by_label(results: dict[str, Any]) -> dict[str, list[dict[str, Any]]]:
    """Runs grouped by label, in the order they were run."""
    groups: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for run in results["runs"].values():
        groups[run["label"]].append(run)
    return groups


def series(runs: list[dict[str, Any]], key: str) -> tuple[np.ndarray, np.ndarray]:
    """Rounds and a [seeds, points] array of ``key``."""
    rounds = np.array([p["round"] for p in runs[0]["curve"]])
    return rounds, np.array([[p[key] for p in r["curve"]] for r in runs])


def fmt(values: np.ndarray, scale: float = 1.0, digits: int = 2) -> str:
    """``mean ± std (min–max)`` over seeds."""
    v = values * scale
    return f"{v.mean():.{digits}f} ± {v.std(ddof=1) if len(v) > 1 else 0.0:.{digits}f} ({v.min():.{digits}f}–{v.max():.{digits}f})"


def fluctuation(losses: np.ndarray, start: int) -> np.ndarray:
    """Per seed: std of the round-to-round changes of the training loss from point ``start`` on."""
    return np.diff(losses[:, start:], axis=1).std(axis=1)


def summary_table(groups: dict[str, list[dict[str, Any]]]) -> str:
    lines = [
        "| algorithm | seeds | final test acc (%) | best test acc (%) | round of best | final train loss | wall s / run |",
        "|---|---|---|---|---|---|---|",
    ]
    for label, runs in groups.items():
        rounds, acc = series(runs, "test_acc")
        _, loss = series(runs, "train_loss")
        best_round = rounds[acc.argmax(axis=1)]
        lines.append(
            f"| {label} | {len(runs)} | {fmt(acc[:, -1], 100)} | {fmt(acc.max(axis=1), 100)} | "
            f"{best_round.mean():.1f} | {fmt(loss[:, -1], digits=3)} | {np.mean([r['wall_s'] for r in runs]):.0f} |"
        )
    return "\n".join(lines)


def stability_table(groups: dict[str, list[dict[str, Any]]], start: int, early: int) -> str:
    """Loss at round 0, at the first evaluation from round ``early`` on, at the end; its maximum; and the
    fluctuation from the first evaluation at or after round ``start`` (the header names the rounds used)."""
    rounds, _ = series(next(iter(groups.values())), "train_loss")
    e, s = int(np.searchsorted(rounds, early)), int(np.searchsorted(rounds, start))
    lines = [
        f"| algorithm | train loss round 0 | train loss round {rounds[e]} | final train loss | max train loss after round 0 | "
        f"fluctuation (std of the change between evaluations, rounds {rounds[s]}+) |",
        "|---|---|---|---|---|---|",
    ]
    for label, runs in groups.items():
        _, loss = series(runs, "train_loss")
        lines.append(
            f"| {label} | {loss[:, 0].mean():.3f} | {fmt(loss[:, e], digits=3)} | {fmt(loss[:, -1], digits=3)} | "
            f"{fmt(loss[:, 1:].max(axis=1), digits=3)} | {fmt(fluctuation(loss, s), digits=4)} |"
        )
    return "\n".join(lines)


def curve_table(groups: dict[str, list[dict[str, Any]]], key: str, scale: float, points: int = 8) -> str:
    labels = list(groups)
    rounds, _ = series(groups[labels[0]], key)
    picks = np.unique(np.linspace(0, len(rounds) - 1, points).round().astype(int))
    lines = ["| round | " + " | ".join(labels) + " |", "|---" * (len(labels) + 1) + "|"]
    for i in picks:
        cells = []
        for label in labels:
            _, v = series(groups[label], key)
            cells.append(f"{v[:, i].mean() * scale:.3f} ± {v[:, i].std(ddof=1) * scale if len(v) > 1 else 0:.3f}")
        lines.append(f"| {rounds[i]} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot(groups: dict[str, list[dict[str, Any]]], title: str, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for label, runs in groups.items():
        for ax, key, scale in ((axes[0], "train_loss", 1.0), (axes[1], "test_acc", 100.0)):
            rounds, v = series(runs, key)
            v = v * scale
            line, = ax.plot(rounds, v.mean(0), label=label)
            ax.fill_between(rounds, v.min(0), v.max(0), color=line.get_color(), alpha=0.2)
    axes[0].set(xlabel="round", ylabel="training loss (global model, log scale)", title=title, yscale="log")
    axes[1].set(xlabel="round", ylabel="test accuracy (%)", title="mean over seeds, band = min–max")
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("results", type=Path, nargs="+", help="run.py result files of one study (merged)")
    parser.add_argument("--stability", action="store_true", help="add the mu-study stability table")
    opts = parser.parse_args()
    parts = [json.loads(path.read_text()) for path in opts.results]
    if len({(p["rounds"], tuple(p["overrides"])) for p in parts}) != 1:
        raise SystemExit("the result files differ in rounds or overrides")
    results = dict(parts[0], runs={k: v for p in parts for k, v in p["runs"].items()})
    groups = by_label(results)
    first = next(iter(results["runs"].values()))
    print(f"rounds={results['rounds']} overrides={results['overrides']} data={first['train_sizes']} "
          f"test_samples={first['test_samples']}\n")
    print(summary_table(groups), "\n")
    if opts.stability:
        print(stability_table(groups, start=5, early=5), "\n")
    print("training loss of the global model (mean ± std over seeds)\n")
    print(curve_table(groups, "train_loss", 1.0), "\n")
    print("test accuracy, % (mean ± std over seeds)\n")
    print(curve_table(groups, "test_acc", 100.0))
    plot(groups, opts.results[0].stem, opts.results[0].with_suffix(".png"))


if __name__ == "__main__":
    main()
