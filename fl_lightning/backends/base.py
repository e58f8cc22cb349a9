"""The client backend protocol: what a backend must do, and the lock-step driver all backends share.

A round is a sequence of work items (the Trainer's "batches" of the epoch). A backend says how
many there are, plans them when the round starts and runs them one by one, reading the engine
only through the :class:`~fl_lightning.backends.context.ClientContext`. Every finished client is
handed in (``context.finish(run, uploads)``, or ``context.hand_in(result)``) and comes back as one
of the work item's results, which :meth:`ClientBackend.run_work_item` returns: a backend never
hands a client's update to the module itself.

A backend runs its clients in *groups* (one client in the sequential backend, a block of
clients in the batched one). In an ordinary round a work item is one group's whole round
(:meth:`ClientBackend.run_clients`). In a lock-step round (FedDRO) a work item is one local step
of every group of this process, and this module's driver runs it: every group's batches, the
clients' shared values (``client_share``), their weighted mean over all processes and the
server's reply (``server_share``), every group's step, and after the last step every client's
``client_final``. A backend supplies the group operations the driver calls.

A backend also evaluates clients with the client module's own ``validation_step`` / ``test_step``
(:meth:`ClientBackend.evaluate`; by default one client after another,
:mod:`fl_lightning.backends.evaluate`).
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from typing import Any, Generic, Iterator, Optional, Sequence, TypeVar

import torch
from torch import Tensor

from fl_lightning.backends.client_round import ClientRoundResult
from fl_lightning.backends.context import ClientContext
from fl_lightning.backends.evaluate import StateOf, evaluate_in_module
from fl_lightning.distributed import all_reduce_sum, rank_and_world
from fl_lightning.update import ClientResult

Group = TypeVar("Group")


class ClientBackend(ABC, Generic[Group]):
    """Executes the client protocol (``client_init``, ``client_step``, ``client_final`` and, in
    lock-step rounds, ``client_share``) for this process's clients of a round.

    Args:
        clients_per_block: clients per group: a work item's (one Trainer batch; the batched
            backend's vectorized blocks), or a lock-step group's (:meth:`group_size`).
    """

    def __init__(self, clients_per_block: int = 1) -> None:
        self.clients_per_block = clients_per_block
        self._lockstep_plan: list[list[int]] = []
        self._groups: list[Group] = []
        self._round_samples = 0.0  # the training samples of all the round's clients (lock-step shares' weights)

    @classmethod
    def check(cls, context: ClientContext) -> list[str]:
        """Why this backend cannot run ``context``'s algorithm in this Trainer (each reason with the
        way out); empty when it can."""
        return []

    # ------------------------------------------------------------ schedule
    def configure(self, context: ClientContext, clients_per_round: int) -> None:
        """Settle what depends on the run, once its device, data and round are known (the module's
        ``setup``). The sequential backend has nothing to settle."""

    def try_step(self, context: ClientContext) -> None:
        """Try the client's local step once, at the setup of a fit, as this backend runs it, so that
        what it cannot run is refused (a ValueError with the reason and the way out) before the first
        round. The sequential backend runs the module's own step: nothing to try."""

    def num_work_items(self, context: ClientContext, clients_per_round: int) -> int:
        """Work items per round on this process (the same on every process)."""
        if context.lockstep:
            steps = context.algorithm.local_steps
            assert steps is not None, "lock-step rounds have a fixed number of local steps"
            return steps
        _, world = rank_and_world()
        return math.ceil(math.ceil(clients_per_round / world) / self.group_size(context))

    def group_size(self, context: ClientContext) -> int:
        """Clients per group: a work item's clients, or one lock-step group's."""
        return self.clients_per_block

    def start_round(self, context: ClientContext, clients: list[int]) -> list[Any]:
        """Plan the round for this process's ``clients``; returns the work items."""
        size = self.group_size(context)
        groups = [clients[i : i + size] for i in range(0, len(clients), size)]
        self._groups = []
        if context.lockstep:
            self._lockstep_plan = groups
            return list(range(self.num_work_items(context, 0)))
        return groups

    def run_work_item(self, context: ClientContext, item: Any) -> list[ClientRoundResult]:
        """Run one work item, a group's round or one lock-step step of every group; returns the results of
        the clients it finished, in the order they finished (none before a lock-step round's last step)."""
        if context.lockstep:
            self.lockstep_step(context, item)
        else:
            self.run_clients(context, item)
        return context.take_results()

    @abstractmethod
    def run_clients(self, context: ClientContext, clients: list[int]) -> None:
        """The whole round of ``clients`` (one group): their runs from ``client_init`` to ``context.finish``."""

    # ------------------------------------------------------------ evaluation
    def evaluate(self, context: ClientContext, client_ids: Sequence[int], state_of: StateOf, split: str,
                 hook: str) -> list[ClientResult]:
        """``client_ids``' evaluation by the client module's own ``hook`` on their ``split`` (in that
        order; empty splits left out), each with its model ``state_of(client)`` (None: the global
        model); by default one client after another (:mod:`fl_lightning.backends.evaluate`)."""
        return evaluate_in_module(context, client_ids, state_of, split, hook)

    # ------------------------------------------------------------ plain local training
    @abstractmethod
    def train_clients_plainly(self, context: ClientContext, client_ids: list[int], start: Tensor, steps: Optional[int],
                              stream: str, round_idx: int) -> Iterator[tuple[int, Tensor]]:
        """Plain local training of each of ``client_ids`` (its module's loss and local optimizer, for
        any algorithm) from ``start``, on ``steps`` batches of ``stream`` keyed by ``round_idx``
        (:func:`~fl_lightning.backends.sequential.train_plainly`'s batches): ``(client, trained state
        vector)`` as each is trained. The client module is as it was at every ``yield``."""

    # ------------------------------------------------------------ lock-step group operations
    @abstractmethod
    def start_group(self, context: ClientContext, clients: list[int]) -> Group:
        """The runs of ``clients`` after their ``client_init``, ready for their first step."""

    @abstractmethod
    def next_batches(self, context: ClientContext, group: Group) -> Any:
        """The group's batches of its next step (every client has one in lock-step rounds)."""

    @abstractmethod
    def share(self, context: ClientContext, group: Group, batches: Any, step: int) -> Optional[tuple[Tensor, Tensor]]:
        """The clients' ``client_share`` values at ``step``: ``(num_samples, values)`` stacked over the
        group's clients, or None when they share nothing at this step."""

    @abstractmethod
    def step(self, context: ClientContext, group: Group, batches: Any, step: int) -> None:
        """``client_step`` of every client of the group."""

    @abstractmethod
    def finish_group(self, context: ClientContext, group: Group) -> None:
        """``client_final`` of every client of the group, each handed to ``context.finish``."""

    # ------------------------------------------------------------ the lock-step driver
    def lockstep_step(self, context: ClientContext, step: int) -> None:
        """Local step ``step`` of all this process's clients: ``client_share``, the server's reply to
        the weighted mean of the shares, ``client_step``; after the last step, ``client_final``."""
        if step == 0:
            self._groups = [self.start_group(context, clients) for clients in self._lockstep_plan]
            algorithm = context.lockstep_algorithm()
            self._round_samples = float(sum(algorithm.engine.datamodule.num_samples(c) for c in algorithm.engine.round_clients))
        batches = [self.next_batches(context, group) for group in self._groups]
        shares = [self.share(context, group, b, step) for group, b in zip(self._groups, batches)]
        parts = [s for s in shares if s is not None]
        if parts:
            if len(parts) < len(shares):
                raise RuntimeError("client_share must return a value for every client or for none, at a given step")
            algorithm = context.lockstep_algorithm()
            algorithm.shared = algorithm.server_share(all_reduce_sum(weighted_mean(parts, self._round_samples)))
        for group, b in zip(self._groups, batches):
            self.step(context, group, b, step)
        if step == self.num_work_items(context, 0) - 1:
            for group in self._groups:
                self.finish_group(context, group)
            self._groups = []


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
