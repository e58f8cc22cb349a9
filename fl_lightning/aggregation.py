"""The round's aggregate: the kept updates combined by the reductions their uploads declare.

One pure function (but for its one all-reduce): the engine calls it once per round with this
process's kept updates, and every process gets the same aggregate and the same count.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping, Optional, Sequence

import torch
from torch import Tensor

from fl_lightning.distributed import all_reduce_sum
from fl_lightning.hooks import Aggregator
from fl_lightning.update import ClientUpdate, LinearReduction, UpdateSpec, finish_linear, linear_sums

#: a non-linear aggregator's combination of the ``"aggregator"`` uploads (None: nothing to combine)
Combine = Callable[[list[ClientUpdate]], Optional[dict[str, Tensor]]]


def aggregate(
    updates: list[ClientUpdate],
    specs: Mapping[str, UpdateSpec],
    aggregator_reduction: Optional[LinearReduction],
    combine: Optional[Combine],
    device: torch.device,
) -> tuple[Optional[dict[str, Tensor]], int]:
    """Combine the round's kept updates (this process's) by their declared reductions.

    The linear reductions, and the ``"aggregator"`` uploads when ``aggregator_reduction`` says the
    aggregator is linear (the mean, by default), cost one all-reduce together; otherwise
    ``combine`` (a robust rule, responsible for its own communication) combines the
    ``"aggregator"`` uploads.

    Returns:
        ``(aggregate, num_updates)``: one tensor per declared upload (in declaration order), None
        when no process kept an update or ``combine`` found nothing to combine; and the number of
        updates kept over all processes.
    """
    linear: dict[str, tuple[int, LinearReduction]] = {}
    delegated = []
    for name, spec in specs.items():
        reduction = aggregator_reduction if spec.reduction == "aggregator" else spec.reduction
        if reduction is None or reduction == "aggregator":
            delegated.append(name)
        else:
            linear[name] = (spec.size, reduction)
    sums = all_reduce_sum(linear_sums(updates, linear, device))
    num_updates = int(sums[-2])
    if num_updates == 0:
        return None, 0
    out = finish_linear(sums, linear)
    if delegated:
        assert combine is not None, "uploads declared for the aggregator need an aggregator when it is not linear"
        combined = combine(updates)
        if combined is None:
            return None, num_updates
        out.update(combined)
    return {name: out[name] for name in specs}, num_updates


def find_aggregator(callbacks: Sequence[Any], default: Optional[Aggregator]) -> Optional[Aggregator]:
    """The one ``Aggregator`` among a Trainer's ``callbacks``, else ``default`` (ValueError if several)."""
    found = [cb for cb in callbacks if isinstance(cb, Aggregator)]
    if len(found) > 1:
        raise ValueError(f"give at most one Aggregator callback, got {[type(c).__name__ for c in found]}")
    return found[0] if found else default
