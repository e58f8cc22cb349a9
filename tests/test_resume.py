"""A run stopped after round 2 and resumed to round 4 equals an uninterrupted 4-round run, bitwise."""

from __future__ import annotations

import pytest
import torch
from pytorch_lightning.callbacks import ModelCheckpoint
from torch.utils.data import TensorDataset

from fl_lightning.algorithms import SCAFFOLD, FedAvg
from fl_lightning.datamodules import FederatedDataModule
from fl_lightning.datamodules.base import feature_checksums
from tests.helpers import checkpoint_client_state, global_vector, straight_and_resumed, synthetic, tiny_client, trainer

CASES = [(FedAvg, {"server_momentum": 0.9, "server_lr": 0.5}), (SCAFFOLD, {})]


def make(algorithm, kwargs):
    return algorithm(tiny_client(hidden=(8,)), clients_per_round=3, local_steps=3, seed=1, **kwargs)


@pytest.mark.parametrize("algorithm,kwargs", CASES)
def test_resume_is_exact(tmp_path, algorithm, kwargs):
    saved = {}
    straight, resumed = straight_and_resumed(
        lambda: make(algorithm, kwargs), lambda: synthetic(6), 4, 2, tmp_path,
        before_resume=lambda: saved.update(torch.load(tmp_path / "last.ckpt", weights_only=False)))
    assert saved["global_step"] == 2  # written after round 2: one server step per round

    assert torch.equal(global_vector(straight), global_vector(resumed))
    if algorithm is SCAFFOLD:
        assert torch.equal(straight.server_control, resumed.server_control)
        assert sorted(straight.engine.store.clients()) == sorted(resumed.engine.store.clients())
        for cid in straight.engine.store.clients():
            assert torch.equal(straight.engine.store.get(cid, "control"), resumed.engine.store.get(cid, "control"))


def test_checkpoint_of_other_configuration_is_refused(tmp_path):
    ckpt = ModelCheckpoint(dirpath=tmp_path, save_last=True, save_top_k=0)
    trainer(1, callbacks=[ckpt], enable_checkpointing=True).fit(make(FedAvg, {}), synthetic(6))
    with pytest.raises(ValueError, match="another configuration.*num_clients"):
        trainer(2).fit(make(FedAvg, {}), synthetic(7), ckpt_path=str(tmp_path / "last.ckpt"))


def test_checkpoint_holds_client_state(tmp_path):
    ckpt = ModelCheckpoint(dirpath=tmp_path, save_last=True, save_top_k=0)
    module = make(SCAFFOLD, {})
    trainer(1, callbacks=[ckpt], enable_checkpointing=True).fit(module, synthetic(6))
    saved = checkpoint_client_state(torch.load(tmp_path / "last.ckpt", weights_only=True))
    assert sorted(saved) == module.engine.round_clients  # created lazily: only the clients that ran
    assert all(entry["control"].device.type == "cpu" for entry in saved.values())


class FromFile(FederatedDataModule):
    """A federation of the (x, y) tensors saved in ``path``."""

    def __init__(self, path: str, **kwargs) -> None:
        super().__init__(**kwargs)
        self.path = path

    def build_datasets(self):
        x, y = torch.load(self.path, weights_only=True)
        return TensorDataset(x, y), None


def test_a_resume_on_changed_features_with_the_same_labels_is_refused(tmp_path):
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(120, 20, generator=g), torch.randint(0, 10, (120,), generator=g)
    data = tmp_path / "data.pt"
    torch.save((x, y), data)
    ckpt = ModelCheckpoint(dirpath=tmp_path, save_last=True, save_top_k=0)
    trainer(1, callbacks=[ckpt], enable_checkpointing=True).fit(make(FedAvg, {}), FromFile(str(data), num_clients=4))
    x[7, 3] += 1.0  # one sample's features replaced, the labels kept
    torch.save((x, y), data)
    with pytest.raises(ValueError, match="another configuration.*partition"):
        trainer(2).fit(make(FedAvg, {}), FromFile(str(data), num_clients=4), ckpt_path=str(tmp_path / "last.ckpt"))


def test_the_data_fingerprint_samples_the_features_of_other_datasets():
    """A dataset that is not a TensorDataset: a fixed spread of samples is read (random transforms drawn
    under a fixed RNG, so the fingerprint is the same each time)."""

    class Noisy(torch.utils.data.Dataset):
        def __init__(self, x):
            self.x = x

        def __len__(self):
            return len(self.x)

        def __getitem__(self, i):
            return self.x[i] + 0.01 * torch.randn(self.x.shape[1]), 0

    x = torch.randn(2000, 4, generator=torch.Generator().manual_seed(0))
    first = list(feature_checksums(Noisy(x)))
    assert len(first) == 512 and list(feature_checksums(Noisy(x))) == first
    x[0] += 1.0  # the first sample is always read
    assert list(feature_checksums(Noisy(x))) != first
