"""Byzantine-robust statistics of a stack of client updates, as pure functions.

Every function takes the round's uploads as one ``[n, p]`` matrix (one row per client) and
returns a ``[p]`` vector. They know nothing of Lightning; the aggregator callbacks in
``fl_lightning.callbacks.robust_aggregation`` call them on the gathered updates.

* :func:`geometric_median` — ``argmin_y sum_i a_i ||y - z_i||`` by Weiszfeld's algorithm
  (RAGA, RFA, Byrd-SAGA), in float64, vectorized over clients; breakdown point 1/2 of the weight.
* :func:`coordinate_median` — per coordinate, the median (Yin et al., 2018).
* :func:`trimmed_mean` — per coordinate, drop the ``b`` largest and ``b`` smallest values and average;
  :func:`trim_count` gives ``b`` for a trimmed fraction.
* :func:`krum` — the upload(s) with the smallest sum of squared distances to their
  ``n - f - 2`` nearest neighbours (Blanchard et al., 2017); ``num_selected > 1`` is multi-Krum.
* :func:`centered_clipping` — ``v <- v + mean_i clip_tau(z_i - v)`` iterated from a centre
  (Karimireddy, He and Jaggi, 2021).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Optional

import torch
from torch import Tensor

from fl_lightning.validation import check_int

StopRule = Literal["objective_abs", "objective_rel", "movement"]
STOP_RULES: tuple[str, ...] = ("objective_abs", "objective_rel", "movement")
CHECK_EVERY = 8
"""Weiszfeld iterations between two reads of the stopping decision by the host (:func:`geometric_median`)."""


@dataclass
class GeometricMedianResult:
    """The output of :func:`geometric_median`.

    Attributes:
        median: the approximate geometric median, ``[p]``, float64.
        objective: ``sum_i a_i ||median - z_i||`` with normalized weights.
        iterations: Weiszfeld iterations run.
        converged: whether the stopping rule held before ``max_iter``: the objective (or the
            iterate) settled within ``eps``. False when the iteration stopped because a step would
            raise the objective by more than that (the distance floor ``nu`` near a data point
            makes Weiszfeld's step non-monotone): the median is then the best iterate, not a
            converged one.
    """

    median: Tensor
    objective: float
    iterations: int
    converged: bool


def _check_points(points: Tensor, weights: Optional[Tensor]) -> tuple[Tensor, Tensor]:
    """``points`` as float64 ``[n, p]`` and ``weights`` normalized to sum 1 (uniform if None)."""
    if points.dim() != 2 or points.shape[0] == 0:
        raise ValueError(f"points must be a non-empty [n, p] matrix, got shape {tuple(points.shape)}")
    z = points.double()
    if weights is None:
        a = torch.full((z.shape[0],), 1.0 / z.shape[0], dtype=torch.float64, device=z.device)
    else:
        a = torch.as_tensor(weights, dtype=torch.float64, device=z.device).reshape(-1)
        if a.numel() != z.shape[0] or bool((a < 0).any() | ~(a.sum() > 0)):
            raise ValueError(f"weights must be {z.shape[0]} non-negative numbers with a positive sum, got {a.tolist()}")
        a = a / a.sum()
    return z, a


def _objective(points: Tensor, weights: Tensor, y: Tensor) -> Tensor:
    """``sum_i a_i ||y - z_i||`` in float64, as a 0-dim tensor on ``points``' device (no host read)."""
    return (weights.double() * torch.linalg.vector_norm(points.double() - y.double(), dim=1)).sum()


def weiszfeld_objective(points: Tensor, weights: Tensor, y: Tensor) -> float:
    """``sum_i a_i ||y - z_i||`` (the geometric median's objective) in float64."""
    return float(_objective(points, weights, y))


def _read_state(state: Tensor) -> list[float]:
    """The host's one read of the Weiszfeld loop's ``[stopped, converged, iterations, objective]`` per chunk."""
    return state.tolist()


def geometric_median(
    points: Tensor,
    weights: Optional[Tensor] = None,
    eps: float = 1e-5,
    max_iter: int = 100,
    nu: float = 1e-8,
    stop: StopRule = "objective_abs",
    check_every: int = CHECK_EVERY,
) -> GeometricMedianResult:
    """The weighted geometric median of the rows of ``points`` by Weiszfeld's algorithm.

    Starts from the weighted mean and iterates ``y <- sum_i b_i z_i / sum_i b_i`` with
    ``b_i = a_i / max(nu, ||y - z_i||)``, in float64 on ``points``' device. With ``nu``
    tiny this is Weiszfeld's algorithm with a guard at the data points; ``nu = 1e-5`` and
    ``max_iter = 4`` is RFA's smoothed Weiszfeld.

    The stopping rule is evaluated on the device after every iteration; once it holds, ``y``,
    the objective and the iteration count stay frozen. The host reads the decision once every
    ``check_every`` iterations, so the result is the same for every ``check_every``.

    Args:
        points: ``[n, p]`` uploads.
        weights: ``[n]`` non-negative weights (normalized here); uniform if None.
        eps: tolerance of the stopping rule.
        max_iter: iteration cap (>= 1).
        nu: distance floor (> 0).
        stop: ``"objective_abs"`` (objective decrease <= eps, the RAGA spec's default),
            ``"objective_rel"`` (decrease <= eps * objective, RFA) or ``"movement"``
            (``||y_new - y|| <= eps``, Byrd-SAGA).
        check_every: iterations between two host reads of the stopping decision (>= 1).
    """
    if not eps > 0:
        raise ValueError(f"eps must be > 0, got {eps}")
    if max_iter < 1:
        raise ValueError(f"max_iter must be >= 1, got {max_iter}")
    if not nu > 0:
        raise ValueError(f"nu must be > 0, got {nu}")
    if stop not in STOP_RULES:
        raise ValueError(f"stop must be one of {STOP_RULES}, got {stop!r}")
    check_int("check_every", check_every, 1)
    z, a = _check_points(points, weights)
    y = a @ z
    f = _objective(z, a, y)
    stopped = torch.zeros((), dtype=torch.bool, device=z.device)
    converged = torch.zeros((), dtype=torch.bool, device=z.device)
    iterations = torch.zeros((), dtype=torch.float64, device=z.device)
    it = 0
    while True:
        chunk = min(check_every, max_iter - it)
        for _ in range(chunk):
            dist = torch.linalg.vector_norm(z - y, dim=1).clamp_min(nu)
            beta = a / dist
            y_new = (beta @ z) / beta.sum()
            f_new = _objective(z, a, y_new)
            if stop == "objective_abs":
                done = (f - f_new).abs() <= eps
            elif stop == "objective_rel":
                done = (f - f_new).abs() <= eps * f_new
            else:
                done = torch.linalg.vector_norm(y_new - y) <= eps
            accept = f_new <= f  # never accept a step that increases the objective (floor effects)
            take = accept & ~stopped
            y, f = torch.where(take, y_new, y), torch.where(take, f_new, f)
            iterations = iterations + ~stopped
            converged = converged | (done & ~stopped)
            stopped = stopped | done | ~accept
        it += chunk
        is_stopped, is_converged, count, objective = _read_state(
            torch.stack([stopped.double(), converged.double(), iterations, f]))
        if is_stopped or it == max_iter:
            return GeometricMedianResult(y, objective, int(count), bool(is_converged))


def coordinate_median(points: Tensor) -> Tensor:
    """Per coordinate, the median of the ``n`` values (the mean of the two middle ones if ``n`` is even).

    One outlier of four uploads moves the mean by far, the median not:

    >>> coordinate_median(torch.tensor([[1.0, 10.0], [2.0, 20.0], [3.0, 30.0], [100.0, -100.0]]))
    tensor([ 2.5000, 15.0000], dtype=torch.float64)
    """
    z, _ = _check_points(points, None)
    s = z.sort(dim=0).values
    n = s.shape[0]
    return s[n // 2] if n % 2 else (s[n // 2 - 1] + s[n // 2]) / 2


def trim_count(num_points: int, trim_fraction: float) -> int:
    """The values a ``trim_fraction``-trimmed mean of ``num_points`` values drops at each end.

    ``max(1, floor(trim_fraction * n))``: the floor, as in ``scipy.stats.trim_mean`` and Flower's
    ``FedTrimmedAvg``, but at least one, so that a trimmed mean never silently becomes the plain
    mean of a small round (``floor(0.1 * n) = 0`` for ``n < 10``). Keeping one value then needs
    ``n >= 3`` (:func:`trimmed_mean` checks it).

    Args:
        num_points: ``n``, the number of values per coordinate.
        trim_fraction: ``beta``, in (0, 0.5).

    >>> trim_count(20, 0.25), trim_count(10, 0.1), trim_count(5, 0.1)
    (5, 1, 1)
    """
    if not 0 < trim_fraction < 0.5:
        raise ValueError(f"trim_fraction must be in (0, 0.5), got {trim_fraction}")
    return max(1, int(trim_fraction * num_points))


def trimmed_mean(points: Tensor, num_trimmed: int) -> Tensor:
    """Per coordinate, the mean after dropping the ``num_trimmed`` largest and smallest values.

    Args:
        points: ``[n, p]`` uploads.
        num_trimmed: values dropped at each end, ``0 <= 2 * num_trimmed < n``.

    >>> trimmed_mean(torch.tensor([[1.0, 10.0], [2.0, 20.0], [3.0, 30.0], [100.0, -100.0]]), num_trimmed=1)
    tensor([ 2.5000, 15.0000], dtype=torch.float64)
    """
    z, _ = _check_points(points, None)
    n = z.shape[0]
    if num_trimmed < 0 or 2 * num_trimmed >= n:
        raise ValueError(f"num_trimmed must be in [0, {(n - 1) // 2}] for {n} updates, got {num_trimmed}")
    s = z.sort(dim=0).values
    return s[num_trimmed : n - num_trimmed].mean(dim=0)


def krum_scores(points: Tensor, num_byzantine: int) -> Tensor:
    """Krum's score of each upload: the sum of squared distances to its ``n - f - 2`` nearest others.

    Requires ``n > 2 f + 2``.
    """
    z, _ = _check_points(points, None)
    n = z.shape[0]
    check_int("num_byzantine", num_byzantine, 0)
    if n <= 2 * num_byzantine + 2:
        raise ValueError(f"krum needs n > 2 * num_byzantine + 2; got n={n}, num_byzantine={num_byzantine}")
    d2 = torch.cdist(z, z).pow(2)
    d2.fill_diagonal_(float("inf"))
    k = n - num_byzantine - 2
    return d2.topk(k, dim=1, largest=False).values.sum(dim=1)


def krum(points: Tensor, num_byzantine: int, num_selected: int = 1) -> Tensor:
    """The mean of the ``num_selected`` uploads with the lowest Krum scores (1: Krum, more: multi-Krum).

    Ties are broken by the lower row index, so the result is deterministic.
    """
    n = points.shape[0]
    check_int("num_selected", num_selected, 1, n)
    scores = krum_scores(points, num_byzantine)
    order = torch.sort(scores, stable=True).indices[:num_selected]
    return points.double()[order].mean(dim=0)


def bulyan(points: Tensor, num_byzantine: int) -> Tensor:
    """Bulyan (El Mhamdi, Guerraoui and Rouault, 2018) over Krum: Krum picks ``theta = n - 2f``
    uploads one at a time, each from the ones not picked yet; then, per coordinate, the mean of
    the ``beta = theta - 2f`` picked values closest to their median. Requires ``n >= 4 f + 3``.

    Krum on the shrinking set scores each upload by its ``max(1, m - f - 2)`` nearest others
    (``m`` uploads left), as Flower's ``aggregate_bulyan``; ties go to the lower row index.
    """
    z, _ = _check_points(points, None)
    n, f = z.shape[0], check_int("num_byzantine", num_byzantine, 0)
    if n < 4 * f + 3:
        raise ValueError(f"bulyan needs n >= 4 * num_byzantine + 3; got n={n}, num_byzantine={f}")
    d2 = torch.cdist(z, z).pow(2)
    d2.fill_diagonal_(float("inf"))
    remaining, picked = list(range(n)), []
    for _ in range(n - 2 * f):
        sub = d2[remaining][:, remaining]
        k = max(1, len(remaining) - f - 2)
        scores = sub.topk(min(k, len(remaining)), dim=1, largest=False).values.sum(dim=1)
        best = remaining[int(torch.sort(scores, stable=True).indices[0])]
        picked.append(best)
        remaining.remove(best)
    chosen = z[picked]
    center = coordinate_median(chosen)
    closest = (chosen - center).abs().topk(n - 4 * f, dim=0, largest=False).indices
    return chosen.gather(0, closest).mean(dim=0)


def centered_clipping(points: Tensor, center: Tensor, tau: float, iterations: int = 1) -> Tensor:
    """``v <- v + (1/n) sum_i (z_i - v) min(1, tau / ||z_i - v||)``, ``iterations`` times from ``center``.

    Args:
        points: ``[n, p]`` uploads.
        center: ``[p]`` starting point (usually the previous round's aggregate).
        tau: clipping radius (> 0).
        iterations: number of clipping iterations (>= 1).
    """
    if not tau > 0:
        raise ValueError(f"tau must be > 0, got {tau}")
    if iterations < 1:
        raise ValueError(f"iterations must be >= 1, got {iterations}")
    z, _ = _check_points(points, None)
    v = center.to(z.device, torch.float64).reshape(-1)
    if v.numel() != z.shape[1]:
        raise ValueError(f"center has {v.numel()} entries, the updates have {z.shape[1]}")
    for _ in range(iterations):
        diff = z - v
        norms = torch.linalg.vector_norm(diff, dim=1, keepdim=True)
        scale = torch.clamp(tau / norms.clamp_min(torch.finfo(torch.float64).tiny), max=1.0)
        v = v + (diff * scale).mean(dim=0)
    return v
