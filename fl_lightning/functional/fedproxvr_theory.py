"""FedProxVR's convergence theory as numbers (Dinh et al., ICPP 2020, Lemma 1, Theorem 1, Sec. 4.3).

What the paper's analysis says about its step-size parameter ``beta`` (``eta = 1/(beta L)``),
the proximal penalty ``mu`` and the local steps ``tau``: which ``tau`` reach a local accuracy
``theta`` (Lemma 1), the rate constant ``Theta`` of Theorem 1, and the parameters that minimize
the training-time bound of Sec. 4.3 for a computation/communication cost ratio ``gamma``
(the paper's Fig. 1), and the local accuracy a client actually reached in a round
(:func:`achieved_local_accuracy`). ``lam`` is the weak-convexity constant of the local losses and
``mu_bar = mu - lam`` the strong convexity of the proximal surrogate; ``sigma2`` is the
data-weighted gradient dissimilarity ``sigma_bar^2``. Spec: ``../shared/specs/fedproxvr.md`` §2.8.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence, TypeVar

import torch
from torch import Tensor

from fl_lightning.functional.norms import joint_norm

#: a float, or a float64 tensor of grid points (the formulas apply elementwise)
Value = TypeVar("Value", float, Tensor)


def _check(beta: float, mu: float, lam: float) -> None:
    """The domain of Lemma 1: ``beta > 3`` and ``mu > lam``."""
    if beta <= 3:
        raise ValueError(f"beta must be > 3 for Lemma 1's lower bound to be positive, got {beta}")
    if mu <= lam:
        raise ValueError(f"mu must exceed the weak-convexity constant lam={lam} (mu_bar = mu - lam > 0), got {mu}")


def steps_lower_bound(beta: float, mu: float, theta: float, smoothness: float = 1.0, lam: float = 0.5) -> float:
    """Lemma 1: the fewest local steps ``tau`` that reach local accuracy ``theta`` (both estimators).

    ``3 (beta^2 L^2 + mu^2) / (theta^2 mu_bar L (beta - 3))``.
    """
    _check(beta, mu, lam)
    if not 0 < theta < 1:
        raise ValueError(f"theta must be in (0, 1), got {theta}")
    return 3 * (beta**2 * smoothness**2 + mu**2) / (theta**2 * (mu - lam) * smoothness * (beta - 3))


def sarah_steps_upper_bound(beta: float) -> float:
    """Lemma 1, eq. (13): the most local steps SARAH's analysis allows, ``(5 beta^2 - 4 beta) / 8``."""
    return (5 * beta**2 - 4 * beta) / 8


def svrg_min_a(tau: float) -> float:
    """The smallest ``a > 0`` with ``a - 4 >= 4 sqrt(a (tau + 1))`` (the side condition of eq. (14)).

    Solving ``s^2 - 4 sqrt(tau+1) s - 4 = 0`` for ``s = sqrt(a)`` gives
    ``a = (2 sqrt(tau + 1) + 2 sqrt(tau + 2))^2``.
    """
    if tau < 0:
        raise ValueError(f"tau must be >= 0, got {tau}")
    return (2 * math.sqrt(tau + 1) + 2 * math.sqrt(tau + 2)) ** 2


def svrg_steps_upper_bound(beta: float, tau: float) -> float:
    """Lemma 1, eq. (14) with the loosest admissible ``a``: ``(5 beta^2 - 4 beta) / (8 a) - 2``.

    SVRG's analysis covers ``tau`` local steps at step-size parameter ``beta`` only when ``tau``
    is at most this value (negative: no ``tau`` at all).
    """
    return sarah_steps_upper_bound(beta) / svrg_min_a(tau) - 2


def _accuracy_formula(beta: Value, mu: Value, smoothness: float, lam: float) -> Value:
    """Eq. (22), elementwise: ``sqrt(24 (beta^2 L^2 + mu^2) / (mu_bar L (5 beta^2 - 4 beta) (beta - 3)))``."""
    return (24 * (beta**2 * smoothness**2 + mu**2) / ((mu - lam) * smoothness * (5 * beta**2 - 4 * beta) * (beta - 3))) ** 0.5


def _rate_formula(mu: Value, theta: Value, smoothness: float, lam: float, sigma2: float) -> Value:
    """Theorem 1's ``Theta``, elementwise (see :func:`rate_constant`)."""
    mu_bar, spread = mu - lam, (1 + theta**2) * (1 + sigma2)
    return (
        1
        - theta * (2 * (1 + sigma2)) ** 0.5
        - 2 * smoothness / mu_bar * spread**0.5
        - 2 * smoothness * mu / mu_bar**2 * spread
    ) / mu


def local_accuracy(beta: float, mu: float, smoothness: float = 1.0, lam: float = 0.5) -> float:
    """Eq. (22): the ``theta`` reached with the largest ``tau`` SARAH allows at ``beta`` (eq. 16)."""
    _check(beta, mu, lam)
    return _accuracy_formula(beta, mu, smoothness, lam)


def achieved_local_accuracy(
    grad_end: Sequence[Tensor], end: Sequence[Tensor], anchor: Sequence[Tensor], grad_anchor: Sequence[Tensor], mu: float
) -> Tensor:
    """The local accuracy a client reached, eq. (11) without the expectation:
    ``||grad J_n(w_n)|| / ||grad F_n(w_bar)||`` with ``grad J_n(w) = grad F_n(w) + mu (w - w_bar)``.

    ``grad_end`` is ``grad F_n`` at the client's model ``end`` (``w_n``), ``grad_anchor`` at the
    global model ``anchor`` (``w_bar``), each a list of tensors shaped like the parameters; the
    result is a 0-dim tensor (no host sync). ``theta = 1`` means no progress on the local problem
    (``w_n = w_bar``), ``0`` its exact solution.
    """
    surrogate = [g + mu * (w - a) for g, w, a in zip(grad_end, end, anchor)]
    return joint_norm(surrogate) / joint_norm(grad_anchor)


def rate_constant(mu: float, theta: float, smoothness: float = 1.0, lam: float = 0.5, sigma2: float = 0.0) -> float:
    """Theorem 1's ``Theta``: the average squared gradient norm after ``T`` rounds is at most
    ``Delta / (Theta T)``; the guarantee needs ``Theta > 0`` (a non-positive value is returned as is)."""
    if mu <= lam:
        raise ValueError(f"mu must exceed the weak-convexity constant lam={lam}, got {mu}")
    return _rate_formula(mu, theta, smoothness, lam, sigma2)


@dataclass(frozen=True)
class OptimalParameters:
    """The solution of the paper's problem (23) for one ``gamma``: Fig. 1's quantities."""

    gamma: float
    beta: float
    mu: float
    tau: float
    theta: float
    rate: float  # Theta
    cost: float  # (1 / Theta) (1 + gamma tau), the training-time bound up to Delta / epsilon


def optimal_parameters(
    gamma: float,
    smoothness: float = 1.0,
    lam: float = 0.5,
    sigma2: float = 0.0,
    beta_max: float = 400.0,
    mu_max: float = 400.0,
    points: int = 1200,
    refinements: int = 4,
) -> OptimalParameters:
    """Minimize ``(1 / Theta) (1 + gamma tau)`` over ``beta > 3`` and ``mu > lam`` (problem 23).

    ``tau`` and ``theta`` follow from ``beta`` and ``mu`` (eqs. 16 and 22); points with
    ``Theta <= 0`` or ``theta >= 1`` are infeasible. Solved on a log-spaced grid of
    ``points x points`` in float64, refined ``refinements`` times around the best point.
    """
    if gamma < 0:
        raise ValueError(f"gamma must be >= 0, got {gamma}")
    b_lo, b_hi = math.log(3.0 + 1e-6), math.log(beta_max)
    m_lo, m_hi = math.log(lam + 1e-6), math.log(mu_max)
    best = None
    for _ in range(refinements + 1):
        beta = torch.logspace(b_lo, b_hi, points, base=math.e, dtype=torch.float64)[:, None]
        mu = torch.logspace(m_lo, m_hi, points, base=math.e, dtype=torch.float64)[None, :]
        tau = sarah_steps_upper_bound(beta)
        theta = _accuracy_formula(beta, mu, smoothness, lam)
        rate = _rate_formula(mu, theta, smoothness, lam, sigma2)
        cost = torch.where((rate > 0) & (theta < 1), (1 + gamma * tau) / rate, torch.full_like(rate, math.inf))
        i, j = divmod(int(cost.argmin()), points)
        if not math.isfinite(float(cost[i, j])):
            raise ValueError(f"no feasible (beta, mu) with Theta > 0 for sigma2={sigma2}, lam={lam}")
        best = OptimalParameters(gamma, float(beta[i, 0]), float(mu[0, j]), float(tau[i, 0]), float(theta[i, j]),
                                 float(rate[i, j]), float(cost[i, j]))
        # zoom in: two grid cells either side of the best point
        step_b, step_m = (b_hi - b_lo) / (points - 1), (m_hi - m_lo) / (points - 1)
        b_lo, b_hi = max(math.log(3.0 + 1e-9), math.log(best.beta) - 2 * step_b), math.log(best.beta) + 2 * step_b
        m_lo, m_hi = max(math.log(lam + 1e-9), math.log(best.mu) - 2 * step_m), math.log(best.mu) + 2 * step_m
    assert best is not None
    return best
