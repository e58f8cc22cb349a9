"""The MNIST-ST runs of ``docs/results/feddro.md``: ``python -m experiments.sweep feddro``.

LeNet, 8 clients (equal random split of MNIST-ST), batch 16, 50 rounds of I = 8 local steps,
evaluation every 5 rounds (``configs/feddro/mnist_st.yaml``). The seed sets the data split, the
batch order and the initialization. The runs:

1. the three algorithms at a common setting (lr 0.05, lambda 2, beta 0.5), seeds 0, 1 and 2;
2. FedDRO, unstable there: a small tuning on seed 0 (lr 0.02; beta 1; lambda 5);
3. the stable FedDRO setting (lambda 5) on seeds 1 and 2;
4. FedDRO's I sweep at 25 model-averaging rounds (I = 8 is read from the 50-round runs);
5. the vanilla compositional baseline at lambda 5 (FedDRO's stable objective), seeds 0, 1, 2.
"""

from __future__ import annotations

from typing import Optional

from experiments.sweep import Run

BASE = "configs/feddro/mnist_st.yaml"
METHOD = {"fedavg": "configs/feddro/methods/fedavg.yaml", "compfedavg": "configs/feddro/methods/compfedavg.yaml"}


def run(algorithm: str, seed: int, lam: Optional[float] = None, beta: Optional[float] = None, lr: float = 0.05,
        local_steps: int = 8, rounds: int = 50) -> Run:
    """One run; ``lam`` (compositional algorithms) and ``beta`` (FedDRO) as the tables name them."""
    args = ["--config", BASE]
    if algorithm in METHOD:
        args += ["--config", METHOD[algorithm]]
    args += ["--seed_everything", str(seed), "--model.init_args.seed", str(seed), "--data.init_args.seed", str(seed)]
    if lam is not None:
        args += ["--model.init_args.objective.init_args.lam", str(lam)]
    if beta is not None:
        args += ["--model.init_args.beta", str(beta)]
    if lr != 0.05:
        args += ["--model.init_args.client.init_args.lr", str(lr)]
    if local_steps != 8:
        args += ["--model.init_args.local_steps", str(local_steps)]
    if rounds != 50:
        args += ["--trainer.max_epochs", str(rounds)]
    name = "_".join([algorithm, *([f"lam{lam:g}"] if lam is not None else []), *([f"beta{beta:g}"] if beta is not None else []),
                     *([f"lr{lr:g}"] if lr != 0.05 else []), *([f"I{local_steps}"] if local_steps != 8 else []),
                     *([f"r{rounds}"] if rounds != 50 else []), f"s{seed}"])
    params = dict(algorithm=algorithm, seed=seed, local_steps=local_steps, rounds=rounds, lr=lr, lam=lam, beta=beta)
    return Run(name, args, params, every=5, metrics=("class/", "feddro/"))


def runs() -> list[Run]:
    common = [run(a, s, **({} if a == "fedavg" else {"lam": 2.0}), **({"beta": 0.5} if a == "feddro" else {}))
              for s in (0, 1, 2) for a in ("fedavg", "compfedavg", "feddro")]
    tuning = [run("feddro", 0, lam=2.0, beta=0.5, lr=0.02), run("feddro", 0, lam=2.0, beta=1.0),
              run("feddro", 0, lam=5.0, beta=0.5)]
    stable = [run("feddro", s, lam=5.0, beta=0.5) for s in (1, 2)]
    sweep = [run("feddro", 0, lam=5.0, beta=0.5, local_steps=i, rounds=25) for i in (1, 2, 4, 16)]
    baseline = [run("compfedavg", s, lam=5.0) for s in (0, 1, 2)]
    return common + tuning + stable + sweep + baseline
