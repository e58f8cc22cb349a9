"""``Classifier``: a plain LightningModule for classification, the base of the reference models.

Nothing federated here: these are the modules a user would train centrally, and that a
``FederatedModule`` federates unchanged. Subclasses only build ``self.net``.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from fl_lightning.lightning_package import pl
from fl_lightning.validation import check_number


class Classifier(pl.LightningModule):
    """Cross-entropy classifier over ``self.net``, with SGD and accuracy logging.

    Args:
        lr: SGD learning rate, > 0.
        momentum: SGD momentum, >= 0.
        weight_decay: SGD weight decay, >= 0.
        lr_milestones: epochs (in a federation: rounds) after which the learning rate is
            multiplied by ``lr_gamma`` (``MultiStepLR``); empty: a constant rate.
        lr_gamma: the factor of each milestone, in (0, 1].

    Raises:
        ValueError: a number above that is out of its range, NaN or infinite (with ``lr=nan`` every
            client's update would be NaN and excluded: the model would never move).
    """

    net: nn.Module

    def __init__(
        self,
        lr: float = 0.01,
        momentum: float = 0.0,
        weight_decay: float = 0.0,
        lr_milestones: Sequence[int] = (),
        lr_gamma: float = 0.1,
    ) -> None:
        super().__init__()
        check_number("lr", lr, 0.0, low_open=True)
        check_number("momentum", momentum, 0.0)
        check_number("weight_decay", weight_decay, 0.0)
        if list(lr_milestones) != sorted(set(lr_milestones)) or any(m < 1 for m in lr_milestones):
            raise ValueError(f"lr_milestones must be increasing integers >= 1, got {list(lr_milestones)}")
        check_number("lr_gamma", lr_gamma, 0.0, 1.0, low_open=True, high_open=False)
        self.lr = lr
        self.momentum = momentum
        self.weight_decay = weight_decay
        self.lr_milestones = list(lr_milestones)
        self.lr_gamma = lr_gamma

    def forward(self, x: Tensor) -> Tensor:
        return self.net(x)

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        self.log("train_loss", loss, sync_dist=True)  # under DDP: the mean over every process's clients
        return loss

    def _evaluate(self, batch: Any, prefix: str) -> None:
        x, y = batch
        logits = self(x)
        self.log(f"{prefix}_loss", F.cross_entropy(logits.float(), y), prog_bar=False, sync_dist=True)
        self.log(f"{prefix}_acc", (logits.argmax(-1) == y).float().mean(), prog_bar=True, sync_dist=True)

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self._evaluate(batch, "val")

    def test_step(self, batch: Any, batch_idx: int) -> None:
        self._evaluate(batch, "test")

    def predict_step(self, batch: Any, batch_idx: int) -> Tensor:
        """The logits of the inputs (``batch`` is ``(x, y)`` or ``x``)."""
        x = batch[0] if isinstance(batch, (tuple, list)) else batch
        return self(x)

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.SGD(self.parameters(), lr=self.lr, momentum=self.momentum, weight_decay=self.weight_decay)
        if not self.lr_milestones:
            return optimizer
        scheduler = torch.optim.lr_scheduler.MultiStepLR(optimizer, self.lr_milestones, gamma=self.lr_gamma)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "epoch"}}
