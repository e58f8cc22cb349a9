"""Partition functions: every sample used once, the promised skew, determinism, clear errors."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest

from fl_lightning.functional import partition as P

LABELS = np.repeat(np.arange(10), 50)  # 500 samples, 50 per class


def assert_exact_cover(parts, n):
    joined = np.concatenate(parts)
    assert len(joined) == n and len(np.unique(joined)) == n


def test_iid_sizes_differ_by_at_most_one():
    parts = P.iid(500, 7, seed=0)
    assert_exact_cover(parts, 500)
    sizes = [len(p) for p in parts]
    assert max(sizes) - min(sizes) <= 1


def test_dirichlet_small_alpha_is_skewed_large_alpha_is_not():
    def mean_classes(alpha):
        parts = P.dirichlet(LABELS, 10, alpha, min_partition_size=1, seed=0)
        assert_exact_cover(parts, 500)
        return np.mean([len(np.unique(LABELS[p])) for p in parts])

    assert mean_classes(0.05) < 4 < 9 < mean_classes(100.0)


def test_dirichlet_min_partition_size():
    parts = P.dirichlet(LABELS, 20, 0.3, min_partition_size=10, seed=1)
    assert min(len(p) for p in parts) >= 10


def test_sorted_split_gives_one_class_per_partition():
    parts = P.sorted_split(LABELS, 10, seed=0)
    assert_exact_cover(parts, 500)
    assert all(len(np.unique(LABELS[p])) == 1 for p in parts)


def test_shards_two_per_partition():
    parts = P.shards(LABELS, 25, 2, seed=0)
    assert_exact_cover(parts, 500)
    assert all(len(np.unique(LABELS[p])) <= 2 for p in parts)


def test_classes_per_partition():
    parts = P.pathological(LABELS, 20, 3, "round-robin", seed=0)
    assert_exact_cover(parts, 500)
    assert all(len(np.unique(LABELS[p])) == 3 for p in parts)


def test_natural_groups_by_key():
    keys = np.array(["b", "a", "b", "c", "a"])
    parts = P.natural(keys)
    assert [p.tolist() for p in parts] == [[1, 4], [0, 2], [3]]


def test_partitions_are_deterministic_from_the_seed():
    a, b = P.dirichlet(LABELS, 10, 0.5, seed=3), P.dirichlet(LABELS, 10, 0.5, seed=3)
    c = P.dirichlet(LABELS, 10, 0.5, seed=4)
    assert all(np.array_equal(x, y) for x, y in zip(a, b))
    assert not all(np.array_equal(x, y) for x, y in zip(a, c))


def test_stratified_split_follows_the_client_distribution():
    idx = np.arange(200)
    labels = np.repeat([0, 1], 100)
    train, val, test = P.stratified_split(idx, labels, [0.1, 0.25], seed=0)
    assert_exact_cover([train, val, test], 200)
    assert np.bincount(labels[test]).tolist() == [25, 25]
    assert np.bincount(labels[val]).tolist() == [10, 10]


def test_stratified_split_draws_as_before():
    """The splits of class labels are those of every run before random splits were added."""
    rng = np.random.default_rng(5)
    labels, idx = rng.integers(0, 7, 300), np.sort(rng.choice(300, 200, replace=False))
    parts = P.stratified_split(idx, labels, [0.15, 0.2], seed=11)
    digests = [hashlib.sha256(p.tobytes()).hexdigest()[:12] for p in parts]
    assert digests == ["7997571061bd", "4186cc3d1378", "a80455af68bd"] and [len(p) for p in parts] == [130, 29, 41]


def test_random_split_cuts_round_fraction_of_the_samples_keyed_by_the_seed():
    idx = np.arange(100, 150)
    train, val, test = P.random_split(idx, [0.1, 0.25], seed=0)
    assert_exact_cover([train - 100, val - 100, test - 100], 50)
    assert [len(train), len(val), len(test)] == [50 - 5 - 12, 5, 12]  # round(12.5) = 12
    assert all(p.dtype == np.int64 and np.array_equal(p, np.sort(p)) for p in (train, val, test))
    again, other = P.random_split(idx, [0.1, 0.25], seed=0), P.random_split(idx, [0.1, 0.25], seed=1)
    assert all(np.array_equal(a, b) for a, b in zip(again, (train, val, test)))
    assert not np.array_equal(other[1], val)
    assert [len(p) for p in P.random_split(idx[:4], [0.1], seed=0)] == [4, 0]  # round(0.4) = 0


@pytest.mark.parametrize(
    "call,match",
    [
        (lambda: P.iid(5, 6), "num_partitions=6 is more than the 5 samples"),
        (lambda: P.dirichlet(LABELS, 10, 0.0), "alpha must be > 0"),
        (lambda: P.dirichlet(LABELS, 10, -1.0), "alpha must be > 0"),
        (lambda: P.dirichlet(LABELS, 10, 0.01, min_partition_size=49), "min_partition_size=49"),
        (lambda: P.shards(LABELS, 10, 0), "num_shards_per_partition must be >= 1"),
        (lambda: P.shards(LABELS, 300, 2), "600 shards"),
        (lambda: P.pathological(LABELS, 10, 11), r"num_classes_per_partition must be in \[1, 10\]"),
        (lambda: P.natural(["a", "b"], num_partitions=3), "2 distinct keys"),
        (lambda: P.iid(10, 0), "num_partitions must be >= 1"),
    ],
)
def test_bad_input(call, match):
    with pytest.raises(ValueError, match=match):
        call()


def test_empty_client_is_an_error():
    labels = np.array([0, 0, 0, 1])
    with pytest.raises(ValueError, match="no samples"):
        P.pathological(labels, 4, 1, "round-robin", seed=0)  # class 1 has one sample for two partitions
