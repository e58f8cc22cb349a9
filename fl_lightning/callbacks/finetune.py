"""``LocalFinetuning``: the "global model + local finetuning" baseline of personalized FL.

After each validation run, every selected client copies the global model, runs ``steps``
plain local optimizer steps (its own loss and ``configure_optimizers``, whatever the
algorithm: ``module.engine.train_clients_locally``; the batched client backend finetunes
blocks of clients at once, each block's steps vectorized) on its training split and is evaluated on its
own split; the global model is left unchanged, so training is not affected. Logs the mean /
worst / 10th percentile of the finetuned clients' accuracies, like ``ClientMetrics`` (whose
client selection, splits and summary it reuses: it only changes the model evaluated).
"""

from __future__ import annotations

from typing import Iterator, Optional, Sequence, Union

from torch import Tensor

from fl_lightning.callbacks.client_metrics import ClientMetrics, Population
from fl_lightning.datamodules.client_data import Split
from fl_lightning.hooks import Federation
from fl_lightning.lightning_package import pl
from fl_lightning.validation import check_int


class LocalFinetuning(ClientMetrics):
    """Evaluate each client's finetuned copy of the global model.

    Args:
        steps: local finetuning steps per client (batches of the datamodule's ``batch_size``,
            drawn from (seed, "finetune", client)).
        split: the clients' split to evaluate, or several (``["val", "test"]``): each client is
            finetuned once and its copy evaluated on each, which one callback per split would
            do twice (the same copy: the finetuning's batches do not depend on the split).
        clients: ``train``, ``unseen`` or ``all``.
        prefix: metric name prefix (default ``finetuned_<split>`` or ``finetuned_unseen_<split>``);
            only with a single split.
    """

    name = "finetuned"

    def __init__(
        self,
        steps: int = 20,
        split: Union[Split, Sequence[Split]] = "test",
        clients: Population = "train",
        prefix: Optional[str] = None,
    ) -> None:
        check_int("steps", steps, 1)
        super().__init__(split, clients, prefix)
        self.steps = steps

    def setup(self, trainer: pl.Trainer, pl_module: Federation, stage: str) -> None:
        super().setup(trainer, pl_module, stage)
        if not pl_module.has_global_model:
            raise ValueError(
                f"LocalFinetuning finetunes the global model, and {type(pl_module).__name__} trains none (each client's "
                "model comes from the algorithm itself): evaluate the clients' own models with ClientMetrics instead"
            )

    def client_states(self, module: Federation, client_ids: Sequence[int]) -> Iterator[tuple[int, Tensor]]:
        """Each client's global model after ``steps`` plain local steps on its training split, by
        the run's client backend: the batched backend finetunes blocks of clients at once
        (``module.engine.train_clients_locally``)."""
        return module.engine.train_clients_locally(client_ids, steps=self.steps, stream="finetune", round_idx=0)
