"""Local only: every client trains its own model alone, from the same initial model; no
communication, no aggregation (the "Local" baseline of personalized FL papers).

Every client's model is the local budget (``local_epochs`` or ``local_steps``) of training from
the initial model, spent once: a client trains the first round it is sampled in and keeps its
model in the client state store; sampled again, it takes no step. A client that never trained
(an unseen client, or one not sampled yet) is trained with the same budget when it is evaluated.
So the budget is the same for all clients whatever ``max_epochs`` and ``clients_per_round``
(rather than one budget per round a client happens to be sampled in, against one for the unseen
clients); a run that trains every client in one round (``clients_per_round`` = the number of
training clients, ``trainer.max_epochs=1``) does the least work. Multi-round runs are not refused:
with partial participation they bring clients in round by round, and they keep the evaluation
schedule of the experiment they are a baseline of.
"""

from __future__ import annotations

from typing import Any, Optional

from torch import Tensor

from fl_lightning.lightning_package import pl
from fl_lightning.module import FederatedModule
from fl_lightning.run import ClientRun

MODEL = "model"


class LocalOnly(FederatedModule):
    """Each client's model is trained on its own data only and evaluated on its own split.

    Args:
        **kwargs: the ``FederatedModule`` arguments; the server arguments (and ``weighting``:
            nothing is aggregated) are unused.
    """

    has_global_model = False

    def __init__(self, client: pl.LightningModule, **kwargs: Any) -> None:
        super().__init__(client, **kwargs)
        self.remove_update("delta")  # nothing is sent
        self.add_client_state(MODEL)  # absent until the client trained: it starts from the common initial model

    def client_init(self, run: ClientRun) -> None:
        """A client that trained in an earlier round (its model is in its state) has spent its budget: it
        keeps its model and takes no step; one that has not starts from the common initial model, the
        round's start (which never changes)."""
        if MODEL in run.state:
            run.start = run.state[MODEL]
            run.local.num_steps = 0

    def client_final(self, run: ClientRun) -> dict[str, Tensor]:
        """The model is kept in the store; nothing is sent."""
        run.state[MODEL] = run.end()
        return {}

    def server_update(self, aggregate: dict[str, Tensor]) -> None:
        """Nothing: there is no global model."""

    def client_eval_state(self, client_id: int) -> Optional[Tensor]:
        """The client's own model; a client that never trained is trained now with the same budget."""
        stored = self.engine.store.get(client_id, MODEL, device=self.device)
        return stored if stored is not None else self.engine.train_locally(client_id)

    def validation_step(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> None:
        """Nothing: there is no global model; clients are evaluated by ``ClientMetrics``."""

    def test_step(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> None:
        """Nothing: there is no global model; clients are evaluated by ``ClientMetrics``."""
