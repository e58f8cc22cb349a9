"""What several benchmarks share: random images standing in for a dataset that is not at hand,
MNIST where it is, the reference clients without ``self.log`` (a hand-written loop's exact work),
and the process's memory figures (Linux)."""

from __future__ import annotations

import time
from typing import Any, Optional

import pytorch_lightning as pl
import torch
import torch.nn.functional as F
from torch.utils.data import TensorDataset

from fl_lightning.datamodules import FederatedDataModule, MNISTFederated
from fl_lightning.models import MLP, LeNet, LogisticRegression


class RandomImages(FederatedDataModule):
    """Random images of one shape (``shape``: channels, height, width) and 10 classes, drawn with
    seed 0: ``samples_per_client`` a client, or MNIST's 60,000 in all (None). Memory and time do
    not depend on the values."""

    def __init__(self, shape: tuple[int, int, int] = (1, 28, 28), samples_per_client: Optional[int] = None,
                 **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.shape, self.samples_per_client = shape, samples_per_client

    def build_datasets(self) -> tuple[TensorDataset, None]:
        g = torch.Generator().manual_seed(0)
        n = 60_000 if self.samples_per_client is None else self.samples_per_client * self.num_clients
        return TensorDataset(torch.randn(n, *self.shape, generator=g), torch.randint(0, 10, (n,), generator=g)), None


def mnist_or_random(root: str, **split: Any) -> tuple[FederatedDataModule, str]:
    """MNIST from ``root`` split by ``split`` (``MNISTFederated``'s arguments), set up, with the name
    of its data; where MNIST is not there, :class:`RandomImages` of its shape, split alike (the same
    work)."""
    try:
        dm: FederatedDataModule = MNISTFederated(root=root, **split)
        dm.setup()
        return dm, "MNIST"
    except RuntimeError:
        print("MNIST not found: random MNIST-shaped data (the same work)")
        dm = RandomImages(**split)
        dm.setup()
        return dm, "random MNIST-shaped data"


class Quiet:
    """Mixes into a reference model: a training step without ``self.log`` (the hand-written loop's exact work)."""

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return F.cross_entropy(self(x), y)


class QuietLogisticRegression(Quiet, LogisticRegression):
    pass


class QuietMLP(Quiet, MLP):
    pass


class QuietLeNet(Quiet, LeNet):
    pass


def status_kib(field: str) -> int:
    """A figure of ``/proc/self/status`` in KiB: ``VmRSS`` (resident now), ``VmHWM`` (its peak)."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":"))


class RoundTimes(pl.Callback):
    """The wall time of every round."""

    def __init__(self) -> None:
        self.seconds: list[float] = []

    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.start = time.perf_counter()

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.seconds.append(time.perf_counter() - self.start)
