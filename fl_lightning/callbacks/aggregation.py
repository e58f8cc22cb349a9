"""The weighted-mean aggregator: the (sample-)weighted mean of the round's updates.

``WeightedMean(module.weighting)`` is what the engine does when no aggregator is given (the
algorithm's ``weighting`` argument, by default its paper's); add it to override an algorithm's
own aggregator (RFA's geometric median, say): ``WeightedMean()`` for the sample-weighted mean,
``WeightedMean("uniform")`` for the uniform mean over the round's clients."""

from __future__ import annotations

from typing import Optional

from torch import Tensor

from fl_lightning.distributed import all_reduce_sum
from fl_lightning.hooks import Aggregator, Federation
from fl_lightning.lightning_package import pl
from fl_lightning.update import (
    ClientUpdate,
    LinearReduction,
    Weighting,
    finish_linear,
    linear_sums,
    weighted_reduction,
)


class WeightedMean(Aggregator):
    """``sum_i w_i u_i / sum_i w_i`` with ``w_i`` the client's sample count (or 1).

    Accumulates in float64 in client-id order, so the result does not depend on the order
    clients ran in; under DDP it costs one all-reduce per round, shared with the algorithm's
    other linear reductions.

    Args:
        weighting: ``"num_samples"`` (FedAvg's weighting) or ``"uniform"``.
    """

    def __init__(self, weighting: Weighting = "num_samples") -> None:
        if weighting not in ("num_samples", "uniform"):
            raise ValueError(f"weighting must be 'num_samples' or 'uniform', got {weighting!r}")
        self.weighting = weighting

    @property
    def linear_reduction(self) -> LinearReduction:  # type: ignore[override]
        return weighted_reduction(self.weighting)

    def aggregate(
        self, trainer: pl.Trainer, module: Federation, updates: list[ClientUpdate]
    ) -> Optional[dict[str, Tensor]]:
        reductions = {name: (size, self.linear_reduction) for name, size in module.engine.aggregated_sizes().items()}
        out = finish_linear(all_reduce_sum(linear_sums(updates, reductions, module.device)), reductions)
        return out or None
