"""torchvision datasets as federations: MNIST, Fashion-MNIST, CIFAR-10, CIFAR-100.

The images are read once through torchvision (``root``, ``download``) and kept as one
float tensor (pixels in [0, 1], standardized per channel unless ``normalize=False``), so a
client's mini-batch is a tensor slice. No augmentation is
applied (the federated papers implemented here use none).
"""

from __future__ import annotations

from typing import Any, ClassVar, Optional

import numpy as np
import torch
from torch.utils.data import Dataset, TensorDataset

from fl_lightning.datamodules.base import FederatedDataModule


class _TorchvisionDataset:
    """A class of ``torchvision.datasets`` by name, imported when first read: torchvision is imported only
    where a vision dataset is used (a deployment node's process imports fl_lightning at every message)."""

    def __init__(self, name: str) -> None:
        self.name = name

    def __get__(self, instance: Any, owner: type) -> Any:
        from torchvision import datasets

        return getattr(datasets, self.name)


class TorchvisionFederated(FederatedDataModule):
    """A torchvision classification dataset split into clients.

    Args:
        root: directory holding the dataset in torchvision's layout.
        download: let torchvision download it if missing (needs internet).
        normalize: standardize each channel with the dataset's mean and std; False keeps the
            pixels in [0, 1].
        **kwargs: the ``FederatedDataModule`` arguments.
    """

    dataset_cls: ClassVar[Any]
    mean: ClassVar[tuple[float, ...]]
    std: ClassVar[tuple[float, ...]]

    def __init__(self, root: str = "data", download: bool = False, normalize: bool = True, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.root = root
        self.download = download
        self.normalize = normalize

    def prepare_data(self) -> None:
        if self.download:
            for train in (True, False):
                self.dataset_cls(self.root, train=train, download=True)

    def _load(self, train: bool) -> TensorDataset:
        try:
            ds = self.dataset_cls(self.root, train=train, download=False)
        except RuntimeError as err:
            raise RuntimeError(
                f"{self.dataset_cls.__name__} not found under root={self.root!r}; pass download=True "
                "(needs internet) or point root at a copy in torchvision's layout"
            ) from err
        x = torch.as_tensor(np.asarray(ds.data)).float().div_(255.0)
        x = x.unsqueeze(1) if x.dim() == 3 else x.permute(0, 3, 1, 2)  # [N, C, H, W]
        if self.normalize:
            x = (x - torch.tensor(self.mean).view(1, -1, 1, 1)) / torch.tensor(self.std).view(1, -1, 1, 1)
        y = torch.as_tensor(np.asarray(ds.targets), dtype=torch.long)
        return TensorDataset(x, y)

    def build_datasets(self) -> tuple[Dataset, Optional[Dataset]]:
        return self._load(train=True), self._load(train=False)


class MNISTFederated(TorchvisionFederated):
    """MNIST (60,000 train / 10,000 test, 1x28x28) split into clients."""

    dataset_cls = _TorchvisionDataset("MNIST")
    mean, std = (0.1307,), (0.3081,)
    num_classes = 10


class FashionMNISTFederated(TorchvisionFederated):
    """Fashion-MNIST (60,000 / 10,000, 1x28x28) split into clients."""

    dataset_cls = _TorchvisionDataset("FashionMNIST")
    mean, std = (0.2860,), (0.3530,)
    num_classes = 10


class CIFAR10Federated(TorchvisionFederated):
    """CIFAR-10 (50,000 / 10,000, 3x32x32) split into clients."""

    dataset_cls = _TorchvisionDataset("CIFAR10")
    mean, std = (0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)
    num_classes = 10


class CIFAR100Federated(TorchvisionFederated):
    """CIFAR-100 (50,000 / 10,000, 3x32x32) split into clients."""

    dataset_cls = _TorchvisionDataset("CIFAR100")
    mean, std = (0.5071, 0.4865, 0.4409), (0.2673, 0.2564, 0.2762)
    num_classes = 100
