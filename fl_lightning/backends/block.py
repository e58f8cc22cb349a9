"""A work item's results as a block of clients in columns: what a backend hands the engine.

A backend returns the results of a work item's clients as one :class:`ClientBlock`: the clients' ids and
sample counts, each declared upload as one ``[clients, size]`` tensor, each metric as one column of values
and each new state entry as one stacked tensor over the clients that have it. The batched backend's
uploads come out of its vectorized step as such tensors already (:meth:`ClientBlock.of` takes them as they
are, without a copy); a block of one client (the sequential backend's) costs a view per column. The engine
reads a block's clients row by row (:meth:`ClientBlock.rows`, views into the columns), since its callbacks
see one update at a time and its sums run in client-id order over the whole round.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterator, Optional, Sequence, Union

import torch
from torch import Tensor

from fl_lightning.backends.client_round import ClientRoundResult
from fl_lightning.update import ClientUpdate, row_of


@dataclass
class ClientBlock:
    """The results of a block of clients, in columns: entry (row) ``i`` of each is client ``client_ids[i]``'s."""

    #: the clients, in the order they finished
    client_ids: list[int]
    #: each client's training-split size
    num_samples: list[int]
    #: each declared upload, ``[clients, size]``
    uploads: dict[str, Tensor]
    #: each metric, a column of the clients' values (floats, or 0-dim tensors until the round's end reads them);
    #: None where a client has no such metric (a forged upload has none)
    metrics: dict[str, list[Any]]
    #: each new state entry, stacked over the rows of the clients that have it (``state_rows``); a list of the
    #: clients' tensors where their shapes differ (ByrdSAGA's table of one row per sample)
    state: dict[str, Union[Tensor, list[Tensor]]]
    #: for each state entry, the rows that have it, in order (a forged upload brings no state)
    state_rows: dict[str, list[int]]

    def __len__(self) -> int:
        return len(self.client_ids)

    @classmethod
    def of(cls, results: Sequence[ClientRoundResult]) -> "ClientBlock":
        """The block of clients' ``results`` (their uploads all of the same names). A column whose values are
        the rows of one stacked tensor, in order, is that tensor (no copy); one client's column is a view."""
        n = len(results)
        if n == 1:  # the sequential backend's work item: views, no loops
            (result,) = results
            update, state = result.update, result.state
            return cls([update.client_id], [update.num_samples],
                       {name: t.unsqueeze(0) for name, t in update.tensors.items()},
                       {name: [value] for name, value in update.metrics.items()},
                       {name: t.unsqueeze(0) for name, t in state.items()} if state else {},
                       {name: [0] for name in state} if state else {})
        updates = [r.update for r in results]
        block = cls([u.client_id for u in updates], [u.num_samples for u in updates], {}, {}, {}, {})
        if not n:
            return block
        block.uploads = {name: columns([u.tensors[name] for u in updates]) for name in updates[0].tensors}
        for i, (update, result) in enumerate(zip(updates, results)):
            for name, value in update.metrics.items():
                block.metrics.setdefault(name, [None] * n)[i] = value
            for name in result.state or ():
                block.state_rows.setdefault(name, []).append(i)
        for name, rows in block.state_rows.items():
            values = [results[i].state[name] for i in rows]
            block.state[name] = columns(values) if len({v.shape for v in values}) == 1 else values
        return block

    @classmethod
    def join(cls, blocks: Sequence["ClientBlock"]) -> "ClientBlock":
        """The clients of ``blocks`` as one block (their columns concatenated)."""
        if len(blocks) == 1:
            return blocks[0]
        return cls.of([result for block in blocks for result in block.rows()])

    def rows(self) -> Iterator[ClientRoundResult]:
        """Each client's result, in the block's order: its uploads and new state entries are views of the
        block's columns."""
        uploads = [(name, column.unbind(0)) for name, column in self.uploads.items()]
        states: list[dict[str, Tensor]] = [{} for _ in self.client_ids] if self.state else []
        for name, column in self.state.items():
            for row, value in zip(self.state_rows[name], column.unbind(0) if isinstance(column, Tensor) else column):
                states[row][name] = value
        metrics = self.metrics.items()
        for i, client_id in enumerate(self.client_ids):
            yield ClientRoundResult(ClientUpdate(client_id, self.num_samples[i],
                                                 {name: rows[i] for name, rows in uploads},
                                                 {name: values[i] for name, values in metrics if values[i] is not None}),
                                    states[i] if states else {})


def columns(rows: Sequence[Tensor]) -> Tensor:
    """``rows`` stacked: their base where they are its rows ``0 .. n-1`` in order (the outputs of a vectorized
    step), a view for one row, a new tensor otherwise."""
    if len(rows) == 1:
        return rows[0].unsqueeze(0)
    base = _base_of(rows)
    return base if base is not None else torch.stack(list(rows))


def _base_of(rows: Sequence[Tensor]) -> Optional[Tensor]:
    """The tensor ``rows`` are the rows of, in order and all of them; None if there is none (two calls a row
    once the first is known to be a row of its base)."""
    first = row_of(rows[0])
    if first is None or first[1] != 0 or first[0].shape[0] != len(rows):
        return None
    base, (offset, step), strides = first[0], (rows[0].storage_offset(), first[0].stride(0)), rows[0].stride()
    for i, row in enumerate(rows):
        if row._base is not base or row.storage_offset() != offset + i * step or row.stride() != strides \
                or row.shape != rows[0].shape:
            return None
    return base
