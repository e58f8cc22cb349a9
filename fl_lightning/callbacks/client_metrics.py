"""``ClientMetrics``: the distribution of accuracy over clients, not only its pooled mean.

After each validation run, every client's model (the global model, or the algorithm's
personalized model for that client, see ``FederatedModule.client_eval_state``) is evaluated
on the client's own split; the callback logs the mean, the worst and the 10th percentile
of client accuracy. Under DDP the clients are divided over processes and the accuracies
gathered, so the figures equal the single-process ones.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal, Optional

import pytorch_lightning as pl
import torch
from torch import Tensor

from fl_lightning.distributed import map_clients
from fl_lightning.hooks import FederatedCallback

if TYPE_CHECKING:
    from fl_lightning.module import FederatedModule


def accuracy_summary(accuracies: Tensor, prefix: str) -> dict[str, float]:
    """Mean, worst and 10th percentile of per-client accuracies."""
    acc = accuracies.double()
    return {
        f"{prefix}/acc_mean": float(acc.mean()),
        f"{prefix}/acc_worst": float(acc.min()),
        f"{prefix}/acc_p10": float(torch.quantile(acc, 0.1)),
    }


class ClientMetrics(FederatedCallback):
    """Log per-client accuracy statistics after validation.

    Args:
        split: the clients' split to evaluate (``test`` or ``val``).
        clients: ``train`` (clients that take part in training), ``unseen`` or ``all``.
        prefix: metric name prefix (default ``clients`` or ``clients_unseen``).
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
        self.prefix = prefix or ("clients" if clients != "unseen" else "clients_unseen")

    def _client_ids(self, module: "FederatedModule") -> list[int]:
        dm = module.datamodule
        if self.clients == "train":
            return list(dm.train_clients)
        if self.clients == "unseen":
            return list(dm.unseen_clients)
        return list(range(dm.num_clients))

    def on_validation_epoch_end(self, trainer: pl.Trainer, pl_module: "FederatedModule") -> None:
        if trainer.sanity_checking:
            return
        results = self.evaluate(pl_module)
        if results:
            accs = torch.tensor([a for _, a in sorted(results.items())])
            for name, value in accuracy_summary(accs, self.prefix).items():
                pl_module.log(name, value, batch_size=1)

    def evaluate(self, module: "FederatedModule") -> dict[int, float]:
        """Accuracy of each client's model on its own split, gathered from all processes."""
        dm = module.datamodule

        def accuracy(cid: int) -> Optional[float]:
            data = dm.client_data(cid, self.split)
            return module.client_accuracy(cid, data) if len(data) > 0 else None

        return map_clients(accuracy, self._client_ids(module))
