"""fl_lightning: federated learning the Lightning way.

One ``Trainer`` runs the whole federation: a ``FederatedModule`` wraps an unchanged client
``LightningModule``, a ``FederatedDataModule`` yields client partitions, a Trainer epoch is a
communication round, and aggregation, attacks and personalization are callbacks.
"""

from fl_lightning import strategy as _strategy  # noqa: F401  (registers fl_ddp)
from fl_lightning.algorithms import RAGA, SCAFFOLD, FedAvg, FedDeper, FedDRO, FedProx, FedProxVR, PeFLL
from fl_lightning.callbacks import Aggregator, ClientMetrics, FederatedCallback, WeightedMean
from fl_lightning.client_config import ClientConfig
from fl_lightning.client_store import ClientStateStore
from fl_lightning.datamodules import (
    CIFAR10Federated,
    CIFAR100Federated,
    FashionMNISTFederated,
    FederatedDataModule,
    MNISTFederated,
    SyntheticFederated,
)
from fl_lightning.module import FederatedModule, NonFiniteUpdateError
from fl_lightning.strategy import FederatedDDPStrategy
from fl_lightning.update import ClientUpdate

__version__ = "0.1.0"

__all__ = [
    "Aggregator",
    "CIFAR100Federated",
    "CIFAR10Federated",
    "ClientConfig",
    "ClientMetrics",
    "ClientStateStore",
    "ClientUpdate",
    "FashionMNISTFederated",
    "FedAvg",
    "FedDRO",
    "FedDeper",
    "FedProx",
    "FedProxVR",
    "FederatedCallback",
    "FederatedDDPStrategy",
    "FederatedDataModule",
    "FederatedModule",
    "MNISTFederated",
    "NonFiniteUpdateError",
    "PeFLL",
    "RAGA",
    "SCAFFOLD",
    "SyntheticFederated",
    "WeightedMean",
]
