"""Proximal SGD: the local optimizer of FedProxVR (Dinh et al., ICPP 2020).

:class:`ProxSGD` applies ``p <- prox(p - lr * p.grad)`` with the closed-form proximal map of
``mu/2 ||w - anchor||^2`` (:func:`fl_lightning.functional.prox.prox_step`), so the proximal term
is an optimizer step, never a gradient term.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable

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
            lr, mu = group["lr"], group["mu"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                p.add_(p.grad, alpha=-lr)  # the same arithmetic as torch.optim.SGD
                if mu != 0:
                    p.copy_(prox_step(p, self.state[p]["anchor"], lr, mu))
        return loss
