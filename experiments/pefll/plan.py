"""The MNIST runs of ``docs/results/pefll.md``: ``python -m experiments.sweep pefll``.

Every run is ``configs/pefll/mnist.yaml`` (Table 1's MNIST analogue: 100 clients with 2 classes
each, 10 % of them unseen, each client's data split 70/15/15 into train / val / test; 5 clients per
round x 50 local steps) with a method's override (``configs/pefll/methods/``), its learning rate,
its rounds and its seed (the initialization, the client sampling and the batches; the data split
keeps seed 0, so every run sees the same federation). The sweep records the logged per-client
figures at every validation (``EVERY`` rounds): the mean over clients of each client's accuracy
with its own model (PeFLL's and pFedHN's generated one, Local's own, FedAvg's global one) on the
seen clients' val and test splits and on the unseen clients' test splits, and for FedAvg the same
after 50 local finetuning steps (FedAvg + finetuning).

* ``tune`` (equal for every method), ``TUNE_ROUNDS`` rounds, seed 0: each method's learning rate
  searched over the same four multiples of its reference value (``GRID``: one half-decade below,
  up to a decade above, as these runs are far shorter than the paper's 5000 rounds), ``RATES``:
  PeFLL's server Adam rate (paper 2e-4), pFedHN's server SGD rate (reference 1e-2), FedAvg's and
  Local's client SGD rate (1e-2). A setting's score is its seen clients' mean validation accuracy
  at the last evaluation; the highest is chosen (ties: the smaller rate), FedAvg's and FedAvg +
  finetuning's each on its own validation figure, from the same runs.
* ``table`` (Table 1 and 2's layout), ``TABLE_ROUNDS`` rounds, seeds 0-2: each method at its
  chosen rate, and PeFLL's label-free embedding (Table 2) at PeFLL's; planned once the tuning is
  complete in the document's result file.
* ``clients`` (Table 1's 500 and 1000 clients), ``CLIENTS_ROUNDS`` rounds evaluated every
  ``CLIENTS_EVERY``, seeds 0-2: the table's methods at their chosen rates with ``n`` clients, 5 % of
  them per round (:func:`per_round`) and descriptor / embedding length ``l = int(1 + n / 4)``. Each
  client takes part in 5 rounds on average, as in the table's first 100 rounds, which the report
  sets beside them (the paper runs 5000 rounds at every n: 250 visits per client). At the table's
  500 rounds a run would take 5 (n = 500) and 10 (n = 1000) times a table run, 30 runs about 45
  CPU hours here; at 100 rounds about 16 (pFedHN and FedAvg + finetuning the longest).
* ``clients_long``: PeFLL and FedAvg (+ finetuning) at n = 500 for ``LONG_ROUNDS`` rounds evaluated
  every ``LONG_EVERY``, seeds 0-2, at the same rates: the experiment on why FedAvg + finetuning beats
  PeFLL on the unseen clients at 100 rounds, where PeFLL's accuracy still rises (by a point over
  its last 25 rounds) and FedAvg + finetuning's has been flat since round 50. If PeFLL is only
  slower to train, 3x the rounds closes the gap.

Budgets. pFedHN takes one client per server step (its reference code), so it runs as many times
the rounds as the others take clients per round (and evaluates as many times less often): every
method trains the same number of clients for the same number of local steps. Local only trains
each client alone once (one round) for the paper's 200 epochs. Runs are ordered by seed, so that a
sweep stopped early has every method at the first seeds.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

from experiments import results
from experiments.sweep import Run

RESULTS = Path(__file__).resolve().parents[2] / "docs" / "results" / "pefll.json"
BASE = "configs/pefll/mnist.yaml"
NUM_CLIENTS = 100
TUNE_ROUNDS = 200
TABLE_ROUNDS = 500
EVERY = 50
#: the clients study's rounds and evaluation interval (see the module's docstring)
CLIENTS_ROUNDS = 100
CLIENTS_EVERY = 25
#: the longer runs at n = 500 (``clients_long``)
LONG_ROUNDS = 300
LONG_EVERY = 50
SEEDS = (0, 1, 2)
#: method -> (the argument that sets its learning rate, its reference value)
RATES = {
    "pefll": ("--model.init_args.server_lr", 2e-4),
    "pfedhn": ("--model.init_args.server_lr", 1e-2),
    "fedavg": ("--model.init_args.client.init_args.lr", 1e-2),
    "local": ("--model.init_args.client.init_args.lr", 1e-2),
}
#: the multiples of the reference rate every method's search tries
GRID = (0.316, 1.0, 3.16, 10.0)
#: what a table row is chosen on: row -> (the tuned method's runs, the validation figure)
CHOICES = {
    "pefll": ("pefll", "clients_val/acc_mean"),
    "pfedhn": ("pfedhn", "clients_val/acc_mean"),
    "fedavg": ("fedavg", "clients_val/acc_mean"),
    "fedavg_ft": ("fedavg", "finetuned_val/acc_mean"),
    "local": ("local", "clients_val/acc_mean"),
}
#: the clients study's federation sizes
CLIENT_COUNTS = (500, 1000)


def rates(method: str) -> list[float]:
    """``method``'s learning-rate search: :data:`GRID` times its reference rate (3 significant digits)."""
    return [float(f"{factor * RATES[method][1]:.3g}") for factor in GRID]


def per_round(num_clients: int) -> int:
    """Clients per round of every method but pFedHN (one per server step): the paper's 5 %."""
    return max(1, num_clients // 20)


def descriptor_dim(num_clients: int) -> int:
    """The paper's descriptor (and pFedHN's embedding) length for ``num_clients``: ``int(1 + n / 4)``."""
    return int(1 + num_clients / 4)


def run(study: str, method: str, lr: float, seed: int, rounds: int, num_clients: int = NUM_CLIENTS,
        every: int = EVERY) -> Run:
    """``method`` (``pefll``, ``pefll_nolabels``, ``pfedhn``, ``fedavg``, ``local``) at learning rate
    ``lr`` (:data:`RATES`; the label-free PeFLL's is PeFLL's), ``rounds`` rounds of a method that
    takes :func:`per_round` clients per round, evaluated every ``every`` such rounds."""
    config = "pefll" if method == "pefll_nolabels" else method
    args = ["--config", BASE]
    if config != "pefll":
        args += ["--config", f"configs/pefll/methods/{config}.yaml"]
    args += [RATES[config][0], repr(lr)]
    if method == "pefll_nolabels":
        args += ["--model.init_args.embedding.init_args.use_labels", "false"]
    if num_clients != NUM_CLIENTS:
        dim = descriptor_dim(num_clients)
        args += ["--data.init_args.num_clients", str(num_clients)]
        if config not in ("pfedhn", "local"):  # pFedHN takes one client per step, Local every client once
            args += ["--model.init_args.clients_per_round", str(per_round(num_clients))]
        if config == "pefll":
            args += ["--model.init_args.embedding.init_args.descriptor_dim", str(dim)]
        elif config == "pfedhn":
            args += ["--model.init_args.embedding_dim", str(dim)]
    trained = rounds
    if config == "pfedhn":
        rounds, every = rounds * per_round(num_clients), every * per_round(num_clients)
    if config == "local":  # each client once, alone: one round, evaluated after it
        rounds, every = 1, 1
    args += ["--seed_everything", str(seed), "--model.init_args.seed", str(seed), "--trainer.max_epochs", str(rounds),
             "--trainer.check_val_every_n_epoch", str(every)]
    params = dict(study=study, method=method, lr=lr, seed=seed, rounds=rounds, client_rounds=trained,
                  num_clients=num_clients)
    size = "" if num_clients == NUM_CLIENTS else f"_n{num_clients}"
    return Run(f"{study}/{method}_lr{lr:g}{size}_s{seed}", args, params, every=every,
               metrics=("clients_", "finetuned_"))


def tune_runs(method: str) -> list[Run]:
    """``method``'s tuning: one run per rate of its search, seed 0."""
    return [run("tune", method, lr, 0, TUNE_ROUNDS) for lr in rates(method)]


def tuned(runs: list[results.Run]) -> dict[str, float]:
    """Table row (:data:`CHOICES`) -> its chosen rate, for every row whose tuning is complete in ``runs``."""
    chosen = {}
    for row, (method, key) in CHOICES.items():
        best = results.best_named(runs, [r.name for r in tune_runs(method)], lambda r, k=key: results.last(r, k))
        if best is not None:
            chosen[row] = rates(method)[best]
    return chosen


def table_settings(chosen: dict[str, float]) -> list[tuple[str, float]]:
    """The (method, rate) pairs the table trains: each tuned row's (FedAvg and FedAvg + finetuning
    share their runs when they chose the same rate) and PeFLL's label-free variant at PeFLL's rate."""
    settings: list[tuple[str, float]] = []
    for row, lr in chosen.items():
        setting = (CHOICES[row][0], lr)
        if setting not in settings:
            settings.append(setting)
        if row == "pefll":
            settings.append(("pefll_nolabels", lr))
    return settings


def runs() -> list[Run]:
    plan = [r for method in RATES for r in tune_runs(method)]
    chosen = tuned(results.load(RESULTS))
    missing = [row for row in CHOICES if row not in chosen]
    if missing:
        warnings.warn(f"the table and clients runs of {missing} are not planned: their rates come from the tune runs, "
                      f"which {RESULTS} lacks (python -m experiments.sweep pefll --only 'tune/*')")
    settings = table_settings(chosen)
    plan += [run("table", method, lr, seed, TABLE_ROUNDS) for seed in SEEDS for method, lr in settings]
    plan += [run("clients", method, lr, seed, CLIENTS_ROUNDS, n, CLIENTS_EVERY) for n in CLIENT_COUNTS
             for seed in SEEDS for method, lr in settings]
    plan += [run("clients_long", method, lr, seed, LONG_ROUNDS, 500, LONG_EVERY) for seed in SEEDS
             for method, lr in settings if method in ("pefll", "fedavg")]
    return plan


def summary(cli: Any) -> dict[str, int]:
    """The federation: seen and unseen clients, and the pooled train / val / test split sizes."""
    dm = cli.datamodule
    return {"seen_clients": len(dm.train_clients), "unseen_clients": len(dm.unseen_clients),
            **{f"{split}_samples": sum(len(s) for s in dm.splits[split]) for split in ("train", "val", "test")}}
