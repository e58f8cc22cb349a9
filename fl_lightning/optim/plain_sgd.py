"""The check that a client's local optimizer is plain SGD.

Several local rules are written for ``w <- w - lr g`` and nothing else (FedDeper's two models,
SCAFFOLD's control variates, RAGA's uploaded gradient mean, FedDRO's local step): momentum,
weight decay, dampening or Nesterov would change the update the algorithm's equations and
uploads assume, silently. :func:`require_plain_sgd` refuses them at setup, naming the parameter.
"""

from __future__ import annotations

import torch

from fl_lightning.optim.param_groups import optimizer_lr

#: The ``torch.optim.SGD`` options that must be off for plain SGD, and their off value.
PLAIN_SGD_OPTIONS = {"momentum": 0, "weight_decay": 0, "dampening": 0, "nesterov": False}


def require_plain_sgd(optimizer: torch.optim.Optimizer, algorithm: str) -> float:
    """The learning rate of ``optimizer`` if it is plain SGD, else a ValueError naming the option.

    Plain SGD is ``torch.optim.SGD`` with momentum, weight decay and dampening 0, no Nesterov,
    and one learning rate for the parameter groups of trainable parameters
    (:func:`~fl_lightning.optim.param_groups.optimizer_lr`).

    Args:
        optimizer: the client's local optimizer (``module.engine.local_optimizer()``).
        algorithm: the algorithm's name, for the error message.
    """
    if type(optimizer) is not torch.optim.SGD:
        raise ValueError(f"{algorithm} needs the client's optimizer to be plain torch.optim.SGD, "
                         f"got {type(optimizer).__name__}")
    for group in optimizer.param_groups:
        for name, off in PLAIN_SGD_OPTIONS.items():
            if group.get(name, off) != off:
                raise ValueError(f"{algorithm} needs plain SGD: the client's optimizer has {name}={group[name]}, "
                                 f"allowed: {off}")
    return optimizer_lr(optimizer)
