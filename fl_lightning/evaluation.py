"""``ClientEvaluation``: validation, test and predict run the client module's own hooks on the global model.

Between rounds the client module holds the global model, so the federated module's
``validation_step``/``test_step``/``predict_step`` are the client's, and the metrics it logs are
the global model's; on several processes, the whole set's (:mod:`fl_lightning.evaluation_logging`).
Federated evaluation of each client's own model is done by callbacks
(:mod:`fl_lightning.callbacks`), through :meth:`ClientEvaluation.evaluate_clients`: the client
module's own hook on each client's split, by the run's client backend.
"""

from __future__ import annotations

from typing import Any, Callable, Iterator, Literal, Optional, Sequence

from torch import Tensor

from fl_lightning.backends import ClientBackend, ClientContext
from fl_lightning.backends.sequential import train_one_by_one
from fl_lightning.backends.evaluate import check_evaluation
from fl_lightning.datamodules.client_data import Split
from fl_lightning.distributed import is_distributed
from fl_lightning.evaluation_logging import EvaluationLogs, check_no_step_syncs
from fl_lightning.lightning_compat import log_agreed, routed_log, set_current_hook
from fl_lightning.lightning_package import overrides_hook, pl
from fl_lightning.update import ClientResult
from fl_lightning.vectors import ModelVector


class ClientEvaluation(pl.LightningModule):
    """The evaluation hooks of a module that wraps a client ``LightningModule`` (``self.client``),
    and the plain local training that evaluation needs (finetuning, fitting an unseen client)."""

    client: pl.LightningModule
    context: ClientContext
    backend: ClientBackend
    #: the state vector a client is evaluated with (None: the global model); ``FederatedModule``'s
    client_eval_state: Callable[[int], Optional[Tensor]]
    global_model: ModelVector
    local_steps: Optional[int]
    #: the client's ``self.log`` calls of the current validation or test epoch on several processes
    _evaluation_logs: Optional[EvaluationLogs] = None

    def train_locally(
        self,
        client_id: int,
        start: Optional[Tensor] = None,
        steps: Optional[int] = None,
        stream: str = "batches",
        round_idx: Optional[int] = None,
    ) -> Tensor:
        """Plain local training of client ``client_id``, for any algorithm: its module's loss and
        optimizer, from ``start`` (default: the global model); returns the trained state vector.

        This is the one entry point of callbacks' local work (finetuning, fitting an unseen
        client). The client module is left as it was; batches come from
        ``(seed, stream, round_idx, client)`` (``round_idx`` defaults to the current round).
        """
        ((_, end),) = train_one_by_one(self.context, [client_id], *self._plain_work(start, steps, round_idx, stream))
        return end

    def train_clients_locally(
        self,
        client_ids: Sequence[int],
        start: Optional[Tensor] = None,
        steps: Optional[int] = None,
        stream: str = "batches",
        round_idx: Optional[int] = None,
    ) -> Iterator[tuple[int, Tensor]]:
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
        start = self.global_model.flatten() if start is None else start.to(self.device)
        return (start, steps if steps is not None else self.local_steps, stream,
                self.current_epoch if round_idx is None else round_idx)

    def evaluate_clients(
        self,
        client_ids: Sequence[int],
        split: Split,
        hook: Literal["validation_step", "test_step"] = "validation_step",
        personalized: bool = True,
    ) -> list[ClientResult]:
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
        check_evaluation(self.client, split, hook)
        state_of = self.client_eval_state if personalized else _global_model
        return self.backend.evaluate(self.context, client_ids, state_of, split, hook)

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
            self.log_round_step()

    def log_round_step(self) -> None:
        """Make the number of rounds done the loggers' step for the metrics logged with this
        epoch's (Lightning takes a logged ``step`` as the x-axis): plots read rounds, not work
        items. ``epoch`` (the 0-based index) is kept beside it, as Lightning logs it. Without a
        logger there is no axis to set (and each ``self.log`` costs a fraction of a millisecond)."""
        if not self.trainer.loggers:
            return
        log_agreed(self, "step", float(self.current_epoch + 1), on_step=False, on_epoch=True, batch_size=1)
        log_agreed(self, "epoch", float(self.current_epoch), on_step=False, on_epoch=True, batch_size=1)

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



def _global_model(client_id: int) -> None:
    """Every client's evaluation model when not personalized: the global model."""
    return None
