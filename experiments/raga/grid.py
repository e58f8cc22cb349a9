"""RAGA's MNIST experiment (Table II of Zuo et al., 2024, scaled to a CPU): methods x fractions x attacks.

Each run: 50 clients, Dirichlet(0.6), batch 512, full participation, K = 3 (Byrd-SAGA: one
SAGA step, gamma = 0.1), the paper schedule ``eta^t = T/(100t + 10T)`` with T = --horizon
(default 1000, the paper's MNIST T), stopped after --rounds rounds: the first rounds of the
paper's run, when --rounds < --horizon.
FedAvg is ``RFA`` with the ``WeightedMean`` aggregator (same local rule and schedule as RFA).
One JSON line per run is appended to --out (runs already there are skipped, so the grid resumes).

    python experiments/raga/grid.py --model mlp --rounds 30 --out experiments/raga/results/mlp.jsonl
"""

from __future__ import annotations

import argparse
import json
import os
import time
from typing import Any, Optional

import pytorch_lightning as pl
import torch

from experiments.curve import Curve
from fl_lightning.algorithms.byrd_saga import ByrdSAGA
from fl_lightning.algorithms.raga import RAGA
from fl_lightning.algorithms.rfa import RFA
from fl_lightning.callbacks.aggregation import WeightedMean
from fl_lightning.callbacks.attacks import ALIEAttack, GaussianAttack, IPMAttack, LabelFlipAttack, SignFlipAttack
from fl_lightning.datamodules import MNISTFederated
from fl_lightning.models import MLP, LeNet

METHODS = ("raga", "fedavg", "rfa", "byrdsaga")
ATTACKS = {
    "gaussian": lambda f: GaussianAttack(fraction=f),
    "signflip": lambda f: SignFlipAttack(fraction=f, scale=3.0),
    "alie": lambda f: ALIEAttack(fraction=f),
    "ipm": lambda f: IPMAttack(fraction=f, epsilon=0.1),
    "labelflip": lambda f: LabelFlipAttack(fraction=f),
}


def client(model: str, seed: int) -> pl.LightningModule:
    """The client model, initialized from ``seed`` (the same for every method)."""
    torch.manual_seed(seed)
    return MLP(hidden=(100,), lr=0.1) if model == "mlp" else LeNet(lr=0.1)


def module(method: str, model: str, horizon: int, seed: int) -> tuple[pl.LightningModule, list[pl.Callback]]:
    """The algorithm and its extra callbacks."""
    common: dict[str, Any] = {"clients_per_round": 50, "seed": seed}
    if method == "raga":
        return RAGA(client(model, seed), total_rounds=horizon, local_steps=3, **common), []
    if method == "rfa":
        return RFA(client(model, seed), total_rounds=horizon, local_steps=3, **common), []
    if method == "fedavg":
        return RFA(client(model, seed), total_rounds=horizon, local_steps=3, **common), [WeightedMean()]
    return ByrdSAGA(client(model, seed), step_size=0.1, **common), []


def run(dm: MNISTFederated, method: str, model: str, attack: str, fraction: float, rounds: int, horizon: int,
        eval_every: int, seed: int, accelerator: str = "cpu") -> dict[str, Any]:
    """One run; returns its record."""
    algo, callbacks = module(method, model, horizon, seed)
    curve = Curve()
    callbacks.append(curve)
    byz: Optional[Any] = None
    if fraction > 0:
        byz = ATTACKS[attack](fraction)
        callbacks.append(byz)
    trainer = pl.Trainer(
        max_epochs=rounds, accelerator=accelerator, devices=1, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
        check_val_every_n_epoch=eval_every, callbacks=callbacks,
    )
    start = time.time()
    trainer.fit(algo, dm)
    wall = time.time() - start
    final = curve.points[-1] if curve.points else (rounds, float("nan"), float("nan"))
    return {
        "method": method, "model": model, "attack": attack, "fraction": fraction, "rounds": rounds, "horizon": horizon, "seed": seed,
        "accelerator": accelerator,
        "achieved_fraction": byz.achieved_fraction if byz is not None else 0.0,
        "num_byzantine": len(byz.byzantine) if byz is not None else 0,
        "test_acc": final[1], "test_loss": final[2], "curve": curve.points, "wall_s": round(wall, 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=("mlp", "lenet"), default="mlp")
    parser.add_argument("--rounds", type=int, default=60)
    parser.add_argument("--horizon", type=int, default=1000, help="T of the learning-rate schedule")
    parser.add_argument("--eval-every", type=int, default=10)
    parser.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    parser.add_argument("--attacks", nargs="+", default=["gaussian", "signflip", "alie"], choices=sorted(ATTACKS))
    parser.add_argument("--fractions", nargs="+", type=float, default=[0.0, 0.1, 0.2, 0.3, 0.4])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--root", default="/work/shared/data")
    parser.add_argument("--accelerator", default="cpu", help="the Trainer's accelerator (cpu, gpu, auto)")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    torch.set_num_threads(1)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    done = set()
    if os.path.exists(args.out):
        with open(args.out) as f:
            for line in f:
                r = json.loads(line)
                done.add((r["method"], r["model"], r["attack"], r["fraction"], r["rounds"], r["seed"]))
    dm = MNISTFederated(root=args.root, num_clients=50, partition="dirichlet", alpha=0.6, min_samples=10,
                        batch_size=512, seed=args.seed)
    # fraction 0 is attack-free: run it once (under the first attack's name) and reuse it in every table
    jobs = [(a, f) for a in args.attacks for f in args.fractions if f > 0 or a == args.attacks[0]]
    for attack, fraction in jobs:
        for method in args.methods:
            key = (method, args.model, attack if fraction > 0 else "none", fraction, args.rounds, args.seed)
            if key in done:
                continue
            record = run(dm, method, args.model, attack if fraction > 0 else "none", fraction, args.rounds,
                         args.horizon, args.eval_every, args.seed, args.accelerator)
            print(json.dumps({k: v for k, v in record.items() if k != "curve"}), flush=True)
            with open(args.out, "a") as f:
                f.write(json.dumps(record) + "\n")


if __name__ == "__main__":
    main()
