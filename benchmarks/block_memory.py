"""What a client of a vectorized block costs in memory, measured, beside what the default block
(``clients_per_block=None``) assumes it costs.

The batched backend sizes its default blocks by an estimate per client: its run's tensors
(``FederatedModule.client_bytes``: four copies of the model, state entries, uploads) plus its
activations (:func:`~fl_lightning.backends.batched.sizing.activation_bytes`): in a local step, twice
the bytes autograd saves for one ``training_step`` on a full batch; in an evaluation, the most
bytes alive at once in the client's ``validation_step`` on a batch of ``eval_batch_size``. This benchmark runs a round of FedAvg in blocks of ``k`` and
``2k`` clients, then evaluates the block's clients (one evaluation block, ``eval_batch_size`` 512),
and measures the peak memory each allocates above what was allocated at its start: on a CUDA device
the caching allocator's peak (``torch.cuda.max_memory_allocated``); on the CPU the process's peak
resident memory (Linux: the peak is reset at the start through ``/proc/self/clear_refs``, read from
``VmHWM`` at the end; each measurement runs in a process of its own with glibc's
``MALLOC_MMAP_THRESHOLD_=131072``, so that every tensor of more than 128 KiB is mapped and unmapped
on its own and the resident memory follows the tensors). The difference of the two peaks over ``k``
is what one more client of a block costs (the fixed costs cancel out); the estimate should be
above it, and not by much more than a factor of a few.

Workloads: the MNIST MLP 784-200-200-10 and LeNet at batch 64 (MNIST-shaped random data: the memory
does not depend on the values), and ResNet20 on CIFAR-shaped random data at batch 32.

    python benchmarks/block_memory.py [--accelerator cpu|gpu] [--block 4] [--out block_memory.json]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from typing import Callable, Optional

import pytorch_lightning as pl
import torch

from common import RandomImages, status_kib

from fl_lightning.algorithms import FedAvg
from fl_lightning.backends.batched.sizing import activation_bytes
from fl_lightning.models import LeNet, MLP
from fl_lightning.models.resnet import ResNet20

MIB = 2**20


#: name -> (the client module, the data's sample shape, the batch size)
WORKLOADS: dict[str, tuple[Callable[[], pl.LightningModule], tuple[int, int, int], int]] = {
    "mlp": (lambda: MLP(784, (200, 200), 10, lr=0.05), (1, 28, 28), 64),
    "lenet": (lambda: LeNet(lr=0.05), (1, 28, 28), 64),
    "resnet20": (lambda: ResNet20(lr=0.05), (3, 32, 32), 32),
}


class Peak:
    """The peak bytes allocated on ``device`` between :meth:`start` and :meth:`stop`, above what was
    allocated at the start."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.bytes: Optional[int] = None

    def start(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize()
            self._start = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
        else:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")  # the peak resident memory starts again from the current
            self._start = status_kib("VmRSS") * 1024

    def stop(self) -> int:
        if self.device.type == "cuda":
            torch.cuda.synchronize()
            self.bytes = torch.cuda.max_memory_allocated() - self._start
        else:
            self.bytes = status_kib("VmHWM") * 1024 - self._start
        return self.bytes


class RoundPeak(pl.Callback):
    """:class:`Peak` of round ``measured``."""

    def __init__(self, measured: int = 1) -> None:
        self.measured = measured
        self.peak: Optional[Peak] = None

    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.current_epoch == self.measured:
            self.peak = Peak(pl_module.device)
            self.peak.start()

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.current_epoch == self.measured:
            assert self.peak is not None
            self.peak.stop()


def block_peaks(name: str, block: int, accelerator: str) -> dict[str, int]:
    """For one block of ``block`` clients: the measured peak of a training round (``train``) and
    of an evaluation of the clients' training splits (``evaluate``: 600 samples a client, so
    batches of ``eval_batch_size`` 512 and 88), and the default blocks' estimates per client of each
    (``train_estimate``, ``evaluate_estimate``)."""
    client, shape, batch_size = WORKLOADS[name]
    torch.manual_seed(0)
    data = RandomImages(shape, samples_per_client=600, num_clients=block, partition="iid", batch_size=batch_size, val_fraction=0.0)
    module = FedAvg(client(), clients_per_round=block, local_steps=2, seed=0, client_backend="batched",
                    clients_per_block=block)
    round_peak = RoundPeak()
    trainer = pl.Trainer(max_epochs=2, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, limit_val_batches=0, callbacks=[round_peak],
                         accelerator=accelerator, devices=1)
    trainer.fit(module, data)
    assert round_peak.peak is not None and round_peak.peak.bytes is not None
    evaluation = Peak(module.device)
    evaluation.start()
    module.engine.evaluate_clients(list(range(block)), "train")
    activations = activation_bytes(module.engine.context)
    return {"train": round_peak.peak.bytes, "evaluate": evaluation.stop(),
            "train_estimate": module.engine.client_bytes() + activations.step,
            "evaluate_estimate": module.engine.client_bytes() + activations.evaluation}


def measured(name: str, block: int, accelerator: str) -> dict[str, int]:
    """:func:`block_peaks` in a fresh process (on the CPU with mapped tensors: see the module's docstring)."""
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "131072"}
    out = subprocess.run([sys.executable, __file__, "--one", name, str(block), "--accelerator", accelerator],
                         env=env, check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


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
        print(json.dumps(block_peaks(args.one[0], int(args.one[1]), args.accelerator)))
        return
    rows = []
    print(f"{'workload':<9} {'part':<9} {'peak k':>9} {'peak 2k':>9} {'per client':>11} {'estimate':>9} "
          f"{'estimate / measured':>20}")
    for name in args.workloads:
        small, large = measured(name, args.block, args.accelerator), measured(name, 2 * args.block, args.accelerator)
        for part in ("train", "evaluate"):
            per_client = (large[part] - small[part]) / args.block
            estimate = small[f"{part}_estimate"]
            ratio = estimate / per_client if per_client > 0 else float("nan")
            rows.append({"workload": name, "part": part, "block": args.block, "peak_k_bytes": small[part],
                         "peak_2k_bytes": large[part], "per_client_bytes": per_client,
                         "estimate_bytes": estimate, "ratio": ratio})
            print(f"{name:<9} {part:<9} {small[part] / MIB:>7.1f}Mi {large[part] / MIB:>7.1f}Mi "
                  f"{per_client / MIB:>9.2f}Mi {estimate / MIB:>7.2f}Mi {ratio:>20.2f}", flush=True)
    if args.out:
        device = torch.cuda.get_device_name() if args.accelerator == "gpu" else "cpu"
        with open(args.out, "w") as f:
            json.dump({"device": device, "torch": torch.__version__, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
