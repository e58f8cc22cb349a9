"""Plain local training of many clients (``LocalFinetuning``'s work): one client after another
against blocks of clients with their steps vectorized (the batched client backend).

A FedAvg federation on MNIST (or random MNIST-shaped data where it is not at hand) trains one round
with the batched backend; then ``module.engine.train_clients_locally`` finetunes ``--clients`` clients for
``--steps`` steps from the global model, one after another (``train_one_by_one``, what the
sequential backend does) and in blocks (the batched backend, block ``--block``: the default is what
a quarter of the free memory holds), interleaved ``--repeats`` times in one process; the best of each
is printed, per client, with the ratio, and the largest difference between the two ways' models.

    python benchmarks/finetuning.py [--model mlp|lenet] [--clients 100] [--steps 50] [--block N]
        [--accelerator cpu|gpu] [--mnist ../shared/data] [--repeats 3] [--out result.json]
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Callable, Iterator, Optional

import pytorch_lightning as pl
import torch

from common import mnist_or_random

from fl_lightning.algorithms import FedAvg
from fl_lightning.backends.sequential import train_one_by_one
from fl_lightning.models import MLP, LeNet


class Timing(pl.Callback):
    """After the round's validation (where ``LocalFinetuning`` works, the model on its device), the
    two ways of finetuning ``clients`` for ``steps`` steps, interleaved ``repeats`` times: their
    seconds and their last models."""

    def __init__(self, clients: int, steps: int, repeats: int) -> None:
        self.clients, self.steps, self.repeats = list(range(clients)), steps, repeats
        self.seconds: dict[str, list[float]] = {}
        self.models: dict[str, dict[int, torch.Tensor]] = {}
        self.block = 0

    def on_validation_epoch_end(self, trainer: pl.Trainer, module: FedAvg) -> None:
        start = module.global_model.flatten().clone()
        ways = {
            "one after another": lambda: train_one_by_one(module.engine.context, self.clients, start, self.steps, "finetune",
                                                          0),
            "batched blocks": lambda: module.engine.train_clients_locally(self.clients, steps=self.steps, stream="finetune",
                                                                   round_idx=0),
        }
        for _ in range(self.repeats):
            for name, way in ways.items():
                seconds, self.models[name] = timed(way)
                self.seconds.setdefault(name, []).append(seconds)
        self.block = module.engine.backend._plain_block(module.engine.context, len(self.clients))


def federation(model: str, clients: int, block: Optional[int], accelerator: str, root: str, timing: Timing) -> str:
    """One round of a FedAvg federation of ``clients`` MNIST clients (batched backend, on
    ``accelerator``), ``timing`` after it; the name of its data."""
    dm, data = mnist_or_random(root, num_clients=clients, partition="iid", batch_size=32, seed=0)
    torch.manual_seed(0)
    client = MLP(in_features=784, hidden=(200, 200), num_classes=10, lr=0.05) if model == "mlp" else \
        LeNet(in_channels=1, image_size=28, conv_channels=(16, 32), hidden=(120, 84), num_classes=10, lr=0.01)
    module = FedAvg(client, clients_per_round=min(clients, 10), local_steps=5, client_backend="batched",
                    clients_per_block=block, seed=0)
    trainer = pl.Trainer(max_epochs=1, accelerator=accelerator, devices=1, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                         limit_val_batches=1, callbacks=[timing])
    trainer.fit(module, dm)
    return data


def timed(run: Callable[[], Iterator[tuple[int, torch.Tensor]]]) -> tuple[float, dict[int, torch.Tensor]]:
    """Seconds of ``run()`` (the device synchronized) and the models it gave."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    start = time.perf_counter()
    out = dict(run())
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return time.perf_counter() - start, out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=["mlp", "lenet"], default="mlp")
    parser.add_argument("--clients", type=int, default=100)
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--block", type=int, default=None)
    parser.add_argument("--accelerator", choices=["cpu", "gpu"], default="cpu")
    parser.add_argument("--mnist", default="../shared/data")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    timing = Timing(args.clients, args.steps, args.repeats)
    data = federation(args.model, args.clients, args.block, args.accelerator, args.mnist, timing)
    times, models = timing.seconds, timing.models
    best = {name: min(values) for name, values in times.items()}
    difference = max(float((models["one after another"][c] - models["batched blocks"][c]).abs().max())
                     for c in timing.clients)
    device = torch.cuda.get_device_name() if args.accelerator == "gpu" else f"cpu, {torch.get_num_threads()} thread(s)"
    print(f"{data}; {args.model}; {args.clients} clients x {args.steps} steps of 32; {device}; best of {args.repeats}")
    for name, seconds in best.items():
        print(f"{name:18}: {seconds:8.2f} s ({1e3 * seconds / args.clients:7.2f} ms a client)  runs: "
              + ", ".join(f"{s:.2f}" for s in times[name]))
    ratio = best["one after another"] / best["batched blocks"]
    print(f"batched speed-up: {ratio:.2f}x; block {timing.block}; "
          f"largest difference between the two ways' models: {difference:.2e}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"args": vars(args), "data": data, "device": device, "seconds": times, "best": best,
                       "speedup": ratio, "max_abs_difference": difference}, f, indent=1)


if __name__ == "__main__":
    main()
