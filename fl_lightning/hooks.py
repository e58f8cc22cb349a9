"""The federated hooks: the base classes of callbacks that take part in rounds.

The engine (``FederatedModule``) calls these hooks; the callbacks of ``fl_lightning.callbacks``
(aggregators, attacks, privacy, metrics), which re-exports both classes, implement them. They
live beside the engine so that it needs nothing from the callbacks package.

A ``FederatedCallback`` is an ordinary Lightning callback (it can use every ``pl.Callback``
hook and keeps its state in ``state_dict``) plus hooks the engine calls each round:

* ``on_round_start``: after the round's clients are sampled;
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
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional

import pytorch_lightning as pl
from torch import Tensor

from fl_lightning.update import ClientUpdate, LinearReduction

if TYPE_CHECKING:
    from fl_lightning.module import FederatedModule


class FederatedCallback(pl.Callback):
    """Base class of callbacks that take part in rounds."""

    def on_round_start(self, trainer: pl.Trainer, module: "FederatedModule", round_idx: int, clients: list[int]) -> None:
        """Called once the round's clients (all processes' clients) are known."""

    def forges_upload(self, trainer: pl.Trainer, module: "FederatedModule", client_id: int) -> bool:
        """Whether this callback will replace ``client_id``'s upload without reading it (default:
        False). The engine then skips the client's local work and sends zeros of the declared
        shapes in its place: the result is the same, only faster."""
        return False

    def on_local_batch(self, trainer: pl.Trainer, module: "FederatedModule", client_id: int, batch: Any) -> Any:
        """Return the batch client ``client_id`` trains on (default: unchanged)."""
        return batch

    def on_client_update(self, trainer: pl.Trainer, module: "FederatedModule", update: ClientUpdate) -> ClientUpdate:
        """Return the update to keep for aggregation (default: unchanged)."""
        return update

    def on_round_updates(
        self, trainer: pl.Trainer, module: "FederatedModule", updates: list[ClientUpdate]
    ) -> list[ClientUpdate]:
        """Return the updates to aggregate (this process's, sorted by client id; default: unchanged).

        Called on every process at the same point of the round, so it may use collectives.
        """
        return updates

    def on_aggregate(
        self, trainer: pl.Trainer, module: "FederatedModule", aggregate: dict[str, Tensor]
    ) -> dict[str, Tensor]:
        """Return the aggregate the server update applies (default: unchanged). Called on every
        process with the same aggregate; a change must be the same on every process."""
        return aggregate

    def on_round_end(
        self, trainer: pl.Trainer, module: "FederatedModule", round_idx: int, aggregate: Optional[dict[str, Tensor]]
    ) -> None:
        """Called after the server update; ``aggregate`` is None when the round had no valid update."""


class Aggregator(FederatedCallback):
    """A callback that combines the uploads an algorithm declares with reduction ``"aggregator"``
    (``module.aggregated_sizes()``: model deltas, gradients) into one tensor per name.

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
        self, trainer: pl.Trainer, module: "FederatedModule", updates: list[ClientUpdate]
    ) -> Optional[dict[str, Tensor]]:
        """Combine the ``module.aggregated_sizes()`` tensors of ``updates`` (this process's,
        sorted by client id); None if there is nothing to combine."""
        raise NotImplementedError
