"""The batches of a block's local steps, in one format: per step, the clients grouped by the shape
of their batches (each group runs as one vectorized call), with the group's batches.

A step's batches are, per group, the dataset indices of every stream ``[clients, batch]``,
gathered from the pool in one go (:class:`IndexGroup`); where every step's indices are known at the
block's start and the pool is a tensor one, several steps' batches are gathered at once and each
step takes its own (:class:`GatheredGroup`, :func:`steps_of`). Only where a callback rewrites local
batches (``on_local_batch``) or ``client_init`` gave its own, the clients' real batches are stacked
instead (:class:`BatchGroup`): the one exception, kept apart.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterator, Optional, Sequence

import torch
from torch import Tensor
from torch.utils.data import TensorDataset

from fl_lightning.backends.batched.run import FunctionalRun
from fl_lightning.backends.context import ClientContext
from fl_lightning.datamodules.client_data import stacked_indices, stacked_step_positions
from fl_lightning.lightning_compat import tree_flatten, tree_unflatten

#: one client's step: its batch (or its indices) and those of the algorithm's extra streams
Item = tuple[Any, dict[str, Any]]

#: the most bytes of batches :func:`steps_of` gathers at once for a group's coming steps (one step's
#: batches at least): enough for the steps of a small model's round, little beside a block's runs
GATHER_AHEAD_BYTES = 32 * 2**20


@dataclass
class IndexGroup:
    """Clients of a block (positions ``members``) whose step batches have the same shapes, as the
    dataset indices of each stream, stacked ``[len(members), batch]`` (``"batches"``: the main one)."""

    members: list[int]
    indices: dict[str, Tensor]

    def load(self, context: ClientContext) -> Item:
        """The group's batches on the device, gathered in one go per stream."""
        gathered = {stream: context.gather(indices) for stream, indices in self.indices.items()}
        return gathered.pop("batches"), gathered


@dataclass
class BatchGroup:
    """Clients of a block whose real step batches (after the callbacks) have the same shapes."""

    members: list[int]
    items: list[Item]

    def load(self, context: ClientContext) -> Item:
        """The group's batches stacked along a new first dimension, leaf by leaf."""
        batch = stack_batches([item[0] for item in self.items])
        extras = {name: stack_batches([item[1][name] for item in self.items]) for name in self.items[0][1]}
        return batch, extras


@dataclass
class GatheredGroup:
    """Clients of a block (positions ``members``) whose step batches were gathered with those of
    other steps (:func:`steps_of`): this step's batch and extra streams' batches, on the device."""

    members: list[int]
    batch: Any
    extras: dict[str, Any]

    def load(self, context: ClientContext) -> Item:
        """The group's batches, gathered already."""
        return self.batch, self.extras


StepGroup = IndexGroup | BatchGroup | GatheredGroup


def real_batches(context: ClientContext, runs: list[FunctionalRun]) -> bool:
    """Whether ``runs`` step on real batches (a callback rewrites local batches, or ``client_init`` gave
    a run its own) rather than on the engine's index tables."""
    return context.changes_local_batches or any(run.data.batches is not None for run in runs)


def plan_steps(context: ClientContext, runs: list[FunctionalRun]) -> Iterator[list[StepGroup]]:
    """Each local step of the block's ``runs``: the clients that take it, grouped by batch shapes.

    Real batches are drawn a step at a time (the callbacks see them in the clients' order);
    indices come from the engine's keyed streams, which draw from no global generator."""
    if real_batches(context, runs):
        streams = [context.step_batches(run) for run in runs]
        while True:
            items = [next(stream, None) for stream in streams]
            if all(item is None for item in items):
                return
            yield _group_batches(items)
    groups = fixed_groups(context, runs)
    if groups is not None:
        yield from steps_of(context, groups)
        return
    tables = [{stream: _index_steps(context, run, stream) for stream in _streams(context)} for run in runs]
    for k in range(max((len(t["batches"]) for t in tables), default=0)):
        yield index_groups(tables, k)


def fixed_groups(context: ClientContext, runs: list[FunctionalRun], stream: Optional[str] = None
                 ) -> Optional[list[IndexGroup]]:
    """Where every run takes ``num_steps`` steps of dataset indices (no real batches), the runs
    grouped by the shapes of their index tables, each group's tables stacked once
    (``[len(members), steps, batch]`` per stream, drawn for each run's round): the groups are the
    same at every step. The streams are the round's (its batches, the algorithm's extra streams), or
    ``stream`` alone as the main batches (plain local training). None otherwise (``local_epochs``,
    real batches)."""
    if real_batches(context, runs) or any(run.local.num_steps is None for run in runs):
        return None
    streams = {"batches": stream} if stream is not None else {s: s for s in _streams(context)}
    splits = [context.client_data(run.client_id) for run in runs]
    members: dict[tuple[int, int], list[int]] = {}  # the shape of a step's batch indices -> its clients
    for i, (run, split) in enumerate(zip(runs, splits)):
        members.setdefault((run.local.num_steps, split.step_batch_size), []).append(i)
    groups = []
    for (steps, _), group in members.items():
        chosen = [splits[i] for i in group]
        groups.append(IndexGroup(group, {
            key: stacked_indices(chosen, stacked_step_positions(
                chosen, steps, [context.batch_order(runs[i].client_id, s, runs[i].round) for i in group]))
            for key, s in streams.items()}))
    return groups


def steps_of(context: ClientContext, groups: list[IndexGroup]) -> Iterator[list[StepGroup]]:
    """The steps of :func:`fixed_groups`' groups: at step ``k``, each group that has one, with its rows ``k``.

    From a tensor pool (a ``TensorDataset``, whose gather draws nothing and runs no code of the
    user's), each group's batches of its coming steps are gathered in one go, as many steps as
    :data:`GATHER_AHEAD_BYTES` holds, laid out ``[steps, clients, batch, ...]`` so that each step's
    batch is a contiguous slice: one gather (on a GPU, one launch per tensor; from a pool on the
    host, one copy) for many steps, the same values as a gather per step. Other pools are gathered
    a step at a time, inside the step's local work (their ``__getitem__`` may draw random numbers)."""
    ahead = isinstance(context.engine.datamodule.pool, TensorDataset)
    lengths = [len(g.indices["batches"][0]) for g in groups]  # each group's number of steps
    chunks: list[tuple[int, int, dict[str, Any]]] = [(0, 0, {}) for _ in groups]  # steps [start, end) gathered
    for k in range(max(lengths, default=0)):
        step = []
        for i, (g, steps) in enumerate(zip(groups, lengths)):
            if k >= steps:
                continue
            if not ahead:
                step.append(IndexGroup(g.members, {s: rows[:, k] for s, rows in g.indices.items()}))
                continue
            start, end, gathered = chunks[i]
            if k >= end:
                start, end = k, min(steps, k + _steps_ahead(context, g))
                gathered = {s: context.gather(rows[:, start:end].transpose(0, 1)) for s, rows in g.indices.items()}
                chunks[i] = (start, end, gathered)
            batches = {s: tuple(t[k - start] for t in batch) for s, batch in gathered.items()}
            step.append(GatheredGroup(g.members, batches.pop("batches"), batches))
        yield step


def _steps_ahead(context: ClientContext, group: IndexGroup) -> int:
    """How many steps of ``group``'s batches :data:`GATHER_AHEAD_BYTES` holds (at least one)."""
    row = sum(t.element_size() * t[0].numel() for t in context.engine.datamodule.pool.tensors)
    step = row * sum(rows[:, 0].numel() for rows in group.indices.values())
    return max(1, GATHER_AHEAD_BYTES // max(step, 1))


def _streams(context: ClientContext) -> tuple[str, ...]:
    """The batch streams of a step: the main one, then the algorithm's extra ones."""
    return ("batches", *context.algorithm.extra_batch_streams)


def index_groups(steps: list[dict[str, Sequence[Tensor]]], k: int) -> list[IndexGroup]:
    """Step ``k`` of clients' index sequences (``steps[i][stream]``: client ``i``'s per-step indices):
    the clients that have one, grouped by the shapes of their indices, each group's stacked."""
    groups: dict[tuple, list[int]] = {}
    for i, client in enumerate(steps):
        if k < len(client["batches"]):
            groups.setdefault(tuple(len(rows[k]) for rows in client.values()), []).append(i)
    return [IndexGroup(members, {s: torch.stack([steps[i][s][k] for i in members]) for s in steps[members[0]]})
            for members in groups.values()]


def _index_steps(context: ClientContext, run: FunctionalRun, stream: str) -> Sequence[Tensor]:
    """A run's step indices in ``stream``: its table ``[num_steps, batch]``, or its epochs' batches."""
    local = run.local
    if local.num_steps is not None:
        return context.index_table(run.client_id, local.num_steps, stream)
    assert local.epochs is not None, "a run without num_steps takes epochs passes"
    return list(context.epoch_indices(run.client_id, local.epochs, stream))


def _group_batches(items: list[Optional[Item]]) -> list[StepGroup]:
    """The clients that have a real batch at this step, grouped by its shapes."""
    groups: dict[tuple, BatchGroup] = {}
    for i, item in enumerate(items):
        if item is not None:
            group = groups.setdefault(_signature(item), BatchGroup([], []))
            group.members.append(i)
            group.items.append(item)
    return list(groups.values())


def stack_batches(batches: list[Any]) -> Any:
    """The clients' batches of a step stacked along a new first dimension, leaf by leaf."""
    first = batches[0]
    if isinstance(first, tuple) and all(isinstance(t, Tensor) for t in first):  # the usual (x, y)
        return tuple(torch.stack(column) for column in zip(*batches))
    flat = [tree_flatten(b) for b in batches]
    return tree_unflatten([torch.stack(column) for column in zip(*(leaves for leaves, _ in flat))], flat[0][1])


def _signature(item: Item) -> tuple:
    """The shapes of a client's real batches at a step: clients with the same one run it together."""
    batch, extras = item
    if not extras and isinstance(batch, tuple) and all(isinstance(t, Tensor) for t in batch):  # the usual (x, y)
        return tuple(t.shape for t in batch)
    return tuple(tuple(x.shape) if isinstance(x, Tensor) else x for x in tree_flatten(item)[0])
