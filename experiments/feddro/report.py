"""The tables and the figure of ``docs/results/feddro.md``, from the runs in its result file.

    python -m experiments.feddro.report [docs/results/feddro.json] [--figure docs/results/feddro_mnist_st.png]

Rows are the variants (algorithm, lr, lambda, beta) of the 50-round runs with I = 8; a variant's
figures are the mean (± population std) over its seeds. The I sweep is FedDRO at lambda 5,
beta 0.5, seed 0, read at 25 model-averaging rounds.
"""

from __future__ import annotations

import argparse
from collections import defaultdict
from pathlib import Path
from typing import Optional

import numpy as np

from experiments import results

RESULTS = Path(__file__).resolve().parents[2] / "docs" / "results" / "feddro.json"
METRICS = [("class/acc", "acc"), ("class/acc_worst_class", "worst-class"), ("class/acc_minority", "minority (0-4)"),
           ("class/acc_majority", "majority (5-9)")]
NAMES = {"fedavg": "FedAvg (CE)", "compfedavg": "vanilla comp. FedAvg (Alg. 1 case I)", "feddro": "FedDRO"}
ORDER = {"fedavg": 0, "compfedavg": 1, "feddro": 2}
Variant = tuple[str, float, Optional[float], Optional[float]]


def variant(run: results.Run) -> Variant:
    """(algorithm, lr, beta, lambda): the hyper-parameters a row of the tables stands for."""
    p = run["params"]
    return p["algorithm"], p["lr"], p["beta"], p["lam"]


def label(v: Variant) -> str:
    alg, lr, beta, lam = v
    extra = [f"lr {lr}"] + ([f"λ {lam}"] if lam is not None else []) + ([f"β {beta}"] if beta is not None else [])
    return f"{NAMES[alg]} ({', '.join(extra)})"


def main_runs(runs: list[results.Run], local_steps: int = 8) -> dict[Variant, list[results.Run]]:
    """The 50-round runs at ``local_steps``, grouped by variant, in a stable order."""
    groups = defaultdict(list)
    for r in runs:
        if r["params"]["local_steps"] == local_steps and r["params"]["rounds"] == 50:
            groups[variant(r)].append(r)
    order = sorted(groups, key=lambda v: (ORDER[v[0]], -v[1], str(v)))
    return {v: sorted(groups[v], key=lambda r: r["params"]["seed"]) for v in order}


def fmt(values: list[float]) -> str:
    v = np.array(values)
    return f"{v.mean():.4f} ± {v.std():.4f}" if len(v) > 1 else f"{v[0]:.4f}"


def main_table(runs: list[results.Run]) -> str:
    lines = ["| algorithm | seeds | " + " | ".join(n for _, n in METRICS) + " | worst-class per seed | wall s/run |",
             "|---|---|" + "---|" * len(METRICS) + "---|---|"]
    for v, rs in main_runs(runs).items():
        last = [r["history"][-1] for r in rs]
        cells = [fmt([h[k] for h in last]) for k, _ in METRICS]
        per_seed = ", ".join(f"{h['class/acc_worst_class']:.3f}" for h in last)
        lines.append(f"| {label(v)} | {','.join(str(r['params']['seed']) for r in rs)} | " + " | ".join(cells)
                     + f" | {per_seed} | {np.mean([r['wall_s'] for r in rs]):.0f} |")
    return "\n".join(lines)


def curve_table(runs: list[results.Run], key: str, local_steps: int = 8) -> str:
    curves: dict[Variant, dict[int, list[float]]] = defaultdict(lambda: defaultdict(list))
    for v, rs in main_runs(runs, local_steps).items():
        for r in rs:
            for h in r["history"]:
                curves[v][h["round"]].append(h[key])
    rounds = sorted({rd for c in curves.values() for rd in c})
    lines = ["| algorithm | " + " | ".join(f"r{rd} ({rd * local_steps} st.)" for rd in rounds) + " |",
             "|---|" + "---|" * len(rounds)]
    for v, c in curves.items():
        seeds = len(next(iter(c.values())))
        lines.append(f"| {label(v)} [{seeds} seed{'s' if seeds > 1 else ''}] | " + " | ".join(
            f"{np.mean(c[rd]):.3f}" if rd in c else "" for rd in rounds) + " |")
    return "\n".join(lines)


def sweep_table(runs: list[results.Run], setting: Variant, at_round: int = 25) -> str:
    rows = {}
    for r in runs:
        if variant(r) == setting and r["params"]["seed"] == 0:
            i = r["params"]["local_steps"]
            rows[i] = (r, r["wall_s"] if r["params"]["rounds"] == at_round else None)
    lines = [f"| I | local steps at round {at_round} | " + " | ".join(n for _, n in METRICS) + " | wall s |",
             "|---|---|" + "---|" * len(METRICS) + "---|"]
    for i in sorted(rows):
        run, wall = rows[i]
        cells = " | ".join(f"{results.at_round(run, k, at_round):.4f}" for k, _ in METRICS)
        lines.append(f"| {i} | {i * at_round} | {cells} | {wall if wall is not None else '(from the 50-round run)'} |")
    return "\n".join(lines)


def tables(runs: list[results.Run]) -> list[str]:
    """Every table of the document, in order."""
    return [main_table(runs), *(curve_table(runs, key) for key, _ in METRICS[:3]),
            sweep_table(runs, ("feddro", 0.05, 0.5, 5.0))]


def plot(runs: list[results.Run], path: Path, local_steps: int = 8) -> None:
    """Mean over seeds (band: min..max) of overall, worst-class and minority accuracy per local step."""
    from experiments.plots import plt, save

    fig, axes = plt.subplots(1, 3, figsize=(12, 3.6))
    for ax, (key, name) in zip(axes, METRICS[:3]):
        for v, rs in main_runs(runs, local_steps).items():
            if len(rs) < 2:
                continue
            steps = [h["round"] * local_steps for h in rs[0]["history"]]
            values = np.array([[h[key] for h in r["history"]] for r in rs])
            ax.plot(steps, values.mean(0), label=label(v))
            ax.fill_between(steps, values.min(0), values.max(0), alpha=0.2)
        ax.set_xlabel(f"local steps (I = {local_steps})")
        ax.set_title(f"MNIST-ST test {name}")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=6)
    fig.tight_layout()
    save(fig, path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("results", nargs="?", type=Path, default=RESULTS)
    parser.add_argument("--figure", type=Path, help="write the curves to this PNG")
    opts = parser.parse_args()
    runs = results.load(opts.results)
    print("\n\n".join(tables(runs)))
    if opts.figure:
        plot(runs, opts.figure)


if __name__ == "__main__":
    main()
