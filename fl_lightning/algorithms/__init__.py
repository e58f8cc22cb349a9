"""Federated algorithms: each a small subclass of ``FederatedModule``."""

from fl_lightning.algorithms.byrd_saga import ByrdSAGA
from fl_lightning.algorithms.dro_baselines import FastDRO, PDSGD
from fl_lightning.algorithms.fedavg import FedAvg
from fl_lightning.algorithms.feddeper import FedDeper
from fl_lightning.algorithms.feddro import CompositionalFedAvg, FedDRO, LockStepCompositional
from fl_lightning.algorithms.fedprox import FedProx
from fl_lightning.algorithms.fedproxvr import FedProxVR
from fl_lightning.algorithms.local_only import LocalOnly
from fl_lightning.algorithms.pefll import HypernetworkFederation, PeFLL
from fl_lightning.algorithms.pfedhn import PFedHN
from fl_lightning.algorithms.raga import RAGA
from fl_lightning.algorithms.rfa import RFA
from fl_lightning.algorithms.scaffold import SCAFFOLD

__all__ = [
    "ByrdSAGA",
    "CompositionalFedAvg",
    "FastDRO",
    "FedAvg",
    "FedDRO",
    "FedDeper",
    "FedProx",
    "FedProxVR",
    "HypernetworkFederation",
    "LocalOnly",
    "LockStepCompositional",
    "PDSGD",
    "PFedHN",
    "PeFLL",
    "RAGA",
    "RFA",
    "SCAFFOLD",
]
