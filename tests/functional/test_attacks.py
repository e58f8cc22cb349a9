"""Attack formulas and the choice of Byzantine clients (fl_lightning.functional.attacks)."""

from __future__ import annotations

import pytest
import torch

from fl_lightning.functional.attacks import (
    alie_attack,
    alie_z,
    data_fraction,
    flip_labels,
    gaussian_attack,
    ipm_attack,
    scaling_attack,
    select_byzantine,
    sign_flip_attack,
)


def seeded(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def test_gaussian_attack_is_seeded_standard_normal():
    a = gaussian_attack(torch.Size([20000]), seeded(3))
    b = gaussian_attack(torch.Size([20000]), seeded(3))
    c = gaussian_attack(torch.Size([20000]), seeded(4))
    assert torch.equal(a, b) and not torch.equal(a, c)
    assert a.dtype == torch.float32
    assert abs(float(a.mean())) < 0.03 and abs(float(a.std()) - 1) < 0.03
    assert torch.equal(gaussian_attack(torch.Size([5]), seeded(1), std=30), 30 * torch.randn(5, generator=seeded(1)))
    with pytest.raises(ValueError, match="std"):
        gaussian_attack(torch.Size([3]), seeded(0), std=0)


def test_update_attacks_by_hand():
    u = torch.tensor([1.0, -2.0])
    assert sign_flip_attack(u).tolist() == [-3.0, 6.0]
    assert sign_flip_attack(u, scale=1.0).tolist() == [-1.0, 2.0]
    assert scaling_attack(u, 10).tolist() == [10.0, -20.0]
    assert ipm_attack(u, 0.5).tolist() == [-0.5, 1.0]
    assert alie_attack(u, torch.tensor([1.0, 2.0]), 1.5).tolist() == [-0.5, -5.0]
    assert flip_labels(torch.tensor([0, 3, 9]), 10).tolist() == [9, 6, 0]
    with pytest.raises(ValueError, match="epsilon"):
        ipm_attack(u, 0)
    with pytest.raises(ValueError, match="num_classes"):
        flip_labels(torch.tensor([0]), 1)


def test_alie_z_follows_baruch_et_al():
    assert alie_z(50, 10) == pytest.approx(0.4677, abs=1e-3)  # s = 16, Phi^-1(34/50)
    assert alie_z(50, 20) == pytest.approx(1.1750, abs=1e-3)  # s = 6, Phi^-1(44/50)
    assert alie_z(4, 3) == 0.0  # s <= 0
    assert alie_z(1, 0) == 0.0  # s = 1 >= n
    with pytest.raises(ValueError, match="num_byzantine"):
        alie_z(5, 6)


def test_byzantine_choice_by_fraction_is_deterministic_and_below_the_target():
    sizes = [10, 200, 35, 80, 5, 120, 60, 90, 15, 40]
    chosen = select_byzantine(sizes, seeded(3), fraction=0.3)
    assert chosen == select_byzantine(sizes, seeded(3), fraction=0.3)
    assert chosen != select_byzantine(sizes, seeded(4), fraction=0.3)
    assert 0.25 <= data_fraction(sizes, chosen) <= 0.3
    assert select_byzantine(sizes, seeded(3), fraction=0.0) == []
    with pytest.raises(ValueError, match="exactly one"):
        select_byzantine(sizes, seeded(0), fraction=0.1, count=1)


def test_byzantine_choice_by_hand():
    # whatever the order: the big client alone is 100/103 > 3 %, the three small ones 3/103 <= 3 %
    for seed in range(5):
        assert select_byzantine([100, 1, 1, 1], seeded(seed), fraction=0.03) == [1, 2, 3]
    # by count: the first `count` positions of the generator's permutation, sorted
    assert select_byzantine([5] * 6, seeded(7), count=4) == sorted(torch.randperm(6, generator=seeded(7))[:4].tolist())
    assert select_byzantine([5] * 6, seeded(7), count=6) == list(range(6))
    with pytest.raises(ValueError, match="count must be in"):
        select_byzantine([5] * 6, seeded(7), count=7)


def test_data_fraction_by_hand():
    assert data_fraction([10, 30, 60], [0, 2]) == pytest.approx(0.7)
    assert data_fraction([10, 30, 60], []) == 0.0
    assert data_fraction([0, 0], [1]) == 0.0
