"""The interface between the round loop and a client backend."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from fl_lightning.module import FederatedModule


class ClientBackend:
    """Executes the client protocol (``client_init``, ``client_step``, ``client_final`` and, in
    lock-step rounds, ``client_share``) for this process's clients of a round.

    A round is a sequence of work items (the Trainer's "batches" of the epoch). The backend
    says how many there are, plans them when the round starts and runs them one by one; every
    finished client is handed to ``module.receive(update, state)``.
    """

    def num_work_items(self, module: "FederatedModule") -> int:
        """Work items per round on this process (the same on every process)."""
        raise NotImplementedError

    def start_round(self, module: "FederatedModule", clients: list[int]) -> list[Any]:
        """Plan the round for this process's ``clients``; returns the work items."""
        raise NotImplementedError

    def run_work_item(self, module: "FederatedModule", item: Any) -> None:
        """Run one work item."""
        raise NotImplementedError
