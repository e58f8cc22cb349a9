"""The studies of ``docs/results/fedproxvr.md``: ``python -m experiments.sweep fedproxvr``.

Each run is a config of ``configs/fedproxvr/`` (a base and the row's override) with the seed (the
initialization, the batch order and the random choices; the data partition keeps seed 0, so every
run of a study sees the same federation), the number of rounds and the study's overrides. The
global model is evaluated before the first round and every ``every`` rounds on the global test
set (the union of the clients' test splits), on the pooled validation splits (what the tuning
chooses on) and on the pooled training splits (whose mean loss is the paper's training loss); the
Trainer's own validation is off.

Table 1's federation (``configs/fedproxvr/table1_mnist_logreg.yaml``): multinomial logistic
regression, 100 clients with two labels each and power-law sizes, MNIST standing in for the
paper's Fashion-MNIST, every client every round.

* ``table1_tune``: the learning-rate search, the same for every method: each of ``LR_GRID``,
  seed 0, ``TUNE_ROUNDS`` rounds; a method's rate is the one with the highest validation accuracy
  after the last round (:func:`tuned_lrs`, read from the document's result file);
* ``table1``: each method at its tuned rate, seeds 0-4, ``TABLE1_ROUNDS`` rounds;
* ``table1_long``: the same at the paper's round count, ``TABLE1_LONG_ROUNDS`` (seeds in order, as
  far as the CPU time went: the document says which);
* ``table1_same_work``: FedAvg at SVRG's local work (tau = 20, B = 32) and FedAvg's tuned rate, seeds
  0-4, ``TUNE_ROUNDS`` rounds: whether FedAvg's lead in ``table1`` comes from its smaller local work;
* ``fig2``: the beta and tau study (the paper's Fig. 2) at the authors' step sizes (spec section
  3: 0.005 at (beta, tau) = (5, 10), 0.003 at (7, 20)) and at tau = 40, above SARAH's Lemma-1
  bound of 27.1 at beta = 7; B = 32 and the same step size and tau for FedAvg; seeds 0-2;
* ``fig3``: the same settings on Table 2's federation (the paper's Fig. 3: MNIST at the paper's 30 %,
  the paper's CNN, 10 clients), B = 64, seeds 0-2, ``FIG3_ROUNDS`` rounds, on the batched client
  backend: for a GPU (a round of SVRG at tau = 40 took 80 s on one core of this CPU at 3 % of the data);
* ``mu``: the mu study (Fig. 4; ``configs/fedproxvr/mu_synthetic_logreg.yaml``: Synthetic(0, 0),
  B = 1, the authors' step size 0.3) scaled down to 20 clients and 25 rounds, seeds 0-2;
* ``mu_n100_r400``: the same at the paper's size, 100 clients, 400 rounds, with the batched client
  backend (equal to the sequential one to float tolerance, ``benchmarks/engine_equivalence.py``;
  0.1 CPU-s a round here against 1.7 sequentially, one thread: 100 clients x 20 steps of one sample);
* ``table2``: Table 2 (the paper's CNN, 10 clients) at the paper's data fraction (30 %) and rows
  (their step sizes untuned, the same rule for each: ``TABLE2``), seeds 0-4, 1000 rounds: for a GPU;
* ``table2_sarah_lr``: SARAH in Table 2's setting at the authors' smaller step sizes
  (``TABLE2_SARAH_LRS``), seeds 0-2: whether its divergence at 1 / (beta L) is the step size's;
* ``table2_tune``: Table 2's step-size search, the same for every row: each of ``TABLE2_LR_GRID``,
  seed 0, ``TABLE2_TUNE_ROUNDS`` rounds, chosen as Table 1's (:func:`tuned_lrs`);
* ``table2_tuned``: Table 2's rows at their chosen step sizes, seeds 0-4, 1000 rounds; each row planned
  once its search is complete in the document's result file. Both on the batched client backend: for a GPU.

``fig3`` ran on a GPU; ``table2_tune`` ran its first six rates there (0.0005-0.15) and its last two on a
CPU; ``table2_tuned`` is for a GPU, and advances on a CPU across sessions, all its runs together
(``--until-round``); ``table2`` and ``table2_sarah_lr`` ran in part (the document says how far).
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any, Optional

from experiments import results
from experiments.sweep import Run

RESULTS = Path(__file__).resolve().parents[2] / "docs" / "results" / "fedproxvr.json"
#: method -> (label, config files of configs/fedproxvr/ for Table 1)
TABLE1 = {"fedavg": ("FedAvg", ["table1_mnist_logreg.yaml", "table1/fedavg.yaml"]),
          "svrg": ("FedProxVR (SVRG)", ["table1_mnist_logreg.yaml"]),
          "sarah": ("FedProxVR (SARAH)", ["table1_mnist_logreg.yaml", "table1/sarah.yaml"])}
#: the learning rates every method is tuned over: half-decade steps through the authors' MNIST
#: rate (0.0005), their Fashion-MNIST rate (0.005) and the configs' 1/(beta L) with L = 2 (0.05),
#: and up to 1.5 (FedAvg's best rate was the largest, 0.15, of the first six)
LR_GRID = (0.0005, 0.0015, 0.005, 0.015, 0.05, 0.15, 0.5, 1.5)
TUNE_ROUNDS = 100
TABLE1_ROUNDS = 300
#: the paper's round count (about 1000): Table 1 run as long, where a CPU session affords it
TABLE1_LONG_ROUNDS = 1000
TABLE1_SEEDS = (0, 1, 2, 3, 4)
#: Fig. 2's settings: name -> (beta, tau, the authors' step size)
FIG2 = {"beta5_tau10": (5, 10, 0.005), "beta7_tau20": (7, 20, 0.003), "beta7_tau40": (7, 40, 0.003)}
FIG2_ROUNDS = 50
FIG3_ROUNDS = 50
MU = {"FedAvg": ["mu_synthetic_logreg.yaml", "mu/fedavg.yaml"]} | {
    f"FedProxVR ({e.upper()}) mu={m}": ["mu_synthetic_logreg.yaml", *o]
    for e, o in (("svrg", []), ("sarah", ["mu/sarah.yaml"])) for m in (0, 1, 4)}
MU_20 = ["--data.init_args.num_clients", "20", "--model.init_args.clients_per_round", "20"]
#: the full-size mu study: the batched client backend (100 clients of B = 1 steps)
BATCHED = ["--model.init_args.client_backend", "batched"]
#: Table 2's rows: method -> (label, config files, the step size they give: FedAvg's client rate,
#: 1 / (beta L) with the configs' beta and L = 2)
TABLE2 = {"fedavg": ("FedAvg", ["table2_mnist_cnn.yaml", "table2/fedavg.yaml"], 0.05),
          "svrg": ("FedProxVR (SVRG)", ["table2_mnist_cnn.yaml"], 1 / (10 * 2)),
          "sarah": ("FedProxVR (SARAH)", ["table2_mnist_cnn.yaml", "table2/sarah.yaml"], 1 / (9 * 2))}
TABLE2_ROUNDS = 1000
#: Table 2's step-size search, the same for every row: Table 1's grid, half-decade steps from the
#: authors' MNIST rate (0.0005) through their Fashion-MNIST rates (0.003-0.005) and the configs'
#: 1 / (beta L) (0.05-0.056) up to 1.5 (as in Table 1, FedAvg's best of the first six rates was the
#: largest, 0.15)
TABLE2_LR_GRID = LR_GRID
TABLE2_TUNE_ROUNDS = 100
TABLE2_SEEDS = (0, 1, 2, 3, 4)
#: SARAH's step sizes in Table 2's setting below the configs' 1 / (beta L) (which diverged): the
#: authors' Fashion-MNIST and MNIST rates (spec section 3)
TABLE2_SARAH_LRS = (0.005, 0.0005)
TABLE2_DATA = ["--data.init_args.partitioner.init_args.used_fraction", "0.3"]  # the paper's client sizes


def lr_overrides(method: str, lr: float) -> list[str]:
    """The arguments that set ``method``'s step size to ``lr`` (FedAvg: the client's SGD rate)."""
    if method == "fedavg":
        return ["--model.init_args.client.init_args.lr", str(lr)]
    return ["--model.init_args.lr", str(lr), "--model.init_args.beta", "null", "--model.init_args.smoothness", "null"]


def fit_args(configs: list[str], seed: int, rounds: int, overrides: list[str]) -> list[str]:
    """``fl-lightning fit`` arguments: the configs, the overrides, the seed and the rounds."""
    return [*(a for c in configs for a in ("--config", f"configs/fedproxvr/{c}")), *overrides,
            "--seed_everything", str(seed), "--model.init_args.seed", str(seed),
            "--trainer.max_epochs", str(rounds), "--trainer.limit_val_batches", "0"]


def table1_run(study: str, method: str, lr: float, seed: int, rounds: int, every: int = 10) -> Run:
    label, configs = TABLE1[method]
    params = dict(study=study, label=label, method=method, lr=lr, seed=seed, rounds=rounds)
    return Run(f"{study}/{method}_lr{lr}_s{seed}", fit_args(configs, seed, rounds, lr_overrides(method, lr)), params,
               every=every, at_start=True, train=True)


def table2_run(study: str, method: str, lr: float, seed: int, rounds: int) -> Run:
    """Table 2's row ``method`` at step size ``lr`` on the batched client backend (equal to the
    sequential one to float tolerance; what makes its 1000 rounds affordable on a GPU)."""
    label, configs, _ = TABLE2[method]
    params = dict(study=study, label=label, method=method, lr=lr, seed=seed, rounds=rounds)
    return Run(f"{study}/{method}_lr{lr}_s{seed}",
               fit_args(configs, seed, rounds, [*TABLE2_DATA, *lr_overrides(method, lr), *BATCHED]), params,
               every=10, at_start=True, train=True)


#: a step-size search: (its study, the methods it tunes, its grid)
TUNINGS = {"table1": ("table1_tune", TABLE1, LR_GRID), "table2": ("table2_tune", TABLE2, TABLE2_LR_GRID)}


def tuned_lrs(runs: Optional[list[results.Run]] = None, table: str = "table1") -> dict[str, float]:
    """Each method's rate for ``table`` (``table1``, ``table2``): the highest validation accuracy after
    the last round among its search's runs (:data:`TUNINGS`; ties: the smaller rate). A method whose
    search has a run missing or stopped has none yet; every method searches the same grid, and its
    choice reads its own runs only."""
    runs = results.load(RESULTS) if runs is None else runs
    study, methods, grid = TUNINGS[table]
    tune = {(r["params"]["method"], r["params"]["lr"]): r for r in results.select(runs, study=study)
            if "stopped" not in r}
    return {m: max(grid, key=lambda lr: (results.last(tune[m, lr], "val_acc"), -lr)) for m in methods
            if all((m, lr) in tune for lr in grid)}


def runs() -> list[Run]:
    plan = [table1_run("table1_tune", m, lr, 0, TUNE_ROUNDS) for m in TABLE1 for lr in LR_GRID]
    chosen = tuned_lrs()
    searched = set(chosen) == set(TABLE1)
    if not searched:
        warnings.warn(f"the table1 runs are not planned: their rates come from the table1_tune runs, which "
                      f"{RESULTS} lacks (python -m experiments.sweep fedproxvr --only 'table1_tune/*' --out {RESULTS})")
    else:
        plan += [table1_run("table1", m, chosen[m], s, TABLE1_ROUNDS) for s in TABLE1_SEEDS for m in TABLE1]
        plan += [table1_run("table1_long", m, chosen[m], s, TABLE1_LONG_ROUNDS) for s in TABLE1_SEEDS for m in TABLE1]
    if searched:
        same_work = ["--model.init_args.local_steps", "20", "--data.init_args.batch_size", "32"]
        for seed in TABLE1_SEEDS:
            label, configs = TABLE1["fedavg"]
            lr = chosen["fedavg"]
            params = dict(study="table1_same_work", label=f"{label} (tau 20, B 32)", method="fedavg", lr=lr, seed=seed,
                          rounds=TUNE_ROUNDS)
            plan.append(Run(f"table1_same_work/fedavg_lr{lr}_s{seed}",
                            fit_args(configs, seed, TUNE_ROUNDS, [*lr_overrides("fedavg", lr), *same_work]), params,
                            every=10, at_start=True, train=True))
    # Fig. 2 on Table 1's federation, Fig. 3 on Table 2's: the same settings and step sizes
    for study, methods, batch, data, backend, rounds in (
            ("fig2", TABLE1, 32, [], [], FIG2_ROUNDS),
            ("fig3", {m: row[:2] for m, row in TABLE2.items()}, 64, TABLE2_DATA, BATCHED, FIG3_ROUNDS)):
        for setting, (beta, tau, lr) in FIG2.items():
            for method, (label, configs) in methods.items():
                for seed in (0, 1, 2):
                    overrides = [*data, *lr_overrides(method, lr), "--model.init_args.local_steps", str(tau),
                                 "--data.init_args.batch_size", str(batch), *backend]
                    params = dict(study=study, setting=setting, beta=beta, tau=tau, label=label, method=method,
                                  lr=lr, seed=seed, rounds=rounds)
                    plan.append(Run(f"{study}/{setting}/{method}_s{seed}", fit_args(configs, seed, rounds, overrides),
                                    params, every=5, at_start=True, train=True))
    for study, rounds, every, overrides in (("mu", 25, 1, MU_20), ("mu_n100_r400", 400, 10, BATCHED)):
        for label, configs in MU.items():
            mu = ["--model.init_args.mu", label.rsplit("=", 1)[1]] if " mu=" in label else []
            for seed in (0, 1, 2):
                params = dict(study=study, label=label, seed=seed, rounds=rounds, lr=0.3)
                plan.append(Run(f"{study}/{slug(label)}_s{seed}", fit_args(configs, seed, rounds, [*mu, *overrides]),
                                params, every=every, at_start=True, train=True))
    for seed in TABLE2_SEEDS:
        for label, configs, lr in TABLE2.values():
            params = dict(study="table2", label=label, lr=round(lr, 4), seed=seed, rounds=TABLE2_ROUNDS)
            plan.append(Run(f"table2/{slug(label)}_s{seed}", fit_args(configs, seed, TABLE2_ROUNDS, TABLE2_DATA), params,
                            every=10, at_start=True, train=True))
    for seed in (0, 1, 2):
        for lr in TABLE2_SARAH_LRS:
            _, configs, _ = TABLE2["sarah"]
            params = dict(study="table2_sarah_lr", label=f"FedProxVR (SARAH), step size {lr}", lr=lr, seed=seed,
                          rounds=TABLE2_ROUNDS)
            plan.append(Run(f"table2_sarah_lr/sarah_lr{lr}_s{seed}",
                            fit_args(configs, seed, TABLE2_ROUNDS, [*TABLE2_DATA, *lr_overrides("sarah", lr)]), params,
                            every=10, at_start=True, train=True))
    plan += [table2_run("table2_tune", m, lr, 0, TABLE2_TUNE_ROUNDS) for m in TABLE2 for lr in TABLE2_LR_GRID]
    chosen2 = tuned_lrs(table="table2")
    plan += [table2_run("table2_tuned", m, chosen2[m], s, TABLE2_ROUNDS) for s in TABLE2_SEEDS for m in TABLE2
             if m in chosen2]
    return plan


def slug(label: str) -> str:
    """``FedProxVR (SVRG) mu=0`` -> ``svrg_mu0``."""
    return label.replace("FedProxVR (", "").replace(")", "").replace(" mu=", "_mu").lower()


def summary(cli: Any) -> dict[str, Any]:
    """The federation: training split sizes and the number of test samples."""
    dm = cli.datamodule
    sizes = [len(s) for s in dm.splits["train"]]
    return {"train_sizes": dict(min=min(sizes), max=max(sizes), total=sum(sizes), clients=len(sizes)),
            "test_samples": len(dm.global_test_set())}
