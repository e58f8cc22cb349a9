"""A plain Lightning classifier: nothing in it knows about federated learning."""

import pytorch_lightning as pl
import torch
import torchmetrics
from torch import nn


class Classifier(pl.LightningModule):
    """An MLP over feature vectors, with cross-entropy, accuracy and SGD with momentum."""

    def __init__(self, in_features: int = 16, num_classes: int = 4, hidden: int = 32, lr: float = 0.05):
        super().__init__()
        self.save_hyperparameters()
        self.net = nn.Sequential(nn.Linear(in_features, hidden), nn.ReLU(), nn.Linear(hidden, num_classes))
        self.val_acc = torchmetrics.Accuracy(task="multiclass", num_classes=num_classes)
        self.test_acc = torchmetrics.Accuracy(task="multiclass", num_classes=num_classes)

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.cross_entropy(self(x), y)
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch, batch_idx):
        self.evaluate(batch, "val", self.val_acc)

    def test_step(self, batch, batch_idx):
        self.evaluate(batch, "test", self.test_acc)

    def evaluate(self, batch, stage: str, accuracy: torchmetrics.Metric) -> None:
        x, y = batch
        logits = self(x)
        self.log(f"{stage}_loss", nn.functional.cross_entropy(logits, y))
        accuracy(logits, y)
        self.log(f"{stage}_acc", accuracy)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.hparams.lr, momentum=0.9)
