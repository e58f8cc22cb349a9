"""One client module written for each Lightning package: :class:`LightningClient` with ``import
lightning.pytorch as L`` (as Lightning's own docs write modules since 2.0), :class:`PytorchLightningClient`
with ``pytorch_lightning``. Their code is the same (:class:`ClientCode`), so a federation of either
must give bitwise the same model."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as L
import pytorch_lightning
import torch
import torchmetrics
from torch import Tensor, nn


class ClientCode:
    """A logistic regression that uses what a user's module does: ``save_hyperparameters``, ``self.log``
    in ``training_step``, a torchmetrics ``Metric`` logged in ``validation_step`` and ``test_step``, a
    ``predict_step``, an LR scheduler."""

    def __init__(self, in_features: int = 20, num_classes: int = 10, lr: float = 0.1, gamma: float = 0.5) -> None:
        super().__init__()
        self.save_hyperparameters()
        torch.manual_seed(0)
        self.net = nn.Linear(in_features, num_classes)
        self.accuracy = torchmetrics.Accuracy("multiclass", num_classes=num_classes)

    def forward(self, x: Tensor) -> Tensor:
        return self.net(x)

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        x, y = batch
        loss = nn.functional.cross_entropy(self(x), y)
        self.log("train/loss", loss)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        logits = self(x)
        self.accuracy(logits, y)
        self.log("val_acc", self.accuracy)
        self.log("val_loss", nn.functional.cross_entropy(logits, y))

    def test_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.accuracy(self(x), y)
        self.log("test_acc", self.accuracy)

    def predict_step(self, batch: Any, batch_idx: int) -> Tensor:
        return self(batch[0]).argmax(-1)

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.SGD(self.parameters(), lr=self.hparams.lr)
        return [optimizer], [torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=self.hparams.gamma)]


class LightningClient(ClientCode, L.LightningModule):
    """:class:`ClientCode` as a ``lightning.pytorch`` module."""


class PytorchLightningClient(ClientCode, pytorch_lightning.LightningModule):
    """:class:`ClientCode` as a ``pytorch_lightning`` module."""


class LightningNoPredict(L.LightningModule):
    """A ``lightning.pytorch`` module without a ``predict_step``: ``trainer.predict`` gives its outputs."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Linear(20, 10)

    def forward(self, x: Tensor) -> Tensor:
        return self.net(x)

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        x, y = batch
        return nn.functional.cross_entropy(self(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)
