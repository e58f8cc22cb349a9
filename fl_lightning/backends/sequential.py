"""The sequential backend: one client after another, trained in the client module itself.

This is the reference backend. Each client's round is the round's
:class:`~fl_lightning.backends.client_round.ClientProgram` run for it: the code of
:func:`~fl_lightning.backends.client_round.run_client`, a client's round without a Trainer (a
:class:`~fl_lightning.backends.client_round.ModuleRun` in the client module, its steps exactly what
the module does when trained alone).

Lock-step algorithms (``FederatedModule.lockstep``) advance all of this process's clients one
step per work item; their trained models are parked as flat vectors between their steps.
"""

from __future__ import annotations

from contextlib import contextmanager
from functools import partial
from typing import Any, Iterator, Optional

import torch
from torch import Tensor

from fl_lightning.backends.base import ClientBackend
from fl_lightning.backends.block import ClientBlock
from fl_lightning.backends.client_round import ClientProgram, ClientRoundResult, ModuleLocal, ModuleRun
from fl_lightning.backends.context import ClientContext
from fl_lightning.run import plain_step


class SequentialBackend(ClientBackend):
    """Runs the round's clients one after another (lock-step algorithms: one step of all of this
    process's clients per work item), in the client module.

    Args:
        clients_per_block: the clients of one work item (one Trainer batch), run one after another.
            None or 1: a work item per client (the progress bar and ``on_train_batch_*`` see each
            client). More: fewer Trainer batches, and Lightning's loop around each (about 0.3 ms on a
            2-core CPU: a sixth of a small model's client) is paid per block; the results are the
            same. Lock-step rounds keep their work items, one local step of every client.
    """

    def __init__(self, clients_per_block: Optional[int] = None) -> None:
        super().__init__(clients_per_block or 1)
        self._program: Optional[ClientProgram] = None

    def setup(self, context: ClientContext, clients_per_round: int, fit: bool) -> None:
        if context.lockstep:
            self.clients_per_block = 1  # a lock-step group is one parked client

    def round(self, context: ClientContext, clients: list[int]) -> Iterator[ClientBlock]:
        self._program = context.client_program()
        yield from super().round(context, clients)

    def new_run(self, context: ClientContext, client_id: int) -> ModuleRun:
        """A lock-step run of ``client_id`` starting from the global model (loaded into the client module)."""
        assert self._program is not None, "the round has not started"
        local = partial(ModuleLocal, optimizer=context.engine.local_optimizer())
        run = context.new_run(ModuleRun, client_id, local, context, self._program.view,
                              batches=context.client_batches(client_id))
        run._restart(run.start)  # the global model, into the client module
        return run

    def run_clients(self, context: ClientContext, clients: list[int]) -> ClientBlock:
        """The whole round of each of ``clients`` (a block), one after another."""
        return ClientBlock.of([self.run_client(context, client_id) for client_id in clients])

    def run_client(self, context: ClientContext, client_id: int) -> ClientRoundResult:
        """One client's whole round: the round's client program run for it (``client_init``, its steps,
        ``client_final``, in one local-work setting)."""
        if context.is_forged(client_id):
            return context.forged_result(client_id)
        assert self._program is not None, "the round has not started"
        start = context.engine.round_start
        assert start is not None, "the round has not started"
        return self._program.run(client_id, start, context.load_client_state(client_id),
                                 context.client_data(client_id), context.round_config(client_id))

    def train_clients_plainly(self, context: ClientContext, client_ids: list[int], start: Tensor, steps: Optional[int],
                              stream: str, round_idx: int) -> Iterator[tuple[int, Tensor]]:
        """One client after another (:func:`train_plainly`)."""
        return train_one_by_one(context, client_ids, start, steps, stream, round_idx)

    def lockstep_group(self, context: ClientContext, clients: list[int]) -> "_Parked":
        (client_id,) = clients
        run = self.new_run(context, client_id)
        with context.local_work(client_id, "init", run.round):
            context.algorithm.client_init(run)
        run.park()
        return _Parked(context, run, context.step_batches(run))


class _Parked:
    """A lock-step group of one client: its run, parked between steps, and its stream of step batches."""

    def __init__(self, context: ClientContext, run: ModuleRun, batches: Iterator[tuple[Any, dict[str, Any]]]) -> None:
        self.context, self.run, self.batches = context, run, batches

    def next_batches(self) -> Any:
        return next(self.batches)

    def share(self, batches: Any, step: int) -> Optional[tuple[Tensor, Tensor]]:
        run, (batch, extra) = self.run, batches
        run.data.extra = extra
        with _activated(self.context, run, "share"), torch.no_grad():
            value = self.context.lockstep_algorithm().client_share(run, batch)
        return None if value is None else (torch.tensor([run.data.num_samples]), value.unsqueeze(0))

    def step(self, batches: Any, step: int) -> None:
        run, context = self.run, self.context
        local = run.local
        local.shared = context.lockstep_algorithm().shared
        with _activated(context, run, "step"), torch.no_grad():
            run._record(context.algorithm.client_step(run, batches[0]))
            local.steps_taken += 1
            local.step_index += 1

    def finish(self) -> ClientBlock:
        with _activated(self.context, self.run, "final"):
            uploads = self.context.algorithm.client_final(self.run)
        return ClientBlock.of([self.context.result(self.run, uploads)])


@contextmanager
def _activated(context: ClientContext, run: ModuleRun, phase: str) -> Iterator[None]:
    """A parked run's model loaded into the module, in its local-work setting for one phase of a
    lock-step (keyed by the phase and the step), and parked again afterwards."""
    run.activate()
    try:
        with context.local_work(run.client_id, phase, run.round, run.local.step_index):
            yield
    finally:
        run.park()


def train_plainly(context: ClientContext, client_id: int, start: Tensor, steps: Optional[int], stream: str,
                  round_idx: int) -> Tensor:
    """Plain local training of client ``client_id`` in the client module, for any algorithm: its
    module's loss and optimizer from ``start``, on ``steps`` batches of ``stream`` (keyed by
    ``round_idx``); returns the trained state vector. The client module is left trained: the
    caller restores it."""
    local = partial(ModuleLocal, optimizer=context.engine.local_optimizer())
    run = context.new_run(ModuleRun, client_id, local, context, context.module_view(),
                          batches=context.client_batches(client_id, round_idx), start=start, plain=True,
                          round_idx=round_idx)
    run.start = start  # loaded into the client module
    with context.local_work(client_id, stream, round_idx), torch.no_grad():
        for batch in context.batches(client_id, steps, stream, round_idx):
            run._record(plain_step(run, batch))
    return run.end()


def train_one_by_one(context: ClientContext, client_ids: list[int], start: Tensor, steps: Optional[int], stream: str,
                     round_idx: int) -> Iterator[tuple[int, Tensor]]:
    """:func:`train_plainly` of each of ``client_ids`` in turn, the client module's model put back
    after each: ``(client, trained state vector)``."""
    saved = context.global_model.flatten()
    for client_id in client_ids:
        end = train_plainly(context, client_id, start, steps, stream, round_idx)
        context.global_model.load(saved)
        yield client_id, end
