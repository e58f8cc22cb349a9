"""``FederatedModule``: the one ``LightningModule`` the Trainer sees, and what an algorithm's author writes.

It wraps the user's client ``LightningModule`` unchanged and runs a whole federation inside one
``Trainer``: a Trainer epoch is a communication round, a training "batch" is a work item (by default
one client's whole local update; see :mod:`fl_lightning.backends`). An algorithm subclasses it,
declares what it uploads (:meth:`~FederatedModule.add_update`), keeps per client
(:meth:`~FederatedModule.add_client_state`) and sends to its clients
(:meth:`~FederatedModule.add_broadcast`), and overrides the client hooks (``client_init``,
``client_step``, ``client_final``) and the server's (``server_update``): ``docs/engine.md`` has an
example. The machinery under them, the round included, is the module's ``engine``
(:class:`~fl_lightning.engine.FederationEngine`). Between rounds the wrapped client module holds the
global model, so validation and test run the client's own ``validation_step``/``test_step`` on it.
"""

from __future__ import annotations

import warnings
from typing import Any, Literal, Optional, Sequence

import torch
from torch import Tensor

from fl_lightning.backends import BACKENDS
from fl_lightning.broadcast import broadcast_state, check_broadcast_name
from fl_lightning.checkpoints import is_plain
from fl_lightning.client_store import StateDefault, StateSpec, check_folder
from fl_lightning.engine import FederationEngine, NonFiniteUpdateError
from fl_lightning.evaluation import ClientEvaluation
from fl_lightning.hooks import Aggregator
from fl_lightning.lightning_package import OptimizerCallable, is_lightning_module, pl
from fl_lightning.module_checkpoint import FederatedCheckpointing
from fl_lightning.optim.server import check_server_optimizer
from fl_lightning.paper import PaperDefaults
from fl_lightning.run import ClientRun, StepOutput, default_hook, plain_step
from fl_lightning.schedules import check_lr_drops, epochs_per_round, lr_drop_scheduler
from fl_lightning.trainer_setup import prepare_trainer
from fl_lightning.update import Reduction, UpdateSpec, Weighting
from fl_lightning.validation import check_federation_arguments
from fl_lightning.vectors import ModelVector

__all__ = ["FederatedModule", "NonFiniteUpdateError"]

NonFinitePolicy = Literal["skip", "raise"]
BackendName = Literal["sequential", "batched"]


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
        local_steps: local optimizer steps per client per round (default ``paper.local_steps``,
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
            the engine's round), or, with ``"raise"``, the run stops in that round.
        seed: the seed of client sampling, of every client's batch order and of the client
            module's own random draws during local work.
        client_backend: who runs the clients' local work: ``"sequential"`` (one client after
            another, in the client module; the reference) or ``"batched"`` (blocks of clients
            advance one local step together, vectorized with ``torch.func``; see
            :mod:`fl_lightning.backends.batched` for what it supports).
        clients_per_block: the clients of one work item (one Trainer batch): the batched backend's
            vectorized block (None: as many as a quarter of the device's free memory holds), the
            sequential backend's run of clients one after another (None: one); see
            :mod:`fl_lightning.backends`.
        compile_step: the batched backend captures its vectorized local step with ``torch.compile``
            (see :class:`~fl_lightning.backends.BatchedBackend`).
        client_state_memory: bytes of per-client state (control variates, personal models) kept
            in RAM; beyond it the least recently written clients' entries are spilled to disk.
        client_state_dir: the folder below which the run's client-state files go (a folder of the
            run's own; default: ``client_state`` in the run's log folder); with several processes, a
            folder they all reach. See :class:`~fl_lightning.client_store.ClientStateStore`.
        client_state_checkpoints: how many of the latest checkpoints keep the client-state files they
            name (None: every checkpoint's); raise it when an older checkpoint must restore client state.
        weighting: how the mean aggregate weighs the round's clients (see :attr:`weighting`); None
            (default): the paper's, stated in each algorithm's docstring.
        lr_drop_epochs: local epochs (passes over a client's training split) after which the local
            learning rate is multiplied by ``lr_drop_gamma`` (converted into rounds at setup:
            :func:`~fl_lightning.schedules.lr_drop_scheduler`). Not with a scheduler of the client's own.
        lr_drop_gamma: the factor of each drop of ``lr_drop_epochs``.
    """

    #: names of keyed batch streams a local step draws from besides the main one; the step's
    #: batch of each is in ``run.data.extra``
    extra_batch_streams: tuple[str, ...] = ()
    #: False refuses the batched backend (the one opt-out of vectorizing), for a client protocol whose vectorized
    #: form would silently differ and that the backend cannot see: a Python effect outside the module, such as
    #: a draw from Python's ``random``. What it can see, it finds itself at setup and refuses with the reason
    #: (a step that needs a client id or a per-client Python value, an optimizer of its own), or, for
    #: ``client_final``, runs per client (:mod:`fl_lightning.backends.batched.final`)
    batchable: bool = True
    #: whether the algorithm trains a global model (False for personalized algorithms whose clients'
    #: models come only from ``client_eval_state``: local training alone, a hypernetwork)
    has_global_model: bool = True
    #: the settings the algorithm's paper fixes (local steps, client weights), where arguments do not say
    paper: PaperDefaults = PaperDefaults()
    #: names of the clients' ``run.metrics`` the round's end logs as ``round/client_<name>``: the mean
    #: over the round's kept updates on all processes, as it logs their step losses (``round/client_loss``)
    round_metrics: tuple[str, ...] = ()

    _engine_class = FederationEngine  # the machinery's class (a lock-step module's adds its shared value)

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
            clients_per_round, clients_fraction, min_clients, local_steps, local_epochs, self.paper.local_steps,
            self.paper.min_local_steps, server_lr, server_momentum, nonfinite_updates, seed, client_backend, list(BACKENDS),
            clients_per_block, compile_step, client_state_memory, client_state_checkpoints, weighting)
        server_weighting = check_server_optimizer(server_optimizer, client.parameters())
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
        self.clients_fraction, self.min_clients = clients_fraction, min_clients
        self.local_steps, self.local_epochs = local_steps, local_epochs
        self.server_lr, self.server_momentum, self._server_optimizer = server_lr, server_momentum, server_optimizer
        self.nonfinite_updates, self.seed, self.client_backend = nonfinite_updates, seed, client_backend
        self.lr_drop_epochs, self.lr_drop_gamma = check_lr_drops(lr_drop_epochs, lr_drop_gamma), lr_drop_gamma
        if self.lr_drop_epochs and type(self).local_lr_scheduler is not FederatedModule.local_lr_scheduler:
            raise ValueError(f"lr_drop_epochs={self.lr_drop_epochs}: {type(self).__name__} schedules its local learning "
                             "rate itself (its paper's schedule); leave lr_drop_epochs empty")
        self.automatic_optimization = False
        #: the folder below which the run's client-state folder is made (absolute; None: the run's log folder)
        self.client_state_dir = check_folder("client_state_dir", client_state_dir)
        #: the client module's parameters and buffers as one flat vector (read, load)
        self.global_model = ModelVector(client)
        #: the aggregator used when the Trainer has no ``Aggregator`` callback; algorithms set their paper's.
        #: None: the mean ``WeightedMean(self.weighting)``, reduced with the other linear uploads
        self.default_aggregator: Optional[Aggregator] = None
        self._weighting, self._server_weighting = weighting, server_weighting
        self._broadcast: list[str] = []  # declared server state the clients' hooks read (add_broadcast)
        #: the run's machinery (:class:`~fl_lightning.engine.FederationEngine`): the declarations, the client
        #: state store, the backend, the round; what callbacks and backends read
        self.engine = self._engine_class(self, client_backend, clients_per_block, compile_step, client_state_memory,
                                         client_state_checkpoints)
        self.add_update("delta", self.global_model.dim)

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
        self.engine.update_specs[name] = UpdateSpec(size, reduction)

    def remove_update(self, name: str) -> None:
        """Undeclare an upload (an algorithm that does not upload FedAvg's ``"delta"``)."""
        if name not in self.engine.update_specs:
            raise ValueError(f"no upload named {name!r}; declared: {sorted(self.engine.update_specs)}")
        del self.engine.update_specs[name]

    def add_client_state(self, name: str, default: StateDefault = None) -> None:
        """Declare a per-client state entry, kept across rounds in the client state store.

        ``run.state[name]`` holds it during the client's round (``default`` before its first
        round; absent if ``default`` is None); its value after ``client_final`` is stored when
        the round keeps the client's update.

        Args:
            name: the entry's name.
            default: a tensor (copied), a function returning one (read when a client needs
                it; a bound method such as ``self.engine.round_start_model``, so that the module
                pickles for ``fl_ddp_spawn``), or None.
        """
        self.engine.state_specs[name] = StateSpec(default)

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

    @property
    def weighting(self) -> Weighting:
        """How the mean aggregate weighs the round's clients ``S``: ``"num_samples"``
        (``sum_i n_i u_i / sum_i n_i``) or ``"uniform"`` (``(1/|S|) sum_i u_i``).

        The ``weighting`` argument if given, else the paper's: the ``server_optimizer``'s
        ``paper_weighting`` if it declares one (Reddi et al.'s ``FedAdam``, ``FedYogi``,
        ``FedAdagrad``: ``"uniform"``), else the algorithm's ``paper.weighting`` (:attr:`paper`).
        """
        return self._weighting or self._server_weighting or self.paper.weighting

    # ------------------------------------------------------------------ Lightning's hooks
    def setup(self, stage: str) -> None:
        prepare_trainer(self.trainer, self.client, stage)
        broadcast_state(self)  # every declared broadcast is a tensor or a module by now
        self.engine.setup(stage)

    def on_train_epoch_start(self) -> None:
        self.engine.start_round()

    def training_step(self, batch: Any, batch_idx: int) -> None:
        self.engine.run_work_item()

    def configure_optimizers(self) -> Any:
        """The server optimizer, and the local optimizer's template with its per-round schedule
        (:meth:`~fl_lightning.engine.FederationEngine.optimizers`)."""
        return self.engine.optimizers()

    def configure_callbacks(self) -> list[pl.Callback]:
        """The federation's own callbacks (:meth:`~fl_lightning.engine.FederationEngine.callbacks`)."""
        return self.engine.callbacks()

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """The global model's forward."""
        return self.client(*args, **kwargs)

    # ------------------------------------------------------------ client protocol
    @default_hook
    def client_init(self, run: ClientRun) -> None:
        """Prepare client ``run.client_id``'s round. The run starts from the global model, with
        the client's declared state entries and a fresh local optimizer; override to start
        elsewhere (set ``run.start``), set scratch values or change ``run.local.num_steps``."""

    @default_hook
    def client_step(self, run: ClientRun, batch: Any) -> StepOutput:
        """One local step on ``batch``; returns its loss (or named scalars, ``"loss"`` among them).

        Runs under ``torch.no_grad()``: gradients come from ``run.loss_and_grad``. Default:
        the plain step (the client module's loss and its optimizer).
        """
        return plain_step(run, batch)

    @default_hook
    def client_final(self, run: ClientRun) -> dict[str, Tensor]:
        """The client's uploads, one flat tensor per declared name; also the place to set the
        client's new ``run.state`` entries. Default: ``{"delta": end - start}``."""
        return {"delta": run.end() - run.start}

    # ------------------------------------------------------------ server side
    def configure_server_optimizer(self) -> torch.optim.Optimizer:
        """The server optimizer over the global model (the pseudo-gradient is ``-delta``):
        ``server_optimizer`` if given, else SGD with ``server_lr`` and ``server_momentum``."""
        if self._server_optimizer is not None:
            return self._server_optimizer(self.client.parameters())
        return torch.optim.SGD(self.client.parameters(), lr=self.server_lr, momentum=self.server_momentum)

    def server_update(self, aggregate: dict[str, Tensor]) -> None:
        """``x <- x - server_lr * momentum(-delta)`` for parameters; buffers take ``x + delta``."""
        delta = aggregate["delta"].to(self.device)
        optimizer = self.engine.server_optimizer
        self.global_model.set_grads([-d for d in self.global_model.layout.split_params(delta)])
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if self.global_model.dim > self.global_model.num_params:
            new, buffers = self.global_model.flatten(), self.global_model.layout.buffers_of
            buffers(new).add_(buffers(delta))
            self.global_model.load(new)

    def local_lr_scheduler(self, optimizer: torch.optim.Optimizer) -> Optional[torch.optim.lr_scheduler.LRScheduler]:
        """The schedule of the local learning rate over rounds, on the template ``optimizer``:
        the drops of ``lr_drop_epochs`` if any, else None (the client's own, if any)."""
        if not self.lr_drop_epochs:
            return None
        dm = self.engine.datamodule
        per_round = epochs_per_round([dm.num_samples(c) for c in dm.train_clients], dm.batch_size, self.local_steps,
                                     self.local_epochs)
        return lr_drop_scheduler(optimizer, self.lr_drop_epochs, self.lr_drop_gamma, per_round)

    # ------------------------------------------------------------ evaluation
    def client_eval_state(self, client_id: int) -> Optional[Tensor]:
        """The state vector client ``client_id`` is evaluated with; None means the global model.

        Personalized algorithms return the client's own model here.
        """
        return None
