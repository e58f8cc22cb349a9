"""``FederationEngine``: the machinery under a ``FederatedModule``, and the round read top to bottom.

An algorithm's author meets ``FederatedModule``'s hooks and declarations; everything else of a run lives
here, behind the module's one ``engine`` attribute: the declared uploads and per-client state entries, the
client-state store, the client backend and the context it reads, the local learning-rate schedule, the
round's clients and start model, the server's state as a round's refusal puts it back, and the services
callbacks use (plain local training, per-client evaluation).

:meth:`FederationEngine.round` is a round from sampling to ``on_round_end``, in one function. The module's
Lightning hooks drive it (``on_train_epoch_start`` starts it, each ``training_step`` runs one work item);
nothing in it calls back up into them::

    sample the round's clients from (seed, round) -> the callbacks' on_round_start
    plan the backend's work items for this process's clients (those the callbacks' configuration keeps)
    each work item: the backend runs its clients and returns their results; each update passes the
        callbacks' on_client_update and is kept with the client's new state entries
    the round's end: on_round_updates -> drop non-finite updates -> aggregate (declared reductions, the
        aggregator) -> on_aggregate -> server_update -> take the result (store the kept clients' state)
        or refuse it (the server put back) -> the local learning-rate schedule's step -> log -> on_round_end
"""

from __future__ import annotations

import copy
import functools
import warnings
from typing import Any, Iterator, Literal, Optional, Sequence

import torch
from torch import Tensor

from fl_lightning.aggregation import aggregate, find_aggregator
from fl_lightning.backends import BACKENDS, BatchedBackend, ClientBackend, ClientContext
from fl_lightning.backends.base import work_items_per_round
from fl_lightning.backends.evaluate import check_evaluation
from fl_lightning.backends.sequential import train_one_by_one
from fl_lightning.client_store import ClientStateStore, StateSpec, run_folder
from fl_lightning.data_check import check_classes, check_client_takes_data
from fl_lightning.datamodules.client_data import Split
from fl_lightning.distributed import all_gather_object, rank_and_world
from fl_lightning.cpu_threads import FitThreads
from fl_lightning.hooks import Aggregator, FederatedCallback, default_callbacks
from fl_lightning.lightning_compat import count_optimizer_step, light_result_moves, log_agreed, raw_optimizer, \
    set_logger_step
from fl_lightning.optim.param_groups import optimizer_lr
from fl_lightning.lightning_package import pl
from fl_lightning.progress import round_progress_bar
from fl_lightning.schedules import LocalSchedule, split_optimizer_config
from fl_lightning.seeding import sample_clients
from fl_lightning.server_state import copy_optimizer_state, copy_tensors, load_optimizer_state, load_tensors, \
    own_tensors
from fl_lightning.update import ClientResult, ClientUpdate, LinearReduction, UpdateSpec, finite_flags, read_metrics, \
    weighted_reduction


class NonFiniteUpdateError(RuntimeError):
    """A client update, or a round's result (its aggregate, the new global model or server state),
    contained NaN or Inf and the module was configured to stop (``nonfinite_updates="raise"``)."""


class FederationEngine:
    """The run's machinery under ``module`` (see the module docstring): built by ``FederatedModule``.

    Args:
        module: the ``FederatedModule`` it serves (typed ``Any``: ``fl_lightning.module`` imports this module).
        client_backend, clients_per_block, compile_step, client_state_memory, client_state_checkpoints:
            the module's arguments of the same names.
    """

    def __init__(self, module: Any, client_backend: str, clients_per_block: Optional[int],
                 compile_step: bool, client_state_memory: int, client_state_checkpoints: Optional[int]) -> None:
        self.module = module
        #: the declared uploads (``add_update``) and per-client state entries (``add_client_state``)
        self.update_specs: dict[str, UpdateSpec] = {}
        self.state_specs: dict[str, StateSpec] = {}
        #: the clients' state entries, kept across rounds (in memory, spilled to the run's folder)
        self.store = ClientStateStore(client_state_memory, None, client_state_checkpoints)
        #: who runs the clients' local work (:mod:`fl_lightning.backends`)
        self.backend: ClientBackend = (BatchedBackend(clients_per_block, compile_step) if client_backend == "batched"
                                       else BACKENDS[client_backend](clients_per_block))
        #: the local learning rate's schedule over rounds
        self.local_schedule = LocalSchedule()
        #: the current round's clients (over all processes) and its start model
        self.round_clients: list[int] = []
        self.round_start: Optional[Tensor] = None
        #: updates the round kept, over all processes (known from the aggregation on)
        self.round_num_updates = 0
        self._round: Optional[Iterator[None]] = None  # the running round (:meth:`round`)
        self._refused_a_round = False  # from the first refused round on, ``round/refused`` is logged every round
        #: the engine's services for the clients' local work, which backends use
        self.context = ClientContext(module, self)

    # ------------------------------------------------------------------ the run
    @property
    def datamodule(self) -> Any:
        """The ``FederatedDataModule`` of the run."""
        dm = getattr(self.module.trainer, "datamodule", None)
        if dm is None or not hasattr(dm, "client_data"):
            raise RuntimeError("a FederatedModule needs a FederatedDataModule: trainer.fit(module, datamodule=...)")
        return dm

    def setup(self, stage: str) -> None:
        """Settle the run once its Trainer, data and device are known: the client-state folder, the round's
        size (``clients_fraction``), the backend's checks and configuration, a trial step (``fit``)."""
        module = self.module
        if self.store.directory is None:
            self.store.directory = run_folder(module.trainer, module.client_state_dir)
        if stage != "fit" and not hasattr(getattr(module.trainer, "datamodule", None), "client_data"):
            return  # validate / test / predict with plain dataloaders: the global model, no federation
        dm = self.datamodule
        dm.place_pool(module.device)  # tensor data that fits lives on the accelerator (invariant 10)
        if module.clients_fraction is not None and dm.train_clients:
            module.clients_per_round = max(module.min_clients, int(module.clients_fraction * len(dm.train_clients)))
        if stage == "fit" and module.clients_per_round > len(dm.train_clients):
            asked = (f"min_clients={module.min_clients} (with clients_fraction={module.clients_fraction})"
                     if module.clients_fraction is not None else f"clients_per_round={module.clients_per_round}")
            raise ValueError(f"{asked} is above the number of training clients ({len(dm.train_clients)})")
        check_classes(module.client, dm)
        if stage == "fit":
            check_client_takes_data(self.context)  # the client's step on one batch: an error that names both
        self.backend.setup(self.context, module.clients_per_round, fit=stage == "fit")  # its refusals, its trial step
        dm.work_items_per_round = self.num_work_items()

    def optimizers(self) -> Any:
        """``configure_optimizers``: the server optimizer, and the local optimizer's template (the client's,
        never stepped) with its per-round schedule: every fresh local optimizer starts at its rate.
        ``LearningRateMonitor`` reports them as ``lr-client`` and ``lr-server`` (a constant schedule, never
        stepped, names it)."""
        module = self.module
        server = module.configure_server_optimizer()
        config = module.client.configure_optimizers()
        if module.lr_drop_epochs and split_optimizer_config(config)[1] is not None:
            raise ValueError(f"lr_drop_epochs={module.lr_drop_epochs} and the client's own lr scheduler both schedule "
                             "the local learning rate: give one of the two")
        template, scheduler = self.local_schedule.build(config, module.local_lr_scheduler)
        server_name = torch.optim.lr_scheduler.ConstantLR(server, factor=1.0, total_iters=0)
        return [server, template], [{"scheduler": scheduler, "interval": "epoch", "name": "lr-client"},
                                    {"scheduler": server_name, "interval": "epoch", "name": "lr-server"}]

    def callbacks(self) -> list[pl.Callback]:
        """``configure_callbacks``: a progress bar counting rounds and clients in place of the Trainer's
        (TQDM or Rich), the default callbacks the Trainer has none of
        (:func:`~fl_lightning.hooks.default_callbacks`: a ``RoundHistory`` where the Trainer has a logger)
        and the choice of the CPU's threads for a fit (:class:`~fl_lightning.cpu_threads.FitThreads`)."""
        trainer = self.module.trainer
        bar = round_progress_bar(trainer.progress_bar_callback)
        return [*([bar] if bar is not None else []), *default_callbacks(trainer), FitThreads()]

    def num_work_items(self) -> int:
        """Work items per round on each process (the length of the train loader)."""
        return work_items_per_round(self.backend, self.context, self.module.clients_per_round)

    def sample_round(self, round_idx: int) -> list[int]:
        """The clients of round ``round_idx``, from (seed, round) only."""
        module = self.module
        return sample_clients(module.seed, round_idx, list(self.datamodule.train_clients), module.clients_per_round)

    # ------------------------------------------------------------------ the round
    def start_round(self) -> None:
        """Start the Trainer epoch's round (``on_train_epoch_start``)."""
        self._round = self.round(self.module.current_epoch)
        next(self._round)

    def run_work_item(self) -> None:
        """Run the round's next work item (a ``training_step``); after the last, the round's end."""
        assert self._round is not None, "the round has not started"
        next(self._round, None)

    def round(self, index: int) -> Iterator[None]:
        """Round ``index``, top to bottom: it pauses before each work item (one Trainer batch each)."""
        module, trainer = self.module, self.module.trainer
        rank, world = rank_and_world()
        self.round_clients = self.sample_round(index)
        self.round_start = module.global_model.flatten()
        callbacks = [cb for cb in trainer.callbacks if isinstance(cb, FederatedCallback)]
        self.context.start_round(callbacks)
        for cb in callbacks:
            cb.on_round_start(trainer, module, index, self.round_clients)
        work = self.backend.round(self.context, self.context.taking_part(self.round_clients[rank::world]))
        updates: list[ClientUpdate] = []
        states: dict[int, Optional[dict[str, Tensor]]] = {}
        for _ in range(self.num_work_items()):  # the same count on every process; some have nothing left
            yield
            block = next(work, None)
            for result in block.rows() if block is not None else ():
                update = result.update
                for cb in callbacks:
                    update = cb.on_client_update(trainer, module, update)
                updates.append(update)
                states[update.client_id] = result.state
        with torch.autocast(module.device.type, enabled=False):
            updates = sorted(updates, key=lambda u: u.client_id)
            read_metrics(updates)
            for cb in callbacks:
                updates = cb.on_round_updates(trainer, module, updates)
            kept, excluded = self._finite(index, updates, states)
            saved = self.server_state()
            result, self.round_num_updates = aggregate(kept, self.update_specs, self.aggregator_reduction,
                                                       self._combine(), module.device)
            if result is not None:
                for cb in callbacks:
                    result = cb.on_aggregate(trainer, module, result)
            module.global_model.load(self.round_start)
            problems: list[str] = []
            if result is not None:
                module.server_update(result)
                problems = self._not_finite(result)
            logged = self._gather_logs(kept, excluded, problems)
            problems = list(dict.fromkeys(what for *_, part in logged for what in part))  # every process's: one decision
            if problems:
                self._refuse(index, saved, problems)
                result = None
            else:
                for u in kept:
                    for name, value in (states.get(u.client_id) or {}).items():
                        self.store.set(u.client_id, name, value, version=index)
                self._count_server_step(index, result)
            self.store.sync()
            self.local_schedule.step()
            self._log_round(index, logged, bool(problems))
            for cb in callbacks:
                cb.on_round_end(trainer, module, index, result)
        self._round = None

    # ------------------------------------------------------------------ the round's parts
    def _finite(self, index: int, updates: list[ClientUpdate], states: dict[int, Optional[dict[str, Tensor]]]
                ) -> tuple[list[ClientUpdate], list[int]]:
        """The updates whose tensors and new state are finite (one device sync for the round's), and the
        clients of those left out, each with a warning (``nonfinite_updates="raise"``: an error)."""
        finite = finite_flags([[*u.tensors.values(), *(states.get(u.client_id) or {}).values()] for u in updates])
        excluded = [u.client_id for u, ok in zip(updates, finite) if not ok]
        for client in excluded:
            message = f"round {index}: the update of client {client} contains NaN or Inf"
            if self.module.nonfinite_updates == "raise":
                raise NonFiniteUpdateError(message)
            warnings.warn(message + "; it is excluded from the round", RuntimeWarning, stacklevel=4)
        self.context.logs.drop(excluded)
        return [u for u, ok in zip(updates, finite) if ok], excluded

    def _combine(self) -> Any:
        """The aggregator callback's ``aggregate`` bound to this run (None: the declared mean)."""
        aggregator = self.aggregator
        return None if aggregator is None else functools.partial(aggregator.aggregate, self.module.trainer,
                                                                  self.module)

    def _not_finite(self, aggregate: dict[str, Tensor]) -> list[str]:
        """What of the round's result holds NaN or Inf, in words: the ``aggregate``'s uploads, the new
        global model, the module's other floating tensors, the server optimizer's state (one device
        sync for all of them)."""
        module = self.module
        named = [(f"the aggregate's {name!r}", t) for name, t in aggregate.items()]
        named += [("the new global model", t) for t in module.global_model.tensors]
        named += [(f"the server's {name!r}", t) for name, t in own_tensors(module, module.client)
                  if t.is_floating_point()]
        named += [("the server optimizer's state", t) for entries in self.server_optimizer.state.values()
                  for t in entries.values() if isinstance(t, Tensor) and t.is_floating_point()]
        finite = finite_flags([[t] for _, t in named])
        return list(dict.fromkeys(what for (what, _), ok in zip(named, finite) if not ok))

    def _gather_logs(self, kept: list[ClientUpdate], excluded: list[int], problems: list[str]) -> list[Any]:
        """Every process's ``(excluded count, the kept clients' metric values, the clients' buffered logs,
        the problems of the result)``: what the round's end logs and decides on, alike on every process."""
        names = ("loss", *self.module.round_metrics)
        values = {name: [u.metrics[name] for u in kept if name in u.metrics] for name in names}
        synced_logs = self.context.logs.synced() if rank_and_world()[1] > 1 else {}
        return all_gather_object((len(excluded), values, synced_logs, problems))

    def _refuse(self, index: int, saved: dict[str, Any], problems: list[str]) -> None:
        """Put the server back as ``saved`` before round ``index`` (and the global model as it started),
        then raise (``nonfinite_updates="raise"``) or warn that the round is refused for ``problems``."""
        self._refused_a_round = True
        self.load_server_state(saved)
        self.module.global_model.load(self.round_start)
        listed = problems[0] if len(problems) == 1 else ", ".join(problems[:-1]) + " and " + problems[-1]
        message = (f"round {index}: {listed} {'is' if len(problems) == 1 else 'are'} not finite; the "
                   "round is refused: the global model, the server's state and the clients' stored state stay as "
                   "they were before it")
        if self.module.nonfinite_updates == "raise":
            raise NonFiniteUpdateError(message)
        warnings.warn(message, RuntimeWarning, stacklevel=4)

    def _count_server_step(self, index: int, result: Optional[dict[str, Tensor]]) -> None:
        """Count a taken server update in ``trainer.global_step``; warn of a round that kept no update."""
        if result is not None:
            count_optimizer_step(self.module.optimizers()[0])
        else:
            warnings.warn(f"round {index}: no valid client update; the global model is unchanged")

    def _log_round(self, index: int, logged: list[Any], refused: bool) -> None:
        """Log ``round/excluded``, ``round/refused`` (from the first refused round on: a metric logged every
        round costs about a thousand Python calls in Lightning, for a value that is 0 in all but broken
        runs), ``round/client_loss`` and the algorithm's other ``round_metrics``, and the clients' own
        buffered logs."""
        module = self.module
        set_logger_step(module.trainer, index)  # + this last work item = the rounds done
        with light_result_moves():  # a self.log call costs a fraction of a fast round otherwise
            log_agreed(module, "round/excluded", float(sum(n for n, _, _, _ in logged)), on_step=False,
                       on_epoch=True, batch_size=1)
            if self._refused_a_round:  # decided alike on every process
                log_agreed(module, "round/refused", float(refused), on_step=False, on_epoch=True, batch_size=1)
            for name in ("loss", *module.round_metrics):
                gathered = [value for _, part, _, _ in logged for value in part[name]]
                if gathered:
                    log_agreed(module, f"round/client_{name}", sum(gathered) / len(gathered), on_step=False,
                               on_epoch=True, batch_size=1)
            self.context.logs.flush([logs for _, _, logs, _ in logged] if rank_and_world()[1] > 1 else None)
            self.log_round_step()

    def log_round_step(self) -> None:
        """Make the number of rounds done the loggers' step for the metrics logged with this
        epoch's (Lightning takes a logged ``step`` as the x-axis): plots read rounds, not work
        items. ``epoch`` (the 0-based index) is kept beside it, as Lightning logs it. Without a
        logger there is no axis to set (and each ``self.log`` costs a fraction of a millisecond)."""
        module = self.module
        if not module.trainer.loggers:
            return
        log_agreed(module, "step", float(module.current_epoch + 1), on_step=False, on_epoch=True, batch_size=1)
        log_agreed(module, "epoch", float(module.current_epoch), on_step=False, on_epoch=True, batch_size=1)

    # ------------------------------------------------------------------ the server's state
    def server_state(self) -> dict[str, Any]:
        """A copy of the server's state besides the global model (which :attr:`round_start` holds):
        the module's own parameters and buffers (not the client module's: server networks, buffers such
        as SCAFFOLD's control variate), the server optimizer's state and the aggregator callback's
        ``state_dict``. The round's end takes it before aggregating and gives it back to
        :meth:`load_server_state` when it refuses the round."""
        module, aggregator = self.module, self.aggregator
        return {"tensors": copy_tensors(own_tensors(module, module.client)),
                "optimizer": copy_optimizer_state(self.server_optimizer),
                "aggregator": None if aggregator is None else copy.deepcopy(aggregator.state_dict())}

    def load_server_state(self, state: dict[str, Any]) -> None:
        """Make ``state``, a copy of :meth:`server_state`, the server's state again (it is taken over)."""
        load_tensors(own_tensors(self.module, self.module.client), state["tensors"])
        load_optimizer_state(self.server_optimizer, state["optimizer"])
        if state["aggregator"] is not None:
            aggregator = self.aggregator
            assert aggregator is not None, "the aggregator of the saved state is gone"
            aggregator.load_state_dict(state["aggregator"])

    @property
    def server_optimizer(self) -> torch.optim.Optimizer:
        """The server optimizer (a ``torch.optim`` optimizer)."""
        return raw_optimizer(self.module.trainer.optimizers[0])

    @property
    def aggregator(self) -> Optional[Aggregator]:
        """The Trainer's ``Aggregator`` callback, or the algorithm's default (None: the mean with
        the module's ``weighting``, the reduction of ``WeightedMean(weighting)``)."""
        return find_aggregator(self.module.trainer.callbacks, self.module.default_aggregator)

    @property
    def aggregator_reduction(self) -> Optional[LinearReduction]:
        """The linear reduction of the ``"aggregator"`` uploads (None: a non-linear aggregator's)."""
        aggregator = self.aggregator
        return weighted_reduction(self.module.weighting) if aggregator is None else aggregator.linear_reduction

    def aggregated_sizes(self) -> dict[str, int]:
        """The uploads an ``Aggregator`` callback combines (reduction ``"aggregator"``), with their sizes."""
        return {n: s.size for n, s in self.update_specs.items() if s.reduction == "aggregator"}

    def upload_sizes(self) -> dict[str, int]:
        """Every declared upload with its size, in declaration order."""
        return {n: s.size for n, s in self.update_specs.items()}

    # ------------------------------------------------------------------ a client's round
    def round_start_model(self) -> Tensor:
        """The global model at the start of the round (a state default: the model of a client's first round)."""
        assert self.round_start is not None, "the round has not started"
        return self.round_start

    def local_optimizer(self) -> torch.optim.Optimizer:
        """A fresh local optimizer over the client module: the client's ``configure_optimizers``
        optimizer at this round's scheduled learning rate."""
        optimizer = self.local_schedule.split(self.module.client.configure_optimizers())[0]
        self.local_schedule.apply(optimizer)
        return optimizer

    @property
    def local_lr(self) -> float:
        """The scheduled local learning rate of the current round: the one rate of the parameter
        groups that hold trainable parameters (:func:`~fl_lightning.optim.param_groups.optimizer_lr`)."""
        return optimizer_lr(self.local_optimizer())

    def client_bytes(self) -> int:
        """About what one client's run holds in memory: four copies of the client model (the
        model, its gradient, the round's start, an optimizer buffer), one more per declared state
        entry, and its uploads; the batched backend adds its activations
        (:func:`~fl_lightning.backends.batched.sizing.activation_bytes`)."""
        client = self.module.client
        model = sum(t.numel() * t.element_size() for t in (*client.parameters(), *client.buffers())
                    if t.is_floating_point())
        uploads = 4 * sum(spec.size for spec in self.update_specs.values())  # float32, as Layout.flatten makes them
        return (4 + len(self.state_specs)) * model + uploads

    # ------------------------------------------------------------------ callbacks' services
    def train_locally(self, client_id: int, start: Optional[Tensor] = None, steps: Optional[int] = None,
                      stream: str = "batches", round_idx: Optional[int] = None) -> Tensor:
        """Plain local training of client ``client_id``, for any algorithm: its module's loss and
        optimizer, from ``start`` (default: the global model); returns the trained state vector.

        This is the one entry point of callbacks' local work (finetuning, fitting an unseen
        client). The client module is left as it was; batches come from
        ``(seed, stream, round_idx, client)`` (``round_idx`` defaults to the current round).
        """
        ((_, end),) = train_one_by_one(self.context, [client_id], *self._plain_work(start, steps, round_idx, stream))
        return end

    def train_clients_locally(self, client_ids: Sequence[int], start: Optional[Tensor] = None,
                              steps: Optional[int] = None, stream: str = "batches",
                              round_idx: Optional[int] = None) -> Iterator[tuple[int, Tensor]]:
        """:meth:`train_locally` of each of ``client_ids``, by the run's client backend:
        ``(client, trained state vector)`` as each is trained. The sequential backend trains one
        client after another; the batched one trains blocks of clients, each block's steps
        vectorized (its blocks bounded by memory), where the plain step allows it. Each client's
        batches are those :meth:`train_locally` draws; the client module is left as it was."""
        return self.backend.train_clients_plainly(self.context, list(client_ids),
                                                  *self._plain_work(start, steps, round_idx, stream))

    def _plain_work(self, start: Optional[Tensor], steps: Optional[int], round_idx: Optional[int], stream: str
                    ) -> tuple[Tensor, Optional[int], str, int]:
        """Plain local training's ``(start, steps, stream, round_idx)`` with their defaults: the global
        model, the module's ``local_steps``, the current round."""
        module = self.module
        start = module.global_model.flatten() if start is None else start.to(module.device)
        return (start, steps if steps is not None else module.local_steps, stream,
                module.current_epoch if round_idx is None else round_idx)

    def evaluate_clients(self, client_ids: Sequence[int], split: Split,
                         hook: Literal["validation_step", "test_step"] = "validation_step",
                         personalized: bool = True) -> list[ClientResult]:
        """This process's evaluation of ``client_ids`` (in that order; clients whose split is empty
        are left out), each with its own model (``client_eval_state(cid)`` when ``personalized``
        and not None, else the global model), by the run's client backend.

        The client module's ``hook`` runs on each batch of the client's ``split``
        (``eval_batch_size`` samples, in index order) and every value it logs is reduced over
        the client's batches as Lightning reduces an epoch's (a scalar's batch-size-weighted
        mean; a torchmetrics ``Metric`` reset before the client and computed after it); see
        :mod:`fl_lightning.backends.evaluate`. Epoch-level hooks are not called. The client module
        is left as it was, its ``Metric`` objects included.
        """
        check_evaluation(self.module.client, split, hook)
        state_of = self.module.client_eval_state if personalized else _global_model
        return self.backend.evaluate(self.context, client_ids, state_of, split, hook)

    def fingerprint(self) -> dict[str, Any]:
        """What a checkpoint must match to be resumed by this run."""
        module, dm = self.module, self.datamodule
        return {
            "algorithm": type(module).__qualname__,
            "state_dim": module.global_model.dim,
            "num_clients": dm.num_clients,
            "partition": dm.partition_hash(),
            "seed": module.seed,
        }


def _global_model(client_id: int) -> None:
    """Every client's evaluation model when not personalized: the global model."""
    return None
