"""Proximal variance-reduced local updates (FedProxVR, Dinh et al., ICPP 2020), as pure functions.

The functions apply to tensors of any shape (one parameter tensor, or a flat vector).

* :func:`prox_step` — the closed form of ``prox_{eta h}(x)`` for ``h(w) = mu/2 ||w - anchor||^2``;
* :func:`svrg_direction`, :func:`sarah_direction` — the two variance-reduced estimators;
* :func:`full_gradient` — the exact gradient of a mean loss over a data set given in chunks;
* :class:`ProxSGD` — the optimizer that applies ``p <- prox(p - lr * p.grad)``, so the proximal
  term is an optimizer step, never a gradient term.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable, Sequence

import torch
from torch import Tensor


def prox_step(x: Tensor, anchor: Tensor, lr: float, mu: float) -> Tensor:
    """``argmin_w mu/2 ||w - anchor||^2 + 1/(2 lr) ||w - x||^2 = (x + lr mu anchor) / (1 + lr mu)``.

    ``mu = 0`` returns ``x`` unchanged; the result lies on the segment from ``x`` to ``anchor``
    with ``||prox(x) - anchor|| = ||x - anchor|| / (1 + lr mu)``.
    """
    if mu == 0:
        return x
    return (x + (lr * mu) * anchor) / (1.0 + lr * mu)


def svrg_direction(grad: Tensor, snapshot_grad: Tensor, full_grad: Tensor) -> Tensor:
    """SVRG: ``v_t = g_I(w_t) - g_I(w_0) + grad F(w_0)``, both minibatch gradients on the same batch ``I``."""
    return grad - snapshot_grad + full_grad


def sarah_direction(grad: Tensor, previous_grad: Tensor, previous_direction: Tensor) -> Tensor:
    """SARAH: ``v_t = g_I(w_t) - g_I(w_{t-1}) + v_{t-1}``, both minibatch gradients on the same batch ``I``."""
    return grad - previous_grad + previous_direction


def full_gradient(grad_fn: Callable[[Any], Sequence[Tensor]], chunks: Iterable[tuple[Any, int]]) -> list[Tensor]:
    """The gradient of the mean loss over a whole data set given as ``(batch, size)`` chunks.

    ``grad_fn(batch)`` is the gradient (a list of tensors) of the *mean* loss of a chunk; the
    result is ``sum_c size_c * grad_fn(c) / sum_c size_c``, accumulated in float64, returned in fp32.
    """
    total: list[Tensor] | None = None
    count = 0
    for batch, size in chunks:
        grads = [g.double() * size for g in grad_fn(batch)]
        total = grads if total is None else [t.add_(g) for t, g in zip(total, grads)]
        count += size
    if total is None or count == 0:
        raise ValueError("full_gradient needs at least one non-empty chunk")
    return [(t / count).float() for t in total]


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
