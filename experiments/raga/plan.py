"""The MNIST-MLP runs of ``docs/results/raga.md``: ``python -m experiments.sweep raga``.

Every run is ``configs/raga/mnist_mlp.yaml`` (50 clients, Dirichlet(0.6), batch 512, full
participation, K = 3 local steps, the paper's schedule ``eta^t = T / (100 t + 10 T)`` with
T = 1000) with a method's override (``configs/raga/methods/``), the run's settings and seed (the
initialization and the batch order; the data split keeps seed 0, so every run sees the same
federation and validation splits: 10 % of each client's data), the clients trained together by the
batched backend (Byrd-SAGA's one by one: its SAGA tables are per client). The global model is evaluated every 10 rounds on the MNIST test set and on the
pooled validation splits (by the sweep's recorder; Lightning's own validation loop is off).

* ``control`` (the step-size control experiment), attack-free, 1000 rounds, seeds 0-2: RAGA's
  server step is ``w <- w - eta^t GM(g_i)`` with ``g_i`` the mean of a client's K gradients, while
  FedAvg's and RFA's is ``w <- w + server_lr * agg(delta_i)`` with ``delta_i`` the sum of K local
  steps, about ``-K eta^t g_i``: K times RAGA's. FedAvg and RFA run at ``server_lr = 1/K``
  (``CONTROL_SERVER_LR``), which scales their step to RAGA's, and at their default 1. If the 1/K
  runs land on RAGA's curve, RAGA's attack-free deficit is its step size, not its aggregation.
  Runs are ordered by seed, so that a sweep stopped early has every setting at the first seeds.
* ``screen`` (the tuning, equal for every method), attack-free, 200 rounds, seed 0: each method at
  its own paper's setup with its step size searched over six values half a decade apart
  (``STEPS``): FedAvg and RFA with a constant local rate 0.01-3.16 (their papers'; server lr 1),
  Byrd-SAGA's constant server step ``gamma`` 0.01-3.16 (its paper's 0.1 among them), RAGA's paper
  schedule times ``lr_scale`` 0.1-31.6 (the paper's 1 among them: first rates 0.0099-3.13, the
  same span). A setting's score is its validation accuracy averaged over
  the last five evaluations (rounds 160-200); the highest is chosen (ties: the smaller rate);
* ``decouple`` (the test of the tuning's hypothesis that RAGA's schedule, one rate for the local
  steps and the server step, is what holds it back), attack-free, 200 rounds, seed 0: RAGA at the
  constant local rate the baselines chose (``DECOUPLE_LR``), its server step once that rate (its
  own rule) and once K times it (``server_lr``: the step of RFA at server lr 1, up to the median's
  solver), scored as the screening;
* ``table`` (the paper's Table II layout): each method at its chosen setting, 1000 rounds, seeds
  0-2, attack-free and under each attack of ``ATTACKS`` at each Byzantine data fraction of
  ``FRACTIONS``; planned once the screening is complete in the document's result file. Beside
  them, once RAGA's screening is complete, the decoupled RAGA of the ``decouple`` study (constant
  local rate ``DECOUPLE_LR``, server rate K times it): what the tie costs under attack.
* ``table200``: the ``table`` study's runs at the screening's 200 rounds (the first 200 of the
  T = 1000 schedule, as the tuning ran them): what a 2-core CPU affords (about 2.3 CPU-minutes a
  run against 11 for 1000 rounds), in the same order, every setting of a seed before the next seed.
* ``solver`` (the test of why RAGA and RFA, both geometric medians, part under IPM at 0.4): the
  median's Weiszfeld iterations swapped (``SOLVER_ITERS``): RAGA at RFA's 4, RFA at RAGA's 100,
  each Table II setting at its step size (the decoupled RAGA too: at 4 iterations it is RFA's
  step up to the median's smoothing, which tests whether what is left of RAGA's gap at 4
  iterations is its step size), 200 rounds, seeds ``SOLVER_SEEDS``; set beside the ``table200``
  runs of the same cases. An exact median (many iterations) falls onto a tight cluster of attackers
  holding under half the weight when the honest uploads are spread out; 4 iterations from the
  weighted mean stay near the mean.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any, Optional

from experiments import results
from experiments.sweep import Run, split_sizes
from fl_lightning.callbacks.attacks import ByzantineAttack

RESULTS = Path(__file__).resolve().parents[2] / "docs" / "results" / "raga.json"
BASE = "configs/raga/mnist_mlp.yaml"
ROUNDS = 1000
EVERY = 10
SEEDS = (0, 1, 2)
LOCAL_STEPS = 3
#: the server rate that scales FedAvg's and RFA's step to RAGA's: 1/K
CONTROL_SERVER_LR = 1 / LOCAL_STEPS
#: the control study's settings: (method, server_lr; None for RAGA, which has no server rate of its own)
CONTROL = (("raga", None), ("fedavg", CONTROL_SERVER_LR), ("rfa", CONTROL_SERVER_LR), ("fedavg", 1.0), ("rfa", 1.0))
#: the tuning's six initial step sizes, half a decade apart
TUNE_RATES = (0.01, 0.0316, 0.1, 0.316, 1.0, 3.16)
#: method -> the values its step size is searched over: RAGA's ``lr_scale``, the others' rate
STEPS = {"raga": (0.1, 0.316, 1.0, 3.16, 10.0, 31.6), "fedavg": TUNE_RATES, "rfa": TUNE_RATES, "byrdsaga": TUNE_RATES}
SCREEN_ROUNDS = 200
#: the screening evaluations a setting is chosen on (every 10 rounds): rounds 160-200
CHOSEN_ON = 5
#: the decoupling test's constant local rate (the baselines' choice) and RAGA's server rates: its own (None), K times it
DECOUPLE_LR = 0.316
DECOUPLE = (None, LOCAL_STEPS * DECOUPLE_LR)
FRACTIONS = (0.1, 0.2, 0.3, 0.4)
#: the Table II studies and their rounds: the paper's, and the screening's (what a CPU affords)
TABLES = {"table": ROUNDS, "table200": SCREEN_ROUNDS}
#: the solver test: each median's Weiszfeld iterations, swapped (RAGA's 100, RFA's 4), in the cases and seeds below
SOLVER_ITERS = {"raga": 4, "rfa": 100}
SOLVER_CASES = (("ipm", 0.4),)
SOLVER_SEEDS = SEEDS
ATTACKS = {"gaussian": "GaussianAttack", "signflip": "SignFlipAttack", "alie": "ALIEAttack", "ipm": "IPMAttack",
           "scaling": "ScalingAttack", "labelflip": "LabelFlipAttack"}


def step_arguments(method: str, step: float, constant: bool = False) -> list[str]:
    """The arguments that set ``method``'s step size to ``step`` (a value of :data:`STEPS`) in its own
    paper's setup; ``constant``: RAGA at the constant local rate ``step`` instead of its schedule."""
    if method == "raga" and not constant:
        return ["--model.init_args.lr_scale", repr(step)]
    if method == "byrdsaga":
        return ["--model.init_args.step_size", repr(step)]
    return ["--model.init_args.schedule", "constant", "--model.init_args.client.init_args.lr", repr(step)]


def run(study: str, method: str, seed: int, server_lr: Optional[float] = None, attack: str = "none",
        fraction: float = 0.0, rounds: int = ROUNDS, step: Optional[float] = None, constant: bool = False,
        max_iter: Optional[int] = None) -> Run:
    """``method`` (``raga``, ``fedavg``, ``rfa``, ``byrdsaga``) with ``seed``; ``attack`` is ``"none"``
    at fraction 0; ``step``: the step size in the method's own setup (:func:`step_arguments`), None:
    the configs' (RAGA's schedule for every method but Byrd-SAGA, whose gamma is 0.1); ``constant``:
    RAGA at the constant local rate ``step``; ``max_iter``: the geometric median's Weiszfeld
    iterations (RAGA, RFA; None: the method's own)."""
    args = ["--config", BASE]
    if method != "raga":
        args += ["--config", f"configs/raga/methods/{method}.yaml"]
    if server_lr is not None:
        args += ["--model.init_args.server_lr", repr(server_lr)]
    if step is not None:
        args += step_arguments(method, step, constant)
    if max_iter is not None:
        args += ["--model.init_args.max_iter", str(max_iter)]
    if attack != "none":
        args += [f"--trainer.callbacks+=fl_lightning.callbacks.attacks.{ATTACKS[attack]}",
                 f"--trainer.callbacks.fraction={fraction}"]
    if method != "byrdsaga":  # its per-client minibatch index runs client by client (the batched backend refuses it)
        args += ["--model.init_args.client_backend", "batched"]
    args += ["--seed_everything", str(seed), "--model.init_args.seed", str(seed), "--trainer.max_epochs", str(rounds),
             "--trainer.limit_val_batches", "0"]
    params = dict(study=study, method=method, server_lr=server_lr, step=step, attack=attack, fraction=fraction,
                  seed=seed, rounds=rounds, **({"constant": True} if constant else {}),
                  **({"max_iter": max_iter} if max_iter is not None else {}))
    slr = "" if server_lr is None else f"_slr{server_lr:.3g}"
    size = "" if step is None else f"_{'scale' if method == 'raga' and not constant else 'lr'}{step:g}"
    iters = "" if max_iter is None else f"_it{max_iter}"
    return Run(f"{study}/{method}{slr}{size}{iters}_{attack}_{fraction:g}_s{seed}", args, params, every=EVERY)


def screen_score(run: results.Run) -> float:
    """Mean validation accuracy over the last ``CHOSEN_ON`` evaluations."""
    return results.mean_of_last(run, "val_acc", CHOSEN_ON)


def tuned(runs: list[results.Run]) -> dict[str, float]:
    """Method -> its chosen step size, for every method whose screening is complete in ``runs``."""
    chosen = {}
    for method, steps in STEPS.items():
        best = results.best_named(runs, [run("screen", method, 0, step=s, rounds=SCREEN_ROUNDS).name for s in steps],
                                  screen_score)
        if best is not None:
            chosen[method] = steps[best]
    return chosen


def runs() -> list[Run]:
    plan = [run("control", method, seed, server_lr) for seed in SEEDS for method, server_lr in CONTROL]
    plan += [run("screen", method, 0, step=step, rounds=SCREEN_ROUNDS) for method, steps in STEPS.items() for step in steps]
    plan += [run("decouple", "raga", 0, server_lr, step=DECOUPLE_LR, rounds=SCREEN_ROUNDS, constant=True)
             for server_lr in DECOUPLE]
    chosen = tuned(results.load(RESULTS))
    missing = [m for m in STEPS if m not in chosen]
    if missing:
        warnings.warn(f"the table runs of {missing} are not planned: their step sizes come from the screen runs, "
                      f"which {RESULTS} lacks (python -m experiments.sweep raga --only 'screen/*')")
    cases = [("none", 0.0)] + [(attack, fraction) for attack in ATTACKS for fraction in FRACTIONS]
    settings = table_settings(chosen)
    plan += [run(study, method, seed, server_lr, attack, fraction, rounds, step=step, constant=constant)
             for study, rounds in TABLES.items()
             for seed in SEEDS for attack, fraction in cases for method, server_lr, step, constant in settings]
    plan += [run("solver", method, seed, server_lr, attack, fraction, SCREEN_ROUNDS, step=step, constant=constant,
                 max_iter=SOLVER_ITERS[method])
             for seed in SOLVER_SEEDS for attack, fraction in SOLVER_CASES
             for method, server_lr, step, constant in settings if method in SOLVER_ITERS]
    return plan


def table_settings(chosen: dict[str, float]) -> list[tuple[str, Optional[float], float, bool]]:
    """The Table II rows, ``(method, server_lr, step, constant)``: each tuned method of ``chosen``
    (:func:`tuned`) at its step size, and beside RAGA the decoupled RAGA of the ``decouple`` study."""
    settings = [(method, None, step, False) for method, step in chosen.items()]
    if "raga" in chosen:
        settings.append(("raga", DECOUPLE[1], DECOUPLE_LR, True))
    return settings


def summary(cli: Any) -> dict[str, Any]:
    """The Byzantine clients the attack chose (their share of the training data and their number),
    and the federation's training and validation split sizes."""
    attack = next((c for c in cli.trainer.callbacks if isinstance(c, ByzantineAttack)), None)
    return {"achieved_fraction": 0.0 if attack is None else attack.achieved_fraction,
            "num_byzantine": 0 if attack is None else len(attack.byzantine), **split_sizes(cli)}
