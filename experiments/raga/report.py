"""The tables and figures of ``docs/results/raga.md``, from the runs in its result file.

    python -m experiments.raga.report [docs/results/raga.json] [--figures docs/results]

A run is (model, rounds, method, attack, Byzantine fraction); the attack-free run of a method
(attack ``none``, fraction 0) is the first column of every attack's table. ``--figures DIR``
draws the document's figures, ``raga_<model>_r<rounds>_<attack>.png``.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any, Optional, Sequence

from experiments import results

RESULTS = Path(__file__).resolve().parents[2] / "docs" / "results" / "raga.json"
NAMES = {"raga": "RAGA", "fedavg": "FedAvg", "rfa": "RFA", "byrdsaga": "Byrd-SAGA"}
FRACTIONS = (0.0, 0.1, 0.2, 0.3, 0.4)
#: the figures of the document: (model, rounds, attack)
FIGURES = (("mlp", 200, "gaussian"), ("lenet", 60, "gaussian"), ("mlp", 1000, "gaussian"), ("mlp", 200, "signflip"),
           ("mlp", 200, "alie"))


class Grid:
    """The runs of one model and length, looked up by method, attack and fraction."""

    def __init__(self, runs: list[results.Run], model: str, rounds: int) -> None:
        self.runs = {(r["params"]["method"], r["params"]["attack"], r["params"]["fraction"]): r
                     for r in results.select(runs, model=model, rounds=rounds)}

    def get(self, method: str, attack: str, fraction: float) -> Optional[results.Run]:
        return self.runs.get((method, "none" if fraction == 0 else attack, fraction))

    def accuracy(self, method: str, attack: str, fraction: float, round_number: Optional[int] = None) -> float:
        run = self.get(method, attack, fraction)
        return results.last(run, "test_acc") if round_number is None else results.at_round(run, "test_acc", round_number)

    def column(self, attack: str, fraction: float) -> str:
        """A fraction as a column head: the target, and the share and number of Byzantine clients achieved."""
        if fraction == 0:
            return "0"
        summary = next(r for (m, a, f), r in self.runs.items() if a == attack and f == fraction)["summary"]
        return f"{fraction:g} ({summary['achieved_fraction']:.3f}, {summary['num_byzantine']} cl.)"


def final_table(grid: Grid, attack: str, fractions: Sequence[float] = FRACTIONS, drop: bool = False) -> str:
    """Final test accuracy: rows methods, columns fractions (and the drop from 0 to the last fraction)."""
    head = "| method | " + " | ".join(grid.column(attack, f) for f in fractions) + " |"
    rule = "|---" * (len(fractions) + 1) + "|"
    if drop:
        head, rule = head + f" drop 0 -> {fractions[-1]:g} |", rule + "---|"
    lines = [head, rule]
    for m in NAMES:
        cells = [f"{grid.accuracy(m, attack, f):.4f}" for f in fractions]
        if drop:
            cells.append(f"{grid.accuracy(m, attack, 0.0) - grid.accuracy(m, attack, fractions[-1]):.3f}")
        lines.append(f"| {NAMES[m]} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def curve_grid(grid: Grid, attack: str, fractions: Sequence[float], rounds: Sequence[int]) -> str:
    """Test accuracy at ``rounds``: rows fractions, columns methods, the rounds side by side in a cell."""
    lines = ["| fraction | " + " | ".join(NAMES.values()) + " |", "|---" * (len(NAMES) + 1) + "|"]
    for f in fractions:
        cells = [" ".join(f"{grid.accuracy(m, attack, f, t):.3f}" for t in rounds) for m in NAMES]
        lines.append(f"| {f:g} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def curve_rows(grid: Grid, attack: str, fractions: Sequence[float], rounds: Sequence[int]) -> str:
    """Test accuracy at ``rounds``: one row per fraction and method."""
    lines = ["| fraction | method | " + " | ".join(map(str, rounds)) + " |", "|---|---|" + "---|" * len(rounds)]
    for f in fractions:
        for m in NAMES:
            lines.append(f"| {f:g} | {NAMES[m]} | " + " | ".join(f"{grid.accuracy(m, attack, f, t):.3f}" for t in rounds) + " |")
    return "\n".join(lines)


def method_rows(grid: Grid, attack: str, fraction: float, rounds: Sequence[int], methods: Sequence[str] = tuple(NAMES)) -> str:
    """Test accuracy at ``rounds`` at one fraction: one row per method."""
    lines = ["| method | " + " | ".join(map(str, rounds)) + " |", "|---" * (len(rounds) + 1) + "|"]
    for m in methods:
        lines.append(f"| {NAMES[m]} | " + " | ".join(f"{grid.accuracy(m, attack, fraction, t):.3f}" for t in rounds) + " |")
    return "\n".join(lines)


def longer_check(grid: Grid, rounds: Sequence[int]) -> str:
    """RAGA and FedAvg at 0 and 0.4 under the Gaussian attack, with the wall time of each run."""
    lines = ["| method, Byzantine fraction | " + " | ".join(map(str, rounds)) + " | wall s |",
             "|---" * (len(rounds) + 2) + "|"]
    for m in ("raga", "fedavg"):
        for f in (0.0, 0.4):
            run = grid.get(m, "gaussian", f)
            where = "0" if f == 0 else f"0.4 ({run['summary']['achieved_fraction']:.3f}, {run['summary']['num_byzantine']} clients)"
            accs = " | ".join(f"{results.at_round(run, 'test_acc', t):.3f}" for t in rounds)
            lines.append(f"| {NAMES[m]}, {where} | {accs} | {run['wall_s']:.0f} |")
    return "\n".join(lines)


def wall_table(grid: Grid) -> str:
    """Wall time per run of each method (min / mean / max) and in total."""
    rounds = {r["params"]["rounds"] for r in grid.runs.values()}.pop()
    lines = [f"| method | runs | wall s per {rounds}-round run (min / mean / max) |", "|---|---|---|"]
    for m in NAMES:
        w = [r["wall_s"] for (method, _, _), r in grid.runs.items() if method == m]
        lines.append(f"| {NAMES[m]} | {len(w)} | {min(w):.0f} / {sum(w) / len(w):.0f} / {max(w):.0f} |")
    total = sum(r["wall_s"] for r in grid.runs.values())
    lines.append(f"| all | {len(grid.runs)} | {total / 60:.1f} min in total |")
    return "\n".join(lines)


def tables(runs: list[results.Run]) -> list[str]:
    """Every table of the document, in order."""
    r20, r60, r200 = Grid(runs, "mlp", 20), Grid(runs, "mlp", 60), Grid(runs, "mlp", 200)
    lenet, r1000 = Grid(runs, "lenet", 60), Grid(runs, "mlp", 1000)
    return [
        final_table(r20, "gaussian"), final_table(r20, "signflip"), final_table(r20, "alie"),
        curve_grid(r20, "gaussian", (0.0, 0.2, 0.4), (5, 10, 15, 20)), wall_table(r20),
        longer_check(r60, (10, 20, 30, 40, 50, 60)),
        final_table(r200, "gaussian", drop=True), curve_grid(r200, "gaussian", FRACTIONS, (50, 100, 150, 200)),
        final_table(lenet, "gaussian", (0.0, 0.4), drop=True), curve_rows(lenet, "gaussian", (0.0, 0.4), (10, 20, 30, 40, 50, 60)),
        final_table(r1000, "gaussian", (0.0, 0.4), drop=True),
        curve_rows(r1000, "gaussian", (0.0, 0.4), (100, 200, 400, 600, 800, 1000)),
        final_table(r200, "signflip"), method_rows(r200, "signflip", 0.4, (10, 20, 50, 80, 100, 150, 200)),
        final_table(r200, "alie"),
    ]


def plot(grid: Grid, attack: str, title: str, path: Path) -> None:
    """Test accuracy per round, one panel per Byzantine fraction, one line per method."""
    from experiments.plots import plt, save

    fractions = sorted({f for (_, a, f) in grid.runs if a in (attack, "none")})
    fig, axes = plt.subplots(1, len(fractions), figsize=(2.6 * len(fractions), 2.6), sharey=True, squeeze=False)
    for ax, f in zip(axes[0], fractions):
        for m in NAMES:
            run = grid.get(m, attack, f)
            if run is not None:
                ax.plot(*results.series(run, "test_acc"), label=NAMES[m])
        ax.set_title(f"{title}, {attack}, fraction {f:g}", fontsize=8)
        ax.set_xlabel("round")
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("test accuracy")
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    save(fig, path)


def main(argv: Any = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("results", nargs="?", type=Path, default=RESULTS)
    parser.add_argument("--figures", type=Path, help="folder for the document's figures")
    opts = parser.parse_args(argv)
    runs = results.load(opts.results)
    print("\n\n".join(tables(runs)))
    if opts.figures:
        for model, rounds, attack in FIGURES:
            plot(Grid(runs, model, rounds), attack, model.upper() if model == "mlp" else "LeNet",
                 opts.figures / f"raga_{model}_r{rounds}_{attack}.png")


if __name__ == "__main__":
    main()
