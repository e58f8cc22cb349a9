"""A client's round without a Trainer: what the sequential backend runs, and what a deployment node runs.

:func:`run_client` takes the algorithm, a client, the round, the start model, the client's state
entries, the round's local settings (:class:`LocalSettings`: learning rates, steps or epochs,
precision, device) and the client's training split, and returns the client's uploads, new state and
metrics (:class:`ClientRoundResult`). Nothing of a ``Trainer`` is read: the precision is a Lightning
precision plugin (made from its name), the batches come from the split in an order keyed by
``(seed, "batches", round, client)``, the client module's own random draws from ``(seed, "client",
client, "round", round)``, as in a fit.

The sequential backend builds one :class:`ClientProgram` a round (the algorithm's client hooks with
the round's settings) and runs each client with :meth:`ClientProgram.run`, the body of
:func:`run_client`: a fit and a deployment node compute the same bits.

A client's model lives in the client module's own parameters for its round (:class:`ModuleRun`): a
local step is exactly what the module does when trained alone, its ``training_step`` under the
precision plugin's forward context, ``backward`` and its own optimizer. Other models of a step
(FedDeper's personal model, FedProxVR's reference point) are tensors evaluated with
``torch.func.functional_call`` on the same module.
"""

from __future__ import annotations

from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from functools import partial
from typing import Any, Callable, Iterator, Mapping, Optional, Protocol, Sequence, Union

import torch
from torch import Tensor

from fl_lightning.backends.stateless import StatelessClient, training_loss
from fl_lightning.broadcast import load_broadcast
from fl_lightning.client_config import ClientConfig
from fl_lightning.datamodules.client_data import ClientData, prefetched, to_device
from fl_lightning.lightning_compat import routed_log
from fl_lightning.lightning_package import MixedPrecision, Precision, pl
from fl_lightning.local_logging import LocalLogBuffer
from fl_lightning.optim.param_groups import moved_by, optimizer_lr
from fl_lightning.run import ClientRun, LocalWork, Model, RunData, StepOutput
from fl_lightning.schedules import set_lrs, split_optimizer_config
from fl_lightning.seeding import generator, keyed_rngs
from fl_lightning.update import ClientUpdate, UpdateSpec
from fl_lightning.validation import check_int
from fl_lightning.vectors import ModelVector, set_grads

#: the precisions a :class:`LocalSettings` names (a Lightning precision plugin may be given instead)
PRECISIONS = ("32-true", "16-mixed", "bf16-mixed")


@dataclass(frozen=True)
class LocalSettings:
    """The round's settings of a client's local work: what a fit takes from its Trainer and schedule.

    Args:
        steps: local steps (exclusive with ``epochs``).
        epochs: passes over the client's training split instead.
        lrs: the learning rate of each of the local optimizer's parameter groups this round; None: the
            rates of the client's ``configure_optimizers``.
        precision: ``"32-true"``, ``"16-mixed"`` or ``"bf16-mixed"`` (Lightning's names), or a Lightning
            precision plugin (a fit's ``trainer.precision_plugin``, whose loss scaler then carries over).
        device: where the client's batches go (the algorithm's module is moved there).

    Raises:
        ValueError: not exactly one of ``steps`` and ``epochs``, one below 0 (``epochs`` below 1), or an
            unknown ``precision``.
    """

    steps: Optional[int] = None
    epochs: Optional[int] = None
    lrs: Optional[Sequence[float]] = None
    precision: Union[str, Precision] = "32-true"
    device: Union[str, torch.device] = "cpu"

    def __post_init__(self) -> None:
        if (self.steps is None) == (self.epochs is None):
            raise ValueError(f"give one of steps and epochs, got steps={self.steps}, epochs={self.epochs}")
        if self.steps is not None:
            check_int("steps", self.steps, 0)
        else:
            check_int("epochs", self.epochs, 1)
        if isinstance(self.precision, str) and self.precision not in PRECISIONS:
            raise ValueError(f"precision must be one of {PRECISIONS} or a Lightning precision plugin, "
                             f"got {self.precision!r}")

    def precision_plugin(self) -> Precision:
        """The precision plugin of local steps (made from the name, or the one given)."""
        if not isinstance(self.precision, str):
            return self.precision
        if self.precision == "32-true":
            return Precision()
        return MixedPrecision(self.precision, torch.device(self.device).type)  # type: ignore[arg-type]


@dataclass(frozen=True)
class ClientRoundResult:
    """A client's round: its ``update`` (uploads, sample count, metrics) and its new ``state`` entries."""

    update: ClientUpdate
    state: dict[str, Tensor]

    @property
    def uploads(self) -> dict[str, Tensor]:
        """The declared uploads, flat fp32."""
        return self.update.tensors

    @property
    def metrics(self) -> dict[str, Any]:
        """The client's metrics: its mean step loss (and other step scalars), ``steps``, ``run.metrics``."""
        return self.update.metrics


class ClientBatches:
    """One client's training split as the batches of its local work, on ``device``.

    Args:
        data: the client's training split.
        client_id: the client.
        round_idx: the round (of the batches' order).
        seed: the federation's seed (of the batches' order).
        device: where batches go.
        epochs: the passes of a round without a step count (``local_epochs``).
        prepare: ``prepare(client_id, batch)``, applied to each batch on the device (the callbacks'
            ``on_local_batch``: data poisoning); None: none.
    """

    def __init__(self, data: ClientData, client_id: int, round_idx: int, seed: int, device: torch.device,
                 epochs: Optional[int] = None, prepare: Optional[Callable[[int, Any], Any]] = None) -> None:
        self.data, self.client_id, self.round, self.seed = data, client_id, round_idx, seed
        self.device, self.epochs, self.prepare = device, epochs, prepare

    def ready(self, batch: Any) -> Any:
        """``batch`` on the device, prepared for a step."""
        batch = to_device(batch, self.device)
        return batch if self.prepare is None else self.prepare(self.client_id, batch)

    def order(self, stream: str = "batches", round_idx: Optional[int] = None) -> torch.Generator:
        """The generator of the batch order of ``stream`` this round (or ``round_idx``)."""
        return generator(self.seed, stream, self.round if round_idx is None else round_idx, self.client_id)

    def batches(self, num_steps: Optional[int], stream: str = "batches", round_idx: Optional[int] = None,
                epochs: Optional[int] = None) -> Iterator[Any]:
        """``num_steps`` batches, or when ``num_steps`` is None ``epochs`` passes (default: the round's), in an
        order from ``(seed, stream, round, client)``. On a CUDA device, batches gathered on the host are copied
        from pinned memory one step ahead, while the previous step runs."""
        g = self.order(stream, round_idx)
        if num_steps is not None:
            batches = self.data.step_batches(num_steps, g)
        else:
            epochs = self.epochs if epochs is None else epochs
            assert epochs is not None, "a round without a step count needs epochs"
            batches = self.data.epoch_batches(epochs, g)
        if self.device.type == "cuda":
            batches = prefetched(batches, partial(to_device, device=self.device, pinned=True))
        for batch in batches:
            yield self.ready(batch)

    def step_batches(self, run: ClientRun, extra_streams: Sequence[str]) -> Iterator[tuple[Any, dict[str, Any]]]:
        """Each local step's batch of ``run`` (``run.data.batches`` if ``client_init`` gave them) and the
        batches of the ``extra_streams``."""
        local = run.local
        main = iter(run.data.batches) if run.data.batches is not None else self.batches(local.num_steps,
                                                                                        epochs=local.epochs)
        extras = {s: self.batches(local.num_steps, s, epochs=local.epochs) for s in extra_streams}
        for batch in main:
            yield batch, {name: next(it) for name, it in extras.items()}

    def fetch(self, positions: Tensor) -> Any:
        """The split's samples at ``positions`` as one batch, ready for a step."""
        return self.ready(self.data.fetch(positions))

    def epoch(self, batch_size: int) -> Iterator[Any]:
        """One pass over the split in index order, in batches ready for a step."""
        for batch in self.data.epoch_batches(1, batch_size=batch_size):
            yield self.ready(batch)


def _drop_log(*args: Any, **kwargs: Any) -> None:
    """Stands in for a client's ``self.log`` where its calls are not kept."""


@contextmanager
def local_setting(client: pl.LightningModule, logs: Optional[LocalLogBuffer], seed: int, client_id: int,
                  keys: tuple[Any, ...], device: torch.device, training: bool, integer_buffers: Sequence[Tensor],
                  seeded: bool = True) -> Iterator[Callable[..., None]]:
    """The setting of local work of ``client_id`` (see ``ClientContext.local_work``): the global RNG forked
    and seeded from ``(seed, "client", client, *keys)`` (yields ``reseed(*more)``; seeded already with
    ``seeded``), the client module in train mode, its ``self.log`` calls buffered in ``logs`` in training
    (dropped elsewhere, or without ``logs``), gradients enabled outside training, and the ``integer_buffers``
    (BatchNorm's counters: not federated state) put back as they were."""
    was_training = client.training
    counters = [(b, b.clone()) for b in integer_buffers]
    logging_client = None
    if logs is not None:
        logging_client, logs.client_id = logs.client_id, client_id
    with ExitStack() as stack:
        reseed = stack.enter_context(keyed_rngs(seed, "client", client_id, *keys, device=device))
        if seeded:
            reseed()
        stack.enter_context(routed_log(client, logs.log if training and logs is not None else _drop_log))
        if not training:
            stack.enter_context(torch.inference_mode(False))
            stack.enter_context(torch.enable_grad())
        if not was_training:
            client.train()
        try:
            yield reseed
        finally:
            if not was_training:
                client.eval()
            if logs is not None:
                logs.batch, logs.client_id = None, logging_client
            with torch.no_grad():
                for buffer, value in counters:
                    buffer.copy_(value)


class ClientAlgorithm(Protocol):
    """What a client's round reads of the algorithm (a ``FederatedModule`` is one): its client module and
    model layout, its seed, its declarations and its client hooks."""

    client: pl.LightningModule
    global_model: ModelVector
    seed: int
    update_specs: dict[str, UpdateSpec]
    extra_batch_streams: tuple[str, ...]
    device: torch.device

    def to(self, device: torch.device) -> Any: ...

    def client_init(self, run: ClientRun) -> None: ...

    def client_step(self, run: ClientRun, batch: Any) -> StepOutput: ...

    def client_final(self, run: ClientRun) -> dict[str, Tensor]: ...


class LocalServices(Protocol):
    """What a :class:`ModuleRun` uses besides its batches: the client module, the module as a function
    of its tensors, and the buffer of its ``self.log`` calls (None: they are dropped)."""

    client: pl.LightningModule
    stateless: StatelessClient
    logs: Optional[LocalLogBuffer]


@dataclass(frozen=True)
class ModuleView:
    """What local steps need of the client module, looked up once a round: its tensors (the module does
    not move during a round) and the precision plugin's forward context and loss scaler."""

    params: list[Tensor]
    tensors: list[Tensor]
    forward_context: Callable[[], Any]
    scaler: Optional[torch.amp.GradScaler]

    @classmethod
    def of(cls, params: list[Tensor], tensors: list[Tensor], precision: Precision) -> "ModuleView":
        return cls(params, tensors, precision.forward_context, getattr(precision, "scaler", None))


class ModuleLocal(LocalWork):
    """The local optimization of a :class:`ModuleRun`: ``optimizer``, a ``torch.optim`` optimizer over the
    client module's parameters (its run tells it their order, for :attr:`moves`)."""

    optimizer: torch.optim.Optimizer
    #: the client module's parameters in the model's order (set by the run) and which of them a step moves
    _params: Sequence[Tensor] = ()
    _moves: Optional[list[bool]] = None

    @property
    def lr(self) -> float:
        return optimizer_lr(self.optimizer)

    @property
    def moves(self) -> list[bool]:
        if self._moves is None:
            self._moves = moved_by(self.optimizer, self._params)
        return self._moves

    def _configure_lr(self, config: ClientConfig) -> None:
        groups = [g for g in self.optimizer.param_groups if any(p.requires_grad for p in g["params"])]
        for group, rate in zip(groups, config.rates([group["lr"] for group in groups])):
            group["lr"] = rate


class ModuleRun(ClientRun):
    """A client's round trained in the client module.

    Args:
        services: the client module and its log buffer.
        view: the module's tensors and precision context.
        **fields: the :class:`~fl_lightning.run.ClientRun` fields (``local``: a :class:`ModuleLocal`).
    """

    local: ModuleLocal

    def __init__(self, services: LocalServices, view: ModuleView, **fields: Any) -> None:
        super().__init__(**fields)
        self.services = services
        self._params, self._tensors = view.params, view.tensors
        self.local._params = view.params
        self._forward_context, self._scaler = view.forward_context, view.scaler
        self._active: Model = None  # the model loss_fn's forward uses, if not the module's own
        self._unscaled = False  # the GradScaler unscaled this optimizer's gradients since its last step
        self._parked: Optional[Tensor] = None

    # ------------------------------------------------------------ model operations
    @property
    def params(self) -> list[Tensor]:
        return self._params

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

    def _log_batch(self, batch: Any) -> None:
        """Tell the log buffer the batch of the client's ``self.log`` calls (it infers batch sizes from it)."""
        logs = self.services.logs
        if logs is not None:
            logs.batch = batch

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
                    self._log_batch(batch)
                    out = training_loss(self.services.client.training_step(batch, self.local.step_index))
            scaled = self._scaled_loss(out)
        scaled.backward()
        if scaler is not None:
            scaler.unscale_(self.local.optimizer)
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
                    self._log_batch(batch)
                    out = training_loss(self.services.stateless.training_step(tensors, batch, self.local.step_index))
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
                return self.services.client(*args)
            return self.services.stateless.forward(tensors, *args)

    def step(self, grads: Sequence[Tensor]) -> None:
        set_grads(self._params, grads)
        scaler = self._scaler
        if scaler is not None and self._unscaled:
            scaler.step(self.local.optimizer)  # skipped if the unscaled gradients had an Inf/NaN
            scaler.update()
            self._unscaled = False
        else:
            self.local.optimizer.step()

    def end(self) -> Tensor:
        return self.layout.flatten(self._tensors)

    def _restart(self, start: Tensor) -> None:
        self.layout.write(self._tensors, start)

    # ------------------------------------------------------------ lock-step rounds
    def park(self) -> None:
        """Keep the trained model as a vector while other clients use the module."""
        self._parked = self.end()

    def activate(self) -> None:
        """Load the parked model back into the module."""
        if self._parked is not None:
            self._restart(self._parked)
            self._parked = None


def local_optimizer(client: pl.LightningModule, lrs: Optional[Sequence[float]]) -> torch.optim.Optimizer:
    """A fresh local optimizer: the client's ``configure_optimizers`` one, at ``lrs`` (one per parameter
    group; None: its own rates)."""
    optimizer = split_optimizer_config(client.configure_optimizers())[0]
    if lrs is not None:
        set_lrs(optimizer, lrs)
    return optimizer


def checked_update(algorithm_name: str, specs: Mapping[str, UpdateSpec], run: ClientRun,
                   uploads: Mapping[str, Tensor]) -> ClientUpdate:
    """The update of a finished ``run``: its ``uploads`` (checked against the declared ``specs``, made flat
    fp32), sample count and metrics.

    Raises:
        ValueError: the uploads' names or sizes are not the declared ones.
    """
    if set(uploads) != set(specs):
        raise ValueError(f"{algorithm_name}.client_final returned uploads {sorted(uploads)}, but the declared "
                         f"uploads are {sorted(specs)} (see add_update)")
    tensors = {}
    for name, spec in specs.items():
        value = uploads[name]
        if value.numel() != spec.size:
            raise ValueError(f"upload {name!r} has {value.numel()} entries, declared {spec.size}")
        tensors[name] = value.reshape(-1).float()
    return ClientUpdate(run.client_id, run.data.num_samples, tensors, run._summary())


class ClientProgram:
    """The algorithm's client hooks with one round's settings: runs client rounds in the client module.

    Args:
        algorithm: the federated module (its ``client_init`` / ``client_step`` / ``client_final``, its
            client module, declarations and ``seed``).
        round_idx: the round.
        settings: the round's local settings.
        logs: the buffer of the client module's ``self.log`` calls (None: they are dropped).
        prepare: applied to each batch on the device (see :class:`ClientBatches`).
    """

    def __init__(self, algorithm: ClientAlgorithm, round_idx: int, settings: LocalSettings,
                 logs: Optional[LocalLogBuffer] = None, prepare: Optional[Callable[[int, Any], Any]] = None) -> None:
        self.algorithm, self.round, self.settings = algorithm, round_idx, settings
        self.client: pl.LightningModule = algorithm.client
        self.stateless = StatelessClient(self.client)
        self.logs, self.prepare = logs, prepare
        self.device = torch.device(settings.device)
        model = algorithm.global_model
        self.view = ModuleView.of(model.params, model.tensors, settings.precision_plugin())
        self.integer_buffers = [b for b in self.client.buffers() if not b.is_floating_point()]

    def batches(self, client_id: int, data: ClientData) -> ClientBatches:
        """Client ``client_id``'s batches of this round from its training split ``data``."""
        return ClientBatches(data, client_id, self.round, self.algorithm.seed, self.device, self.settings.epochs,
                             self.prepare)

    def run(self, client_id: int, start: Tensor, state: dict[str, Tensor], data: ClientData,
            config: Optional[ClientConfig] = None) -> ClientRoundResult:
        """Client ``client_id``'s round from ``start`` with its ``state`` entries (taken over) on ``data``:
        ``client_init``, ``client_step`` on each batch, ``client_final``, in the client's local-work setting;
        ``config`` (a callback's ``configure_client``) changes its local work and rates from the settings'.
        The client module is left with the client's trained model."""
        algorithm, settings = self.algorithm, self.settings
        batches = self.batches(client_id, data)
        local = ModuleLocal(settings.steps if config is None else config.local_steps,
                            settings.epochs if config is None else config.local_epochs,
                            optimizer=local_optimizer(self.client, settings.lrs))
        if config is not None and config.changes_lr:
            local._configure_lr(config)
        run = ModuleRun(self, self.view, client_id=client_id, round_idx=self.round,
                        layout=algorithm.global_model.layout, start=start, state=state,
                        data=RunData(len(data), data.batch_size, data.eval_batch_size, batches.fetch, batches.epoch),
                        local=local)
        run._restart(start)  # into the module
        with local_setting(self.client, self.logs, algorithm.seed, client_id, ("round", self.round), self.device,
                           True, self.integer_buffers):
            algorithm.client_init(run)
            with torch.no_grad():
                for batch, extra in batches.step_batches(run, algorithm.extra_batch_streams):
                    run.data.extra = extra
                    run._record(algorithm.client_step(run, batch))
                    local.steps_taken += 1
                    local.step_index += 1
            uploads = algorithm.client_final(run)
        return ClientRoundResult(checked_update(type(algorithm).__name__, algorithm.engine.update_specs, run, uploads),
                                 run.state)


def run_client(algorithm: ClientAlgorithm, client_id: int, round_idx: int, start: Tensor, state: Mapping[str, Tensor],
               settings: LocalSettings, data: ClientData, broadcast: Optional[Mapping[str, Tensor]] = None,
               logs: Optional[LocalLogBuffer] = None) -> ClientRoundResult:
    """One client's round, without a Trainer: what the sequential backend runs for each client of a fit.

    Args:
        algorithm: the federated module (a ``FederatedModule``; no Trainer need be attached). Its client
            module is left with the client's trained model.
        client_id: the client.
        round_idx: the round (of the batches' order and the client module's random draws).
        start: the start model, a flat state vector (the round's global model).
        state: the client's declared state entries (``add_client_state``; their defaults where it has none).
        settings: the round's local settings.
        data: the client's training split.
        broadcast: the server state the algorithm declares its clients read (:func:`~fl_lightning.broadcast.
            broadcast_state` of the server's copy), loaded into ``algorithm`` first; None: ``algorithm`` holds it
            already.
        logs: the buffer of the client module's ``self.log`` calls (None: they are dropped).

    Returns:
        The client's uploads, new state entries and metrics.

    Raises:
        ValueError: a lock-step algorithm (its clients wait for the server at every step), or uploads
            other than the declared ones.
    """
    if getattr(algorithm, "lockstep", False):
        raise ValueError(f"{type(algorithm).__name__} moves its clients in lock-step: a client's round needs the "
                         "server's reply at every step, which run_client cannot give")
    device = torch.device(settings.device)
    if algorithm.device != device:
        algorithm.to(device)
    if broadcast is not None:
        load_broadcast(algorithm, broadcast)
    program = ClientProgram(algorithm, round_idx, settings, logs)
    return program.run(client_id, start.to(device), {k: v.to(device) for k, v in state.items()}, data)
