"""Distributionally robust objectives as compositional problems ``h(x) + f(g(x))``.

FedDRO (Khanduri et al.) writes penalized DRO over per-sample losses ``l_i`` as

    Phi(x) = mean_i h_i(x) + f( mean_i g_i(x) )

where the inner mean ``g`` runs over *all* clients' data. An objective here maps a batch of
per-sample losses to its per-sample ``h``-terms ``[b]`` and ``g``-terms ``[b, d_g]`` and gives
``f`` and its gradient; the federated algorithm estimates ``g`` (``y``) and differentiates the
surrogate ``mean(h) + <grad f(y_bar), mean(g)>``.

* :class:`KLDRO`: ``g_i = exp(l_i / lam - shift)``, ``f = log`` (the paper's eq. 4) or
  ``lam * log`` (the exact value of the inner max, option ``scale_by_lambda``).
* :class:`ChiSquareDRO`: the spec's corrected form of eq. 5, ``h_i = l_i + l_i^2 / (2 lam)``,
  ``g_i = l_i``, ``f(u) = -u^2 / (2 lam)``. The paper prints ``h = -l^2/(2 lam)``,
  ``f = +u^2/(2 lam)``, which equals ``-Var(l) / (2 lam)``: unbounded below, it maximizes the
  loss variance. The corrected one is ``mean(l) + Var(l) / (2 lam)``.

Numerical guards: terms are computed in float64 (whatever the autocast dtype of the losses),
``exp`` is taken after a *fixed* shift (the estimate mixes iterations, so a moving shift would
bias it), ``y`` is kept above the smallest possible ``g`` for KL (``g >= exp(-shift)`` since
``l >= 0``), and :func:`check_finite` stops with a clear error on NaN/Inf.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor


class NonFiniteEstimateError(FloatingPointError):
    """An inner-function estimate (or its terms) became NaN or Inf."""


class CompositionalObjective:
    """Base class: what a federated compositional algorithm needs from an objective."""

    #: dimension of the inner function g
    dim: int = 1

    def terms(self, losses: Tensor) -> tuple[Tensor, Tensor]:
        """Per-sample h-terms ``[b]`` and g-terms ``[b, dim]`` (float64) of per-sample losses ``[b]``."""
        raise NotImplementedError

    def outer(self, y: Tensor) -> Tensor:
        """``f(y)``, a scalar."""
        raise NotImplementedError

    def outer_grad(self, y: Tensor) -> Tensor:
        """``grad f(y)`` (shape ``[dim]``)."""
        raise NotImplementedError

    def guard(self, y: Tensor) -> Tensor:
        """``y`` moved into the domain of ``f``; default: unchanged (``f`` defined everywhere)."""
        return y


def check_finite(name: str, value: Tensor) -> Tensor:
    """Return ``value``; raise :class:`NonFiniteEstimateError` naming ``name`` if it holds NaN/Inf."""
    if not bool(torch.isfinite(value).all()):
        raise NonFiniteEstimateError(
            f"{name} is not finite ({value.detach().flatten()[:4].tolist()}...); lower the learning rate, "
            "raise lambda, or raise the KL shift"
        )
    return value


def storm_estimate(y_bar_prev: Tensor, g_cur: Tensor, g_prev: Tensor, beta: float) -> Tensor:
    """FedDRO's eq. 8, the hybrid SARAH/SGD (STORM) estimate of a client's inner function:

    ``y_k^t = (1 - beta) (y_bar^{t-1} - g_k(x_k^{t-1}; b)) + g_k(x_k^t; b)``

    with both ``g`` values on the same minibatch ``b``. ``beta = 1`` is the plain minibatch
    value (the "modified FedAvg" of Thm 4.2).
    """
    return (1.0 - beta) * (y_bar_prev - g_prev) + g_cur


class KLDRO(CompositionalObjective):
    """KL-regularized DRO (paper eq. 4): ``min_x f(mean_i exp(l_i(x) / lam))``, ``h = 0``.

    Args:
        lam: the KL penalty lambda (> 0); smaller is more robust (closer to the max loss).
        scale_by_lambda: ``f = lam * log`` (the exact inner max; gradients are ``lam`` times
            the paper's) instead of the paper's ``f = log``. Same minimizers; only the
            effective learning rate differs.
        shift: fixed ``c`` in ``g_i = exp(l_i / lam - c)``; raise it when ``l / lam`` can
            exceed ~700 (float64 overflow). It must stay fixed during a run.
    """

    dim = 1

    def __init__(self, lam: float = 5.0, scale_by_lambda: bool = False, shift: float = 0.0) -> None:
        if not lam > 0:
            raise ValueError(f"lam must be > 0, got {lam}")
        if not math.isfinite(shift):
            raise ValueError(f"shift must be finite, got {shift}")
        self.lam = lam
        self.scale_by_lambda = scale_by_lambda
        self.shift = shift

    @property
    def scale(self) -> float:
        """The factor of ``f``: ``lam`` with ``scale_by_lambda``, else 1."""
        return self.lam if self.scale_by_lambda else 1.0

    def terms(self, losses: Tensor) -> tuple[Tensor, Tensor]:
        """``h_i = 0``, ``g_i = exp(l_i / lam - shift)``."""
        losses = losses.double()
        return torch.zeros_like(losses), torch.exp(losses / self.lam - self.shift).unsqueeze(-1)

    def outer(self, y: Tensor) -> Tensor:
        """``scale * (log y + shift)``: the log of the unshifted mean of ``exp(l / lam)``."""
        return self.scale * (torch.log(y) + self.shift).sum()

    def outer_grad(self, y: Tensor) -> Tensor:
        """``scale / y``."""
        return self.scale / y

    def guard(self, y: Tensor) -> Tensor:
        """``max(y, exp(-shift))``: per-sample losses are >= 0, so ``g >= exp(-shift) > 0``."""
        return y.clamp(min=math.exp(-self.shift))


class ChiSquareDRO(CompositionalObjective):
    """Chi-square-regularized DRO, the corrected eq. 5 (see the module docstring):

    ``Phi = mean_i [l_i + l_i^2 / (2 lam)] - (mean_i l_i)^2 / (2 lam) = mean(l) + Var(l) / (2 lam)``

    (exact when no optimal weight hits ``p_i = 0``, i.e. every ``l_i >= mean(l) - lam``).

    Args:
        lam: the chi-square penalty lambda (> 0).
    """

    dim = 1

    def __init__(self, lam: float = 1.0) -> None:
        if not lam > 0:
            raise ValueError(f"lam must be > 0, got {lam}")
        self.lam = lam

    def terms(self, losses: Tensor) -> tuple[Tensor, Tensor]:
        """``h_i = l_i + l_i^2 / (2 lam)``, ``g_i = l_i``."""
        losses = losses.double()
        return losses + losses**2 / (2 * self.lam), losses.unsqueeze(-1)

    def outer(self, y: Tensor) -> Tensor:
        """``-y^2 / (2 lam)``."""
        return -(y**2).sum() / (2 * self.lam)

    def outer_grad(self, y: Tensor) -> Tensor:
        """``-y / lam``."""
        return -y / self.lam


def surrogate(objective: CompositionalObjective, losses: Tensor, y_bar: Tensor) -> Tensor:
    """``mean(h) + <grad f(y_bar), mean(g)>``: its gradient is FedDRO's direction (eq. 7)."""
    h, g = objective.terms(losses)
    return h.mean() + (objective.outer_grad(y_bar).detach().to(g.dtype) * g.mean(0)).sum()


def objective_value(objective: CompositionalObjective, losses: Tensor) -> Tensor:
    """``mean(h) + f(mean(g))`` over ``losses`` (e.g. all training losses): the DRO objective."""
    h, g = objective.terms(losses)
    return h.mean() + objective.outer(g.mean(0))


# ---------------------------------------------------------------------------------------------
# The worst-case sample weights of the centralized DRO baselines (FastDRO, PDSGD)


def cvar_weights(losses: Tensor, alpha: float) -> Tensor:
    """The worst-case weights of CVaR at level ``alpha`` over a batch of per-sample losses ``[b]``.

    ``q = argmax { sum_i q_i l_i : sum_i q_i = 1, 0 <= q_i <= 1 / (alpha b) }``: the largest
    ``alpha b`` losses weigh ``1 / (alpha b)`` each (the one at the boundary its fraction), the
    others 0, so that ``sum_i q_i l_i`` is the mean of the batch's upper ``alpha``-tail (Levy et
    al. 2020's minibatch CVaR). ``alpha = 1`` gives the mean. Branch-free, so it vectorizes.
    """
    if not 0 < alpha <= 1:
        raise ValueError(f"alpha must be in (0, 1], got {alpha}")
    b = losses.shape[-1]
    cap = 1.0 / (alpha * b)
    order = losses.argsort(dim=-1, descending=True)
    ranks = torch.arange(b, device=losses.device, dtype=losses.dtype)
    sorted_weights = (1.0 - ranks * cap).clamp(0.0, cap)  # the mass left at each rank, capped
    return torch.zeros_like(losses).scatter(-1, order, sorted_weights.expand_as(losses))


def simplex_projection(v: Tensor) -> Tensor:
    """The Euclidean projection of ``v`` ``[b]`` onto the probability simplex (by sorting; branch-free)."""
    u = v.sort(dim=-1, descending=True).values
    css = u.cumsum(-1)
    j = torch.arange(1, v.shape[-1] + 1, device=v.device, dtype=v.dtype)
    support = (u - (css - 1.0) / j > 0).sum(-1, keepdim=True)  # rho: the size of the support
    theta = (css.gather(-1, support - 1) - 1.0) / support.to(v.dtype)
    return (v - theta).clamp(min=0.0)


def chi_square_weights(losses: Tensor, lam: float) -> Tensor:
    """The worst-case weights of the chi-square-penalized robust loss over a batch ``[b]``:

    ``q = argmax_{q in simplex} sum_i q_i l_i - (lam / (2 b)) sum_i (b q_i - 1)^2``

    (Levy et al. 2020's penalized chi-square divergence ``(1/b) sum_i (b q_i - 1)^2 / 2``). Its
    optimality conditions give ``q_i = max(0, (1 + (l_i - eta) / lam) / b)``: the projection of
    ``(1 + l / lam) / b`` onto the simplex. ``lam -> infinity`` gives the mean.
    """
    if not lam > 0:
        raise ValueError(f"lam must be > 0, got {lam}")
    b = losses.shape[-1]
    return simplex_projection((1.0 + losses / lam) / b)


def chi_square_penalty(weights: Tensor, lam: float) -> Tensor:
    """``(lam / (2 b)) sum_i (b q_i - 1)^2``: the penalty of :func:`chi_square_weights`' objective."""
    b = weights.shape[-1]
    return lam / (2 * b) * ((b * weights - 1.0) ** 2).sum(-1)


def kl_dual_step(log_q: Tensor, gradient: Tensor, lam: float, lr: float) -> Tensor:
    """One proximal mirror-ascent step on the dual of KL-penalized DRO, in log space.

    ``q+ = argmax_{q in simplex} <gradient, q> - lam KL(q || 1/n) - (1/lr) KL(q || q)``, which is
    ``log q+ = (log q + lr gradient - lr lam log n) / (1 + lr lam)``, normalized: stable for any
    ``lr`` (the penalty is taken exactly, not linearized). ``gradient`` estimates the losses
    ``l_i`` (zero off the batch, ``n / b`` times the loss on it).
    """
    n = log_q.shape[-1]
    raw = (log_q + lr * gradient - lr * lam * math.log(n)) / (1.0 + lr * lam)
    return raw - torch.logsumexp(raw, dim=-1, keepdim=True)
