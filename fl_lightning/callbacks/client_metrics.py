"""``ClientMetrics``: the distribution of accuracy over clients, not only its pooled mean.

After each validation run, every client's model (the global model, or the algorithm's
personalized model for that client, see ``FederatedModule.client_eval_state``) is evaluated
on the client's own split; the callback logs the mean, the worst and the 10th percentile
of client accuracy, under names that say the split (``clients_test/acc_mean``,
``clients_unseen_val/acc_worst``...). Under DDP the clients are divided over processes and the
accuracies gathered, so the figures equal the single-process ones. When every selected client's
split is empty (``test_fraction=0``, say) it warns once instead of logging nothing silently.
"""

from __future__ import annotations

from typing import Any, Literal, Optional

import pytorch_lightning as pl
import torch
from pytorch_lightning.utilities import rank_zero_warn
from torch import Tensor

from fl_lightning.callbacks.accuracy import client_accuracy
from fl_lightning.distributed import map_clients
from fl_lightning.functional.client_summaries import summarize
from fl_lightning.hooks import FederatedCallback, Federation


def accuracy_summary(accuracies: Tensor, prefix: str) -> dict[str, float]:
    """Mean (uniform over clients), worst and 10th percentile of per-client accuracies
    (:func:`~fl_lightning.functional.client_summaries.summarize`'s figures)."""
    summary = summarize(accuracies, torch.ones_like(accuracies), higher_is_better=True, percentiles=(10,))
    return {f"{prefix}/acc_{stat}": summary[stat] for stat in ("mean", "worst", "p10")}


def default_prefix(name: str, split: str, clients: str) -> str:
    """A metric prefix naming the evaluated split and, for unseen clients, that they are unseen."""
    return f"{name}_unseen_{split}" if clients == "unseen" else f"{name}_{split}"


def population(datamodule: Any, clients: str) -> list[int]:
    """The ids of the clients a metric callback draws from: ``train`` (those that take part in
    training), ``unseen`` or ``all``."""
    if clients == "train":
        return sorted(datamodule.train_clients)
    if clients == "unseen":
        return sorted(datamodule.unseen_clients)
    return list(range(datamodule.num_clients))


class ClientMetrics(FederatedCallback):
    """Log per-client accuracy statistics after validation.

    Args:
        split: the clients' split to evaluate (``test``, ``val``, or ``train``: the data they
            train on, which is large and optimistic).
        clients: ``train`` (clients that take part in training), ``unseen`` or ``all``.
        prefix: metric name prefix (default ``clients_<split>`` or ``clients_unseen_<split>``).
    """

    def __init__(
        self,
        split: Literal["train", "val", "test"] = "test",
        clients: Literal["train", "unseen", "all"] = "train",
        prefix: Optional[str] = None,
    ) -> None:
        if split not in ("train", "val", "test"):
            raise ValueError(f"split must be 'train', 'val' or 'test', got {split!r}")
        if clients not in ("train", "unseen", "all"):
            raise ValueError(f"clients must be 'train', 'unseen' or 'all', got {clients!r}")
        self.split = split
        self.clients = clients
        self.prefix = prefix or default_prefix("clients", split, clients)
        self._warned = False

    def on_validation_epoch_end(self, trainer: pl.Trainer, pl_module: Federation) -> None:
        if trainer.sanity_checking:
            return
        results = self.evaluate(pl_module)
        if not results and not self._warned:
            self._warned = True
            rank_zero_warn(
                f"{type(self).__name__}(split={self.split!r}, clients={self.clients!r}) has nothing to evaluate: "
                f"the selected clients' {self.split!r} splits are empty (set the datamodule's "
                f"{self.split}_fraction > 0, or choose another split)"
            )
        if results:
            accs = torch.tensor([a for _, a in sorted(results.items())])
            for name, value in accuracy_summary(accs, self.prefix).items():
                pl_module.log(name, value, batch_size=1)

    def evaluate(self, module: Federation) -> dict[int, float]:
        """Accuracy of each client's model on its own split, gathered from all processes."""
        dm = module.datamodule

        def accuracy(cid: int) -> Optional[float]:
            data = dm.client_data(cid, self.split)
            return client_accuracy(module, cid, data) if len(data) > 0 else None

        return map_clients(accuracy, population(module.datamodule, self.clients))
