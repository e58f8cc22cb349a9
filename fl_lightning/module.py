"""``FederatedModule``: the one ``LightningModule`` the Trainer sees.

It wraps the user's client ``LightningModule`` unchanged and runs a whole federation inside
one ``Trainer``: a Trainer epoch is a communication round, a training "batch" is a work
item (by default one client's whole local update).

::

    on_train_epoch_start   sample the round's clients from (seed, round); split them over ranks
    training_step(item)    the backend runs the client protocol for the item's client(s):
                           client_init(run) -> client_step(run, batch) x K -> client_final(run)
                           -> a ClientUpdate, passed through the callbacks and kept
    last item of a round   drop non-finite updates -> store the kept clients' state -> aggregate
                           (declared reductions; an Aggregator callback for "aggregator") ->
                           server_update -> LR schedule step -> callbacks.on_round_end

Between rounds the wrapped client module holds the global model, so validation and test run
the client's own ``validation_step``/``test_step`` on the global model.

An algorithm subclasses this, declares what it uploads (:meth:`add_update`) and keeps per
client (:meth:`add_client_state`), and overrides the hooks of the client protocol and the
server. ``docs/engine.md`` lists them with a complete example; each has one meaning:

=====================  =================================================================
``client_init``        prepare a client's round (start model, scratch values, step count)
``client_step``        one local step: the paper's local update rule
``client_final``       the tensors uploaded, and the client's new state entries
``client_share``       lock-step algorithms: the value a client shares at each step
``server_share``       lock-step algorithms: the server's reply to the shared values
``server_update``      how the round's aggregate changes the global model
``client_eval_state``  the model a client is evaluated with (personalized algorithms)
``local_lr_scheduler`` the local learning rate's schedule over rounds
``configure_server_optimizer``  the server optimizer
=====================  =================================================================
"""

from __future__ import annotations

import functools
import inspect
import os
import time
import uuid
import warnings
from contextlib import ExitStack, contextmanager
from typing import Any, Iterator, Literal, Mapping, Optional

import pytorch_lightning as pl
import torch
from lightning_fabric.utilities.apply_func import move_data_to_device
from pytorch_lightning.cli import OptimizerCallable
from pytorch_lightning.strategies import DDPStrategy
from pytorch_lightning.utilities import rank_zero_warn
from torch import Tensor

from fl_lightning.backends import BatchedBackend, ClientBackend, ModuleRun, SequentialBackend
from fl_lightning.backends.functional import FunctionalClient
from fl_lightning.checkpoints import (
    AllowedClasses,
    CheckpointError,
    build_checked,
    check_weights_only,
    check_written_by,
    class_path_of,
    install_safe_io,
    is_plain,
    load_checkpoint,
    resolve_class,
)
from fl_lightning.datamodules.client_data import ClientData, to_device
from fl_lightning.distributed import all_gather_object, all_reduce_sum, rank_and_world
from fl_lightning.hooks import Aggregator, FederatedCallback
from fl_lightning.lightning_compat import (
    attached_trainer,
    batch_norm_layers,
    count_optimizer_step,
    default_map_location,
    raw_optimizer,
    routed_log,
    set_current_hook,
    set_logger_step,
)
from fl_lightning.local_logging import LocalLogBuffer
from fl_lightning.optim.functional import optimizer_lr
from fl_lightning.progress import round_progress_bar
from fl_lightning.run import ClientRun, StepOutput
from fl_lightning.schedules import LocalSchedule
from fl_lightning.seeding import generator, keyed_rng, sample_clients
from fl_lightning.state import ClientStateStore, StateDefault, StateSpec, check_folder
from fl_lightning.update import (
    ClientUpdate,
    LinearReduction,
    Reduction,
    UpdateSpec,
    Weighting,
    all_finite,
    finish_linear,
    linear_sums,
    weighted_reduction,
)
from fl_lightning.validation import check_int, check_number
from fl_lightning.vectors import StateVector

NonFinitePolicy = Literal["skip", "raise"]
BackendName = Literal["sequential", "batched"]


class NonFiniteUpdateError(RuntimeError):
    """A client update contained NaN or Inf and the module was configured to stop."""


def plain_step(run: ClientRun, batch: Any) -> Tensor:
    """The plain local step: the client module's loss, its gradient, one step of its optimizer."""
    loss, grads = run.loss_and_grad(batch)
    run.step(grads)
    return loss


def _drop_log(*args: Any, **kwargs: Any) -> None:
    """Stands in for a client's ``self.log`` during local work inside an evaluation hook."""


class FederatedModule(pl.LightningModule):
    """Runs federated training of ``client`` (plain FedAvg unless a subclass changes the rules).

    Args:
        client: any ``LightningModule``. Its ``training_step`` gives the local loss (its
            ``self.log`` calls keep working), its ``configure_optimizers`` the local optimizer
            (created fresh for each client each round) and, optionally, a learning-rate
            scheduler stepped once per round; its ``validation_step``/``test_step`` the
            metrics of the global model.
        clients_per_round: clients sampled (uniformly, without replacement) each round (10 when
            ``clients_fraction`` is not given). Exclusive with ``clients_fraction``.
        clients_fraction: the share of the training clients sampled each round instead (Flower's
            ``fraction_fit``): ``max(min_clients, int(fraction * training clients))``.
        min_clients: the fewest clients a round samples with ``clients_fraction`` (Flower's
            ``min_fit_clients``).
        local_steps: local optimizer steps per client per round (default ``default_local_steps``,
            10 unless the algorithm's paper says otherwise, when ``local_epochs`` is not given).
            Exclusive with ``local_epochs``.
        local_epochs: passes over the client's training split per round, instead of steps.
        server_lr: learning rate of the default server optimizer (SGD on the pseudo-gradient
            ``-mean(delta)``); 1.0 with no momentum is plain FedAvg.
        server_momentum: momentum of the default server optimizer (FedAvgM).
        server_optimizer: any ``torch.optim`` optimizer class (a callable taking the global
            model's parameters; YAML: ``class_path`` + ``init_args``) in place of SGD, e.g.
            :class:`~fl_lightning.optim.FedAdam`, ``FedYogi``, ``FedAdagrad`` (Reddi et al., 2021).
        nonfinite_updates: what to do with an update holding NaN/Inf: ``"skip"`` excludes it
            from the round and reports it (warning + ``round/excluded`` metric), ``"raise"``
            stops the run. It is never averaged in.
        seed: the seed of client sampling, of every client's batch order and of the client
            module's own random draws during local work.
        client_backend: who runs the clients' local work: ``"sequential"`` (one client after
            another, in the client module; the reference) or ``"batched"`` (blocks of clients
            advance one local step together, vectorized with ``torch.func``; see
            :mod:`fl_lightning.backends.batched` for what it supports).
        clients_per_block: clients per vectorized block of the batched backend (memory grows with it).
        client_state_memory: bytes of per-client state (control variates, personal models) kept
            in RAM; beyond it the least recently written clients' entries are spilled to disk.
        client_state_dir: where client state files go (spilled entries, and every entry a checkpoint
            names; default: ``client_state`` in the run's log folder, or below ``default_root_dir``
            without a logger): each run writes into a folder of its own there, named by a run id
            (runs may share it), and checkpoints name it by its absolute path; with several
            processes, a folder they all reach.
        client_state_checkpoints: how many of the latest checkpoints keep the client-state files they
            name (checkpoints are incremental: they name files in ``client_state_dir``); None keeps
            every file. Raise it (or None) when an older checkpoint (``ModelCheckpoint``'s best)
            must restore client state (resume, personalized evaluation).
        weighting: how the mean aggregate (no ``Aggregator`` callback) weighs the round's clients
            ``S``: ``"num_samples"`` (``sum_i n_i u_i / sum_i n_i``, FedAvg's) or ``"uniform"``
            (``(1/|S|) sum_i u_i``); None (default) takes the paper's, stated in each algorithm's
            docstring (see :attr:`weighting`). Algorithms whose default aggregator is robust pass it on
            (the geometric median's weights).
    """

    #: whether the round's clients move in lock-step: a work item is one local step of all of
    #: this process's clients, with ``client_share``/``server_share`` between them (FedDRO)
    lockstep: bool = False
    #: names of keyed batch streams a local step draws from besides the main one; the step's
    #: batch of each is in ``run.extra_batches``
    extra_batch_streams: tuple[str, ...] = ()
    #: whether the local rule is a function of tensors that the batched backend can vectorize (False
    #: for rules with a torch optimizer of their own or a start model that carries a graph)
    batchable: bool = True
    #: whether the algorithm trains a global model (False for personalized algorithms whose clients'
    #: models come only from ``client_eval_state``: local training alone, a hypernetwork)
    has_global_model: bool = True
    #: ``local_steps`` when neither ``local_steps`` nor ``local_epochs`` is given (an algorithm sets its paper's)
    default_local_steps: int = 10
    #: the mean aggregate's client weights in the algorithm's paper (``weighting=None``; see :attr:`weighting`)
    paper_weighting: Weighting = "num_samples"

    def __init__(
        self,
        client: pl.LightningModule,
        clients_per_round: Optional[int] = None,
        local_steps: Optional[int] = None,
        local_epochs: Optional[int] = None,
        server_lr: float = 1.0,
        server_momentum: float = 0.0,
        server_optimizer: Optional[OptimizerCallable] = None,
        nonfinite_updates: NonFinitePolicy = "skip",
        seed: int = 0,
        clients_fraction: Optional[float] = None,
        min_clients: int = 1,
        client_backend: BackendName = "sequential",
        clients_per_block: int = 10,
        client_state_memory: int = 2**30,
        client_state_dir: Optional[str] = None,
        client_state_checkpoints: Optional[int] = 2,
        weighting: Optional[Weighting] = None,
    ) -> None:
        super().__init__()
        if not isinstance(client, pl.LightningModule):
            raise TypeError(f"client must be a LightningModule, got {type(client).__name__}")
        if local_steps is None and local_epochs is None:
            local_steps = self.default_local_steps
        if clients_per_round is not None and clients_fraction is not None:
            raise ValueError(f"give at most one of clients_per_round and clients_fraction, got clients_per_round="
                             f"{clients_per_round}, clients_fraction={clients_fraction}")
        if clients_fraction is not None:
            check_number("clients_fraction", clients_fraction, 0.0, 1.0, low_open=True, high_open=False)
        elif clients_per_round is None:
            clients_per_round = 10
        if clients_per_round is not None:
            check_int("clients_per_round", clients_per_round, 1)
        check_int("min_clients", min_clients, 1)
        if local_steps is not None and local_epochs is not None:
            raise ValueError(
                f"give exactly one of local_steps and local_epochs, got local_steps={local_steps}, "
                f"local_epochs={local_epochs}"
            )
        for name, value in (("local_steps", local_steps), ("local_epochs", local_epochs)):
            if value is not None:
                check_int(name, value, 1)
        check_number("server_lr", server_lr, 0.0, low_open=True)
        check_number("server_momentum", server_momentum, 0.0, 1.0)
        if nonfinite_updates not in ("skip", "raise"):
            raise ValueError(f"nonfinite_updates must be 'skip' or 'raise', got {nonfinite_updates!r}")
        check_int("seed", seed, 0)
        if client_backend not in ("sequential", "batched"):
            raise ValueError(f"client_backend must be 'sequential' or 'batched', got {client_backend!r}")
        check_int("clients_per_block", clients_per_block, 1)
        if weighting not in (None, "num_samples", "uniform"):
            raise ValueError(f"weighting must be 'num_samples', 'uniform' or None (the paper's), got {weighting!r}")
        # objects (the client, an embedding network, an objective) stay out of the hyperparameters, so
        # that checkpoints hold no pickled object and load with weights_only=True
        self.save_hyperparameters(ignore=["client"])
        objects = [k for k, v in self.hparams.items() if not is_plain(v)]
        if objects:
            self.save_hyperparameters(ignore=["client", *objects])
        self.client = client
        #: clients per round (with ``clients_fraction``: known from ``setup`` on)
        self.clients_per_round: int = clients_per_round if clients_per_round is not None else min_clients
        self.clients_fraction = clients_fraction
        self.min_clients = min_clients
        self.make_server_optimizer = server_optimizer
        self.local_steps = local_steps
        self.local_epochs = local_epochs
        self.server_lr = server_lr
        self.server_momentum = server_momentum
        self.nonfinite_updates = nonfinite_updates
        self.seed = seed
        self.automatic_optimization = False
        check_int("client_state_memory", client_state_memory, 0)
        if client_state_checkpoints is not None:
            check_int("client_state_checkpoints", client_state_checkpoints, 1)
        #: the folder below which the run's client-state folder is made (absolute; None: the run's log folder)
        self.client_state_dir = check_folder("client_state_dir", client_state_dir)
        self.store = ClientStateStore(client_state_memory, None, client_state_checkpoints)
        self.state = StateVector(client)
        #: declared uploads (:meth:`add_update`); FedAvg's model delta unless an algorithm says otherwise
        self.update_specs: dict[str, UpdateSpec] = {}
        #: declared per-client state entries (:meth:`add_client_state`)
        self.state_specs: dict[str, StateSpec] = {}
        self.add_update("delta", self.state.dim)
        #: the aggregator used when the Trainer has no ``Aggregator`` callback; algorithms set their paper's.
        #: None: the mean ``WeightedMean(self.weighting)``, reduced with the other linear uploads
        self.default_aggregator: Optional[Aggregator] = None
        self._weighting = weighting
        self.client_backend = client_backend
        self.backend: ClientBackend = (
            BatchedBackend(clients_per_block) if client_backend == "batched" else SequentialBackend()
        )
        self.functional_client = FunctionalClient(client)
        self.local_schedule = LocalSchedule()
        # the round, as the engine sees it (server side: nothing per client between hooks)
        self.round_start: Optional[Tensor] = None
        self.round_clients: list[int] = []
        #: updates the round kept, over all processes (known from the aggregation on)
        self.round_num_updates = 0
        #: lock-step algorithms: the server's latest ``server_share`` reply (kept across rounds, checkpointed)
        self.shared: Optional[Tensor] = None
        self._work: list[Any] = []
        self._updates: list[ClientUpdate] = []
        self._pending_state: dict[int, Optional[dict[str, Tensor]]] = {}
        self._excluded: list[int] = []
        self._callbacks: list[FederatedCallback] = []
        self._batch_callbacks: list[FederatedCallback] = []  # those that change local batches
        self._integer_buffers: Optional[list[Tensor]] = None  # the client's (BatchNorm counters), per round
        #: the client's ``self.log`` calls of local work, logged once per round
        self.client_logs = LocalLogBuffer()
        self.client_logs.bind(client)

    # ------------------------------------------------------------------ declarations
    def add_update(self, name: str, size: int, reduction: Reduction = "aggregator") -> None:
        """Declare an uploaded tensor: ``client_final`` returns it, flat, of ``size`` entries.

        Args:
            name: the tensor's name in every ``ClientUpdate``.
            size: its number of entries.
            reduction: ``"aggregator"`` (the Trainer's ``Aggregator`` callback: the
                sample-weighted mean by default, a robust rule when one is given),
                ``"weighted_mean"`` (by sample count), ``"mean"`` (uniform over the kept
                updates) or ``"sum"``.
        """
        self.update_specs[name] = UpdateSpec(size, reduction)

    def remove_update(self, name: str) -> None:
        """Undeclare an upload (an algorithm that does not upload FedAvg's ``"delta"``)."""
        if name not in self.update_specs:
            raise ValueError(f"no upload named {name!r}; declared: {sorted(self.update_specs)}")
        del self.update_specs[name]

    def add_client_state(self, name: str, default: StateDefault = None) -> None:
        """Declare a per-client state entry, kept across rounds in the client state store.

        ``run.state[name]`` holds it during the client's round (``default`` before its first
        round; absent if ``default`` is None); its value after ``client_final`` is stored when
        the round keeps the client's update.

        Args:
            name: the entry's name.
            default: a tensor (copied), a function returning one (read when a client needs
                it; a bound method such as :meth:`round_start_model`, so that the module
                pickles for ``fl_ddp_spawn``), or None.
        """
        self.state_specs[name] = StateSpec(default)

    def round_start_model(self) -> Tensor:
        """The global model at the start of the current round (a state default: a client's entry
        starts from the model of the round it first takes part in)."""
        assert self.round_start is not None, "the round has not started"
        return self.round_start

    def aggregated_sizes(self) -> dict[str, int]:
        """The uploads an ``Aggregator`` callback combines (reduction ``"aggregator"``), with their sizes."""
        return {n: s.size for n, s in self.update_specs.items() if s.reduction == "aggregator"}

    def upload_sizes(self) -> dict[str, int]:
        """Every declared upload with its size, in declaration order."""
        return {n: s.size for n, s in self.update_specs.items()}

    # ------------------------------------------------------------------ setup
    def setup(self, stage: str) -> None:
        strategy = self.trainer.strategy
        install_safe_io(strategy)  # checkpoints are read with weights_only=True and clear errors
        # rounds are logged per epoch: Lightning's advice to lower log_every_n_steps does not apply
        warnings.filterwarnings("ignore", message=r"The number of training batches \(\d+\) is smaller than the logging")
        if self.store.directory is None:
            self.store.directory = self._client_state_dir()
        if isinstance(strategy, DDPStrategy) and not getattr(strategy, "is_federated", False):
            raise ValueError(
                f"strategy {type(strategy).__name__} all-reduces the gradients of every local step; "
                "use strategy='fl_ddp' (or 'fl_ddp_spawn'), fl_lightning's DDP strategy for federations"
            )
        cumulative = [name for name, m in batch_norm_layers(self.client) if m.track_running_stats and m.momentum is None]
        if stage == "fit" and cumulative:
            rank_zero_warn(
                f"BatchNorm layer(s) {cumulative[:5]} have momentum=None (a cumulative average weighted by "
                "num_batches_tracked): integer buffers are not federated (local work leaves them at the global model's "
                "value), so these cumulative averages restart in every client's local work; give the layers a momentum "
                "(e.g. 0.1) for running statistics that federate"
            )
        if stage != "fit" and not hasattr(getattr(self.trainer, "datamodule", None), "client_data"):
            return  # validate / test / predict with plain dataloaders: the global model, no federation
        dm = self.datamodule
        if self.clients_fraction is not None and dm.train_clients:
            self.clients_per_round = max(self.min_clients, int(self.clients_fraction * len(dm.train_clients)))
        if stage == "fit" and self.clients_per_round > len(dm.train_clients):
            asked = (f"min_clients={self.min_clients} (with clients_fraction={self.clients_fraction})"
                     if self.clients_fraction is not None else f"clients_per_round={self.clients_per_round}")
            raise ValueError(f"{asked} is above the number of training clients ({len(dm.train_clients)})")
        if self.client_backend == "batched":
            if not self.batchable:
                raise ValueError(
                    f"{type(self).__name__}'s local rule cannot run in the batched client backend (it needs a torch "
                    "optimizer of its own or a start model with a graph); use client_backend='sequential'"
                )
            if self.grad_scaler is not None:
                raise ValueError("precision '16-mixed' scales each optimizer's loss; the batched client backend runs "
                                 "the optimizer as a function: use 'bf16-mixed' or client_backend='sequential'")
        _, world = rank_and_world()
        if stage == "fit" and self.lockstep and self.clients_per_round < world:
            raise ValueError(
                f"{type(self).__name__} moves its clients in lock-step and needs at least one client per process: "
                f"clients_per_round={self.clients_per_round} < {world} processes"
            )

    def _client_state_dir(self) -> str:
        """The run's own folder for client-state files (absolute): a folder named by the run id below
        ``client_state_dir``, by default ``client_state`` in the logger's version folder or, with no
        logger, in ``default_root_dir``. The id is rank 0's start time, process and a random part, the
        same on every process: two runs never share files. Nothing is created until a file is written."""
        trainer = self.trainer
        base = self.client_state_dir
        if base is None:
            logged = trainer.loggers and trainer.log_dir is not None
            base = os.path.join(trainer.log_dir if logged else trainer.default_root_dir, "client_state")
        run = trainer.strategy.broadcast(f"{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}-{uuid.uuid4().hex[:8]}")
        return os.path.abspath(os.path.join(base, run))

    @property
    def datamodule(self) -> Any:
        """The ``FederatedDataModule`` of the run."""
        dm = getattr(self.trainer, "datamodule", None)
        if dm is None or not hasattr(dm, "client_data"):
            raise RuntimeError("a FederatedModule needs a FederatedDataModule: trainer.fit(module, datamodule=...)")
        return dm

    @property
    def hparams_initial(self) -> Any:
        """What the loggers record as the run's hyperparameters (TensorBoard's ``hparams.yaml``):
        the module's, the client module's under ``client`` and the datamodule's under ``data``,
        each as ``class_path`` + ``init_args`` (nested: the names they share, such as ``seed``,
        do not collide; tuples as lists, so that the file reads with ``yaml.safe_load``).
        Checkpoints keep the module's own ``hparams``."""
        hparams = super().hparams_initial
        recipe = client_recipe(self.client)
        hparams["client"] = {"class_path": recipe["class_path"], "init_args": recipe["hparams"]}
        dm = getattr(attached_trainer(self), "datamodule", None)
        if dm is not None:
            data = {k: v for k, v in dict(dm.hparams).items() if not k.startswith("_")}
            hparams["data"] = {"class_path": class_path_of(type(dm)), "init_args": data}
        for key, value in hparams.items():
            hparams[key] = _tuples_as_lists(value)
        return hparams

    def configure_optimizers(self) -> Any:
        """The server optimizer, and the local optimizer's template with its per-round schedule.

        The template is the client's ``configure_optimizers`` optimizer, never stepped: its
        learning rate is the scheduled rate of the current round, which every fresh local
        optimizer starts at. Lightning saves both in checkpoints, and ``LearningRateMonitor``
        reports the client's rate as ``lr-client`` and the server's as ``lr-server`` (it names a
        rate by its scheduler's ``name``: the server's is a constant one, never stepped).
        """
        server = self.configure_server_optimizer()
        template, scheduler = self.local_schedule.build(self.client.configure_optimizers(), self.local_lr_scheduler)
        server_name = torch.optim.lr_scheduler.ConstantLR(server, factor=1.0, total_iters=0)
        return [server, template], [{"scheduler": scheduler, "interval": "epoch", "name": "lr-client"},
                                    {"scheduler": server_name, "interval": "epoch", "name": "lr-server"}]

    def configure_callbacks(self) -> list[pl.Callback]:
        """A progress bar counting rounds and clients in place of the Trainer's (TQDM or Rich)."""
        bar = round_progress_bar(self.trainer.progress_bar_callback)
        return [bar] if bar is not None else []

    def configure_server_optimizer(self) -> torch.optim.Optimizer:
        """The server optimizer over the global model (the pseudo-gradient is ``-delta``):
        ``server_optimizer`` if given, else SGD with ``server_lr`` and ``server_momentum``."""
        if self.make_server_optimizer is not None:
            return self.make_server_optimizer(self.client.parameters())
        return torch.optim.SGD(self.client.parameters(), lr=self.server_lr, momentum=self.server_momentum)

    def local_lr_scheduler(self, optimizer: torch.optim.Optimizer) -> Optional[torch.optim.lr_scheduler.LRScheduler]:
        """The schedule of the local learning rate over rounds, on the template ``optimizer``;
        None (default) keeps the client's own (from its ``configure_optimizers``, if any)."""
        return None

    @property
    def server_optimizer(self) -> torch.optim.Optimizer:
        """The server optimizer (a ``torch.optim`` optimizer)."""
        return raw_optimizer(self.trainer.optimizers[0])

    @property
    def local_lr(self) -> float:
        """The scheduled local learning rate of the current round: the one rate of the parameter
        groups that hold trainable parameters (:func:`~fl_lightning.optim.functional.optimizer_lr`)."""
        return optimizer_lr(self.local_optimizer())

    @property
    def grad_scaler(self) -> Optional[torch.amp.GradScaler]:
        """The precision plugin's loss scaler (``16-mixed``), or None."""
        return getattr(self.trainer.precision_plugin, "scaler", None)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """The global model's forward."""
        return self.client(*args, **kwargs)

    # ----------------------------------------------------------------- round
    def num_work_items(self) -> int:
        """Work items per round on each process (the length of the train loader)."""
        return self.backend.num_work_items(self)

    def sample_round(self, round_idx: int) -> list[int]:
        """The clients of round ``round_idx``, from (seed, round) only."""
        return sample_clients(self.seed, round_idx, list(self.datamodule.train_clients), self.clients_per_round)

    def on_train_epoch_start(self) -> None:
        rank, world = rank_and_world()
        round_idx = self.current_epoch
        self.round_clients = self.sample_round(round_idx)
        self.round_start = self.state.flatten()
        self._updates, self._pending_state, self._excluded = [], {}, []
        self._callbacks = [cb for cb in self.trainer.callbacks if isinstance(cb, FederatedCallback)]
        self._integer_buffers = None  # looked up again once per round (the module may have moved)
        self._batch_callbacks = [cb for cb in self._callbacks
                                 if type(cb).on_local_batch is not FederatedCallback.on_local_batch]
        for cb in self._callbacks:
            cb.on_round_start(self.trainer, self, round_idx, self.round_clients)
        self._work = self.backend.start_round(self, self.round_clients[rank::world])

    def training_step(self, batch: Any, batch_idx: int) -> None:
        if batch_idx < len(self._work):
            self.backend.run_work_item(self, self._work[batch_idx])
        if batch_idx == self.num_work_items() - 1:
            with torch.autocast(self.device.type, enabled=False):
                self.finish_round()

    def receive(self, update: ClientUpdate, state: Optional[dict[str, Tensor]]) -> None:
        """Pass ``update`` through the callbacks and keep it (with the client's new ``state``,
        stored only if the round keeps the update)."""
        for cb in self._callbacks:
            update = cb.on_client_update(self.trainer, self, update)
        self._updates.append(update)
        self._pending_state[update.client_id] = state

    def finish_round(self) -> None:
        """Drop non-finite updates, store the kept clients' state, aggregate, update the server,
        step the local LR schedule, log ``round/excluded`` (updates left out for NaN/Inf),
        ``round/client_loss`` (mean local loss) and the clients' own buffered logs, call
        ``on_round_end``."""
        updates = sorted(self._updates, key=lambda u: u.client_id)
        for cb in self._callbacks:
            updates = cb.on_round_updates(self.trainer, self, updates)
        kept = [u for u in updates if self._is_kept(u)]
        for u in kept:
            for name, value in (self._pending_state.get(u.client_id) or {}).items():
                self.store.set(u.client_id, name, value, version=self.current_epoch)
        self.store.sync()
        aggregate = self.aggregate(kept)
        if aggregate is not None:
            for cb in self._callbacks:
                aggregate = cb.on_aggregate(self.trainer, self, aggregate)
        self.state.load(self.round_start)
        if aggregate is not None:
            self.server_update(aggregate)
            count_optimizer_step(self.optimizers()[0])
        else:
            warnings.warn(f"round {self.current_epoch}: no valid client update; the global model is unchanged")
        self.local_schedule.step()
        set_logger_step(self.trainer, self.current_epoch)  # + this last work item = the rounds done
        losses = [u.metrics["loss"] for u in kept if "loss" in u.metrics]
        parts = all_gather_object((len(self._excluded), losses))
        self.log("round/excluded", float(sum(n for n, _ in parts)), on_step=False, on_epoch=True, batch_size=1)
        losses = [loss for _, part in parts for loss in part]
        if losses:
            self.log("round/client_loss", sum(losses) / len(losses), on_step=False, on_epoch=True, batch_size=1)
        self.client_logs.flush()
        self.log_round_step()
        for cb in self._callbacks:
            cb.on_round_end(self.trainer, self, self.current_epoch, aggregate)
        self._updates, self._pending_state = [], {}

    def _is_kept(self, update: ClientUpdate) -> bool:
        """Whether ``update`` and the client's new state are finite; else exclude it (or raise)."""
        state = self._pending_state.get(update.client_id) or {}
        if update.is_finite() and all_finite(state.values()):
            return True
        message = f"round {self.current_epoch}: the update of client {update.client_id} contains NaN or Inf"
        if self.nonfinite_updates == "raise":
            raise NonFiniteUpdateError(message)
        warnings.warn(message + "; it is excluded from the round", RuntimeWarning, stacklevel=3)
        self._excluded.append(update.client_id)
        return False

    def aggregate(self, updates: list[ClientUpdate]) -> Optional[dict[str, Tensor]]:
        """Combine the round's kept updates (this process's) by their declared reductions.

        The linear reductions (and the ``"aggregator"`` uploads when the aggregator is a mean)
        cost one all-reduce together; other aggregators combine their uploads themselves.
        Returns None when no process kept an update.
        """
        aggregator = self.aggregator
        reduction = self.aggregator_reduction
        linear = {n: (s.size, s.reduction) for n, s in self.update_specs.items() if s.reduction != "aggregator"}
        delegated = self.aggregated_sizes()
        if delegated and reduction is not None:
            linear.update({n: (size, reduction) for n, size in delegated.items()})
            delegated = {}
        sums = all_reduce_sum(linear_sums(updates, linear, self.device))  # type: ignore[arg-type]
        self.round_num_updates = int(sums[-2])
        if self.round_num_updates == 0:
            return None
        out = finish_linear(sums, linear)  # type: ignore[arg-type]
        if delegated:
            assert aggregator is not None  # only a non-linear aggregator leaves uploads delegated
            robust = aggregator.aggregate(self.trainer, self, updates)
            if robust is None:
                return None
            out.update(robust)
        return {name: out[name] for name in self.update_specs}

    @property
    def aggregator(self) -> Optional[Aggregator]:
        """The Trainer's ``Aggregator`` callback, or the algorithm's default (None: the mean with
        :attr:`weighting`, the reduction of ``WeightedMean(self.weighting)``)."""
        found = [cb for cb in self.trainer.callbacks if isinstance(cb, Aggregator)]
        if len(found) > 1:
            raise ValueError(f"give at most one Aggregator callback, got {[type(c).__name__ for c in found]}")
        return found[0] if found else self.default_aggregator

    @property
    def aggregator_reduction(self) -> Optional[LinearReduction]:
        """The linear reduction that combines the ``"aggregator"`` uploads (None: a non-linear
        aggregator combines them)."""
        aggregator = self.aggregator
        return weighted_reduction(self.weighting) if aggregator is None else aggregator.linear_reduction

    @property
    def weighting(self) -> Weighting:
        """How the mean aggregate weighs the round's clients ``S``: ``"num_samples"``
        (``sum_i n_i u_i / sum_i n_i``) or ``"uniform"`` (``(1/|S|) sum_i u_i``).

        The ``weighting`` argument if given, else the paper's: the ``server_optimizer``'s
        ``paper_weighting`` if it declares one (Reddi et al.'s ``FedAdam``, ``FedYogi``,
        ``FedAdagrad``: ``"uniform"``), else the algorithm's :attr:`paper_weighting`.
        """
        if self._weighting is not None:
            return self._weighting
        return self._server_paper_weighting or self.paper_weighting

    @functools.cached_property
    def _server_paper_weighting(self) -> Optional[Weighting]:
        """The ``paper_weighting`` of the ``server_optimizer`` argument's class, if it has one (read
        from one built for the purpose: the argument may be any callable, a YAML one included)."""
        if self.make_server_optimizer is None:
            return None
        return getattr(self.make_server_optimizer(self.client.parameters()), "paper_weighting", None)

    # ------------------------------------------------------------ client protocol
    def client_init(self, run: ClientRun) -> None:
        """Prepare client ``run.client_id``'s round. The run starts from the global model, with
        the client's declared state entries and a fresh local optimizer; override to start
        elsewhere (``run.restart``), set scratch values or change ``run.num_steps``."""

    def client_step(self, run: ClientRun, batch: Any) -> StepOutput:
        """One local step on ``batch``; returns its loss (or named scalars, ``"loss"`` among them).

        Runs under ``torch.no_grad()``: gradients come from ``run.loss_and_grad``. Default:
        the plain step (the client module's loss and its optimizer).
        """
        return plain_step(run, batch)

    def client_final(self, run: ClientRun) -> dict[str, Tensor]:
        """The client's uploads, one flat tensor per declared name; also the place to set the
        client's new ``run.state`` entries. Default: ``{"delta": end - start}``."""
        return {"delta": run.end() - run.start}

    def client_share(self, run: ClientRun, batch: Any) -> Optional[Tensor]:
        """Lock-step algorithms: the value client ``run.client_id`` shares before local step
        ``run.step_index`` on ``batch`` (None: nothing to share at this step). The engine
        averages the round's values, weighted by sample count, over all processes."""
        return None

    def server_share(self, mean: Tensor) -> Tensor:
        """Lock-step algorithms: the server's reply to the mean of the shared values; every
        client reads it as ``run.shared`` in its step. Default: the mean."""
        return mean

    # ------------------------------------------------------------ engine services for backends
    def local_optimizer(self) -> torch.optim.Optimizer:
        """A fresh local optimizer over the client module: the client's ``configure_optimizers``
        optimizer at this round's scheduled learning rate."""
        optimizer = self.local_schedule.split(self.client.configure_optimizers())[0]
        self.local_schedule.apply(optimizer)
        return optimizer

    def load_client_state(self, client_id: int) -> dict[str, Tensor]:
        """Client ``client_id``'s declared state entries, on the device (defaults where absent)."""
        state = {}
        for name, spec in self.state_specs.items():
            value = self.store.get(client_id, name, device=self.device)
            if value is None:
                value = spec.initial()
            if value is not None:
                state[name] = value.to(self.device)
        return state

    def client_update(self, run: ClientRun, uploads: Mapping[str, Tensor]) -> ClientUpdate:
        """The ``ClientUpdate`` of a finished run, after checking its uploads against the declarations."""
        if set(uploads) != set(self.update_specs):
            raise ValueError(
                f"{type(self).__name__}.client_final returned uploads {sorted(uploads)}, "
                f"but the declared uploads are {sorted(self.update_specs)} (see add_update)"
            )
        tensors = {}
        for name, spec in self.update_specs.items():
            value = uploads[name]
            if value.numel() != spec.size:
                raise ValueError(f"upload {name!r} has {value.numel()} entries, declared {spec.size}")
            tensors[name] = value.reshape(-1).float()
        return ClientUpdate(run.client_id, run.num_samples, tensors, run.summary())

    def upload_is_forged(self, client_id: int) -> bool:
        """Whether a callback will replace ``client_id``'s upload without reading it (its local
        work is then skipped: the result is the same, only faster)."""
        return any(cb.forges_upload(self.trainer, self, client_id) for cb in self._callbacks)

    def forged_placeholder(self, client_id: int) -> ClientUpdate:
        """Zeros of the declared shapes, for a client whose upload a callback forges."""
        zeros = {name: torch.zeros(spec.size, device=self.device) for name, spec in self.update_specs.items()}
        return ClientUpdate(client_id, self.datamodule.num_samples(client_id), zeros)

    def prepare_batch(self, client_id: int, batch: Any) -> Any:
        """``batch`` on the device, after the callbacks' ``on_local_batch`` (data poisoning)."""
        batch = to_device(batch, self.device)
        for cb in self._batch_callbacks:
            batch = cb.on_local_batch(self.trainer, self, client_id, batch)
        return batch

    def client_batches(
        self, client_id: int, num_steps: Optional[int], stream: str = "batches", round_idx: Optional[int] = None
    ) -> Iterator[Any]:
        """The client's mini-batches, ready for a step, in an order from ``(seed, stream, round, client)``:
        ``num_steps`` batches, or ``local_epochs`` passes when ``num_steps`` is None."""
        data, g = self._batch_order(client_id, stream, round_idx)
        if num_steps is not None:
            batches = data.step_batches(num_steps, g)
        else:
            assert self.local_epochs is not None
            batches = data.epoch_batches(self.local_epochs, g)
        for batch in batches:
            yield self.prepare_batch(client_id, batch)

    def _batch_order(
        self, client_id: int, stream: str, round_idx: Optional[int]
    ) -> tuple[ClientData, torch.Generator]:
        """The client's train split and the generator of its batch order in ``stream`` this round."""
        data = self.datamodule.client_data(client_id, "train")
        return data, generator(self.seed, stream, self.current_epoch if round_idx is None else round_idx, client_id)

    def client_indices(
        self, client_id: int, num_steps: Optional[int], stream: str = "batches", round_idx: Optional[int] = None
    ) -> Iterator[Tensor]:
        """The dataset indices of :meth:`client_batches`' batches (the same keyed order), for a
        backend that gathers many clients' batches at once (then ``on_local_batch`` callbacks do
        not run: backends use it only when no callback changes local batches)."""
        if num_steps is not None:
            return iter(self.client_step_indices(client_id, num_steps, stream, round_idx))
        data, g = self._batch_order(client_id, stream, round_idx)
        assert self.local_epochs is not None
        return data.epoch_indices(self.local_epochs, g)

    def client_step_indices(
        self, client_id: int, num_steps: int, stream: str = "batches", round_idx: Optional[int] = None
    ) -> Tensor:
        """:meth:`client_indices` of ``num_steps`` steps as one table, ``[num_steps, batch]``."""
        data, g = self._batch_order(client_id, stream, round_idx)
        return data.step_indices(num_steps, g)

    @property
    def overrides_client_init(self) -> bool:
        """Whether the algorithm prepares its clients' rounds (overrides :meth:`client_init`): a
        backend need not set up a client's local work to run the default, which does nothing."""
        return type(self).client_init is not FederatedModule.client_init

    @property
    def changes_local_batches(self) -> bool:
        """Whether a callback of the round changes clients' local batches (``on_local_batch``)."""
        return bool(self._batch_callbacks)

    def step_batches(self, run: ClientRun) -> Iterator[tuple[Any, dict[str, Any]]]:
        """Each local step's batch and the batches of the extra streams, for ``run``."""
        main = iter(run.batches) if run.batches is not None else self.client_batches(run.client_id, run.num_steps)
        extras = {s: self.client_batches(run.client_id, run.num_steps, s) for s in self.extra_batch_streams}
        for batch in main:
            yield batch, {name: next(it) for name, it in extras.items()}

    def note_local_batch(self, batch: Any) -> None:
        """The batch of the current local step (the client's ``self.log`` infers batch sizes from it)."""
        self.client_logs.batch = batch

    @contextmanager
    def local_work(self, client_id: int, *keys: Any) -> Iterator[None]:
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
        training = self.trainer.training
        was_training = self.client.training
        if self._integer_buffers is None or not training:
            self._integer_buffers = [b for b in self.client.buffers() if not b.is_floating_point()]
        counters = [(b, b.clone()) for b in self._integer_buffers]
        with ExitStack() as stack:
            stack.enter_context(keyed_rng(self.seed, "client", client_id, *keys, device=self.device))
            stack.enter_context(routed_log(self.client, self.client_logs.log if training else _drop_log))
            if not training:
                stack.enter_context(torch.inference_mode(False))
                stack.enter_context(torch.enable_grad())
            if not was_training:
                self.client.train()
            try:
                yield
            finally:
                if not was_training:
                    self.client.eval()
                self.client_logs.batch = None
                with torch.no_grad():
                    for buffer, value in counters:
                        buffer.copy_(value)

    def train_locally(
        self,
        client_id: int,
        start: Optional[Tensor] = None,
        steps: Optional[int] = None,
        stream: str = "batches",
        round_idx: Optional[int] = None,
    ) -> Tensor:
        """Plain local training of client ``client_id``, for any algorithm: its module's loss and
        optimizer, from ``start`` (default: the global model); returns the trained state vector.

        This is the one entry point of callbacks' local work (finetuning, fitting an unseen
        client). The client module is left as it was; batches come from
        ``(seed, stream, round_idx, client)`` (``round_idx`` defaults to the current round).
        """
        saved = self.state.flatten()
        round_idx = self.current_epoch if round_idx is None else round_idx
        run = self._plain_run(client_id, saved if start is None else start.to(self.device), round_idx)
        with self.local_work(client_id, stream, round_idx), torch.no_grad():
            for batch in self.client_batches(client_id, steps if steps is not None else self.local_steps, stream, round_idx):
                run.record(plain_step(run, batch))
        end = run.end()
        self.state.load(saved)
        return end

    def _plain_run(self, client_id: int, start: Tensor, round_idx: int) -> ClientRun:
        """A sequential run of ``client_id`` from ``start`` with no state, for plain local work."""
        run = ModuleRun(self, self.local_optimizer(), client_id=client_id, round_idx=round_idx,
                        num_samples=self.datamodule.num_samples(client_id), layout=self.state.layout,
                        start=start, state={}, num_steps=self.local_steps)
        run.restart(start)
        return run

    # ------------------------------------------------------------ server side
    def server_update(self, aggregate: dict[str, Tensor]) -> None:
        """``x <- x - server_lr * momentum(-delta)`` for parameters; buffers take ``x + delta``."""
        delta = aggregate["delta"].to(self.device)
        optimizer = self.server_optimizer
        self.state.set_grads([-d for d in self.state.layout.split_params(delta)])
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if self.state.dim > self.state.num_params:
            new = self.state.flatten()
            new[self.state.num_params :] += delta[self.state.num_params :]
            self.state.load(new)

    # ------------------------------------------------------------ evaluation
    def client_eval_state(self, client_id: int) -> Optional[Tensor]:
        """The state vector client ``client_id`` is evaluated with; None means the global model.

        Personalized algorithms return the client's own model here.
        """
        return None

    def client_accuracy(self, client_id: int, data: Any, personalized: bool = True) -> float:
        """Accuracy on ``data`` (a ``ClientData``) of client ``client_id``'s model
        (:meth:`client_eval_state`), or of the global model if ``personalized`` is False."""
        return self.accuracy_of(self.client_eval_state(client_id) if personalized else None, data)

    @torch.no_grad()
    def accuracy_of(self, state: Optional[Tensor], data: Any) -> float:
        """Accuracy on ``data`` (a ``ClientData``) of the model ``state`` (None: the global model);
        the client module's output is read as logits. The client module is left as it was."""
        saved = self.state.flatten() if state is not None else None
        if state is not None:
            self.state.load(state.to(self.device))
        was_training = self.client.training
        self.client.eval()
        correct = 0
        for x, y in data.epoch_batches(1, batch_size=self.datamodule.eval_batch_size):
            logits = self.client(move_data_to_device(x, self.device))
            correct += int((logits.argmax(-1).cpu() == y).sum())
        self.client.train(was_training)
        if saved is not None:
            self.state.load(saved)
        return correct / max(len(data), 1)

    def validation_step(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> Any:
        return self._client_hook("validation_step", batch, batch_idx)

    def test_step(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> Any:
        return self._client_hook("test_step", batch, batch_idx)

    def predict_step(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> Any:
        """The client's own ``predict_step``; for a client without one, the global model's
        outputs on the inputs: the batch's first element (the datamodule's batches are ``(x, y)``)."""
        if type(self.client).predict_step is not pl.LightningModule.predict_step:
            return self._client_hook("predict_step", batch, batch_idx)
        return self.client(batch[0] if isinstance(batch, (list, tuple)) else batch)

    def on_validation_epoch_start(self) -> None:
        self._client_hook("on_validation_epoch_start")

    def on_validation_epoch_end(self) -> None:
        self._client_hook("on_validation_epoch_end")
        if self.trainer.state.fn == "fit" and not self.trainer.sanity_checking:
            self.log_round_step()

    def log_round_step(self) -> None:
        """Make the number of rounds done the loggers' step for the metrics logged with this
        epoch's (Lightning takes a logged ``step`` as the x-axis): plots read rounds, not work
        items. ``epoch`` (the 0-based index) is kept beside it, as Lightning logs it. Without a
        logger there is no axis to set (and each ``self.log`` costs a fraction of a millisecond)."""
        if not self.trainer.loggers:
            return
        self.log("step", float(self.current_epoch + 1), on_step=False, on_epoch=True, batch_size=1)
        self.log("epoch", float(self.current_epoch), on_step=False, on_epoch=True, batch_size=1)

    def on_test_epoch_start(self) -> None:
        self._client_hook("on_test_epoch_start")

    def on_test_epoch_end(self) -> None:
        self._client_hook("on_test_epoch_end")

    def _client_hook(self, name: str, *args: Any) -> Any:
        set_current_hook(self.client, name)
        return getattr(self.client, name)(*args)

    # ------------------------------------------------------------ checkpoint
    @classmethod
    def load_from_checkpoint(  # type: ignore[override]
        cls, checkpoint_path: Any, map_location: Any = None, hparams_file: Any = None, strict: Optional[bool] = None,
        allowed_classes: AllowedClasses = (), weights_only: Optional[bool] = None, **kwargs: Any,
    ) -> "FederatedModule":
        """The module of a checkpoint this algorithm wrote, read with ``weights_only=True`` (loading runs no code).

        The client module is rebuilt from the class path and hyperparameters the checkpoint
        holds (its weights come from the checkpoint) unless given as ``client=...``; other
        constructor arguments that are objects (an embedding network, an objective) must be given.
        A class the checkpoint names (the client's, a server optimizer's) is built only if it is
        already imported (its module is in ``sys.modules``) or in ``allowed_classes``: loading
        imports no module a file names, since importing runs the module's code.

        Args:
            checkpoint_path, map_location, hparams_file, strict, **kwargs: as Lightning's
                (``hparams_file`` is read as plain YAML).
            allowed_classes: classes the checkpoint may name although they are not imported
                yet: class paths (``"my_package.models.Net"``, imported here) or the classes.
            weights_only: True or None: checkpoints are always read with ``weights_only=True``.

        Raises:
            CheckpointError: the file cannot be used (see :func:`~fl_lightning.checkpoints.load_checkpoint`),
                another algorithm wrote it, or it names a class that is neither imported nor allowed.
        """
        check_weights_only(weights_only)
        allowed_classes = list(allowed_classes)
        checkpoint = load_checkpoint(checkpoint_path, default_map_location(map_location), name="checkpoint_path")
        check_written_by(checkpoint, cls, checkpoint_path)
        if "client" not in kwargs:
            recipe = checkpoint.get("federated", {}).get("client")
            if recipe is None:
                raise CheckpointError(f"{checkpoint_path} holds no client recipe (written before it was saved): "
                                      "pass client=<the client module>")
            kwargs["client"] = build_client(recipe, allowed_classes)
        return build_checked(cls, checkpoint, hparams_file, strict, allowed_classes, **kwargs)

    def fingerprint(self) -> dict[str, Any]:
        """What a checkpoint must match to be resumed by this run."""
        dm = self.datamodule
        return {
            "algorithm": type(self).__qualname__,
            "state_dim": self.state.dim,
            "num_clients": dm.num_clients,
            "partition": dm.partition_hash(),
            "seed": self.seed,
        }

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        checkpoint["federated"] = {
            "store": self.store.state_dict(),
            "fingerprint": self.fingerprint(),
            "shared": None if self.shared is None else self.shared.cpu(),
            "client": client_recipe(self.client),
        }

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Refuse a checkpoint of another configuration (algorithm, model size, clients, data,
        seed) or with non-finite state; warn about every other setting that changed (the run
        uses the new value: a flag the user typed is never ignored)."""
        saved = checkpoint.get("federated")
        if saved is None:
            raise CheckpointError("the checkpoint was not written by a FederatedModule (no 'federated' entry)")
        trainer = attached_trainer(self)
        if trainer is not None and getattr(trainer, "datamodule", None) is not None:
            mine = self.fingerprint()
            diff = {k: (saved["fingerprint"].get(k), v) for k, v in mine.items() if saved["fingerprint"].get(k) != v}
            if diff:
                lines = ", ".join(f"{k}: checkpoint {a!r} vs run {b!r}" for k, (a, b) in diff.items())
                raise CheckpointError(
                    f"the checkpoint comes from another configuration ({lines}); resume it with the configuration "
                    "that wrote it, or start a new run without ckpt_path"
                )
            self._warn_changed_settings(checkpoint, saved)
        if saved.get("shared") is not None and not all_finite([saved["shared"]]):
            raise CheckpointError("the checkpoint holds NaN or Inf in the lock-step shared value; it cannot be resumed")
        store = ClientStateStore(self.store.memory_budget, self.store.directory, self.store.keep_checkpoints)
        resuming = trainer is not None and trainer.state.fn == "fit"
        try:
            # reads (and checks) the entries that fit in RAM; finds the files beside the checkpoint if they moved with it
            store.load_state_dict(saved["store"], checkpoint_path=getattr(trainer, "ckpt_path", None))
        except FileNotFoundError as error:
            if resuming:
                raise CheckpointError(f"the checkpoint's client state cannot be resumed: {error}") from error
            # validate/test/predict and load_from_checkpoint need the global model only
            rank_zero_warn(f"the checkpoint's client state is not loaded ({error}); the global model is")
            store = ClientStateStore(self.store.memory_budget, self.store.directory, self.store.keep_checkpoints)
        except ValueError as error:
            raise CheckpointError(f"the checkpoint's client state cannot be resumed: {error}") from error
        missing = store.missing_files() if resuming else []
        if missing:
            raise CheckpointError(
                f"the checkpoint's client state cannot be resumed: {len(missing)} file(s) it names are missing "
                f"({', '.join(missing[:5])}{', ...' if len(missing) > 5 else ''}); they were removed "
                "(client_state_checkpoints) or moved: put them back, or resume from a later checkpoint")
        self.store = store
        shared = saved.get("shared")
        self.shared = None if shared is None else shared.to(self.device)

    def _warn_changed_settings(self, checkpoint: dict[str, Any], saved: dict[str, Any]) -> None:
        """Warn about hyperparameters of the module, the client and the data that differ from the checkpoint's."""
        changes = []
        groups = [
            ("model", checkpoint.get("hyper_parameters", {}), dict(self.hparams)),
            ("client", saved.get("client", {}).get("hparams", {}), client_recipe(self.client)["hparams"]),
            ("data", checkpoint.get("datamodule_hyper_parameters", {}), dict(getattr(self.datamodule, "hparams", {}))),
        ]
        for group, before, now in groups:
            for key in sorted(set(before) | set(now)):
                if key.startswith("_") or before.get(key) == now.get(key):
                    continue
                changes.append(f"{group}.{key}: checkpoint {before.get(key)!r}, now {now.get(key)!r}")
        before_class = saved.get("client", {}).get("class_path")
        if before_class is not None and before_class != client_recipe(self.client)["class_path"]:
            changes.append(f"client class: checkpoint {before_class}, now {client_recipe(self.client)['class_path']}")
        if changes:
            warnings.warn("resuming with changed settings; the run uses the new values: " + "; ".join(changes),
                          UserWarning, stacklevel=2)


def build_client(recipe: dict[str, Any], allowed_classes: AllowedClasses = ()) -> pl.LightningModule:
    """A client module from :func:`client_recipe`'s output: its class (which must be a
    ``LightningModule``) called with the hyperparameters its constructor takes.

    The class must be already imported (its module in ``sys.modules``) or in ``allowed_classes``
    (class paths, imported here, or classes): the checkpoint names it, and importing a module a
    file names would run that module's code. Import the client's module before loading, allow
    it, or pass ``client=``.
    """
    path = recipe["class_path"]
    try:
        cls = resolve_class(path, pl.LightningModule, allowed_classes, "checkpoint's client class")
    except CheckpointError as error:
        raise CheckpointError(f"{error}; or pass client=<the client module>") from error
    parameters = inspect.signature(cls.__init__).parameters
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values())
    arguments = {k: v for k, v in recipe["hparams"].items() if takes_any or k in parameters}
    try:
        return cls(**arguments)
    except TypeError as error:
        raise CheckpointError(
            f"the client class {path} cannot be rebuilt from the hyperparameters the checkpoint holds ({arguments}): "
            f"{error}; call self.save_hyperparameters() in its __init__, or pass client=<the client module>"
        ) from error


def client_recipe(client: pl.LightningModule) -> dict[str, Any]:
    """The client module's class path and its plain hyperparameters (what rebuilds it)."""
    hparams = {k: v for k, v in dict(getattr(client, "hparams", {})).items() if is_plain(v) and not k.startswith("_")}
    return {"class_path": class_path_of(type(client)), "hparams": hparams}


def _tuples_as_lists(value: Any) -> Any:
    """``value`` with every tuple inside it (dict values, list items) turned into a list."""
    if isinstance(value, dict):
        return {k: _tuples_as_lists(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_tuples_as_lists(v) for v in value]
    return value
