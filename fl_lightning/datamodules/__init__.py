"""Federated datamodules, partitioners and pool subsamples."""

from fl_lightning.datamodules.base import FederatedDataModule
from fl_lightning.datamodules.client_data import ClientData
from fl_lightning.datamodules.client_files import ClientFilesFederated, write_client_files
from fl_lightning.datamodules.huggingface import HuggingFaceFederated
from fl_lightning.datamodules.leaf import FEMNISTFederated
from fl_lightning.datamodules.partitioners import (
    DirichletPartitioner,
    FlowerPartitioner,
    IidPartitioner,
    NaturalIdPartitioner,
    PathologicalPartitioner,
    Partitioner,
    PowerLawPartitioner,
    ShardPartitioner,
    SortedPartitioner,
)
from fl_lightning.datamodules.subsample import ImbalancedSubsample, Subsample, st_indices
from fl_lightning.datamodules.synthetic import SyntheticFederated, synthetic_clients
from fl_lightning.datamodules.targets import are_class_labels, describe_targets, labels_of
from fl_lightning.datamodules.vision import (
    CIFAR10Federated,
    CIFAR100Federated,
    FashionMNISTFederated,
    MNISTFederated,
    TorchvisionFederated,
)

__all__ = [
    "CIFAR100Federated",
    "CIFAR10Federated",
    "ClientData",
    "ClientFilesFederated",
    "DirichletPartitioner",
    "FEMNISTFederated",
    "FashionMNISTFederated",
    "FederatedDataModule",
    "FlowerPartitioner",
    "HuggingFaceFederated",
    "IidPartitioner",
    "ImbalancedSubsample",
    "MNISTFederated",
    "NaturalIdPartitioner",
    "PathologicalPartitioner",
    "Partitioner",
    "PowerLawPartitioner",
    "ShardPartitioner",
    "SortedPartitioner",
    "Subsample",
    "SyntheticFederated",
    "TorchvisionFederated",
    "are_class_labels",
    "describe_targets",
    "labels_of",
    "st_indices",
    "synthetic_clients",
    "write_client_files",
]
