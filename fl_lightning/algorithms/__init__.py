"""Federated algorithms: each a small subclass of ``FederatedModule``."""

from fl_lightning.algorithms.fedavg import FedAvg
from fl_lightning.algorithms.fedprox import FedProx
from fl_lightning.algorithms.scaffold import SCAFFOLD

__all__ = ["FedAvg", "FedProx", "SCAFFOLD"]
