"""``ClassAccuracy``: overall, worst-class and minority-half accuracy of the global model.

For imbalanced training sets (the "-ST" sets of FedDRO) the mean test accuracy hides what
robust objectives are for: the classes with few training samples. After each validation run
the callback evaluates the global model on the global test set and logs

* ``{prefix}/acc``: overall accuracy;
* ``{prefix}/acc_worst_class``: the lowest per-class accuracy;
* ``{prefix}/acc_minority`` / ``{prefix}/acc_majority``: mean per-class accuracy of the
  minority classes (default: the first half, as in CIFAR-ST) and of the others;
* optionally ``{prefix}/acc_class_{c}`` for every class.

Under DDP each process evaluates every ``world``-th test sample and the per-class counts are
summed (one all-reduce), so the figures equal the single-process ones.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch
from torch import Tensor
from torch.utils.data import DataLoader, Subset

from fl_lightning.callbacks.accuracy import check_accuracy_data, inputs_and_labels
from fl_lightning.distributed import all_reduce_sum, rank_and_world
from fl_lightning.hooks import FederatedCallback, Federation
from fl_lightning.lightning_compat import log_agreed
from fl_lightning.lightning_package import move_data_to_device, pl
from fl_lightning.validation import check_int


def class_accuracy_summary(correct: Tensor, total: Tensor, minority: Sequence[int]) -> dict[str, float]:
    """Overall, worst-class, minority-mean and majority-mean accuracy from per-class counts.

    Classes absent from the test set (``total == 0``) are left out of the per-class figures.
    """
    correct, total = correct.double(), total.double()
    present = total > 0
    per_class = torch.where(present, correct / total.clamp(min=1), torch.nan)
    is_minority = torch.zeros_like(present)
    is_minority[list(minority)] = True
    return {
        "acc": float(correct.sum() / total.sum()),
        "acc_worst_class": float(per_class[present].min()),
        "acc_minority": float(per_class[present & is_minority].mean()),
        "acc_majority": float(per_class[present & ~is_minority].mean()),
    }


class ClassAccuracy(FederatedCallback):
    """Log per-class accuracy statistics of the global model after each validation run.

    Args:
        num_classes: number of classes (> 1).
        minority: the minority classes; default the first half ``0 .. num_classes // 2 - 1``.
        per_class: also log every class's accuracy.
        prefix: metric name prefix.
    """

    def __init__(
        self, num_classes: int, minority: Optional[Sequence[int]] = None, per_class: bool = False, prefix: str = "class"
    ) -> None:
        check_int("num_classes", num_classes, 2)
        minority = list(range(num_classes // 2)) if minority is None else [int(c) for c in minority]
        bad = [c for c in minority if not 0 <= c < num_classes]
        if bad or not minority:
            raise ValueError(f"minority must be a non-empty list of classes in [0, {num_classes}), got {minority}")
        self.num_classes = num_classes
        self.minority = minority
        self.per_class = per_class
        self.prefix = prefix

    @torch.no_grad()
    def class_counts(self, module: Federation) -> tuple[Tensor, Tensor]:
        """Per-class (correct, total) counts of the global model on the global test set, all processes summed."""
        rank, world = rank_and_world()
        dm = module.engine.datamodule
        test = dm.global_test_set()
        loader = DataLoader(Subset(test, range(rank, len(test), world)), batch_size=dm.eval_batch_size)
        counts = torch.zeros(2, self.num_classes, dtype=torch.float64, device=module.device)
        was_training = module.client.training
        module.client.eval()
        for batch in loader:
            x, y = inputs_and_labels(batch)
            y = y.to(module.device)
            pred = module.client(move_data_to_device(x, module.device)).argmax(-1)
            counts[0] += torch.bincount(y[pred == y], minlength=self.num_classes).double()
            counts[1] += torch.bincount(y, minlength=self.num_classes).double()
        module.client.train(was_training)
        counts = all_reduce_sum(counts)
        return counts[0], counts[1]

    def setup(self, trainer: pl.Trainer, pl_module: Federation, stage: str) -> None:
        check_accuracy_data(pl_module, type(self).__name__)

    def on_validation_epoch_end(self, trainer: pl.Trainer, pl_module: Federation) -> None:
        if trainer.sanity_checking:
            return
        correct, total = self.class_counts(pl_module)
        for name, value in class_accuracy_summary(correct, total, self.minority).items():
            log_agreed(pl_module, f"{self.prefix}/{name}", value, batch_size=1)
        if self.per_class:
            for c in range(self.num_classes):
                if total[c] > 0:
                    log_agreed(pl_module, f"{self.prefix}/acc_class_{c}", float(correct[c] / total[c]), batch_size=1)
