"""Subsamples of a datamodule's pool, applied in ``setup`` before the partition.

A datamodule takes one as ``subsample=`` (in YAML: ``class_path`` / ``init_args``); only the
pool is cut, the global test set is unchanged. :class:`ImbalancedSubsample` makes the "-ST"
imbalanced sets of FedDRO's experiments (MNIST-ST, CIFAR10-ST, CIFAR100-ST)::

    CIFAR10Federated(num_clients=8, partition="iid", subsample=ImbalancedSubsample(keep=100))
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import ClassVar, Literal

import numpy as np

from fl_lightning.validation import check_int

MinorityHalf = Literal["first", "second"]


def check_st(keep: int, minority_half: MinorityHalf) -> None:
    """Refuse "-ST" arguments that are invalid whatever the data."""
    check_int("keep", keep, 1)
    if minority_half not in ("first", "second"):
        raise ValueError(f"minority_half must be 'first' or 'second', got {minority_half!r}")


def st_indices(labels: np.ndarray, keep: int = 100, minority_half: MinorityHalf = "first") -> np.ndarray:
    """Sorted indices of the "-ST" subset: the minority half of the classes keeps its last ``keep`` samples.

    "Only the last 100 images are retained for each class in the first half of the classes"
    (FedDRO, appendix; the construction of Qi et al.): classes ``0 .. C/2 - 1`` are cut to their
    last ``keep`` samples in dataset order, the other classes are unchanged. CIFAR10-ST has
    5 x 100 + 5 x 5000 = 25,500 training images, CIFAR100-ST 50 x 100 + 50 x 500 = 30,000,
    MNIST-ST 5 x 100 + 29,404 = 29,904.

    Args:
        labels: integer labels of the pool, in dataset order.
        keep: samples kept per minority class (>= 1); the last ones in dataset order.
        minority_half: ``"first"`` (classes ``0 .. C/2 - 1``, the paper) or ``"second"``
            (``C/2 .. C - 1``, Qi et al.'s code).
    """
    check_st(keep, minority_half)
    labels = np.asarray(labels)
    num_classes = int(labels.max()) + 1
    half = num_classes // 2
    minority = range(half) if minority_half == "first" else range(half, num_classes)
    mask = ~np.isin(labels, list(minority))
    for c in minority:
        mask[np.flatnonzero(labels == c)[-keep:]] = True
    return np.flatnonzero(mask)


class Subsample(ABC):
    """Which samples of the pool a datamodule keeps (before partitioning)."""

    #: whether it keeps samples by class: a datamodule whose targets are not class labels refuses it
    reads_labels: ClassVar[bool] = False

    @abstractmethod
    def indices(self, labels: np.ndarray) -> np.ndarray:
        """Sorted indices of the samples kept, given the targets of the pool."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}({', '.join(f'{k}={v!r}' for k, v in vars(self).items())})"


class ImbalancedSubsample(Subsample):
    """The "-ST" imbalanced pool: the minority half of the classes keeps its last ``keep``
    samples (see :func:`st_indices`).

    Args:
        keep: samples kept per minority class.
        minority_half: ``"first"`` (the paper) or ``"second"`` half of the classes is the minority.
    """

    reads_labels = True

    def __init__(self, keep: int = 100, minority_half: MinorityHalf = "first") -> None:
        check_st(keep, minority_half)
        self.keep = keep
        self.minority_half = minority_half

    def indices(self, labels: np.ndarray) -> np.ndarray:
        return st_indices(labels, self.keep, self.minority_half)
