"""A callback shared by the experiment scripts: the global model's test curve of one run."""

from __future__ import annotations

import pytorch_lightning as pl


class Curve(pl.Callback):
    """Records (round, test accuracy, test loss) after each validation and prints it (a run cut
    short still leaves its curve in the log)."""

    def __init__(self) -> None:
        self.points: list[tuple[int, float, float]] = []

    def on_validation_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not trainer.sanity_checking:
            m = trainer.callback_metrics
            self.points.append((trainer.current_epoch + 1, float(m["val_acc"]), float(m["val_loss"])))
            print("curve", *self.points[-1], flush=True)
