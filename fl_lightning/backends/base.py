"""The client backend protocol: what a backend must do, and the lock-step round all backends share.

A backend is handed this process's clients of a round and returns their results; it reads the
engine only through the :class:`~fl_lightning.backends.context.ClientContext` and never calls into
the module. Its protocol is six methods, three of them abstract:

* :meth:`ClientBackend.setup`: settle what depends on the run (device, data, block sizes) and refuse,
  before the first round, what it cannot run;
* :meth:`ClientBackend.round`: the round of this process's clients as work items (the Trainer's
  "batches" of the epoch), yielding each work item's results as it runs, a
  :class:`~fl_lightning.backends.block.ClientBlock` (columns, not an object per client); in an ordinary
  round a work item is a block of ``clients_per_block`` clients' whole rounds
  (:meth:`ClientBackend.run_clients`);
* :meth:`ClientBackend.run_clients` (abstract): the whole round of a block of clients, returning their
  results as a block;
* :meth:`ClientBackend.lockstep_group` (abstract): a block of clients of a lock-step round (FedDRO), as
  an object whose operations :func:`lockstep_round` drives (:class:`LockstepGroup`): every group's
  batches, the clients' shared values (``client_share``), their weighted mean over all processes and
  the server's reply (``server_share``), every group's step, and after the last step every client's
  ``client_final``;
* :meth:`ClientBackend.train_clients_plainly` (abstract): plain local training of clients (for the
  callbacks that finetune or fit unseen clients);
* :meth:`ClientBackend.evaluate`: clients evaluated with the client module's own ``validation_step`` /
  ``test_step`` (by default one client after another, :mod:`fl_lightning.backends.evaluate`).

How many work items a round has (the same on every process, :func:`work_items_per_round`) follows from
``clients_per_block``, which :meth:`ClientBackend.setup` may settle.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from typing import Any, Iterator, Optional, Protocol, Sequence

import torch
from torch import Tensor

from fl_lightning.backends.block import ClientBlock
from fl_lightning.backends.context import ClientContext
from fl_lightning.backends.evaluate import StateOf, evaluate_in_module
from fl_lightning.distributed import all_reduce_sum, rank_and_world
from fl_lightning.update import ClientResult


class LockstepGroup(Protocol):
    """A block of a lock-step round's clients as a backend holds them between their steps, after their
    ``client_init``."""

    def next_batches(self) -> Any:
        """The group's batches of its next step (every client has one in lock-step rounds)."""

    def share(self, batches: Any, step: int) -> Optional[tuple[Tensor, Tensor]]:
        """The clients' ``client_share`` values at ``step``: ``(num_samples, values)`` stacked over the
        group's clients, or None when they share nothing at this step."""

    def step(self, batches: Any, step: int) -> None:
        """``client_step`` of every client of the group, the server's reply in ``run.local.shared``."""

    def finish(self) -> ClientBlock:
        """``client_final`` of every client of the group: their results."""


class ClientBackend(ABC):
    """Executes the client protocol (``client_init``, ``client_step``, ``client_final`` and, in
    lock-step rounds, ``client_share``) for this process's clients of a round.

    Args:
        clients_per_block: clients per work item (one Trainer batch; the batched backend's vectorized
            blocks), or per lock-step group.
    """

    def __init__(self, clients_per_block: int = 1) -> None:
        self.clients_per_block = clients_per_block

    def setup(self, context: ClientContext, clients_per_round: int, fit: bool) -> None:
        """Settle what depends on the run, once its device, data and round are known (the module's
        ``setup``), and refuse what this backend cannot run (``fit``: a fit, whose first local step a
        backend may try as it will run it), before the first round.

        Raises:
            ValueError: this backend cannot run the algorithm here: the reason and the way out.
        """

    def round(self, context: ClientContext, clients: list[int]) -> Iterator[ClientBlock]:
        """The round of this process's ``clients``: the results of each work item as it runs (those of the
        clients it finished; none before a lock-step round's last step), as a block."""
        if context.lockstep:
            yield from lockstep_round(self, context, clients)
            return
        size = self.clients_per_block
        for first in range(0, len(clients), size):
            yield self.run_clients(context, clients[first:first + size])

    @abstractmethod
    def run_clients(self, context: ClientContext, clients: list[int]) -> ClientBlock:
        """The whole round of ``clients`` (one work item), from ``client_init`` to ``client_final``: their
        results, in the order they finished."""

    @abstractmethod
    def lockstep_group(self, context: ClientContext, clients: list[int]) -> LockstepGroup:
        """``clients`` of a lock-step round after their ``client_init``, ready for their first step."""

    @abstractmethod
    def train_clients_plainly(self, context: ClientContext, client_ids: list[int], start: Tensor, steps: Optional[int],
                              stream: str, round_idx: int) -> Iterator[tuple[int, Tensor]]:
        """Plain local training of each of ``client_ids`` (its module's loss and local optimizer, for
        any algorithm) from ``start``, on ``steps`` batches of ``stream`` keyed by ``round_idx``
        (:func:`~fl_lightning.backends.sequential.train_plainly`'s batches): ``(client, trained state
        vector)`` as each is trained. The client module is as it was at every ``yield``."""

    def evaluate(self, context: ClientContext, client_ids: Sequence[int], state_of: StateOf, split: str,
                 hook: str) -> list[ClientResult]:
        """``client_ids``' evaluation by the client module's own ``hook`` on their ``split`` (in that
        order; empty splits left out), each with its model ``state_of(client)`` (None: the global
        model); by default one client after another (:mod:`fl_lightning.backends.evaluate`)."""
        return evaluate_in_module(context, client_ids, state_of, split, hook)


def refusal(context: ClientContext, reasons: list[str]) -> ValueError:
    """The error of a backend that cannot run ``context``'s algorithm, for ``reasons`` (each with its way out)."""
    algorithm = context.algorithm
    return ValueError(f"client_backend={getattr(algorithm, 'client_backend', None)!r} cannot run "
                      f"{type(algorithm).__name__}: " + "; ".join(reasons))


def work_items_per_round(backend: ClientBackend, context: ClientContext, clients_per_round: int) -> int:
    """Work items per round on each process (the same on every process): a lock-step round's local steps,
    or this process's share of the round's clients in blocks of ``backend.clients_per_block``."""
    if context.lockstep:
        steps = context.algorithm.local_steps
        assert steps is not None, "lock-step rounds have a fixed number of local steps"
        return steps
    _, world = rank_and_world()
    return math.ceil(math.ceil(clients_per_round / world) / backend.clients_per_block)


def lockstep_round(backend: ClientBackend, context: ClientContext, clients: list[int]) -> Iterator[ClientBlock]:
    """A lock-step round of this process's ``clients``, one work item per local step of all of them:
    ``client_share``, the server's reply to the weighted mean of the shares over every process,
    ``client_step``; after the last step, ``client_final`` (that work item's results: every client's)."""
    size = backend.clients_per_block
    groups = [backend.lockstep_group(context, clients[i:i + size]) for i in range(0, len(clients), size)]
    algorithm = context.lockstep_algorithm()
    engine = context.engine
    round_samples = float(sum(engine.datamodule.num_samples(c) for c in engine.round_clients))
    steps = work_items_per_round(backend, context, 0)
    for step in range(steps):
        batches = [group.next_batches() for group in groups]
        shares = [group.share(b, step) for group, b in zip(groups, batches)]
        parts = [s for s in shares if s is not None]
        if parts:
            if len(parts) < len(shares):
                raise RuntimeError("client_share must return a value for every client or for none, at a given step")
            algorithm.shared = algorithm.server_share(all_reduce_sum(weighted_mean(parts, round_samples)))
        for group, b in zip(groups, batches):
            group.step(b, step)
        if step < steps - 1:
            yield ClientBlock.of([])
    yield ClientBlock.join([group.finish() for group in groups])


def weighted_mean(parts: list[tuple[Tensor, Tensor]], total: float) -> Tensor:
    """``sum_k n_k v_k / total`` (float64) of groups' ``(n, v)``: sample counts ``[clients]`` and values
    stacked ``[clients, ...]``, as the groups come (this process's part of the round's mean)."""
    acc: Optional[Tensor] = None
    for counts, values in parts:
        weights = (counts.to(torch.float64) / total).to(values.device)
        part = torch.tensordot(weights, values.to(torch.float64), dims=1)
        acc = part if acc is None else acc + part
    assert acc is not None
    return acc
