"""A small plan on the quickstart's federation (30 generated clients, no download; seconds a run):
the sweep runner on data every checkout has, and its test.

    python -m experiments.sweep quickstart --list
    python -m experiments.sweep quickstart --jobs 2 --out runs/quickstart.json

FedAvg of ``configs/quickstart.yaml`` at each client rate of ``LRS`` and each seed of ``SEEDS``,
``ROUNDS`` rounds, evaluated every 5 rounds on the global test set and the validation splits.
"""

from __future__ import annotations

from experiments.sweep import Run

CONFIG = "configs/quickstart.yaml"
LRS = (0.01, 0.05, 0.2)
SEEDS = (0, 1)
ROUNDS = 10


def run(lr: float, seed: int, rounds: int = ROUNDS) -> Run:
    """FedAvg on the quickstart federation at client rate ``lr`` with ``seed``."""
    args = ["--config", CONFIG, "--model.init_args.client.init_args.lr", repr(lr), "--seed_everything", str(seed),
            "--model.init_args.seed", str(seed), "--trainer.max_epochs", str(rounds)]
    return Run(f"fedavg_lr{lr:g}_s{seed}", args, dict(method="fedavg", lr=lr, seed=seed, rounds=rounds), every=5)


def runs() -> list[Run]:
    return [run(lr, seed) for seed in SEEDS for lr in LRS]
