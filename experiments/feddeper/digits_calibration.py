"""FedDeper and its baselines on the spec's offline stand-in (scikit-learn's 8x8 digits).

The FedDeper specification (``../shared/specs/feddeper.md``, section 6) reports calibration runs
of an independent re-implementation on ``sklearn.datasets.load_digits``: stratified 75/25 split
(random_state 0; 1,347 train, 450 test), the sorted split over n = 10 clients, the MLP
64-512-256-10, m = 5, tau = 10, lr 0.01, B = 32, rho = 0.03, lambda = 0.5, FedProx mu = 1,
SCAFFOLD option II, 500 rounds. Running this project's algorithms in the same setting tells
whether a gap to the paper on real MNIST comes from the implementation or from the setting.
One JSON line per run is appended to --out (runs already there are skipped).

Needs scikit-learn (for the data set only; not a dependency of fl_lightning).

    PYTHONPATH=. python experiments/feddeper/digits_calibration.py --seeds 0 1 \
        --out experiments/feddeper/digits/digits_m5.jsonl
    PYTHONPATH=. python experiments/feddeper/digits_calibration.py --report experiments/feddeper/digits/digits_m5.jsonl
"""

from __future__ import annotations

import argparse
import json
import os
import time
from typing import Any, Optional

import pytorch_lightning as pl
import torch
from torch.utils.data import Dataset, TensorDataset

from experiments.curve import Curve
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


def run(method: str, seed: int, rounds: int, clients_per_round: int, eval_every: int) -> dict[str, Any]:
    """One run; returns its record."""
    pl.seed_everything(seed, verbose=False)
    dm = DigitsFederated(num_clients=10, partition="shards", shards_per_client=1, batch_size=32,
                         eval_batch_size=1000, seed=seed)
    curve = Curve()
    trainer = pl.Trainer(
        max_epochs=rounds, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
        check_val_every_n_epoch=eval_every, callbacks=[curve],
    )
    start = time.perf_counter()
    trainer.fit(algorithm(method, seed, clients_per_round), datamodule=dm)
    wall = time.perf_counter() - start
    return {"method": method, "seed": seed, "rounds": rounds, "clients_per_round": clients_per_round,
            "test_acc": curve.points[-1][1], "curve": curve.points, "wall_s": round(wall, 1)}


def report(path: str) -> str:
    """A markdown table of a result file: test accuracy (%) per method and seed at each evaluation."""
    with open(path) as f:
        records = [json.loads(line) for line in f]
    rounds = [r for r, _, _ in records[0]["curve"]]
    lines = ["| method | seed | " + " | ".join(map(str, rounds)) + " | wall s |",
             "|---|---|" + "---|" * (len(rounds) + 1)]
    for r in sorted(records, key=lambda r: (METHODS.index(r["method"]), r["seed"])):
        accs = " | ".join(f"{100 * a:.1f}" for _, a, _ in r["curve"])
        lines.append(f"| {r['method']} | {r['seed']} | {accs} | {r['wall_s']:.0f} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1])
    parser.add_argument("--rounds", type=int, default=500)
    parser.add_argument("--clients-per-round", type=int, default=5)
    parser.add_argument("--eval-every", type=int, default=50)
    parser.add_argument("--out", help="result file (JSON lines) to append to")
    parser.add_argument("--report", metavar="RESULTS", help="print the table of a result file and exit")
    args = parser.parse_args()
    if args.report:
        print(report(args.report))
        return
    if not args.out:
        parser.error("--out is required to run")
    torch.set_num_threads(1)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    done = set()
    if os.path.exists(args.out):
        with open(args.out) as f:
            done = {(r["method"], r["seed"], r["rounds"], r["clients_per_round"]) for r in map(json.loads, f)}
    for seed in args.seeds:
        for method in args.methods:
            if (method, seed, args.rounds, args.clients_per_round) in done:
                continue
            record = run(method, seed, args.rounds, args.clients_per_round, args.eval_every)
            print(json.dumps({k: v for k, v in record.items() if k != "curve"}), flush=True)
            with open(args.out, "a") as f:
                f.write(json.dumps(record) + "\n")


if __name__ == "__main__":
    main()
