"""Reference models of the papers, as plain LightningModules."""

from fl_lightning.models.classifier import Classifier
from fl_lightning.models.mlp import MLP, LogisticRegression

__all__ = ["Classifier", "LogisticRegression", "MLP"]
