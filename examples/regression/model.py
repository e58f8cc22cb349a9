"""A plain Lightning regressor: a linear model of a float target."""

import pytorch_lightning as pl
import torch
import torchmetrics
from torch import nn


class Regressor(pl.LightningModule):
    """MSE loss; MSE and MAE in validation."""

    def __init__(self, in_features: int = 8, lr: float = 0.05):
        super().__init__()
        self.save_hyperparameters()
        self.net = nn.Linear(in_features, 1)
        self.val_mae = torchmetrics.MeanAbsoluteError()

    def forward(self, x):
        return self.net(x).squeeze(-1)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.mse_loss(self(x), y)
        self.log("train/mse", loss)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        prediction = self(x)
        self.log("val/mse", nn.functional.mse_loss(prediction, y))
        self.val_mae(prediction, y)
        self.log("val/mae", self.val_mae)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.hparams.lr)
