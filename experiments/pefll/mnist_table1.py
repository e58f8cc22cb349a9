"""PeFLL's Table 1 on an MNIST analogue: seen and unseen client accuracy of PeFLL and baselines.

100 clients with 2 classes each (the pathological split of PeFLL's CIFAR-10 recipe), 10 of them
held out as unseen; every method uses the paper's LeNet client (1x28x28 input here). A run is one
method and one seed: the Trainer trains it, then every client is evaluated on its test split
(PeFLL: the model PeFLL-predict generates for it, with and without masking the classes absent
from its training split; FedAvg: the global model, and the global model finetuned on the client;
pFedHN and Local only: the client's own model), pooled over the seen and over the unseen clients.
Each run is added to the result file --out (format: :mod:`experiments.results`; runs already there
are skipped) as ``<method>_s<seed>``; the tables of ``docs/results/pefll.md``:
``python -m experiments.pefll.report FILE``. The defaults are the document's settings:

    python -m experiments.pefll.mnist_table1 --methods pefll fedavg local pfedhn --seeds 0 1 2 --out runs/pefll.json
    python -m experiments.pefll.mnist_table1 --methods pefll_nolabels --seeds 0 --out runs/pefll.json

Methods: pefll, pefll_nolabels (embedding without labels; unseen clients' labels hidden),
pfedhn, fedavg (+ local finetuning), local.
"""

from __future__ import annotations

import argparse
import time
import warnings
from pathlib import Path
from typing import Any

import pytorch_lightning as pl
import torch

from experiments import results
from fl_lightning.algorithms.fedavg import FedAvg
from fl_lightning.algorithms.local_only import LocalOnly
from fl_lightning.algorithms.pefll import PeFLL
from fl_lightning.callbacks.accuracy import client_accuracy
from fl_lightning.algorithms.pfedhn import PFedHN
from fl_lightning.callbacks.client_metrics import ClientMetrics
from fl_lightning.callbacks.finetune import LocalFinetuning
from fl_lightning.datamodules import MNISTFederated
from fl_lightning.models import LeNet
from fl_lightning.models.hypernetwork import CNNEmbedding
from fl_lightning.predict import mask_absent_classes, personalize

NUM_CLIENTS, UNSEEN_FRACTION = 100, 0.1
DESCRIPTOR_DIM = int(1 + NUM_CLIENTS / 4)  # l = 26, as the paper's code


class Curve(pl.Callback):
    """Records the per-client mean accuracies after each validation (after ClientMetrics)."""

    def __init__(self) -> None:
        self.points: list[dict[str, float]] = []

    def on_validation_epoch_end(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
        if not trainer.sanity_checking:
            point = {"round": trainer.current_epoch + 1}
            point.update({k: float(v) for k, v in trainer.callback_metrics.items() if k.endswith("acc_mean")})
            self.points.append(point)
            print(point, flush=True)


def client_model(args: argparse.Namespace) -> LeNet:
    return LeNet(1, 28, (16, 32), (120, 84), 10, lr=args.client_lr, momentum=0.9)


def build(method: str, seed: int, args: argparse.Namespace) -> tuple[pl.LightningModule, int]:
    """The module of ``method`` and its number of rounds."""
    common = dict(clients_per_round=args.clients_per_round, local_steps=args.local_steps, seed=seed)
    if method in ("pefll", "pefll_nolabels"):
        embedding = CNNEmbedding(1, 28, 10, DESCRIPTOR_DIM, use_labels=method == "pefll")
        module = PeFLL(client_model(args), embedding, server_lr=args.server_lr, **common)
        return module, args.rounds
    if method == "pfedhn":
        return PFedHN(client_model(args), embedding_dim=DESCRIPTOR_DIM, new_client_rounds=20, **common), args.rounds
    if method == "fedavg":
        return FedAvg(client_model(args), **common), args.rounds
    if method == "local":
        num_train = NUM_CLIENTS - round(UNSEEN_FRACTION * NUM_CLIENTS)  # every training client, one round
        return LocalOnly(client_model(args), clients_per_round=num_train, local_steps=args.local_only_steps, seed=seed), 1
    raise ValueError(f"unknown method {method!r}")


def pooled(counts: list[tuple[int, int]]) -> float:
    """Sum of correct / sum of samples."""
    return 100.0 * sum(c for c, _ in counts) / max(sum(n for _, n in counts), 1)


def evaluate(module: Any, dm: MNISTFederated, method: str, args: argparse.Namespace) -> dict[str, float]:
    """Pooled test accuracy (%) over the seen and the unseen clients (and variants)."""
    out: dict[str, float] = {}
    groups = {"seen": list(dm.train_clients), "unseen": list(dm.unseen_clients)}
    for group, clients in groups.items():
        counts, masked, finetuned = [], [], []
        for cid in clients:
            test = dm.client_data(cid, "test")
            n = len(test)
            if method.startswith("pefll"):
                train = dm.client_data(cid, "train").full()
                hidden = method == "pefll_nolabels" and group == "unseen"
                model = personalize(module, train if not hidden else train[0])
                x, y = test.full()
                logits = model(x)
                present = torch.unique(train[1])
                counts.append((int((logits.argmax(-1) == y).sum()), n))
                masked.append((int((mask_absent_classes(logits, present).argmax(-1) == y).sum()), n))
            else:
                counts.append((round(client_accuracy(module, cid, test) * n), n))
                if method == "fedavg":
                    ft = LocalFinetuning(steps=args.finetune_steps)
                    finetuned.append((round(ft.finetuned_accuracy(module, cid) * n), n))
        out[group] = pooled(counts)
        if masked:
            out[f"{group}_masked"] = pooled(masked)
        if finetuned:
            out[f"{group}_finetuned"] = pooled(finetuned)
    return out


def run(method: str, seed: int, args: argparse.Namespace) -> results.Run:
    """Train and evaluate one method with one seed; returns its record for the result file."""
    pl.seed_everything(seed, verbose=False)
    dm = MNISTFederated(root=args.root, num_clients=NUM_CLIENTS, partition="classes", classes_per_client=2,
                        test_fraction=0.2, unseen_fraction=UNSEEN_FRACTION, batch_size=32, seed=seed)
    module, rounds = build(method, seed, args)
    curve = Curve()
    metrics = [ClientMetrics(clients="train"), ClientMetrics(clients="unseen")] if method != "local" else []
    trainer = pl.Trainer(
        max_epochs=rounds, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
        check_val_every_n_epoch=args.eval_every if method != "local" else 1,
        limit_val_batches=0 if method == "local" else 1.0,
        callbacks=metrics + [curve],
    )
    start = time.time()
    trainer.fit(module, dm)
    train_time = time.time() - start
    module.eval()
    summary = evaluate(module, dm, method, args)
    summary["total_seconds"] = round(time.time() - start, 1)
    params = dict(method=method, seed=seed, rounds=rounds, clients_per_round=args.clients_per_round,
                  local_steps=args.local_only_steps if method == "local" else args.local_steps,
                  finetune_steps=args.finetune_steps, client_lr=args.client_lr, server_lr=args.server_lr,
                  eval_every=args.eval_every)
    return {"name": f"{method}_s{seed}", "params": params, "wall_s": round(train_time, 1), "history": curve.points,
            "summary": summary}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--methods", nargs="+", required=True, choices=["pefll", "pefll_nolabels", "pfedhn", "fedavg", "local"])
    parser.add_argument("--seeds", nargs="+", type=int, default=[0])
    parser.add_argument("--rounds", type=int, default=40)
    parser.add_argument("--clients_per_round", type=int, default=5)
    parser.add_argument("--local_steps", type=int, default=10, help="local steps per round")
    parser.add_argument("--local_only_steps", type=int, default=50, help="Local only: local steps in total")
    parser.add_argument("--finetune_steps", type=int, default=20, help="FedAvg + finetuning: local steps")
    parser.add_argument("--client_lr", type=float, default=0.01)
    parser.add_argument("--server_lr", type=float, default=1e-3, help="PeFLL's Adam learning rate")
    parser.add_argument("--eval_every", type=int, default=20)
    parser.add_argument("--root", default="../shared/data")
    parser.add_argument("--out", type=Path, required=True, help="result file to add the runs to")
    args = parser.parse_args()

    torch.set_num_threads(1)
    warnings.filterwarnings("ignore", ".*does not have many workers.*")
    done = {r["name"] for r in results.load(args.out)}
    for seed in args.seeds:
        for method in args.methods:
            if f"{method}_s{seed}" not in done:
                record = run(method, seed, args)
                print(record["name"], record["summary"], flush=True)
                results.add(args.out, record)


if __name__ == "__main__":
    main()
