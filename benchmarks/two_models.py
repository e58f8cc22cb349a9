"""Cost of the algorithms that take two gradients per local step, against FedAvg.

FedDeper steps a globalized and a personal model on each mini-batch; FedProxVR (SVRG and
SARAH) takes the minibatch gradient at the current point and at a reference point. Both do
twice FedAvg's gradient work per local step, so a round should cost about 2x FedAvg's (plus
FedProxVR's full local gradient at the start of each round). What is above 2x is the price of
keeping the second model: this benchmark prints it.

The same federation for all: FedDeper's MNIST setting (MLP 784-512-256-10, the sorted split
over 10 clients of 6,000 samples, 5 per round, 10 local steps of batch 64; random data of
MNIST's shape where MNIST is not at hand). Runs are interleaved in one process (FedAvg, FedDeper, SVRG, SARAH, FedAvg, ...)
and the median of the per-round times of each is compared, so the ratios are robust to the
machine's background load.

    python benchmarks/two_models.py [--rounds 10] [--repeats 3] [--mnist ../shared/data]

Prints seconds per round and the ratio to FedAvg for each algorithm.
"""

from __future__ import annotations

import argparse
import statistics
from typing import Callable

import torch

from common import mnist_or_random
from overhead import timed_fit

from fl_lightning.algorithms import FedAvg, FedDeper, FedProxVR
from fl_lightning.datamodules import FederatedDataModule
from fl_lightning.models import MLP
from fl_lightning.module import FederatedModule

CLIENTS, PER_ROUND, STEPS, BATCH, LR = 10, 5, 10, 64, 0.01

ALGORITHMS: dict[str, Callable[[MLP], FederatedModule]] = {
    "FedAvg": lambda c: FedAvg(c, clients_per_round=PER_ROUND, local_steps=STEPS),
    "FedDeper": lambda c: FedDeper(c, clients_per_round=PER_ROUND, local_steps=STEPS),
    "FedProxVR (SVRG)": lambda c: FedProxVR(c, estimator="svrg", clients_per_round=PER_ROUND, local_steps=STEPS,
                                            mu=0.1, output_iterate="last"),
    "FedProxVR (SARAH)": lambda c: FedProxVR(c, estimator="sarah", clients_per_round=PER_ROUND, local_steps=STEPS,
                                             mu=0.1, output_iterate="last"),
}


def seconds_per_round(name: str, dm: FederatedDataModule, rounds: int) -> float:
    """One run of ``rounds`` rounds of algorithm ``name``; wall seconds per round."""
    torch.manual_seed(0)
    return timed_fit(ALGORITHMS[name](MLP(hidden=(512, 256), lr=LR)), dm, rounds)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (1: least sensitive to load)")
    parser.add_argument("--mnist", default="../shared/data", help="MNIST root; random data if not found")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    split = {"num_clients": CLIENTS, "partition": "shards", "shards_per_client": 1, "batch_size": BATCH}
    dm, data = mnist_or_random(args.mnist, **split)
    times: dict[str, list[float]] = {name: [] for name in ALGORITHMS}
    for _ in range(args.repeats):
        for name in ALGORITHMS:
            times[name].append(seconds_per_round(name, dm, args.rounds))
    base = statistics.median(times["FedAvg"])
    print(f"data: {data}; {args.rounds} rounds x {args.repeats} repeats, {CLIENTS} clients, {PER_ROUND} per round, "
          f"{STEPS} steps of {BATCH}, MLP 784-512-256-10, {args.threads} thread(s)")
    print(f"{'algorithm':<20} {'s/round (median)':>17} {'all runs':>28} {'ratio to FedAvg':>16}")
    for name, runs in times.items():
        median = statistics.median(runs)
        print(f"{name:<20} {median:>17.3f} {' '.join(f'{t:.3f}' for t in runs):>28} {median / base:>16.2f}")


if __name__ == "__main__":
    main()
