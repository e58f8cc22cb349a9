"""Local optimizers as functions of tensors, for backends that step many clients at once.

:class:`FunctionalSGD` reproduces ``torch.optim.SGD`` (learning rate, momentum, dampening,
Nesterov, weight decay; per parameter group) with the same arithmetic, as a function of the
parameters, their gradients and the optimizer state that ``torch.func.vmap`` can batch. Like
``torch.optim.SGD`` it updates the parameters and momentum buffers in place: for a block of
clients these are large stacked tensors, and a new allocation per step would cost more than the
arithmetic. The state is a list with one momentum buffer per parameter (None for a parameter
without momentum; the list is empty before the first step). Frozen parameters
(``requires_grad=False``) and parameters the optimizer does not hold are never moved, as
``torch.optim.SGD`` leaves them in plain training.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable, Optional, Sequence

import torch
from torch import Tensor

from fl_lightning.optim.param_groups import single_lr

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
    #: the parameter is frozen (``requires_grad=False``): the step leaves it as it is
    frozen: bool = False


class FunctionalSGD:
    """``torch.optim.SGD`` as a pure function.

    Args:
        groups: the hyperparameters of each parameter, in parameter order.
    """

    def __init__(self, groups: Sequence[SGDHyperparameters]) -> None:
        self.groups = list(groups)

    def __eq__(self, other: object) -> bool:
        """The same step: the same hyperparameters for every parameter."""
        return isinstance(other, FunctionalSGD) and self.groups == other.groups

    def __hash__(self) -> int:
        return hash(tuple(self.groups))

    def with_rates(self, rates: Callable[[list[float]], list[float]]) -> "FunctionalSGD":
        """This optimizer with new learning rates for the parameters a step moves: ``rates`` maps
        their rates (in parameter order) to the new ones; frozen parameters keep theirs."""
        moving = [i for i, h in enumerate(self.groups) if not h.frozen]
        groups = list(self.groups)
        for i, lr in zip(moving, rates([self.groups[i].lr for i in moving])):
            groups[i] = replace(groups[i], lr=lr)
        return FunctionalSGD(groups)

    @property
    def lr(self) -> float:
        """The one learning rate of the parameters a step moves (see :func:`~fl_lightning.optim.param_groups.single_lr`)."""
        return single_lr(h.lr for h in self.groups if not h.frozen)

    def initial_state(self) -> list[Optional[Tensor]]:
        """The state before the first step: no momentum buffer yet (None) for each parameter. It is
        the state that steps without momentum keep, so that their compiled step sees one structure
        of the state from the first step on (one graph, where an empty first state would take two)."""
        return [None] * len(self.groups)

    def step_(
        self, params: Sequence[Tensor], grads: Sequence[Tensor], state: Sequence[Optional[Tensor]]
    ) -> list[Optional[Tensor]]:
        """One step, in place on ``params`` (and on the momentum buffers); returns the state.

        With ``d = g + weight_decay * p``: ``buf = d`` at the first step, else
        ``momentum * buf + (1 - dampening) d``; the direction is ``buf`` (``d + momentum * buf``
        with Nesterov), and ``p <- p - lr * direction``. The first step is the one whose ``state``
        holds no buffer for the parameter: :meth:`initial_state`'s, or an empty one.
        """
        first = len(state) == 0
        new_state: list[Optional[Tensor]] = []
        for i, (p, g, h) in enumerate(zip(params, grads, self.groups)):
            if h.frozen or h.momentum == 0:
                new_state.append(None)
                if h.frozen:
                    continue
            d = g.add(p, alpha=h.weight_decay) if h.weight_decay != 0 else g
            if h.momentum != 0:
                previous = None if first else state[i]
                buf = d.clone() if previous is None else previous.mul_(h.momentum).add_(d, alpha=1 - h.dampening)
                new_state.append(buf)
                d = d.add(buf, alpha=h.momentum) if h.nesterov else buf
            p.add_(d, alpha=-h.lr)
        return new_state


def functional_optimizer(optimizer: torch.optim.Optimizer, params: Sequence[Tensor]) -> FunctionalSGD:
    """The function form of ``optimizer`` (built over ``params``, in their order).

    Raises:
        ValueError: ``optimizer`` is not one of :data:`SUPPORTED`, or uses an option they do not
            (``maximize``). Parameters it does not hold, like frozen ones, are left unchanged.
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
        if group is None:  # a parameter the optimizer does not hold does not move
            groups.append(SGDHyperparameters(0.0, 0.0, 0.0, 0.0, False, frozen=True))
            continue
        if group.get("maximize", False):
            raise ValueError("the batched client backend does not support SGD(maximize=True)")
        groups.append(SGDHyperparameters(float(group["lr"]), float(group["momentum"]), float(group["dampening"]),
                                         float(group["weight_decay"]), bool(group["nesterov"]), not p.requires_grad))
    return FunctionalSGD(groups)
