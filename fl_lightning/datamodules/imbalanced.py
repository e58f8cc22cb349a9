"""The "-ST" imbalanced sets of FedDRO's experiments: MNIST-ST, CIFAR10-ST, CIFAR100-ST.

"Only the last 100 images are retained for each class in the first half of the classes"
(FedDRO, appendix; the construction of Qi et al.): the training set of classes
``0 .. C/2 - 1`` is cut to its last ``keep`` images in dataset order, the other classes and
the test set are unchanged. CIFAR10-ST has 5 x 100 + 5 x 5000 = 25,500 training images,
CIFAR100-ST 50 x 100 + 50 x 500 = 30,000, MNIST-ST 5 x 100 + 29,404 = 29,904. The
imbalanced set is then split over clients by the usual partitioner (the paper: an equal
random split, ``partition="iid"``).
"""

from __future__ import annotations

from typing import Any, Literal, Optional

import numpy as np
from torch.utils.data import Dataset, TensorDataset

from fl_lightning.datamodules.vision import CIFAR10Federated, CIFAR100Federated, MNISTFederated, TorchvisionFederated

MinorityHalf = Literal["first", "second"]


def st_indices(labels: np.ndarray, keep: int = 100, minority_half: MinorityHalf = "first") -> np.ndarray:
    """Sorted indices of the "-ST" subset: the minority half of the classes keeps its last ``keep`` samples.

    Args:
        labels: integer labels of the training set, in dataset order.
        keep: samples kept per minority class (>= 1); the last ones in dataset order.
        minority_half: ``"first"`` (classes ``0 .. C/2 - 1``, the paper) or ``"second"``
            (``C/2 .. C - 1``, Qi et al.'s code).
    """
    if minority_half not in ("first", "second"):
        raise ValueError(f"minority_half must be 'first' or 'second', got {minority_half!r}")
    if keep < 1:
        raise ValueError(f"keep must be >= 1, got {keep}")
    labels = np.asarray(labels)
    num_classes = int(labels.max()) + 1
    half = num_classes // 2
    minority = range(half) if minority_half == "first" else range(half, num_classes)
    mask = ~np.isin(labels, list(minority))
    for c in minority:
        mask[np.flatnonzero(labels == c)[-keep:]] = True
    return np.flatnonzero(mask)


class STMixin:
    """Cuts the training pool of a ``TorchvisionFederated`` to its "-ST" subset (see :func:`st_indices`).

    Args:
        keep: training images kept per minority class.
        minority_half: ``"first"`` or ``"second"`` half of the classes is the minority.
        **kwargs: the ``TorchvisionFederated`` arguments (``root``, ``num_clients``, ``batch_size``...).
    """

    def __init__(self, keep: int = 100, minority_half: MinorityHalf = "first", **kwargs: Any) -> None:
        st_indices(np.arange(2), keep, minority_half)  # validates the arguments early
        super().__init__(**kwargs)  # type: ignore[call-arg]
        self.keep = keep
        self.minority_half = minority_half

    def build_datasets(self) -> tuple[Dataset, Optional[Dataset]]:
        pool, test = TorchvisionFederated.build_datasets(self)  # type: ignore[arg-type]
        x, y = pool.tensors
        idx = st_indices(y.numpy(), self.keep, self.minority_half)
        return TensorDataset(x[idx], y[idx]), test


class MNISTSTFederated(STMixin, MNISTFederated):
    """MNIST-ST: digits 0-4 keep their last 100 training images (29,904 train / 10,000 test)."""


class CIFAR10STFederated(STMixin, CIFAR10Federated):
    """CIFAR10-ST: classes 0-4 keep their last 100 training images (25,500 train / 10,000 test)."""


class CIFAR100STFederated(STMixin, CIFAR100Federated):
    """CIFAR100-ST: classes 0-49 keep their last 100 training images (30,000 train / 10,000 test)."""
