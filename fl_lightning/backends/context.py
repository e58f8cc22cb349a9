"""``ClientContext``: everything a client backend may use from the engine.

A backend (:mod:`fl_lightning.backends.base`) runs the client protocol of the algorithm for this
process's clients of a round. It reads nothing of the federated module directly: it asks the
context for a client's run (:meth:`ClientContext.new_run`, the one place a run is built), its
batches (the engine's keyed streams, as batches or as dataset indices), the setting of its local
work (:meth:`ClientContext.local_work`), and the result of a finished run
(:meth:`ClientContext.result`), which the backend returns. The context, in turn, reads the module through
:class:`Algorithm`, the declared list of what it needs of it.

FedJAX's ``for_each_client`` takes the client functions and the data; this object is the same
seam for a ``LightningModule``: the client module runs in its own precision context, its
``self.log`` calls are buffered, its random draws keyed by client.
"""

from __future__ import annotations

from functools import cached_property, partial
from typing import Any, Callable, ClassVar, ContextManager, Iterator, Mapping, Optional, Protocol, TypeVar, cast

import torch
from torch import Tensor

from fl_lightning.backends.client_round import (ClientBatches, ClientProgram, ClientRoundResult, LocalSettings,
                                                ModuleView, checked_update, local_setting)
from fl_lightning.backends.stateless import StatelessClient
from fl_lightning.client_config import ClientConfig
from fl_lightning.client_store import ClientStateStore, StateSpec
from fl_lightning.datamodules.client_data import ClientData, gather, to_device
from fl_lightning.hooks import FederatedCallback, Federation
from fl_lightning.lightning_package import pl
from fl_lightning.local_logging import LocalLogBuffer
from fl_lightning.paper import PaperDefaults
from fl_lightning.run import ClientRun, LocalWork, RunData, StepOutput, is_default_hook
from fl_lightning.seeding import generator
from fl_lightning.update import ClientUpdate, UpdateSpec
from fl_lightning.vectors import ModelVector

RunT = TypeVar("RunT", bound=ClientRun)


class Engine(Protocol):
    """What the client context and the backends read of the federation's engine
    (:class:`~fl_lightning.engine.FederationEngine` satisfies it)."""

    #: the declared uploads and per-client state entries
    update_specs: dict[str, UpdateSpec]
    state_specs: dict[str, StateSpec]
    #: the client state store
    store: ClientStateStore
    #: the global model at the start of the current round, and the round's clients
    round_start: Optional[Tensor]
    round_clients: list[int]

    @property
    def datamodule(self) -> Any:
        """The federation's datamodule (``FederatedDataModule``)."""

    def local_optimizer(self) -> torch.optim.Optimizer:
        """A fresh local optimizer at the round's scheduled rate."""

    def client_bytes(self) -> int:
        """About what one client's run holds in memory."""


class Algorithm(Federation, Protocol):
    """What the client context reads of the federated module (``FederatedModule`` satisfies it):
    the client protocol's hooks and declarations, and the run's settings."""

    #: names of the keyed batch streams a local step draws from besides the main one
    extra_batch_streams: tuple[str, ...]
    #: False: the batched backend refuses the algorithm (see ``FederatedModule.batchable``)
    batchable: bool
    #: local steps per round (None: ``local_epochs`` passes)
    local_steps: Optional[int]
    local_epochs: Optional[int]
    #: the settings the algorithm's paper fixes (its fewest local steps)
    paper: PaperDefaults

    @property
    def trainer(self) -> pl.Trainer:
        """The Trainer running the federation (its precision plugin, whether it is training)."""

    def local_optimizer(self) -> torch.optim.Optimizer: ...

    def client_init(self, run: ClientRun) -> None: ...

    def client_step(self, run: ClientRun, batch: Any) -> StepOutput: ...

    def client_final(self, run: ClientRun) -> dict[str, Tensor]: ...


class LockstepAlgorithm(Algorithm, Protocol):
    """An algorithm whose clients move in lock-step (:class:`~fl_lightning.lockstep.LockstepModule`)."""

    lockstep: ClassVar[bool]
    #: the server's latest reply to the shared values
    shared: Optional[Tensor]

    def client_share(self, run: ClientRun, batch: Any) -> Optional[Tensor]: ...

    def server_share(self, mean: Tensor) -> Tensor: ...


class ClientContext:
    """The engine's services for local work of ``algorithm``'s clients.

    Args:
        algorithm: the federated module.
        engine: its engine.
    """

    def __init__(self, algorithm: Algorithm, engine: Engine) -> None:
        self.algorithm = algorithm
        self.engine = engine
        #: the client module (it holds the global model between rounds)
        self.client: pl.LightningModule = algorithm.client
        #: the client module as a function of its tensors
        self.stateless = StatelessClient(algorithm.client)
        #: the client's ``self.log`` calls of local work, logged once per round
        self.logs = LocalLogBuffer()
        self.logs.bind(algorithm.client)
        #: whether the round's clients move in lock-step (``client_share``/``server_share`` between steps)
        self.lockstep: bool = bool(getattr(algorithm, "lockstep", False))
        self._callbacks: list[FederatedCallback] = []
        self._batch_callbacks: list[FederatedCallback] = []
        self._config_callbacks: list[FederatedCallback] = []
        #: the round's configuration of each client asked for (:meth:`client_config`), and the module's
        self._configs: dict[int, ClientConfig] = {}
        self._module_config: Optional[ClientConfig] = None
        self._integer_buffers: Optional[list[Tensor]] = None

    # ------------------------------------------------------------ the round
    def start_round(self, callbacks: list[FederatedCallback]) -> None:
        """Take the round's federated callbacks (those that forge uploads, change local batches or
        configure clients)."""
        self._callbacks = callbacks
        self._batch_callbacks = [cb for cb in callbacks
                                 if type(cb).on_local_batch is not FederatedCallback.on_local_batch]
        self._config_callbacks = [cb for cb in callbacks
                                  if type(cb).configure_client is not FederatedCallback.configure_client]
        self._configs, self._module_config = {}, None
        self._integer_buffers = None  # looked up again once per round (the module may have moved)

    # ------------------------------------------------------------ the clients' configuration
    def client_config(self, client_id: int) -> ClientConfig:
        """Client ``client_id``'s configuration of the round: the module's (its ``local_steps`` or
        ``local_epochs`` as they are once the round started, the scheduled learning rate) as the round's
        callbacks change it in ``configure_client``, in their order; asked once per client and round.

        Raises:
            ValueError: a configuration that counts local work in another unit than the module, takes
                fewer steps than the algorithm does, or changes the work of a lock-step algorithm
                (whose clients all take the round's steps together).
        """
        if self._module_config is None:
            self._module_config = ClientConfig(self.algorithm.local_steps, self.algorithm.local_epochs)
        if not self._config_callbacks:
            return self._module_config
        config = self._configs.get(client_id)
        if config is not None:
            return config
        config = self._module_config
        for cb in self._config_callbacks:
            config = cb.configure_client(self.trainer, self.algorithm, self.round, client_id, config)
            if not isinstance(config, ClientConfig):
                raise TypeError(f"{type(cb).__name__}.configure_client must return a ClientConfig "
                                f"(config.replace(...)), got {type(config).__name__}")
        self._check_config(client_id, config)
        self._configs[client_id] = config
        return config

    def _check_config(self, client_id: int, config: ClientConfig) -> None:
        """Refuse ``config`` of ``client_id`` where the algorithm cannot run it (see :meth:`client_config`)."""
        name, module = type(self.algorithm).__name__, self._module_config
        assert module is not None
        given = f"round {self.round}: client {client_id}'s configuration (configure_client) gives"
        if config.unit != module.unit:
            raise ValueError(f"{given} {config.unit}={config.work}, and {name} counts local work in {module.unit} "
                             f"({module.unit}={module.work}): configure {module.unit}")
        if config.local_steps is not None and config.local_steps < self.algorithm.paper.min_local_steps:
            raise ValueError(f"{given} local_steps={config.local_steps}; {name} takes at least "
                             f"{self.algorithm.paper.min_local_steps} local steps")
        if self.lockstep and (config.work != module.work or config.drop):
            change = "drop=True" if config.drop else f"{config.unit}={config.work}"
            raise ValueError(f"{given} {change}, and {name} moves its clients in lock-step: every client takes the "
                             f"round's {module.unit}={module.work}; leave its clients' local work as the module's")

    def round_config(self, client_id: int) -> Optional[ClientConfig]:
        """Client ``client_id``'s configuration of the round (:meth:`client_config`), or None where no callback
        configures clients: every run then has the module's settings, and nothing is asked."""
        return self.client_config(client_id) if self._config_callbacks else None

    def taking_part(self, clients: list[int]) -> list[int]:
        """``clients`` (this process's clients of the round) but those their configuration drops from the
        round (``ClientConfig.drop``): they do no local work and send nothing."""
        if not self._config_callbacks:
            return clients
        return [c for c in clients if not self.client_config(c).drop]

    # ------------------------------------------------------------ the client hooks that are the defaults
    # (said by the hooks, :func:`~fl_lightning.run.default_hook`; read once the algorithm is built, at the
    # setup of its first fit: an algorithm may take a default in its constructor)
    @cached_property
    def prepares_rounds(self) -> bool:
        """Whether ``client_init`` is the algorithm's own: a backend need not set up a client's local
        work to run the default, which does nothing."""
        return not is_default_hook(self.algorithm.client_init)

    @cached_property
    def plain_steps(self) -> bool:
        """Whether ``client_step`` is the default, the plain step (the client's loss and optimizer:
        ``plain_step``), which the batched backend takes with the gradient outside ``vmap``."""
        return is_default_hook(self.algorithm.client_step)

    @cached_property
    def finalizes_rounds(self) -> bool:
        """Whether ``client_final`` is the algorithm's own: the default, ``end - start``, needs no
        local-work setting (no draw, no log, no forward), and a block computes it at once."""
        return not is_default_hook(self.algorithm.client_final)

    @property
    def round(self) -> int:
        return self.algorithm.current_epoch

    @property
    def device(self) -> torch.device:
        return self.algorithm.device

    @property
    def global_model(self) -> ModelVector:
        """The client module's tensors as one vector (the global model between rounds)."""
        return self.algorithm.global_model

    @property
    def trainer(self) -> pl.Trainer:
        return self.algorithm.trainer

    @property
    def forward_context(self) -> Callable[[], Any]:
        """The precision plugin's forward context (autocast of ``bf16-mixed``)."""
        return self.trainer.precision_plugin.forward_context

    @property
    def grad_scaler(self) -> Optional[torch.amp.GradScaler]:
        """The precision plugin's loss scaler (``16-mixed``), or None."""
        return getattr(self.trainer.precision_plugin, "scaler", None)

    def lockstep_algorithm(self) -> LockstepAlgorithm:
        """The module as a lock-step algorithm (for the lock-step driver)."""
        assert self.lockstep, "the algorithm does not move its clients in lock-step"
        return cast(LockstepAlgorithm, self.algorithm)

    # ------------------------------------------------------------ runs
    def load_client_state(self, client_id: int) -> dict[str, Tensor]:
        """Client ``client_id``'s declared state entries, on the device (defaults where absent)."""
        state = {}
        for name, spec in self.engine.state_specs.items():
            value = self.engine.store.get(client_id, name, device=self.device)
            if value is None:
                value = spec.initial()
            if value is not None:
                state[name] = value.to(self.device)
        return state

    def new_run(self, run_class: type[RunT], client_id: int, local: Callable[..., LocalWork], *args: Any,
                batches: Optional[ClientBatches] = None, start: Optional[Tensor] = None, plain: bool = False,
                round_idx: Optional[int] = None) -> RunT:
        """A ``run_class`` run of ``client_id`` (its backend's ``*args`` first), its local work
        ``local(num_steps, epochs, shared)``, reading the client's split from ``batches`` (default: through
        this context), from ``start`` (default: the round's global model) and, unless ``plain`` (plain local
        work, outside the algorithm, with the module's steps), with the client's configuration of the round
        (its local work and learning rate: :meth:`client_config`), its declared state entries and the
        lock-step value."""
        algorithm = self.algorithm
        if start is None:
            assert self.engine.round_start is not None, "the round has not started"
            start = self.engine.round_start
        config = None if plain else self.round_config(client_id)
        work = local(algorithm.local_steps if config is None else config.local_steps,
                     algorithm.local_epochs if config is None else config.local_epochs,
                     self.lockstep_algorithm().shared if self.lockstep and not plain else None)
        if config is not None and config.changes_lr:
            work._configure_lr(config)
        dm = self.engine.datamodule
        fetch, epoch = ((batches.fetch, batches.epoch) if batches is not None
                        else (partial(self.fetch, client_id), partial(self.epoch, client_id)))
        return run_class(
            *args,
            client_id=client_id,
            round_idx=self.round if round_idx is None else round_idx,
            layout=self.global_model.layout,
            start=start,
            state={} if plain else self.load_client_state(client_id),
            data=RunData(dm.num_samples(client_id), dm.batch_size, dm.eval_batch_size, fetch, epoch),
            local=work,
        )

    def result(self, run: ClientRun, uploads: Mapping[str, Tensor]) -> ClientRoundResult:
        """A finished run's result: its uploads (checked against the declarations), sample count, metrics and
        new state."""
        update = checked_update(type(self.algorithm).__name__, self.engine.update_specs, run, uploads)
        return ClientRoundResult(update, run.state)

    def is_forged(self, client_id: int) -> bool:
        """Whether a callback will replace ``client_id``'s upload without reading it (its local
        work is then skipped: the result is the same, only faster)."""
        return any(cb.forges_upload(self.trainer, self.algorithm, client_id) for cb in self._callbacks)

    def forged_result(self, client_id: int) -> ClientRoundResult:
        """The result of ``client_id``, whose upload a callback forges: zeros of the declared shapes, no new state."""
        specs = self.engine.update_specs
        zeros = {name: torch.zeros(spec.size, device=self.device) for name, spec in specs.items()}
        return ClientRoundResult(ClientUpdate(client_id, self.engine.datamodule.num_samples(client_id), zeros),
                                 {})

    # ------------------------------------------------------------ batches
    @property
    def changes_local_batches(self) -> bool:
        """Whether a callback of the round changes clients' local batches (``on_local_batch``): then
        batches must be real ones, each passed through the callbacks."""
        return bool(self._batch_callbacks)

    def client_data(self, client_id: int) -> ClientData:
        """The client's training split."""
        return self.engine.datamodule.client_data(client_id, "train")

    def _on_local_batch(self, client_id: int, batch: Any) -> Any:
        """``batch`` after the callbacks' ``on_local_batch`` (data poisoning)."""
        for cb in self._batch_callbacks:
            batch = cb.on_local_batch(self.trainer, self.algorithm, client_id, batch)
        return batch

    def client_batches(self, client_id: int, round_idx: Optional[int] = None) -> ClientBatches:
        """The client's batches of this round (or ``round_idx``), passed through the callbacks' ``on_local_batch``."""
        return ClientBatches(self.client_data(client_id), client_id, self.round if round_idx is None else round_idx,
                             self.algorithm.seed, self.device, self.algorithm.local_epochs,
                             self._on_local_batch if self._batch_callbacks else None)

    def client_program(self) -> ClientProgram:
        """The round's client program: the algorithm's client hooks with the round's local settings (the
        Trainer's precision plugin, the scheduled learning rates), its clients' logs buffered, their batches
        passed through the callbacks' ``on_local_batch``."""
        algorithm = self.algorithm
        lrs = [group["lr"] for group in self.engine.local_optimizer().param_groups]
        settings = LocalSettings(algorithm.local_steps, algorithm.local_epochs, lrs, self.trainer.precision_plugin,
                                 self.device)
        return ClientProgram(algorithm, self.round, settings, self.logs,
                             self._on_local_batch if self._batch_callbacks else None)

    def module_view(self) -> ModuleView:
        """The client module's tensors and the Trainer's precision context, for a round's runs."""
        model = self.global_model
        return ModuleView.of(model.params, model.tensors, self.trainer.precision_plugin)

    def batch_order(self, client_id: int, stream: str = "batches", round_idx: Optional[int] = None) -> torch.Generator:
        """The generator of the client's batch order in ``stream`` this round (or ``round_idx``)."""
        return generator(self.algorithm.seed, stream, self.round if round_idx is None else round_idx, client_id)

    def batches(self, client_id: int, num_steps: Optional[int], stream: str = "batches",
                round_idx: Optional[int] = None, epochs: Optional[int] = None) -> Iterator[Any]:
        """The client's mini-batches, ready for a step, in an order from ``(seed, stream, round, client)``:
        ``num_steps`` batches, or when ``num_steps`` is None ``epochs`` passes (default: the module's
        ``local_epochs``). On a CUDA device, batches gathered on the host (a pool kept there) are copied
        from pinned memory one step ahead, while the previous step runs; batches of a pool on the
        device need no copy."""
        return self.client_batches(client_id).batches(num_steps, stream, round_idx, epochs)

    def epoch_indices(self, client_id: int, epochs: int, stream: str = "batches") -> Iterator[Tensor]:
        """The dataset indices of the batches of the client's ``epochs`` passes (:meth:`batches`' order),
        for a backend that gathers many clients' batches at once."""
        return self.client_data(client_id).epoch_indices(epochs, self.batch_order(client_id, stream))

    def index_table(self, client_id: int, num_steps: int, stream: str = "batches") -> Tensor:
        """The dataset indices of :meth:`batches`' ``num_steps`` batches as one table, ``[num_steps, batch]``."""
        return self.client_data(client_id).step_indices(num_steps, self.batch_order(client_id, stream))

    def fetch(self, client_id: int, positions: Tensor) -> Any:
        """The client's training samples at ``positions`` as one batch, ready for a step."""
        return self.client_batches(client_id).fetch(positions)

    def epoch(self, client_id: int, batch_size: int) -> Iterator[Any]:
        """One pass over the client's training split in index order, in batches ready for a step."""
        return self.client_batches(client_id).epoch(batch_size)

    def gather(self, indices: Tensor) -> Any:
        """The samples of the dataset pool at ``indices`` (any shape, e.g. ``[clients, batch]``), on the
        device (one gather there when the pool and the indices are: ``FederatedDataModule.place_pool``)."""
        return to_device(gather(self.engine.datamodule.pool, indices), self.device)

    def step_batches(self, run: ClientRun) -> Iterator[tuple[Any, dict[str, Any]]]:
        """Each local step's batch and the batches of the extra streams, for ``run``."""
        return self.client_batches(run.client_id).step_batches(run, self.algorithm.extra_batch_streams)

    # ------------------------------------------------------------ the setting of local work
    def local_work(self, client_id: int, *keys: Any) -> ContextManager[Callable[..., None]]:
        """The setting of local work of ``client_id``.

        The global torch RNG is forked and seeded from ``(seed, "client", client, *keys)``, so the
        client module's own draws (Dropout, augmentation) do not depend on the process, the
        client order or a resume. The client module is in train mode. In training, its
        ``self.log`` calls are buffered and logged once per round as their batch-size-weighted
        mean (:mod:`fl_lightning.local_logging`); in an evaluation hook (finetuning, fitting an
        unseen client) gradients are enabled, inference mode is left, and the client's
        ``self.log`` calls are dropped: they would land in the evaluation's results. Integer
        buffers (BatchNorm's ``num_batches_tracked``) are not federated state: local work leaves
        them at the global model's values, whatever the backend.
        """
        return self._setting(client_id, keys, seeded=True)

    def local_steps(self, client_id: int, *keys: Any) -> ContextManager[Callable[..., None]]:
        """:meth:`local_work` entered once for consecutive pieces of local work (a block's steps):
        the block receives ``reseed(*more)``, after which the global RNG draws what it would in a
        ``local_work(client_id, *keys, *more)`` of its own. The rest of the setting (train mode, the
        routed ``self.log``, the integer buffers' values) holds through the block, set up once: a
        block of small clients' steps costs its launch, not the setting's."""
        return self._setting(client_id, keys, seeded=False)

    def _setting(self, client_id: int, keys: tuple[Any, ...], seeded: bool) -> ContextManager[Callable[..., None]]:
        """:meth:`local_work`'s setting (the RNG seeded from ``keys`` already with ``seeded``), which
        yields :meth:`local_steps`' ``reseed`` (:func:`~fl_lightning.backends.client_round.local_setting`)."""
        training = self.trainer.training
        if self._integer_buffers is None or not training:
            self._integer_buffers = [b for b in self.client.buffers() if not b.is_floating_point()]
        return local_setting(self.client, self.logs, self.algorithm.seed, client_id, keys, self.device, training,
                             self._integer_buffers, seeded)

