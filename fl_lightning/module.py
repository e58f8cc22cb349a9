"""``FederatedModule``: the one ``LightningModule`` the Trainer sees.

It wraps the user's client ``LightningModule`` unchanged and runs a whole federation inside
one ``Trainer``: a Trainer epoch is a communication round, a training "batch" is a work
item (by default one client's whole local update).

::

    on_train_epoch_start   sample the round's clients from (seed, round); split them over ranks
    training_step(item)    load the client's start model and state, run its local steps with the
                           client module's own training_step/configure_optimizers, turn the
                           result into a ClientUpdate, let callbacks transform it, keep it
    last item of a round   aggregate (an Aggregator callback; weighted mean by default) ->
                           server update (the server optimizer) -> callbacks.on_round_end ->
                           client state synchronized across ranks

Between rounds the wrapped client module holds the global model, so validation and test run
the client's own ``validation_step``/``test_step`` on the global model.

Algorithms subclass this and override a few hooks:

* :meth:`client_start` — the state a client starts from (global model by default);
* :meth:`client_update` / :meth:`local_train` — the local work and what is sent back;
* :meth:`adjust_local_gradients` — a gradient correction applied before each local step;
* :meth:`server_update` — how the aggregate changes the global model;
* :meth:`update_spec` — the names and sizes of the tensors in a ``ClientUpdate``;
* :meth:`twin` — a second copy of the client module, for algorithms with two models per step;
* :meth:`num_work_items` / :meth:`round_work` / :meth:`run_work_item` — the schedule, for
  algorithms whose clients move in lock-step.
"""

from __future__ import annotations

import copy
import math
import warnings
from contextlib import ExitStack, contextmanager
from typing import Any, Iterable, Iterator, Literal, Optional

import pytorch_lightning as pl
import torch
from lightning_fabric.utilities.apply_func import move_data_to_device
from pytorch_lightning.strategies import DDPStrategy
from torch import Tensor

from fl_lightning.callbacks.aggregation import WeightedMean
from fl_lightning.callbacks.base import Aggregator, FederatedCallback
from fl_lightning.distributed import all_gather_object, rank_and_world
from fl_lightning.local_logging import LocalLogBuffer
from fl_lightning.seeding import generator, sample_clients
from fl_lightning.state import ClientStateStore
from fl_lightning.update import ClientUpdate
from fl_lightning.vectors import StateVector

NonFinitePolicy = Literal["skip", "raise"]


class NonFiniteUpdateError(RuntimeError):
    """A client update contained NaN or Inf and the module was configured to stop."""


class FederatedModule(pl.LightningModule):
    """Runs federated training of ``client`` (plain FedAvg unless a subclass changes the rules).

    Args:
        client: any ``LightningModule``. Its ``training_step`` gives the local loss (its
            ``self.log`` calls keep working), its ``configure_optimizers`` the local optimizer
            (created fresh for each client each round), its ``validation_step``/``test_step``
            the metrics of the global model.
        clients_per_round: clients sampled (uniformly, without replacement) each round.
        local_steps: local optimizer steps per client per round. Exclusive with ``local_epochs``.
        local_epochs: passes over the client's training split per round, instead of steps.
        server_lr: learning rate of the server optimizer (SGD on the pseudo-gradient
            ``-mean(delta)``); 1.0 with no momentum is plain FedAvg.
        server_momentum: momentum of the server optimizer (FedAvgM).
        nonfinite_updates: what to do with an update holding NaN/Inf: ``"skip"`` excludes it
            from the round and reports it (warning + ``round/excluded`` metric), ``"raise"``
            stops the run. It is never averaged in.
        seed: the seed of client sampling and of every client's batch order.
    """

    def __init__(
        self,
        client: pl.LightningModule,
        clients_per_round: int = 10,
        local_steps: Optional[int] = 10,
        local_epochs: Optional[int] = None,
        server_lr: float = 1.0,
        server_momentum: float = 0.0,
        nonfinite_updates: NonFinitePolicy = "skip",
        seed: int = 0,
    ) -> None:
        super().__init__()
        if not isinstance(client, pl.LightningModule):
            raise TypeError(f"client must be a LightningModule, got {type(client).__name__}")
        if clients_per_round < 1:
            raise ValueError(f"clients_per_round must be >= 1, got {clients_per_round}")
        if (local_steps is None) == (local_epochs is None):
            raise ValueError(
                f"give exactly one of local_steps and local_epochs, got local_steps={local_steps}, "
                f"local_epochs={local_epochs}"
            )
        for name, value in (("local_steps", local_steps), ("local_epochs", local_epochs)):
            if value is not None and value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        if server_lr <= 0:
            raise ValueError(f"server_lr must be > 0, got {server_lr}")
        if not 0 <= server_momentum < 1:
            raise ValueError(f"server_momentum must be in [0, 1), got {server_momentum}")
        if nonfinite_updates not in ("skip", "raise"):
            raise ValueError(f"nonfinite_updates must be 'skip' or 'raise', got {nonfinite_updates!r}")
        self.save_hyperparameters(ignore=["client"])
        self.client = client
        self.clients_per_round = clients_per_round
        self.local_steps = local_steps
        self.local_epochs = local_epochs
        self.server_lr = server_lr
        self.server_momentum = server_momentum
        self.nonfinite_updates = nonfinite_updates
        self.seed = seed
        self.automatic_optimization = False
        self.store = ClientStateStore()
        self.state = StateVector(client)
        self.round_start: Optional[Tensor] = None
        self.round_clients: list[int] = []
        self._rank_clients: list[int] = []
        self._work: list[Any] = []
        self._updates: list[ClientUpdate] = []
        self._excluded: list[int] = []
        self._callbacks: list[FederatedCallback] = []
        self._local_client: Optional[int] = None
        self._local_logs = LocalLogBuffer()
        self._local_logs.bind(client)
        # the twin (see :meth:`twin`) is kept out of the module tree: no checkpoint, no optimizer
        object.__setattr__(self, "_twin", None)
        #: the aggregator used when the Trainer has no ``Aggregator`` callback; algorithms set their paper's
        self.default_aggregator: Aggregator = WeightedMean()

    # ------------------------------------------------------------------ setup
    def setup(self, stage: str) -> None:
        strategy = self.trainer.strategy
        if isinstance(strategy, DDPStrategy) and not getattr(strategy, "is_federated", False):
            raise ValueError(
                f"strategy {type(strategy).__name__} all-reduces the gradients of every local step; "
                "use strategy='fl_ddp' (or 'fl_ddp_spawn'), fl_lightning's DDP strategy for federations"
            )
        dm = self.datamodule
        if stage == "fit" and self.clients_per_round > len(dm.train_clients):
            raise ValueError(
                f"clients_per_round={self.clients_per_round} is above the number of training clients "
                f"({len(dm.train_clients)})"
            )

    @property
    def datamodule(self) -> Any:
        """The ``FederatedDataModule`` of the run."""
        dm = getattr(self.trainer, "datamodule", None)
        if dm is None or not hasattr(dm, "client_data"):
            raise RuntimeError("a FederatedModule needs a FederatedDataModule: trainer.fit(module, datamodule=...)")
        return dm

    def configure_optimizers(self) -> torch.optim.Optimizer:
        """The server optimizer, over the global model's parameters."""
        return torch.optim.SGD(self.client.parameters(), lr=self.server_lr, momentum=self.server_momentum)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """The global model's forward."""
        return self.client(*args, **kwargs)

    # -------------------------------------------------------------- schedule
    def num_work_items(self) -> int:
        """Work items per round on each process (the length of the train loader)."""
        _, world = rank_and_world()
        return math.ceil(self.clients_per_round / world)

    def sample_round(self, round_idx: int) -> list[int]:
        """The clients of round ``round_idx``, from (seed, round) only."""
        return sample_clients(self.seed, round_idx, list(self.datamodule.train_clients), self.clients_per_round)

    def round_work(self, clients: list[int]) -> list[Any]:
        """This process's work items for the round given its clients (default: one per client)."""
        return list(clients)

    def run_work_item(self, item: Any) -> None:
        """Run one work item (default: one client's update, then :meth:`receive` it)."""
        self.receive(self.client_update(item))

    # ----------------------------------------------------------------- round
    def on_train_epoch_start(self) -> None:
        rank, world = rank_and_world()
        round_idx = self.current_epoch
        self.round_clients = self.sample_round(round_idx)
        self._rank_clients = self.round_clients[rank::world]
        self._work = self.round_work(self._rank_clients)
        if len(self._work) > self.num_work_items():
            raise RuntimeError(f"{len(self._work)} work items for a loader of {self.num_work_items()}")
        self.round_start = self.state.flatten()
        self._updates, self._excluded = [], []
        self._callbacks = [cb for cb in self.trainer.callbacks if isinstance(cb, FederatedCallback)]
        for cb in self._callbacks:
            cb.on_round_start(self.trainer, self, round_idx, self.round_clients)

    def training_step(self, batch: Any, batch_idx: int) -> None:
        if batch_idx < len(self._work):
            self.run_work_item(self._work[batch_idx])
        if batch_idx == self.num_work_items() - 1:
            with torch.autocast(self.device.type, enabled=False):
                self.finish_round()

    def receive(self, update: ClientUpdate) -> None:
        """Pass ``update`` through the callbacks and keep it for aggregation, unless non-finite."""
        for cb in self._callbacks:
            update = cb.on_client_update(self.trainer, self, update)
        if not update.is_finite():
            message = f"round {self.current_epoch}: the update of client {update.client_id} contains NaN or Inf"
            if self.nonfinite_updates == "raise":
                raise NonFiniteUpdateError(message)
            warnings.warn(message + "; it is excluded from the round", RuntimeWarning, stacklevel=2)
            self._excluded.append(update.client_id)
            return
        self._updates.append(update)

    def finish_round(self) -> None:
        """Aggregate, update the server, synchronize client state, log ``round/excluded`` (updates
        left out for NaN/Inf), ``round/client_loss`` (mean local loss) and the clients' own
        buffered logs, call ``on_round_end``."""
        updates = sorted(self._updates, key=lambda u: u.client_id)
        for cb in self._callbacks:
            updates = cb.on_round_updates(self.trainer, self, updates)
        aggregate = self.aggregator.aggregate(self.trainer, self, updates)
        self.state.load(self.round_start)
        if aggregate is not None:
            self.server_update(aggregate)
            self._count_server_step()
        else:
            warnings.warn(f"round {self.current_epoch}: no valid client update; the global model is unchanged")
        self.store.sync()
        losses = [u.metrics["loss"] for u in self._updates if "loss" in u.metrics]
        parts = all_gather_object((len(self._excluded), losses))
        self.log("round/excluded", float(sum(n for n, _ in parts)), on_step=False, on_epoch=True, batch_size=1)
        losses = [loss for _, part in parts for loss in part]
        if losses:
            self.log("round/client_loss", sum(losses) / len(losses), on_step=False, on_epoch=True, batch_size=1)
        self._local_logs.flush()
        for cb in self._callbacks:
            cb.on_round_end(self.trainer, self, self.current_epoch, aggregate)
        self._updates = []

    # ------------------------------------------------------------ client side
    def client_start(self, client_id: int) -> Tensor:
        """The state vector client ``client_id`` starts its local work from (the global model)."""
        assert self.round_start is not None
        return self.round_start

    def client_update(self, client_id: int) -> ClientUpdate:
        """Load the start state, run the local work, return ``{"delta": end - start}``."""
        start = self.client_start(client_id)
        self.state.load(start)
        metrics = self.local_train(client_id)
        delta = self.state.flatten() - start
        return ClientUpdate(client_id, self.datamodule.num_samples(client_id), {"delta": delta}, metrics)

    def local_train(
        self,
        client_id: int,
        optimizer: Optional[torch.optim.Optimizer] = None,
        batches: Optional[Iterable[Any]] = None,
    ) -> dict[str, float]:
        """Run local steps of ``client_id`` on the client module; return the mean loss and the step count.

        Args:
            client_id: the client.
            optimizer: the local optimizer (default: a fresh :meth:`local_optimizer`).
            batches: the mini-batches (default: :meth:`local_batches` of this round).

        Works inside training and inside evaluation hooks (finetuning, unseen clients): see
        :meth:`local_context`.
        """
        optimizer = optimizer if optimizer is not None else self.local_optimizer()
        batches = batches if batches is not None else self.local_batches(client_id)
        losses = []
        with self.local_context(client_id):
            for step, batch in enumerate(batches):
                losses.append(self.local_step(optimizer, batch, step))
        return {"loss": mean_loss(losses), "steps": float(len(losses))}

    def local_batches(
        self, client_id: int, round_idx: Optional[int] = None, stream: str = "batches", steps: Optional[int] = None
    ) -> Iterator[Any]:
        """The client's mini-batches, on the device, in an order from ``(seed, stream, round, client)``.

        Args:
            client_id: the client.
            round_idx: the round of the key (default: the current round).
            stream: the name of the random stream (another name gives an independent order).
            steps: a number of steps instead of the module's ``local_steps``/``local_epochs``.
        """
        data = self.datamodule.client_data(client_id, "train")
        g = generator(self.seed, stream, self.current_epoch if round_idx is None else round_idx, client_id)
        if steps is not None or self.local_steps is not None:
            batches = data.step_batches(steps if steps is not None else self.local_steps, g)
        else:
            batches = data.epoch_batches(self.local_epochs, g)
        for batch in batches:
            batch = move_data_to_device(batch, self.device)
            for cb in self._callbacks:
                batch = cb.on_local_batch(self.trainer, self, client_id, batch)
            yield batch

    def local_optimizer(self, module: Optional[pl.LightningModule] = None) -> torch.optim.Optimizer:
        """A fresh optimizer from the ``configure_optimizers`` of the client module (or of ``module``,
        e.g. the :meth:`twin`)."""
        return _single_optimizer((self.client if module is None else module).configure_optimizers())

    def module_loss(self, module: pl.LightningModule, batch: Any, step: int) -> Tensor:
        """``module``'s own training loss on ``batch`` (its ``training_step``): the client module or its :meth:`twin`."""
        self._local_logs.batch = batch  # lets the client's self.log infer its batch size
        out = module.training_step(batch, step)
        loss = out["loss"] if isinstance(out, dict) else out
        if not isinstance(loss, Tensor):
            raise TypeError(f"the client's training_step must return a loss tensor, got {type(out).__name__}")
        return loss

    def local_loss(self, batch: Any, step: int) -> Tensor:
        """The loss a local step of the client module minimizes: its training loss (algorithms with a
        surrogate objective override this)."""
        return self.module_loss(self.client, batch, step)

    def local_step(
        self, optimizer: torch.optim.Optimizer, batch: Any, step: int, module: Optional[pl.LightningModule] = None
    ) -> Tensor:
        """One local optimizer step of the client module, or of ``module`` (the :meth:`twin`) on its
        own training loss; returns the detached loss.

        The forward runs inside the Trainer's precision context (autocast for ``*-mixed``);
        under ``16-mixed`` the loss is scaled with the precision plugin's ``GradScaler`` and
        the gradients are unscaled before :meth:`adjust_local_gradients`, which applies to the
        client module's steps only. Local steps do not dispatch the Trainer's per-step
        backward/optimizer hooks: they are the inner loop of one Trainer step.
        """
        optimizer.zero_grad(set_to_none=True)
        loss = self.local_loss(batch, step) if module is None else self.module_loss(module, batch, step)
        scaler = getattr(self.trainer.precision_plugin, "scaler", None)
        if scaler is not None:
            scaler.scale(loss).backward()
            scaler.unscale_(optimizer)
        else:
            loss.backward()
        if module is None:
            self.adjust_local_gradients(self._local_client)
        if scaler is not None:
            scaler.step(optimizer)
            scaler.update()
        else:
            optimizer.step()
        return loss.detach()

    def adjust_local_gradients(self, client_id: int) -> None:
        """Change the client module's (unscaled) gradients before each of its local optimizer steps.
        Default: nothing."""

    def twin(self) -> pl.LightningModule:
        """A second copy of the client module, for algorithms that keep two models in a local step.

        FedDeper trains its personal model on it beside the uploaded one; FedProxVR takes the
        gradient at its reference point on it. Each model then stays in its own parameters for the
        whole round, instead of being loaded and flattened at every local step. The twin is a deep
        copy of the client module made on first use, not a submodule (it is in no checkpoint and no
        optimizer: what must persist goes to the client state store), and it follows the client
        module's device and train/eval mode. Its ``self.log`` calls are the client module's: in
        local training they are buffered with the client's own. Train it with
        ``local_step(optimizer, batch, step, module=twin)`` and ``local_optimizer(twin)``; read and
        write it with ``StateVector(twin)``.
        """
        twin = self._twin
        if twin is None:
            twin = copy.deepcopy(self.client)  # LightningModule.__getstate__ leaves the Trainer out
            object.__setattr__(twin, "log", self._log_as_client)
            object.__setattr__(self, "_twin", twin)
        if self._trainer is not None and twin._trainer is not self._trainer:
            twin.trainer = self._trainer
        reference = next(self.client.parameters(), None)
        if reference is not None and next(twin.parameters()).device != reference.device:
            twin.to(reference.device)
        if twin.training != self.client.training:
            twin.train(self.client.training)
        return twin

    def _log_as_client(self, *args: Any, **kwargs: Any) -> None:
        """The twin's ``self.log``: the client module's, whatever it is routed to at the moment."""
        self.client.log(*args, **kwargs)

    @contextmanager
    def local_context(self, client_id: int) -> Iterator[None]:
        """The setting of local work for ``client_id``.

        In training, the client module's ``self.log`` calls are buffered and logged once per
        round as their batch-size-weighted mean (:mod:`fl_lightning.local_logging`), with the
        options of the client's call. In an evaluation hook (finetuning, fitting an unseen
        client), gradients are enabled, inference mode is left, and the client's ``self.log``
        calls are dropped: they would land in the evaluation's results.
        """
        training = self.trainer.training
        self._local_client = client_id
        with ExitStack() as stack:
            object.__setattr__(self.client, "log", self._local_logs.log if training else _drop_log)
            stack.callback(object.__delattr__, self.client, "log")
            if not training:
                stack.enter_context(torch.inference_mode(False))
                stack.enter_context(torch.enable_grad())
            try:
                yield
            finally:
                self._local_client = None
                self._local_logs.batch = None

    # ------------------------------------------------------------ server side
    def update_spec(self) -> dict[str, int]:
        """Names and sizes of the flat tensors of every ``ClientUpdate``."""
        return {"delta": self.state.dim}

    def server_update(self, aggregate: dict[str, Tensor]) -> None:
        """``x <- x - server_lr * momentum(-delta)`` for parameters; buffers take ``x + delta``."""
        delta = aggregate["delta"].to(self.device)
        optimizer = self.optimizers()
        raw = optimizer.optimizer if hasattr(optimizer, "optimizer") else optimizer
        offset = 0
        for p in self.state.params:
            p.grad = -delta[offset : offset + p.numel()].view_as(p).to(p.dtype)
            offset += p.numel()
        raw.step()
        raw.zero_grad(set_to_none=True)
        if self.state.dim > self.state.num_params:
            new = self.state.flatten()
            new[self.state.num_params :] += delta[self.state.num_params :]
            self.state.load(new)

    def _count_server_step(self) -> None:
        """Count the round's server update as one optimizer step (``trainer.global_step``).

        The server optimizer is stepped directly (the precision plugin's loss scaler must not
        touch pseudo-gradients), so the step is counted with the two hooks Lightning's own
        ``LightningOptimizer.step`` calls around a manual-optimization step. ``ModelCheckpoint``
        and step-based loggers rely on ``global_step`` advancing once per round.
        """
        optimizer = self.optimizers()
        optimizer._on_before_step()
        optimizer._on_after_step()

    @property
    def aggregator(self) -> Aggregator:
        """The Trainer's ``Aggregator`` callback, or the sample-weighted mean if none is given."""
        found = [cb for cb in self.trainer.callbacks if isinstance(cb, Aggregator)]
        if len(found) > 1:
            raise ValueError(f"give at most one Aggregator callback, got {[type(c).__name__ for c in found]}")
        return found[0] if found else self.default_aggregator

    # ------------------------------------------------------------ evaluation
    def client_eval_state(self, client_id: int) -> Optional[Tensor]:
        """The state vector client ``client_id`` is evaluated with; None means the global model.

        Personalized algorithms return the client's own model here.
        """
        return None

    @torch.no_grad()
    def client_accuracy(self, client_id: int, data: Any, personalized: bool = True) -> float:
        """Accuracy on ``data`` (a ``ClientData``) of client ``client_id``'s model
        (:meth:`client_eval_state`), or of the global model if ``personalized`` is False; the
        client module's output is read as logits."""
        state = self.client_eval_state(client_id) if personalized else None
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
        return self._client_hook("predict_step", batch, batch_idx)

    def on_validation_epoch_start(self) -> None:
        self._client_hook("on_validation_epoch_start")

    def on_validation_epoch_end(self) -> None:
        self._client_hook("on_validation_epoch_end")

    def on_test_epoch_start(self) -> None:
        self._client_hook("on_test_epoch_start")

    def on_test_epoch_end(self) -> None:
        self._client_hook("on_test_epoch_end")

    def _client_hook(self, name: str, *args: Any) -> Any:
        self.client._current_fx_name = name
        return getattr(self.client, name)(*args)

    # ------------------------------------------------------------ checkpoint
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
        checkpoint["federated"] = {"store": self.store.state_dict(), "fingerprint": self.fingerprint()}

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        saved = checkpoint.get("federated")
        if saved is None:
            raise ValueError("the checkpoint was not written by a FederatedModule (no 'federated' entry)")
        if self._trainer is not None and getattr(self._trainer, "datamodule", None) is not None:
            mine = self.fingerprint()
            diff = {k: (saved["fingerprint"].get(k), v) for k, v in mine.items() if saved["fingerprint"].get(k) != v}
            if diff:
                lines = ", ".join(f"{k}: checkpoint {a!r} vs run {b!r}" for k, (a, b) in diff.items())
                raise ValueError(f"the checkpoint comes from another configuration ({lines})")
        self.store.load_state_dict(saved["store"])


def mean_loss(losses: list[Tensor]) -> float:
    """The mean of a round's detached local-step losses, read with one device sync (NaN for none)."""
    return float(torch.stack(losses).float().mean()) if losses else float("nan")


def _drop_log(*args: Any, **kwargs: Any) -> None:
    """Stands in for a client's ``self.log`` during local work inside an evaluation hook."""


def _single_optimizer(config: Any) -> torch.optim.Optimizer:
    """The optimizer of a ``configure_optimizers`` result that holds exactly one."""
    if isinstance(config, torch.optim.Optimizer):
        return config
    if isinstance(config, dict) and "optimizer" in config:
        if config.get("lr_scheduler") is not None:
            warnings.warn("the client's lr_scheduler is ignored: local optimizers are created fresh each round")
        return _single_optimizer(config["optimizer"])
    if isinstance(config, (list, tuple)) and len(config) >= 1:
        if len(config) == 2 and isinstance(config[0], (list, tuple)):
            return _single_optimizer(list(config[0]))
        if len(config) == 1:
            return _single_optimizer(config[0])
    raise ValueError(
        "the client's configure_optimizers must return exactly one optimizer (optionally with a scheduler), "
        f"got {config!r}"
    )
