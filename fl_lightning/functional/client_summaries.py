"""Summaries of one metric over clients: the figures that federated evaluation logs.

Each evaluated client gives one value of a metric (its MSE, its accuracy...) and a weight (the
number of samples it was evaluated on). :func:`summarize` reduces them to a few numbers that
describe the distribution over clients, as Flower's ``evaluate_metrics_aggregation_fn`` would:

* ``weighted``: ``sum_i n_i v_i / sum_i n_i``, equal to the pooled figure over all the clients'
  samples for a metric that is a mean over samples (a loss, an MSE, an accuracy);
* ``mean``: the uniform mean over clients (every client counts once, whatever its size);
* ``worst`` / ``best``: the lowest and highest client's value, in the metric's direction (only
  when the direction is known);
* ``p10``, ``p90``...: percentiles over clients (linear interpolation, as ``torch.quantile``).
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch
from torch import Tensor


def percentile_name(q: float) -> str:
    """The key of percentile ``q`` (in [0, 100]): ``p10``, ``p2.5``."""
    return f"p{q:g}"


def summarize(
    values: Tensor, weights: Tensor, higher_is_better: Optional[bool], percentiles: Sequence[float] = (10, 90)
) -> dict[str, float]:
    """The summary of one metric over clients.

    Args:
        values: one value per client (1-D, at least one).
        weights: one weight per client, >= 0 with a positive sum (their sample counts).
        higher_is_better: the metric's direction; None (unknown): no ``worst`` or ``best``.
        percentiles: the percentiles over clients to give, each in [0, 100].

    Returns:
        ``{"weighted", "mean", "worst", "best", "p10", ...}`` as floats (computed in float64);
        a NaN client value gives NaN figures.

    Three clients' accuracies, the first with twice the others' samples:

    >>> summarize(torch.tensor([1.0, 0.5, 0.75]), torch.tensor([2.0, 1.0, 1.0]), higher_is_better=True,
    ...           percentiles=(50,))
    {'weighted': 0.8125, 'mean': 0.75, 'worst': 0.5, 'best': 1.0, 'p50': 0.75}
    """
    if values.dim() != 1 or values.numel() == 0:
        raise ValueError(f"values must be a non-empty 1-D tensor, got shape {tuple(values.shape)}")
    if weights.shape != values.shape:
        raise ValueError(f"weights must have the shape of values {tuple(values.shape)}, got {tuple(weights.shape)}")
    v, w = values.detach().double().cpu(), weights.detach().double().cpu()
    if bool((w < 0).any()) or float(w.sum()) <= 0:
        raise ValueError(f"weights must be >= 0 with a positive sum, got {w.tolist()}")
    bad = [q for q in percentiles if not 0 <= q <= 100]
    if bad:
        raise ValueError(f"percentiles must be in [0, 100], got {list(percentiles)}")
    out = {"weighted": float((w * v).sum() / w.sum()), "mean": float(v.mean())}
    if higher_is_better is not None:
        low, high = float(v.min()), float(v.max())
        out["worst"], out["best"] = (low, high) if higher_is_better else (high, low)
    if percentiles:
        qs = torch.quantile(v, torch.tensor([q / 100 for q in percentiles], dtype=torch.float64))
        out.update({percentile_name(q): float(x) for q, x in zip(percentiles, qs)})
    return out
