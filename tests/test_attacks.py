"""The attack callbacks (fl_lightning.callbacks.attacks): which uploads they forge, the data-mass
check, label flipping, and an attack's effect on a run. The formulas are tested in
tests/functional/test_attacks.py."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch.utils.data import TensorDataset

from fl_lightning.algorithms.fedavg import FedAvg
from fl_lightning.callbacks import FederatedCallback
from fl_lightning.callbacks.attacks import (
    ALIEAttack,
    GaussianAttack,
    IPMAttack,
    LabelFlipAttack,
    ScalingAttack,
    SignFlipAttack,
)
from fl_lightning.datamodules import FederatedDataModule
from fl_lightning.functional.attacks import alie_z, gaussian_attack
from fl_lightning.seeding import generator
from fl_lightning.update import ClientUpdate
from tests.helpers import synthetic, tiny_client, trainer


def test_attack_refuses_a_byzantine_majority_of_the_data():
    with pytest.raises(ValueError, match="allow_majority"):
        GaussianAttack(fraction=0.5)
    GaussianAttack(fraction=0.6, allow_majority=True)
    attack = GaussianAttack(count=6)
    module = SimpleNamespace(seed=0, engine=SimpleNamespace(datamodule=SimpleNamespace(train_clients=list(range(8)),
                                                                                  num_samples=lambda c: 10)))
    with pytest.raises(ValueError, match="allow_majority"):
        attack.choose(module)
    assert len(GaussianAttack(count=3).choose(module)) == 3


def _fake_module(round_idx=2):
    return SimpleNamespace(seed=5, current_epoch=round_idx, device=torch.device("cpu"),
                           engine=SimpleNamespace(upload_sizes=lambda: {"d": 3}))


def _round(attack, byzantine, updates):
    """Feed one round's updates (one process) through ``attack``; return what is aggregated."""
    attack.byzantine = byzantine
    module = _fake_module()
    attack.on_round_start(None, module, 2, [u.client_id for u in updates])
    kept = [attack.on_client_update(None, module, u) for u in updates]
    return attack.on_round_updates(None, module, kept)


UPDATES = [ClientUpdate(i, 10, {"d": torch.tensor([float(i), 1.0, -1.0])}) for i in range(5)]


def test_gaussian_callback_replaces_only_byzantine_uploads():
    out = _round(GaussianAttack(count=2), [1, 3], UPDATES)
    assert out[0] is UPDATES[0] and out[2] is UPDATES[2]
    expected = gaussian_attack(torch.Size([3]), generator(5, "attack", 2, 1))
    assert torch.equal(out[1].tensors["d"], expected)
    assert out[1].num_samples == 10 and out[1].client_id == 1


def test_scaling_and_own_sign_flip_callbacks():
    out = _round(ScalingAttack(factor=-2, count=1), [4], UPDATES)
    assert out[4].tensors["d"].tolist() == [-8.0, -2.0, 2.0]
    out = _round(SignFlipAttack(reference="own", scale=1, count=1), [4], UPDATES)
    assert out[4].tensors["d"].tolist() == [-4.0, -1.0, 1.0]


def test_omniscient_attacks_use_the_honest_statistics_once_the_round_is_in():
    honest = torch.stack([u.tensors["d"] for u in UPDATES if u.client_id not in (0, 3)])  # clients 1, 2, 4
    out = _round(SignFlipAttack(count=2), [0, 3], UPDATES)
    assert torch.allclose(out[0].tensors["d"], -3 * honest.mean(0))
    assert torch.equal(out[0].tensors["d"], out[3].tensors["d"])  # colluding: the same vector
    out = _round(IPMAttack(epsilon=0.5, count=2), [0, 3], UPDATES)
    assert torch.allclose(out[3].tensors["d"], -0.5 * honest.mean(0))
    out = _round(ALIEAttack(z=1.0, count=2), [0, 3], UPDATES)
    std = honest.std(0, unbiased=False)
    assert torch.allclose(out[0].tensors["d"], honest.mean(0) - std)
    out = _round(ALIEAttack(count=2), [0, 3], UPDATES)  # z from (n=5, f=2): s = 1, Phi^-1(4/5)
    assert torch.allclose(out[0].tensors["d"], honest.mean(0) - alie_z(5, 2) * std)


def test_label_flip_poisons_only_byzantine_batches():
    attack = LabelFlipAttack(count=1)
    attack.byzantine = [2]
    batch = (torch.zeros(3, 2), torch.tensor([0, 1, 9]))
    assert attack.on_local_batch(None, None, 2, batch)[1].tolist() == [9, 8, 0]
    assert attack.on_local_batch(None, None, 1, batch)[1].tolist() == [0, 1, 9]


class SeenLabels(FederatedCallback):
    """Records the labels each client trains on (registered after the attack)."""

    def __init__(self):
        self.labels = {}

    def on_local_batch(self, trainer, module, client_id, batch):
        self.labels.setdefault(client_id, []).append(batch[1].clone())
        return batch


def test_label_flip_reaches_any_algorithm():
    attack, seen = LabelFlipAttack(count=1), SeenLabels()
    dm = synthetic(4)
    module = FedAvg(tiny_client(), clients_per_round=4, local_steps=2)
    trainer(1, callbacks=[attack, seen]).fit(module, dm)
    (bad,) = attack.byzantine
    for cid, labels in seen.labels.items():
        x, y = dm.client_data(cid).full()
        original = set(y.tolist())
        got = set(torch.cat(labels).tolist())
        assert got <= ({9 - v for v in original} if cid == bad else original)


def test_gaussian_attack_breaks_fedavg_in_a_run():
    def final(callbacks):
        module = FedAvg(tiny_client(), clients_per_round=8, local_steps=2, seed=1)
        t = trainer(2, callbacks=callbacks)
        t.fit(module, synthetic(8))
        return module.global_model.flatten()

    clean, attacked = final([]), final([GaussianAttack(fraction=0.3, std=10.0)])
    assert float((attacked - clean).norm()) > 10 * float(clean.norm())


@pytest.mark.parametrize("count, shown", [(1.5, "1.5"), (-1, "-1"), (True, "True")])
def test_the_byzantine_count_must_be_a_whole_number(count, shown):
    with pytest.raises(ValueError, match=f"count must be >= 0 and an integer, got {shown}"):
        GaussianAttack(count=count)


NAN, INF = float("nan"), float("inf")


@pytest.mark.parametrize("make, message", [
    (lambda: ScalingAttack(factor=NAN, count=1), "factor must be finite, got nan"),
    (lambda: ScalingAttack(factor=-INF, count=1), "factor must be finite, got -inf"),
    (lambda: SignFlipAttack(scale=NAN, count=1), "scale must be finite, got nan"),
    (lambda: GaussianAttack(std=INF, count=1), "std must be > 0 and finite, got inf"),
    (lambda: IPMAttack(epsilon=INF, count=1), "epsilon must be > 0 and finite, got inf"),
    (lambda: ALIEAttack(z=NAN, count=1), "z must be finite, got nan"),
    (lambda: GaussianAttack(count=1, seed=1.5), "seed must be >= 0 and an integer, got 1.5"),
    (lambda: LabelFlipAttack(num_classes=2.5, count=1), "num_classes must be >= 2 and an integer, got 2.5"),
])
def test_an_attack_refuses_a_non_finite_or_misplaced_number_at_construction(make, message):
    with pytest.raises(ValueError, match=message):
        make()


class UnknownClasses(FederatedDataModule):
    """Labels 0..9, and no ``num_classes``: the datamodule does not know its classes."""

    def build_datasets(self):
        x = torch.randn(200, 20, generator=torch.Generator().manual_seed(0))
        return TensorDataset(x, torch.arange(200) % 10), None


@pytest.mark.parametrize("data, num_classes, message", [
    (lambda: synthetic(4), 5, r"LabelFlipAttack\(num_classes=5\) flips a label y to 4 - y, but SyntheticFederated "
                              "has num_classes=10: the flipped labels would not be its classes; give num_classes=10"),
    (lambda: synthetic(4), 12, "but SyntheticFederated has num_classes=10"),
    (lambda: UnknownClasses(num_clients=4), 5, "but UnknownClasses's labels reach 9: .* give num_classes=10"),
])
def test_label_flip_with_other_classes_than_the_data_is_refused_at_setup(data, num_classes, message):
    """At setup, not once a Byzantine client is first sampled: max_epochs=0 runs no round."""
    module = FedAvg(tiny_client(), clients_per_round=2, local_steps=1)
    with pytest.raises(ValueError, match=message):
        trainer(0, callbacks=[LabelFlipAttack(num_classes=num_classes, count=1)]).fit(module, data())


def test_label_flip_with_the_data_classes_runs_also_where_the_datamodule_does_not_know_them():
    for data in (synthetic(4), UnknownClasses(num_clients=4)):
        trainer(1, callbacks=[LabelFlipAttack(num_classes=10, count=1)]).fit(
            FedAvg(tiny_client(), clients_per_round=2, local_steps=1), data)
