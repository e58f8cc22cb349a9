"""The tables and figure of ``docs/results/raga.md``, from the runs in its result file.

    python -m experiments.raga.report [docs/results/raga.json] [--figures docs/results]

Accuracies in %; spreads are ``mean ± sample std (ddof = 1) (min–max)`` over seeds.

* the control experiment (``control``), per setting (RAGA; FedAvg and RFA at server lr 1/K and 1):
  the final test accuracy, the test accuracy at the best validation, the best and the mean of the
  last five evaluations; each setting's difference to RAGA, paired by seed, with its 95 %
  confidence interval, and how far its curve strays from RAGA's (the largest and the mean absolute
  gap over the evaluated rounds, per seed); the test accuracy at a few rounds;
* the tuning (``screen``): each method's validation score (the mean validation accuracy over the
  last five evaluations, rounds 160-200) at each of its six step sizes, the chosen one in bold;
* the decoupling test (``decouple``): RAGA at the baselines' constant local rate with its own server
  step and with K times it, beside the screening runs of RFA and FedAvg at that rate and of RAGA
  at its chosen schedule: validation score and final test accuracy (seed 0);
* the paper's Table II layout (``table``, ``table200``): per attack, each method's final test
  accuracy and its test accuracy at the best validation, attack-free and at each Byzantine
  fraction, over seeds, the best method of each column in bold; and RAGA against the best of its
  paper's baselines in each attack and fraction, paired by seed, with its 95 % confidence interval;
  and the decoupled RAGA minus RFA (the same step size) and minus RAGA (the same median), paired by
  seed: what RAGA's rule costs; each comparison by the final test accuracy and again by the test
  accuracy at the best validation;
* the solver test (``solver``): RAGA, RFA and the decoupled RAGA under its attacks at their own and
  at the other median's Weiszfeld iterations (the own from ``table200``), final test accuracy and at the best
  validation, per seed.

``--figures DIR`` draws ``raga_control.png`` (test accuracy per round, mean over seeds, band: min–max).
"""

from __future__ import annotations

import argparse
import inspect
from pathlib import Path
from typing import Any, Callable, Optional

import numpy as np

from experiments import results
from experiments.raga.plan import (ATTACKS, CONTROL, CONTROL_SERVER_LR, DECOUPLE, DECOUPLE_LR, FRACTIONS, LOCAL_STEPS,
                                   ROUNDS, SCREEN_ROUNDS, SEEDS, SOLVER_CASES, SOLVER_ITERS, SOLVER_SEEDS, STEPS,
                                   TABLES, run, screen_score, table_settings, tuned)
from fl_lightning.algorithms.raga import RAGA, paper_learning_rate
from fl_lightning.algorithms.rfa import RFA
from experiments.seed_stats import Groups, best_validation, final, fmt, paired, series
from experiments.seed_stats import curve_table as seed_curve_table

RESULTS = Path(__file__).resolve().parents[2] / "docs" / "results" / "raga.json"
NAMES = {"raga": "RAGA", "fedavg": "FedAvg", "rfa": "RFA", "byrdsaga": "Byrd-SAGA"}
CURVE_ROUNDS = (10, 50, 100, 200, 400, 600, 800, 1000)


#: the first column's header of a comparison by the test accuracy at the best validation (a final one's: ``attack``)
AT_BEST_VAL = "attack (test accuracy at the best validation)"


def at_best_validation(group: list[results.Run]) -> np.ndarray:
    """Per seed, the test accuracy at the evaluation with the highest validation accuracy."""
    return best_validation(group)[0]


def label(method: str, server_lr: Optional[float]) -> str:
    """``FedAvg, server lr 1/K``: a control setting's row label."""
    if server_lr is None:
        return f"{NAMES[method]} (server step η^t)"
    return f"{NAMES[method]}, server lr " + ("1/K" if server_lr == CONTROL_SERVER_LR else f"{server_lr:g}")


def control_groups(runs: list[results.Run]) -> Groups:
    """Row label -> the control runs of a setting (seed order), in :data:`CONTROL` order."""
    groups: Groups = {}
    for method, server_lr in CONTROL:
        group = sorted(results.select(runs, study="control", method=method, server_lr=server_lr),
                       key=lambda r: r["params"]["seed"])
        if group:
            groups[label(method, server_lr)] = group
    return groups


def accuracy_table(groups: Groups) -> str:
    """Final, best-validation, best and last-5 test accuracy of each setting."""
    lines = ["| setting (attack-free, 1000 rounds) | seeds | final | at best val | best | last 5 |", "|---|---|---|---|---|---|"]
    for name, group in groups.items():
        _, acc = series(group, "test_acc")
        lines.append(f"| {name} | {len(group)} | {fmt(final(group), 100)} | {fmt(best_validation(group)[0], 100)} | "
                     f"{fmt(acc.max(axis=1), 100)} | {fmt(acc[:, -5:].mean(axis=1), 100)} |")
    return "\n".join(lines)


def curve_gaps(a: list[results.Run], b: list[results.Run]) -> tuple[np.ndarray, np.ndarray]:
    """Per seed both groups ran: the largest and the mean ``|acc_a - acc_b|`` over the evaluated rounds."""
    seeds = sorted({r["params"]["seed"] for r in a} & {r["params"]["seed"] for r in b})
    a, b = ([r for r in g if r["params"]["seed"] in seeds] for g in (a, b))
    gap = np.abs(series(a, "test_acc")[1] - series(b, "test_acc")[1])
    return gap.max(axis=1), gap.mean(axis=1)


def differences_table(groups: Groups) -> str:
    """Each setting minus RAGA, paired by seed (points, 95 % CI), and the gap between the curves."""
    reference_label, reference = next(iter(groups.items()))
    lines = [f"| minus {reference_label} (points) | final: mean ± std [95 % CI] | at best val: mean ± std [95 % CI] | "
             "largest gap over the rounds | mean gap over the rounds |", "|---|---|---|---|---|"]
    for name, group in list(groups.items())[1:]:
        largest, mean = curve_gaps(group, reference)
        lines.append(f"| {name} | {paired(group, reference, final)} | "
                     f"{paired(group, reference, at_best_validation)} | {fmt(largest, 100)} | {fmt(mean, 100)} |")
    return "\n".join(lines)


def screen_table(runs: list[results.Run]) -> str:
    """Validation score (%) of every method at each of its six step sizes (columns: the step's rank,
    0.01 to 3.16 as the first rate), the chosen one in bold."""
    by_name = {r["name"]: r for r in runs}
    chosen = tuned(runs)
    lines = ["| method: its step size (first rate) | " + " | ".join(f"step {k + 1}" for k in range(6)) + " |",
             "|---" * 7 + "|"]
    for method, steps in STEPS.items():
        cells = []
        for step in steps:
            found = by_name.get(run("screen", method, 0, step=step, rounds=SCREEN_ROUNDS).name)
            rate = f"{step:g}" if method != "raga" else f"×{step:g} ({step * paper_learning_rate(1, ROUNDS):.3g})"
            cell = f"{rate}: {100 * screen_score(found):.2f}" if found else f"{rate}: –"
            cells.append(f"**{cell}**" if chosen.get(method) == step else cell)
        what = "RAGA: lr_scale" if method == "raga" else f"{NAMES[method]}: " + ("γ" if method == "byrdsaga" else "constant lr")
        lines.append(f"| {what} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def decouple_table(runs: list[results.Run]) -> str:
    """The decoupling test's runs and the screening runs they are compared with (seed 0, 200 rounds)."""
    by_name = {r["name"]: r for r in runs}
    rows = [(f"RAGA, constant local rate {DECOUPLE_LR:g}, server step "
             + ("= that rate (its rule)" if server_lr is None else f"{server_lr:g} (K times it)"),
             run("decouple", "raga", 0, server_lr, step=DECOUPLE_LR, rounds=SCREEN_ROUNDS, constant=True).name)
            for server_lr in DECOUPLE]
    rows += [(f"{NAMES[m]}, constant local rate {DECOUPLE_LR:g}, server lr 1 (step about {LOCAL_STEPS * DECOUPLE_LR:g})",
              run("screen", m, 0, step=DECOUPLE_LR, rounds=SCREEN_ROUNDS).name) for m in ("rfa", "fedavg")]
    chosen = tuned(runs).get("raga")
    if chosen is not None:
        rows.append((f"RAGA, its schedule ×{chosen:g} (the tuning's choice)",
                     run("screen", "raga", 0, step=chosen, rounds=SCREEN_ROUNDS).name))
    lines = ["| run (attack-free, 200 rounds, seed 0) | validation score | final test acc |", "|---|---|---|"]
    for name, key in rows:
        found = by_name.get(key)
        cells = (f"{100 * screen_score(found):.2f}", f"{100 * results.last(found, 'test_acc'):.2f}") if found else ("–", "–")
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def setting_label(method: str, server_lr: Optional[float], constant: bool) -> str:
    """A Table II row's method: its name, the decoupled RAGA with its rates."""
    if constant:
        return f"RAGA, decoupled (local {DECOUPLE_LR:g}, server {server_lr:g})"
    return NAMES[method]


def not_diverged(group: list[results.Run]) -> list[results.Run]:
    """The runs of ``group`` that did not diverge (those that did are counted, not averaged)."""
    return [r for r in group if "diverged" not in r]


def grid_cell(group: list[results.Run], measure: Callable[[list[results.Run]], np.ndarray]) -> tuple[str, float]:
    """A grid cell, ``mean ± std`` (%) over the seeds that did not diverge, with their count where
    it is not the plan's and the seeds that diverged; and the mean, to find each column's best
    (nan: every seed diverged, or no run yet: ``–``)."""
    if not group:
        return "–", float("nan")
    done = not_diverged(group)
    gone = [str(r["params"]["seed"]) for r in group if "diverged" in r]
    diverged = f"seed{'s' if len(gone) > 1 else ''} {', '.join(gone)} diverged"
    if not done:
        return diverged, float("nan")
    values = 100 * measure(done)
    notes = ([] if len(done) == len(SEEDS) else [f"{len(done)} seed{'s' if len(done) > 1 else ''}"]) + \
        ([diverged] if gone else [])
    spread = values.std(ddof=1) if len(values) > 1 else 0.0
    return f"{values.mean():.2f} ± {spread:.2f}" + (f" ({'; '.join(notes)})" if notes else ""), float(values.mean())


Cells = dict[tuple, dict[tuple[str, float], list[results.Run]]]


def study_cells(runs: list[results.Run], study: str) -> Cells:
    """The runs of ``study`` (``table``, ``table200``) that ran all their rounds (one a sweep's time
    limit stopped goes on from its checkpoint in the next sweep), by setting ``(method, server_lr,
    constant)``, the paper's methods before the decoupled RAGA, and by case ``(attack, fraction)``,
    attack-free as ``("none", 0.0)``; each cell's runs in seed order."""
    cells: Cells = {}
    for r in results.select(runs, study=study):
        if "stopped" not in r:
            p = r["params"]
            key = (p["method"], p["server_lr"], p.get("constant", False))
            cells.setdefault(key, {}).setdefault((p["attack"], p["fraction"]), []).append(r)
    for by_case in cells.values():
        for group in by_case.values():
            group.sort(key=lambda r: r["params"]["seed"])
    return dict(sorted(cells.items(), key=lambda item: item[0][2]))


def grid_table(runs: list[results.Run], study: str, measure: Callable[[list[results.Run]], np.ndarray],
               what: str) -> str:
    """The paper's Table II layout for ``study`` (``table``, ``table200``): per attack, each method's
    ``measure`` (final test accuracy, or at the best validation) attack-free and at each Byzantine
    fraction, mean ± sample std over seeds; the best method's mean of each column in bold."""
    cells = study_cells(runs, study)
    rounds = results.select(runs, study=study)[0]["params"]["rounds"]
    head = " | ".join(["attack-free"] + [f"{f:g}" for f in FRACTIONS])
    lines = [f"| attack | method ({what}, {rounds} rounds) | {head} |", "|---|---|" + "---|" * (len(FRACTIONS) + 1)]
    for attack in ATTACKS:
        row_cells = {key: [grid_cell(by_case.get(case, []), measure)
                           for case in [("none", 0.0)] + [(attack, f) for f in FRACTIONS]] for key, by_case in cells.items()}
        best = [np.nanmax([row_cells[key][c][1] for key in cells])
                if any(not np.isnan(row_cells[key][c][1]) for key in cells) else None for c in range(len(FRACTIONS) + 1)]
        for key in cells:
            row = [f"**{text}**" if best[c] is not None and value == best[c] else text
                   for c, (text, value) in enumerate(row_cells[key])]
            lines.append(f"| {attack} | {setting_label(*key)} | " + " | ".join(row) + " |")
    return "\n".join(lines)


def against_table(runs: list[results.Run], study: str,
                  measure: Callable[[list[results.Run]], np.ndarray] = final, head: str = "attack") -> str:
    """RAGA (its paper's schedule) against the best of the baselines its paper compares with (FedAvg,
    RFA, Byrd-SAGA) at each attack and Byzantine fraction of ``study``: that baseline (the highest mean
    ``measure`` over the seeds both ran) and RAGA's ``measure`` minus its, in points, paired by seed:
    ``mean ± std [95 % CI]`` (``–``: no seed that both ran). Picking the baseline on the same seeds
    favours it: an interval above 0 is the stronger for it.

    Args:
        runs: the result file's runs.
        study: ``table`` or ``table200``.
        measure: per seed, the figure compared: the final test accuracy (:func:`final`) or the test
            accuracy at the best validation (:func:`at_best_validation`).
        head: the first column's header, which names the measure where it is not the final one.
    """
    cells = study_cells(runs, study)
    raga = cells.get(("raga", None, False), {})
    baselines = [key for key in cells if key[0] != "raga"]
    lines = [f"| {head} | " + " | ".join(f"{f:g}" for f in FRACTIONS) + " |", "|---|" + "---|" * len(FRACTIONS)]
    for attack in ATTACKS:
        row = []
        for case in [(attack, f) for f in FRACTIONS]:
            ours = not_diverged(raga.get(case, []))
            seeds = {r["params"]["seed"] for r in ours}
            scored = []
            for key in baselines:
                theirs = [r for r in not_diverged(cells[key].get(case, [])) if r["params"]["seed"] in seeds]
                if theirs:
                    scored.append((measure(theirs).mean(), key, theirs))
            if not scored:
                row.append("–")
                continue
            _, key, theirs = max(scored, key=lambda item: item[0])
            row.append(f"{NAMES[key[0]]}: {paired(ours, theirs, measure)}")
        lines.append(f"| {attack} | " + " | ".join(row) + " |")
    return "\n".join(lines)


#: the Table II settings (``(method, server_lr, constant)``, as :func:`study_cells` keys them)
#: whose differences show what RAGA's rule costs: the decoupled RAGA against RFA (the same step
#: size, K times the local rate; the medians' solvers differ) and against RAGA (the same median;
#: the step differs)
DECOUPLED, RFA_KEY, RAGA_KEY = ("raga", DECOUPLE[1], True), ("rfa", None, False), ("raga", None, False)


def difference_table(runs: list[results.Run], study: str, ours: tuple, theirs: tuple,
                     measure: Callable[[list[results.Run]], np.ndarray] = final, head: str = "attack") -> str:
    """``ours`` minus ``theirs`` (settings keyed as :func:`study_cells` keys them) in ``study``: the
    final test accuracy or another ``measure`` (:func:`against_table`'s; ``head`` names it), in
    points, paired by seed, ``mean ± std [95 % CI]``, attack-free and under each attack at each
    Byzantine fraction (``–``: no seed that both ran without diverging)."""
    cells = study_cells(runs, study)
    a, b = cells.get(ours, {}), cells.get(theirs, {})

    def cell(case: tuple[str, float]) -> str:
        mine, other = not_diverged(a.get(case, [])), not_diverged(b.get(case, []))
        common = {r["params"]["seed"] for r in mine} & {r["params"]["seed"] for r in other}
        return paired(mine, other, measure) if common else "–"

    lines = [f"| {head} | attack-free | " + " | ".join(f"{f:g}" for f in FRACTIONS) + " |",
             "|---|---|" + "---|" * len(FRACTIONS), f"| none | {cell(('none', 0.0))} |" + " |" * len(FRACTIONS)]
    lines += [f"| {attack} | | " + " | ".join(cell((attack, f)) for f in FRACTIONS) + " |" for attack in ATTACKS]
    return "\n".join(lines)


def solver_table(runs: list[results.Run]) -> str:
    """The solver test: RAGA, RFA and the decoupled RAGA in each of its cases at their own Weiszfeld
    iterations (the ``table200`` run) and at the other median's (the ``solver`` run), final test
    accuracy and the test accuracy at the best validation (%), per seed (``–``: not run yet)."""
    by_name = {r["name"]: r for r in runs}
    chosen = tuned(runs)
    own = {name: inspect.signature(cls).parameters["max_iter"].default for name, cls in (("raga", RAGA), ("rfa", RFA))}
    seeds = " | ".join(f"seed {s}" for s in SOLVER_SEEDS)
    lines = [f"| case (200 rounds) | method | Weiszfeld iterations | final: {seeds} | at best val: {seeds} |",
             "|---|---|---|" + "---|" * (2 * len(SOLVER_SEEDS))]
    for attack, fraction in SOLVER_CASES:
        for method, server_lr, step, constant in table_settings(chosen):
            if method not in SOLVER_ITERS:
                continue
            for iters in (own[method], SOLVER_ITERS[method]):
                study, max_iter = ("table200", None) if iters == own[method] else ("solver", iters)
                found = [by_name.get(run(study, method, seed, server_lr, attack, fraction, SCREEN_ROUNDS, step=step,
                                         constant=constant, max_iter=max_iter).name) for seed in SOLVER_SEEDS]
                found = [r if r is not None and "stopped" not in r else None for r in found]
                finals = [f"{100 * results.last(r, 'test_acc'):.2f}" if r else "–" for r in found]
                at_best = [f"{100 * best_validation([r])[0][0]:.2f}" if r else "–" for r in found]
                lines.append(f"| {attack} {fraction:g} | {setting_label(method, server_lr, constant)} | "
                             f"{iters}{' (its own)' if iters == own[method] else ''} | " + " | ".join(finals + at_best) + " |")
    return "\n".join(lines)


def tables(runs: list[results.Run]) -> list[str]:
    """Every table of the document, in its order."""
    out = []
    groups = control_groups(runs)
    if groups:
        out += [accuracy_table(groups), differences_table(groups),
                seed_curve_table(groups, "test_acc", 100, rounds=CURVE_ROUNDS, digits=2)]
    if results.select(runs, study="screen"):
        out.append(screen_table(runs))
    if results.select(runs, study="decouple"):
        out.append(decouple_table(runs))
    for study in TABLES:
        if results.select(runs, study=study):
            out += [grid_table(runs, study, final, "final test accuracy, %"),
                    grid_table(runs, study, at_best_validation, "test accuracy at the best validation, %"),
                    against_table(runs, study), against_table(runs, study, at_best_validation, AT_BEST_VAL)]
            out += [difference_table(runs, study, DECOUPLED, theirs, measure, head) for theirs in (RFA_KEY, RAGA_KEY)
                    for measure, head in ((final, "attack"), (at_best_validation, AT_BEST_VAL))]
    if results.select(runs, study="solver"):
        out.append(solver_table(runs))
    return out


def plot(groups: Groups, path: Path) -> None:
    """Test accuracy per evaluated round of each control setting, mean over seeds, band min–max."""
    from experiments.plots import plt, save

    fig, ax = plt.subplots(figsize=(6.4, 4))
    for k, (name, group) in enumerate(groups.items()):
        rounds, acc = series(group, "test_acc")
        style = dict(color="black", linestyle="--", zorder=3) if k == 0 else {}  # RAGA, drawn over what matches it
        line, = ax.plot(rounds, 100 * acc.mean(0), label=f"{name} ({len(group)} seeds)", **style)
        ax.fill_between(rounds, 100 * acc.min(0), 100 * acc.max(0), color=line.get_color(), alpha=0.2)
    ax.set(xlabel="round", ylabel="global test accuracy (%)", title="MNIST MLP, 50 clients, attack-free: the server step")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    ax.set_ylim(85, 100)
    fig.tight_layout()
    save(fig, path)


def main(argv: Any = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("results", nargs="?", type=Path, default=RESULTS)
    parser.add_argument("--figures", type=Path, help="folder for raga_control.png")
    opts = parser.parse_args(argv)
    runs = results.load(opts.results)
    print("\n\n".join(tables(runs)))
    if opts.figures and control_groups(runs):
        plot(control_groups(runs), opts.figures / "raga_control.png")


if __name__ == "__main__":
    main()
