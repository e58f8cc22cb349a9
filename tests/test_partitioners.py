"""Partitioner objects: each option on hand-made labels, the old shortcuts pinned bit for bit,
clear errors, datamodule wiring, and flwr-datasets' partitions reproduced exactly."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest
import torch
from torch.utils.data import TensorDataset

from fl_lightning.datamodules import (
    DirichletPartitioner,
    FederatedDataModule,
    IidPartitioner,
    ImbalancedSubsample,
    MNISTFederated,
    NaturalIdPartitioner,
    PathologicalPartitioner,
    PowerLawPartitioner,
    ShardPartitioner,
    SortedPartitioner,
    labels_of,
)
from fl_lightning.datamodules.partitioners import from_shortcut
from fl_lightning.datamodules.subsample import st_indices
from fl_lightning.functional import partition as P

LABELS = np.random.default_rng(7).integers(0, 10, 600)  # unsorted, unequal classes
KEYS = np.random.default_rng(8).integers(0, 13, 600)
BLOCKS = np.repeat(np.arange(4), 25)  # 100 samples: 4 classes of 25, sorted


def digest(parts) -> str:
    h = hashlib.sha256()
    for p in parts:
        h.update(np.asarray(p, dtype=np.int64).tobytes())
        h.update(b"|")
    return h.hexdigest()[:16]


def classes_of(parts, labels=LABELS) -> list[set]:
    return [set(labels[p].tolist()) for p in parts]


def assert_exact_cover(parts, n):
    joined = np.concatenate(parts)
    assert len(joined) == n == len(np.unique(joined))


class Pinned(FederatedDataModule):
    """600 samples with LABELS and natural KEYS (the pinned digests include this class's name)."""

    def build_datasets(self):
        x = torch.randn(600, 3, generator=torch.Generator().manual_seed(0))
        return TensorDataset(x, torch.from_numpy(LABELS)), None

    def partition_keys(self):
        return KEYS


# ------------------------------------------------------------ the old shortcuts, bit for bit
# Digests of the partitions the code before partitioner objects gave (fl_lightning.datamodules.partition,
# powerlaw.two_label_power_law, imbalanced.st_indices and the datamodules), for these inputs and seeds;
# the Dirichlet and class splits of before are sample_order="shuffled" (the default is now Flower's draw).
# The old "shards" split with 2+ shards per client is gone: ShardPartitioner is now Flower's (below).
@pytest.mark.parametrize("name,call,expected", [
    ("iid", lambda: P.iid(600, 7, seed=3), "0422c2f5edc89e65"),
    ("dirichlet", lambda: P.dirichlet(LABELS, 10, 0.5, min_partition_size=1, seed=0, sample_order="shuffled"),
     "4b191c4590f64059"),
    ("dirichlet min", lambda: P.dirichlet(LABELS, 8, 0.3, min_partition_size=10, seed=5, sample_order="shuffled"),
     "3dc870583d7e834e"),
    ("shards 1", lambda: P.sorted_split(LABELS, 10, seed=0), "a4c79dd1e77aec70"),
    ("classes 2", lambda: P.pathological(LABELS, 12, 2, "round-robin", seed=1, sample_order="shuffled"),
     "f3916fc6679a2e8c"),
    ("classes 3", lambda: P.pathological(LABELS, 7, 3, "round-robin", seed=4, sample_order="shuffled"),
     "28f7ba539d0e5aac"),
    ("natural", lambda: P.natural(KEYS), "3466b08e414a7298"),
    ("power law", lambda: P.power_law(LABELS, 20, min_per_class=5, seed=0), "7af1c9211f52c3df"),
    ("power law options", lambda: P.power_law(LABELS, 10, num_classes_per_partition=3, min_per_class=2, sigma=1.0,
                                              used_fraction=0.5, seed=2), "1fd6468b4c01d886"),
    ("st", lambda: [st_indices(LABELS, keep=10)], "8a56a3029e7fd5b5"),
    ("st second", lambda: [st_indices(LABELS, keep=10, minority_half="second")], "9ae296daad306ded"),
])
def test_pure_functions_give_the_partitions_of_before(name, call, expected):
    assert digest(call()) == expected


@pytest.mark.parametrize("kwargs,expected", [
    (dict(partition="iid"), "73aa1aade11c2b5d"),
    (dict(partition="dirichlet", alpha=0.3, min_samples=5), "209cd21968b5bd3c"),
    (dict(partition="shards", shards_per_client=1), "61ad97890e024352"),
    (dict(partition="shards"), "7a548b86ae16816b"),  # Flower's shards now (before: 28c03f7cc46b7034)
    (dict(partition="classes", classes_per_client=3), "2da307f1a335ba57"),
    (dict(partition="natural", num_clients=13), "787773d7e362f246"),
])
def test_each_old_shortcut_gives_the_clients_of_before(kwargs, expected):
    kwargs.setdefault("num_clients", 10)
    dm = Pinned(test_fraction=0.2, seed=4, **kwargs)
    dm.setup()
    assert digest([idx for name in ("train", "val", "test") for idx in dm.splits[name]]) == expected


@pytest.mark.parametrize("kwargs,partitioner", [
    (dict(partition="iid"), IidPartitioner()),
    (dict(partition="dirichlet", alpha=0.3, min_samples=5),
     DirichletPartitioner(alpha=0.3, min_partition_size=5, sample_order="shuffled")),
    (dict(partition="dirichlet"), DirichletPartitioner(alpha=0.5, min_partition_size=1, sample_order="shuffled")),
    (dict(partition="shards", shards_per_client=1), SortedPartitioner()),
    (dict(partition="shards"), ShardPartitioner(num_shards_per_partition=2)),
    (dict(partition="classes", classes_per_client=3),
     PathologicalPartitioner(num_classes_per_partition=3, class_assignment_mode="round-robin",
                             sample_order="shuffled")),
    (dict(partition="natural"), NaturalIdPartitioner()),
])
def test_a_shortcut_is_its_partitioner(kwargs, partitioner):
    assert from_shortcut(**kwargs) == partitioner
    written = Pinned(num_clients=13 if kwargs["partition"] == "natural" else 10, seed=4, **kwargs)
    given = Pinned(num_clients=13 if kwargs["partition"] == "natural" else 10, seed=4, partitioner=partitioner)
    written.setup(), given.setup()
    assert written.splits["train"] and all(
        np.array_equal(a, b) for a, b in zip(written.splits["train"], given.splits["train"]))


def test_the_paper_datamodules_give_the_clients_of_before(monkeypatch):
    class FakeImages:
        def __init__(self, root, train, download=False):
            g = torch.Generator().manual_seed(0 if train else 1)
            n = 600 if train else 200
            self.data = (torch.rand(n, 8, 8, generator=g) * 255).to(torch.uint8)
            self.targets = torch.from_numpy(np.random.default_rng(0 if train else 1).integers(0, 10, n))

    monkeypatch.setattr(MNISTFederated, "dataset_cls", FakeImages)
    # the classes that were MNISTSTFederated and PowerLawMNIST, now written as configs write them
    st = MNISTFederated(num_clients=5, seed=1, subsample=ImbalancedSubsample(keep=10))
    st.setup()
    splits = lambda dm: digest([idx for name in ("train", "val", "test") for idx in dm.splits[name]])  # noqa: E731
    assert (splits(st), len(st.pool), len(st.test_set)) == ("bcbc3fa8b8ba539c", 372, 200)
    power = MNISTFederated(num_clients=10, test_fraction=0.25, seed=2, pool_test_set=True,
                           partitioner=PowerLawPartitioner(num_classes_per_partition=2, min_per_class=5,
                                                           used_fraction=0.5))
    power.setup()
    assert (splits(power), len(power.pool), power.test_set) == ("55288b17ed1c2bb9", 800, None)


# ------------------------------------------------------------- each partitioner, each option
def test_iid_sizes_and_seeds():
    parts = IidPartitioner(num_partitions=7).split(LABELS)
    assert_exact_cover(parts, 600)
    assert sorted({len(p) for p in parts}) == [85, 86]
    assert digest(IidPartitioner(seed=3).split(LABELS, 7, seed=0)) == digest(P.iid(600, 7, seed=3))  # own seed wins
    assert digest(IidPartitioner().split(LABELS, 7, seed=3)) == digest(P.iid(600, 7, seed=3))


def test_dirichlet_flower_default_min_partition_size_is_10():
    partitioner = DirichletPartitioner(alpha=0.1)
    assert partitioner.min_partition_size == 10 and partitioner.self_balancing is False
    parts = partitioner.split(LABELS, 20, seed=0)
    assert_exact_cover(parts, 600)
    assert min(len(p) for p in parts) >= 10
    assert min(len(p) for p in DirichletPartitioner(alpha=0.1, min_partition_size=0).split(LABELS, 20)) < 10


def test_dirichlet_alpha_per_partition():
    # a partition's expected share of every class is its alpha over the sum: here 4/8 for the last
    parts = DirichletPartitioner(alpha=[100.0] * 4 + [400.0]).split(LABELS, 5, seed=0)
    assert_exact_cover(parts, 600)
    sizes = [len(p) for p in parts]
    assert abs(sizes[4] - 300) < 30 and max(abs(s - 75) for s in sizes[:4]) < 20
    with pytest.raises(ValueError, match="alpha has 3 values but num_partitions=10"):
        DirichletPartitioner(alpha=[1.0, 1.0, 1.0]).split(LABELS, 10)


def test_dirichlet_self_balancing_bounds_the_sizes():
    sizes = {}
    for balancing in (False, True):
        parts = DirichletPartitioner(alpha=0.1, min_partition_size=1, self_balancing=balancing).split(LABELS, 10, 0)
        assert_exact_cover(parts, 600)
        sizes[balancing] = [len(p) for p in parts]
    # a partition above the average (60) receives no further class, so it ends below 60 + the largest class
    assert max(sizes[True]) <= 60 + np.bincount(LABELS).max() < max(sizes[False])


@pytest.mark.parametrize("mode", ["random", "deterministic", "first-deterministic", "round-robin"])
def test_pathological_modes(mode):
    parts = PathologicalPartitioner(num_classes_per_partition=2, class_assignment_mode=mode).split(LABELS, 12, 0)
    held = classes_of(parts)
    assert all(len(h) == 2 for h in held)
    if mode == "deterministic":
        assert held == [{p % 10, (p + 1) % 10} for p in range(12)]
    if mode == "first-deterministic":
        assert all(p % 10 in h for p, h in enumerate(held))
    if mode == "round-robin":
        holders = np.bincount([k for h in held for k in h], minlength=10)
        assert holders.max() - holders.min() <= 1 and holders.min() >= 1
    # a class is split evenly among its holders
    for k in range(10):
        shares = [int(np.sum(LABELS[p] == k)) for p in parts if k in set(LABELS[p].tolist())]
        assert max(shares) - min(shares) <= 1 and sum(shares) == np.sum(LABELS == k)


def test_pathological_unused_classes_warn_and_small_classes_fail():
    with pytest.warns(UserWarning, match=r"classes \[4, 5, 6, 7, 8, 9\] are in no partition"):
        PathologicalPartitioner(num_classes_per_partition=2, class_assignment_mode="deterministic").split(LABELS, 3)
    with pytest.raises(ValueError, match="class 1 has 1 sample.*2 partitions holding it.*no samples"):
        PathologicalPartitioner(num_classes_per_partition=1, class_assignment_mode="round-robin").split(
            np.array([0, 0, 0, 1]), 4)


def test_shard_options():
    # num_shards_per_partition alone: 4 x 2 shards of 100 // 8 = 12 samples, the other 4 unused (Flower's)
    parts = ShardPartitioner(num_shards_per_partition=2).split(BLOCKS, 4)
    assert [len(p) for p in parts] == [24] * 4 and len(np.unique(np.concatenate(parts))) == 96
    assert all(len(h) <= 4 for h in classes_of(parts, BLOCKS))
    # ... and with keep_incomplete_shard the 9th shard (the last 4 samples) may be dealt instead of one of 12
    kept = [ShardPartitioner(num_shards_per_partition=2, keep_incomplete_shard=True).split(BLOCKS, 4, seed=s)
            for s in range(10)]
    assert any(96 - 12 + 4 == sum(len(p) for p in parts) for parts in kept)
    # shard_size alone: 10 shards of 10 dealt 4, 3, 3
    parts = ShardPartitioner(shard_size=10).split(BLOCKS, 3)
    assert [len(p) for p in parts] == [40, 30, 30] and all(len(h) <= 4 for h in classes_of(parts, BLOCKS))
    # 105 samples, shard_size 10: the incomplete shard is dropped, or kept
    labels = np.repeat(np.arange(5), 21)
    assert sum(len(p) for p in ShardPartitioner(shard_size=10).split(labels, 3)) == 100
    kept = ShardPartitioner(shard_size=10, keep_incomplete_shard=True).split(labels, 3)
    assert_exact_cover(kept, 105)
    # both: exactly num_shards_per_partition shards of shard_size, the rest unused
    parts = ShardPartitioner(num_shards_per_partition=2, shard_size=10).split(BLOCKS, 3)
    assert [len(p) for p in parts] == [20, 20, 20]
    with pytest.raises(ValueError, match="= 120 samples is more than the 100 samples"):
        ShardPartitioner(num_shards_per_partition=4, shard_size=10).split(BLOCKS, 3)
    with pytest.raises(ValueError, match="shard_size=40 cuts the 100 samples into 2 shards, fewer than num_partitions=3"):
        ShardPartitioner(shard_size=40).split(BLOCKS, 3)


def test_sorted_natural_and_power_law():
    parts = SortedPartitioner(num_partitions=4).split(BLOCKS)
    assert classes_of(parts, BLOCKS) == [{0}, {1}, {2}, {3}]
    keys = np.array(["b", "a", "b", "c", "a"])
    assert [p.tolist() for p in NaturalIdPartitioner().split(keys)] == [[1, 4], [0, 2], [3]]
    with pytest.raises(ValueError, match="num_partitions=2 but the natural partition has 3 distinct keys"):
        NaturalIdPartitioner(num_partitions=2).split(keys)
    parts = PowerLawPartitioner(num_classes_per_partition=3, min_per_class=2).split(LABELS, 10, seed=0)
    assert classes_of(parts) == [{k % 10, (k + 1) % 10, (k + 2) % 10} for k in range(10)]
    sizes = [len(p) for p in parts]
    assert max(sizes) > 3 * min(sizes)


def test_partitioners_are_deterministic_from_their_seed():
    for partitioner in (IidPartitioner(), DirichletPartitioner(alpha=0.5), ShardPartitioner(num_shards_per_partition=2),
                        PathologicalPartitioner(num_classes_per_partition=2), PowerLawPartitioner(min_per_class=2),
                        SortedPartitioner()):
        a, b, c = (partitioner.split(LABELS, 10, seed=s) for s in (1, 1, 2))
        assert digest(a) == digest(b) != digest(c), partitioner


# ------------------------------------------------------------------------------- errors
@pytest.mark.parametrize("make,match", [
    (lambda: DirichletPartitioner(alpha=0.0), r"alpha must be > 0 and finite, got 0.0"),
    (lambda: DirichletPartitioner(alpha="big"), r"alpha must be a number > 0 or a list of numbers > 0 .*got 'big'"),
    (lambda: DirichletPartitioner(alpha=[1.0, -1.0]), r"alpha must be .* got \[1.0, -1.0\]"),
    (lambda: DirichletPartitioner(num_partitions=3, alpha=[1.0]), "alpha has 1 values but num_partitions=3"),
    (lambda: DirichletPartitioner(alpha=1.0, min_partition_size=-1), "min_partition_size must be >= 0.*got -1"),
    (lambda: DirichletPartitioner(alpha=1.0, self_balancing="yes"), "self_balancing must be True or False, got 'yes'"),
    (lambda: DirichletPartitioner(alpha=1.0, sample_order="random"),
     r"sample_order must be one of \('dataset', 'shuffled'\), got 'random'"),
    (lambda: PathologicalPartitioner(num_classes_per_partition=2, sample_order=None),
     r"sample_order must be one of \('dataset', 'shuffled'\), got None"),
    (lambda: PathologicalPartitioner(num_classes_per_partition=0), "num_classes_per_partition must be >= 1.*got 0"),
    (lambda: PathologicalPartitioner(num_classes_per_partition=2, class_assignment_mode="cyclic"),
     r"class_assignment_mode must be one of \('random', 'deterministic', 'first-deterministic', 'round-robin'\), "
     r"got 'cyclic'"),
    (lambda: ShardPartitioner(), "give num_shards_per_partition, shard_size or both; got neither"),
    (lambda: ShardPartitioner(shard_size=0), "shard_size must be >= 1.*got 0"),
    (lambda: ShardPartitioner(num_shards_per_partition=2.5), "num_shards_per_partition must be >= 1 and an integer, or None, got 2.5"),
    (lambda: PowerLawPartitioner(sigma=-1.0), "sigma must be >= 0 and finite, got -1.0"),
    (lambda: PowerLawPartitioner(used_fraction=1.5), r"used_fraction must be in \(0, 1\], got 1.5"),
    (lambda: IidPartitioner(num_partitions=0), "num_partitions must be >= 1.*got 0"),
    (lambda: IidPartitioner(seed=-1), "seed must be >= 0.*got -1"),
    (lambda: IidPartitioner().split(LABELS), r"IidPartitioner\(\) needs num_partitions"),
    (lambda: IidPartitioner(num_partitions=5).split(LABELS, 10), r"makes 5 partitions but 10 were asked for"),
    (lambda: IidPartitioner().split(LABELS[:5], 6), "num_partitions=6 is more than the 5 samples"),
    (lambda: PathologicalPartitioner(num_classes_per_partition=11).split(LABELS, 5),
     r"num_classes_per_partition must be in \[1, 10\] \(the number of classes\), got 11"),
    (lambda: DirichletPartitioner(alpha=0.01, min_partition_size=70).split(LABELS, 10),
     "min_partition_size=70 is not achievable with num_partitions=10 and 600 samples"),
])
def test_errors_name_the_parameter_the_value_and_what_is_allowed(make, match):
    with pytest.raises(ValueError, match=match):
        make()


@pytest.mark.parametrize("kwargs,match", [
    (dict(partitioner=IidPartitioner(), partition="iid"), "partition='iid' is a shortcut argument, but partitioner="),
    (dict(partitioner=IidPartitioner(), alpha=0.3), "alpha=0.3 is a shortcut argument"),
    (dict(partition="iid", alpha=0.3), "alpha=0.3 is an argument of partition='dirichlet', but partition='iid'"),
    (dict(classes_per_client=3), "classes_per_client=3 is an argument of partition='classes', but partition=None"),
    (dict(partitioner="dirichlet"), "partitioner must be a Partitioner .* got 'dirichlet'"),
    (dict(partitioner=IidPartitioner(num_partitions=5), num_clients=10),
     "num_clients=10 but the partitioner makes num_partitions=5"),
    (dict(subsample=0.5), "subsample must be a Subsample .* got 0.5"),
    (dict(partition="shards", shards_per_client=0), "shards_per_client must be >= 1.*got 0"),
])
def test_datamodule_refuses_conflicting_partition_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        Pinned(**kwargs)


# ------------------------------------------------------------------------ in a datamodule
def test_datamodule_takes_num_clients_and_seed_from_the_partitioner_or_gives_them():
    dm = Pinned(partitioner=DirichletPartitioner(num_partitions=6, alpha=1.0), seed=4)
    assert dm.num_clients == 6
    dm.setup()
    assert digest([np.sort(np.concatenate(s)) for s in zip(*(dm.splits[k] for k in ("train", "val", "test")))]) \
        == digest(P.dirichlet(LABELS, 6, 1.0, seed=4))
    own = Pinned(num_clients=6, partitioner=DirichletPartitioner(alpha=1.0, seed=9), seed=4)
    own.setup()
    assert [len(np.concatenate(s)) for s in zip(own.splits["train"], own.splits["val"])] == [
        len(p) for p in P.dirichlet(LABELS, 6, 1.0, seed=9)]
    natural = Pinned(partitioner=NaturalIdPartitioner())
    natural.setup()
    assert natural.num_clients == 13
    assert "partition=DirichletPartitioner(num_partitions=6, alpha=1.0)" in dm.summary()


def test_partition_by_label_and_unknown_columns():
    by_label = Pinned(num_clients=5, partitioner=PathologicalPartitioner(partition_by="label",
                                                                         num_classes_per_partition=2))
    by_label.setup()
    assert all(np.count_nonzero(by_label.label_histogram(c)) <= 2 for c in range(5))
    with pytest.raises(ValueError, match="Pinned has no column 'writer': its partitioners read the labels"):
        Pinned(partitioner=NaturalIdPartitioner(partition_by="writer")).setup()


def test_subsample_and_pool_test_set_transform_the_pool():
    class WithTest(Pinned):
        def build_datasets(self):
            pool, _ = super().build_datasets()
            return pool, TensorDataset(torch.zeros(50, 3), torch.arange(50) % 10)

    dm = WithTest(num_clients=4, subsample=ImbalancedSubsample(keep=3))
    dm.setup()
    assert np.bincount(labels_of(dm.pool))[:5].tolist() == [3] * 5 and len(dm.test_set) == 50
    pooled = WithTest(num_clients=4, pool_test_set=True, test_fraction=0.25)
    pooled.setup()
    assert len(pooled.pool) == 650 and pooled.test_set is None
    assert len(pooled.global_test_set()) == sum(len(t) for t in pooled.splits["test"])
    natural = WithTest(partitioner=NaturalIdPartitioner(), subsample=ImbalancedSubsample(keep=3))
    natural.setup()  # the keys are subsampled with the pool
    assert sum(len(np.concatenate(s)) for s in zip(natural.splits["train"], natural.splits["val"])) == len(natural.pool)
    with pytest.raises(ValueError, match="pool_test_set=True"):
        WithTest(partitioner=NaturalIdPartitioner(), pool_test_set=True).setup()
    with pytest.raises(ValueError, match="pool_test_set=True but Pinned has no test set"):
        Pinned(pool_test_set=True).setup()


class Measured(Pinned):
    """Pinned's samples with a float target each (a regression), and a column ``site`` of 6 values."""

    def build_datasets(self):
        x, _ = super().build_datasets()[0].tensors
        return TensorDataset(x, x.sum(dim=1)), None

    def partition_column(self, name):
        if name != "site":
            return super().partition_column(name)
        return LABELS % 6


@pytest.mark.parametrize("partitioner, shown", [
    (DirichletPartitioner(alpha=0.5), r"DirichletPartitioner\(alpha=0.5\)"),
    (PathologicalPartitioner(num_classes_per_partition=2), "PathologicalPartitioner"),
    (ShardPartitioner(num_shards_per_partition=2), "ShardPartitioner"),
    (SortedPartitioner(), "SortedPartitioner"),
    (PowerLawPartitioner(min_per_class=1), "PowerLawPartitioner"),
    (DirichletPartitioner(partition_by="label", alpha=0.5), "DirichletPartitioner"),
    (from_shortcut("dirichlet"), "DirichletPartitioner"),
])
def test_class_partitioners_refuse_targets_that_are_not_class_labels(partitioner, shown):
    """Each float would be a class of its own: refused at setup, naming the partitioner and the ways out."""
    with pytest.raises(ValueError, match=rf"partitioner={shown}.* splits the pool by class, but Measured's targets are "
                                         r"float32 numbers of shape \[\] \(mean .*\), not class labels .*: use "
                                         r"IidPartitioner\(\), NaturalIdPartitioner\(\) .*partition_by=<a column>"):
        Measured(num_clients=4, partitioner=partitioner).setup()
    with pytest.raises(ValueError, match=r"subsample=ImbalancedSubsample\(keep=3, minority_half='first'\) keeps "
                                         r"samples by class, but Measured's targets are float32 numbers"):
        Measured(num_clients=4, subsample=ImbalancedSubsample(keep=3)).setup()


def test_iid_natural_and_column_partitioners_take_any_targets():
    iid = Measured(num_clients=4, partitioner=IidPartitioner(), val_fraction=0.2)
    natural = Measured(partitioner=NaturalIdPartitioner(), val_fraction=0.2)
    by_site = Measured(num_clients=4, partitioner=DirichletPartitioner(partition_by="site", alpha=0.5),
                       val_fraction=0.2)
    for dm in (iid, natural, by_site):
        dm.setup()
        assert not dm.has_class_labels and all(len(v) > 0 for v in dm.splits["val"])
    assert natural.num_clients == 13 and by_site.num_clients == 4
    flwr = pytest.importorskip("flwr_datasets.partitioner")
    from fl_lightning.datamodules import FlowerPartitioner

    flower = Measured(partitioner=FlowerPartitioner(flwr.IidPartitioner(num_partitions=3)))
    flower.setup()
    assert flower.num_clients == 3
    with pytest.raises(ValueError, match=r"partitioner=FlowerPartitioner\(.*\) splits the pool by class"):
        Measured(partitioner=FlowerPartitioner(flwr.DirichletPartitioner(num_partitions=3, partition_by="label",
                                                                        alpha=1.0))).setup()


def test_checkpointed_hyperparameters_are_plain():
    from fl_lightning.checkpoints import is_plain

    dm = Pinned(partitioner=DirichletPartitioner(alpha=[1.0, 2.0], num_partitions=2),
                subsample=ImbalancedSubsample(keep=3))
    assert all(is_plain(v) for v in dm.hparams.values())
    assert dm.hparams["partitioner"] == "DirichletPartitioner(num_partitions=2, alpha=[1.0, 2.0])"
    assert dm.hparams["subsample"] == "ImbalancedSubsample(keep=3, minority_half='first')"


# ------------------------------------------------------------------------ flwr-datasets
def flower_parts(partitioner, labels, shuffle_seed=None) -> list[np.ndarray]:
    """Flower's partitions of ``labels`` (a one-column Hugging Face dataset, shuffled first as
    ``FederatedDataset(shuffle=True, seed=shuffle_seed)`` does if given) as sorted index arrays."""
    datasets = pytest.importorskip("datasets")
    table = datasets.Dataset.from_dict({"label": labels.tolist(), "row": np.arange(len(labels))})
    partitioner.dataset = table if shuffle_seed is None else table.shuffle(seed=shuffle_seed)
    return [np.sort(np.asarray(partitioner.load_partition(i)["row"])) for i in range(partitioner.num_partitions)]


MANY = np.random.default_rng(9).integers(0, 10, 2000)  # for 30 self-balanced partitions


@pytest.mark.parametrize("labels,num_partitions,cls,options", [
    (LABELS, 10, DirichletPartitioner, dict(alpha=0.5)),
    (LABELS, 6, DirichletPartitioner, dict(alpha=[0.2, 0.5, 1.0, 2.0, 5.0, 1.0], min_partition_size=5)),
    (LABELS, 5, DirichletPartitioner, dict(alpha=1000.0, self_balancing=True)),
    (MANY, 30, DirichletPartitioner, dict(alpha=0.5, self_balancing=True)),  # np.sum would move cuts here
    (LABELS, 7, ShardPartitioner, dict(num_shards_per_partition=2)),
    (LABELS, 7, ShardPartitioner, dict(num_shards_per_partition=3, keep_incomplete_shard=True)),
    (LABELS, 7, ShardPartitioner, dict(shard_size=25)),
    (LABELS, 7, ShardPartitioner, dict(shard_size=25, keep_incomplete_shard=True)),
    (LABELS, 7, ShardPartitioner, dict(shard_size=20, num_shards_per_partition=3)),
    (LABELS, 12, PathologicalPartitioner, dict(num_classes_per_partition=3)),
    (LABELS, 12, PathologicalPartitioner, dict(num_classes_per_partition=2, class_assignment_mode="deterministic")),
    (LABELS, 12, PathologicalPartitioner,
     dict(num_classes_per_partition=3, class_assignment_mode="first-deterministic")),
])
def test_flwr_named_partitioners_give_flowers_partitions(labels, num_partitions, cls, options):
    flwr = pytest.importorskip("flwr_datasets.partitioner")
    ours = cls(**options)
    for seed in range(5):
        theirs = getattr(flwr, cls.__name__)(num_partitions=num_partitions, partition_by="label", seed=seed, **options)
        expected = flower_parts(theirs, labels)
        assert [p.tolist() for p in ours.split(labels, num_partitions, seed=seed)] == [p.tolist() for p in expected]


def test_iid_gives_the_partitions_of_flowers_shuffled_federated_dataset():
    flwr = pytest.importorskip("flwr_datasets.partitioner")
    for seed in range(5):
        expected = flower_parts(flwr.IidPartitioner(num_partitions=7), LABELS, shuffle_seed=seed)
        assert [p.tolist() for p in IidPartitioner().split(LABELS, 7, seed=seed)] == [p.tolist() for p in expected]


def test_natural_id_gives_flowers_partitions():
    flwr = pytest.importorskip("flwr_datasets.partitioner")
    theirs = flower_parts(flwr.NaturalIdPartitioner(partition_by="label"), KEYS)
    assert [p.tolist() for p in NaturalIdPartitioner().split(KEYS)] == [p.tolist() for p in theirs]


def test_shuffled_sample_order_keeps_flowers_classes_and_sizes():
    flwr = pytest.importorskip("flwr_datasets.partitioner")
    ours = PathologicalPartitioner(num_classes_per_partition=3, sample_order="shuffled").split(LABELS, 8, seed=42)
    theirs = flower_parts(flwr.PathologicalPartitioner(num_partitions=8, partition_by="label",
                                                       num_classes_per_partition=3, seed=42), LABELS)
    assert classes_of(ours) == classes_of(theirs) and [len(p) for p in ours] == [len(p) for p in theirs]
    assert [p.tolist() for p in ours] != [p.tolist() for p in theirs]


def test_flower_partitioner_adapter_gives_flowers_partitions():
    flwr = pytest.importorskip("flwr_datasets.partitioner")
    from fl_lightning.datamodules import FlowerPartitioner

    def flower():
        return flwr.DirichletPartitioner(num_partitions=6, partition_by="label", alpha=0.5, seed=3)

    adapter = FlowerPartitioner(flower())
    dm = Pinned(partitioner=adapter, val_fraction=0.0)
    dm.setup()
    assert dm.num_clients == 6
    assert [p.tolist() for p in dm.splits["train"]] == [p.tolist() for p in flower_parts(flower(), LABELS)]
    assert [p.tolist() for p in adapter.split(LABELS)] == [p.tolist() for p in dm.splits["train"]]  # reusable
    with pytest.raises(ValueError, match="makes 6 partitions but num_clients=4"):
        Pinned(num_clients=4, partitioner=FlowerPartitioner(flower())).setup()
    with pytest.raises(ValueError, match="partitioner must be a flwr_datasets.partitioner.Partitioner"):
        FlowerPartitioner("dirichlet")


def test_flower_partitioner_refuses_too_many_partitions_and_a_column_mismatch():
    flwr = pytest.importorskip("flwr_datasets.partitioner")
    from fl_lightning.datamodules import FlowerPartitioner

    for too_many in (flwr.IidPartitioner(num_partitions=700),
                     flwr.DirichletPartitioner(num_partitions=700, partition_by="label", alpha=1.0)):
        with pytest.raises(ValueError, match="the Flower partitioner's num_partitions=700 is more than the 600 samples"):
            Pinned(partitioner=FlowerPartitioner(too_many)).setup()
    digits = flwr.DirichletPartitioner(num_partitions=3, partition_by="digit", alpha=1.0)
    with pytest.raises(ValueError, match=r"DirichletPartitioner reads the column 'digit' \(its partition_by\), but "
                                         r"FlowerPartitioner\(partition_by=None\) hands it the column 'label'"):
        FlowerPartitioner(digits)
    with pytest.raises(ValueError, match="Pinned has no column 'digit'"):  # the datamodule names what it has
        Pinned(partitioner=FlowerPartitioner(digits, partition_by="digit")).setup()
