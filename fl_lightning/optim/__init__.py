"""Optimizers and update rules: proximal SVRG / SARAH (FedProxVR), SGD as a function (the batched
backend), and the adaptive server optimizers FedAdam, FedYogi, FedAdagrad."""

from fl_lightning.optim.server import FedAdagrad, FedAdam, FedYogi
from fl_lightning.optim.variance_reduction import (
    ProxSGD,
    full_gradient,
    prox_step,
    sarah_direction,
    svrg_direction,
)

__all__ = ["FedAdagrad", "FedAdam", "FedYogi", "ProxSGD", "full_gradient", "prox_step", "sarah_direction", "svrg_direction"]
