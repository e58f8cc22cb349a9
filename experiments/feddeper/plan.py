"""The MNIST-MLP runs of ``docs/results/feddeper.md`` (Table I (a), n = 10): ``python -m experiments.sweep feddeper``.

Every run is ``configs/feddeper/mnist_mlp.yaml`` (the sorted split, the MLP 784-512-256-10, plain
SGD, tau = 10) with a method's override (``configs/feddeper/methods/``), the cell's clients per
round ``m``, the run's settings and seed (the initialization, the sampling and the batch order;
the data split keeps seed 0, so every run sees the same federation and validation splits). The
global model is evaluated every 10 rounds on the MNIST test set and on the pooled validation
splits (what the tuning chooses on).

* ``screen``: the tuning, 200 rounds, seed 0, m = 5 and m = 10, 48 settings for every method:
  FedDeper over rho x lambda x batch (``RHOS`` x ``LAMS`` x ``BATCHES``, at the paper's lr 0.01);
  FedAvg and SCAFFOLD over lr x batch (``LRS`` x ``BATCHES``); FedProx over lr x mu x batch
  (``PROX_LRS`` x ``MUS`` x ``BATCHES``). A setting's score is its validation accuracy averaged
  over the last five evaluations (rounds 160-200), which the m = 5 curves' swings of several points
  make steadier than the last one alone; the highest is chosen (ties: the first in grid order);
* ``screen_lr``: FedDeper's second stage, since the baselines' best rates lie far above the
  paper's 0.01: each larger rate of ``LRS`` with rho scaled with it (rho / lr as chosen at 0.01,
  where rho < 1; the paper ties rho to "the same order as" eta) and lambda and the batch as chosen;
  FedDeper's setting is the best of the first stage's choice and these (:func:`tuned`, read from
  the document's result file);
* ``confirm``: the screening's choice is one seed's, and at 500 rounds it failed: FedAvg's best
  seed-0 rate diverged on two seeds of three, FedProx's on one. So each method's ``CONFIRM_TOP``
  best settings by their seed-0 score (FedDeper's from both of its stages) run again with seeds
  ``CONFIRM_SEEDS``, 200 rounds, and the setting with the highest score averaged over the three
  seeds is the method's (:func:`tuned`): the same six runs for every method and cell, and a setting
  that diverges on one seed loses;
* ``screen_lr_fixed``: whether FedDeper gains from a larger rate when rho is kept, not scaled:
  its first stage's setting at the rates ``FIXED_RHO_LRS``, 200 rounds, seed 0 (a hypothesis
  test, added after the ``screen_lr`` runs diverged, not part of the tuning);
* ``table_fixed_rho``: FedDeper at the best of those rates (if better than 0.01), seeds 0-2,
  500 rounds;
* ``table``: each method at its tuned (confirmed) setting, seeds 0-2, 500 rounds (the runs at the
  settings seed 0 alone chose, before the ``confirm`` stage, stay in the result file and the
  report); FedDeper* is FedDeper's tuned setting with tau = 5; the base config's
  ``PersonalizedAccuracy`` measures the personal models (FedDeper) and the global model on the
  clients' local test sets every 10 rounds, for FedDeper also with 1 and 3 classes the client does
  not hold added (``EXTRA_CLASSES``, Fig. 5b);
* ``table_lower``: a baseline whose tuned rate diverged in the table on some seed (final test
  accuracy under ``DIVERGED``), at the next lower rate of its grid, the rest of its setting kept,
  seeds 0-2, 500 rounds: whether one grid step gives the stability that the 200-round ``confirm``
  runs could not see (FedAvg's and FedProx's rates failed there after round 250; a hypothesis
  test, added after the table, not part of the tuning);
* ``isolation``: FedDeper at ``ISOLATION_SETTING`` with one reading of Algorithm 1 changed
  (``ISOLATION``): the y-step pulling toward ``2x - v_{j+1}`` (Gauss-Seidel order) instead of
  ``v_j``, and the personal model restarted from ``x`` every round instead of kept; m = 5,
  seeds 0-2, 500 rounds, beside FedDeper's ``table`` runs at that setting: whether either closes
  the gap to the paper;
* ``star_factors``: FedDeper* where its ``table`` runs diverged (final test accuracy under
  ``DIVERGED``; at m = 10 it settles at about 19-45 % from round 40 on, while FedDeper with tau = 10 at
  the same setting reaches 91 %), at that setting with one of rho, lambda at the paper's value
  (each that differs), seeds 0-2, 500 rounds: which of the two makes tau = 5 fail (a hypothesis
  test, added after the table, not part of the tuning);
* ``paper``: each method at the paper's setting (lr 0.01, batch 64, rho 0.03, lambda 0.5, FedProx
  mu 1) where it differs from the tuned one, FedDeper* too, seeds 0-2, 500 rounds;
* ``n100_first_round``, ``n100_reset_personal``, ``n100_rho_gain`` (:data:`STALENESS`): FedDeper in
  the ``n100`` cells at the paper's setting with each personal model started from the global model
  of its client's first round (``personal_init="first_round"``) instead of ``x^0``, with ``v``
  restarted from ``x`` every round (``reset_personal``), and with rho scaled to n = 10's gain (0.003),
  seeds 0-2, 500 rounds: whether the stored personal models, old where a client is sampled every
  10-20 rounds, make FedDeper diverge there (hypothesis tests, added after its ``n100`` runs diverged);
* ``cnn`` (Table I (a)'s CNN cell: ``configs/feddeper/mnist_cnn.yaml``, n = 10, m = 5) and ``n100``
  (Table I (b)'s MNIST MLP cells: n = 100, m = 5 and 10), seeds 0-2, 500 rounds: each method at the
  paper's setting and, once the MLP cell with the same m is tuned, at that cell's tuned setting (a
  transfer, not a tuning of these cells: :data:`TRANSFER`).
"""

from __future__ import annotations

import itertools
import warnings
from pathlib import Path
from typing import Any, Optional

from experiments import results
from experiments.sweep import Run, split_sizes

RESULTS = Path(__file__).resolve().parents[2] / "docs" / "results" / "feddeper.json"
BASE = "configs/feddeper/mnist_mlp.yaml"
CELLS = (5, 10)
SCREEN_ROUNDS = 200
#: the screening evaluations a setting is chosen on (every 10 rounds): rounds 160-200
CHOSEN_ON = 5
TABLE_ROUNDS = 500
SEEDS = (0, 1, 2)
#: the settings of each method that the ``confirm`` stage reruns (its best by seed-0 score), and with which seeds
CONFIRM_TOP = 3
CONFIRM_SEEDS = (1, 2)
#: a table run whose final test accuracy is below this diverged (chance is 0.1)
DIVERGED = 0.5
BATCHES = (10, 32, 64)
RHOS = (0.02, 0.03, 0.04, 0.05)
LAMS = (0.3, 0.5, 0.7, 0.9)
PAPER_LR = 0.01
#: 16 rates, a sixth of a decade apart, from the paper's 0.01 to 3.16 (a first grid, from 0.001 to
#: 0.316, had its best FedAvg rate at its top; its rates below 0.01 stay in the result file)
LRS = tuple(float(f"{10 ** (k / 6 - 2):.3g}") for k in range(16))
PROX_LRS = (0.0316, 0.1, 0.316, 1.0)
#: every other rate of ``LRS`` above 0.01 up to FedAvg's best, 0.464 (the ``screen_lr_fixed`` runs)
FIXED_RHO_LRS = (0.0215, 0.0464, 0.1, 0.215, 0.464)
MUS = (0.01, 0.1, 0.3, 1.0)
#: method -> the settings it is tuned over: name -> values (the same count, 48, for each)
GRIDS = {"feddeper": {"rho": RHOS, "lam": LAMS, "batch": BATCHES},
         "fedavg": {"lr": LRS, "batch": BATCHES},
         "scaffold": {"lr": LRS, "batch": BATCHES},
         "fedprox": {"lr": PROX_LRS, "mu": MUS, "batch": BATCHES}}
#: the paper's setting of each method (spec A9, A12, A8: lr 0.01, B 64 assumed)
PAPER = {"feddeper": dict(lr=0.01, rho=0.03, lam=0.5, batch=64), "fedavg": dict(lr=0.01, batch=64),
         "scaffold": dict(lr=0.01, batch=64), "fedprox": dict(lr=0.01, mu=1.0, batch=64)}
PERSONAL = "--trainer.callbacks+=fl_lightning.callbacks.personalized.PersonalizedAccuracy"
#: FedDeper's table runs also measure the personal models on the local test sets with 1 and 3
#: classes the client does not hold added (the paper's Fig. 5b)
EXTRA_CLASSES = [PERSONAL, "--trainer.callbacks.extra_classes=1", PERSONAL, "--trainer.callbacks.extra_classes=3"]
#: isolation variant -> the arguments that make it (FedDeper at ``ISOLATION_SETTING``, m = 5)
ISOLATION = {"gauss_seidel": ["--model.init_args.update_order", "gauss_seidel"],
             "reset_personal": ["--model.init_args.reset_personal", "true"]}
#: hypothesis tests in the n = 100 cells, where FedDeper at the paper's setting diverged (each client is
#: sampled every n/m = 10-20 rounds there, so its stored v_i is old, and the pull toward 2x - v_i moves y
#: by about rho tau (x - v_i): rho tau n/m times the global model's mean step, 6 and 3 here against 0.6
#: and 0.3 at n = 10): study -> (variant, FedDeper's settings); v_i started from the
#: global model of the client's first round instead of x^0; v restarted from x every round (no stored
#: v_i in the step); rho scaled to n = 10's gain (rho tau n/m = 0.6 at m = 5, 0.3 at m = 10)
STALENESS = {"n100_first_round": ("first_round", PAPER["feddeper"]),
             "n100_reset_personal": ("reset_personal", PAPER["feddeper"]),
             "n100_rho_gain": (None, dict(PAPER["feddeper"], rho=0.003))}
#: every FedDeper variant of the plan -> the arguments that make it
VARIANTS = {**ISOLATION, "first_round": ["--model.init_args.personal_init", "first_round"]}
#: FedDeper's setting in the isolation runs: the m = 5 choice of seed 0's screening, the tuned setting
#: when they ran (the ``confirm`` stage chose B 64 later; the variants are compared at one setting)
ISOLATION_SETTING = dict(lr=0.01, rho=0.04, lam=0.5, batch=32)
#: the cells tuned on the n = 10 MLP whose settings are transferred: study -> (config, clients n, cells m)
TRANSFER = {"cnn": ("configs/feddeper/mnist_cnn.yaml", 10, (5,)), "n100": (BASE, 100, (5, 10))}
#: the command-line argument of each setting
ARGUMENT = {"rho": "--model.init_args.rho", "lam": "--model.init_args.lam", "batch": "--data.init_args.batch_size",
            "lr": "--model.init_args.client.init_args.lr", "mu": "--model.init_args.mu"}


def settings_name(settings: dict[str, Any]) -> str:
    """``rho0.03_lam0.5_b64``."""
    return "_".join(f"{'b' if k == 'batch' else k}{v}" for k, v in settings.items())


def grid(method: str) -> list[dict[str, Any]]:
    """Every setting ``method`` is tuned over, in grid order."""
    names = list(GRIDS[method])
    return [dict(zip(names, values)) for values in itertools.product(*GRIDS[method].values())]


def run(study: str, m: int, method: str, settings: dict[str, Any], seed: int, rounds: int,
        local_steps: Optional[int] = None, variant: Optional[str] = None, config: str = BASE,
        num_clients: Optional[int] = None) -> Run:
    """``method`` (``feddeper_star``: FedDeper with ``local_steps``) with ``settings`` in the cell
    with ``m`` clients per round (``variant``: FedDeper's :data:`ISOLATION` variant) of ``config``
    (with ``num_clients`` clients instead of its 10)."""
    args = ["--config", config]
    if method not in ("feddeper", "feddeper_star"):
        args += ["--config", f"configs/feddeper/methods/{method}.yaml"]
    args += ["--model.init_args.clients_per_round", str(m)]
    if num_clients is not None:
        args += ["--data.init_args.num_clients", str(num_clients)]
    for key, value in settings.items():
        args += [ARGUMENT[key], str(value)]
    if local_steps is not None:
        args += ["--model.init_args.local_steps", str(local_steps)]
    if variant is not None:
        args += VARIANTS[variant]
    args += ["--seed_everything", str(seed), "--model.init_args.seed", str(seed), "--trainer.max_epochs", str(rounds)]
    if study.startswith("screen") or study == "confirm":
        args += ["--trainer.limit_val_batches", "0"]  # the Recorder measures; no personal evaluation
    elif study == "table" and method == "feddeper":
        args += EXTRA_CLASSES
    params = dict(study=study, m=m, method=method, **settings, seed=seed, rounds=rounds)
    if num_clients is not None:
        params["n"] = num_clients
    name = f"{study}/m{m}/{method}_{settings_name(settings)}_s{seed}"
    if variant is not None:
        params["variant"] = variant
        name = f"{study}/m{m}/{variant}_{settings_name(settings)}_s{seed}"
    return Run(name, args, params, every=10, metrics=("local",))


def screen_score(run: results.Run) -> float:
    """Mean validation accuracy over the last ``CHOSEN_ON`` evaluations."""
    return results.mean_of_last(run, "val_acc", CHOSEN_ON)


def screened(runs: list[results.Run], study: str, m: int, method: str,
             settings: list[dict[str, Any]]) -> Optional[list[results.Run]]:
    """The runs of ``study`` with each of ``settings`` (seed 0), or None while one is missing."""
    by_name = {r["name"]: r for r in runs}
    found = [by_name.get(f"{study}/m{m}/{method}_{settings_name(s)}_s0") for s in settings]
    return None if None in found else found


def first_stage(runs: list[results.Run]) -> dict[tuple[int, str], dict[str, Any]]:
    """``(m, method)`` -> the best setting of its ``screen`` grid, where the grid is complete in ``runs``."""
    chosen = {}
    for m in CELLS:
        for method in GRIDS:
            found = screened(runs, "screen", m, method, grid(method))
            if found is not None:
                scores = [screen_score(r) for r in found]
                chosen[m, method] = grid(method)[scores.index(max(scores))]
    return chosen


def lr_stage(settings: dict[str, Any]) -> list[dict[str, Any]]:
    """FedDeper's ``screen_lr`` settings after the first stage chose ``settings`` (at lr 0.01): each
    larger rate of ``LRS`` with rho scaled with it, where rho stays below 1."""
    ratio = settings["rho"] / PAPER_LR
    return [dict(lr=lr, rho=float(f"{ratio * lr:.3g}"), lam=settings["lam"], batch=settings["batch"])
            for lr in LRS if lr > PAPER_LR and ratio * lr < 1]


def candidates(runs: list[results.Run], m: int, method: str) -> Optional[list[tuple[dict[str, Any], results.Run]]]:
    """Every setting ``method`` was screened with in the cell (seed 0), with its run, in grid order;
    None while its screening is incomplete: a baseline's grid; FedDeper's grid at lr 0.01, then its
    ``screen_lr`` settings."""
    settings = grid(method)
    found = screened(runs, "screen", m, method, settings)
    if found is None:
        return None
    if method != "feddeper":
        return list(zip(settings, found))
    second = lr_stage(first_stage(runs)[m, method])
    found_second = screened(runs, "screen_lr", m, method, second)
    if found_second is None:
        return None
    return [(dict(lr=PAPER_LR, **s), r) for s, r in zip(settings, found)] + list(zip(second, found_second))


def ranked(runs: list[results.Run], m: int, method: str) -> Optional[list[tuple[dict[str, Any], results.Run]]]:
    """:func:`candidates`, best seed-0 score first (ties: grid order); None while the screening is incomplete."""
    found = candidates(runs, m, method)
    return None if found is None else sorted(found, key=lambda item: -screen_score(item[1]))  # stable sort


def shortlist(runs: list[results.Run], m: int, method: str) -> Optional[list[dict[str, Any]]]:
    """``method``'s ``CONFIRM_TOP`` settings with the highest seed-0 score in the cell, best first
    (ties: grid order); None while its screening is incomplete."""
    order = ranked(runs, m, method)
    return None if order is None else [settings for settings, _ in order[:CONFIRM_TOP]]


def confirmed(runs: list[results.Run], m: int, method: str) -> Optional[list[tuple[dict[str, Any], list[float]]]]:
    """The shortlisted settings with their scores on seeds 0, 1, 2 (seed 0: the screening run);
    None while a run is missing."""
    order = ranked(runs, m, method)
    if order is None:
        return None
    by_name = {r["name"]: r for r in runs}
    out = []
    for settings, seed0 in order[:CONFIRM_TOP]:
        again = [by_name.get(run("confirm", m, method, settings, seed, SCREEN_ROUNDS).name) for seed in CONFIRM_SEEDS]
        if None in again:
            return None
        out.append((settings, [screen_score(r) for r in [seed0, *again]]))
    return out


def tuned(runs: Optional[list[results.Run]] = None) -> dict[tuple[int, str], dict[str, Any]]:
    """``(m, method)`` -> its chosen setting, for every cell and method whose ``confirm`` runs are
    all in ``runs`` (default: the document's result file): of its shortlisted settings, the one with
    the highest score averaged over seeds 0-2 (ties: the better seed-0 score)."""
    runs = results.load(RESULTS) if runs is None else runs
    chosen = {}
    for m in CELLS:
        for method in GRIDS:
            scored = confirmed(runs, m, method)
            if scored is not None:
                means = [sum(scores) / len(scores) for _, scores in scored]
                chosen[m, method] = scored[means.index(max(means))][0]
    return chosen


def table_diverged(runs: list[results.Run], m: int, method: str, setting: dict[str, Any]) -> bool:
    """Whether a ``table`` run of ``method`` at ``setting`` in the cell diverged (final test accuracy
    under ``DIVERGED``)."""
    group = results.select(runs, study="table", m=m, method=method, **setting)
    return any(results.last(r, "test_acc") < DIVERGED for r in group)


def lower_rate(runs: list[results.Run], m: int, method: str, setting: dict[str, Any]) -> Optional[dict[str, Any]]:
    """A baseline's tuned ``setting`` at the next lower rate of its grid, if a ``table`` run at that
    setting diverged (final test accuracy under ``DIVERGED``); None otherwise."""
    if method == "feddeper":
        return None
    if not table_diverged(runs, m, method, setting):
        return None
    below = [lr for lr in sorted(GRIDS[method]["lr"]) if lr < setting["lr"]]
    return dict(setting, lr=below[-1]) if below else None


def star_factors(runs: list[results.Run], m: int, setting: dict[str, Any]) -> list[dict[str, Any]]:
    """FedDeper's tuned ``setting`` with one of rho, lambda at the paper's value (each that differs),
    if a ``table`` run of FedDeper* (tau = 5) at that setting diverged (final test accuracy under
    ``DIVERGED``); [] otherwise."""
    if not table_diverged(runs, m, "feddeper_star", setting):
        return []
    paper = PAPER["feddeper"]
    return [dict(setting, **{key: paper[key]}) for key in ("rho", "lam") if setting[key] != paper[key]]


def fixed_rho_choice(runs: list[results.Run], m: int) -> Optional[dict[str, Any]]:
    """FedDeper's ``screen_lr_fixed`` setting with the highest score, if it beats the first stage's
    choice at lr 0.01; None otherwise or while a run is missing."""
    first = first_stage(runs).get((m, "feddeper"))
    if first is None:
        return None
    candidates = [dict(lr=lr, **first) for lr in FIXED_RHO_LRS]
    found = screened(runs, "screen_lr_fixed", m, "feddeper", candidates)
    if found is None:
        return None
    scores = [screen_score(r) for r in found]
    best = scores.index(max(scores))
    return candidates[best] if scores[best] > screen_score(screened(runs, "screen", m, "feddeper", [first])[0]) else None


def runs() -> list[Run]:
    plan = [run("screen", m, method, s, 0, SCREEN_ROUNDS) for m in CELLS for method in GRIDS for s in grid(method)]
    found = results.load(RESULTS)
    for (m, method), settings in first_stage(found).items():
        if method == "feddeper":
            plan += [run("screen_lr", m, method, s, 0, SCREEN_ROUNDS) for s in lr_stage(settings)]
            plan += [run("screen_lr_fixed", m, method, dict(lr=lr, **settings), 0, SCREEN_ROUNDS) for lr in FIXED_RHO_LRS]
            fixed = fixed_rho_choice(found, m)
            if fixed is not None:
                plan += [run("table_fixed_rho", m, method, fixed, seed, TABLE_ROUNDS) for seed in SEEDS]
    for m in CELLS:
        for method in GRIDS:
            top = shortlist(found, m, method)
            if top is not None:
                plan += [run("confirm", m, method, s, seed, SCREEN_ROUNDS) for s in top for seed in CONFIRM_SEEDS]
    chosen = tuned(found)
    missing = [f"m{m}/{method}" for m in CELLS for method in GRIDS if (m, method) not in chosen]
    if missing:
        warnings.warn(f"the table and paper runs of {missing} are not planned: their settings come from the screen "
                      f"and confirm runs, which {RESULTS} lacks (python -m experiments.sweep feddeper --only 'screen*', "
                      "then --only 'confirm/*')")
    for (m, method), settings in chosen.items():
        lower = lower_rate(found, m, method, settings)
        factors = star_factors(found, m, settings) if method == "feddeper" else []
        for seed in SEEDS:
            plan.append(run("table", m, method, settings, seed, TABLE_ROUNDS))
            if method == "feddeper":
                plan.append(run("table", m, "feddeper_star", settings, seed, TABLE_ROUNDS, local_steps=5))
                plan += [run("star_factors", m, "feddeper_star", s, seed, TABLE_ROUNDS, local_steps=5) for s in factors]
            if settings != PAPER[method]:
                plan.append(run("paper", m, method, PAPER[method], seed, TABLE_ROUNDS))
                if method == "feddeper":
                    plan.append(run("paper", m, "feddeper_star", PAPER[method], seed, TABLE_ROUNDS, local_steps=5))
            if lower is not None:
                plan.append(run("table_lower", m, method, lower, seed, TABLE_ROUNDS))
            if method == "feddeper" and m == 5:
                if settings != ISOLATION_SETTING:  # the isolation variants' baseline
                    plan.append(run("table", m, method, ISOLATION_SETTING, seed, TABLE_ROUNDS))
                plan += [run("isolation", m, method, ISOLATION_SETTING, seed, TABLE_ROUNDS, variant=v) for v in ISOLATION]
    for study, (config, n, cells) in TRANSFER.items():
        for m in cells:
            settings = [(method, PAPER[method]) for method in GRIDS]
            settings += [(method, chosen[m, method]) for method in GRIDS if chosen.get((m, method), PAPER[method]) != PAPER[method]]
            plan += [run(study, m, method, s, seed, TABLE_ROUNDS, config=config, num_clients=None if n == 10 else n)
                     for seed in SEEDS for method, s in settings]
    config, n, cells = TRANSFER["n100"]
    plan += [run(study, m, "feddeper", settings, seed, TABLE_ROUNDS, variant=variant, config=config, num_clients=n)
             for study, (variant, settings) in STALENESS.items() for m in cells for seed in SEEDS]
    return plan


def summary(cli: Any) -> dict[str, Any]:
    """The federation: training and validation split sizes."""
    return split_sizes(cli)
