"""``LockstepModule``: algorithms whose clients move in lock-step, sharing a value at every local step.

In an ordinary round each client runs its local steps on its own. A lock-step algorithm (FedDRO)
needs a server round-trip inside the round: before every local step each client shares a value
(:meth:`LockstepModule.client_share`), the server replies to their mean
(:meth:`LockstepModule.server_share`), and every client's step reads the reply as
``run.local.shared``. A work item is then one local step of all of this process's clients (the backends'
shared driver, :mod:`fl_lightning.backends.base`), so a round has ``local_steps`` work items.
"""

from __future__ import annotations

from typing import Any, ClassVar, Optional

import torch
from torch import Tensor

from fl_lightning.checkpoints import CheckpointError
from fl_lightning.distributed import rank_and_world
from fl_lightning.engine import FederationEngine
from fl_lightning.module import FederatedModule
from fl_lightning.run import ClientRun
from fl_lightning.update import all_finite


class LockstepEngine(FederationEngine):
    """The engine of a :class:`LockstepModule`: the server's state as a refused round puts it back holds
    the ``shared`` value the round started from (a refused round's estimate, made of its clients' refused
    trajectories, is not kept)."""

    module: "LockstepModule"

    def server_state(self) -> dict[str, Any]:
        return {**super().server_state(), "shared": self.module._shared_at_start}

    def load_server_state(self, state: dict[str, Any]) -> None:
        super().load_server_state(state)
        self.module.shared = state["shared"]


class LockstepModule(FederatedModule):
    """A ``FederatedModule`` whose clients move in lock-step, with ``client_share``/``server_share``
    between their steps. Needs at least one client per process and a fixed ``local_steps``."""

    lockstep: ClassVar[bool] = True
    _engine_class = LockstepEngine
    #: the server's latest ``server_share`` reply (kept across rounds, checkpointed); None before the first
    shared: Optional[Tensor] = None
    #: ``shared`` as the round started (put back when the round is refused)
    _shared_at_start: Optional[Tensor] = None

    def client_share(self, run: ClientRun, batch: Any) -> Optional[Tensor]:
        """The value client ``run.client_id`` shares before local step ``run.local.step_index`` on
        ``batch`` (None: nothing to share at this step). The engine averages the round's values,
        weighted by sample count, over all processes."""
        return None

    def server_share(self, mean: Tensor) -> Tensor:
        """The server's reply to the mean of the shared values; every client reads it as
        ``run.local.shared`` in its step. Default: the mean."""
        return mean

    def on_train_epoch_start(self) -> None:
        self._shared_at_start = self.shared  # replaced at each step, never changed in place
        super().on_train_epoch_start()

    def setup(self, stage: str) -> None:
        super().setup(stage)
        _, world = rank_and_world()
        if stage == "fit" and self.clients_per_round < world:
            raise ValueError(
                f"{type(self).__name__} moves its clients in lock-step and needs at least one client per process: "
                f"clients_per_round={self.clients_per_round} < {world} processes"
            )

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        super().on_save_checkpoint(checkpoint)
        checkpoint["federated"]["shared"] = None if self.shared is None else self.shared.cpu()

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        shared = checkpoint.get("federated", {}).get("shared")
        if shared is not None and not all_finite([shared]):
            raise CheckpointError("the checkpoint holds NaN or Inf in the lock-step shared value; it cannot be resumed")
        super().on_load_checkpoint(checkpoint)
        self.shared = None if shared is None else torch.as_tensor(shared).to(self.device)
