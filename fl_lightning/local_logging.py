"""Buffered ``self.log`` for a client module during its local training.

A client ``LightningModule`` logs from its ``training_step`` as it would on its own, but in a
federation that step runs at every local step of every client, and Lightning's ``self.log``
costs about half a millisecond a call: a client logging its loss at each of 20 local steps of
100 clients would spend more time logging than training a small model. During local training
the engine routes the client's calls here instead: each name's values are accumulated, weighted
by batch size, and logged once per round, through Lightning's own ``self.log`` with the options
of the client's call (``on_step``, ``on_epoch``, ``prog_bar``, ``sync_dist``...). The logged
value is the batch-size-weighted mean over this process's local steps of the round, which is
what Lightning's ``on_epoch`` mean would have given; on several processes, over every process's
local steps, what one process logs, with ``sync_dist=True`` or without (:meth:`LocalLogBuffer.flush`).
The steps of a client whose update the round excludes (NaN or Inf) are left out
(:meth:`LocalLogBuffer.drop`), as they are of ``round/client_loss``. Calls that are not a mean of
scalars (a torchmetrics ``Metric``, another ``reduce_fx``, a non-scalar value) go to Lightning
unbuffered, as they are made: those of an excluded client stay in.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Any, Collection, Optional, Sequence

import torch
from torch import Tensor
from torchmetrics import Metric

from fl_lightning.lightning_compat import current_hook, lightning_log, log_agreed, results_batch
from fl_lightning.lightning_package import extract_batch_size, pl

_LOG_SIGNATURE = inspect.signature(pl.LightningModule.log)


#: one add of values to a name: one client's sum of values times their batch sizes (0-dim) or one such sum
#: per client of a block (1-dim), the samples behind each client's sum, and the clients
_Part = tuple[Tensor, int, Sequence[Optional[int]]]


@dataclass
class _Entry:
    """One logged name: the weighted sum of its values, their total weight, the call's options, and
    each add of values (:data:`_Part`), to take a client's values out again (:meth:`LocalLogBuffer.drop`)."""

    total: Tensor
    weight: int
    options: dict[str, Any] = field(default_factory=dict)
    parts: list[_Part] = field(default_factory=list)


class LocalLogBuffer:
    """Collects a client module's ``self.log`` calls of one round and logs each name once.

    Install :meth:`log` as the client's ``log`` for its local training, set :attr:`batch` to
    the batch of each local step (to infer batch sizes as Lightning does) and :attr:`client_id` to
    the client whose local work is in progress, and call :meth:`flush` once per round, inside the
    federated module's ``training_step`` (after :meth:`drop` of the clients the round excluded).
    """

    def __init__(self) -> None:
        #: the batch of the current local step, for the batch size of calls that give none
        self.batch: Optional[Any] = None
        #: the client whose local work logs now (its values leave with it, :meth:`drop`)
        self.client_id: Optional[int] = None
        self._entries: dict[str, _Entry] = {}
        self._client: Optional[pl.LightningModule] = None

    def bind(self, client: pl.LightningModule) -> None:
        """The client module whose calls this buffer receives (and logs through on :meth:`flush`)."""
        self._client = client

    def log(self, name: str, value: Any, *args: Any, **kwargs: Any) -> None:
        """Stands in for the client's ``self.log``: same signature, buffered for a mean."""
        options = call_options(args, kwargs)
        reduce_fx = options.get("reduce_fx", "mean")
        if isinstance(value, Metric) or reduce_fx not in ("mean", torch.mean) or _numel(value) != 1:
            self._log_now(name, value, *args, **kwargs)
            return
        batch_size = options.pop("batch_size", None)
        if batch_size is None:
            batch_size = extract_batch_size(self.batch) if self.batch is not None else 1
        value = torch.as_tensor(value).detach().float().reshape(()) * batch_size
        self._add(name, value, int(batch_size), options, (value, int(batch_size), (self.client_id,)))

    def add(self, name: str, total: Tensor, weight: int, options: dict[str, Any],
            clients: Sequence[Optional[int]]) -> None:
        """Add ``total`` to ``name``'s mean: the sum of a client's values times their batch sizes, over
        ``weight`` samples (0-dim; ``clients`` names the client), or one such sum per client of a block,
        each over ``weight`` samples (1-dim, a row per client of ``clients``: the batched backend adds a
        whole block's values at once)."""
        part = (total, weight, clients)
        if total.dim():
            self._add(name, total.sum(), weight * len(clients), options, part)
        else:
            self._add(name, total, weight, options, part)

    def _add(self, name: str, total: Tensor, weight: int, options: dict[str, Any], part: _Part) -> None:
        """Add ``total`` over ``weight`` samples to ``name``'s weighted sum, and ``part`` to its adds."""
        entry = self._entries.get(name)
        if entry is None:
            self._entries[name] = _Entry(total, weight, dict(options), [part])
        else:
            entry.total = entry.total + total
            entry.weight += weight
            entry.parts.append(part)

    def drop(self, clients: Collection[int]) -> None:
        """Leave out every value ``clients`` logged this round (the round excluded their updates): each
        name's sum is added up again from the other clients' values, in the order they were logged."""
        if not clients:
            return
        excluded: set[Optional[int]] = set(clients)
        for name, entry in list(self._entries.items()):
            if not any(c in excluded for _, _, owners in entry.parts for c in owners):
                continue
            del self._entries[name]
            for total, weight, owners in entry.parts:
                keep = [i for i, c in enumerate(owners) if c not in excluded]
                if len(keep) == len(owners):
                    self.add(name, total, weight, entry.options, owners)
                elif keep:  # some rows of a block's values
                    rows = total.index_select(0, torch.tensor(keep, device=total.device))
                    self.add(name, rows, weight, entry.options, [owners[i] for i in keep])

    def parts(self) -> dict[str, tuple[dict[str, Any], list[_Part]]]:
        """The buffered names: ``{name: (options, adds)}``, each add ``(total, weight, clients)`` as
        :meth:`add` takes it, in the order they came (a deployment node sends its client's adds to the
        server, which adds them to its own buffer: the same sums as one process running the round)."""
        return {name: (dict(entry.options), list(entry.parts)) for name, entry in self._entries.items()}

    def synced(self) -> dict[str, tuple[float, int, dict[str, Any]]]:
        """The buffered names: ``{name: (weighted sum, weight, options)}``, for the caller to gather
        across processes and hand to :meth:`flush` (reads each sum once)."""
        return {
            name: (float(entry.total), entry.weight, {k: v for k, v in entry.options.items() if k != "sync_dist_group"})
            for name, entry in self._entries.items()
        }

    def flush(self, synced: Optional[Sequence[dict[str, tuple[float, int, dict[str, Any]]]]] = None) -> None:
        """Log each buffered name once (its weighted mean) through Lightning, and empty the buffer.

        The mean is the round's value: it is logged with ``on_epoch=True, on_step=False`` (so it
        reaches the loggers every round, whatever ``log_every_n_steps`` is, under the name the
        client gave it), with the call's other options.

        ``synced``: every process's :meth:`synced`, gathered. Each name is then logged on every process
        (also one whose clients logged none this round) as the mean over all processes' values, weighted
        by their sample counts: the value of one process running all the round's clients, whether the
        call asked for ``sync_dist`` or not. Lightning's own sync would floor the processes' mean sample
        count where they differ, as the clients' sizes do (Lightning-AI/pytorch-lightning#21859: two
        processes of 3 and 2 clients logged 0.80 for 0.64).
        """
        entries, self._entries = self._entries, {}
        merged: dict[str, tuple[float, int, dict[str, Any]]] = {}
        for part in synced or ():
            for name, (total, weight, options) in part.items():
                previous_total, previous_weight, _ = merged.get(name, (0.0, 0, options))
                merged[name] = (previous_total + total, previous_weight + weight, options)
        for name, (total, weight, options) in merged.items():
            entries.pop(name, None)
            options = {**options, "on_step": False, "on_epoch": True, "sync_dist": False}
            self._log_now(name, torch.tensor(total / weight), batch_size=weight, agreed=True, **options)
        for name, entry in entries.items():
            options = {**entry.options, "on_step": False, "on_epoch": True}
            self._log_now(name, entry.total / entry.weight, batch_size=entry.weight, **options)

    def _log_now(self, name: str, value: Any, *args: Any, agreed: bool = False, **kwargs: Any) -> None:
        """Log through Lightning now, as the client's ``training_step`` (``agreed``: a value merged
        over processes here, the same on each: :func:`~fl_lightning.lightning_compat.log_agreed`)."""
        client = self._client
        if client is None:
            raise RuntimeError("LocalLogBuffer.bind(client) was not called")
        with current_hook(client, "training_step"), results_batch(client.trainer, self.batch):
            (log_agreed if agreed else lightning_log)(client, name, value, *args, **kwargs)


def call_options(args: tuple, kwargs: dict[str, Any]) -> dict[str, Any]:
    """The options of a ``self.log(name, value, *args, **kwargs)`` call, by name (options given by
    position are named as in Lightning's signature)."""
    if not args:
        return dict(kwargs)
    options = dict(_LOG_SIGNATURE.bind(None, "name", None, *args, **kwargs).arguments)
    for key in ("self", "name", "value"):
        options.pop(key)
    return options


def _numel(value: Any) -> int:
    """Elements of a logged value (1 for a Python number)."""
    return value.numel() if isinstance(value, Tensor) else 1
