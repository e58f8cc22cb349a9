"""One intra-op thread against torch's default, for small and large clients, both client backends.

Each row is a federation fitted for ``--rounds`` rounds (no validation, no logger); its time is the
median round after the first (which sets up and warms the allocator). Rows run interleaved in one
process, each repeat in the order of the last rotated by one, with ``torch.set_num_threads`` set
before each fit (1, or the default torch chose at start: the cores it sees; named in ``OMP_NUM_THREADS``
too, so that the engine keeps it: ``fl_lightning.cpu_threads``), so that both thread counts meet the
same background load. Printed per row: the best and the worst of the repeats'
medians (the spread is the noise), and per workload and backend the ratio default / one thread of
the best medians and its range over the repeats.

Workloads (FedAvg, ``--clients`` clients a round):

* ``quickstart``: ``configs/quickstart.yaml``'s logistic regression (60 -> 10), 20 steps of 10 samples;
* ``mlp``: MNIST's MLP (784-200-200-10), 10 steps of 64;
* ``cnn``: FedDeper's MNIST CNN (``fl_lightning.models.CNN``), 10 steps of 64;
* ``cnn-b512``: the same CNN, 5 steps of 512 (a large client: more arithmetic per operation).

MNIST is read from ``--mnist`` (random data of its shape where it is absent: the same work).

    python benchmarks/threads.py --workloads quickstart mlp cnn cnn-b512 --repeats 3 --out threads.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
from typing import Any, Callable

import pytorch_lightning as pl
import torch

from common import QuietLogisticRegression, QuietMLP, RoundTimes, mnist_or_random

from fl_lightning.algorithms import FedAvg
from fl_lightning.datamodules import FederatedDataModule, IidPartitioner, SyntheticFederated
from fl_lightning.models import CNN

#: torch's intra-op threads at start (what a run gets unless told otherwise)
DEFAULT_THREADS = torch.get_num_threads()


class QuietCNN(CNN):
    """The CNN without ``self.log`` in its training step."""

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return torch.nn.functional.cross_entropy(self(x), y)


def workloads(mnist: str) -> dict[str, Callable[[], tuple[pl.LightningModule, FederatedDataModule, int]]]:
    """Each workload: a fresh client, its data and its local steps."""

    def mnist_data(batch_size: int) -> FederatedDataModule:
        dm, _ = mnist_or_random(mnist, num_clients=100, partitioner=IidPartitioner(), batch_size=batch_size, seed=0)
        return dm

    return {
        "quickstart": lambda: (QuietLogisticRegression(in_features=60, num_classes=10, lr=0.05),
                               SyntheticFederated(alpha=1.0, beta=1.0, num_clients=30, batch_size=10, seed=0), 20),
        "mlp": lambda: (QuietMLP(in_features=784, hidden=(200, 200), num_classes=10, lr=0.05), mnist_data(64), 10),
        "cnn": lambda: (QuietCNN(lr=0.05), mnist_data(64), 10),
        "cnn-b512": lambda: (QuietCNN(lr=0.05), mnist_data(512), 5),
    }


def median_round(make: Callable[[], tuple[pl.LightningModule, FederatedDataModule, int]], backend: str, threads: int,
                 clients: int, rounds: int) -> float:
    """The median round (after the first) of a FedAvg fit of ``make``'s workload with ``threads`` intra-op threads
    (named in ``OMP_NUM_THREADS`` too: the count is the user's choice, which the engine keeps)."""
    os.environ["OMP_NUM_THREADS"] = str(threads)
    torch.set_num_threads(threads)
    torch.manual_seed(0)
    client, dm, steps = make()
    module = FedAvg(client, clients_per_round=clients, local_steps=steps, seed=0, client_backend=backend)
    timer = RoundTimes()
    pl.Trainer(max_epochs=rounds, logger=False, enable_checkpointing=False, enable_progress_bar=False,
               enable_model_summary=False, limit_val_batches=0, callbacks=[timer], accelerator="cpu").fit(module, dm)
    return statistics.median(timer.seconds[1:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workloads", nargs="+", default=["quickstart", "mlp", "cnn", "cnn-b512"],
                        choices=["quickstart", "mlp", "cnn", "cnn-b512"])
    parser.add_argument("--backends", nargs="+", default=["sequential", "batched"], choices=["sequential", "batched"])
    parser.add_argument("--clients", type=int, default=10, help="clients a round")
    parser.add_argument("--rounds", type=int, default=6, help="rounds a fit (the first is not timed)")
    parser.add_argument("--repeats", type=int, default=3, help="interleaved repeats of every row")
    parser.add_argument("--mnist", default="../shared/data", help="MNIST root (random data of its shape if absent)")
    parser.add_argument("--out", default=None, help="JSON file for the results")
    args = parser.parse_args()
    made = workloads(args.mnist)
    rows = [(w, b, t) for w in args.workloads for b in args.backends for t in sorted({1, DEFAULT_THREADS})]
    times: dict[tuple[str, str, int], list[float]] = {row: [] for row in rows}
    for repeat in range(args.repeats):
        order = rows[repeat % len(rows):] + rows[:repeat % len(rows)]
        for workload, backend, threads in order:
            seconds = median_round(made[workload], backend, threads, args.clients, args.rounds)
            times[(workload, backend, threads)].append(seconds)
            print(f"repeat {repeat}: {workload:10s} {backend:10s} {threads} thread(s): "
                  f"{1000 * seconds:8.1f} ms a round", flush=True)
    print(f"\nms a round, best (worst) of {args.repeats} interleaved repeats; default threads: {DEFAULT_THREADS}")
    results = []
    for workload in args.workloads:
        for backend in args.backends:
            one, default = times[(workload, backend, 1)], times[(workload, backend, DEFAULT_THREADS)]
            ratios = [d / o for d, o in zip(default, one)]
            print(f"{workload:10s} {backend:10s} 1 thread {1000 * min(one):8.1f} ({1000 * max(one):8.1f})  "
                  f"{DEFAULT_THREADS} threads {1000 * min(default):8.1f} ({1000 * max(default):8.1f})  "
                  f"default / one: {min(default) / min(one):.2f} (repeats {min(ratios):.2f}-{max(ratios):.2f})")
            results.append({"workload": workload, "backend": backend, "one_thread_ms": [1000 * s for s in one],
                            "default_threads": DEFAULT_THREADS, "default_ms": [1000 * s for s in default]})
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"torch": torch.__version__, "clients": args.clients, "rounds": args.rounds, "rows": results}, f,
                      indent=1)


if __name__ == "__main__":
    main()
