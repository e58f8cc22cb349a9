"""Memory and time against the number of clients, at 10 clients per round: the client state
store keeps at most its budget in RAM and spills the rest to disk.

SCAFFOLD (a control variate per client) and FedDeper (a personal model per client), MLP
784-200-200-10 (0.76 MB of state per client, SGD lr 0.05; FedDeper with rho = 0, see ``_run``),
MNIST-shaped random data with 2 samples per client, 10 clients per round, 10 local steps. For each federation size, the same run with the store's
budget at 64 MiB (bounded) and unbounded (everything in RAM): the resident memory of the process
over the data's after rounds 10, 100 and 300, and ms per round (bounded / unbounded). For the
bounded run, also the most the process grew by over the run (its resident memory read after every
round) against the budget, and the state files on disk against the entries stored.

``--model logreg --features F`` runs a logistic regression of ``F`` features instead (an entry of
``(F + 1) * 40`` bytes: 1814 features make 71 KiB), on random data of that shape;
``--clients-per-round`` and ``--local-steps`` change the round. The probe of issue 70 (entries below
glibc's mmap threshold, whose freed memory the heap kept):

    python benchmarks/scale.py --clients 10000 --algorithms SCAFFOLD --model logreg --features 1814 \
        --clients-per-round 100 --local-steps 1 --budget-mib 16 --rounds 300 --runs bounded

With ``--checkpoint``, the bounded run also writes a resumable checkpoint every round
(``RoundCheckpoint``) and the benchmark prints, after rounds 10, 100 and 300, the size of
``last.ckpt``, the client state the checkpoint names on disk, and what an inline checkpoint would
hold (the store's RAM part, which checkpoints held before they were incremental).

    python benchmarks/scale.py [--clients 10000 100000] [--rounds 300] [--budget-mib 64] [--checkpoint] [--out scale.json]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import tempfile
import time

import pytorch_lightning as pl
import torch

from common import RandomImages, status_kib

from fl_lightning.algorithms import SCAFFOLD, FedDeper
from fl_lightning.callbacks import RoundCheckpoint
from fl_lightning.models import MLP, LogisticRegression

CHECKPOINTS = (10, 100, 300)


def rss_mib() -> float:
    """The process's resident memory now (Linux)."""
    return status_kib("VmRSS") / 1024


class Probe(pl.Callback):
    """Resident memory after the rounds of ``CHECKPOINTS`` and its most over the run, and seconds
    per round after the first."""

    def __init__(self, base: float, checkpoint: str = "") -> None:
        self.base, self.rss, self.start, self.checkpoint, self.files = base, {}, 0.0, checkpoint, {}
        self.peak = 0.0

    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.current_epoch == 1:
            self.start = time.perf_counter()

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        done = trainer.current_epoch + 1
        self.peak = max(self.peak, rss_mib() - self.base)
        if done in CHECKPOINTS:
            self.rss[done] = rss_mib() - self.base
            if self.checkpoint:  # (this callback runs after RoundCheckpoint wrote the round's)
                folder = pl_module.engine.store.directory
                self.files[done] = {
                    "ckpt_kib": os.path.getsize(os.path.join(self.checkpoint, "last.ckpt")) / 1024,
                    "state_on_disk_mib": sum(os.path.getsize(os.path.join(folder, f)) for f in os.listdir(folder)) / 2**20,
                    "inline_mib": pl_module.engine.store.nbytes() / 2**20,
                }

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.per_round = (time.perf_counter() - self.start) / (trainer.current_epoch - 1)


def run(algorithm: str, num_clients: int, rounds: int, budget: int, checkpoint: bool = False, **shape: int) -> dict:
    """One run in a fresh process (so that its memory is its own); ``shape``: :func:`_run`'s keywords."""
    with multiprocessing.get_context("spawn").Pool(1) as pool:
        return pool.apply(_run, (algorithm, num_clients, rounds, budget, checkpoint), shape)


def _run(algorithm: str, num_clients: int, rounds: int, budget: int, checkpoint: bool, features: int = 0,
         clients_per_round: int = 10, local_steps: int = 10) -> dict:
    """One run; ``features``: a logistic regression of that many features (0: the MLP on MNIST's shape)."""
    torch.set_num_threads(1)
    dm = RandomImages(shape=(1, 1, features) if features else (1, 28, 28), samples_per_client=2,
                      num_clients=num_clients, partition="iid", batch_size=2)
    dm.setup()
    torch.manual_seed(0)
    client = LogisticRegression(in_features=features, lr=0.05) if features else MLP(hidden=(200, 200), lr=0.05)
    # FedDeper with rho = 0: the same two models and personal state per client, no pull. With
    # rho > 0 and 10,000 clients rarely sampled twice, personal models stay at x^0 and the pull
    # toward 2x - x^0 makes ||x|| grow ~30% per round (diverged by round 30 here, before Engine v2 too)
    extra = {"rho": 0.0} if algorithm == "FedDeper" else {}
    cls = SCAFFOLD if algorithm == "SCAFFOLD" else FedDeper
    with tempfile.TemporaryDirectory() as folder:
        module = cls(client, clients_per_round=clients_per_round, local_steps=local_steps, client_state_memory=budget,
                     client_state_dir=os.path.join(folder, "state"), **extra)
        ckpt = os.path.join(folder, "ckpt")
        probe = Probe(rss_mib(), ckpt if checkpoint else "")
        callbacks = [RoundCheckpoint(dirpath=ckpt), probe] if checkpoint else [probe]
        pl.Trainer(max_epochs=rounds, logger=False, enable_checkpointing=checkpoint, enable_progress_bar=False,
                   enable_model_summary=False, limit_val_batches=0, callbacks=callbacks, accelerator="cpu",
                   default_root_dir=folder).fit(module, dm)
        state = module.engine.store.directory
        return {"ms_per_round": probe.per_round * 1e3, "rss_mib": probe.rss, "peak_rss_mib": probe.peak,
                "clients_stored": len(module.engine.store), "ram_mib": module.engine.store.nbytes() / 2**20, "files": probe.files,
                "files_on_disk": len(os.listdir(state)) if os.path.isdir(state) else 0}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--clients", type=int, nargs="+", default=[10_000, 100_000])
    parser.add_argument("--algorithms", nargs="+", default=["SCAFFOLD", "FedDeper"])
    parser.add_argument("--rounds", type=int, default=300)
    parser.add_argument("--budget-mib", type=int, default=64)
    parser.add_argument("--checkpoint", action="store_true", help="also a bounded run with a checkpoint every round")
    parser.add_argument("--model", choices=["mlp", "logreg"], default="mlp")
    parser.add_argument("--features", type=int, default=1814,
                        help="the logistic regression's features (--model logreg)")
    parser.add_argument("--clients-per-round", type=int, default=10)
    parser.add_argument("--local-steps", type=int, default=10)
    parser.add_argument("--runs", nargs="+", choices=["bounded", "unbounded"], default=["bounded", "unbounded"])
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    torch.set_num_threads(1)
    results = {}
    shape = {"features": args.features if args.model == "logreg" else 0, "clients_per_round": args.clients_per_round,
             "local_steps": args.local_steps}
    model = f"logistic regression of {args.features} features" if args.model == "logreg" else "MLP 784-200-200-10"
    print(f"{args.clients_per_round} clients/round x {args.local_steps} local steps, {model}, {args.rounds} rounds, "
          f"1 thread; RSS over the data's, in MiB, after rounds {', '.join(map(str, CHECKPOINTS))}")
    budgets = {"bounded": args.budget_mib * 2**20, "unbounded": 2**50}
    for n in args.clients:
        for algorithm in args.algorithms:
            row = {}
            for name in args.runs:
                row[name] = run(algorithm, n, args.rounds, budgets[name], **shape)
                rss = " ".join(f"{row[name]['rss_mib'].get(r, float('nan')):7.0f}" for r in CHECKPOINTS)
                print(f"{algorithm:>8} {n:>7} clients, {name:<9}: RSS {rss}   {row[name]['ms_per_round']:7.1f} ms/round, "
                      f"{row[name]['clients_stored']} clients stored, {row[name]['ram_mib']:.0f} MiB in RAM", flush=True)
            if "bounded" in row:
                bounded = row["bounded"]
                print(f"{'':>8} bounded: grew {bounded['peak_rss_mib']:.0f} MiB at most "
                      f"({bounded['peak_rss_mib'] / args.budget_mib:.1f}x the {args.budget_mib} MiB budget); "
                      f"{bounded['files_on_disk']} state files for {bounded['clients_stored']} clients stored")
            if len(row) == 2:
                ratio = row["bounded"]["ms_per_round"] / row["unbounded"]["ms_per_round"]
                print(f"{'':>8} time bounded / unbounded: {ratio:.2f}")
            if args.checkpoint:
                row["checkpointed"] = run(algorithm, n, args.rounds, args.budget_mib * 2**20, checkpoint=True, **shape)
                files = row["checkpointed"]["files"]
                bounded_ms = row["bounded"]["ms_per_round"] if "bounded" in row else float("nan")
                print(f"{'':>8} checkpoint every round: {row['checkpointed']['ms_per_round']:.1f} ms/round "
                      f"({row['checkpointed']['ms_per_round'] / bounded_ms:.2f}x); after rounds "
                      + ", ".join(f"{r}: last.ckpt {f['ckpt_kib']:.0f} KiB, state files {f['state_on_disk_mib']:.0f} MiB "
                                  f"(inline would hold {f['inline_mib']:.0f} MiB)" for r, f in files.items()), flush=True)
            results[f"{algorithm}-{n}"] = row
            if args.out:
                with open(args.out, "w") as f:
                    json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
