"""The MNIST-MLP runs of ``docs/results/raga.md``: ``python -m experiments.sweep raga``.

Every run is ``configs/raga/mnist_mlp.yaml`` (50 clients, Dirichlet(0.6), batch 512, full
participation, K = 3 local steps, the paper's schedule ``eta^t = T / (100 t + 10 T)`` with
T = 1000) with a method's override (``configs/raga/methods/``), the run's settings and seed (the
initialization and the batch order; the data split keeps seed 0, so every run sees the same
federation and validation splits: 10 % of each client's data), the clients trained together by the
batched backend. The global model is evaluated every 10 rounds on the MNIST test set and on the
pooled validation splits (by the sweep's recorder; Lightning's own validation loop is off).

* ``control`` (the step-size control experiment), attack-free, 1000 rounds, seeds 0-2: RAGA's
  server step is ``w <- w - eta^t GM(g_i)`` with ``g_i`` the mean of a client's K gradients, while
  FedAvg's and RFA's is ``w <- w + server_lr * agg(delta_i)`` with ``delta_i`` the sum of K local
  steps, about ``-K eta^t g_i``: K times RAGA's. FedAvg and RFA run at ``server_lr = 1/K``
  (``CONTROL_SERVER_LR``), which scales their step to RAGA's, and at their default 1. If the 1/K
  runs land on RAGA's curve, RAGA's attack-free deficit is its step size, not its aggregation.
  Runs are ordered by seed, so that a sweep stopped early has every setting at the first seeds.
"""

from __future__ import annotations

from typing import Any, Optional

from experiments.sweep import Run
from fl_lightning.callbacks.attacks import ByzantineAttack

BASE = "configs/raga/mnist_mlp.yaml"
ROUNDS = 1000
EVERY = 10
SEEDS = (0, 1, 2)
LOCAL_STEPS = 3
#: the server rate that scales FedAvg's and RFA's step to RAGA's: 1/K
CONTROL_SERVER_LR = 1 / LOCAL_STEPS
#: the control study's settings: (method, server_lr; None for RAGA, which has no server rate of its own)
CONTROL = (("raga", None), ("fedavg", CONTROL_SERVER_LR), ("rfa", CONTROL_SERVER_LR), ("fedavg", 1.0), ("rfa", 1.0))
ATTACKS = {"gaussian": "GaussianAttack", "signflip": "SignFlipAttack", "alie": "ALIEAttack", "ipm": "IPMAttack",
           "scaling": "ScalingAttack", "labelflip": "LabelFlipAttack"}


def run(study: str, method: str, seed: int, server_lr: Optional[float] = None, attack: str = "none",
        fraction: float = 0.0, rounds: int = ROUNDS) -> Run:
    """``method`` (``raga``, ``fedavg``, ``rfa``, ``byrdsaga``) with ``seed``; ``attack`` is ``"none"`` at fraction 0."""
    args = ["--config", BASE]
    if method != "raga":
        args += ["--config", f"configs/raga/methods/{method}.yaml"]
    if server_lr is not None:
        args += ["--model.init_args.server_lr", repr(server_lr)]
    if attack != "none":
        args += [f"--trainer.callbacks+=fl_lightning.callbacks.attacks.{ATTACKS[attack]}",
                 f"--trainer.callbacks.fraction={fraction}"]
    args += ["--model.init_args.client_backend", "batched", "--seed_everything", str(seed), "--model.init_args.seed",
             str(seed), "--trainer.max_epochs", str(rounds), "--trainer.limit_val_batches", "0"]
    params = dict(study=study, method=method, server_lr=server_lr, attack=attack, fraction=fraction, seed=seed,
                  rounds=rounds)
    slr = "" if server_lr is None else f"_slr{server_lr:.3g}"
    return Run(f"{study}/{method}{slr}_{attack}_{fraction:g}_s{seed}", args, params, every=EVERY)


def runs() -> list[Run]:
    return [run("control", method, seed, server_lr) for seed in SEEDS for method, server_lr in CONTROL]


def summary(cli: Any) -> dict[str, Any]:
    """The Byzantine clients the attack chose (their share of the training data and their number),
    and the federation's training and validation split sizes."""
    attack = next((c for c in cli.trainer.callbacks if isinstance(c, ByzantineAttack)), None)
    dm = cli.datamodule
    return {"achieved_fraction": 0.0 if attack is None else attack.achieved_fraction,
            "num_byzantine": 0 if attack is None else len(attack.byzantine),
            "train_samples": sum(len(s) for s in dm.splits["train"]),
            "val_samples": sum(len(s) for s in dm.splits["val"])}
