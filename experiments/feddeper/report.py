"""The tables and figures of ``docs/results/feddeper.md``, from the runs in its result file.

    python -m experiments.feddeper.report [docs/results/feddeper.json] [--figures docs/results]

Accuracies in %. The paper's numbers (Table I (a)) and the specification's digits calibration
(``../shared/specs/feddeper.md`` section 6) are constants here, beside ours. ``--figures DIR``
draws ``feddeper_m5.png`` and ``feddeper_m10.png``: the global model's test accuracy per
evaluated round of each method.
"""

from __future__ import annotations

import argparse
import shlex
from pathlib import Path
from typing import Any, Sequence

from experiments import results
from experiments.feddeper.plan import SWEEP_M5

RESULTS = Path(__file__).resolve().parents[2] / "docs" / "results" / "feddeper.json"
TEST_IMAGES = 10_000
METHODS = {"feddeper": "FedDeper (ρ 0.03, λ 0.5, τ 10)", "feddeper_star": "FedDeper\\* (τ 5)", "scaffold": "SCAFFOLD",
           "fedavg": "FedAvg", "fedprox": "FedProx (μ = 1)"}
SHORT = {"feddeper": "FedDeper", "feddeper_star": "FedDeper\\*", "scaffold": "SCAFFOLD", "fedavg": "FedAvg", "fedprox": "FedProx"}
#: Table I (a), MNIST MLP, n = 10: m -> method -> accuracy (%)
PAPER = {5: {"feddeper": 94.92, "feddeper_star": 94.67, "scaffold": 94.52, "fedavg": 89.19, "fedprox": 86.19},
         10: {"feddeper": 95.28, "feddeper_star": 95.23, "scaffold": 95.32, "fedavg": 89.86, "fedprox": 88.77}}
#: the rows whose final accuracy the document sets in bold
BOLD = ("feddeper", "scaffold", "fedavg")
EVERY_50 = tuple(range(50, 501, 50))
#: m = 5 sweep: (row, run); the override column is the run's arguments in the plan
SWEEP_ROWS = [("ρ 0.01", "rho0.01_500"), ("ρ 0.05 (stopped at round 195)", "rho0.05_500"),
              ("ρ 0.1 (150-round probe)", "rho0.1"), ("λ 1.0", "lam1.0_500"), ("λ 0.3", "lam0.3_500"),
              ("batch 32 (the first 150 rounds were a probe of the first session)", "batch32_500"),
              ("FedAvg, batch 32 (its base: FedAvg in the m = 5 table)", "fedavg_batch32_500"),
              ("pixels in [0, 1], not standardized", "raw_pixels_500"), ("FedAvg, pixels in [0, 1]", "fedavg_raw_pixels_500"),
              ("independent batches for y and v", "indep_500"), ("Gauss-Seidel order (y uses v_{j+1})", "gauss_seidel_500"),
              ("seed 1", "seed1_500")]
SWEEP_M10_ROWS = [("FedDeper base (ρ 0.03, λ 0.5)", "m10/feddeper_500"), ("ρ 0.05", "m10/sweep_rho0.05"),
                  ("ρ 0.1 (stopped at round 478)", "m10/sweep_rho0.1"), ("ρ 0.1, λ 1.0", "m10/sweep_rho0.1_lam1.0"),
                  ("FedAvg", "m10/fedavg_500"), ("SCAFFOLD", "m10/scaffold_500")]
DIGITS_ROUNDS = (100, 150, 300, 500)
#: the specification's independent implementation on the digits: (method, seed) -> accuracy (%) at DIGITS_ROUNDS
SPEC_DIGITS_M5 = {("feddeper", 0): (83.6, 93.3, 93.6, 96.2), ("feddeper", 1): (73.1, 86.9, 94.7, 95.8),
                  ("feddeper_star", 0): (73.8, 89.6, 90.4, 94.4), ("feddeper_star", 1): (76.4, 82.2, 90.7, 94.9),
                  ("scaffold", 0): (91.1, 93.3, 95.6, 97.1), ("scaffold", 1): (90.7, 93.3, 95.8, 96.4),
                  ("fedavg", 0): (50.4, 69.1, 67.1, 84.7), ("fedavg", 1): (43.1, 61.6, 63.3, 86.2),
                  ("fedprox", 0): (50.4, 68.0, 67.1, 83.8)}
#: m = 10, seed 0, rounds 150 and 500
SPEC_DIGITS_M10 = {"feddeper": (79.1, 93.1), "scaffold": (92.9, 97.1), "fedavg": (82.7, 88.7), "fedprox": (82.4, 88.0)}


def pct(value: float) -> str:
    return f"{100 * value:.2f}"


def signed(value: float) -> str:
    """``+0.98`` / ``−2.47`` (a minus sign, as the document writes it)."""
    return f"{value:+.2f}".replace("-", "−")


def accuracy_at(run: results.Run, rounds: Sequence[int]) -> list[str]:
    """Test accuracy at ``rounds`` (``–`` where the run had stopped)."""
    measured = dict(zip(*results.series(run, "test_acc")))
    return [pct(measured[r]) if r in measured else "–" for r in rounds]


def mean_worst(run: results.Run, prefix: str, model: str) -> str:
    """``mean / worst`` over the clients of ``model``'s accuracy on the ``prefix`` local test sets, at the end."""
    return f"{pct(results.last(run, f'{prefix}/{model}_acc_mean'))} / {pct(results.last(run, f'{prefix}/{model}_acc_worst'))}"


def main_table(runs: dict[str, results.Run], m: int) -> str:
    """Final, best and last-5 mean test accuracy of the five methods beside the paper's."""
    head = "| method | paper | ours: final | best | last 5 | ours − paper (final) |"
    rule = "|---|---|---|---|---|---|"
    if m == 10:
        head, rule = head + " local test, personal models (mean / worst) | wall time |", rule + "---|---|"
    lines = [head, rule]
    for method, label in METHODS.items():
        run = runs[f"m{m}/{method}_500"]
        accs = results.series(run, "test_acc")[1]
        final = pct(accs[-1])
        cells = [label, f"{PAPER[m][method]:.2f}", f"**{final}**" if method in BOLD else final, pct(max(accs)),
                 pct(sum(accs[-5:]) / 5), signed(100 * accs[-1] - PAPER[m][method])]
        if m == 10:
            personal = mean_worst(run, "local", "personal") if method.startswith("feddeper") else ""
            cells += [personal, f"{run['wall_s']:.0f} s"]
        lines.append("| " + " | ".join(cells).replace("|  |", "| |") + " |")
    return "\n".join(lines)


def along_the_way(runs: dict[str, results.Run]) -> str:
    lines = ["| method | " + " | ".join(map(str, EVERY_50)) + " |", "|---" * (len(EVERY_50) + 1) + "|"]
    for method in METHODS:
        lines.append(f"| {SHORT[method]} | " + " | ".join(accuracy_at(runs[f"m5/{method}_500"], EVERY_50)) + " |")
    return "\n".join(lines)


def personal_table(runs: dict[str, results.Run]) -> str:
    """Mean / worst local-test accuracy of personal and global models at round 500 (m = 5)."""
    feddeper, star, fedavg = runs["m5/feddeper_500"], runs["m5/feddeper_star_500"], runs["m5/fedavg_500"]
    return "\n".join([
        "| model | local test set | + 1 class | + 3 classes |", "|---|---|---|---|",
        f"| FedDeper personal models v_i | {mean_worst(feddeper, 'local', 'personal')} | "
        f"{mean_worst(feddeper, 'local+1', 'personal')} | {mean_worst(feddeper, 'local+3', 'personal')} |",
        f"| FedDeper global model x | {mean_worst(feddeper, 'local', 'global')} | | |",
        f"| FedDeper\\* personal models | {mean_worst(star, 'local', 'personal')} | | |",
        f"| FedAvg global model | {mean_worst(fedavg, 'local', 'global')} | | |",
    ])


def first_excluded(run: results.Run) -> int:
    """The first round with client updates left out for NaN/Inf."""
    return results.series(run, "round/excluded")[0][0]


def sweep_table(runs: dict[str, results.Run]) -> str:
    """The m = 5 sweep: one change per run, test accuracy every 50 rounds."""
    lines = ["| run | override | " + " | ".join(map(str, EVERY_50)) + " |", "|---|---|" + "---|" * len(EVERY_50),
             "| base (ρ 0.03, λ 0.5, batch 64, same batch, Jacobi order) | – | "
             + " | ".join(accuracy_at(runs["m5/feddeper_500"], EVERY_50)) + " |"]
    for label, name in SWEEP_ROWS:
        method, overrides = SWEEP_M5[name]
        run = runs[f"m5/sweep_{name}"]
        if name == "lam0.3_500":
            label += f" (NaN updates from round {first_excluded(run)})"
        args = (["--config", f"configs/feddeper/methods/{method}.yaml"] if method != "feddeper" else [])
        if "--trainer.max_epochs" in overrides:  # a probe: the row's header says its length
            i = overrides.index("--trainer.max_epochs")
            overrides = overrides[:i] + overrides[i + 2:]
        args += overrides
        lines.append(f"| {label} | `{shlex.join(args)}` | " + " | ".join(accuracy_at(run, EVERY_50)) + " |")
    return "\n".join(lines)


def sweep_m10_table(runs: dict[str, results.Run]) -> str:
    lines = ["| run (m = 10) | " + " | ".join(map(str, EVERY_50)) + " |", "|---" * (len(EVERY_50) + 1) + "|"]
    for label, name in SWEEP_M10_ROWS:
        lines.append(f"| {label} | " + " | ".join(accuracy_at(runs[name], EVERY_50)) + " |")
    return "\n".join(lines)


def digits_tables(runs: dict[str, results.Run]) -> list[str]:
    """Ours beside the specification's implementation on the digits stand-in, m = 5 and m = 10."""
    def ours(name: str, rounds: Sequence[int]) -> list[float]:
        return [100 * results.at_round(runs[name], "test_acc", r) for r in rounds] if name in runs else []

    def cell(values: Sequence[float]) -> str:
        return " / ".join(f"{v:.1f}" for v in values[:-1]) + f" / **{values[-1]:.1f}**" if values else "–"

    rounds = " / ".join(map(str, DIGITS_ROUNDS))
    m5 = ["| method | round | spec, seed 0 | ours, seed 0 | spec, seed 1 | ours, seed 1 |", "|---|---|---|---|---|---|"]
    for method in METHODS:
        cells = [cell(v) for s in (0, 1)
                 for v in (SPEC_DIGITS_M5.get((method, s), ()), ours(f"digits_m5/{method}_s{s}", DIGITS_ROUNDS))]
        m5.append(f"| {SHORT[method]} | {rounds} | " + " | ".join(cells) + " |")
    m10 = ["| method | spec, round 150 / 500 | ours, round 150 / 500 |", "|---|---|---|"]
    for method, spec in SPEC_DIGITS_M10.items():
        label = "FedDeper (ρ 0.03, λ 0.5)" if method == "feddeper" else SHORT[method]
        m10.append(f"| {label} | {cell(spec)} | {cell(ours(f'digits_m10/{method}_s0', (150, 500)))} |")
    return ["\n".join(m5), "\n".join(m10)]


def twin_table(runs: dict[str, results.Run]) -> str:
    """The base run before and after the engine change: accuracy at a few rounds, largest difference."""
    before, after = runs["m5/feddeper_500"], runs["m5/sweep_twin_500"]
    rounds = (50, 100, 250, 500)
    a, b = (dict(zip(*results.series(r, "test_acc"))) for r in (before, after))
    diff = max(abs(a[r] - b[r]) for r in a)
    evaluations = len(a)
    last = accuracy_at(after, rounds)
    return "\n".join([
        "| round | " + " | ".join(map(str, rounds)) + f" | largest difference over the {evaluations} evaluations |",
        "|---" * (len(rounds) + 2) + "|",
        "| before (`feddeper_500`) | " + " | ".join(accuracy_at(before, rounds)) + " | |",
        "| after (`sweep_twin_500`) | " + " | ".join(last[:-1]) + f" | **{last[-1]}** | "
        f"{100 * diff:.2f} points ({round(diff * TEST_IMAGES)} test images) |",
    ])


def tables(records: list[results.Run]) -> list[str]:
    """Every table of the document, in order."""
    runs = {r["name"]: r for r in records}
    return [main_table(runs, 5), along_the_way(runs), personal_table(runs), main_table(runs, 10), sweep_table(runs),
            sweep_m10_table(runs), *digits_tables(runs), twin_table(runs)]


def plot(runs: dict[str, results.Run], m: int, path: Path) -> None:
    """Global test accuracy per evaluated round of the five methods (500 rounds)."""
    from experiments.plots import plt, save

    fig, ax = plt.subplots(figsize=(6, 3.8))
    for method in METHODS:
        rounds, accs = results.series(runs[f"m{m}/{method}_500"], "test_acc")
        ax.plot(rounds, [100 * a for a in accs], label=SHORT[method].replace("\\", ""))
    ax.set(xlabel="round", ylabel="global test accuracy (%)", title=f"MNIST MLP, n = 10, m = {m}")
    ax.grid(alpha=0.3)
    ax.legend()
    ax.set_ylim(bottom=0)
    fig.tight_layout()
    save(fig, path)


def main(argv: Any = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("results", nargs="?", type=Path, default=RESULTS)
    parser.add_argument("--figures", type=Path, help="folder for feddeper_m5.png and feddeper_m10.png")
    opts = parser.parse_args(argv)
    records = results.load(opts.results)
    print("\n\n".join(tables(records)))
    if opts.figures:
        runs = {r["name"]: r for r in records}
        for m in (5, 10):
            plot(runs, m, opts.figures / f"feddeper_m{m}.png")


if __name__ == "__main__":
    main()
