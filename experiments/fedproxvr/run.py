"""Run a FedProxVR study from its configs over several seeds; record per-round curves as JSON.

Each run is ``fl-lightning fit --config <config>`` (the same CLI, in-process) with the seed, the
number of rounds and any ``--set`` scale-down overrides applied to every config of the study;
the global model is evaluated every ``--eval-every`` rounds on the global test set (the union of
the clients' test splits) and on the pooled training splits (the paper's training loss).

    python experiments/fedproxvr/run.py mu --rounds 40 --seeds 0 1 2 \
        --set data.init_args.num_clients=30 --out experiments/fedproxvr/results/mu.json
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytorch_lightning as pl
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, Subset

from fl_lightning.cli import FederatedCLI

CONFIGS = Path(__file__).resolve().parents[2] / "configs" / "fedproxvr"

#: study -> [(label, config files composed in order, extra CLI arguments)]
STUDIES: dict[str, list[tuple[str, list[str], list[str]]]] = {
    "table1": [
        ("FedAvg", ["table1_mnist_logreg.yaml", "table1/fedavg.yaml"], []),
        ("FedProxVR (SVRG)", ["table1_mnist_logreg.yaml"], []),
        ("FedProxVR (SARAH)", ["table1_mnist_logreg.yaml", "table1/sarah.yaml"], []),
    ],
    "table2": [
        ("FedAvg", ["table2_mnist_cnn.yaml", "table2/fedavg.yaml"], []),
        ("FedProxVR (SVRG)", ["table2_mnist_cnn.yaml"], []),
        ("FedProxVR (SARAH)", ["table2_mnist_cnn.yaml", "table2/sarah.yaml"], []),
    ],
    "mu": [("FedAvg", ["mu_synthetic_logreg.yaml", "mu/fedavg.yaml"], [])]
    + [(f"FedProxVR ({e.upper()}) mu={m}", ["mu_synthetic_logreg.yaml", *overrides], ["--model.init_args.mu", str(m)])
       for e, overrides in (("svrg", []), ("sarah", ["mu/sarah.yaml"])) for m in (0, 1, 4)],
}


@torch.no_grad()
def evaluate(model: torch.nn.Module, dataset: Any, batch_size: int) -> tuple[float, float]:
    """Mean cross-entropy and accuracy of ``model`` on ``dataset``."""
    model.eval()
    device = next(model.parameters()).device
    loss, correct, n = 0.0, 0, 0
    for x, y in DataLoader(dataset, batch_size=batch_size):
        x, y = x.to(device), y.to(device)
        logits = model(x)
        loss += float(F.cross_entropy(logits, y, reduction="sum"))
        correct += int((logits.argmax(-1) == y).sum())
        n += len(y)
    model.train()
    return loss / n, correct / n


class Recorder(pl.Callback):
    """Evaluates the global model every ``every`` rounds (and before the first) and keeps the curve."""

    def __init__(self, every: int) -> None:
        self.every = every
        self.curve: list[dict[str, float]] = []
        self.start = 0.0

    def record(self, trainer: pl.Trainer, module: Any, rounds: int) -> None:
        dm = trainer.datamodule
        train = Subset(dm.pool, np.concatenate(dm.splits["train"]).tolist())
        train_loss, train_acc = evaluate(module.client, train, dm.eval_batch_size)
        test_loss, test_acc = evaluate(module.client, dm.global_test_set(), dm.eval_batch_size)
        point = dict(round=rounds, train_loss=train_loss, train_acc=train_acc, test_loss=test_loss,
                     test_acc=test_acc, wall_s=time.time() - self.start)
        self.curve.append(point)
        print(" ".join(f"{k}={v:.4f}" if isinstance(v, float) else f"{k}={v}" for k, v in point.items()), flush=True)

    def on_train_start(self, trainer: pl.Trainer, module: Any) -> None:
        self.start = time.time()
        self.record(trainer, module, 0)
        self.start = time.time()

    def on_train_epoch_end(self, trainer: pl.Trainer, module: Any) -> None:
        rounds = trainer.current_epoch + 1
        if rounds % self.every == 0 or rounds == trainer.max_epochs:
            self.record(trainer, module, rounds)


def run_one(configs: list[str], extra: list[str], seed: int, rounds: int, every: int) -> dict[str, Any]:
    args = [
        *(a for c in configs for a in ("--config", str(CONFIGS / c))), *extra,
        "--seed_everything", str(seed), "--model.init_args.seed", str(seed),
        "--trainer.max_epochs", str(rounds), "--trainer.limit_val_batches", "0",
        "--trainer.logger", "false", "--trainer.enable_checkpointing", "false",
        "--trainer.enable_progress_bar", "false", "--data.init_args.print_summary", "false",
    ]
    cli = FederatedCLI(args=args, run=False)
    recorder = Recorder(every)
    cli.trainer.callbacks.append(recorder)
    started = time.time()
    cli.trainer.fit(cli.model, cli.datamodule)
    sizes = [len(s) for s in cli.datamodule.splits["train"]]
    return dict(curve=recorder.curve, wall_s=time.time() - started, args=args,
                train_sizes=dict(min=min(sizes), max=max(sizes), total=sum(sizes), clients=len(sizes)),
                test_samples=len(cli.datamodule.global_test_set()))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("study", choices=sorted(STUDIES))
    parser.add_argument("--rounds", type=int, required=True)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--eval-every", type=int, default=1)
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="a config override for every run of the study, e.g. model.init_args.local_steps=10")
    parser.add_argument("--only", nargs="*", default=None, help="labels of the study to run (default: all)")
    parser.add_argument("--out", type=Path, required=True)
    opts = parser.parse_args()
    torch.set_num_threads(1)
    overrides = [a for kv in opts.set for a in ("--" + kv.split("=", 1)[0], kv.split("=", 1)[1])]
    results: dict[str, Any] = json.loads(opts.out.read_text()) if opts.out.exists() else {}
    results.setdefault("runs", {})
    results["overrides"], results["rounds"] = opts.set, opts.rounds
    for label, configs, extra in STUDIES[opts.study]:
        if opts.only and label not in opts.only:
            continue
        for seed in opts.seeds:
            print(f"== {label} seed {seed}", flush=True)
            results["runs"][f"{label}|{seed}"] = dict(label=label, seed=seed, configs=configs,
                                                      **run_one(configs, extra + overrides, seed, opts.rounds,
                                                                opts.eval_every))
            opts.out.parent.mkdir(parents=True, exist_ok=True)
            opts.out.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
