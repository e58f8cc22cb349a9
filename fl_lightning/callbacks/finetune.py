"""``LocalFinetuning``: the "global model + local finetuning" baseline of personalized FL.

After each validation run, every selected client copies the global model, runs ``steps``
plain local optimizer steps (its own loss and ``configure_optimizers``, whatever the
algorithm: ``FederatedModule.train_locally``) on its training split and is evaluated on its
own split; the global model is left unchanged, so training is not affected. Logs the mean / worst / 10th percentile of the finetuned clients' accuracies, like
``ClientMetrics`` (whose client selection and summary it reuses).
"""

from __future__ import annotations

from typing import Literal, Optional

import pytorch_lightning as pl

from fl_lightning.callbacks.accuracy import accuracy_of
from fl_lightning.callbacks.client_metrics import ClientMetrics, default_prefix, population
from fl_lightning.distributed import map_clients
from fl_lightning.hooks import Federation


class LocalFinetuning(ClientMetrics):
    """Evaluate each client's finetuned copy of the global model.

    Args:
        steps: local finetuning steps per client (batches of the datamodule's ``batch_size``,
            drawn from (seed, "finetune", client)).
        split: the clients' split to evaluate.
        clients: ``train``, ``unseen`` or ``all``.
        prefix: metric name prefix (default ``finetuned_<split>`` or ``finetuned_unseen_<split>``).
    """

    def __init__(
        self,
        steps: int = 20,
        split: Literal["train", "val", "test"] = "test",
        clients: Literal["train", "unseen", "all"] = "train",
        prefix: Optional[str] = None,
    ) -> None:
        if steps < 1:
            raise ValueError(f"steps must be >= 1, got {steps}")
        super().__init__(split, clients, prefix or default_prefix("finetuned", split, clients))
        self.steps = steps

    def setup(self, trainer: pl.Trainer, pl_module: Federation, stage: str) -> None:
        if not pl_module.has_global_model:
            raise ValueError(
                f"LocalFinetuning finetunes the global model, and {type(pl_module).__name__} trains none (each client's "
                "model comes from the algorithm itself): evaluate the clients' own models with ClientMetrics instead"
            )

    def finetuned_accuracy(self, module: Federation, client_id: int) -> float:
        """Accuracy on the client's split of the global model after ``steps`` plain local steps."""
        finetuned = module.train_locally(client_id, steps=self.steps, stream="finetune", round_idx=0)
        return accuracy_of(module, finetuned, module.datamodule.client_data(client_id, self.split))

    def evaluate(self, module: Federation) -> dict[int, float]:
        dm = module.datamodule

        def accuracy(cid: int) -> Optional[float]:
            return self.finetuned_accuracy(module, cid) if len(dm.client_data(cid, self.split)) > 0 else None

        return map_clients(accuracy, population(module.datamodule, self.clients))
