"""10,000 clients with 10 per round: work, state and memory follow the clients in flight."""

from __future__ import annotations

import torch
from torch.utils.data import TensorDataset

from fl_lightning.algorithms import SCAFFOLD
from fl_lightning.datamodules import FederatedDataModule
from tests.helpers import tiny_client, trainer


class Many(FederatedDataModule):
    def build_datasets(self):
        g = torch.Generator().manual_seed(0)
        y = torch.randint(0, 10, (30_000,), generator=g)
        return TensorDataset(torch.randn(30_000, 20, generator=g) + y[:, None] * 0.1, y), None


def test_ten_thousand_clients_ten_per_round():
    dm = Many(num_clients=10_000, partition="iid", batch_size=3)
    module = SCAFFOLD(tiny_client(), clients_per_round=10, local_steps=2)
    t = trainer(3, limit_val_batches=0)
    t.fit(module, dm)
    assert t.num_training_batches == 10  # work items per round: the clients in flight
    ran = set().union(*(module.engine.sample_round(r) for r in range(3)))
    assert sorted(module.engine.store.clients()) == sorted(ran)  # state only for clients that ran, not for 10,000
    assert module.engine.store.nbytes() <= 30 * module.global_model.num_params * 4
