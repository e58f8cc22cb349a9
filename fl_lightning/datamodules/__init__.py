"""Federated datamodules and partitioners."""

from fl_lightning.datamodules.base import FederatedDataModule, labels_of
from fl_lightning.datamodules.client_data import ClientData
from fl_lightning.datamodules.imbalanced import CIFAR10STFederated, CIFAR100STFederated, MNISTSTFederated, st_indices
from fl_lightning.datamodules.leaf import FEMNISTFederated
from fl_lightning.datamodules.powerlaw import PowerLawFashionMNIST, PowerLawMNIST, TwoLabelPowerLaw, two_label_power_law
from fl_lightning.datamodules.synthetic import SyntheticFederated, synthetic_clients
from fl_lightning.datamodules.vision import (
    CIFAR10Federated,
    CIFAR100Federated,
    FashionMNISTFederated,
    MNISTFederated,
    TorchvisionFederated,
)

__all__ = [
    "CIFAR100Federated",
    "CIFAR100STFederated",
    "CIFAR10Federated",
    "CIFAR10STFederated",
    "ClientData",
    "FEMNISTFederated",
    "FashionMNISTFederated",
    "FederatedDataModule",
    "MNISTFederated",
    "MNISTSTFederated",
    "PowerLawFashionMNIST",
    "PowerLawMNIST",
    "SyntheticFederated",
    "TorchvisionFederated",
    "TwoLabelPowerLaw",
    "labels_of",
    "st_indices",
    "synthetic_clients",
    "two_label_power_law",
]
