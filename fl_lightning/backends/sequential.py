"""The sequential backend: one client after another, trained in the client module itself.

This is the reference backend. A client's trained model lives in the client module's own
parameters for its whole round, so a local step is exactly what the module does when trained
alone: its ``training_step`` under the Trainer's precision context, ``backward``, and its
own optimizer (from ``configure_optimizers``, at the round's scheduled learning rate). Other
models of a step (FedDeper's personal model, FedProxVR's reference point) are plain tensors
evaluated with ``torch.func.functional_call`` on the same module.

Lock-step algorithms (``FederatedModule.lockstep``) advance all of this process's clients one
step per work item; their trained models are parked as flat vectors between their steps.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Optional, Sequence

import torch
from torch import Tensor

from fl_lightning.backends.base import ClientBackend
from fl_lightning.backends.context import ClientContext
from fl_lightning.backends.stateless import training_loss
from fl_lightning.client_config import ClientConfig
from fl_lightning.optim.param_groups import optimizer_lr
from fl_lightning.run import ClientRun, Model, plain_step
from fl_lightning.vectors import set_grads


@dataclass(frozen=True)
class ModuleView:
    """What local steps need of the federated module, looked up once (per round): the client
    module's tensors (it does not move during a round) and the precision plugin's forward
    context and loss scaler."""

    params: list[Tensor]
    tensors: list[Tensor]
    forward_context: Callable[[], Any]
    scaler: Optional[torch.amp.GradScaler]

    @classmethod
    def of(cls, context: ClientContext) -> "ModuleView":
        model = context.global_model
        return cls(model.params, model.tensors, context.forward_context, context.grad_scaler)


class ModuleRun(ClientRun):
    """A client's round trained in the client module (the sequential backend's run).

    Args:
        context: the engine's services for local work.
        optimizer: the local optimizer over the client module's parameters.
        view: the module's tensors and precision context (default: looked up now).
        **fields: the :class:`~fl_lightning.run.ClientRun` fields.
    """

    def __init__(
        self, context: ClientContext, optimizer: torch.optim.Optimizer, view: Optional[ModuleView] = None,
        **fields: Any,
    ) -> None:
        super().__init__(**fields)
        self.context = context
        self.optimizer: torch.optim.Optimizer = optimizer
        view = view if view is not None else ModuleView.of(context)
        self._params, self._tensors = view.params, view.tensors
        self._forward_context, self._scaler = view.forward_context, view.scaler
        self._active: Model = None  # the model loss_fn's forward uses, if not the module's own
        self._unscaled = False  # the GradScaler unscaled this optimizer's gradients since its last step
        self._parked: Optional[Tensor] = None

    # ------------------------------------------------------------ model operations
    @property
    def params(self) -> list[Tensor]:
        return self._params

    @property
    def lr(self) -> float:
        return optimizer_lr(self.optimizer)

    def configure_lr(self, config: ClientConfig) -> None:
        groups = [g for g in self.optimizer.param_groups if any(p.requires_grad for p in g["params"])]
        for group, rate in zip(groups, config.rates([group["lr"] for group in groups])):
            group["lr"] = rate

    def loss_and_grad(
        self,
        batch: Any,
        model: Model = None,
        loss_fn: Optional[Callable[[Any], Any]] = None,
        has_aux: bool = False,
    ) -> tuple[Any, list[Tensor]]:
        if model is None:
            out, grads = self._trained_loss_and_grad(batch, loss_fn)
        else:
            out, grads = self._other_loss_and_grad(batch, model, loss_fn)
        if has_aux:
            loss, aux = out
            return (loss.detach(), aux), grads
        return out.detach(), grads

    def _trained_loss_and_grad(self, batch: Any, loss_fn: Optional[Callable[[Any], Any]]) -> tuple[Any, list[Tensor]]:
        scaler = self._scaler
        if scaler is not None and self._unscaled:
            scaler.update()  # the previous gradient of this optimizer was not followed by a step
            self._unscaled = False
        for p in self._params:
            p.grad = None
        with torch.enable_grad():
            with self._forward_context():
                if loss_fn is not None:
                    out = loss_fn(batch)
                else:
                    self.context.logs.batch = batch  # the client's self.log infers batch sizes from it
                    out = training_loss(self.context.client.training_step(batch, self.step_index))
            scaled = self._scaled_loss(out)
        scaled.backward()
        if scaler is not None:
            scaler.unscale_(self.optimizer)
            self._unscaled = True
        return out, [torch.zeros_like(p) if p.grad is None else p.grad for p in self._params]

    def _other_loss_and_grad(
        self, batch: Any, model: Sequence[Tensor], loss_fn: Optional[Callable[[Any], Any]]
    ) -> tuple[Any, list[Tensor]]:
        k = self.layout.num_param_tensors
        leaves = [t.detach().requires_grad_() for t in model[:k]]
        tensors = [*leaves, *model[k:]]
        with torch.enable_grad():
            with self._forward_context():
                if loss_fn is not None:
                    self._active = tensors
                    try:
                        out = loss_fn(batch)
                    finally:
                        self._active = None
                else:
                    self.context.logs.batch = batch
                    out = training_loss(self.context.stateless.training_step(tensors, batch, self.step_index))
            scaled = self._scaled_loss(out)
        grads = torch.autograd.grad(scaled, leaves, allow_unused=True)
        scaler = self._scaler
        inverse = 1.0 / scaler.get_scale() if scaler is not None else 1.0
        return out, [torch.zeros_like(p) if g is None else (g * inverse if scaler is not None else g)
                     for p, g in zip(leaves, grads)]

    def _scaled_loss(self, out: Any) -> Tensor:
        """The loss of ``out`` (a loss, or a ``(loss, aux)`` pair) times the loss scaler's scale
        (``16-mixed``), or the loss itself. Call it with grad enabled, as the forward: local steps
        run under ``torch.no_grad()``, where the scaled loss would have no grad_fn to backward."""
        loss = out[0] if isinstance(out, tuple) else out
        return self._scaler.scale(loss) if self._scaler is not None else loss

    def forward(self, *args: Any, model: Model = None) -> Any:
        tensors = model if model is not None else self._active
        with self._forward_context():
            if tensors is None:
                return self.context.client(*args)
            return self.context.stateless.forward(tensors, *args)

    def step(self, grads: Sequence[Tensor]) -> None:
        set_grads(self._params, grads)
        scaler = self._scaler
        if scaler is not None and self._unscaled:
            scaler.step(self.optimizer)  # skipped if the unscaled gradients had an Inf/NaN
            scaler.update()
            self._unscaled = False
        else:
            self.optimizer.step()

    def end(self) -> Tensor:
        return self.layout.flatten(self._tensors)

    def restart(self, start: Tensor) -> None:
        self.start = start
        self.layout.write(self._tensors, start)

    def copy_model(self, vector: Optional[Tensor] = None) -> list[Tensor]:
        if vector is not None:
            return super().copy_model(vector)
        return [t.detach().clone() for t in self._tensors]

    def fetch(self, positions: Tensor) -> Any:
        return self.context.fetch(self.client_id, positions)

    def epoch(self, batch_size: int) -> Iterator[Any]:
        return self.context.epoch(self.client_id, batch_size)

    # ------------------------------------------------------------ lock-step rounds
    def park(self) -> None:
        """Keep the trained model as a vector while other clients use the module."""
        self._parked = self.end()

    def activate(self) -> None:
        """Load the parked model back into the module."""
        if self._parked is not None:
            start = self.start
            self.restart(self._parked)
            self.start, self._parked = start, None


@dataclass
class _Parked:
    """A lock-step client: its run, parked between steps, and its stream of step batches."""

    run: ModuleRun
    batches: Iterator[tuple[Any, dict[str, Any]]]


class SequentialBackend(ClientBackend[_Parked]):
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
        self._view: Optional[ModuleView] = None

    def group_size(self, context: ClientContext) -> int:
        return 1 if context.lockstep else self.clients_per_block  # a lock-step group is one parked client

    def start_round(self, context: ClientContext, clients: list[int]) -> list[Any]:
        self._view = ModuleView.of(context)
        return super().start_round(context, clients)

    def new_run(self, context: ClientContext, client_id: int) -> ModuleRun:
        """A run of ``client_id`` starting from the global model (loaded into the client module)."""
        run = context.new_run(ModuleRun, client_id, context, context.algorithm.local_optimizer(), self._view)
        run.restart(run.start)
        return run

    def run_clients(self, context: ClientContext, clients: list[int]) -> None:
        """The whole round of each of ``clients`` (a block), one after another."""
        for client_id in clients:
            self.run_client(context, client_id)

    def run_client(self, context: ClientContext, client_id: int) -> None:
        """One client's whole round: ``client_init``, its steps, ``client_final``, in one local-work setting."""
        if context.is_forged(client_id):
            context.skip_forged(client_id)
            return
        run = self.new_run(context, client_id)
        algorithm = context.algorithm
        with context.local_work(client_id, "round", run.round):
            algorithm.client_init(run)
            with torch.no_grad():
                for batch, extra in context.step_batches(run):
                    run.extra_batches = extra
                    run.record(algorithm.client_step(run, batch))
                    run.steps_taken += 1
                    run.step_index += 1
            uploads = algorithm.client_final(run)
        context.finish(run, uploads)

    def train_clients_plainly(self, context: ClientContext, client_ids: list[int], start: Tensor, steps: Optional[int],
                              stream: str, round_idx: int) -> Iterator[tuple[int, Tensor]]:
        """One client after another (:func:`train_plainly`)."""
        return train_one_by_one(context, client_ids, start, steps, stream, round_idx)

    # ------------------------------------------------------------ lock-step group operations (one client each)
    def start_group(self, context: ClientContext, clients: list[int]) -> _Parked:
        (client_id,) = clients
        run = self.new_run(context, client_id)
        with context.local_work(client_id, "init", run.round):
            context.algorithm.client_init(run)
        run.park()
        return _Parked(run, context.step_batches(run))

    def next_batches(self, context: ClientContext, group: _Parked) -> Any:
        return next(group.batches)

    def share(self, context: ClientContext, group: _Parked, batches: Any, step: int) -> Optional[tuple[Tensor, Tensor]]:
        run, (batch, extra) = group.run, batches
        run.extra_batches = extra
        with _activated(context, run, "share"), torch.no_grad():
            value = context.lockstep_algorithm().client_share(run, batch)
        return None if value is None else (torch.tensor([run.num_samples]), value.unsqueeze(0))

    def step(self, context: ClientContext, group: _Parked, batches: Any, step: int) -> None:
        run = group.run
        run.shared = context.lockstep_algorithm().shared
        with _activated(context, run, "step"), torch.no_grad():
            run.record(context.algorithm.client_step(run, batches[0]))
            run.steps_taken += 1
            run.step_index += 1

    def finish_group(self, context: ClientContext, group: _Parked) -> None:
        with _activated(context, group.run, "final"):
            uploads = context.algorithm.client_final(group.run)
        context.finish(group.run, uploads)


@contextmanager
def _activated(context: ClientContext, run: ModuleRun, phase: str) -> Iterator[None]:
    """A parked run's model loaded into the module, in its local-work setting for one phase of a
    lock-step (keyed by the phase and the step), and parked again afterwards."""
    run.activate()
    try:
        with context.local_work(run.client_id, phase, run.round, run.step_index):
            yield
    finally:
        run.park()


def train_plainly(context: ClientContext, client_id: int, start: Tensor, steps: Optional[int], stream: str,
                  round_idx: int) -> Tensor:
    """Plain local training of client ``client_id`` in the client module, for any algorithm: its
    module's loss and optimizer from ``start``, on ``steps`` batches of ``stream`` (keyed by
    ``round_idx``); returns the trained state vector. The client module is left trained: the
    caller restores it."""
    run = context.new_run(ModuleRun, client_id, context, context.algorithm.local_optimizer(), start=start,
                          plain=True, round_idx=round_idx)
    run.restart(start)
    with context.local_work(client_id, stream, round_idx), torch.no_grad():
        for batch in context.batches(client_id, steps, stream, round_idx):
            run.record(plain_step(run, batch))
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
