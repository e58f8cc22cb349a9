"""What one client sends back to the server (and what its evaluation gives), how each uploaded
tensor is combined, and the linear combinations themselves.

An algorithm declares each tensor it uploads with :meth:`FederatedModule.add_update
<fl_lightning.module.FederatedModule.add_update>`, naming its size and its reduction, in the
spirit of torchmetrics' ``add_state(name, default, dist_reduce_fx)``:

===================  ===============================================================
``"aggregator"``     the Trainer's ``Aggregator`` callback decides (the sample-weighted
                     mean by default; a robust rule such as the geometric median when one
                     is given). Model deltas and gradients are declared so.
``"weighted_mean"``  ``sum_i n_i u_i / sum_i n_i`` with ``n_i`` the client's sample count
``"mean"``           ``sum_i u_i / m``, uniform over the round's ``m`` kept updates
                     (SCAFFOLD's control-variate deltas)
``"sum"``            ``sum_i u_i``
===================  ===============================================================
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable, Literal, Mapping, Optional, Sequence

import torch
from torch import Tensor

Reduction = Literal["aggregator", "weighted_mean", "mean", "sum"]
REDUCTIONS: tuple[str, ...] = ("aggregator", "weighted_mean", "mean", "sum")
#: the reductions that are linear in the updates: one all-reduce combines them on every process
LinearReduction = Literal["weighted_mean", "mean", "sum"]
#: the client weights of a mean: ``n_i`` (the client's sample count) or 1
Weighting = Literal["num_samples", "uniform"]


def weighted_reduction(weighting: Weighting) -> LinearReduction:
    """The mean with ``weighting``'s client weights: ``"weighted_mean"`` or ``"mean"``."""
    return "weighted_mean" if weighting == "num_samples" else "mean"


@dataclass(frozen=True)
class UpdateSpec:
    """One declared upload: its flat size and how the round's values are combined."""

    size: int
    reduction: Reduction = "aggregator"

    def __post_init__(self) -> None:
        if self.reduction not in REDUCTIONS:
            raise ValueError(f"reduction must be one of {REDUCTIONS}, got {self.reduction!r}")
        if not isinstance(self.size, int) or self.size < 0:
            raise ValueError(f"size must be an int >= 0, got {self.size!r}")


@dataclass
class ClientUpdate:
    """One client's contribution to a round.

    Attributes:
        client_id: index of the client in the federation.
        num_samples: size of the client's training split (the weight of sample-weighted means).
        tensors: named flat fp32 tensors to aggregate, e.g. ``{"delta": y - x}``, one per
            declared upload.
        metrics: scalars for logging (local loss, ...), not aggregated into the model: floats,
            or 0-dim tensors until the round's end reads them all with one device sync
            (:func:`read_metrics`; callbacks from ``on_round_updates`` on see floats).
    """

    client_id: int
    num_samples: int
    tensors: dict[str, Tensor]
    metrics: dict[str, float | Tensor] = field(default_factory=dict)

    def to(self, device: torch.device | str) -> "ClientUpdate":
        """A copy with every tensor on ``device``."""
        return ClientUpdate(
            self.client_id,
            self.num_samples,
            {k: v.to(device) for k, v in self.tensors.items()},
            dict(self.metrics),
        )


@dataclass
class ClientResult:
    """One client's evaluation by its module's own ``validation_step`` / ``test_step``.

    Attributes:
        client_id: index of the client in the federation.
        num_samples: samples in the client's evaluated split (the weight of sample-weighted means).
        metrics: each name the hook logged, with the client's value: a scalar's
            batch-size-weighted mean over the client's batches (or its ``reduce_fx``), a torchmetrics
            ``Metric``'s ``compute()`` over the client's batches.
        higher_is_better: the direction of each logged ``Metric`` that declares one, by name.
    """

    client_id: int
    num_samples: int
    metrics: dict[str, float]
    higher_is_better: dict[str, bool] = field(default_factory=dict)


def all_finite(tensors: Iterable[Tensor]) -> bool:
    """Whether every tensor is free of NaN and Inf (:func:`finite_flags` of one group)."""
    return finite_flags([tensors])[0]


def read_metrics(updates: Iterable[ClientUpdate]) -> None:
    """Replace the tensor metrics of ``updates`` by floats, read with one device sync for all of
    them (a client's local losses stay on the device until the round's end)."""
    pending = [(u.metrics, name) for u in updates for name, value in u.metrics.items() if isinstance(value, Tensor)]
    if not pending:
        return
    device = pending[0][0][pending[0][1]].device
    with torch.no_grad():
        values = torch.stack([_scalar(metrics[name], device) for metrics, name in pending])
    for (metrics, name), value in zip(pending, values.tolist()):
        metrics[name] = value


def _scalar(value: Tensor, device: torch.device) -> Tensor:
    """``value`` as a 0-dim fp32 tensor on ``device`` (as it is where it is one: a thousand clients'
    metrics would otherwise cost four operations each)."""
    if value.dim() == 0 and value.dtype == torch.float32 and value.device == device:
        return value
    return value.float().reshape(()).to(device)


def finite_flags(groups: Sequence[Iterable[Tensor]]) -> list[bool]:
    """For each group of tensors, whether every tensor of it is free of NaN and Inf, read with one
    device sync for all groups (a round's updates are checked together at its end).

    The minimum and the maximum propagate NaN and hold any -Inf / +Inf, so one reduction per
    tensor decides it (and, unlike a sum, it cannot overflow); all the extremes are then checked
    by one operation. Tensors that are rows of one stacked tensor (the uploads a batched block
    computes for all its clients at once) are reduced with one operation per stacked tensor, row
    by row: on a GPU each operation is a launch, and a block of a thousand clients would cost a
    thousand.
    """
    owners: list[int] = []
    lows: list[Tensor] = []
    highs: list[Tensor] = []
    stacked: dict[int, tuple[Tensor, list[int], list[int]]] = {}  # id(base) -> (base, rows, their groups)
    bases: dict[int, Optional[tuple[torch.Size, int, int]]] = {}  # what row_of looked up of each base
    for group, tensors in enumerate(groups):
        for t in tensors:
            if not t.numel():
                continue
            row = row_of(t, bases)
            if row is not None:
                base, i = row
                entry = stacked.setdefault(id(base), (base, [], []))
                entry[1].append(i)
                entry[2].append(group)
                continue
            low, high = torch.aminmax(t.detach())
            owners.append(group)
            lows.append(low.reshape(1))
            highs.append(high.reshape(1))
    for base, rows, members in stacked.values():
        flat = base.detach().reshape(len(base), -1)
        low, high = flat.amin(dim=1), flat.amax(dim=1)  # aminmax along a dim: ~20x slower on the CPU
        index = torch.tensor(rows, device=base.device)
        owners.extend(members)
        lows.append(low.index_select(0, index))
        highs.append(high.index_select(0, index))
    flags = [True] * len(groups)
    if not owners:
        return flags
    device = lows[0].device
    extremes = torch.cat([x if x.device == device else x.to(device) for x in (*lows, *highs)])  # dtypes promote
    finite = torch.isfinite(extremes).tolist()
    n = len(owners)
    for i, group in enumerate(owners):
        flags[group] = flags[group] and finite[i] and finite[n + i]
    return flags


def row_of(t: Tensor, bases: Optional[dict[int, Optional[tuple[torch.Size, int, int]]]] = None
           ) -> Optional[tuple[Tensor, int]]:
    """``(base, i)`` where ``t`` is row ``i`` of a contiguous tensor ``base`` (``base.unbind(0)[i]``,
    ``base[i]``), else None. ``bases`` keeps what is looked up of each base (its row shape, storage
    offset and row stride; None: no rows) for the next rows of the same base."""
    base = t._base
    if base is None:
        return None
    key = id(base)
    if bases is None or key not in bases:
        rows = (base.dim() > 0 and base.is_contiguous() and len(base) > 0 and base.stride(0) > 0)
        layout = (base.shape[1:], base.storage_offset(), base.stride(0)) if rows else None
        if bases is not None:
            bases[key] = layout
    else:
        layout = bases[key]
    if layout is None:
        return None
    shape, first, step = layout
    if t.shape != shape or not t.is_contiguous():
        return None
    offset = t.storage_offset() - first
    if offset % step:
        return None
    i = offset // step
    return (base, i) if 0 <= i < len(base) else None


def linear_sums(
    updates: list[ClientUpdate], reductions: Mapping[str, tuple[int, LinearReduction]], device: torch.device
) -> Tensor:
    """The float64 numerators and denominators of linear reductions, as one flat vector.

    For each name (in ``reductions`` order) the vector holds ``size`` entries of
    ``sum_i w_i u_i``, then three totals: ``sum_i n_i``, the update count and 1 (for sums). A
    process sums its updates in fp32, in client-id order (so the result does not depend on the
    order clients ran in), and hands the sum over in float64: summing these vectors over
    processes and calling :func:`finish_linear` gives the reductions over all processes'
    updates, in one all-reduce per round.
    """
    ordered = sorted(updates, key=lambda u: u.client_id)
    sizes = [size for size, _ in reductions.values()]
    out = torch.empty(sum(sizes) + 3, dtype=torch.float64, device=device)
    for part, (name, (size, reduction)) in zip(out[:-3].split(sizes), reductions.items()):
        acc = torch.zeros(size, dtype=torch.float32, device=device)
        for u in ordered:
            acc.add_(u.tensors[name].reshape(-1).to(device),
                     alpha=float(u.num_samples) if reduction == "weighted_mean" else 1.0)
        part.copy_(acc)  # widened as it is written: no float64 copy of its own, no concatenation
    totals = [float(sum(u.num_samples for u in ordered)), float(len(ordered)), 1.0]
    out[-3:] = torch.tensor(totals, dtype=torch.float64)
    return out


def finish_linear(sums: Tensor, reductions: Mapping[str, tuple[int, LinearReduction]]) -> dict[str, Tensor]:
    """Divide the (all-reduced) output of :func:`linear_sums` into fp32 results; empty if no update."""
    samples, count = float(sums[-3]), float(sums[-2])
    if count == 0:
        return {}
    out = {}
    for (name, (size, reduction)), part in zip(reductions.items(), sums[:-3].split([s for s, _ in reductions.values()])):
        denominator = {"weighted_mean": samples, "mean": count, "sum": 1.0}[reduction]
        if denominator > 0:  # divided in float64 and rounded to fp32 as it is written: one pass
            out[name] = torch.div(part, denominator, out=torch.empty(size, dtype=torch.float32, device=sums.device))
        else:
            out[name] = torch.zeros(size, dtype=torch.float32, device=sums.device)
    return out

