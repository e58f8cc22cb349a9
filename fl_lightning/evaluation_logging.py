"""A client module's ``self.log`` in validation and test on several processes: the whole set's values.

Under ``fl_ddp`` each process evaluates its own shard of the validation (test) set, each sample on
one process (:func:`fl_lightning.strategy.unpadded`). A client module that logs
``self.log("val/loss", loss)`` in its ``validation_step``, without ``sync_dist`` as most modules do,
would log its shard's mean on each process, and the first process's is what ``ModelCheckpoint`` and
early stopping read; with ``sync_dist=True`` Lightning divides the processes' mean sum by their mean
sample count, floored, which is the set's mean only where the shards are equal in size
(Lightning-AI/pytorch-lightning#21859). So, on several processes, the engine routes the client's calls
in its evaluation hooks here (:class:`EvaluationLogs`): each scalar's value over the epoch is
accumulated as Lightning accumulates it (the batch-size-weighted mean, or the sum, maximum or minimum
of the ``reduce_fx``), and at the epoch's end the processes' accumulations are gathered in one
collective and each name is logged once, the same value on every process: the value one process
evaluating the whole set logs (to float rounding), whatever ``sync_dist`` says. A value logged from
an epoch hook counts once per process (the processes' mean, for a mean): the whole set's where it
is, as a ``Metric``'s ``compute()`` is.

What is not a scalar value over the epoch goes to Lightning as the client logged it: a torchmetrics
``Metric`` (torchmetrics gathers its states over the processes when it is computed, at the epoch's
end), a call with ``rank_zero_only=True``, a value Lightning refuses. A per-batch value
(``on_step=True``) is its batch's on the process that evaluated it, logged without ``sync_dist``: the
shards' batch counts may differ by one, and a collective in one process's extra batch would wait
forever (:func:`check_no_step_syncs` refuses a ``Metric`` that syncs at every step for that reason).
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass
from typing import Any, Optional, Sequence

import torch
from torch import Tensor
from torchmetrics import Metric

from fl_lightning.distributed import all_gather_object
from fl_lightning.lightning_compat import current_hook, dataloader_suffix, lightning_log, log_agreed
from fl_lightning.lightning_package import extract_batch_size, pl
from fl_lightning.local_logging import call_options

#: the ``reduce_fx`` values Lightning accepts, by name (its strings, and the functions it recognizes)
_REDUCTIONS = {"mean": "mean", "avg": "mean", "sum": "sum", "max": "max", "min": "min"}
_REDUCING_FUNCTIONS = ((torch.mean, "mean"), (torch.sum, "sum"), (sum, "sum"), (torch.max, "max"), (max, "max"),
                       (torch.min, "min"), (min, "min"))
#: the options of a call that the value logged at the epoch's end keeps
_KEPT_OPTIONS = ("prog_bar", "logger")

#: one process's accumulation of a name: (reduction, value, weight, forked, kept options), where
#: value is the weighted sum (mean), the sum, the maximum or the minimum, and weight the samples
#: of a mean; forked: the call logged the per-batch values too (``on_step=True``)
Accumulated = tuple[str, float, int, bool, dict[str, Any]]


def reduction_of(reduce_fx: Any) -> Optional[str]:
    """The reduction ``"mean"``, ``"sum"``, ``"max"`` or ``"min"`` that Lightning reads in a
    ``reduce_fx`` (None: one it refuses)."""
    if isinstance(reduce_fx, str):
        return _REDUCTIONS.get(reduce_fx.lower())
    return next((name for function, name in _REDUCING_FUNCTIONS if reduce_fx is function), None)


def merge(parts: Sequence[dict[tuple[str, str], Accumulated]]) -> dict[tuple[str, str], Accumulated]:
    """The processes' accumulations (each process's ``{(name, dataloader suffix): accumulated}``) as
    one: weighted sums and weights add, sums add, maxima and minima take the extreme. A name
    accumulated only by some processes is theirs."""
    merged: dict[tuple[str, str], Accumulated] = {}
    for part in parts:
        for key, (reduction, value, weight, forked, options) in part.items():
            if key not in merged:
                merged[key] = (reduction, value, weight, forked, options)
                continue
            _, seen, seen_weight, _, _ = merged[key]
            combined = max(seen, value) if reduction == "max" else min(seen, value) if reduction == "min" \
                else seen + value
            merged[key] = (reduction, combined, seen_weight + weight, forked, options)
    return merged


def epoch_value(reduction: str, value: float, weight: int) -> float:
    """The value of a merged accumulation: a mean's weighted sum over its weight, else the value."""
    return value / weight if reduction == "mean" else value


@dataclass
class _Entry:
    """A name's accumulation on this process, on the value's device (read once, at the epoch's end)."""

    reduction: str
    value: Tensor
    weight: int
    forked: bool
    options: dict[str, Any]


class EvaluationLogs:
    """The client module's ``self.log`` calls of one evaluation epoch on this process, logged at
    its end (:meth:`flush`) as the values over every process's batches.

    Args:
        client: the client module whose calls these are (and through which they are logged).
        epoch_end: the hook the merged values are logged from (``"on_validation_epoch_end"``, ``"on_test_epoch_end"``).
    """

    def __init__(self, client: pl.LightningModule, epoch_end: str) -> None:
        self.client = client
        self.epoch_end = epoch_end
        self._batch: Optional[Any] = None
        self._batch_size: Optional[int] = None
        self._entries: dict[tuple[str, str], _Entry] = {}

    def start(self, batch: Optional[Any]) -> None:
        """The batch the client's next calls come from (None in an epoch hook), whose size weighs a
        mean's values as Lightning weighs them (a call's ``batch_size`` first)."""
        self._batch, self._batch_size = batch, None

    def log(self, name: str, value: Any, *args: Any, **kwargs: Any) -> None:
        """Stands in for the client's ``self.log`` (same signature) in an evaluation hook."""
        options = call_options(args, kwargs)
        reduction = reduction_of(options.get("reduce_fx", "mean"))
        scalar = isinstance(value, numbers.Number) or isinstance(value, Tensor) and value.numel() == 1
        if not scalar or reduction is None or options.get("rank_zero_only"):
            lightning_log(self.client, name, value, *args, **kwargs)
            return
        on_step = bool(options.get("on_step"))  # Lightning's defaults in an evaluation hook: on_step=False,
        on_epoch = options.get("on_epoch") is not False  # on_epoch=True
        if on_step:  # the batch's value, on this process
            lightning_log(self.client, f"{name}_step" if on_epoch else name, value,
                          **{**options, "on_step": True, "on_epoch": False, "sync_dist": False})
        if not on_epoch:
            return
        value = torch.as_tensor(value).detach().reshape(())
        value = value if value.dtype in (torch.float32, torch.float64) else value.float()
        weight = 1
        if reduction == "mean":
            weight = int(options.get("batch_size") or self._inferred_batch_size())
            value = value * weight
        suffix = dataloader_suffix(self.client.trainer) if options.get("add_dataloader_idx", True) else ""
        self._add((name, suffix), reduction, value, weight, on_step, {k: options[k] for k in _KEPT_OPTIONS
                                                                       if k in options})

    def flush(self) -> None:
        """Log each name once, its value over every process's batches, the same on every process
        (every process calls it: one ``all_gather_object``, also where no name was logged). A name
        also logged per batch gets Lightning's names: ``<name>_epoch`` for the loggers and the
        progress bar, ``<name>`` for callbacks (``ModelCheckpoint(monitor=...)``)."""
        entries, self._entries = self._entries, {}
        mine = {key: (e.reduction, float(e.value), e.weight, e.forked, e.options) for key, e in entries.items()}
        with current_hook(self.client, self.epoch_end):
            for (name, suffix), (reduction, value, weight, forked, options) in merge(all_gather_object(mine)).items():
                logged = torch.tensor(epoch_value(reduction, value, weight))
                agreed = {"on_step": False, "on_epoch": True, "batch_size": 1, "add_dataloader_idx": False}
                if forked:
                    log_agreed(self.client, f"{name}_epoch{suffix}", logged, **options, **agreed)
                    log_agreed(self.client, f"{name}{suffix}", logged, prog_bar=False, logger=False, **agreed)
                else:
                    log_agreed(self.client, f"{name}{suffix}", logged, **options, **agreed)

    def _add(self, key: tuple[str, str], reduction: str, value: Tensor, weight: int, forked: bool,
             options: dict[str, Any]) -> None:
        """Accumulate ``value`` (times its weight for a mean) into ``key``'s entry."""
        entry = self._entries.get(key)
        if entry is None:
            self._entries[key] = _Entry(reduction, value, weight, forked, options)
            return
        if entry.reduction != reduction:
            raise ValueError(f"self.log({key[0]!r}, ...) is called with reduce_fx={reduction!r} and "
                             f"{entry.reduction!r} in one evaluation epoch: one reduction per name")
        if reduction == "max":
            entry.value = torch.maximum(entry.value, value)
        elif reduction == "min":
            entry.value = torch.minimum(entry.value, value)
        else:
            entry.value = entry.value + value
        entry.weight += weight

    def _inferred_batch_size(self) -> int:
        """The size of the current batch as Lightning infers it (1 in an epoch hook), once per batch."""
        if self._batch_size is None:
            self._batch_size = 1 if self._batch is None else extract_batch_size(self._batch)
        return self._batch_size


def check_no_step_syncs(client: pl.LightningModule) -> None:
    """Refuse a client whose torchmetrics ``Metric`` gathers its states over the processes at every
    step (``dist_sync_on_step=True``): under ``fl_ddp`` the processes' shards may differ by one
    batch, and the process with the extra batch would wait forever for the others.

    Raises:
        ValueError: naming the ``Metric`` and the way out.
    """
    for name, module in client.named_modules():
        if isinstance(module, Metric) and module.dist_sync_on_step:
            raise ValueError(f"the client's Metric {name!r} has dist_sync_on_step=True: under fl_ddp each process "
                             f"evaluates its own shard of the set, whose batches may be one fewer than another's, "
                             f"so a sync at every step would wait forever; drop dist_sync_on_step (the Metric's "
                             f"states are gathered over the processes when it is computed, at the epoch's end)")
