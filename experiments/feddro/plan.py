"""The MNIST-ST runs of ``docs/results/feddro.md``: ``python -m experiments.sweep feddro``.

MNIST-ST is the paper's "-ST" construction on MNIST (classes 0-4 keep their last 100 training
images, classes 5-9 all of theirs; the test set is unchanged, balanced). Every run is
``configs/feddro/mnist_st.yaml`` (LeNet, 8 clients holding an equal random split, batch 16, plain
SGD, KL-DRO with ``f = lambda log``, beta 0.5) with a method's override (``configs/feddro/methods/``),
the run's settings and seed (the initialization and the batch order; the data split keeps seed 0,
so every run sees the same federation and validation splits: 10 % of each client's data, as
imbalanced as its training split). The centralized baselines are the paper's "parallel" versions:
one client holding all the training data, batch 128 = 8 x 16, so one of their steps uses the data
of one step of the 8 clients. Every run lasts ``EPOCHS`` passes over the training data (211 steps
of a client, or of the one client, per pass) with the rate x0.1 after epoch ``DROP_EPOCH`` (the
paper's drop after 90 of about 120 epochs, at the same fraction of the run). The global model is
evaluated every epoch on the test set, the pooled validation splits and the pooled training
splits (the paper's headline is training accuracy): overall, balanced (mean per-class),
worst-class and per-class accuracy, and the KL-DRO objective ``lambda log mean exp(loss / lambda)``
on the training splits at the run's lambda (``TUNE_LAM`` for the methods without one).

* ``tune`` (the same budget for every method): each method's rate over the paper's grid
  ``LRS`` (spec section 3: "tuned per algorithm from {0.001, 0.01, 0.05, 0.1}"), lambda = 2,
  I = 1, seed 0; the rate with the highest balanced validation accuracy after the last epoch is
  chosen (the test set is balanced; ties: the smaller rate). FedAvg minimizes the mean loss (ERM),
  FastDRO its minibatch CVaR at level 0.1; FedDRO, MBSGD (Algorithm 1 case I, each client's
  plug-in estimate) and PDSGD the KL-DRO objective at lambda;
* ``table`` (the paper's Fig. 1): each method at its chosen rate, I = 1, seeds 0-4, at every
  lambda of ``LAMS`` for the methods with one (FedAvg and FastDRO once);
* ``local_steps`` (the paper's Fig. 2): FedDRO at its chosen rate and lambda = 2 with each I of
  ``LOCAL_STEPS`` for ``SWEEP_ROUNDS`` model-averaging rounds (I = 32 is 20 epochs), seeds 0-2:
  whether accuracy at a fixed number of rounds rises with I and then saturates;
* ``centralized`` (the test of the tuning's hypothesis that FedDRO's deficit is the federated
  estimate of the inner expectation): FedDRO on one client holding all the training data, batch
  128, as the centralized baselines, at every rate of ``LRS``, lambda = 2, seed 0: one estimate from
  128 samples per step instead of eight clients' from 16 each;
* ``beta`` (the test of the hypothesis that FedDRO's momentum limits its rate: it alone ends at a
  higher value of its own objective as the rate rises): FedDRO with each momentum of ``BETAS``
  besides the config's 0.5 (the tuning's runs), at the rates of ``LRS`` from 0.01 up, lambda = 2,
  seed 0. ``beta = 1`` drops the momentum: the estimate is the 8 clients' fresh average, the
  paper's "modified FedAvg";
* ``length`` (the test of the hypothesis that FedDRO is only slower, and catches up in a run closer
  to the paper's length): FedDRO and the centralized DRO baselines at their chosen rates, lambda 2,
  seed 0, for ``LONG_EPOCHS`` epochs with the drop at the same fraction of the run;
* ``paper_length`` (the headline at the paper's length): every method at its chosen rate, lambda 2,
  I = 1, seeds 0-4, for ``PAPER_EPOCHS`` epochs (the paper's ~120, its drop after 90). The runs are long
  for this CPU (about 45 minutes for FedDRO's): advance them together with ``--until-round``, so that
  every method has all its seeds at a common length when a session ends.

The ``table`` and ``local_steps`` runs are planned once the tuning is complete in the document's
result file.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Optional

from experiments import results
from experiments.sweep import Run

RESULTS = Path(__file__).resolve().parents[2] / "docs" / "results" / "feddro.json"
BASE = "configs/feddro/mnist_st.yaml"
#: method -> its override of the base config (FedDRO: none)
METHODS = {"feddro": None, "compfedavg": "configs/feddro/methods/compfedavg.yaml",
           "fastdro": "configs/feddro/methods/fastdro.yaml", "pdsgd": "configs/feddro/methods/pdsgd.yaml",
           "fedavg": "configs/feddro/methods/fedavg.yaml"}
#: the methods with a DRO temperature lambda, and the argument that sets it
LAM_ARGUMENT = {"feddro": "--model.init_args.objective.init_args.lam",
                "compfedavg": "--model.init_args.objective.init_args.lam", "pdsgd": "--model.init_args.lam"}
#: steps of a client (batch 16) or of the centralized baselines' one client (batch 128) per epoch
STEPS_PER_EPOCH = 211
EPOCHS = 20
DROP_EPOCH = 15
LRS = (0.001, 0.01, 0.05, 0.1)
TUNE_LAM = 2.0
LAMS = (1.0, 2.0, 3.0)
SEEDS = (0, 1, 2, 3, 4)
LOCAL_STEPS = (1, 2, 4, 8, 16, 32)
SWEEP_SEEDS = (0, 1, 2)
#: the model-averaging rounds of the ``local_steps`` study: 20 epochs at its largest I
SWEEP_ROUNDS = EPOCHS * STEPS_PER_EPOCH // LOCAL_STEPS[-1]
#: the ``length`` study's run length, and its methods
LONG_EPOCHS = 60
LONG_METHODS = ("feddro", "fastdro", "pdsgd")
#: the ``paper_length`` study's run length (the paper's: about 120 epochs, the drop after 90)
PAPER_EPOCHS = 120
#: FedDRO's momentum in ``BASE``, and those the ``beta`` study tries besides it
CONFIG_BETA = 0.5
BETAS = (0.1, 1.0)


def run(study: str, method: str, lr: float, seed: int, lam: Optional[float] = None, local_steps: int = 1,
        rounds: Optional[int] = None, centralized: bool = False, beta: Optional[float] = None,
        epochs: int = EPOCHS) -> Run:
    """``method`` at rate ``lr`` (and ``lam`` if it has one) with ``local_steps`` steps per round, for
    ``rounds`` rounds (None: ``epochs`` epochs, the rate's drop after ``DROP_EPOCH / EPOCHS`` of them),
    evaluated every epoch (or ten times, if shorter);
    ``centralized``: on one client holding the training data, batch 128 (the centralized baselines' setting);
    ``beta``: FedDRO's momentum (None: the config's)."""
    args = ["--config", BASE]
    if METHODS[method] is not None:
        args += ["--config", METHODS[method]]
    if centralized:
        args += ["--data.init_args.num_clients", "1", "--data.init_args.batch_size", "128",
                 "--model.init_args.clients_per_round", "1"]
    if lam is not None:
        args += [LAM_ARGUMENT[method], repr(lam)]
    if beta is not None:
        args += ["--model.init_args.beta", repr(beta)]
    rounds = epochs * STEPS_PER_EPOCH // local_steps if rounds is None else rounds
    every = max(1, min(STEPS_PER_EPOCH // local_steps, rounds // 10))
    args += ["--model.init_args.client.init_args.lr", repr(lr), "--model.init_args.local_steps", str(local_steps),
             "--model.init_args.lr_drop_epochs", f"[{DROP_EPOCH * epochs // EPOCHS}]", "--seed_everything", str(seed),
             "--model.init_args.seed", str(seed), "--trainer.max_epochs", str(rounds),
             "--trainer.limit_val_batches", "0"]
    params = dict(study=study, method=method, lr=lr, lam=lam, local_steps=local_steps, seed=seed, rounds=rounds,
                  **({"centralized": True} if centralized else {}), **({"beta": beta} if beta is not None else {}),
                  **({"epochs": epochs} if epochs != EPOCHS else {}))
    name = (f"{study}/{method}_lr{lr:g}" + ("" if lam is None else f"_lam{lam:g}") + f"_I{local_steps}"
            + ("" if beta is None else f"_beta{beta:g}") + ("" if epochs == EPOCHS else f"_e{epochs}") + f"_s{seed}")
    return Run(name, args, params, every=every, at_start=True, train=True, classes=True,
               dro_lam=TUNE_LAM if lam is None else lam)


def tune_runs() -> list[Run]:
    """The tuning: every method at every rate of ``LRS``."""
    return [run("tune", method, lr, 0, TUNE_LAM if method in LAM_ARGUMENT else None) for method in METHODS for lr in LRS]


def tuned(runs: list[results.Run]) -> dict[str, float]:
    """Method -> its chosen rate, for every method whose tuning is complete in ``runs``."""
    chosen = {}
    for method in METHODS:
        names = [r.name for r in tune_runs() if r.params["method"] == method]
        best = results.best_named(runs, names, lambda r: results.last(r, "val_acc_balanced"))
        if best is not None:
            chosen[method] = LRS[best]
    return chosen


def runs() -> list[Run]:
    plan = tune_runs() + [run("centralized", "feddro", lr, 0, TUNE_LAM, centralized=True) for lr in LRS]
    plan += [run("beta", "feddro", lr, 0, TUNE_LAM, beta=beta) for beta in BETAS for lr in LRS[1:]]
    chosen = tuned(results.load(RESULTS))
    missing = [m for m in METHODS if m not in chosen]
    if missing:
        warnings.warn(f"the table runs of {missing} are not planned: their rates come from the tune runs, "
                      f"which {RESULTS} lacks (python -m experiments.sweep feddro --only 'tune/*')")
    for seed in SEEDS:
        for method, lr in chosen.items():
            plan += [run("table", method, lr, seed, lam) for lam in (LAMS if method in LAM_ARGUMENT else (None,))]
    plan += [run("length", method, chosen[method], 0, TUNE_LAM if method in LAM_ARGUMENT else None, epochs=LONG_EPOCHS)
             for method in LONG_METHODS if method in chosen]
    plan += [run("paper_length", method, lr, seed, TUNE_LAM if method in LAM_ARGUMENT else None, epochs=PAPER_EPOCHS)
             for seed in SEEDS for method, lr in chosen.items()]
    if "feddro" in chosen:
        plan += [run("local_steps", "feddro", chosen["feddro"], seed, TUNE_LAM, i, SWEEP_ROUNDS)
                 for seed in SWEEP_SEEDS for i in LOCAL_STEPS]
    return plan
