"""Tables (markdown) and curves (PNG) of the MNIST-ST runs in results.jsonl.

    python experiments/feddro/summarize.py [--results experiments/feddro/results.jsonl]
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path

import numpy as np

METRICS = [("class/acc", "acc"), ("class/acc_worst_class", "worst-class"), ("class/acc_minority", "minority (0-4)"),
           ("class/acc_majority", "majority (5-9)")]
NAMES = {"fedavg": "FedAvg (CE)", "compfedavg": "vanilla comp. FedAvg (Alg. 1 case I)", "feddro": "FedDRO"}


def load(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def variant(r: dict) -> tuple:
    """(algorithm, lr, beta, lam): the hyper-parameters a row of the tables stands for."""
    alg = r["algorithm"]
    return (alg, r["lr"], r["beta"] if alg == "feddro" else None, r["lam"] if alg != "fedavg" else None)


def label(v: tuple) -> str:
    alg, lr, beta, lam = v
    extra = [f"lr {lr}"] + ([f"λ {lam}"] if lam is not None else []) + ([f"β {beta}"] if beta is not None else [])
    return f"{NAMES[alg]} ({', '.join(extra)})"


ORDER = {"fedavg": 0, "compfedavg": 1, "feddro": 2}


def main_runs(runs: list[dict], local_steps: int = 8) -> dict[tuple, list[dict]]:
    """The 50-round runs at ``local_steps``, grouped by variant, in a stable order."""
    groups = defaultdict(list)
    for r in runs:
        if r["local_steps"] == local_steps and r["rounds"] == 50:
            groups[variant(r)].append(r)
    return {v: sorted(groups[v], key=lambda r: r["seed"]) for v in sorted(groups, key=lambda v: (ORDER[v[0]], -v[1], str(v)))}


def fmt(values: list[float]) -> str:
    v = np.array(values)
    return f"{v.mean():.4f} ± {v.std():.4f}" if len(v) > 1 else f"{v[0]:.4f}"


def main_table(runs: list[dict], local_steps: int = 8) -> str:
    lines = ["| algorithm | seeds | " + " | ".join(n for _, n in METRICS) + " | worst-class per seed | wall s/run |",
             "|---|---|" + "---|" * len(METRICS) + "---|---|"]
    for v, rs in main_runs(runs, local_steps).items():
        last = [r["history"][-1] for r in rs]
        cells = [fmt([h[k] for h in last]) for k, _ in METRICS]
        per_seed = ", ".join(f"{h['class/acc_worst_class']:.3f}" for h in last)
        wall = np.mean([r["wall_s"] for r in rs])
        lines.append(f"| {label(v)} | {','.join(str(r['seed']) for r in rs)} | " + " | ".join(cells)
                     + f" | {per_seed} | {wall:.0f} |")
    return "\n".join(lines)


def curve_table(runs: list[dict], key: str, local_steps: int = 8) -> str:
    curves = defaultdict(lambda: defaultdict(list))
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


def sweep_table(runs: list[dict], setting: tuple, at_round: int = 25) -> str:
    rows = {}
    for r in runs:
        if variant(r) == setting and r["seed"] == 0:
            for h in r["history"]:
                if h["round"] == at_round:
                    rows[r["local_steps"]] = (h, r["wall_s"] if r["rounds"] == at_round else None)
    lines = [f"| I | local steps at round {at_round} | " + " | ".join(n for _, n in METRICS) + " | wall s |",
             "|---|---|" + "---|" * len(METRICS) + "---|"]
    for i in sorted(rows):
        h, wall = rows[i]
        lines.append(f"| {i} | {i * at_round} | " + " | ".join(f"{h[k]:.4f}" for k, _ in METRICS)
                     + f" | {wall if wall is not None else '(from the 50-round run)'} |")
    return "\n".join(lines)


def plot(runs: list[dict], path: Path, local_steps: int = 8) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    for ax, (key, name) in zip(axes, METRICS[:3]):
        for v, rs in main_runs(runs, local_steps).items():
            if len(rs) < 2:
                continue
            steps = [h["steps"] for h in rs[0]["history"]]
            values = np.array([[h[key] for h in r["history"]] for r in rs])
            ax.plot(steps, values.mean(0), label=label(v))
            ax.fill_between(steps, values.min(0), values.max(0), alpha=0.2)
        ax.set_xlabel("local steps (I = 8)")
        ax.set_title(f"MNIST-ST test {name}")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=90)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--results", default="experiments/feddro/results.jsonl")
    p.add_argument("--plot", default="experiments/feddro/mnist_st_curves.png")
    p.add_argument("--sweep-lr", type=float, default=0.05, help="the FedDRO setting of the I sweep")
    p.add_argument("--sweep-beta", type=float, default=0.5)
    p.add_argument("--sweep-lam", type=float, default=2.0)
    args = p.parse_args()
    runs = load(Path(args.results))
    print("## Final (round 50, 400 local steps, I = 8), mean ± std over seeds\n")
    print(main_table(runs))
    for key, name in METRICS[:3]:
        print(f"\n## Curve: test {name} (mean over seeds)\n")
        print(curve_table(runs, key))
    setting = ("feddro", args.sweep_lr, args.sweep_beta, args.sweep_lam)
    print(f"\n## I sweep of {label(setting)}, seed 0, at 25 model-averaging rounds\n")
    print(sweep_table(runs, setting))
    plot(runs, Path(args.plot))
    print(f"\n(curves: {args.plot})")


if __name__ == "__main__":
    main()
