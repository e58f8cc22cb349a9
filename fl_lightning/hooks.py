"""The federated hooks: the base classes of callbacks that take part in rounds.

The engine (:class:`~fl_lightning.engine.FederationEngine`, in the round) calls these hooks; the callbacks of ``fl_lightning.callbacks``
(aggregators, attacks, privacy, metrics), which re-exports both classes, implement them. They
live beside the engine so that it needs nothing from the callbacks package.

The hooks receive the module as a :class:`Federation`: the protocol that says what a callback
may use of it (the client module, the global model, the run's settings and its ``engine``: the
datamodule, the round's clients, the declared uploads, plain local training, the clients'
evaluation). ``FederatedModule`` satisfies it structurally, so the hooks and the callbacks depend on
this protocol, not on the module's class.

A ``FederatedCallback`` is an ordinary Lightning callback (it can use every ``pl.Callback``
hook and keeps its state in ``state_dict``) plus hooks the engine calls each round:

* ``on_round_start``: after the round's clients are sampled;
* ``configure_client``: once per round for each client of this process, before its run is built;
  returns the client's :class:`~fl_lightning.client_config.ClientConfig` (its local work, learning
  rate, or dropping out: Flower's ``on_fit_config_fn``);
* ``forges_upload``: whether the callback will replace a client's upload without reading it
  (the engine then skips the client's local work);
* ``on_local_batch``: for each mini-batch a client trains on; returns the batch to use (data
  poisoning such as label flipping happens here);
* ``on_client_update``: for each update this process produced; returns the update to keep
  (attacks, clipping, noise and compression transform it here);
* ``on_round_updates``: once per round before aggregation, with this process's kept updates,
  at the same point on every process (collectives allowed): attacks that read the honest
  uploads (ALIE, IPM, a colluding sign flip) forge theirs here;
* ``aggregate`` (aggregators only): combine all of the round's updates;
* ``on_aggregate``: once per round with the aggregate, before the server update (server-side
  noise of differential privacy); the same on every process;
* ``on_round_end``: after the server update.

A callback's module may also make it a default (:func:`add_default_callback`): every
``FederatedModule`` then gives its Trainer one that the callback's function chooses, unless the
Trainer has one (``RoundHistory``: the run's history and summary, where the Trainer has a logger).
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Protocol

import torch
from torch import Tensor

from fl_lightning.client_config import ClientConfig
from fl_lightning.lightning_package import pl
from fl_lightning.update import ClientUpdate, LinearReduction
from fl_lightning.vectors import ModelVector



class Federation(Protocol):
    """What a federated callback may use of the module that calls its hooks (``FederatedModule``
    satisfies it): the run's settings, the client module and the global model, and the run's
    machinery, :attr:`engine` (the datamodule, the round's clients and kept updates, the declared
    uploads, plain local training, the clients' evaluation)."""

    @property
    def engine(self) -> Any:
        """The run's machinery (:class:`~fl_lightning.engine.FederationEngine`)."""

    @property
    def device(self) -> torch.device:
        """The device of the client module and of the updates."""

    @property
    def client(self) -> pl.LightningModule:
        """The client module (its weights: the global model, :attr:`global_model`)."""

    @property
    def global_model(self) -> ModelVector:
        """The client module's parameters and buffers as one flat vector (read, load)."""

    @property
    def has_global_model(self) -> bool:
        """Whether the algorithm trains a global model (False: each client's model comes from the algorithm)."""

    @property
    def seed(self) -> int:
        """The run's seed, from which every random draw is keyed."""

    @property
    def current_epoch(self) -> int:
        """The current round's index (0-based)."""

    @property
    def clients_per_round(self) -> int:
        """How many clients a round samples."""

    def client_eval_state(self, client_id: int) -> Optional[Tensor]:
        """The state vector client ``client_id`` is evaluated with (None: the global model)."""

    def log(
        self,
        name: str,
        value: float,
        *,
        on_step: Optional[bool] = None,
        on_epoch: Optional[bool] = None,
        batch_size: Optional[int] = None,
    ) -> None:
        """Log a metric, as ``LightningModule.log``."""


class FederatedCallback(pl.Callback):
    """Base class of callbacks that take part in rounds."""

    def on_round_start(self, trainer: pl.Trainer, module: Federation, round_idx: int, clients: list[int]) -> None:
        """Called once the round's clients (all processes' clients) are known."""

    def configure_client(
        self, trainer: pl.Trainer, module: Federation, round_idx: int, client_id: int, config: ClientConfig
    ) -> ClientConfig:
        """Return client ``client_id``'s configuration for round ``round_idx`` (default: ``config`` unchanged).

        ``config`` is the module's (its ``local_steps`` or ``local_epochs``, the round's scheduled
        learning rate) as the callbacks before this one changed it; return ``config.replace(...)``
        to change it (:class:`~fl_lightning.client_config.ClientConfig`): the client's local work in
        the module's unit, its learning rate (``lr``, ``lr_scale``), or ``drop=True`` (it does no
        local work and sends nothing). Called after ``on_round_start``, once per round for each
        client of this process, before its run is built. Local training outside the round
        (finetuning, fitting an unseen client) keeps the module's settings. The result must depend
        on the round and the client only (draw from a generator keyed by them,
        :func:`~fl_lightning.seeding.generator`), so that it is the same on any number of processes
        and after a resume."""
        return config

    def forges_upload(self, trainer: pl.Trainer, module: Federation, client_id: int) -> bool:
        """Whether this callback will replace ``client_id``'s upload without reading it (default:
        False). The engine then skips the client's local work and sends zeros of the declared
        shapes in its place: the result is the same, only faster."""
        return False

    def on_local_batch(self, trainer: pl.Trainer, module: Federation, client_id: int, batch: Any) -> Any:
        """Return the batch client ``client_id`` trains on (default: unchanged)."""
        return batch

    def on_client_update(self, trainer: pl.Trainer, module: Federation, update: ClientUpdate) -> ClientUpdate:
        """Return the update to keep for aggregation (default: unchanged)."""
        return update

    def on_round_updates(
        self, trainer: pl.Trainer, module: Federation, updates: list[ClientUpdate]
    ) -> list[ClientUpdate]:
        """Return the updates to aggregate (this process's, sorted by client id; default: unchanged).

        Called on every process at the same point of the round, so it may use collectives.
        """
        return updates

    def on_aggregate(
        self, trainer: pl.Trainer, module: Federation, aggregate: dict[str, Tensor]
    ) -> dict[str, Tensor]:
        """Return the aggregate the server update applies (default: unchanged). Called on every
        process with the same aggregate; a change must be the same on every process."""
        return aggregate

    def on_round_end(
        self, trainer: pl.Trainer, module: Federation, round_idx: int, aggregate: Optional[dict[str, Tensor]]
    ) -> None:
        """Called after the server update; ``aggregate`` is None when the round had no valid update, or
        when its result was not finite and the round was refused (the server left as before it)."""


class Aggregator(FederatedCallback):
    """A callback that combines the uploads an algorithm declares with reduction ``"aggregator"``
    (``module.engine.aggregated_sizes()``: model deltas, gradients) into one tensor per name.

    An aggregator sees only this process's updates and is responsible for its own
    cross-process communication (``fl_lightning.distributed``), so that its result is the
    same on every process and equal to the single-process result. An aggregator that is a
    linear reduction says so with :attr:`linear_reduction`; the engine then combines its
    uploads with the algorithm's other linear ones, in one all-reduce. With no aggregator (no
    ``Aggregator`` callback, no ``default_aggregator`` of the algorithm) the engine takes the
    mean ``WeightedMean(module.weighting)``: the paper's weights unless ``weighting`` is given.
    """

    #: ``"weighted_mean"``, ``"mean"`` or ``"sum"`` if the aggregate is that linear reduction, else None
    linear_reduction: Optional[LinearReduction] = None

    def aggregate(
        self, trainer: pl.Trainer, module: Federation, updates: list[ClientUpdate]
    ) -> Optional[dict[str, Tensor]]:
        """Combine the ``module.engine.aggregated_sizes()`` tensors of ``updates`` (this process's,
        sorted by client id); None if there is nothing to combine."""
        raise NotImplementedError


#: what :func:`add_default_callback` registered: functions of a Trainer that return the callback to add, or None
_DEFAULT_CALLBACKS: list[Callable[[pl.Trainer], Optional[pl.Callback]]] = []


def add_default_callback(choose: Callable[[pl.Trainer], Optional[pl.Callback]]) -> None:
    """Make a callback a default of every federation: each ``FederatedModule`` gives its Trainer the
    callback ``choose(trainer)`` returns (``configure_callbacks``, when a ``fit``, ``validate``,
    ``test`` or ``predict`` starts), or none where it returns None. ``choose`` decides where the
    callback applies, and returns None where the Trainer has one of its own (which Lightning would
    otherwise replace). Registered by the callback's module, so that the engine needs nothing from it."""
    if choose not in _DEFAULT_CALLBACKS:
        _DEFAULT_CALLBACKS.append(choose)


def default_callbacks(trainer: pl.Trainer) -> list[pl.Callback]:
    """The callbacks the registered defaults (:func:`add_default_callback`) give ``trainer``."""
    return [callback for callback in (choose(trainer) for choose in _DEFAULT_CALLBACKS) if callback is not None]
