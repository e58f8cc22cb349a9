"""Markdown tables of a grid.py result file: final test accuracy per attack, curves, wall times.

    python experiments/raga/report.py experiments/raga/results/mlp_r20.jsonl [--plot curves.png]
    python experiments/raga/report.py results/mlp_r200.jsonl results/mlp_r200_signflip.jsonl \
        --plot signflip.png --plot-attack signflip       # several files: one set of runs
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict

NAMES = {"raga": "RAGA", "fedavg": "FedAvg", "rfa": "RFA", "byrdsaga": "Byrd-SAGA"}
ORDER = ["raga", "fedavg", "rfa", "byrdsaga"]


def load(paths: list[str]) -> list[dict]:
    """The runs of one or more result files (JSON lines)."""
    records = []
    for path in paths:
        with open(path) as f:
            records += [json.loads(line) for line in f if line.strip()]
    return records


def accuracy_table(records: list[dict], attack: str) -> str:
    """Rows: methods; columns: Byzantine data fractions (0 is the shared attack-free run)."""
    cells: dict[tuple[str, float], dict] = {}
    achieved: dict[float, tuple[float, int]] = {0.0: (0.0, 0)}
    for r in records:
        if r["attack"] == attack or r["attack"] == "none":
            cells[(r["method"], r["fraction"])] = r
            achieved[r["fraction"]] = (r["achieved_fraction"], r["num_byzantine"])
    fractions = sorted({f for _, f in cells})
    head = "| method | " + " | ".join(f"{f:g} ({achieved[f][0]:.3f}, {achieved[f][1]} cl.)" for f in fractions) + " |"
    lines = [head, "|---" * (len(fractions) + 1) + "|"]
    for m in ORDER:
        row = [f"{cells[(m, f)]['test_acc']:.4f}" if (m, f) in cells else "–" for f in fractions]
        lines.append(f"| {NAMES[m]} | " + " | ".join(row) + " |")
    return "\n".join(lines)


def curve_table(records: list[dict], attack: str, fractions: list[float]) -> str:
    """Test accuracy by round for each method at the given fractions."""
    lines = []
    for r in records:
        if r["fraction"] in fractions and (r["attack"] == attack or r["attack"] == "none"):
            pts = " ".join(f"{acc:.3f}" for _, acc, _ in r["curve"])
            rounds = ",".join(str(t) for t, _, _ in r["curve"])
            row = f"| {r['fraction']:g} | {NAMES[r['method']]} | {pts} |"
            lines.append((r["fraction"], ORDER.index(r["method"]), row, rounds))
    lines.sort()
    rounds = lines[0][3] if lines else ""
    return "\n".join([f"| fraction | method | test accuracy at rounds {rounds} |", "|---|---|---|"] + [line[2] for line in lines])


def wall_table(records: list[dict]) -> str:
    by_method: dict[str, list[float]] = defaultdict(list)
    for r in records:
        by_method[r["method"]].append(r["wall_s"])
    lines = ["| method | runs | wall s (min / mean / max) |", "|---|---|---|"]
    for m in ORDER:
        w = by_method.get(m, [])
        if w:
            lines.append(f"| {NAMES[m]} | {len(w)} | {min(w):.0f} / {sum(w) / len(w):.0f} / {max(w):.0f} |")
    total = sum(r["wall_s"] for r in records)
    lines.append(f"| all | {len(records)} | total {total / 60:.1f} min |")
    return "\n".join(lines)


def plot_curves(records: list[dict], attack: str, path: str) -> None:
    """Test accuracy per round, one panel per Byzantine fraction, one line per method."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = [r for r in records if r["attack"] in (attack, "none")]
    fractions = sorted({r["fraction"] for r in runs})
    fig, axes = plt.subplots(1, len(fractions), figsize=(3.2 * len(fractions), 3.0), sharey=True, squeeze=False)
    for ax, f in zip(axes[0], fractions):
        for r in sorted((r for r in runs if r["fraction"] == f), key=lambda r: ORDER.index(r["method"])):
            ax.plot([t for t, _, _ in r["curve"]], [a for _, a, _ in r["curve"]], label=NAMES[r["method"]])
        ax.set_title(f"{attack}, fraction {f:g}")
        ax.set_xlabel("round")
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("test accuracy")
    axes[0][0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("results", nargs="+", help="result files of grid.py (read together)")
    parser.add_argument("--plot", help="write the curves of --plot-attack to this PNG")
    parser.add_argument("--plot-attack", default="gaussian")
    args = parser.parse_args()
    records = load(args.results)
    attacks = [a for a in ("gaussian", "signflip", "alie", "ipm", "labelflip") if any(r["attack"] == a for r in records)]
    for attack in attacks:
        print(f"### {attack}\n\n{accuracy_table(records, attack)}\n")
    for attack in attacks:
        print(f"### curves ({attack})\n\n{curve_table(records, attack, [0.0, 0.2, 0.4])}\n")
    print(f"### wall times\n\n{wall_table(records)}\n")
    if args.plot:
        plot_curves(records, args.plot_attack, args.plot)


if __name__ == "__main__":
    main()
