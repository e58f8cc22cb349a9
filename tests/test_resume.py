"""A run stopped after round 2 and resumed to round 4 equals an uninterrupted 4-round run, bitwise."""

from __future__ import annotations

import pytest
import torch
from pytorch_lightning.callbacks import ModelCheckpoint

from fl_lightning.algorithms import SCAFFOLD, FedAvg
from tests.helpers import checkpoint_client_state, global_vector, synthetic, tiny_client, trainer

CASES = [(FedAvg, {"server_momentum": 0.9, "server_lr": 0.5}), (SCAFFOLD, {})]


def make(algorithm, kwargs):
    return algorithm(tiny_client(hidden=(8,)), clients_per_round=3, local_steps=3, seed=1, **kwargs)


@pytest.mark.parametrize("algorithm,kwargs", CASES)
def test_resume_is_exact(tmp_path, algorithm, kwargs):
    straight = make(algorithm, kwargs)
    trainer(4).fit(straight, synthetic(6))

    first = make(algorithm, kwargs)
    ckpt = ModelCheckpoint(dirpath=tmp_path, save_last=True, save_top_k=0)
    trainer(2, callbacks=[ckpt], enable_checkpointing=True).fit(first, synthetic(6))
    saved = torch.load(tmp_path / "last.ckpt", weights_only=False)
    assert saved["global_step"] == 2  # written after round 2: one server step per round
    resumed = make(algorithm, kwargs)
    trainer(4).fit(resumed, synthetic(6), ckpt_path=str(tmp_path / "last.ckpt"))

    assert torch.equal(global_vector(straight), global_vector(resumed))
    if algorithm is SCAFFOLD:
        assert torch.equal(straight.server_control, resumed.server_control)
        assert sorted(straight.store.clients()) == sorted(resumed.store.clients())
        for cid in straight.store.clients():
            assert torch.equal(straight.store.get(cid, "control"), resumed.store.get(cid, "control"))


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
    assert sorted(saved) == module.round_clients  # created lazily: only the clients that ran
    assert all(entry["control"].device.type == "cpu" for entry in saved.values())
