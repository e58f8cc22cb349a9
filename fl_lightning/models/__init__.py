"""Reference models of the papers, as plain LightningModules (and PeFLL's server networks)."""

from fl_lightning.models.classifier import Classifier
from fl_lightning.models.cnn import CNN
from fl_lightning.models.fedproxvr_cnn import FedProxVRCNN
from fl_lightning.models.hypernetwork import CNNEmbedding, HyperNetwork, LabelEmbedding, MLPEmbedding
from fl_lightning.models.lenet import LeNet, lenet_layers
from fl_lightning.models.mlp import MLP, LogisticRegression
from fl_lightning.models.resnet import ResNet20

__all__ = [
    "CNN",
    "CNNEmbedding",
    "Classifier",
    "FedProxVRCNN",
    "HyperNetwork",
    "LabelEmbedding",
    "LeNet",
    "LogisticRegression",
    "MLP",
    "MLPEmbedding",
    "ResNet20",
    "lenet_layers",
]
