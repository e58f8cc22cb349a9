"""The step batches of a block of clients: dataset indices gathered for the whole block in one go,
or real batches stacked over the clients, and the shapes that group clients into one vectorized call."""

from __future__ import annotations

from typing import Any, Iterator, Optional

import torch
from torch import Tensor

from fl_lightning.backends.batched.run import FunctionalRun
from fl_lightning.backends.context import ClientContext
from fl_lightning.lightning_compat import tree_flatten, tree_unflatten


class Indices:
    """A client's batch given by its dataset indices (gathered with the block's other clients')."""

    __slots__ = ("indices",)

    def __init__(self, indices: Tensor) -> None:
        self.indices = indices


class BlockStep:
    """One local step of every client of a block, as dataset indices ``[clients, batch]`` (and those
    of the extra streams): the batches of the whole block are gathered in one go."""

    __slots__ = ("main", "extras")

    def __init__(self, main: Tensor, extras: dict[str, Tensor]) -> None:
        self.main, self.extras = main, extras


def step_table(context: ClientContext, runs: list[FunctionalRun]) -> Optional[list[BlockStep]]:
    """The block's steps as :class:`BlockStep` when every client takes the same number of steps with
    batches of the same size (``local_steps``), else None (``local_epochs``, a client smaller than
    the batch): each client's steps are one table of dataset indices, the block's one stack."""
    steps = runs[0].num_steps
    if steps is None or any(run.num_steps != steps for run in runs):
        return None
    tables = {stream: [context.index_table(run.client_id, steps, stream) for run in runs]
              for stream in ("batches", *context.algorithm.extra_batch_streams)}
    if any(len({t.shape for t in column}) != 1 for column in tables.values()):
        return None
    stacked = {stream: torch.stack(column) for stream, column in tables.items()}
    main = stacked.pop("batches")
    return [BlockStep(main[:, k], {name: t[:, k] for name, t in stacked.items()}) for k in range(steps)]


def index_stream(context: ClientContext, run: FunctionalRun) -> Iterator[tuple[Any, dict[str, Any]]]:
    """A run's step batches as dataset indices (the engine's keyed order)."""
    extras = {s: context.indices(run.client_id, run.num_steps, s) for s in context.algorithm.extra_batch_streams}
    for idx in context.indices(run.client_id, run.num_steps):
        yield Indices(idx), {name: Indices(next(it)) for name, it in extras.items()}


def stack_batches(context: ClientContext, batches: list[Any]) -> Any:
    """The clients' batches of a step stacked along a new first dimension: gathered from the
    dataset in one go when given as indices, else stacked leaf by leaf."""
    first = batches[0]
    if isinstance(first, Indices):
        return context.gather(torch.stack([b.indices for b in batches]))
    if isinstance(first, tuple) and all(isinstance(t, Tensor) for t in first):  # the usual (x, y)
        return tuple(torch.stack(column) for column in zip(*batches))
    flat = [tree_flatten(b) for b in batches]
    return tree_unflatten([torch.stack(column) for column in zip(*(leaves for leaves, _ in flat))], flat[0][1])


def batch_signature(item: tuple[Any, dict[str, Any]]) -> tuple:
    """The shapes of a step's batches: clients with the same signature run the step together."""
    batch, extras = item
    if isinstance(batch, Indices):
        return (len(batch.indices), *(len(e.indices) for e in extras.values()))
    if not extras and isinstance(batch, tuple) and all(isinstance(t, Tensor) for t in batch):  # the usual (x, y)
        return tuple(t.shape for t in batch)
    return tuple(tuple(x.shape) if isinstance(x, Tensor) else x for x in tree_flatten(item)[0])
