"""Local only: every client trains its own model alone, from the same initial model; no
communication, no aggregation (the "Local" baseline of personalized FL papers).

Run it with every training client in one round (``clients_per_round`` = number of training
clients, ``trainer.max_epochs=1``) and the local budget in ``local_epochs`` or ``local_steps``;
a client that did not train (an unseen client) is trained with the same budget when it is
evaluated. Each client's model lives in the client state store.
"""

from __future__ import annotations

from typing import Any, Optional

from torch import Tensor

from fl_lightning.module import FederatedModule
from fl_lightning.update import ClientUpdate


class LocalOnly(FederatedModule):
    """Each client's model is trained on its own data only and evaluated on its own split.

    Args:
        **kwargs: the ``FederatedModule`` arguments; the server arguments are unused.
    """

    def client_start(self, client_id: int) -> Tensor:
        """The client's own model, else the common initial model."""
        assert self.round_start is not None
        initial = self.round_start
        return self.store.get(client_id, "model", default=lambda: initial, device=self.device)

    def client_update(self, client_id: int) -> ClientUpdate:
        """Local training; the model is kept in the store and nothing is sent."""
        update = super().client_update(client_id)
        self.store.set(client_id, "model", self.state.flatten())
        update.tensors = {}
        return update

    def update_spec(self) -> dict[str, int]:
        return {}

    def server_update(self, aggregate: dict[str, Tensor]) -> None:
        """Nothing: there is no global model."""

    def client_eval_state(self, client_id: int) -> Optional[Tensor]:
        """The client's own model; a client that never trained is trained now with the same budget."""
        stored = self.store.get(client_id, "model", device=self.device)
        if stored is not None:
            return stored
        initial = self.state.flatten()
        self.local_train(client_id)
        trained = self.state.flatten()
        self.state.load(initial)
        return trained

    def validation_step(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> None:
        """Nothing: there is no global model; clients are evaluated by ``ClientMetrics``."""

    def test_step(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> None:
        """Nothing: there is no global model; clients are evaluated by ``ClientMetrics``."""
