"""The tables and figures of ``docs/results/fedproxvr.md``, from the runs in its result file.

    python -m experiments.fedproxvr.report [docs/results/fedproxvr.json] [--figures docs/results]

Per study (``params.study``): the federation, a summary per row (final and best test accuracy,
training loss; mean ± sample std (min–max) over seeds), for the mu studies the stability of the
training loss, and the training loss and test accuracy at 8 evaluations: the tables the document
shows (``SHOWN``). ``--figures DIR`` draws the document's figures, ``fedproxvr_<study>.png`` (mean
over seeds, band: min–max).
"""

from __future__ import annotations

import argparse
from collections import defaultdict
from pathlib import Path
from typing import Any

import numpy as np

from experiments import results

RESULTS = Path(__file__).resolve().parents[2] / "docs" / "results" / "fedproxvr.json"
FULL = ("data", "summary", "train_loss", "test_acc")
#: study -> the tables the document shows, in its order
SHOWN = {"mu": ("data", "summary", "stability", "train_loss", "test_acc"),
         "mu_n100_r100": ("data", "summary", "stability", "train_loss", "test_acc"),
         "mu_n100_r400": ("data", "summary", "stability", "train_loss", "test_acc"),
         "table1": FULL, "table1_r100": FULL, "table2": FULL, "table2_r50": ("summary", "test_acc", "train_loss"),
         "table2_sarah_beta20": ("summary",)}
#: the studies the document plots
PLOTTED = ("mu", "mu_n100_r100", "mu_n100_r400", "table1", "table1_r100", "table2", "table2_r50")
Groups = dict[str, list[results.Run]]


def studies(runs: list[results.Run]) -> dict[str, Groups]:
    """study -> row label -> runs (seeds), in file order."""
    out: dict[str, Groups] = defaultdict(lambda: defaultdict(list))
    for run in runs:
        out[run["params"]["study"]][run["params"]["label"]].append(run)
    return out


def series(runs: list[results.Run], key: str) -> tuple[np.ndarray, np.ndarray]:
    """Rounds and a [seeds, points] array of ``key``."""
    rounds = np.array([h["round"] for h in runs[0]["history"]])
    return rounds, np.array([[h[key] for h in r["history"]] for r in runs])


def fmt(values: np.ndarray, scale: float = 1.0, digits: int = 2) -> str:
    """``mean ± std (min–max)`` over seeds."""
    v = values * scale
    return f"{v.mean():.{digits}f} ± {v.std(ddof=1) if len(v) > 1 else 0.0:.{digits}f} ({v.min():.{digits}f}–{v.max():.{digits}f})"


def fluctuation(losses: np.ndarray, start: int) -> np.ndarray:
    """Per seed: std of the changes of the training loss between evaluations, from point ``start`` on."""
    return np.diff(losses[:, start:], axis=1).std(axis=1)


def data_line(groups: Groups) -> str:
    first = next(iter(groups.values()))[0]
    return (f"rounds={first['params']['rounds']} overrides={first['params']['overrides']} "
            f"data={first['summary']['train_sizes']} test_samples={first['summary']['test_samples']}")


def summary_table(groups: Groups) -> str:
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


def stability_table(groups: Groups, start: int = 5, early: int = 5) -> str:
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


def curve_table(groups: Groups, key: str, scale: float, points: int = 8) -> str:
    """``key`` (mean ± sample std over seeds) at ``points`` evaluations spread over the run."""
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


def tables(runs: list[results.Run]) -> list[str]:
    """Every table of the document, study by study (a study the document does not show: all of them)."""
    make = {"data": data_line, "summary": summary_table, "stability": stability_table,
            "train_loss": lambda g: curve_table(g, "train_loss", 1.0), "test_acc": lambda g: curve_table(g, "test_acc", 100.0)}
    return [make[part](groups) for study, groups in studies(runs).items() for part in SHOWN.get(study, FULL)]


def plot(groups: Groups, title: str, path: Path) -> None:
    """Training loss (log scale) and test accuracy per round, mean over seeds, band min–max."""
    from experiments.plots import plt, save

    fig, axes = plt.subplots(1, 2, figsize=(10, 3.6))
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
    save(fig, path)


def main(argv: Any = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("results", nargs="?", type=Path, default=RESULTS)
    parser.add_argument("--figures", type=Path, help="folder for fedproxvr_<study>.png")
    opts = parser.parse_args(argv)
    runs = results.load(opts.results)
    print("\n\n".join(tables(runs)))
    if opts.figures:
        for study, groups in studies(runs).items():
            if study in PLOTTED:
                plot(groups, study, opts.figures / f"fedproxvr_{study}.png")


if __name__ == "__main__":
    main()
