"""FedDRO's "-ST" imbalanced sets under the class names the shipped configs use.

Each is its torchvision datamodule with ``subsample=ImbalancedSubsample(keep, minority_half)``
(:mod:`fl_lightning.datamodules.subsample`), which a config can also write directly::

    data:
      class_path: fl_lightning.datamodules.MNISTFederated
      init_args:
        subsample: {class_path: fl_lightning.datamodules.ImbalancedSubsample, init_args: {keep: 100}}
"""

from __future__ import annotations

from typing import Any

from fl_lightning.datamodules.subsample import ImbalancedSubsample, MinorityHalf
from fl_lightning.datamodules.vision import CIFAR10Federated, CIFAR100Federated, MNISTFederated


class MNISTSTFederated(MNISTFederated):
    """MNIST-ST: digits 0-4 keep their last ``keep`` training images (29,904 train / 10,000 test).

    Args:
        keep: training images kept per minority class.
        minority_half: ``"first"`` or ``"second"`` half of the classes is the minority.
        **kwargs: the ``MNISTFederated`` arguments.
    """

    def __init__(self, keep: int = 100, minority_half: MinorityHalf = "first", **kwargs: Any) -> None:
        super().__init__(subsample=ImbalancedSubsample(keep, minority_half), **kwargs)


class CIFAR10STFederated(CIFAR10Federated):
    """CIFAR10-ST: classes 0-4 keep their last ``keep`` training images (25,500 train / 10,000 test).

    Args:
        keep: training images kept per minority class.
        minority_half: ``"first"`` or ``"second"`` half of the classes is the minority.
        **kwargs: the ``CIFAR10Federated`` arguments.
    """

    def __init__(self, keep: int = 100, minority_half: MinorityHalf = "first", **kwargs: Any) -> None:
        super().__init__(subsample=ImbalancedSubsample(keep, minority_half), **kwargs)


class CIFAR100STFederated(CIFAR100Federated):
    """CIFAR100-ST: classes 0-49 keep their last ``keep`` training images (30,000 train / 10,000 test).

    Args:
        keep: training images kept per minority class.
        minority_half: ``"first"`` or ``"second"`` half of the classes is the minority.
        **kwargs: the ``CIFAR100Federated`` arguments.
    """

    def __init__(self, keep: int = 100, minority_half: MinorityHalf = "first", **kwargs: Any) -> None:
        super().__init__(subsample=ImbalancedSubsample(keep, minority_half), **kwargs)
