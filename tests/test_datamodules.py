"""FederatedDataModule: client splits, unseen clients, summary, determinism, loaders, datasets."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch.utils.data import TensorDataset

from fl_lightning.datamodules import (
    CIFAR10Federated,
    ClientData,
    FederatedDataModule,
    MNISTFederated,
    SyntheticFederated,
    labels_of,
)
from fl_lightning.datamodules.client_data import stacked_indices
from fl_lightning.seeding import generator
from tests.helpers import synthetic


class Blobs(FederatedDataModule):
    """400 generated samples of 4 classes."""

    def build_datasets(self):
        g = torch.Generator().manual_seed(0)
        y = torch.arange(400) % 4
        x = torch.randn(400, 3, generator=g) + y[:, None]
        return TensorDataset(x, y), None


def test_splits_cover_each_client_and_follow_its_labels():
    dm = Blobs(num_clients=5, partition="dirichlet", alpha=1.0, val_fraction=0.1, test_fraction=0.2, seed=1)
    dm.setup()
    labels = labels_of(dm.pool)
    for c in range(5):
        parts = [dm.splits[s][c] for s in ("train", "val", "test")]
        joined = np.concatenate(parts)
        assert len(np.unique(joined)) == len(joined)
        hist_all = np.bincount(labels[joined], minlength=4) / len(joined)
        hist_test = np.bincount(labels[parts[2]], minlength=4) / max(len(parts[2]), 1)
        assert np.abs(hist_all - hist_test).max() < 0.15
    assert len(dm.global_test_set()) == sum(len(t) for t in dm.splits["test"])


def test_unseen_clients_are_held_out_and_never_sampled():
    from fl_lightning.algorithms import FedAvg
    from tests.helpers import tiny_client, trainer

    dm = synthetic(10, unseen_fraction=0.3)
    dm.setup()
    assert len(dm.unseen_clients) == 3 and not set(dm.unseen_clients) & set(dm.train_clients)
    module = FedAvg(tiny_client(), clients_per_round=7, local_steps=1)
    trainer(2).fit(module, dm)
    assert sorted(module.engine.round_clients) == dm.train_clients


def test_same_seed_same_partition():
    a, b, c = Blobs(num_clients=6, partition="iid", seed=3), Blobs(num_clients=6, partition="iid", seed=3), Blobs(
        num_clients=6, partition="iid", seed=4)
    for dm in (a, b, c):
        dm.setup()
    assert a.partition_hash() == b.partition_hash() != c.partition_hash()


def test_summary_lists_samples_and_histograms():
    dm = Blobs(num_clients=4, partition="shards", shards_per_client=1, val_fraction=0.0, test_fraction=0.25)
    dm.setup()
    text = dm.summary()
    assert "4 clients" in text and "partition=shards" in text
    rows = [line.split() for line in text.splitlines()[2:6]]
    assert [r[:4] for r in rows] == [[str(c), "75", "0", "25"] for c in range(4)]
    assert sorted(" ".join(r[4:]) for r in rows) == ["[0 0 0 75]", "[0 0 75 0]", "[0 75 0 0]", "[75 0 0 0]"]


def test_client_batches_are_keyed_by_seed_round_client():
    dm = synthetic(4)
    dm.setup()
    data = dm.client_data(1)
    a = [b[0] for b in data.step_batches(5, generator(0, "batches", 3, 1))]
    b = [b[0] for b in data.step_batches(5, generator(0, "batches", 3, 1))]
    c = [b[0] for b in data.step_batches(5, generator(0, "batches", 4, 1))]
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    assert not all(torch.equal(x, y) for x, y in zip(a, c))
    assert all(len(x) == min(dm.batch_size, len(data)) for x in a)


def test_step_indices_are_passes_of_fresh_permutations_without_the_remainder():
    """5 samples in batches of 2: a pass gives 2 batches (one sample left out), then a new permutation."""
    indices, data = torch.tensor([10, 11, 12, 13, 14]), TensorDataset(torch.arange(20))
    table = ClientData(data, indices, batch_size=2).step_indices(5, torch.Generator().manual_seed(7))
    g = torch.Generator().manual_seed(7)
    perms = [indices[torch.randperm(5, generator=g)] for _ in range(3)]
    expected = torch.stack([perms[0][0:2], perms[0][2:4], perms[1][0:2], perms[1][2:4], perms[2][0:2]])
    assert torch.equal(table, expected)
    assert ClientData(data, indices, batch_size=8).step_indices(3, g).shape == (3, 5)  # a batch is at most the split


def test_stacked_step_positions_are_each_splits_passes_drawn_from_its_generator():
    """Splits of several sizes (one step batch size) at once: for each, the passes of fresh
    permutations of its own generator, cut into batches without the remainder."""
    from fl_lightning.datamodules.client_data import stacked_step_positions

    def alone(n: int, b: int, steps: int, g: torch.Generator) -> torch.Tensor:
        per_pass = n // b
        orders = [torch.randperm(n, generator=g)[: per_pass * b] for _ in range(-(-steps // per_pass))]
        return torch.cat(orders).view(-1, b)[:steps]

    data = TensorDataset(torch.arange(100))
    splits = [ClientData(data, torch.arange(size), batch_size=3) for size in (7, 12, 3, 9)]
    stacked = stacked_step_positions(splits, 5, [torch.Generator().manual_seed(i) for i in range(4)])
    expected = [alone(len(s), 3, 5, torch.Generator().manual_seed(i)) for i, s in enumerate(splits)]
    assert torch.equal(stacked, torch.stack(expected))
    for steps in (1, 3, 4, 9):  # one split alone, in one pass (3 and 4 batches a pass) and in several
        for split in splits[1:2] + splits[3:]:
            g = torch.Generator().manual_seed(steps)
            want = alone(len(split), 3, steps, torch.Generator().manual_seed(steps))
            assert torch.equal(split.step_positions(steps, g), want)
            assert torch.equal(stacked_step_positions([split], steps, [torch.Generator().manual_seed(steps)]),
                               want.unsqueeze(0))
    with pytest.raises(ValueError, match="step batch sizes differ"):
        stacked_step_positions([splits[0], ClientData(data, torch.arange(2), batch_size=3)], 5,
                               [torch.Generator(), torch.Generator()])
    with pytest.raises(ValueError, match="empty"):
        ClientData(data, torch.arange(0), batch_size=3).step_positions(2, torch.Generator())


@pytest.mark.parametrize("source_shape", [(50,), (50, 3), (50, 1, 2, 2)])
@pytest.mark.parametrize("index_shape", [(), (4,), (3, 4), (2, 3, 4), (0,), (3, 0)])
def test_take_rows_is_advanced_indexing(source_shape, index_shape):
    from fl_lightning.datamodules.client_data import take_rows

    source = torch.randn(*source_shape, generator=torch.Generator().manual_seed(0))
    index = torch.randint(0, 50, index_shape, generator=torch.Generator().manual_seed(1))
    rows = take_rows(source, index)
    assert rows.shape == source[index].shape and torch.equal(rows, source[index])
    with pytest.raises(IndexError):
        take_rows(source, torch.tensor([50]))


def test_stacked_indices_equal_each_split_indexed_on_its_own():
    """Splits of different sizes, their tables drawn at once (one gather) as each would be alone."""
    data = TensorDataset(torch.arange(100))
    splits = [ClientData(data, torch.arange(start, start + size), batch_size=3)
              for start, size in ((0, 7), (40, 12), (70, 3))]
    positions = torch.stack([split.step_positions(4, torch.Generator().manual_seed(i)) for i, split in enumerate(splits)])
    alone = [split.step_indices(4, torch.Generator().manual_seed(i)) for i, split in enumerate(splits)]
    assert torch.equal(stacked_indices(splits, positions), torch.stack(alone))



def test_client_data_is_made_once_and_anew_when_what_it_holds_changes():
    """A client split's ``ClientData`` is kept while its indices, the pool and the batch size are the
    same; a split replaced, another batch size or another pool make a new one from them."""
    dm = synthetic(4)
    dm.setup("fit")
    first = dm.client_data(1, "train")
    assert dm.client_data(1, "train") is first and dm.client_data(2, "train") is not first
    assert dm.client_data(1, "val") is not first
    dm.splits["train"][1] = dm.splits["train"][1][:3]  # a split replaced: the new indices
    fewer = dm.client_data(1, "train")
    assert len(fewer) == 3 and torch.equal(fewer.indices, first.indices[:3])
    dm.batch_size = 5
    assert dm.client_data(1, "train").batch_size == 5
    dm.pool = TensorDataset(*(t.clone() for t in dm.pool.tensors))
    assert dm.client_data(1, "train").dataset is dm.pool

@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"partition": "zipf"}, "partition must be one of"),
        ({"partition": "dirichlet", "alpha": 0.0}, "alpha must be > 0"),
        ({"num_clients": 0}, "num_clients must be >= 1"),
        ({"test_fraction": 1.0}, r"test_fraction must be in \[0, 1\)"),
        ({"val_fraction": 0.6, "test_fraction": 0.5}, "val_fraction \\+ test_fraction"),
        ({"batch_size": 0}, "batch_size"),
    ],
)
def test_bad_datamodule_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        Blobs(**kwargs)


def test_more_clients_than_samples():
    with pytest.raises(ValueError, match="more than the 400 samples"):
        Blobs(num_clients=401).setup()


def test_natural_partition_needs_keys():
    with pytest.raises(ValueError, match="no natural partition"):
        Blobs(num_clients=2, partition="natural").setup()


def test_client_with_no_training_samples():
    class Tiny(FederatedDataModule):
        def build_datasets(self):
            return TensorDataset(torch.zeros(4, 2), torch.tensor([0, 0, 1, 1])), None

    with pytest.raises(ValueError, match="no training samples"):
        Tiny(num_clients=4, partition="iid", val_fraction=0.0, test_fraction=0.9).setup()


def test_synthetic_is_deterministic_and_heterogeneous():
    a, b = SyntheticFederated(num_clients=10, seed=0), SyntheticFederated(num_clients=10, seed=0)
    a.setup(), b.setup()
    assert torch.equal(a.pool.tensors[0], b.pool.tensors[0])
    sizes = [a.num_samples(c) for c in range(10)]
    assert len(set(sizes)) > 3  # power-law sizes
    with pytest.raises(ValueError, match="alpha and beta must be >= 0"):
        SyntheticFederated(alpha=-1.0).setup()


class FakeVision:
    """Stands in for a torchvision dataset class: ``data`` (uint8 images) and ``targets``."""

    def __init__(self, root, train, download):
        n = 60 if train else 20
        g = torch.Generator().manual_seed(int(train))
        self.data = torch.randint(0, 255, (n, 28, 28), dtype=torch.uint8, generator=g)
        self.targets = (torch.arange(n) % 10).tolist()


class FakeCIFAR(FakeVision):
    def __init__(self, root, train, download):
        super().__init__(root, train, download)
        self.data = np.zeros((len(self.targets), 32, 32, 3), dtype=np.uint8)


def test_torchvision_datamodules_on_generated_data(monkeypatch):
    monkeypatch.setattr(MNISTFederated, "dataset_cls", FakeVision)
    monkeypatch.setattr(CIFAR10Federated, "dataset_cls", FakeCIFAR)
    mnist = MNISTFederated(num_clients=3, partition="iid")
    mnist.setup()
    x, y = mnist.client_data(0).full()
    assert x.shape[1:] == (1, 28, 28) and len(mnist.test_set) == 20
    cifar = CIFAR10Federated(num_clients=2, partition="classes", classes_per_client=5)
    cifar.setup()
    assert cifar.client_data(1).full()[0].shape[1:] == (3, 32, 32)


def test_torchvision_pixels_are_standardized_unless_normalize_is_false(monkeypatch):
    monkeypatch.setattr(MNISTFederated, "dataset_cls", FakeVision)
    raw = MNISTFederated(num_clients=2, normalize=False)
    std = MNISTFederated(num_clients=2)
    raw.setup(), std.setup()
    pixels = torch.as_tensor(FakeVision("", True, False).data).float() / 255.0
    assert torch.equal(raw.pool.tensors[0].squeeze(1), pixels)
    assert torch.allclose(std.pool.tensors[0], (raw.pool.tensors[0] - 0.1307) / 0.3081)


def test_missing_torchvision_data_says_how_to_get_it(tmp_path):
    with pytest.raises(RuntimeError, match="download=True"):
        MNISTFederated(root=str(tmp_path), num_clients=2).setup()


def test_femnist_reads_leaf_json_one_client_per_writer(tmp_path):
    import json

    from fl_lightning.datamodules.leaf import FEMNISTFederated

    g = np.random.default_rng(0)
    for split, n in (("train", 9), ("test", 1)):
        (tmp_path / split).mkdir()
        users = ["w1", "w2", "w3"]
        blob = {"users": users, "user_data": {u: {"x": g.random((n, 784)).tolist(), "y": [k % 62 for k in range(n)]}
                                              for u in users}}
        (tmp_path / split / "part0.json").write_text(json.dumps(blob))
    dm = FEMNISTFederated(root=str(tmp_path), pad_to=32, test_fraction=0.2)
    dm.setup()
    assert dm.num_clients == 3 and sum(dm.num_samples(c) for c in range(3)) + sum(
        len(t) for t in dm.splits["test"]) == 30
    assert dm.client_data(0).full()[0].shape[1:] == (1, 32, 32)
    with pytest.raises(ValueError, match="3 writers"):
        FEMNISTFederated(root=str(tmp_path), num_clients=5).setup()
    with pytest.raises(RuntimeError, match="LEAF"):
        FEMNISTFederated(root=str(tmp_path / "nowhere")).setup()


def test_validation_set_is_the_clients_val_splits_never_the_test_set():
    dm = Blobs(num_clients=4, partition="iid", test_fraction=0.2)
    dm.setup()
    val = set(dm.val_dataloader().dataset.indices)
    assert val == set(np.concatenate(dm.splits["val"]).tolist()) and len(val) > 0
    assert not val & set(np.concatenate(dm.splits["test"]).tolist())
    assert not val & set(np.concatenate(dm.splits["train"]).tolist())


def test_the_default_gives_a_validation_set_and_zero_warns():
    dm = Blobs(num_clients=4)
    dm.setup()
    assert len(dm.val_dataloader().dataset) > 0
    dm = Blobs(num_clients=4, val_fraction=0.0)
    dm.setup()
    with pytest.warns(UserWarning, match=r"val_fraction=0.0\) has no validation data"):
        assert len(dm.val_dataloader().dataset) == 0


def test_train_loader_yields_the_work_items_the_engine_sets():
    dm = Blobs(num_clients=4)
    dm.setup()
    with pytest.raises(RuntimeError, match=r"before work_items_per_round was set.*fit it with a FederatedModule, "
                                           r"which sets work_items_per_round in its setup"):
        dm.train_dataloader()
    dm.work_items_per_round = 3
    assert list(dm.train_dataloader()) == [0, 1, 2]
    dm.work_items_per_round = 0
    with pytest.raises(ValueError, match=r"work_items_per_round must be >= 1 and an integer, got 0"):
        dm.train_dataloader()


class Given(FederatedDataModule):
    """A pool (and test set) of given tensors; ``num_classes`` as given (None: the classes are unknown)."""

    def __init__(self, x, y, test=None, num_classes=None, **kwargs):
        super().__init__(num_clients=4, **kwargs)
        self.x, self.y, self.test, self.num_classes = x, y, test, num_classes

    def build_datasets(self):
        return TensorDataset(self.x, self.y), self.test


X, Y = torch.randn(100, 3, generator=torch.Generator().manual_seed(0)), torch.arange(100) % 10


def with_value(t: torch.Tensor, index: tuple, value: float) -> torch.Tensor:
    t = t.clone()
    t[index] = value
    return t


@pytest.mark.parametrize("data, message", [
    (lambda: Given(X, Y + 1, num_classes=10),
     r"the labels of Given's pool must be class indices in \[0, num_classes=10\), got 10 at sample 9 "
     r"\(10 sample\(s\) outside\)"),
    (lambda: Given(X, Y - 1, num_classes=10), r"must be class indices in \[0, num_classes=10\), got -1 at sample 0"),
    (lambda: Given(X, Y.float(), num_classes=10),
     r"the labels of Given's pool must be class indices .* got float32 labels"),
    (lambda: Given(X, Y, TensorDataset(X, Y * 2), num_classes=10),
     "the labels of Given's test set .* got 10 at sample 5"),
    (lambda: Given(with_value(X, (7, 1), float("nan")), Y),
     r"Given's pool holds nan in the inputs \(its tensor 0 of 2\) at sample 7: drop or fill non-finite samples"),
    (lambda: Given(X, with_value(Y.float(), (3,), float("-inf"))),
     r"Given's pool holds -inf in the labels or targets \(its tensor 1 of 2\) at sample 3"),
    (lambda: Given(X, Y, TensorDataset(with_value(X, (2, 0), float("inf")), Y)),
     "Given's test set holds inf in the inputs"),
])
def test_labels_outside_the_classes_and_non_finite_data_are_refused_at_setup(data, message):
    with pytest.raises(ValueError, match=message):
        data().setup()


def test_float_and_negative_targets_pass_where_the_datamodule_does_not_know_classes():
    """A datamodule without ``num_classes`` may hold regression targets: the client's loss decides
    (the engine tries it on a batch at setup, tests/test_reliability.py)."""
    dm = Given(X, torch.randn(100, generator=torch.Generator().manual_seed(1)))
    dm.setup()
    assert dm.num_classes is None and len(dm.train_clients) == 4


def test_the_bundled_datamodules_know_their_classes():
    known = synthetic(4, num_classes=3).num_classes, MNISTFederated.num_classes, CIFAR10Federated.num_classes
    assert known == (3, 10, 10)
