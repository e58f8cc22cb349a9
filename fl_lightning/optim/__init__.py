"""Optimizers: proximal SGD (FedProxVR's local optimizer), SGD as a function (the batched
backend's local optimizer), the adaptive server optimizers FedAdam, FedYogi, FedAdagrad, and
the check that a local optimizer is plain SGD."""

from fl_lightning.optim.plain_sgd import require_plain_sgd
from fl_lightning.optim.prox_sgd import ProxSGD
from fl_lightning.optim.server import FedAdagrad, FedAdam, FedYogi

__all__ = ["FedAdagrad", "FedAdam", "FedYogi", "ProxSGD", "require_plain_sgd"]
