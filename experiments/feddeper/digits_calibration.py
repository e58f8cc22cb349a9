"""FedDeper and its baselines on the spec's offline stand-in (scikit-learn's 8x8 digits).

The FedDeper specification (``../shared/specs/feddeper.md``, section 6) reports calibration runs
of an independent re-implementation on ``sklearn.datasets.load_digits``: stratified 75/25 split
(random_state 0; 1,347 train, 450 test), the sorted split over n = 10 clients, the MLP
64-512-256-10, m = 5, tau = 10, lr 0.01, B = 32, rho = 0.03, lambda = 0.5, FedProx mu = 1,
SCAFFOLD option II, 500 rounds. Running this project's algorithms in the same setting tells
whether a gap to the paper on real MNIST comes from the implementation or from the setting.
Each run is added to the result file --out (format: :mod:`experiments.results`; runs already
there are skipped) as ``digits_m<clients per round>/<method>_s<seed>``; the tables of
``docs/results/feddeper.md``: ``python -m experiments.feddeper.report FILE``.

Needs scikit-learn (for the data set only; not a dependency of fl_lightning).

    python -m experiments.feddeper.digits_calibration --seeds 0 1 --out runs/feddeper_digits.json
    python -m experiments.feddeper.digits_calibration --seeds 0 --clients-per-round 10 \
        --methods feddeper fedavg fedprox scaffold --out runs/feddeper_digits.json
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any, Optional

import pytorch_lightning as pl
import torch
from torch.utils.data import Dataset, TensorDataset

from experiments import results
from experiments.sweep import Recorder
from fl_lightning.algorithms import SCAFFOLD, FedAvg, FedProx
from fl_lightning.algorithms.feddeper import FedDeper
from fl_lightning.datamodules.base import FederatedDataModule
from fl_lightning.models.mlp import MLP

METHODS = ("feddeper", "feddeper_star", "scaffold", "fedavg", "fedprox")


class DigitsFederated(FederatedDataModule):
    """scikit-learn's digits (pixels / 16), split 75/25 stratified with random_state 0 as in the spec."""

    def build_datasets(self) -> tuple[Dataset, Optional[Dataset]]:
        from sklearn.datasets import load_digits
        from sklearn.model_selection import train_test_split

        x, y = load_digits(return_X_y=True)
        x_tr, x_te, y_tr, y_te = train_test_split(x / 16.0, y, test_size=0.25, stratify=y, random_state=0)

        def tensors(x: Any, y: Any) -> TensorDataset:
            return TensorDataset(torch.as_tensor(x, dtype=torch.float32), torch.as_tensor(y, dtype=torch.long))

        return tensors(x_tr, y_tr), tensors(x_te, y_te)


def algorithm(method: str, seed: int, clients_per_round: int) -> pl.LightningModule:
    """The method's module around a freshly seeded MLP (the same initialization for every method)."""
    torch.manual_seed(seed)
    client = MLP(in_features=64, hidden=(512, 256), lr=0.01)
    common: dict[str, Any] = {"clients_per_round": clients_per_round, "seed": seed}
    if method in ("feddeper", "feddeper_star"):
        return FedDeper(client, rho=0.03, lam=0.5, local_steps=5 if method == "feddeper_star" else 10, **common)
    if method == "scaffold":
        return SCAFFOLD(client, local_steps=10, **common)
    if method == "fedprox":
        return FedProx(client, mu=1.0, local_steps=10, **common)
    return FedAvg(client, local_steps=10, **common)


def run(method: str, seed: int, rounds: int, clients_per_round: int, eval_every: int, commit: str) -> results.Run:
    """One run; returns its record for the result file (``commit``: the code it runs)."""
    pl.seed_everything(seed, verbose=False)
    dm = DigitsFederated(num_clients=10, partition="shards", shards_per_client=1, batch_size=32,
                         eval_batch_size=1000, seed=seed)
    recorder = Recorder(every=eval_every)
    trainer = pl.Trainer(
        max_epochs=rounds, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0,
        callbacks=[recorder],
    )
    start = time.perf_counter()
    trainer.fit(algorithm(method, seed, clients_per_round), datamodule=dm)
    wall = time.perf_counter() - start
    params = dict(study="digits", m=clients_per_round, method=method, seed=seed, rounds=rounds)
    history = [{"round": h["round"], "test_acc": h["test_acc"]} for h in recorder.history]
    return results.record(f"digits_m{clients_per_round}/{method}_s{seed}", commit, params, wall, history, "cpu")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1])
    parser.add_argument("--rounds", type=int, default=500)
    parser.add_argument("--clients-per-round", type=int, default=5)
    parser.add_argument("--eval-every", type=int, default=50)
    parser.add_argument("--out", type=Path, required=True, help="result file to add the runs to")
    args = parser.parse_args()
    torch.set_num_threads(1)
    done = {r["name"] for r in results.load(args.out)}
    commit = results.commit()  # the code imported now, which every run of this process runs
    for seed in args.seeds:
        for method in args.methods:
            if f"digits_m{args.clients_per_round}/{method}_s{seed}" in done:
                continue
            record = run(method, seed, args.rounds, args.clients_per_round, args.eval_every, commit)
            print(record["name"], record["history"][-1], f"{record['wall_s']} s", flush=True)
            results.add(args.out, record)


if __name__ == "__main__":
    main()
