"""Local update rules as pure functions and optimizers: proximal SVRG / SARAH (FedProxVR)."""

from fl_lightning.optim.variance_reduction import (
    ProxSGD,
    full_gradient,
    prox_step,
    sarah_direction,
    svrg_direction,
)

__all__ = ["ProxSGD", "full_gradient", "prox_step", "sarah_direction", "svrg_direction"]
