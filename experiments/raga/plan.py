"""The MNIST runs of ``docs/results/raga.md``: ``python -m experiments.sweep raga``.

50 clients, Dirichlet(0.6), batch 512, full participation, seed 0 for everything, the first
``rounds`` rounds of the T = 1000 schedule (``configs/raga/mnist_mlp.yaml``,
``configs/raga/mnist_lenet.yaml``). The attack-free run of a method serves every attack's table.

* the MLP grid, 20 rounds: the four methods x Gaussian, sign flip and ALIE at every fraction;
* the MLP, 60 rounds: RAGA and FedAvg, Gaussian attack at 0 and 0.4;
* the MLP, 200 rounds: the four methods x the three attacks at every fraction;
* LeNet, 20 rounds (RAGA and FedAvg) and 60 rounds (the four methods), Gaussian at 0 and 0.4;
* the MLP, the paper's 1000 rounds: the four methods, Gaussian at 0 and 0.4.
"""

from __future__ import annotations

from typing import Any

from experiments.sweep import Run
from fl_lightning.callbacks.attacks import ByzantineAttack

METHODS = ("raga", "fedavg", "rfa", "byrdsaga")
ATTACKS = {"gaussian": "GaussianAttack", "signflip": "SignFlipAttack", "alie": "ALIEAttack"}
FRACTIONS = (0.1, 0.2, 0.3, 0.4)


def run(model: str, rounds: int, every: int, method: str, attack: str, fraction: float) -> Run:
    """One run; ``attack`` is ``"none"`` at fraction 0."""
    args = ["--config", f"configs/raga/mnist_{model}.yaml"]
    if method != "raga":
        args += ["--config", f"configs/raga/methods/{method}.yaml"]
    args += ["--trainer.max_epochs", str(rounds), "--trainer.check_val_every_n_epoch", str(every)]
    if attack != "none":
        args += [f"--trainer.callbacks+=fl_lightning.callbacks.attacks.{ATTACKS[attack]}",
                 f"--trainer.callbacks.fraction={fraction}"]
    params = dict(model=model, rounds=rounds, method=method, attack=attack, fraction=fraction)
    return Run(f"{model}_r{rounds}/{method}_{attack}_{fraction:g}", args, params, every=every)


def grid(model: str, rounds: int, every: int, methods=METHODS, attacks=tuple(ATTACKS), fractions=FRACTIONS) -> list[Run]:
    """The attack-free run of each method, then every attack at every fraction."""
    return [run(model, rounds, every, m, "none", 0.0) for m in methods] + [
        run(model, rounds, every, m, a, f) for a in attacks for f in fractions for m in methods]


def runs() -> list[Run]:
    return (grid("mlp", 20, 5) + grid("mlp", 60, 10, ("raga", "fedavg"), ("gaussian",), (0.4,))
            + grid("mlp", 200, 10) + grid("lenet", 20, 5, ("raga", "fedavg"), ("gaussian",), (0.4,))
            + grid("lenet", 60, 10, attacks=("gaussian",), fractions=(0.4,))
            + grid("mlp", 1000, 50, attacks=("gaussian",), fractions=(0.4,)))


def summary(cli: Any) -> dict[str, Any]:
    """The Byzantine clients the attack chose: their share of the training data and their number."""
    attack = next((c for c in cli.trainer.callbacks if isinstance(c, ByzantineAttack)), None)
    if attack is None:
        return {"achieved_fraction": 0.0, "num_byzantine": 0}
    return {"achieved_fraction": attack.achieved_fraction, "num_byzantine": len(attack.byzantine)}
