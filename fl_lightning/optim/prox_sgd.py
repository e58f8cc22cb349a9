"""Proximal SGD: the local optimizer of FedProxVR (Dinh et al., ICPP 2020).

:class:`ProxSGD` applies ``p <- prox(p - lr * p.grad)`` with the closed-form proximal map of
``mu/2 ||w - anchor||^2`` (:func:`fl_lightning.functional.prox.prox_step`), so the proximal term
is an optimizer step, never a gradient term. :class:`FunctionalProxSGD` is the same step as a
function of the parameters, their gradients and the anchors, for backends that step many clients
at once (:meth:`ProxSGD.functional`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterable, Sequence

import torch
from torch import Tensor

from fl_lightning.functional.prox import prox_step


class ProxSGD(torch.optim.Optimizer):
    """``p <- prox_step(p - lr * p.grad, anchor, lr, mu)``: a gradient step then the exact proximal map.

    The anchor of each parameter is its value when the optimizer is built (the round's global
    model). No momentum, no weight decay; with ``mu = 0`` this is plain SGD.

    Args:
        params: the parameters to update.
        lr: step size ``eta`` > 0.
        mu: proximal strength >= 0.
    """

    def __init__(self, params: Iterable[Tensor], lr: float, mu: float = 0.0) -> None:
        if not lr > 0:
            raise ValueError(f"lr must be > 0, got {lr}")
        if not mu >= 0:
            raise ValueError(f"mu must be >= 0, got {mu}")
        super().__init__(params, {"lr": lr, "mu": mu})
        for group in self.param_groups:
            for p in group["params"]:
                self.state[p]["anchor"] = p.detach().clone()

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            step = FunctionalProxSGD(group["lr"], group["mu"], (False,) * len(params))
            step.step_(params, [p.grad for p in params], [self.state[p]["anchor"] for p in params])
        return loss

    def functional(self, frozen: Sequence[bool]) -> tuple["FunctionalProxSGD", list[Tensor]]:
        """This optimizer as a function and its state, the anchors (one parameter group; ``frozen``:
        whether each parameter is frozen, which a step then leaves as it is, as this optimizer does
        with a parameter without gradient)."""
        if len(self.param_groups) != 1:
            raise ValueError(f"ProxSGD as a function takes one parameter group, got {len(self.param_groups)}")
        group = self.param_groups[0]
        if len(frozen) != len(group["params"]):
            raise ValueError(f"frozen has {len(frozen)} entries, the optimizer {len(group['params'])} parameters")
        anchors = [self.state[p]["anchor"] for p in group["params"]]
        return FunctionalProxSGD(float(group["lr"]), float(group["mu"]), tuple(frozen)), anchors


@dataclass(frozen=True)
class FunctionalProxSGD:
    """:class:`ProxSGD`'s step as a function: ``p <- prox_step(p - lr * g, anchor, lr, mu)`` in place
    on each parameter, with the same arithmetic (``state``: the anchors, unchanged by a step)."""

    lr: float
    mu: float
    #: per parameter: frozen (``requires_grad=False``), left as it is
    frozen: tuple[bool, ...]

    def step_(self, params: Sequence[Tensor], grads: Sequence[Tensor], state: Sequence[Tensor]) -> list[Tensor]:
        """One step, in place on ``params``; returns the state (the anchors)."""
        for p, g, anchor, frozen in zip(params, grads, state, self.frozen):
            if frozen:
                continue
            p.add_(g.to(p.dtype), alpha=-self.lr)  # the same arithmetic as torch.optim.SGD
            if self.mu != 0:
                p.copy_(prox_step(p, anchor, self.lr, self.mu))
        return list(state)
