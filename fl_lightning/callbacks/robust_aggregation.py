"""Byzantine-robust aggregators as callbacks, usable with any algorithm.

Each aggregator gathers the round's updates from every process (one all-gather per round,
``fl_lightning.distributed.gather_updates``), stacks each client's tensors into one row of a
``[n, p]`` matrix (the tensors of ``module.engine.aggregated_sizes()`` concatenated, in that order),
applies a pure function of ``fl_lightning.functional.robust`` on the module's device in
float64, and splits the result back into names. The result is the same on every process and
equal to the single-process one.

Only the geometric median uses the clients' sample counts (``weighting``); the
coordinate-wise rules, Krum and centered clipping treat clients alike, as in their papers.
"""

from __future__ import annotations

from typing import Any, Literal, Optional

import torch
from torch import Tensor

from fl_lightning.distributed import gather_updates
from fl_lightning.functional.robust import (
    STOP_RULES,
    StopRule,
    bulyan,
    centered_clipping,
    coordinate_median,
    geometric_median,
    krum,
    trim_count,
    trimmed_mean,
)
from fl_lightning.hooks import Aggregator, Federation
from fl_lightning.lightning_compat import log_agreed
from fl_lightning.lightning_package import pl
from fl_lightning.update import ClientUpdate
from fl_lightning.validation import check_int, check_number

Weighting = Literal["num_samples", "uniform"]


def stack_updates(updates: list[ClientUpdate], names: dict[str, int], device: torch.device) -> tuple[Tensor, Tensor]:
    """``([n, sum numel], [n] sample counts)``: each update's tensors concatenated in ``names`` order."""
    rows = [torch.cat([u.tensors[name].reshape(-1).to(device, torch.float64) for name in names]) for u in updates]
    counts = torch.tensor([float(u.num_samples) for u in updates], dtype=torch.float64, device=device)
    return torch.stack(rows), counts


def split_aggregate(vector: Tensor, names: dict[str, int]) -> dict[str, Tensor]:
    """The inverse of the concatenation of :func:`stack_updates`, as fp32 tensors."""
    return {name: part.float() for name, part in zip(names, vector.split(list(names.values())))}


class RobustAggregator(Aggregator):
    """Base class: gathers all updates, stacks them, calls :meth:`combine` on the ``[n, p]`` matrix."""

    def on_fit_start(self, trainer: pl.Trainer, pl_module: Federation) -> None:
        """Refuse, before the first round, an algorithm with nothing for the aggregator to combine and a
        round too small for the rule (:meth:`check_round_size`)."""
        if not pl_module.engine.aggregated_sizes():
            declared = {n: s.reduction for n, s in pl_module.engine.update_specs.items()}
            raise ValueError(
                f"{type(self).__name__} combines the uploads declared with reduction 'aggregator', and "
                f"{type(pl_module).__name__} declares none (its uploads: {declared or 'none'}): remove the aggregator"
            )
        self.check_round_size(pl_module.clients_per_round)

    def check_round_size(self, clients_per_round: int) -> None:
        """Raise ValueError if the rule cannot combine ``clients_per_round`` uploads (default: any number can)."""

    def aggregate(
        self, trainer: pl.Trainer, module: Federation, updates: list[ClientUpdate]
    ) -> Optional[dict[str, Tensor]]:
        everyone = gather_updates(updates)
        if not everyone:
            return None
        names = module.engine.aggregated_sizes()
        points, counts = stack_updates(everyone, names, module.device)
        result = self.combine(points, counts)
        return split_aggregate(result, names)

    def combine(self, points: Tensor, num_samples: Tensor) -> Tensor:
        """The aggregate ``[p]`` of the uploads ``points`` ``[n, p]`` (float64) with sample counts ``[n]``."""
        raise NotImplementedError


class GeometricMedian(RobustAggregator):
    """The (sample-weighted) geometric median by Weiszfeld's algorithm (RAGA, RFA, Byrd-SAGA).

    Logs ``robust/weiszfeld_iterations`` and ``robust/weiszfeld_converged`` each round.

    Args:
        weighting: ``"num_samples"`` (RAGA's alpha_m = S_m / sum S) or ``"uniform"`` (Byrd-SAGA).
        eps: stopping tolerance (RAGA: 1e-5).
        max_iter: iteration cap.
        nu: distance floor (RFA's smoothing: 1e-5).
        stop: ``"objective_abs"``, ``"objective_rel"`` or ``"movement"`` (see ``robust.geometric_median``).
    """

    def __init__(
        self,
        weighting: Weighting = "num_samples",
        eps: float = 1e-5,
        max_iter: int = 100,
        nu: float = 1e-8,
        stop: StopRule = "objective_abs",
    ) -> None:
        if weighting not in ("num_samples", "uniform"):
            raise ValueError(f"weighting must be 'num_samples' or 'uniform', got {weighting!r}")
        if stop not in STOP_RULES:
            raise ValueError(f"stop must be one of {STOP_RULES}, got {stop!r}")
        check_number("eps", eps, 0.0, low_open=True)
        check_number("nu", nu, 0.0, low_open=True)
        check_int("max_iter", max_iter, 1)
        self.weighting = weighting
        self.eps = eps
        self.max_iter = max_iter
        self.nu = nu
        self.stop = stop
        self.last_iterations = 0
        self.last_converged = True

    def combine(self, points: Tensor, num_samples: Tensor) -> Tensor:
        weights = num_samples if self.weighting == "num_samples" else None
        result = geometric_median(points, weights, eps=self.eps, max_iter=self.max_iter, nu=self.nu, stop=self.stop)
        self.last_iterations, self.last_converged = result.iterations, result.converged
        return result.median

    def on_round_end(self, trainer: pl.Trainer, module: Federation, round_idx: int, aggregate: Any) -> None:
        if aggregate is not None:
            log_agreed(module, "robust/weiszfeld_iterations", float(self.last_iterations), on_step=False,
                       on_epoch=True, batch_size=1)
            log_agreed(module, "robust/weiszfeld_converged", float(self.last_converged), on_step=False,
                       on_epoch=True, batch_size=1)


class CoordinateMedian(RobustAggregator):
    """Per coordinate, the median of the clients' values (Yin et al., 2018)."""

    def combine(self, points: Tensor, num_samples: Tensor) -> Tensor:
        return coordinate_median(points)


class TrimmedMean(RobustAggregator):
    """Per coordinate, the mean after dropping the largest and smallest values (Yin et al., 2018).

    A round of ``n`` uploads drops ``b = max(1, floor(trim_fraction * n))`` at each end
    (:func:`~fl_lightning.functional.robust.trim_count`): the floor of scipy's ``trim_mean`` and
    Flower's ``FedTrimmedAvg``, but never zero, since a trimmed mean that trims nothing is the plain
    mean and lets any outlier through. A round must keep at least one upload (``n >= 2 b + 1``,
    so ``n >= 3`` with a fraction); a smaller ``clients_per_round`` is refused before training.
    For no trimming at all, use ``WeightedMean("uniform")``.

    Args:
        trim_fraction: fraction ``beta`` of the round's uploads dropped at each end, in (0, 0.5).
        num_trimmed: a fixed count ``b >= 1`` dropped at each end instead (overrides ``trim_fraction``).
    """

    def __init__(self, trim_fraction: float = 0.1, num_trimmed: Optional[int] = None) -> None:
        trim_count(1, trim_fraction)  # refuses a fraction outside (0, 0.5)
        if num_trimmed is not None:
            check_int("num_trimmed", num_trimmed, 1)  # 0 trims nothing: that is WeightedMean("uniform")
        self.trim_fraction = trim_fraction
        self.num_trimmed = num_trimmed

    def trimmed_count(self, num_updates: int) -> int:
        """``b``, the uploads dropped at each end of a round of ``num_updates``; ValueError if none would be left."""
        if self.num_trimmed is not None:
            b, rule = self.num_trimmed, f"num_trimmed={self.num_trimmed}"
        else:
            b, rule = trim_count(num_updates, self.trim_fraction), f"trim_fraction={self.trim_fraction}"
        if num_updates < 2 * b + 1:
            plural = "s" if b > 1 else ""
            raise ValueError(f"TrimmedMean({rule}) drops {b} upload{plural} at each end and keeps at least "
                             f"one: it needs at least {2 * b + 1} uploads per round, got {num_updates} "
                             "(raise clients_per_round or trim fewer)")
        return b

    def check_round_size(self, clients_per_round: int) -> None:
        self.trimmed_count(clients_per_round)

    def combine(self, points: Tensor, num_samples: Tensor) -> Tensor:
        return trimmed_mean(points, self.trimmed_count(points.shape[0]))


class Krum(RobustAggregator):
    """Krum / multi-Krum (Blanchard et al., 2017).

    Args:
        num_byzantine: ``f``, the number of Byzantine uploads assumed per round (``n > 2f + 2``).
        num_selected: uploads averaged (1 = Krum; ``n - f`` is the usual multi-Krum).
    """

    def __init__(self, num_byzantine: int, num_selected: int = 1) -> None:
        self.num_byzantine = check_int("num_byzantine", num_byzantine, 0)
        self.num_selected = check_int("num_selected", num_selected, 1)

    def check_uploads(self, num_uploads: int, source: str) -> None:
        """Raise ValueError unless ``num_uploads`` (``source`` says where the count comes from) exceed
        ``2 f + 2`` and ``num_selected``."""
        f = self.num_byzantine
        if not num_uploads > 2 * f + 2:
            raise ValueError(f"Krum(num_byzantine={f}) needs more than 2 * num_byzantine + 2 = {2 * f + 2} uploads per "
                             f"round; {source}: sample more clients or assume fewer Byzantine ones")
        if self.num_selected > num_uploads:
            raise ValueError(f"Krum(num_selected={self.num_selected}) selects more uploads than a round has ({source})")

    def check_round_size(self, clients_per_round: int) -> None:
        self.check_uploads(clients_per_round, f"clients_per_round={clients_per_round}")

    def combine(self, points: Tensor, num_samples: Tensor) -> Tensor:
        self.check_uploads(points.shape[0], f"this round has {points.shape[0]}")
        return krum(points, self.num_byzantine, self.num_selected)


class Bulyan(RobustAggregator):
    """Bulyan over Krum (El Mhamdi, Guerraoui and Rouault, 2018): ``n - 2f`` uploads picked by
    Krum one at a time, then per coordinate the mean of the ``n - 4f`` picked values closest to
    their median. Needs ``n >= 4 f + 3`` uploads in the round.

    Args:
        num_byzantine: ``f``, the number of Byzantine uploads assumed per round.
    """

    def __init__(self, num_byzantine: int) -> None:
        self.num_byzantine = check_int("num_byzantine", num_byzantine, 0)

    def check_uploads(self, num_uploads: int, source: str) -> None:
        """Raise ValueError unless ``num_uploads`` (``source`` says where the count comes from) reach ``4 f + 3``."""
        f = self.num_byzantine
        if num_uploads < 4 * f + 3:
            raise ValueError(f"Bulyan(num_byzantine={f}) needs at least 4 * num_byzantine + 3 = {4 * f + 3} uploads per "
                             f"round; {source}: sample more clients or assume fewer Byzantine ones")

    def check_round_size(self, clients_per_round: int) -> None:
        self.check_uploads(clients_per_round, f"clients_per_round={clients_per_round}")

    def combine(self, points: Tensor, num_samples: Tensor) -> Tensor:
        self.check_uploads(points.shape[0], f"this round has {points.shape[0]}")
        return bulyan(points, self.num_byzantine)


class CenteredClipping(RobustAggregator):
    """Centered clipping (Karimireddy, He and Jaggi, 2021), centred at the previous round's aggregate.

    The centre starts at zero and is kept in the callback's ``state_dict`` (so in checkpoints).

    Args:
        tau: clipping radius.
        iterations: clipping iterations per round.
    """

    def __init__(self, tau: float = 10.0, iterations: int = 1) -> None:
        self.tau = check_number("tau", tau, 0.0, low_open=True)
        self.iterations = check_int("iterations", iterations, 1)
        self.center: Optional[Tensor] = None

    def combine(self, points: Tensor, num_samples: Tensor) -> Tensor:
        center = self.center if self.center is not None else torch.zeros(points.shape[1], dtype=torch.float64)
        result = centered_clipping(points, center, self.tau, self.iterations)
        self.center = result.detach().cpu()
        return result

    def state_dict(self) -> dict[str, Any]:
        return {"center": self.center}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.center = state_dict.get("center")
