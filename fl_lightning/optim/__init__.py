"""Optimizers: proximal SGD (FedProxVR's local optimizer), SGD as a function (the batched
backend's local optimizer) and the adaptive server optimizers FedAdam, FedYogi, FedAdagrad."""

from fl_lightning.optim.prox_sgd import ProxSGD
from fl_lightning.optim.server import FedAdagrad, FedAdam, FedYogi

__all__ = ["FedAdagrad", "FedAdam", "FedYogi", "ProxSGD"]
