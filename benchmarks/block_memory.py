"""What a client of a vectorized block costs in memory, measured, beside what the default block
(``clients_per_block=None``) assumes it costs.

The batched backend sizes its default block by an estimate per client: its run's tensors
(``FederatedModule.client_bytes``: four copies of the model, state entries, uploads) plus twice the
bytes autograd saves for one ``training_step`` on a full batch
(:func:`~fl_lightning.backends.batched.sizing.step_activation_bytes`). This benchmark runs a round of
FedAvg in blocks of ``k`` and ``2k`` clients and measures the peak memory the round allocates above
what was allocated at its start: on a CUDA device the caching allocator's peak
(``torch.cuda.max_memory_allocated``); on the CPU the process's peak resident memory (Linux: the
peak is reset at the round's start through ``/proc/self/clear_refs``, read from ``VmHWM`` at its
end; each measurement runs in a process of its own with glibc's ``MALLOC_MMAP_THRESHOLD_=131072``, so
that every tensor of more than 128 KiB is mapped and unmapped on its own and the resident memory
follows the tensors). The difference of the two peaks over ``k`` is what one more client of a block costs (the round's fixed
costs cancel out); the estimate should be above it, and not by much more than a factor of a few.

Workloads: the MNIST MLP 784-200-200-10 and LeNet at batch 64 (MNIST-shaped random data: the memory
does not depend on the values), and ResNet20 on CIFAR-shaped random data at batch 32.

    python benchmarks/block_memory.py [--accelerator cpu|gpu] [--block 4] [--out block_memory.json]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
from typing import Any, Callable, Optional

import pytorch_lightning as pl
import torch
from torch.utils.data import TensorDataset

from fl_lightning.algorithms import FedAvg
from fl_lightning.backends.batched.sizing import step_activation_bytes
from fl_lightning.datamodules import FederatedDataModule
from fl_lightning.models import LeNet, MLP
from fl_lightning.models.resnet import ResNet20

MIB = 2**20


class RandomImages(FederatedDataModule):
    """Random images of one shape (``shape``: channels, height, width) and 10 classes, 200 a client."""

    def __init__(self, shape: tuple[int, int, int], **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.shape = shape

    def build_datasets(self):
        g = torch.Generator().manual_seed(0)
        n = 200 * self.num_clients
        return TensorDataset(torch.randn(n, *self.shape, generator=g), torch.randint(0, 10, (n,), generator=g)), None


#: name -> (the client module, the data's sample shape, the batch size)
WORKLOADS: dict[str, tuple[Callable[[], pl.LightningModule], tuple[int, int, int], int]] = {
    "mlp": (lambda: MLP(784, (200, 200), 10, lr=0.05), (1, 28, 28), 64),
    "lenet": (lambda: LeNet(lr=0.05), (1, 28, 28), 64),
    "resnet20": (lambda: ResNet20(lr=0.05), (3, 32, 32), 32),
}


def _status_kib(field: str) -> int:
    """A ``/proc/self/status`` figure (``VmRSS``, ``VmHWM``), in KiB."""
    with open("/proc/self/status") as f:
        return int(re.search(rf"{field}:\s+(\d+)", f.read()).group(1))


class RoundPeak(pl.Callback):
    """The peak bytes allocated in round ``measured`` above what was allocated at its start."""

    def __init__(self, measured: int = 1) -> None:
        self.measured = measured
        self.peak: Optional[int] = None

    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.current_epoch != self.measured:
            return
        if pl_module.device.type == "cuda":
            torch.cuda.synchronize()
            self._start = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
        else:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")  # the peak resident memory starts again from the current
            self._start = _status_kib("VmRSS") * 1024

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.current_epoch != self.measured:
            return
        if pl_module.device.type == "cuda":
            torch.cuda.synchronize()
            self.peak = torch.cuda.max_memory_allocated() - self._start
        else:
            self.peak = _status_kib("VmHWM") * 1024 - self._start


def round_peak(name: str, block: int, accelerator: str) -> tuple[int, int]:
    """The measured peak of a round of ``block`` clients (one block) and the default block's
    estimate per client."""
    client, shape, batch_size = WORKLOADS[name]
    torch.manual_seed(0)
    data = RandomImages(shape, num_clients=block, partition="iid", batch_size=batch_size, val_fraction=0.0)
    module = FedAvg(client(), clients_per_round=block, local_steps=2, seed=0, client_backend="batched",
                    clients_per_block=block)
    peak = RoundPeak()
    trainer = pl.Trainer(max_epochs=2, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, limit_val_batches=0, callbacks=[peak],
                         accelerator=accelerator, devices=1)
    trainer.fit(module, data)
    assert peak.peak is not None
    return peak.peak, module.client_bytes() + step_activation_bytes(module.context)


def measured(name: str, block: int, accelerator: str) -> tuple[int, int]:
    """:func:`round_peak` in a fresh process (on the CPU with mapped tensors: see the module's docstring)."""
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "131072"}
    out = subprocess.run([sys.executable, __file__, "--one", name, str(block), "--accelerator", accelerator],
                         env=env, check=True, capture_output=True, text=True).stdout
    peak, estimate = json.loads(out.strip().splitlines()[-1])
    return peak, estimate


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--accelerator", default="cpu", choices=["cpu", "gpu"])
    parser.add_argument("--block", type=int, default=4, help="the smaller block, k (the larger is 2k)")
    parser.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=list(WORKLOADS))
    parser.add_argument("--out", default=None, help="a JSON file for the figures")
    parser.add_argument("--one", nargs=2, metavar=("WORKLOAD", "BLOCK"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.one:
        print(json.dumps(round_peak(args.one[0], int(args.one[1]), args.accelerator)))
        return
    rows = []
    print(f"{'workload':<9} {'peak k':>9} {'peak 2k':>9} {'per client':>11} {'estimate':>9} {'estimate / measured':>20}")
    for name in args.workloads:
        small, estimate = measured(name, args.block, args.accelerator)
        large, _ = measured(name, 2 * args.block, args.accelerator)
        per_client = (large - small) / args.block
        ratio = estimate / per_client if per_client > 0 else float("nan")
        rows.append({"workload": name, "block": args.block, "peak_k_bytes": small, "peak_2k_bytes": large,
                     "per_client_bytes": per_client, "estimate_bytes": estimate, "ratio": ratio})
        print(f"{name:<9} {small / MIB:>7.1f}Mi {large / MIB:>7.1f}Mi {per_client / MIB:>9.2f}Mi "
              f"{estimate / MIB:>7.2f}Mi {ratio:>20.2f}", flush=True)
    if args.out:
        device = torch.cuda.get_device_name() if args.accelerator == "gpu" else "cpu"
        with open(args.out, "w") as f:
            json.dump({"device": device, "torch": torch.__version__, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
