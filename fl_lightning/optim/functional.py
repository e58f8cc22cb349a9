"""Local optimizers as functions of tensors, for backends that step many clients at once.

:class:`FunctionalSGD` reproduces ``torch.optim.SGD`` (learning rate, momentum, dampening,
Nesterov, weight decay; per parameter group) with the same arithmetic, as a function of the
parameters, their gradients and the optimizer state that ``torch.func.vmap`` can batch. Like
``torch.optim.SGD`` it updates the parameters and momentum buffers in place: for a block of
clients these are large stacked tensors, and a new allocation per step would cost more than the
arithmetic. The state is a list of momentum buffers (empty before the first step).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
from torch import Tensor

#: the optimizer classes :func:`functional_optimizer` can run as functions
SUPPORTED: tuple[type, ...] = (torch.optim.SGD,)


@dataclass(frozen=True)
class SGDHyperparameters:
    """The hyperparameters of one parameter group of ``torch.optim.SGD``."""

    lr: float
    momentum: float
    dampening: float
    weight_decay: float
    nesterov: bool


class FunctionalSGD:
    """``torch.optim.SGD`` as a pure function.

    Args:
        groups: the hyperparameters of each parameter, in parameter order.
    """

    def __init__(self, groups: Sequence[SGDHyperparameters]) -> None:
        self.groups = list(groups)

    @property
    def lr(self) -> float:
        """The learning rate of the first parameter."""
        return self.groups[0].lr

    def step_(self, params: Sequence[Tensor], grads: Sequence[Tensor], state: Sequence[Tensor]) -> list[Tensor]:
        """One step, in place on ``params`` (and on the momentum buffers); returns the state.

        With ``d = g + weight_decay * p``: ``buf = d`` at the first step, else
        ``momentum * buf + (1 - dampening) d``; the direction is ``buf`` (``d + momentum * buf``
        with Nesterov), and ``p <- p - lr * direction``.
        """
        first = len(state) == 0
        new_state = []
        for i, (p, g, h) in enumerate(zip(params, grads, self.groups)):
            d = g.add(p, alpha=h.weight_decay) if h.weight_decay != 0 else g
            if h.momentum != 0:
                buf = d.clone() if first else state[i].mul_(h.momentum).add_(d, alpha=1 - h.dampening)
                new_state.append(buf)
                d = d.add(buf, alpha=h.momentum) if h.nesterov else buf
            else:
                new_state.append(torch.zeros((), dtype=p.dtype, device=p.device))
            p.add_(d, alpha=-h.lr)
        return new_state


def functional_optimizer(optimizer: torch.optim.Optimizer, params: Sequence[Tensor]) -> FunctionalSGD:
    """The function form of ``optimizer`` (built over ``params``, in their order).

    Raises:
        ValueError: ``optimizer`` is not one of :data:`SUPPORTED`, or uses an option they do not
            (``maximize``), or does not hold every parameter.
    """
    if type(optimizer) not in SUPPORTED:
        raise ValueError(
            f"the batched client backend runs the local optimizer as a function and supports "
            f"{[c.__name__ for c in SUPPORTED]}; the client's configure_optimizers returned "
            f"{type(optimizer).__name__}: use client_backend='sequential' for it"
        )
    group_of = {id(p): g for g in optimizer.param_groups for p in g["params"]}
    groups = []
    for p in params:
        group = group_of.get(id(p))
        if group is None:
            raise ValueError("the client's optimizer must hold every parameter of the client module for the batched "
                             "backend (a frozen parameter would still move); use client_backend='sequential'")
        if group.get("maximize", False):
            raise ValueError("the batched client backend does not support SGD(maximize=True)")
        groups.append(SGDHyperparameters(float(group["lr"]), float(group["momentum"]), float(group["dampening"]),
                                         float(group["weight_decay"]), bool(group["nesterov"])))
    return FunctionalSGD(groups)
