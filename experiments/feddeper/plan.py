"""The MNIST-MLP runs of ``docs/results/feddeper.md`` (Table I (a), n = 10): ``python -m experiments.sweep feddeper``.

``configs/feddeper/mnist_mlp.yaml`` (FedDeper, m = 5) and the method overrides; the global model
and the clients' local test sets evaluated every 10 rounds. Names: the cell (``m5``, ``m10``)
and the run, e.g. ``m5/feddeper_500``.

* m = 5 and m = 10, the five methods, 500 rounds (FedDeper and FedAvg at m = 5 also on the local
  test sets with 1 and 3 classes added); at m = 5 also the first session's 250-round runs;
* the sweep around FedDeper's setting, one change per run (``sweep_*``), 500 rounds, and the two
  150-round probes of the first session; ``m5/sweep_twin_500`` is the base run again (it compared
  two versions of the engine).
"""

from __future__ import annotations

from experiments.sweep import Run

BASE = "configs/feddeper/mnist_mlp.yaml"
METHODS = ("feddeper", "feddeper_star", "scaffold", "fedavg", "fedprox")
PERSONAL = "--trainer.callbacks+=fl_lightning.callbacks.personalized.PersonalizedAccuracy"
EXTRA_CLASSES = [PERSONAL, "--trainer.callbacks.extra_classes=1", PERSONAL, "--trainer.callbacks.extra_classes=3"]
#: sweep run -> (method, its overrides)
SWEEP_M5 = {
    "rho0.01_500": ("feddeper", ["--model.init_args.rho", "0.01"]),
    "rho0.05_500": ("feddeper", ["--model.init_args.rho", "0.05"]),
    "lam1.0_500": ("feddeper", ["--model.init_args.lam", "1.0"]),
    "lam0.3_500": ("feddeper", ["--model.init_args.lam", "0.3"]),
    "batch32_500": ("feddeper", ["--data.init_args.batch_size", "32"]),
    "fedavg_batch32_500": ("fedavg", ["--data.init_args.batch_size", "32"]),
    "raw_pixels_500": ("feddeper", ["--data.init_args.normalize", "false"]),
    "fedavg_raw_pixels_500": ("fedavg", ["--data.init_args.normalize", "false"]),
    "indep_500": ("feddeper", ["--model.init_args.independent_batches", "true"]),
    "gauss_seidel_500": ("feddeper", ["--model.init_args.update_order", "gauss_seidel"]),
    "seed1_500": ("feddeper", ["--seed_everything", "1", "--model.init_args.seed", "1", "--data.init_args.seed", "1"]),
    "twin_500": ("feddeper", []),
    "rho0.1": ("feddeper", ["--model.init_args.rho", "0.1", "--trainer.max_epochs", "150"]),
    "batch32": ("feddeper", ["--data.init_args.batch_size", "32", "--trainer.max_epochs", "150"]),
}
SWEEP_M10 = {
    "rho0.05": ("feddeper", ["--model.init_args.rho", "0.05"]),
    "rho0.1": ("feddeper", ["--model.init_args.rho", "0.1"]),
    "rho0.1_lam1.0": ("feddeper", ["--model.init_args.rho", "0.1", "--model.init_args.lam", "1.0"]),
}


def run(m: int, name: str, method: str, overrides: list[str]) -> Run:
    """A run of the cell with ``m`` clients per round: ``method`` with ``overrides``."""
    args = ["--config", BASE]
    if method != "feddeper":
        args += ["--config", f"configs/feddeper/methods/{method}.yaml"]
    if m != 5:
        args += ["--model.init_args.clients_per_round", str(m)]
    rounds = int(overrides[overrides.index("--trainer.max_epochs") + 1]) if "--trainer.max_epochs" in overrides else 500
    return Run(f"m{m}/{name}", [*args, *overrides], dict(m=m, method=method, rounds=rounds), every=10,
               metrics=("local",))


def runs() -> list[Run]:
    table = [run(5, f"{m}_500", m, EXTRA_CLASSES if m in ("feddeper", "fedavg") else []) for m in METHODS]
    table += [run(5, m, m, ["--trainer.max_epochs", "250"]) for m in METHODS]
    table += [run(10, f"{m}_500", m, []) for m in METHODS]
    sweep = [run(5, f"sweep_{name}", m, o) for name, (m, o) in SWEEP_M5.items()]
    sweep += [run(10, f"sweep_{name}", m, o) for name, (m, o) in SWEEP_M10.items()]
    return table + sweep
