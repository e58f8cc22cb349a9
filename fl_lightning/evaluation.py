"""``ClientEvaluation``: validation, test and predict run the client module's own hooks on the global model.

Between rounds the client module holds the global model, so the federated module's
``validation_step``/``test_step``/``predict_step`` are the client's, and the metrics it logs are
the global model's; on several processes, the whole set's (:mod:`fl_lightning.evaluation_logging`).
Federated evaluation of each client's own model is done by callbacks
(:mod:`fl_lightning.callbacks`), through the engine's
:meth:`~fl_lightning.engine.FederationEngine.evaluate_clients`: the client
module's own hook on each client's split, by the run's client backend.
"""

from __future__ import annotations

from typing import Any, Optional

from fl_lightning.distributed import is_distributed
from fl_lightning.evaluation_logging import EvaluationLogs, check_no_step_syncs
from fl_lightning.lightning_compat import routed_log, set_current_hook
from fl_lightning.lightning_package import attach_trainer, overrides_hook, pl



class ClientEvaluation(pl.LightningModule):
    """The hooks of a module that wraps a client ``LightningModule`` (``self.client``): evaluation, and the
    Trainer attached to both."""

    client: pl.LightningModule
    #: the run's machinery (:class:`~fl_lightning.engine.FederationEngine`; not imported: it imports this module)
    engine: Any
    #: the client's ``self.log`` calls of the current validation or test epoch on several processes
    _evaluation_logs: Optional[EvaluationLogs] = None

    @pl.LightningModule.trainer.setter  # Lightning's property (its getter unchanged), with this setter
    def trainer(self, trainer: Optional[pl.Trainer]) -> None:
        """Attach ``trainer`` as Lightning does, and to a client module of the other Lightning package too
        (:func:`~fl_lightning.lightning_package.attach_trainer`), which Lightning's setter passes over."""
        pl.LightningModule.trainer.fset(self, trainer)
        attach_trainer(self, trainer)

    def validation_step(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> Any:
        return self._client_hook("validation_step", batch, batch_idx)

    def test_step(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> Any:
        return self._client_hook("test_step", batch, batch_idx)

    def predict_step(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> Any:
        """The client's own ``predict_step``; for a client without one, the global model's
        outputs on the inputs: the batch's first element (the datamodule's batches are ``(x, y)``)."""
        if overrides_hook(self.client, "predict_step"):
            return self._client_hook("predict_step", batch, batch_idx)
        return self.client(batch[0] if isinstance(batch, (list, tuple)) else batch)

    def on_validation_epoch_start(self) -> None:
        self._start_evaluation_logs("on_validation_epoch_end")
        self._client_hook("on_validation_epoch_start")

    def on_validation_epoch_end(self) -> None:
        self._client_hook("on_validation_epoch_end")
        self._flush_evaluation_logs()
        if self.trainer.state.fn == "fit" and not self.trainer.sanity_checking:
            self.engine.log_round_step()

    def on_test_epoch_start(self) -> None:
        self._start_evaluation_logs("on_test_epoch_end")
        self._client_hook("on_test_epoch_start")

    def on_test_epoch_end(self) -> None:
        self._client_hook("on_test_epoch_end")
        self._flush_evaluation_logs()

    def _start_evaluation_logs(self, epoch_end: str) -> None:
        """On several processes, route the client's ``self.log`` in the epoch's hooks to an
        :class:`~fl_lightning.evaluation_logging.EvaluationLogs`, which logs the whole set's values at
        the epoch's end (``epoch_end``); in one process the client logs through Lightning as it would alone."""
        self._evaluation_logs = None
        if is_distributed():
            check_no_step_syncs(self.client)
            self._evaluation_logs = EvaluationLogs(self.client, epoch_end)

    def _flush_evaluation_logs(self) -> None:
        """Log the epoch's routed values (on every process: a collective) and end the routing."""
        logs, self._evaluation_logs = self._evaluation_logs, None
        if logs is not None:
            logs.flush()

    def _client_hook(self, name: str, *args: Any) -> Any:
        set_current_hook(self.client, name)
        logs = self._evaluation_logs
        if logs is None:
            return getattr(self.client, name)(*args)
        logs.start(args[0] if name.endswith("_step") else None)
        with routed_log(self.client, logs.log):
            return getattr(self.client, name)(*args)
