"""The tables and figures of ``docs/results/feddeper.md``, from the runs in its result file.

    python -m experiments.feddeper.report [docs/results/feddeper.json] [--figures docs/results]

Accuracies in %; the paper's numbers (Table I (a)) are constants here, beside ours.

* per method, the screening (``screen``): the validation accuracy of every setting of its grid
  (mean of the evaluations at rounds 160-200) for each cell, the chosen one in bold
  (:func:`experiments.feddeper.plan.tuned`);
* FedDeper's rate search (``screen_lr``), per cell: the validation accuracy at each rate, rho
  scaled with it; and the same setting at larger rates with rho kept (``screen_lr_fixed``);
* per cell, the ``confirm`` stage: each method's shortlisted settings, their scores on seeds 0-2
  and the mean the choice is made on;
* per cell (m = 5, m = 10), over seeds: the final test accuracy, the test accuracy at the best
  validation, the best and the mean of the last five evaluations, of each method at its tuned
  setting (``table``), at the setting seed 0 alone chose where that differs, at the next lower rate
  where the tuned one diverged (``table_lower``), FedDeper* with one of rho, lambda at the paper's
  value where its tuned runs diverged (``star_factors``) and at the paper's setting (``paper``); the differences
  between FedDeper and each baseline, paired by seed, with 95 % confidence intervals; the test
  accuracy every 50 rounds; the personal and global models on the clients' local test sets after
  the last round;
* Table I's other MNIST cells (``cnn``, ``n100``): each method at the paper's setting and at the MLP
  cell's tuned one, over the seeds that finished (the ones a time limit stopped named with their
  round), FedDeper minus each baseline paired by seed; FedDeper in the n = 100 cells with its
  personal models started otherwise (:data:`~experiments.feddeper.plan.STALENESS`) beside Algorithm 1;
* the isolation variants of FedDeper (``isolation``) beside it, with their paired differences;
* the digits stand-in (``digits``, ``experiments/feddeper/digits_calibration.py``) beside the
  specification's independent implementation, whose numbers are constants here.

Spreads are ``mean ± sample std (ddof = 1) (min–max)`` over seeds. ``--figures DIR`` draws
``feddeper_m<m>.png`` (test accuracy per round, mean over seeds, band: min–max).
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any, Optional

import numpy as np

from experiments import results
from experiments.feddeper.plan import (CELLS, FIXED_RHO_LRS, GRIDS, ISOLATION, ISOLATION_SETTING, PAPER, PAPER_LR,
                                      RESULTS, STALENESS, TRANSFER, confirmed, first_stage, grid, lr_stage,
                                      screen_score, screened, settings_name, tuned)
from experiments.seed_stats import Groups, best_validation, final, fmt, paired, series
from experiments.seed_stats import curve_table as seed_curve_table

LABELS = {"feddeper": "FedDeper", "feddeper_star": "FedDeper\\*", "scaffold": "SCAFFOLD", "fedavg": "FedAvg",
          "fedprox": "FedProx"}
#: Table I (a), MNIST MLP, n = 10: m -> method -> accuracy (%)
PAPER_TABLE = {5: {"feddeper": 94.92, "feddeper_star": 94.67, "scaffold": 94.52, "fedavg": 89.19, "fedprox": 86.19},
               10: {"feddeper": 95.28, "feddeper_star": 95.23, "scaffold": 95.32, "fedavg": 89.86, "fedprox": 88.77}}
#: Table I's other MNIST cells, those the ``cnn`` and ``n100`` studies run: (study, m) -> method -> accuracy (%)
PAPER_TRANSFER = {
    ("cnn", 5): {"feddeper": 96.13, "feddeper_star": 95.10, "scaffold": 94.20, "fedavg": 90.34, "fedprox": 86.83},
    ("n100", 5): {"feddeper": 92.17, "feddeper_star": 92.08, "scaffold": 93.04, "fedavg": 87.64, "fedprox": 82.94},
    ("n100", 10): {"feddeper": 93.70, "feddeper_star": 93.42, "scaffold": 92.86, "fedavg": 87.88, "fedprox": 84.02}}
CELL_NAMES = {"cnn": "(a) MNIST CNN, n = 10", "n100": "(b) MNIST MLP, n = 100"}
VARIANTS = {"gauss_seidel": "Gauss-Seidel order: the y-step pulls toward 2x − v_{j+1}",
            "reset_personal": "v restarted from x every round (v_0 = x)"}
SYMBOLS = {"rho": "ρ", "lam": "λ", "batch": "B", "lr": "lr", "mu": "μ"}
EVERY_50 = tuple(range(50, 501, 50))
DIGITS_ROUNDS = (100, 150, 300, 500)
#: the specification's independent implementation on the digits (section 6): (method, seed) ->
#: test accuracy (%) at DIGITS_ROUNDS, m = 5
SPEC_DIGITS_M5 = {("feddeper", 0): (83.6, 93.3, 93.6, 96.2), ("feddeper", 1): (73.1, 86.9, 94.7, 95.8),
                  ("feddeper_star", 0): (73.8, 89.6, 90.4, 94.4), ("feddeper_star", 1): (76.4, 82.2, 90.7, 94.9),
                  ("scaffold", 0): (91.1, 93.3, 95.6, 97.1), ("scaffold", 1): (90.7, 93.3, 95.8, 96.4),
                  ("fedavg", 0): (50.4, 69.1, 67.1, 84.7), ("fedavg", 1): (43.1, 61.6, 63.3, 86.2),
                  ("fedprox", 0): (50.4, 68.0, 67.1, 83.8)}
#: m = 10, seed 0, rounds 150 and 500
SPEC_DIGITS_M10 = {"feddeper": (79.1, 93.1), "scaffold": (92.9, 97.1), "fedavg": (82.7, 88.7), "fedprox": (82.4, 88.0)}
#: the models and local test sets of the personalization table: (row, metric prefix, model)
PERSONAL_ROWS = (("personal models v_i", "local", "personal"), ("personal models v_i, + 1 class", "local+1", "personal"),
                 ("personal models v_i, + 3 classes", "local+3", "personal"), ("global model x", "local", "global"))


def setting(params: dict[str, Any], method: str) -> str:
    """``ρ 0.03, λ 0.5, B 64``: ``method``'s tuned settings in ``params``."""
    base = "fedprox" if method == "fedprox" else "feddeper" if method.startswith("feddeper") else "fedavg"
    keys = (["lr"] if base == "feddeper" else []) + list(GRIDS[base])
    text = ", ".join(f"{SYMBOLS[k]} {params[k]}" for k in keys)
    return text + (", τ 5" if method == "feddeper_star" else "")


def finished_runs(group: list[results.Run]) -> list[results.Run]:
    """The runs of ``group`` that ran all their rounds (none a time limit stopped), in seed order."""
    return sorted((r for r in group if "stopped" not in r), key=lambda r: r["params"]["seed"])


def spread_cells(group: list[results.Run]) -> list[str]:
    """Table cells over the seeds of ``group`` (%): final, at the best validation and last-5 test accuracy."""
    _, acc = series(group, "test_acc")
    return [fmt(acc[:, -1], 100), fmt(best_validation(group)[0], 100), fmt(acc[:, -5:].mean(axis=1), 100)]


def paired_cells(a: list[results.Run], b: list[results.Run]) -> list[str]:
    """Table cells of ``a`` minus ``b`` paired by seed (points): the seeds both ran, the final and the
    best-validation difference with their 95 % confidence intervals; [] when they share no seed."""
    seeds = len({r["params"]["seed"] for r in a} & {r["params"]["seed"] for r in b})
    return [str(seeds), paired(a, b, final), paired(a, b, lambda g: best_validation(g)[0])] if seeds else []


def with_rows(table: str) -> list[str]:
    """``[table]`` if it has a row below its header, else []."""
    return [table] if table.count("\n") > 1 else []


def screen_table(runs: list[results.Run], method: str) -> str:
    """Validation accuracy (%) of every setting of ``method``'s grid, per screened cell and batch
    size (the mean of the evaluations the choice is made on), the chosen setting in bold."""
    names = [k for k in GRIDS[method] if k != "batch"]
    batches = GRIDS[method]["batch"]
    scores = {(r["params"]["m"], settings_name({k: r["params"][k] for k in GRIDS[method]})): screen_score(r)
              for r in results.select(runs, study="screen", method=method)}
    chosen = first_stage(runs)
    cells = [m for m in CELLS if results.select(runs, study="screen", m=m)] or list(CELLS)
    columns = [(m, b) for m in cells for b in batches]
    paper = tuple((k, PAPER[method][k]) for k in names)
    lines = [f"| {LABELS[method]}: " + ", ".join(SYMBOLS[k] for k in names) + " | " +
             " | ".join(f"m = {m}, B {b}" for m, b in columns) + " |", "|---" * (len(columns) + 1) + "|"]
    for point in dict.fromkeys(tuple((k, s[k]) for k in names) for s in grid(method)):
        cells = []
        for m, b in columns:
            settings = {**dict(point), "batch": b}
            key = (m, settings_name({k: settings[k] for k in GRIDS[method]}))
            cell = f"{100 * scores[key]:.2f}" if key in scores else "–"
            cells.append(f"**{cell}**" if chosen.get((m, method)) == {k: settings[k] for k in GRIDS[method]} else cell)
        label = ", ".join(str(v) for _, v in point) + (f" (the paper's, with B {PAPER[method]['batch']})" if point == paper else "")
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def lr_stage_table(runs: list[results.Run], m: int) -> str:
    """FedDeper's second stage in the cell: validation accuracy (%) at each rate, rho scaled with it,
    beside the first stage's choice at lr 0.01; FedDeper's setting in bold."""
    first = first_stage(runs)[m, "feddeper"]
    chosen = tuned(runs).get((m, "feddeper"))
    lines = [f"| m = {m}: lr | ρ (λ {first['lam']}, B {first['batch']}) | validation accuracy (%) |", "|---|---|---|"]
    for settings in [dict(lr=PAPER_LR, **first), *lr_stage(first)]:
        study = "screen" if settings["lr"] == PAPER_LR else "screen_lr"
        named = {k: v for k, v in settings.items() if study == "screen_lr" or k != "lr"}
        run = (screened(runs, study, m, "feddeper", [named]) or [None])[0]
        cell = f"{100 * screen_score(run):.2f}" if run else "–"
        lines.append(f"| {settings['lr']} | {settings['rho']} | {f'**{cell}**' if settings == chosen else cell} |")
    return "\n".join(lines)


def fixed_rho_table(runs: list[results.Run], m: int) -> str:
    """FedDeper at its first stage's setting with larger rates, rho kept: validation accuracy (%)."""
    first = first_stage(runs)[m, "feddeper"]
    lines = [f"| m = {m}: lr (ρ {first['rho']}, λ {first['lam']}, B {first['batch']}) | validation accuracy (%) |",
             "|---|---|"]
    for lr in (PAPER_LR, *FIXED_RHO_LRS):
        study = "screen" if lr == PAPER_LR else "screen_lr_fixed"
        settings = first if lr == PAPER_LR else dict(lr=lr, **first)
        run = (screened(runs, study, m, "feddeper", [settings]) or [None])[0]
        lines.append(f"| {lr} | {f'{100 * screen_score(run):.2f}' if run else '–'} |")
    return "\n".join(lines)


#: the ``table`` runs at the setting seed 0's screening alone chose, before the ``confirm`` stage
#: (a pseudo-study of :func:`cell_groups`; ``"table"`` there means the runs at the confirmed setting)
SEED0 = "table_seed0"


def cell_groups(runs: list[results.Run], m: int, study: str) -> Groups:
    """Method -> its runs of ``study`` in the cell (seed order), in the paper's row order. For
    ``"table"`` only the runs at the method's tuned setting (:func:`~experiments.feddeper.plan.tuned`:
    none while its confirm runs are missing); ``SEED0``: the table runs at any other setting."""
    chosen = tuned(runs) if study in ("table", SEED0) else {}
    groups: Groups = {}
    for method in LABELS:
        group = sorted(results.select(runs, study="table" if study == SEED0 else study, m=m, method=method),
                       key=lambda r: r["params"]["seed"])
        if study in ("table", SEED0):
            setting = chosen.get((m, "feddeper" if method == "feddeper_star" else method))
            group = [r for r in group if (setting is not None and setting.items() <= r["params"].items()) == (study == "table")]
        if group:
            groups[method] = group
    return groups


def factor_groups(runs: list[results.Run], m: int) -> dict[str, list[results.Run]]:
    """FedDeper*'s ``star_factors`` runs in the cell: a label naming the setting -> its runs (seed order)."""
    groups: dict[str, list[results.Run]] = {}
    for r in sorted(results.select(runs, study="star_factors", m=m), key=lambda r: r["params"]["seed"]):
        groups.setdefault(f"{LABELS['feddeper_star']}, {setting(r['params'], 'feddeper_star')}", []).append(r)
    return groups


def confirm_table(runs: list[results.Run], m: int) -> str:
    """The ``confirm`` stage in the cell: each method's shortlisted settings, their validation
    score (%) on seeds 0-2 and its mean; the chosen setting in bold."""
    lines = [f"| m = {m}: method | setting | seed 0 (screening) | seed 1 | seed 2 | mean |", "|---|---|---|---|---|---|"]
    chosen = tuned(runs)
    for method in GRIDS:
        scored = confirmed(runs, m, method)
        for settings, scores in scored or []:
            text = ", ".join(f"{SYMBOLS[k]} {v}" for k, v in settings.items())
            mean = f"{100 * sum(scores) / len(scores):.2f}"
            lines.append(f"| {LABELS[method]} | {text} | " + " | ".join(f"{100 * v:.2f}" for v in scores) +
                         f" | {f'**{mean}**' if chosen.get((m, method)) == settings else mean} |")
    return "\n".join(lines)


def accuracy_table(runs: list[results.Run], m: int) -> str:
    """Final, best-validation, best and last-5 test accuracy of each method, tuned and at the paper's setting."""
    lines = ["| method | setting | paper | seeds | final | at best val | best | last 5 | final − paper |",
             "|---|---|---|---|---|---|---|---|---|"]
    for study, suffix in (("table", ""), (SEED0, " (seed 0's choice)"), ("table_lower", ", next lower rate"),
                          ("table_fixed_rho", ", rate searched with ρ kept"), ("paper", " (paper's setting)")):
        rows = [(f"{LABELS[method]}{suffix}", method, group) for method, group in cell_groups(runs, m, study).items()]
        if study == "table":  # FedDeper*'s single-factor runs right below its diverged tuned row
            rows += [(f"{LABELS['feddeper_star']}, one of ρ, λ at the paper's value", "feddeper_star", group)
                     for group in factor_groups(runs, m).values()]
        for label, method, group in rows:
            _, acc = series(group, "test_acc")
            at_best, _ = best_validation(group)
            gap = 100 * acc[:, -1].mean() - PAPER_TABLE[m][method]
            lines.append(f"| {label} | {setting(group[0]['params'], method)} | {PAPER_TABLE[m][method]:.2f} | "
                         f"{len(group)} | {fmt(acc[:, -1], 100)} | {fmt(at_best, 100)} | {fmt(acc.max(axis=1), 100)} | "
                         f"{fmt(acc[:, -5:].mean(axis=1), 100)} | {gap:+.2f} |")
    return "\n".join(lines)


def differences_table(runs: list[results.Run], m: int) -> str:
    """FedDeper (tuned, and at the rate searched with rho kept) minus each tuned baseline (and at the
    next lower rate), and FedDeper at the paper's setting minus each baseline at the paper's, paired
    by seed, in points, with 95 % confidence intervals."""
    groups = cell_groups(runs, m, "table")
    ours = [("FedDeper", groups.get("feddeper"))]
    ours += [("FedDeper, ρ kept", g) for g in cell_groups(runs, m, "table_fixed_rho").values()]
    theirs = [(LABELS[k], g) for k, g in groups.items() if k in ("scaffold", "fedavg", "fedprox")]
    theirs += [(f"{LABELS[k]}, next lower rate", g) for k, g in cell_groups(runs, m, "table_lower").items()]
    pairs = [(label, a, against, b) for label, a in ours if a is not None for against, b in theirs]
    paper = cell_groups(runs, m, "paper")
    if "feddeper" in paper:  # the paper's claim at the paper's own settings
        pairs += [("FedDeper (paper's setting)", paper["feddeper"], f"{LABELS[k]} (paper's setting)", g)
                  for k, g in paper.items() if k in ("scaffold", "fedavg", "fedprox")]
    lines = ["| difference (points) | seeds | final: mean ± std [95 % CI] | at best val: mean ± std [95 % CI] |",
             "|---|---|---|---|"]
    lines += [f"| {label} − {against} | " + " | ".join(paired_cells(a, b)) + " |" for label, a, against, b in pairs]
    return "\n".join(lines)


def curve_table(runs: list[results.Run], m: int) -> str:
    """Test accuracy (%, mean ± sample std over seeds) every 50 rounds, tuned methods (and FedDeper
    at the rate searched with rho kept)."""
    groups = {LABELS[k]: g for k, g in cell_groups(runs, m, "table").items()}
    groups.update({f"{LABELS[k]}, next lower rate": g for k, g in cell_groups(runs, m, "table_lower").items()})
    groups.update({f"{LABELS[k]}, ρ kept": g for k, g in cell_groups(runs, m, "table_fixed_rho").items()})
    groups.update(factor_groups(runs, m))
    return seed_curve_table(groups, "test_acc", 100, rounds=EVERY_50, digits=2)


def personal_table(runs: list[results.Run], m: int) -> str:
    """Mean and worst client accuracy on the local test sets after the last round, mean over seeds."""
    lines = ["| method | model, local test set | mean over clients | worst client |", "|---|---|---|---|"]
    for method, group in cell_groups(runs, m, "table").items():
        for row, prefix, model in PERSONAL_ROWS:
            key = f"{prefix}/{model}_acc_mean"
            if key not in group[0]["history"][-1]:
                continue
            mean = np.array([results.last(r, key) for r in group])
            worst = np.array([results.last(r, f"{prefix}/{model}_acc_worst") for r in group])
            lines.append(f"| {LABELS[method]} | {row} | {fmt(mean, 100)} | {fmt(worst, 100)} |")
    return "\n".join(lines)


def transfer_groups(runs: list[results.Run], study: str, m: int) -> dict[tuple[str, bool], list[results.Run]]:
    """(method, at the paper's setting) -> its runs of the transfer ``study`` (``cnn``, ``n100``) in
    the cell (seed order), the paper's setting before the transferred one, in the paper's row order."""
    groups: dict[tuple[str, bool], list[results.Run]] = {}
    for method in LABELS:
        for at_paper in (True, False):
            group = [r for r in results.select(runs, study=study, m=m, method=method)
                     if (PAPER[method].items() <= r["params"].items()) == at_paper]
            if group:
                groups[method, at_paper] = sorted(group, key=lambda r: r["params"]["seed"])
    return groups


def stopped_cell(group: list[results.Run]) -> str:
    """The seeds of ``group`` that a sweep's time limit stopped: the round each reached and its test
    accuracy (%) there; "" when none was."""
    return "; ".join(f"seed {r['params']['seed']}: round {r['history'][-1]['round']}, "
                     f"{100 * results.last(r, 'test_acc'):.2f}" for r in group if "stopped" in r)


def transfer_table(runs: list[results.Run], study: str, m: int) -> str:
    """A cell of Table I beyond (a)'s MLP: each method at the paper's setting and at the tuned setting of
    the MLP cell with the same m (transferred, not tuned here), over the seeds that ran all their
    rounds: final, best-validation and last-5 test accuracy beside the paper's; the seeds a time limit
    stopped with the round they reached."""
    paper = PAPER_TRANSFER[study, m]
    lines = [f"| {CELL_NAMES[study]}, m = {m}: method | setting | paper | seeds finished | final | at best val | last 5 | "
             "final − paper | stopped |",
             "|---|---|---|---|---|---|---|---|---|"]
    for (method, at_paper), group in transfer_groups(runs, study, m).items():
        label = LABELS[method] + (" (paper's setting)" if at_paper else f" (m = {m} MLP cell's tuned setting)")
        done = finished_runs(group)
        cells = ["–"] * 4
        if done:
            cells = [*spread_cells(done), f"{100 * final(done).mean() - paper[method]:+.2f}"]
        lines.append(f"| {label} | {setting(group[0]['params'], method)} | {paper[method]:.2f} | {len(done)} | "
                     + " | ".join(cells) + f" | {stopped_cell(group) or '–'} |")
    return "\n".join(lines)


def transfer_differences_table(runs: list[results.Run], study: str, m: int) -> str:
    """FedDeper minus each baseline in a transfer cell, both at the paper's setting and both at the
    transferred one, paired over the seeds both finished, in points, with 95 % confidence intervals."""
    groups = {key: finished_runs(group) for key, group in transfer_groups(runs, study, m).items()}
    lines = ["| difference (points) | seeds | final: mean ± std [95 % CI] | at best val: mean ± std [95 % CI] |",
             "|---|---|---|---|"]
    for at_paper in (True, False):
        ours = groups.get(("feddeper", at_paper))
        where = "paper's setting" if at_paper else "transferred setting"
        for method in ("scaffold", "fedavg", "fedprox"):
            cells = paired_cells(ours or [], groups.get((method, at_paper), []))
            if cells:
                lines.append(f"| FedDeper − {LABELS[method]} ({where}) | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def nonfinite_from(run: results.Run) -> Optional[int]:
    """The first evaluated round of ``run`` whose global test loss is NaN or infinite, or None."""
    return next((p["round"] for p in run["history"] if not np.isfinite(p["test_loss"])), None)


#: how each :data:`~experiments.feddeper.plan.STALENESS` study starts a round's personal model
STALENESS_LABELS = {"n100": "Algorithm 1: v from the stored v_i, v_i^0 = x^0",
                    "n100_first_round": "v from the stored v_i, v_i^0 = x of the client's first round",
                    "n100_reset_personal": "v from x every round",
                    "n100_rho_gain": "Algorithm 1 with ρ 0.003 (ρτn/m as at n = 10)"}


def staleness_table(runs: list[results.Run]) -> str:
    """FedDeper in the n = 100 cells, Algorithm 1 at the paper's setting (the ``n100`` runs) beside
    each :data:`~experiments.feddeper.plan.STALENESS` study: test accuracy (%) over the seeds that
    finished, and the round from which each seed's test loss is NaN or infinite."""
    lines = ["| n = 100, FedDeper (the paper's setting, ρ where given) | m | paper | seeds finished | final | "
             "at best val | last 5 | test loss not finite from round (per seed) |", "|---|---|---|---|---|---|---|---|"]
    settings = {study: s for study, (_, s) in STALENESS.items()}
    for m in TRANSFER["n100"][2]:
        for study, label in STALENESS_LABELS.items():
            group = results.select(runs, study=study, m=m, method="feddeper", **settings.get(study, PAPER["feddeper"]))
            done = finished_runs(group)
            if not done:
                continue
            gone = ", ".join(str(nonfinite_from(r) or "–") for r in done)
            lines.append(f"| {label} | {m} | {PAPER_TRANSFER['n100', m]['feddeper']:.2f} | {len(done)} | "
                         + " | ".join(spread_cells(done)) + f" | {gone} |")
    return "\n".join(lines)


def staleness_differences_table(runs: list[results.Run]) -> str:
    """Each :data:`~experiments.feddeper.plan.STALENESS` study that did not diverge minus SCAFFOLD and
    FedAvg at the paper's setting (the ``n100`` runs), paired by seed, in points, with 95 % confidence
    intervals."""
    lines = ["| n = 100, difference (points) | m | seeds | final: mean ± std [95 % CI] | at best val: mean ± std [95 % CI] |",
             "|---|---|---|---|---|"]
    for m in TRANSFER["n100"][2]:
        for study, (_, settings) in STALENESS.items():
            ours = finished_runs(results.select(runs, study=study, m=m, **settings))
            if not ours or any(nonfinite_from(r) for r in ours):
                continue
            for method in ("scaffold", "fedavg"):
                cells = paired_cells(ours, finished_runs(results.select(runs, study="n100", m=m, method=method, **PAPER[method])))
                if cells:
                    lines.append(f"| {STALENESS_LABELS[study]} − {LABELS[method]} | {m} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def isolation_table(runs: list[results.Run]) -> str:
    """FedDeper (m = 5, at ``ISOLATION_SETTING``) and its :data:`~experiments.feddeper.plan.ISOLATION` variants:
    test accuracy, and each variant's difference to FedDeper paired by seed with its 95 % confidence
    interval."""
    base = sorted(results.select(runs, study="table", m=5, method="feddeper", **ISOLATION_SETTING),
                  key=lambda r: r["params"]["seed"])
    lines = ["| FedDeper, m = 5 | seeds | final | at best val | last 5 | final − FedDeper: mean ± std [95 % CI] |",
             "|---|---|---|---|---|---|"]
    rows = {f"Algorithm 1 as specified (Jacobi order, v kept), {setting(base[0]['params'], 'feddeper')}": base}
    for variant in ISOLATION:
        group = sorted(results.select(runs, study="isolation", variant=variant), key=lambda r: r["params"]["seed"])
        if group:
            rows[VARIANTS[variant]] = group
    for label, group in rows.items():
        cell = "–" if group is base else paired(group, base, final)
        lines.append(f"| {label} | {len(group)} | " + " | ".join(spread_cells(group)) + f" | {cell} |")
    return "\n".join(lines)


def digits_tables(runs: list[results.Run]) -> list[str]:
    """Ours beside the specification's implementation on the digits stand-in (m = 5, m = 10): test
    accuracy (%) at the rounds the specification gives."""
    by_name = {r["name"]: r for r in results.select(runs, study="digits")}

    def cell(values: tuple[float, ...]) -> str:
        return " / ".join(f"{v:.1f}" for v in values) if values else "–"

    def ours(name: str, rounds: tuple[int, ...]) -> tuple[float, ...]:
        run = by_name.get(name)
        return tuple(100 * results.at_round(run, "test_acc", r) for r in rounds) if run else ()

    m5 = [f"| m = 5, rounds {' / '.join(map(str, DIGITS_ROUNDS))} | spec, seed 0 | ours, seed 0 | spec, seed 1 | "
          "ours, seed 1 |", "|---|---|---|---|---|"]
    for method in LABELS:
        cells = [cell(v) for s in (0, 1) for v in (SPEC_DIGITS_M5.get((method, s), ()),
                                                 ours(f"digits_m5/{method}_s{s}", DIGITS_ROUNDS))]
        m5.append(f"| {LABELS[method]} | " + " | ".join(cells) + " |")
    m10 = ["| m = 10, seed 0, rounds 150 / 500 | spec | ours |", "|---|---|---|"]
    for method, spec in SPEC_DIGITS_M10.items():
        m10.append(f"| {LABELS[method]} | {cell(spec)} | {cell(ours(f'digits_m10/{method}_s0', (150, 500)))} |")
    return ["\n".join(m5), "\n".join(m10)]


def tables(runs: list[results.Run]) -> list[str]:
    """Every table of the document, in its order."""
    out = [screen_table(runs, method) for method in GRIDS]
    out += [lr_stage_table(runs, m) for m in CELLS if (m, "feddeper") in first_stage(runs)]
    out += [fixed_rho_table(runs, m) for m in CELLS if results.select(runs, study="screen_lr_fixed", m=m)]
    out += [confirm_table(runs, m) for m in CELLS if results.select(runs, study="confirm", m=m)]
    for m in CELLS:
        if cell_groups(runs, m, "table") or cell_groups(runs, m, SEED0):
            out.append(accuracy_table(runs, m))
        if cell_groups(runs, m, "table"):
            out += [differences_table(runs, m), curve_table(runs, m), personal_table(runs, m)]
    for study, (_, _, cells) in TRANSFER.items():
        for m in cells:
            if results.select(runs, study=study, m=m):
                out += [transfer_table(runs, study, m), *with_rows(transfer_differences_table(runs, study, m))]
    if any(results.select(runs, study=study) for study in STALENESS):
        out += [staleness_table(runs), *with_rows(staleness_differences_table(runs))]
    if results.select(runs, study="isolation"):
        out += [isolation_table(runs)]
    if results.select(runs, study="digits"):
        out += digits_tables(runs)
    return out


def plot(runs: list[results.Run], m: int, path: Path) -> None:
    """Test accuracy per evaluated round of each tuned method, mean over seeds, band min–max."""
    from experiments.plots import plt, save

    fig, ax = plt.subplots(figsize=(6.4, 4))
    rows = [*cell_groups(runs, m, "table").items(), *cell_groups(runs, m, "table_lower").items(),
            *cell_groups(runs, m, "table_fixed_rho").items()]
    low = 60.0
    for method, group in rows:
        rounds, acc = series(group, "test_acc")
        low = min(low, 100 * float(acc.mean(0)[-1]))
        line, = ax.plot(rounds, 100 * acc.mean(0), label=f"{LABELS[method]} ({setting(group[0]['params'], method)})".replace("\\", ""))
        ax.fill_between(rounds, 100 * acc.min(0), 100 * acc.max(0), color=line.get_color(), alpha=0.2)
    ax.set(xlabel="round", ylabel="global test accuracy (%)", title=f"MNIST MLP, n = 10, m = {m}, tuned, mean of 3 seeds")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    ax.set_ylim(60 if low >= 60 else 0, 100)  # from 60 %, unless a method ends below it
    fig.tight_layout()
    save(fig, path)


def main(argv: Any = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("results", nargs="?", type=Path, default=RESULTS)
    parser.add_argument("--figures", type=Path, help="folder for feddeper_m<m>.png")
    opts = parser.parse_args(argv)
    runs = results.load(opts.results)
    print("\n\n".join(tables(runs)))
    if opts.figures:
        opts.figures.mkdir(parents=True, exist_ok=True)
        for m in CELLS:
            if cell_groups(runs, m, "table"):
                plot(runs, m, opts.figures / f"feddeper_m{m}.png")


if __name__ == "__main__":
    main()
