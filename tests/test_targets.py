"""Targets of any kind in a FederatedDataModule: class labels (stratified splits, label counts, the
fingerprints of before), regression values and vectors (random splits keyed by the seed, a
description in place of label counts), samples that are dicts or longer tuples, and the refusals
and warnings that say what is true."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch.utils.data import Dataset, TensorDataset

from fl_lightning.algorithms import FedAvg
from fl_lightning.datamodules import DirichletPartitioner, FederatedDataModule, SyntheticFederated, labels_of
from tests.helpers import RegressionData, Regressor, global_vector, trainer

X = torch.randn(200, 5, generator=torch.Generator().manual_seed(0))
Y = X @ torch.randn(5, generator=torch.Generator().manual_seed(1))


class Pool(FederatedDataModule):
    """The given dataset as the pool, 4 clients unless told."""

    def __init__(self, dataset: Dataset, **kwargs):
        kwargs.setdefault("num_clients", 4)
        super().__init__(**kwargs)
        self.dataset = dataset

    def build_datasets(self):
        return self.dataset, None


class Samples(Dataset):
    """``make(i)`` for ``i < n``: samples of any form."""

    def __init__(self, make, n: int = 200):
        self.make, self.n = make, n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return self.make(i)


class Blobs(FederatedDataModule):
    """tests/test_datamodules.py's 400 samples of 4 classes."""

    def build_datasets(self):
        g = torch.Generator().manual_seed(0)
        y = torch.arange(400) % 4
        return TensorDataset(torch.randn(400, 3, generator=g) + y[:, None], y), None


class Items(Dataset):
    """(x, int) samples, read one by one (``WithTargets``: through a ``targets`` attribute)."""

    def __init__(self):
        g = torch.Generator().manual_seed(1)
        self.x, self.y = torch.randn(300, 2, generator=g), [int(i % 5) for i in range(300)]

    def __len__(self):
        return 300

    def __getitem__(self, i):
        return self.x[i], self.y[i]


class WithTargets(Items):
    @property
    def targets(self):
        return self.y


def test_class_label_partitions_splits_and_fingerprints_are_those_of_before():
    """The fingerprints (partition_hash: the labels, the features and every client's split indices)
    of configurations over class labels, as the code before targets of other kinds computed them."""
    configs = {
        "44c0c0df4b1ec238": lambda: Blobs(num_clients=5, partition="dirichlet", alpha=1.0, val_fraction=0.1,
                                          test_fraction=0.2, seed=1),
        "02f3a370be9499a9": lambda: SyntheticFederated(alpha=1.0, beta=1.0, num_clients=30, batch_size=10, seed=0),
        "d5620b7ceccd56c7": lambda: Pool(Items(), num_clients=6, val_fraction=0.2, test_fraction=0.1,
                                         unseen_fraction=0.2,
                                         partitioner=DirichletPartitioner(alpha=0.5, min_partition_size=5)),
        "23682bb7c85fe485": lambda: Pool(WithTargets(), num_clients=5, partition="shards", val_fraction=0.15),
    }
    for digest, make in configs.items():
        dm = make()
        dm.setup()
        assert dm.partition_hash() == digest


def test_float_targets_get_random_splits_keyed_by_the_seed():
    """Each client holds out round(fraction x its size) at random, where a split stratified by value
    (every float its own class) held out nothing."""
    splits = []
    for seed in (0, 0, 1):
        dm = Pool(TensorDataset(X, Y), val_fraction=0.2, test_fraction=0.1, seed=seed)
        dm.setup()
        splits.append(dm.splits)
    assert not dm.has_class_labels
    for c in range(4):
        parts = [splits[0][s][c] for s in ("train", "val", "test")]
        assert [len(p) for p in parts] == [35, 10, 5] and len(np.unique(np.concatenate(parts))) == 50
    assert all(np.array_equal(splits[0][s][c], splits[1][s][c]) for s in splits[0] for c in range(4))
    assert not np.array_equal(splits[0]["val"][0], splits[2]["val"][0])


@pytest.mark.parametrize("targets", [Y[:, None].repeat(1, 3), (torch.arange(200) % 3)[:, None], Y.double() - 100,
                                     torch.arange(200) - 50])
def test_vector_and_negative_targets_are_not_class_labels(targets):
    """Vectors ``[N, k]`` (floats or integers) and negative numbers: random splits, described, not counted."""
    dm = Pool(TensorDataset(X, targets), val_fraction=0.2)
    dm.setup()
    assert not dm.has_class_labels and [len(v) for v in dm.splits["val"]] == [10] * 4
    description = dm.describe_targets()
    assert description["kind"] == "numbers" and description["shape"] == list(targets.shape[1:])
    assert description["min"] == pytest.approx(float(targets.min())) and "num_classes" not in description
    with pytest.raises(ValueError, match=r"label_histogram\(\) counts classes, but Pool's targets are .* not class"):
        dm.label_histogram(0)


def test_the_summary_and_the_partition_record_say_what_the_targets_are():
    dm = Pool(TensorDataset(X, Y), val_fraction=0.2, seed=3)
    dm.setup()
    lines = dm.summary().splitlines()
    assert lines[1] == (f"targets: float32 numbers of shape [] (mean {Y.double().mean():.4g}, std "
                        f"{Y.double().std(unbiased=False):.4g}, min {Y.min():.4g}, max {Y.max():.4g}); not class "
                        "labels: splits drawn at random")
    first = Y[torch.from_numpy(dm.splits["train"][0])].double()
    assert lines[3].split() == ["0", "40", "10", "0", f"{first.mean():.4g}", f"{first.std(unbiased=False):.4g}"]
    record = dm.partition_record()
    assert "clients" not in record and record["train_sizes"] == [40] * 4
    assert record["targets"]["kind"] == "numbers" and record["targets"]["dtype"] == "float32"
    assert record["targets"]["mean"] == pytest.approx(float(Y.double().mean()))
    classes = Blobs(num_clients=2)
    classes.setup()
    assert classes.partition_record()["clients"] == [classes.label_histogram(c).tolist() for c in range(2)]
    assert classes.partition_record()["targets"] == {"kind": "class labels", "dtype": "int64", "shape": [],
                                                     "num_classes": 4}


LABELS = torch.arange(200) % 4


@pytest.mark.parametrize("dataset, label_column", [
    (Samples(lambda i: {"x": X[i], "label": LABELS[i]}), "label"),
    (Samples(lambda i: {"features": X[i], "y": LABELS[i]}), "y"),
    (Samples(lambda i: (X[i], LABELS[i], torch.tensor(0.5))), "label"),
    (Samples(lambda i: [X[i], int(LABELS[i])]), "label"),
    (TensorDataset(X, LABELS, torch.rand(200)), "label"),
])
def test_the_target_is_a_samples_second_element_or_its_label_column_entry(dataset, label_column):
    """Dicts (Hugging Face style) hold their target under the datamodule's label_column; tuples and
    lists (a TensorDataset's tensors too) as their second element, whatever follows it."""
    dm = Pool(dataset, val_fraction=0.2)
    dm.label_column = label_column
    dm.setup()
    labels = LABELS.numpy()
    assert np.array_equal(dm.pool_targets, labels) and dm.has_class_labels
    for c in range(4):  # stratified: round(0.2 x n) of each class's n samples of the client
        held = np.bincount(labels[np.concatenate([dm.splits["train"][c], dm.splits["val"][c]])], minlength=4)
        assert np.bincount(labels[dm.splits["val"][c]], minlength=4).tolist() == [round(0.2 * n) for n in held]


@pytest.mark.parametrize("dataset, message", [
    (Samples(lambda i: {"x": X[i], "y": Y[i]}),
     r"Pool's pool: the samples are dicts with keys \['x', 'y'\], and the datamodule's label_column 'label' is not "
     r"one of them: set label_column to the key of the targets"),
    (Samples(lambda i: X[i]), r"Pool's pool: a sample is a Tensor, which holds no target: a sample must be a tuple or "
                              r"list \(inputs, target, ...\).*adapt the samples with a transform"),
    (Samples(lambda i: (X[i],)), r"a sample is a tuple of 1, which holds no target"),
    (TensorDataset(X), r"Pool's pool: a TensorDataset of 1 tensor holds no targets"),
])
def test_samples_without_a_target_are_refused_at_setup_saying_what_is_supported(dataset, message):
    with pytest.raises(ValueError, match=message):
        Pool(dataset).setup()


def test_dict_samples_and_longer_tuples_train_as_tensors_do_on_both_backends():
    """A regression over dict samples ({"x", "y"}) or (x, y, weight) tuples, on the sequential and the
    batched backend (which gathers the batches of a block of clients in one go): on each, the model of
    the same data as a TensorDataset (the two backends' to float tolerance)."""

    class Dicts(Pool):
        label_column = "y"

    class Unpacking(Regressor):
        def training_step(self, batch, batch_idx):
            return super().training_step((batch["x"], batch["y"]) if isinstance(batch, dict) else batch[:2], batch_idx)

        def validation_step(self, batch, batch_idx):
            return super().validation_step((batch["x"], batch["y"]) if isinstance(batch, dict) else batch[:2],
                                           batch_idx)

    data = {"tensors": lambda: Pool(TensorDataset(X, Y), batch_size=8),
            "dicts": lambda: Dicts(Samples(lambda i: {"x": X[i], "y": Y[i]}), batch_size=8),
            "triples": lambda: Pool(Samples(lambda i: (X[i], Y[i], torch.tensor(1.0))), batch_size=8)}
    models = {}
    for name, make in data.items():
        for backend in ("sequential", "batched"):
            module = FedAvg(Unpacking(), clients_per_round=3, local_steps=3, client_backend=backend, seed=0)
            trainer(2).fit(module, make())
            models[name, backend] = global_vector(module)
    for (name, backend), model in models.items():
        assert torch.equal(model, models["tensors", backend])
    assert torch.allclose(models["tensors", "batched"], models["tensors", "sequential"], atol=1e-6)


def test_an_empty_validation_set_warns_why():
    """Clients too small for val_fraction: the warning names them, their sizes and the rounding, not
    "set val_fraction > 0" when it is set."""
    dm = Pool(TensorDataset(X[:16], Y[:16]), val_fraction=0.1)
    dm.setup()
    with pytest.warns(UserWarning, match=r"Pool\(val_fraction=0.1\) has no validation data, so validation .* is "
                                         r"skipped: val_fraction=0.1 holds out round\(0.1 x n\) of a client's samples, "
                                         r"and 4 client\(s\) are too small for any \(client 0: round\(0.1 x 4\) = 0, "):
        assert len(dm.validation_set()) == 0
    classes = Pool(TensorDataset(X[:40], torch.arange(40) % 4), val_fraction=0.1)
    classes.setup()
    with pytest.warns(UserWarning, match=r"round\(0.1 x n\) of the samples of each class of a client, and 4 client"
                                         r"\(s\) are too small for any \(client 0: round\(0.1 x 4\) = 0"):
        classes.validation_set()
    none = Pool(TensorDataset(X, Y), val_fraction=0.0)
    none.setup()
    with pytest.warns(UserWarning, match=r"val_fraction=0 holds out no val data: set val_fraction > 0"):
        none.validation_set()


def test_labels_of_reads_every_kind_of_dataset():
    """A TensorDataset's second tensor, a table's label column, a dataset's targets, or sample by
    sample (numbers stacked, dicts as objects); Subset and ConcatDataset read through."""
    from torch.utils.data import ConcatDataset, Subset

    assert np.array_equal(labels_of(Subset(TensorDataset(X, Y), [3, 1])), Y[[3, 1]].numpy())
    assert np.array_equal(labels_of(ConcatDataset([Items(), WithTargets()])), np.tile(np.arange(300) % 5, 2))
    assert labels_of(Items()).dtype == np.int64
    assert labels_of(Subset(TensorDataset(X, Y), [])).shape == (0,)
    dicts = labels_of(Samples(lambda i: (X[i], {"a": Y[i]}), n=3))
    assert dicts.dtype == object and dicts.shape == (3,) and dicts[2]["a"] == Y[2]
    datasets = pytest.importorskip("datasets")
    table = datasets.Dataset.from_dict({"x": X[:4].tolist(), "y": [0.5, 1.5, 2.5, 3.5]}).with_format("torch")
    assert np.array_equal(labels_of(table, "y"), np.array([0.5, 1.5, 2.5, 3.5], dtype=np.float32))


def test_a_regression_pool_trains_with_its_validation_metrics():
    """A regression module on float targets: validation metrics from the clients' val splits."""
    module = FedAvg(Regressor(), clients_per_round=2, local_steps=3, seed=0)
    t = trainer(2)
    t.fit(module, RegressionData(val_fraction=0.2))
    assert {"val/mse", "val/mae", "train/mse"} <= set(t.callback_metrics)
