"""Float targets from 10 sites: each site is a client (its natural key)."""

import torch
from torch.utils.data import TensorDataset

from fl_lightning.datamodules import FederatedDataModule


class Sites(FederatedDataModule):
    """``y = <w, x> + the offset of the sample's site + noise``. No global test set: the clients' own
    test splits (``test_fraction``) are it."""

    def __init__(self, samples: int = 2000, in_features: int = 8, sites: int = 10, noise: float = 0.1, **kwargs):
        super().__init__(**kwargs)
        self.samples, self.in_features, self.sites, self.noise = samples, in_features, sites, noise

    def build_datasets(self):
        g = torch.Generator().manual_seed(self.seed)
        x = torch.randn(self.samples, self.in_features, generator=g)
        self.site = torch.randint(0, self.sites, (self.samples,), generator=g)
        w, offset = torch.randn(self.in_features, generator=g), torch.randn(self.sites, generator=g)
        y = x @ w + offset[self.site] + self.noise * torch.randn(self.samples, generator=g)
        return TensorDataset(x, y), None

    def partition_keys(self):
        """The natural clients: each sample's site."""
        return self.site.tolist()
