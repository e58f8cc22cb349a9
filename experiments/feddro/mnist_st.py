"""MNIST-ST (digits 0-4 cut to their last 100 training images), LeNet, 8 clients x batch 16.

Runs one (algorithm, seed, I) configuration and appends its per-round test metrics (overall,
worst-class, minority-half accuracy of the global model) to a JSON-lines file::

    python experiments/feddro/mnist_st.py --algorithm feddro --seed 0 --local-steps 8 --rounds 60 \
        --out experiments/feddro/results.jsonl

Algorithms: ``fedavg`` (FedAvg on the mean cross-entropy), ``compfedavg`` (Algorithm 1
case I, each client's own minibatch value of g: the federated MBSGD plug-in), ``feddro``.
The two compositional ones minimize KL-DRO with ``f = lam * log`` (same lr scale as CE).
"""

from __future__ import annotations

import argparse
import json
import time

import pytorch_lightning as pl
import torch

from fl_lightning.algorithms.fedavg import FedAvg
from fl_lightning.algorithms.feddro import CompositionalFedAvg, FedDRO
from fl_lightning.callbacks.class_metrics import ClassAccuracy
from fl_lightning.datamodules.imbalanced import MNISTSTFederated
from fl_lightning.functional.dro import KLDRO
from fl_lightning.models.lenet import LeNet


class History(pl.Callback):
    """Keeps the logged test metrics of every validation run."""

    def __init__(self) -> None:
        self.rows: list[dict] = []

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.sanity_checking:
            return
        m = trainer.callback_metrics
        row = {"round": trainer.current_epoch + 1, "steps": (trainer.current_epoch + 1) * pl_module.local_steps}
        row.update({k: float(v) for k, v in m.items() if k.startswith(("class/", "feddro/"))})
        self.rows.append(row)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--algorithm", choices=["fedavg", "compfedavg", "feddro"], required=True)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--local-steps", type=int, default=8)
    p.add_argument("--rounds", type=int, default=60)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--lam", type=float, default=2.0)
    p.add_argument("--beta", type=float, default=0.5)
    p.add_argument("--eval-every", type=int, default=5)
    p.add_argument("--root", default="/work/shared/data")
    p.add_argument("--out", default="experiments/feddro/results.jsonl")
    args = p.parse_args()
    torch.set_num_threads(1)
    pl.seed_everything(args.seed)
    client = LeNet(lr=args.lr)
    common = dict(clients_per_round=8, local_steps=args.local_steps, seed=args.seed)
    objective = KLDRO(lam=args.lam, scale_by_lambda=True)
    if args.algorithm == "fedavg":
        module = FedAvg(client, **common)
    elif args.algorithm == "compfedavg":
        module = CompositionalFedAvg(client, objective, case="I", **common)
    else:
        module = FedDRO(client, objective, beta=args.beta, **common)
    data = MNISTSTFederated(root=args.root, num_clients=8, partition="iid", batch_size=16, eval_batch_size=2000,
                            seed=args.seed)
    history = History()
    trainer = pl.Trainer(
        max_epochs=args.rounds, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
        check_val_every_n_epoch=args.eval_every, callbacks=[ClassAccuracy(num_classes=10), history],
    )
    start = time.time()
    trainer.fit(module, data)
    wall = time.time() - start
    record = {k: v for k, v in vars(args).items() if k not in ("root", "out")}
    record.update(wall_s=round(wall, 1), history=history.rows)
    with open(args.out, "a") as f:
        f.write(json.dumps(record) + "\n")
    last = history.rows[-1]
    print(f"{args.algorithm} seed={args.seed} I={args.local_steps}: acc {last['class/acc']:.4f} "
          f"worst {last['class/acc_worst_class']:.4f} minority {last['class/acc_minority']:.4f} wall {wall:.0f}s")


if __name__ == "__main__":
    main()
