"""A federated datamodule over data of your own: return the pool and the test set from build_datasets."""

import torch
from torch.utils.data import TensorDataset

from fl_lightning.datamodules import FederatedDataModule


class Blobs(FederatedDataModule):
    """Gaussian blobs, one class each: ``samples`` to partition into clients, a fifth as many to test on."""

    num_classes = 4  # the labels are checked against it at setup

    def __init__(self, samples: int = 4000, in_features: int = 16, **kwargs):
        super().__init__(**kwargs)
        self.samples, self.in_features = samples, in_features

    def build_datasets(self):
        g = torch.Generator().manual_seed(self.seed)
        centres = 0.6 * torch.randn(self.num_classes, self.in_features, generator=g)

        def draw(n: int) -> TensorDataset:
            y = torch.randint(0, self.num_classes, (n,), generator=g)
            return TensorDataset(centres[y] + torch.randn(n, self.in_features, generator=g), y)

        return draw(self.samples), draw(self.samples // 5)
