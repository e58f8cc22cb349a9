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

import math
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Iterator, Mapping, Optional, Sequence

import torch
from torch import Tensor

from fl_lightning.backends.base import ClientBackend
from fl_lightning.distributed import all_reduce_sum, rank_and_world
from fl_lightning.optim.functional import optimizer_lr
from fl_lightning.run import ClientRun, Model
from fl_lightning.update import ClientUpdate
from fl_lightning.vectors import set_grads

if TYPE_CHECKING:
    from fl_lightning.module import FederatedModule


def training_loss(output: Any) -> Tensor:
    """The loss of a ``training_step`` result: a tensor, or the ``"loss"`` of a dict, as a 0-dim tensor.

    Both backends take the loss here. A loss of more than one element, or one that does not
    require grad (detached, or computed under ``no_grad``), is refused with a ValueError: the
    first fails in ``backward`` / ``torch.func.grad``, the second would give the batched backend
    a zero gradient. The checks read tensor metadata only (no device sync)."""
    loss = output["loss"] if isinstance(output, Mapping) and "loss" in output else output
    if not isinstance(loss, Tensor):
        got = f"a dict with keys {sorted(output)}" if isinstance(output, Mapping) else type(output).__name__
        raise TypeError(
            f"the client's training_step must return a loss tensor or a dict with a 'loss' tensor, got {got}"
        )
    if loss.numel() != 1:
        raise ValueError(f"the client's training_step returned a loss of shape {tuple(loss.shape)}: it must be a "
                         "scalar tensor (one element); reduce it, e.g. with .mean()")
    if not loss.requires_grad:
        raise ValueError("the client's training_step returned a loss that does not require grad (detached, computed "
                         "under torch.no_grad(), or from no trainable parameter): it must be a tensor computed from "
                         "the model's parameters with grad enabled")
    return loss.reshape(())


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
    def of(cls, module: "FederatedModule") -> "ModuleView":
        return cls(module.state.params, module.state.tensors, module.trainer.precision_plugin.forward_context,
                   module.grad_scaler)


class ModuleRun(ClientRun):
    """A client's round trained in the client module (the sequential backend's run).

    Args:
        module: the federated module.
        optimizer: the local optimizer over the client module's parameters.
        view: the module's tensors and precision context (default: looked up now).
        **fields: the :class:`~fl_lightning.run.ClientRun` fields.
    """

    def __init__(
        self, module: "FederatedModule", optimizer: torch.optim.Optimizer, view: Optional[ModuleView] = None,
        **fields: Any,
    ) -> None:
        super().__init__(**fields)
        self.module = module
        self.optimizer: torch.optim.Optimizer = optimizer
        view = view if view is not None else ModuleView.of(module)
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
        with torch.enable_grad(), self._forward_context():
            if loss_fn is not None:
                out = loss_fn(batch)
            else:
                self.module.note_local_batch(batch)
                out = training_loss(self.module.client.training_step(batch, self.step_index))
        loss = out[0] if isinstance(out, tuple) else out
        if scaler is not None:
            scaler.scale(loss).backward()
            scaler.unscale_(self.optimizer)
            self._unscaled = True
        else:
            loss.backward()
        return out, [torch.zeros_like(p) if p.grad is None else p.grad for p in self._params]

    def _other_loss_and_grad(
        self, batch: Any, model: Sequence[Tensor], loss_fn: Optional[Callable[[Any], Any]]
    ) -> tuple[Any, list[Tensor]]:
        k = self.layout.num_param_tensors
        leaves = [t.detach().requires_grad_() for t in model[:k]]
        tensors = [*leaves, *model[k:]]
        with torch.enable_grad(), self._forward_context():
            if loss_fn is not None:
                self._active = tensors
                try:
                    out = loss_fn(batch)
                finally:
                    self._active = None
            else:
                self.module.note_local_batch(batch)
                out = training_loss(self.module.functional_client.training_step(tensors, batch, self.step_index))
            loss = out[0] if isinstance(out, tuple) else out
            scaler = self._scaler
            scaled = scaler.scale(loss) if scaler is not None else loss
        grads = torch.autograd.grad(scaled, leaves, allow_unused=True)
        inverse = 1.0 / scaler.get_scale() if scaler is not None else 1.0
        return out, [torch.zeros_like(p) if g is None else (g * inverse if scaler is not None else g)
                     for p, g in zip(leaves, grads)]

    def forward(self, *args: Any, model: Model = None) -> Any:
        tensors = model if model is not None else self._active
        with self._forward_context():
            if tensors is None:
                return self.module.client(*args)
            return self.module.functional_client.forward(tensors, *args)

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
        with torch.no_grad():
            for t, v in zip(self._tensors, self.layout.split(start)):
                t.copy_(v)

    def copy_model(self, vector: Optional[Tensor] = None) -> list[Tensor]:
        if vector is not None:
            return super().copy_model(vector)
        return [t.detach().clone() for t in self._tensors]

    def fetch(self, positions: Tensor) -> Any:
        data = self.module.datamodule.client_data(self.client_id, "train")
        return self.module.prepare_batch(self.client_id, data.fetch(positions))

    def epoch(self, batch_size: int) -> Iterator[Any]:
        data = self.module.datamodule.client_data(self.client_id, "train")
        for batch in data.epoch_batches(1, batch_size=batch_size):
            yield self.module.prepare_batch(self.client_id, batch)

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


class SequentialBackend(ClientBackend):
    """Runs the round's clients one after another (lock-step algorithms: one step of all of this
    process's clients per work item), in the client module."""

    def __init__(self) -> None:
        self._runs: list[ModuleRun] = []
        self._steps: list[Iterator[tuple[Any, dict[str, Any]]]] = []
        self._clients: list[int] = []
        self._view: Optional[ModuleView] = None

    # ------------------------------------------------------------ schedule
    def num_work_items(self, module: "FederatedModule") -> int:
        if module.lockstep:
            assert module.local_steps is not None
            return module.local_steps
        _, world = rank_and_world()
        return math.ceil(module.clients_per_round / world)

    def start_round(self, module: "FederatedModule", clients: list[int]) -> list[Any]:
        self._clients, self._runs, self._steps = list(clients), [], []
        self._view = ModuleView.of(module)
        if module.lockstep:
            return list(range(self.num_work_items(module)))
        return list(clients)

    def run_work_item(self, module: "FederatedModule", item: Any) -> None:
        if module.lockstep:
            self._lockstep_item(module, item)
        else:
            module.receive(*self.run_client(module, item))

    # ------------------------------------------------------------ one client's round
    def new_run(self, module: "FederatedModule", client_id: int) -> ModuleRun:
        """A run of ``client_id`` starting from the global model (loaded into the client module)."""
        assert module.round_start is not None
        run = ModuleRun(
            module,
            module.local_optimizer(),
            self._view,
            client_id=client_id,
            round_idx=module.current_epoch,
            num_samples=module.datamodule.num_samples(client_id),
            layout=module.state.layout,
            start=module.round_start,
            state=module.load_client_state(client_id),
            num_steps=module.local_steps,
            shared=module.shared,
        )
        run.restart(module.round_start)
        return run

    def run_client(self, module: "FederatedModule", client_id: int) -> tuple[ClientUpdate, Optional[dict[str, Tensor]]]:
        """One client's whole round: ``client_init``, its steps, ``client_final``."""
        if module.upload_is_forged(client_id):
            return module.forged_placeholder(client_id), None
        run = self.new_run(module, client_id)
        with module.local_work(client_id, "round", run.round):
            module.client_init(run)
            with torch.no_grad():
                for batch, extra in module.step_batches(run):
                    run.extra_batches = extra
                    run.record(module.client_step(run, batch))
                    run.steps_taken += 1
                    run.step_index += 1
            uploads = module.client_final(run)
        return module.client_update(run, uploads), run.state

    # ------------------------------------------------------------ lock-step rounds
    def _lockstep_item(self, module: "FederatedModule", step: int) -> None:
        """Local step ``step`` of all this process's clients (``client_share``, the server's
        combination, ``client_step``); after the last, their ``client_final``."""
        if step == 0:
            for cid in self._clients:
                run = self.new_run(module, cid)
                with module.local_work(cid, "init", run.round):
                    module.client_init(run)
                run.park()
                self._runs.append(run)
                self._steps.append(module.step_batches(run))
        batches = [next(steps) for steps in self._steps]
        shares: list[Optional[Tensor]] = []
        for run, (batch, extra) in zip(self._runs, batches):
            run.extra_batches = extra
            with _activated(module, run, "share"), torch.no_grad():
                shares.append(module.client_share(run, batch))
        if any(s is not None for s in shares):
            module.shared = module.server_share(self._weighted_mean(module, shares))
            for run in self._runs:
                run.shared = module.shared
        for run, (batch, _) in zip(self._runs, batches):
            with _activated(module, run, "step"), torch.no_grad():
                run.record(module.client_step(run, batch))
                run.steps_taken += 1
                run.step_index += 1
        if step == self.num_work_items(module) - 1:
            for run in self._runs:
                with _activated(module, run, "final"):
                    uploads = module.client_final(run)
                module.receive(module.client_update(run, uploads), run.state)
            self._runs, self._steps = [], []

    def _weighted_mean(self, module: "FederatedModule", shares: list[Optional[Tensor]]) -> Tensor:
        """``sum_k n_k share_k / sum_k n_k`` over all processes' clients of the round (one all-reduce)."""
        dm = module.datamodule
        total = float(sum(dm.num_samples(c) for c in module.round_clients))
        present = [s for s in shares if s is not None]
        if len(present) != len(shares):
            raise RuntimeError("client_share must return a value for every client or for none, at a given step")
        acc = torch.zeros_like(present[0], dtype=torch.float64)
        for run, share in zip(self._runs, present):
            acc += (run.num_samples / total) * share.to(torch.float64)
        return all_reduce_sum(acc)


@contextmanager
def _activated(module: "FederatedModule", run: ModuleRun, phase: str) -> Iterator[None]:
    """A parked run's model loaded into the module, in its local-work setting for one phase of a
    lock-step (keyed by the phase and the step), and parked again afterwards."""
    run.activate()
    try:
        with module.local_work(run.client_id, phase, run.round, run.step_index):
            yield
    finally:
        run.park()
