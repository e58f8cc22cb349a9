"""Byzantine attacks and the choice of Byzantine clients, as pure functions.

The attack functions return what a Byzantine client uploads in place of its honest message
(a model delta, an averaged gradient...). Those that read the honest uploads (sign flip,
ALIE, IPM) take their statistics as arguments; gathering them is the callbacks' job
(``fl_lightning.callbacks.attacks``).
"""

from __future__ import annotations

import math
from statistics import NormalDist
from typing import Optional, Sequence

import torch
from torch import Tensor


def gaussian_attack(shape: torch.Size, generator: torch.Generator, std: float = 1.0) -> Tensor:
    """A fresh ``N(0, std^2 I)`` vector (RAGA's experiments: ``std = 1``)."""
    if not std > 0:
        raise ValueError(f"std must be > 0, got {std}")
    return torch.randn(shape, generator=generator, dtype=torch.float32) * std


def sign_flip_attack(reference: Tensor, scale: float = 3.0) -> Tensor:
    """``-scale * reference`` (the honest mean: colluding sign flip; the client's own message: plain sign flip)."""
    return -scale * reference


def scaling_attack(update: Tensor, factor: float) -> Tensor:
    """``factor * update`` (model-replacement style boosting)."""
    return factor * update


def alie_z(num_clients: int, num_byzantine: int) -> float:
    """ALIE's ``z_max`` (Baruch et al., 2019): ``Phi^-1((n - s) / n)``, ``s = floor(n/2 + 1) - f``.

    The largest shift that keeps the Byzantine uploads closer to the honest mean than enough
    honest uploads, so that median-type rules keep picking them. 0 when ``s <= 0`` or ``s >= n``.
    """
    if num_clients < 1 or not 0 <= num_byzantine <= num_clients:
        raise ValueError(f"need 0 <= num_byzantine <= num_clients and num_clients >= 1, got {num_byzantine}, {num_clients}")
    s = math.floor(num_clients / 2 + 1) - num_byzantine
    if s <= 0 or s >= num_clients:
        return 0.0
    return NormalDist().inv_cdf((num_clients - s) / num_clients)


def alie_attack(honest_mean: Tensor, honest_std: Tensor, z: float) -> Tensor:
    """``mean - z * std`` per coordinate (A Little Is Enough, Baruch et al., 2019)."""
    return honest_mean - z * honest_std


def ipm_attack(honest_mean: Tensor, epsilon: float = 0.1) -> Tensor:
    """``-epsilon * mean`` (inner-product manipulation, Xie et al., 2020)."""
    if not epsilon > 0:
        raise ValueError(f"epsilon must be > 0, got {epsilon}")
    return -epsilon * honest_mean


def flip_labels(labels: Tensor, num_classes: int) -> Tensor:
    """``y -> num_classes - 1 - y`` (label-flipping data poisoning)."""
    if num_classes < 2:
        raise ValueError(f"num_classes must be >= 2, got {num_classes}")
    return num_classes - 1 - labels


def select_byzantine(
    sizes: Sequence[int],
    generator: torch.Generator,
    fraction: Optional[float] = None,
    count: Optional[int] = None,
) -> list[int]:
    """Positions (into ``sizes``) of the Byzantine clients, from a random permutation.

    By ``count``: the first ``count`` clients of the permutation. By ``fraction`` (data mass,
    as in RAGA): walk the permutation and take every client that keeps the Byzantine share of
    the samples ``<= fraction`` (so the achieved share is at most the target). Give exactly one.
    """
    n = len(sizes)
    if (fraction is None) == (count is None):
        raise ValueError(f"give exactly one of fraction and count, got fraction={fraction}, count={count}")
    order = torch.randperm(n, generator=generator).tolist()
    if count is not None:
        if not 0 <= count <= n:
            raise ValueError(f"count must be in [0, {n}], got {count}")
        return sorted(order[:count])
    if not 0.0 <= fraction <= 1.0:  # type: ignore[operator]
        raise ValueError(f"fraction must be in [0, 1], got {fraction}")
    total = float(sum(sizes))
    chosen, mass = [], 0.0
    for i in order:
        if (mass + sizes[i]) / total <= fraction + 1e-12:  # type: ignore[operator]
            chosen.append(i)
            mass += sizes[i]
    return sorted(chosen)


def data_fraction(sizes: Sequence[int], chosen: Sequence[int]) -> float:
    """The share of all samples held by the clients at positions ``chosen`` (``1 - C_alpha``)."""
    total = float(sum(sizes))
    return sum(sizes[i] for i in chosen) / total if total > 0 else 0.0
