"""``FederatedModule``: the one ``LightningModule`` the Trainer sees.

It wraps the user's client ``LightningModule`` unchanged and runs a whole federation inside
one ``Trainer``: a Trainer epoch is a communication round, a training "batch" is a work
item (by default one client's whole local update; see :mod:`fl_lightning.backends`).

::

    on_train_epoch_start   sample the round's clients from (seed, round); split them over ranks; leave
                           out those their configuration drops (callbacks' configure_client)
    training_step(item)    the backend runs the client protocol for the item's client(s):
                           client_init(run) -> client_step(run, batch) x K -> client_final(run)
                           -> a ClientUpdate, passed through the callbacks and kept
    last item of a round   drop non-finite updates -> aggregate (declared reductions; an Aggregator
                           callback for "aggregator") -> server_update -> check the result: a
                           non-finite one is refused (the server's state put back), a finite one
                           taken (the kept clients' state stored) -> LR schedule step ->
                           callbacks.on_round_end

Between rounds the wrapped client module holds the global model, so validation and test run
the client's own ``validation_step``/``test_step`` on the global model.

An algorithm subclasses this, declares what it uploads (:meth:`add_update`) and keeps per
client (:meth:`add_client_state`) and overrides the hooks: ``docs/engine.md`` has an example.
"""

from __future__ import annotations

import copy
import functools
import warnings
from typing import Any, Literal, Optional, Sequence

import torch
from torch import Tensor

from fl_lightning.aggregation import aggregate, find_aggregator
from fl_lightning.backends import BACKENDS, BatchedBackend, ClientBackend, ClientContext
from fl_lightning.backends.context import overrides_default
from fl_lightning.broadcast import broadcast_state, check_broadcast_name
from fl_lightning.checkpoints import is_plain
from fl_lightning.client_store import ClientStateStore, StateDefault, StateSpec, check_folder, run_folder
from fl_lightning.cpu_threads import FitThreads
from fl_lightning.data_check import check_classes, check_client_takes_data
from fl_lightning.distributed import all_gather_object, rank_and_world
from fl_lightning.hooks import Aggregator, FederatedCallback, default_callbacks
from fl_lightning.lightning_compat import (attached_trainer, count_optimizer_step, light_result_moves, log_agreed,
                                          raw_optimizer, set_logger_step)
from fl_lightning.evaluation import ClientEvaluation
from fl_lightning.lightning_package import OptimizerCallable, attach_trainer, is_lightning_module, pl
from fl_lightning.module_checkpoint import FederatedCheckpointing, logged_hparams
from fl_lightning.optim.param_groups import optimizer_lr
from fl_lightning.optim.server import check_server_optimizer
from fl_lightning.progress import round_progress_bar
from fl_lightning.run import ClientRun, StepOutput, plain_step
from fl_lightning.schedules import (
    LocalSchedule, check_lr_drops, epochs_per_round, lr_drop_scheduler, split_optimizer_config,
)
from fl_lightning.seeding import sample_clients
from fl_lightning.server_state import (copy_optimizer_state, copy_tensors, load_optimizer_state, load_tensors,
                                       own_tensors)
from fl_lightning.trainer_setup import prepare_trainer
from fl_lightning.update import (
    ClientUpdate, LinearReduction, Reduction, UpdateSpec, Weighting, finite_flags, read_metrics,
    weighted_reduction,
)
from fl_lightning.validation import check_federation_arguments
from fl_lightning.vectors import ModelVector

NonFinitePolicy = Literal["skip", "raise"]
BackendName = Literal["sequential", "batched"]


class NonFiniteUpdateError(RuntimeError):
    """A client update, or a round's result (its aggregate, the new global model or server state),
    contained NaN or Inf and the module was configured to stop (``nonfinite_updates="raise"``)."""


class FederatedModule(ClientEvaluation, FederatedCheckpointing):
    """Runs federated training of ``client`` (plain FedAvg unless a subclass changes the rules).

    Args:
        client: any ``LightningModule``, of ``pytorch_lightning`` or of the unified ``lightning``
            package (``lightning.pytorch``), whichever of the two this module is built on
            (:mod:`fl_lightning.lightning_package`). Its ``training_step`` gives the local loss (its
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
            Exclusive with ``local_epochs``. A callback may change a client's steps (and rate) for a
            round: :meth:`~fl_lightning.hooks.FederatedCallback.configure_client`.
        local_epochs: passes over the client's training split per round, instead of steps.
        server_lr: learning rate of the default server optimizer (SGD on the pseudo-gradient
            ``-mean(delta)``); 1.0 with no momentum is plain FedAvg.
        server_momentum: momentum of the default server optimizer (FedAvgM).
        server_optimizer: any ``torch.optim`` optimizer class (a callable taking the global
            model's parameters; YAML: ``class_path`` + ``init_args``) in place of SGD, e.g.
            :class:`~fl_lightning.optim.FedAdam`, ``FedYogi``, ``FedAdagrad`` (Reddi et al., 2021).
        nonfinite_updates: what to do with an update holding NaN/Inf: ``"skip"`` excludes it
            from the round and reports it (warning + ``round/excluded`` metric), ``"raise"``
            stops the run. It is never averaged in. Finite updates can still combine into a
            result that is not (a sum that overflows): such a round is refused as a whole, the
            server left as it was before it (warning + ``round/refused`` metric; see
            :meth:`finish_round`), or, with ``"raise"``, the run stops in that round.
        seed: the seed of client sampling, of every client's batch order and of the client
            module's own random draws during local work.
        client_backend: who runs the clients' local work: ``"sequential"`` (one client after
            another, in the client module; the reference) or ``"batched"`` (blocks of clients
            advance one local step together, vectorized with ``torch.func``; see
            :mod:`fl_lightning.backends.batched` for what it supports).
        clients_per_block: the clients of one work item (one Trainer batch). Batched backend: the
            clients of a vectorized block (memory grows with it); None: the round's clients (each
            process's share) in one block, as far as a quarter of the device's free memory holds
            their runs (four copies of the model each, plus state entries, uploads and the
            activations of a local step, counted at setup); a block that runs out of memory all the
            same steps again in halves; a number bounds it yourself. Sequential backend: clients run
            one after another in one work item; None: one (a Trainer batch per client); more pays
            Lightning's loop around a batch once per block, with the same results.
        compile_step: the batched backend captures its vectorized local step with ``torch.compile``
            (compiled once per step structure, then reused: several times faster for small models,
            on the CPU and on a GPU; see :class:`~fl_lightning.backends.BatchedBackend`).
        client_state_memory: bytes of per-client state (control variates, personal models) kept
            in RAM; beyond it the least recently written clients' entries are spilled to disk.
        client_state_dir: where client state files go (spilled entries, and every entry a checkpoint
            names; default: ``client_state`` in the run's log folder, or below ``default_root_dir``
            without a logger): each run writes into a folder of its own there, named by a run id
            (runs may share it), and checkpoints name it by its absolute path; with several
            processes, a folder they all reach.
        client_state_checkpoints: how many of the latest checkpoints keep the client-state files they
            name (checkpoints are incremental: they name files in ``client_state_dir``); None keeps
            every checkpoint's. Raise it (or None) when an older checkpoint (``ModelCheckpoint``'s
            best) must restore client state (resume, personalized evaluation). A version that no
            checkpoint names is removed at the end of the round that superseded it.
        weighting: how the mean aggregate (no ``Aggregator`` callback) weighs the round's clients
            ``S``: ``"num_samples"`` (``sum_i n_i u_i / sum_i n_i``, FedAvg's) or ``"uniform"``
            (``(1/|S|) sum_i u_i``); None (default) takes the paper's, stated in each algorithm's
            docstring (see :attr:`weighting`). Algorithms whose default aggregator is robust pass it on
            (the geometric median's weights).
        lr_drop_epochs: local epochs (passes over a client's training split) after which the local
            learning rate is multiplied by ``lr_drop_gamma``, converted into rounds at setup from the
            clients' training-split sizes, the batch size and ``local_steps``
            (:func:`~fl_lightning.schedules.lr_drop_scheduler`): whatever the validation split, the
            drop comes after that many passes. Not with a scheduler of the client's own.
        lr_drop_gamma: the factor of each drop of ``lr_drop_epochs``.
    """

    #: names of keyed batch streams a local step draws from besides the main one; the step's
    #: batch of each is in ``run.extra_batches``
    extra_batch_streams: tuple[str, ...] = ()
    #: whether the local rule is a function of tensors that the batched backend can vectorize (False
    #: for rules with a torch optimizer of their own; a graph for ``client_final`` waits in ``run.held``)
    batchable: bool = True
    #: whether ``client_final`` is a function of the run's tensors and of Python values all the clients
    #: of a block share (the steps taken, the rate): no ``client_id`` or ``num_samples``, no data, no
    #: random draws, no ``self.log``. The batched backend then runs it once for a block, ``vmap``-ped over
    #: its clients, instead of once per client (one operation a block where each client costs a few:
    #: on a GPU, launches); where the block's clients took different numbers of steps, per client.
    vectorized_final: bool = False
    #: whether the algorithm trains a global model (False for personalized algorithms whose clients'
    #: models come only from ``client_eval_state``: local training alone, a hypernetwork)
    has_global_model: bool = True
    #: ``local_steps`` when neither ``local_steps`` nor ``local_epochs`` is given (an algorithm sets its paper's)
    default_local_steps: int = 10
    #: the fewest ``local_steps`` the algorithm takes: 1, or 0 for an algorithm whose round does its
    #: own work before the minibatch steps (FedProxVR's full-gradient step)
    min_local_steps: int = 1
    #: the mean aggregate's client weights in the algorithm's paper (``weighting=None``; see :attr:`weighting`)
    paper_weighting: Weighting = "num_samples"
    #: names of the clients' ``run.metrics`` the round's end logs as ``round/client_<name>``: the mean
    #: over the round's kept updates on all processes, as it logs their step losses (``round/client_loss``)
    round_metrics: tuple[str, ...] = ()

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
        clients_per_block: Optional[int] = None,
        compile_step: bool = False,
        client_state_memory: int = 2**30,
        client_state_dir: Optional[str] = None,
        client_state_checkpoints: Optional[int] = 2,
        weighting: Optional[Weighting] = None,
        lr_drop_epochs: Sequence[float] = (),
        lr_drop_gamma: float = 0.1,
    ) -> None:
        super().__init__()
        if not is_lightning_module(client):
            raise TypeError(f"client must be a LightningModule of pytorch_lightning or lightning.pytorch, got "
                            f"{type(client).__module__}.{type(client).__qualname__}")
        clients_per_round, local_steps = check_federation_arguments(
            clients_per_round, clients_fraction, min_clients, local_steps, local_epochs, self.default_local_steps,
            self.min_local_steps, server_lr, server_momentum, nonfinite_updates, seed, client_backend, list(BACKENDS),
            clients_per_block, compile_step, client_state_memory, client_state_checkpoints, weighting)
        check_server_optimizer(server_optimizer, client.parameters())
        # objects (the client, an embedding network, an objective) stay out of the hyperparameters, so
        # that checkpoints hold no pickled object and load with weights_only=True; Lightning's advice
        # to ignore a module argument (PeFLL's embedding) is followed by the second call
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=r"Attribute '\w+' is an instance of `nn.Module`")
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
        self.lr_drop_epochs, self.lr_drop_gamma = check_lr_drops(lr_drop_epochs, lr_drop_gamma), lr_drop_gamma
        if self.lr_drop_epochs and type(self).local_lr_scheduler is not FederatedModule.local_lr_scheduler:
            raise ValueError(f"lr_drop_epochs={self.lr_drop_epochs}: {type(self).__name__} schedules its local learning "
                             "rate itself (its paper's schedule); leave lr_drop_epochs empty")
        self.automatic_optimization = False
        #: the folder below which the run's client-state folder is made (absolute; None: the run's log folder)
        self.client_state_dir = check_folder("client_state_dir", client_state_dir)
        self.store = ClientStateStore(client_state_memory, None, client_state_checkpoints)
        self.global_model = ModelVector(client)
        #: declared uploads (:meth:`add_update`); FedAvg's model delta unless an algorithm says otherwise
        self.update_specs: dict[str, UpdateSpec] = {}
        #: declared per-client state entries (:meth:`add_client_state`)
        self.state_specs: dict[str, StateSpec] = {}
        self._broadcast: list[str] = []  # declared server state the clients' hooks read (add_broadcast)
        self.add_update("delta", self.global_model.dim)
        #: the aggregator used when the Trainer has no ``Aggregator`` callback; algorithms set their paper's.
        #: None: the mean ``WeightedMean(self.weighting)``, reduced with the other linear uploads
        self.default_aggregator: Optional[Aggregator] = None
        self._weighting = weighting
        self.client_backend = client_backend
        #: who runs the clients' local work (:mod:`fl_lightning.backends`)
        self.backend: ClientBackend = (BatchedBackend(clients_per_block, compile_step) if client_backend == "batched"
                                       else BACKENDS[client_backend](clients_per_block))
        self.local_schedule = LocalSchedule()
        # the round, as the engine sees it (server side: nothing per client between hooks)
        self.round_start: Optional[Tensor] = None
        self.round_clients: list[int] = []
        #: updates the round kept, over all processes (known from the aggregation on)
        self.round_num_updates = 0
        self._work: list[Any] = []
        self._updates: list[ClientUpdate] = []
        self._pending_state: dict[int, Optional[dict[str, Tensor]]] = {}
        self._excluded: list[int] = []
        #: whether a round was refused: ``round/refused`` is logged in every round from the first refused one on
        self._refused_a_round = False
        self._callbacks: list[FederatedCallback] = []
        #: the engine's services for the clients' local work, which backends use
        self.context = ClientContext(self)

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

    def add_broadcast(self, name: str, value: Optional[Tensor | torch.nn.Module] = None) -> None:
        """Declare server state that the clients' hooks read besides the start model (SCAFFOLD's control
        variate): a backend that runs clients elsewhere sends them with their work
        (:func:`~fl_lightning.broadcast.broadcast_state`, :func:`~fl_lightning.broadcast.load_broadcast`).

        Args:
            name: an attribute of this module: a tensor (a buffer or a parameter) or a submodule (its
                tensors are sent), set now or later (in ``setup``).
            value: a tensor to register as the buffer ``name``, or a module to set as ``name``; None: the
                attribute is set elsewhere.

        Raises:
            ValueError: ``name`` is no attribute name, is declared already, or is the client module.
        """
        check_broadcast_name(self, name, self._broadcast)
        if isinstance(value, Tensor):
            self.register_buffer(name, value)
        elif value is not None:
            setattr(self, name, value)
        self._broadcast.append(name)

    def round_start_model(self) -> Tensor:
        """The global model at the start of the round (a state default: the model of a client's first round)."""
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
        prepare_trainer(self.trainer, self.client, stage)
        broadcast_state(self)  # every declared broadcast is a tensor or a module by now
        if self.store.directory is None:
            self.store.directory = run_folder(self.trainer, self.client_state_dir)
        if stage != "fit" and not hasattr(getattr(self.trainer, "datamodule", None), "client_data"):
            return  # validate / test / predict with plain dataloaders: the global model, no federation
        dm = self.datamodule
        dm.place_pool(self.device)  # tensor data that fits lives on the accelerator (invariant 10)
        if self.clients_fraction is not None and dm.train_clients:
            self.clients_per_round = max(self.min_clients, int(self.clients_fraction * len(dm.train_clients)))
        if stage == "fit" and self.clients_per_round > len(dm.train_clients):
            asked = (f"min_clients={self.min_clients} (with clients_fraction={self.clients_fraction})"
                     if self.clients_fraction is not None else f"clients_per_round={self.clients_per_round}")
            raise ValueError(f"{asked} is above the number of training clients ({len(dm.train_clients)})")
        refusals = type(self.backend).check(self.context)
        if refusals:
            raise ValueError(f"client_backend={self.client_backend!r} cannot run {type(self).__name__}: "
                             + "; ".join(refusals))
        check_classes(self.client, dm)
        if stage == "fit":
            check_client_takes_data(self.context)  # the client's step on one batch: an error that names both
            self.backend.try_step(self.context)  # and as the backend runs it (the batched backend: vectorized)
        self.backend.configure(self.context, self.clients_per_round)
        dm.work_items_per_round = self.num_work_items()

    def client_bytes(self) -> int:
        """About what one client's run holds in memory: four copies of the client model (the
        model, its gradient, the round's start, an optimizer buffer), one more per declared state
        entry, and its uploads; the batched backend adds its activations
        (:func:`~fl_lightning.backends.batched.sizing.activation_bytes`)."""
        model = sum(t.numel() * t.element_size() for t in (*self.client.parameters(), *self.client.buffers())
                    if t.is_floating_point())
        uploads = 4 * sum(spec.size for spec in self.update_specs.values())  # float32, as Layout.flatten makes them
        return (4 + len(self.state_specs)) * model + uploads

    @pl.LightningModule.trainer.setter  # Lightning's property (its getter unchanged), with this setter
    def trainer(self, trainer: Optional[pl.Trainer]) -> None:
        """Attach ``trainer`` as Lightning does, and to a client module of the other Lightning package too
        (:func:`~fl_lightning.lightning_package.attach_trainer`), which Lightning's setter passes over."""
        pl.LightningModule.trainer.fset(self, trainer)
        attach_trainer(self, trainer)

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
        the module's, the client module's under ``client`` and the datamodule's under ``data``
        (:func:`~fl_lightning.module_checkpoint.logged_hparams`). Checkpoints keep the module's own ``hparams``."""
        return logged_hparams(super().hparams_initial, self.client, getattr(attached_trainer(self), "datamodule", None))

    def configure_optimizers(self) -> Any:
        """The server optimizer, and the local optimizer's template (the client's, never stepped) with its
        per-round schedule: every fresh local optimizer starts at its rate. ``LearningRateMonitor``
        reports them as ``lr-client`` and ``lr-server`` (a constant schedule, never stepped, names it)."""
        server = self.configure_server_optimizer()
        config = self.client.configure_optimizers()
        if self.lr_drop_epochs and split_optimizer_config(config)[1] is not None:
            raise ValueError(f"lr_drop_epochs={self.lr_drop_epochs} and the client's own lr scheduler both schedule "
                             "the local learning rate: give one of the two")
        template, scheduler = self.local_schedule.build(config, self.local_lr_scheduler)
        server_name = torch.optim.lr_scheduler.ConstantLR(server, factor=1.0, total_iters=0)
        return [server, template], [{"scheduler": scheduler, "interval": "epoch", "name": "lr-client"},
                                    {"scheduler": server_name, "interval": "epoch", "name": "lr-server"}]

    def configure_callbacks(self) -> list[pl.Callback]:
        """A progress bar counting rounds and clients in place of the Trainer's (TQDM or Rich), and the
        default callbacks the Trainer has none of (:func:`~fl_lightning.hooks.default_callbacks`: a
        ``RoundHistory`` where the Trainer has a logger) and the choice of the CPU's threads for a fit
        (:class:`~fl_lightning.cpu_threads.FitThreads`)."""
        bar = round_progress_bar(self.trainer.progress_bar_callback)
        return [*([bar] if bar is not None else []), *default_callbacks(self.trainer), FitThreads()]

    def configure_server_optimizer(self) -> torch.optim.Optimizer:
        """The server optimizer over the global model (the pseudo-gradient is ``-delta``):
        ``server_optimizer`` if given, else SGD with ``server_lr`` and ``server_momentum``."""
        if self.make_server_optimizer is not None:
            return self.make_server_optimizer(self.client.parameters())
        return torch.optim.SGD(self.client.parameters(), lr=self.server_lr, momentum=self.server_momentum)

    def local_lr_scheduler(self, optimizer: torch.optim.Optimizer) -> Optional[torch.optim.lr_scheduler.LRScheduler]:
        """The schedule of the local learning rate over rounds, on the template ``optimizer``:
        the drops of ``lr_drop_epochs`` if any, else None (the client's own, if any)."""
        if not self.lr_drop_epochs:
            return None
        dm = self.datamodule
        per_round = epochs_per_round([dm.num_samples(c) for c in dm.train_clients], dm.batch_size, self.local_steps,
                                     self.local_epochs)
        return lr_drop_scheduler(optimizer, self.lr_drop_epochs, self.lr_drop_gamma, per_round)

    @property
    def server_optimizer(self) -> torch.optim.Optimizer:
        """The server optimizer (a ``torch.optim`` optimizer)."""
        return raw_optimizer(self.trainer.optimizers[0])

    def local_optimizer(self) -> torch.optim.Optimizer:
        """A fresh local optimizer over the client module: the client's ``configure_optimizers``
        optimizer at this round's scheduled learning rate."""
        optimizer = self.local_schedule.split(self.client.configure_optimizers())[0]
        self.local_schedule.apply(optimizer)
        return optimizer

    @property
    def local_lr(self) -> float:
        """The scheduled local learning rate of the current round: the one rate of the parameter
        groups that hold trainable parameters (:func:`~fl_lightning.optim.param_groups.optimizer_lr`)."""
        return optimizer_lr(self.local_optimizer())

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """The global model's forward."""
        return self.client(*args, **kwargs)

    # ----------------------------------------------------------------- round
    def num_work_items(self) -> int:
        """Work items per round on each process (the length of the train loader)."""
        return self.backend.num_work_items(self.context, self.clients_per_round)

    def sample_round(self, round_idx: int) -> list[int]:
        """The clients of round ``round_idx``, from (seed, round) only."""
        return sample_clients(self.seed, round_idx, list(self.datamodule.train_clients), self.clients_per_round)

    def on_train_epoch_start(self) -> None:
        rank, world = rank_and_world()
        self.round_clients = self.sample_round(self.current_epoch)
        self.round_start = self.global_model.flatten()
        self._updates, self._pending_state, self._excluded = [], {}, []
        self._callbacks = [cb for cb in self.trainer.callbacks if isinstance(cb, FederatedCallback)]
        self.context.start_round(self._callbacks)
        for cb in self._callbacks:
            cb.on_round_start(self.trainer, self, self.current_epoch, self.round_clients)
        self._work = self.backend.start_round(self.context, self.context.taking_part(self.round_clients[rank::world]))

    def training_step(self, batch: Any, batch_idx: int) -> None:
        if batch_idx < len(self._work):
            for result in self.backend.run_work_item(self.context, self._work[batch_idx]):
                self.receive(result.update, result.state)
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
        """Drop non-finite updates, aggregate, update the server and check the round's result; take
        it (store the kept clients' state) or refuse it; step the local LR schedule; log
        ``round/excluded`` (updates left out for NaN/Inf), ``round/refused`` (1 in a refused round, 0 in
        every later one; not logged before the first, since a metric logged every round costs about a
        thousand Python calls a round in Lightning, for a value that is 0 in all but broken runs;
        ``RoundHistory`` writes 0 in the rounds without it), ``round/client_loss`` (mean local loss)
        and the algorithm's other :attr:`round_metrics`, the clients' own buffered logs (those of the
        kept clients); call ``on_round_end``.

        The result is checked before it is taken: the aggregate, the new global model, the module's
        other tensors and the server optimizer's state, in one device sync. Finite updates can combine
        into a result that is not (a sample-weighted sum that overflows fp32, a server step or a second
        moment out of range): then the round is refused as a whole. The global model and the server's
        state (:meth:`server_state`: the server optimizer's state, the module's own tensors, an
        aggregator's state) are put back as they were before the round, the kept clients' new state is
        not stored, and the round is reported (a warning naming what was not finite, ``round/refused``)
        or, with ``nonfinite_updates="raise"``, :class:`NonFiniteUpdateError` is raised in that round.
        Under several processes the processes decide together (one refuses, all do). The round is
        still a round of the Trainer: the local learning-rate schedule steps, as it does in a round
        that keeps no update, since it counts rounds (the rate of round ``r`` is the schedule's at
        ``r``, whatever happened to earlier rounds' results, as a resumed run computes it), and
        ``on_round_end`` is called with no aggregate; no server step is counted (``trainer.global_step``
        counts the server updates taken).
        """
        updates = sorted(self._updates, key=lambda u: u.client_id)
        read_metrics(updates)
        for cb in self._callbacks:
            updates = cb.on_round_updates(self.trainer, self, updates)
        finite = finite_flags([[*u.tensors.values(), *(self._pending_state.get(u.client_id) or {}).values()]
                               for u in updates])  # one device sync for the round's updates
        kept = [u for u, ok in zip(updates, finite) if ok or self._exclude(u)]
        self.context.logs.drop(self._excluded)
        saved = self.server_state()
        aggregator = self.aggregator
        combine = None if aggregator is None else functools.partial(aggregator.aggregate, self.trainer, self)
        result, self.round_num_updates = aggregate(kept, self.update_specs, self.aggregator_reduction, combine,
                                                   self.device)
        if result is not None:
            for cb in self._callbacks:
                result = cb.on_aggregate(self.trainer, self, result)
        self.global_model.load(self.round_start)
        problems: list[str] = []
        if result is not None:
            self.server_update(result)
            problems = self._not_finite(result)
        names = ("loss", *self.round_metrics)
        values = {name: [u.metrics[name] for u in kept if name in u.metrics] for name in names}
        distributed = rank_and_world()[1] > 1
        synced_logs = self.context.logs.synced() if distributed else {}
        parts = all_gather_object((len(self._excluded), values, synced_logs, problems))
        problems = list(dict.fromkeys(what for *_, part in parts for what in part))  # every process's: one decision
        if problems:
            self._refused_a_round = True
            self._refuse(saved, problems)
            result = None
        else:
            for u in kept:
                for name, value in (self._pending_state.get(u.client_id) or {}).items():
                    self.store.set(u.client_id, name, value, version=self.current_epoch)
            if result is not None:
                count_optimizer_step(self.optimizers()[0])
            else:
                warnings.warn(f"round {self.current_epoch}: no valid client update; the global model is unchanged")
        self.store.sync()
        self.local_schedule.step()
        set_logger_step(self.trainer, self.current_epoch)  # + this last work item = the rounds done
        with light_result_moves():  # a self.log call costs a fraction of a fast round otherwise
            log_agreed(self, "round/excluded", float(sum(n for n, _, _, _ in parts)), on_step=False, on_epoch=True,
                       batch_size=1)
            if self._refused_a_round:  # decided alike on every process
                log_agreed(self, "round/refused", float(bool(problems)), on_step=False, on_epoch=True, batch_size=1)
            for name in names:
                gathered = [value for _, part, _, _ in parts for value in part[name]]
                if gathered:
                    log_agreed(self, f"round/client_{name}", sum(gathered) / len(gathered), on_step=False,
                               on_epoch=True, batch_size=1)
            self.context.logs.flush([logs for _, _, logs, _ in parts] if distributed else None)
            self.log_round_step()
        for cb in self._callbacks:
            cb.on_round_end(self.trainer, self, self.current_epoch, result)
        self._updates, self._pending_state = [], {}

    def _exclude(self, update: ClientUpdate) -> bool:
        """Exclude ``update``, whose tensors or client state hold NaN or Inf, with a warning (False),
        or raise (``nonfinite_updates="raise"``)."""
        message = f"round {self.current_epoch}: the update of client {update.client_id} contains NaN or Inf"
        if self.nonfinite_updates == "raise":
            raise NonFiniteUpdateError(message)
        warnings.warn(message + "; it is excluded from the round", RuntimeWarning, stacklevel=3)
        self._excluded.append(update.client_id)
        return False

    def _not_finite(self, aggregate: dict[str, Tensor]) -> list[str]:
        """What of the round's result holds NaN or Inf, in words: the ``aggregate``'s uploads, the new
        global model, the module's other floating tensors, the server optimizer's state (one device
        sync for all of them)."""
        named = [(f"the aggregate's {name!r}", t) for name, t in aggregate.items()]
        named += [("the new global model", t) for t in self.global_model.tensors]
        named += [(f"the server's {name!r}", t) for name, t in own_tensors(self, self.client) if t.is_floating_point()]
        named += [("the server optimizer's state", t) for entries in self.server_optimizer.state.values()
                  for t in entries.values() if isinstance(t, Tensor) and t.is_floating_point()]
        finite = finite_flags([[t] for _, t in named])
        return list(dict.fromkeys(what for (what, _), ok in zip(named, finite) if not ok))

    def _refuse(self, saved: dict[str, Any], problems: list[str]) -> None:
        """Put the server back as ``saved`` before the round (and the global model as it started),
        then raise (``nonfinite_updates="raise"``) or warn that the round is refused for ``problems``."""
        self.load_server_state(saved)
        self.global_model.load(self.round_start)
        listed = problems[0] if len(problems) == 1 else ", ".join(problems[:-1]) + " and " + problems[-1]
        message = (f"round {self.current_epoch}: {listed} {'is' if len(problems) == 1 else 'are'} not finite; the "
                   "round is refused: the global model, the server's state and the clients' stored state stay as "
                   "they were before it")
        if self.nonfinite_updates == "raise":
            raise NonFiniteUpdateError(message)
        warnings.warn(message, RuntimeWarning, stacklevel=3)

    def server_state(self) -> dict[str, Any]:
        """A copy of the server's state besides the global model (which :attr:`round_start` holds):
        the module's own parameters and buffers (not the client module's: server networks, buffers such
        as SCAFFOLD's control variate), the server optimizer's state and the aggregator callback's
        ``state_dict``. The round's end takes it before aggregating and gives it back to
        :meth:`load_server_state` when it refuses the round. An algorithm whose server keeps state of
        another kind (a Python value, a tensor that is not a buffer) adds it in both methods
        (:class:`~fl_lightning.lockstep.LockstepModule` adds its ``shared`` value)."""
        aggregator = self.aggregator
        return {"tensors": copy_tensors(own_tensors(self, self.client)),
                "optimizer": copy_optimizer_state(self.server_optimizer),
                "aggregator": None if aggregator is None else copy.deepcopy(aggregator.state_dict())}

    def load_server_state(self, state: dict[str, Any]) -> None:
        """Make ``state``, a copy of :meth:`server_state`, the server's state again (it is taken over)."""
        load_tensors(own_tensors(self, self.client), state["tensors"])
        load_optimizer_state(self.server_optimizer, state["optimizer"])
        if state["aggregator"] is not None:
            aggregator = self.aggregator
            assert aggregator is not None, "the aggregator of the saved state is gone"
            aggregator.load_state_dict(state["aggregator"])

    @property
    def aggregator(self) -> Optional[Aggregator]:
        """The Trainer's ``Aggregator`` callback, or the algorithm's default (None: the mean with
        :attr:`weighting`, the reduction of ``WeightedMean(self.weighting)``)."""
        return find_aggregator(self.trainer.callbacks, self.default_aggregator)

    @property
    def aggregator_reduction(self) -> Optional[LinearReduction]:
        """The linear reduction of the ``"aggregator"`` uploads (None: a non-linear aggregator's)."""
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
        """The ``paper_weighting`` of the ``server_optimizer`` argument's class, if any (of one built to ask)."""
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

    @property
    def finalizes_rounds(self) -> bool:
        """Whether :meth:`client_final` computes more than the default upload, ``end - start``
        (a backend then sets up the client's local work around it: its draws, its logging). By
        default, whether the class overrides it; an override that is the default's for some of
        its arguments says so here."""
        return overrides_default(self, "client_final")

    # ------------------------------------------------------------ server side
    def server_update(self, aggregate: dict[str, Tensor]) -> None:
        """``x <- x - server_lr * momentum(-delta)`` for parameters; buffers take ``x + delta``."""
        delta = aggregate["delta"].to(self.device)
        optimizer = self.server_optimizer
        self.global_model.set_grads([-d for d in self.global_model.layout.split_params(delta)])
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if self.global_model.dim > self.global_model.num_params:
            new, buffers = self.global_model.flatten(), self.global_model.layout.buffers_of
            buffers(new).add_(buffers(delta))
            self.global_model.load(new)

    # ------------------------------------------------------------ evaluation
    def client_eval_state(self, client_id: int) -> Optional[Tensor]:
        """The state vector client ``client_id`` is evaluated with; None means the global model.

        Personalized algorithms return the client's own model here.
        """
        return None


