"""Federated datamodules and partitioners."""

from fl_lightning.datamodules.base import FederatedDataModule, labels_of
from fl_lightning.datamodules.client_data import ClientData
from fl_lightning.datamodules.synthetic import SyntheticFederated, synthetic_clients
from fl_lightning.datamodules.vision import (
    CIFAR10Federated,
    CIFAR100Federated,
    FashionMNISTFederated,
    MNISTFederated,
    TorchvisionFederated,
)

__all__ = [
    "CIFAR10Federated",
    "CIFAR100Federated",
    "ClientData",
    "FashionMNISTFederated",
    "FederatedDataModule",
    "MNISTFederated",
    "SyntheticFederated",
    "TorchvisionFederated",
    "labels_of",
    "synthetic_clients",
]
