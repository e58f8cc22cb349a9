"""Reference models of the papers, as plain LightningModules."""

from fl_lightning.models.classifier import Classifier
from fl_lightning.models.lenet import LeNet, lenet_layers
from fl_lightning.models.mlp import MLP, LogisticRegression

__all__ = ["Classifier", "LeNet", "LogisticRegression", "MLP", "lenet_layers"]
