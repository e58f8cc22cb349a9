"""Proximal terms ``mu/2 ||w - anchor||^2``: their gradients and their proximal map, as pure functions.

Every function applies per tensor, to tensors of any shape (one parameter tensor, or a flat vector).

* :func:`proximal_gradient`: ``g + mu (w - anchor)``, the gradient of a loss plus the term
  (FedProx, Li et al., 2020: the anchor is the global model);
* :func:`depersonalization_gradient`: the same with the anchor ``2x - v``, the personal model
  ``v`` reflected through the global model ``x`` (FedDeper, Zhou et al., 2022), and
  :func:`depersonalization_strength`, its coefficient;
* :func:`prox_step`: the closed-form proximal map of the term, applied after a gradient step
  instead of adding its gradient (FedProxVR, Dinh et al., 2020).
"""

from __future__ import annotations

from typing import Sequence

from torch import Tensor


def proximal_gradient(grads: Sequence[Tensor], params: Sequence[Tensor], anchor: Sequence[Tensor], mu: float) -> list[Tensor]:
    """``g + mu (w - anchor)``: the gradient of ``F(w) + mu/2 ||w - anchor||^2``, per tensor."""
    return [g + mu * (w - a) for g, w, a in zip(grads, params, anchor)]


def depersonalization_gradient(
    grads: Sequence[Tensor], globalized: Sequence[Tensor], personal: Sequence[Tensor], global_model: Sequence[Tensor],
    strength: float,
) -> list[Tensor]:
    """``g + strength * (y + v - 2x)`` per tensor: ``g`` plus the gradient of ``strength/2 ||v + y - 2x||^2``.

    With ``strength = rho / eta`` this is the regularizer ``rho/(2 eta) ||v + y - 2x||^2``, a
    proximal term centred on the reflection ``2x - v`` of the personal model through ``x``.
    ``grads``, ``globalized`` (``y``), ``personal`` (``v``) and ``global_model`` (``x``) are
    lists of tensors shaped like the parameters (longer lists are cut to ``grads``).
    """
    return [g.add(y, alpha=strength).add(v, alpha=strength).add(x, alpha=-2.0 * strength)
            for g, y, v, x in zip(grads, globalized, personal, global_model)]


def depersonalization_strength(rho: float, lr: float) -> float:
    """``rho / eta``: the proximal coefficient that makes one SGD step of rate ``eta`` pull by exactly ``rho``."""
    return rho / lr


def prox_step(x: Tensor, anchor: Tensor, lr: float, mu: float) -> Tensor:
    """``argmin_w mu/2 ||w - anchor||^2 + 1/(2 lr) ||w - x||^2 = (x + lr mu anchor) / (1 + lr mu)``.

    ``mu = 0`` returns ``x`` unchanged; the result lies on the segment from ``x`` to ``anchor``
    with ``||prox(x) - anchor|| = ||x - anchor|| / (1 + lr mu)``.

    >>> prox_step(torch.tensor([2.0]), anchor=torch.tensor([0.0]), lr=0.5, mu=2.0)  # 2 / (1 + 0.5 * 2)
    tensor([1.])
    """
    if mu == 0:
        return x
    return (x + (lr * mu) * anchor) / (1.0 + lr * mu)
