"""HuggingFaceFederated on generated datasets (Dataset.from_dict, offline): conversion,
partitions by a column or by the labels, test split, loading from disk, from YAML, errors."""

from __future__ import annotations

import sys

import numpy as np
import pytest
import torch

from fl_lightning.datamodules import (
    DirichletPartitioner,
    HuggingFaceFederated,
    NaturalIdPartitioner,
    PathologicalPartitioner,
)


def test_missing_datasets_names_the_extra(monkeypatch):
    from fl_lightning.datamodules.hf_datasets import import_datasets

    monkeypatch.setitem(sys.modules, "datasets", None)
    with pytest.raises(ImportError, match=r"pip install 'fl-lightning\[hf\]'"):
        import_datasets()


datasets = pytest.importorskip("datasets")
from PIL import Image  # noqa: E402  (pillow comes with torchvision)


def images(n: int = 60, seed: int = 0, channels: int = 1) -> "datasets.Dataset":
    """``n`` random 6x5 images with a label (``i % 4``) and a user (``u0`` .. ``u4``)."""
    g = np.random.default_rng(seed)
    shape = (6, 5) if channels == 1 else (6, 5, channels)
    pictures = [Image.fromarray(g.integers(0, 256, shape, dtype=np.uint8)) for _ in range(n)]
    table = datasets.Dataset.from_dict({"image": pictures, "label": [i % 4 for i in range(n)],
                                        "user": [f"u{i % 5}" for i in range(n)]})
    return table.cast_column("image", datasets.Image())


def test_images_become_nchw_tensors_and_clients_follow_a_column():
    dm = HuggingFaceFederated(images(), partitioner=NaturalIdPartitioner(partition_by="user"), val_fraction=0.0)
    dm.setup()
    x, y = dm.pool.tensors
    assert x.shape == (60, 1, 6, 5) and x.dtype == torch.float32 and 0 <= x.min() and x.max() <= 1
    assert y.dtype == torch.int64 and y.tolist() == [i % 4 for i in range(60)]
    assert dm.num_clients == 5
    assert [p.tolist() for p in dm.splits["train"]] == [list(range(u, 60, 5)) for u in range(5)]
    color = HuggingFaceFederated(images(12, channels=3), num_clients=2)
    color.setup()
    assert color.pool.tensors[0].shape == (12, 3, 6, 5)


def test_any_partitioner_reads_the_label_column():
    dm = HuggingFaceFederated(images(), num_clients=4, partitioner=PathologicalPartitioner(num_classes_per_partition=1,
                                                                                           class_assignment_mode="deterministic"))
    dm.setup()
    assert [np.flatnonzero(dm.label_histogram(c)).tolist() for c in range(4)] == [[0], [1], [2], [3]]
    renamed = HuggingFaceFederated(images().rename_column("label", "digit"), label="digit", num_clients=3,
                                   partitioner=DirichletPartitioner(partition_by="digit", alpha=1.0, min_partition_size=5))
    renamed.setup()
    assert sum(renamed.num_samples(c) for c in range(3)) > 0


def test_tabular_columns_test_split_and_loading_from_disk(tmp_path):
    g = np.random.default_rng(1)
    def split(n):
        return datasets.Dataset.from_dict({"a": g.normal(size=n).tolist(), "b": g.integers(0, 9, n).tolist(),
                                           "v": g.normal(size=(n, 3)).tolist(), "y": (np.arange(n) % 3).tolist()})

    both = datasets.DatasetDict({"train": split(40), "test": split(10)})
    dm = HuggingFaceFederated(both, features=["a", "b", "v"], label="y", test_split="test", num_clients=4)
    dm.setup()
    assert dm.pool.tensors[0].shape == (40, 5) and len(dm.test_set) == 10
    both.save_to_disk(str(tmp_path / "tab"))
    loaded = HuggingFaceFederated(str(tmp_path / "tab"), features=["a", "b", "v"], label="y", test_split="test",
                                  num_clients=4)
    loaded.setup()
    assert torch.equal(loaded.pool.tensors[0], dm.pool.tensors[0]) and loaded.partition_hash() == dm.partition_hash()
    assert isinstance(loaded.hparams["dataset"], str)


@pytest.mark.parametrize("kwargs,match", [
    (dict(features="pixels"), r"columns \['pixels'\] are not in the dataset \(split='train'\); its columns are"),
    (dict(test_split="test"), "test_split='test' needs a DatasetDict"),
    (dict(features=[]), "features must be a column name or a non-empty list of them, got"),
    (dict(features=["image", "label"]), "mixes an image column with others"),
    (dict(features="user"), "feature column 'user' holds"),
])
def test_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        HuggingFaceFederated(images(), num_clients=2, **kwargs).setup()


def test_bad_datasets_and_labels():
    with pytest.raises(ValueError, match="dataset must be a datasets.Dataset, a datasets.DatasetDict or a path"):
        HuggingFaceFederated([1, 2, 3])
    with pytest.raises(ValueError, match=r"split='validation' is not a split of the dataset; its splits are \['train'\]"):
        HuggingFaceFederated(datasets.DatasetDict({"train": images()}), split="validation")
    with pytest.raises(ValueError, match=r"label column 'user' holds .* not integers.*class_encode_column\('user'\)"):
        HuggingFaceFederated(images(), label="user", num_clients=2).setup()
    with pytest.raises(ValueError, match=r"NaturalIdPartitioner\(partition_by=<column>\)"):
        HuggingFaceFederated(images(), partitioner=NaturalIdPartitioner()).setup()
    ragged = datasets.Dataset.from_dict({"x": [[1.0], [1.0, 2.0]], "label": [0, 1]})
    with pytest.raises(ValueError, match="column 'x' has samples of different shapes"):
        HuggingFaceFederated(ragged, features="x", num_clients=2).setup()


def test_flower_partitions_through_the_adapter():
    flwr = pytest.importorskip("flwr_datasets.partitioner")
    from fl_lightning.datamodules import FlowerPartitioner

    table = images(80)
    flower = flwr.PathologicalPartitioner(num_partitions=4, partition_by="label", num_classes_per_partition=2,
                                          class_assignment_mode="deterministic", seed=0)
    dm = HuggingFaceFederated(table, partitioner=FlowerPartitioner(flower), val_fraction=0.0)
    dm.setup()
    expected = flwr.PathologicalPartitioner(num_partitions=4, partition_by="label", num_classes_per_partition=2,
                                            class_assignment_mode="deterministic", seed=0)
    expected.dataset = table.add_column("row", list(range(80)))
    assert [p.tolist() for p in dm.splits["train"]] == [
        sorted(expected.load_partition(i)["row"]) for i in range(4)]
    by_user = HuggingFaceFederated(table, partitioner=FlowerPartitioner(flwr.NaturalIdPartitioner(partition_by="user"),
                                                                        partition_by="user"), val_fraction=0.0)
    by_user.setup()
    assert [p.tolist() for p in by_user.splits["train"]] == [list(range(u, 80, 5)) for u in range(5)]


def test_a_config_fits_a_dataset_saved_to_disk(tmp_path, monkeypatch):
    from fl_lightning.cli import FederatedCLI

    monkeypatch.setattr(sys, "argv", ["fl-lightning"])
    images(100).save_to_disk(str(tmp_path / "pics"))
    config = tmp_path / "hf.yaml"
    config.write_text(f"""
seed_everything: 0
model:
  class_path: fl_lightning.algorithms.FedAvg
  init_args:
    client: {{class_path: fl_lightning.models.LogisticRegression, init_args: {{in_features: 30, num_classes: 4}}}}
    clients_per_round: 2
    local_steps: 2
data:
  class_path: fl_lightning.datamodules.HuggingFaceFederated
  init_args:
    dataset: {tmp_path / "pics"}
    partitioner: {{class_path: fl_lightning.datamodules.NaturalIdPartitioner, init_args: {{partition_by: user}}}}
    val_fraction: 0.2
    batch_size: 4
trainer:
  max_epochs: 2
  logger: false
  enable_progress_bar: false
  enable_model_summary: false
  enable_checkpointing: false
  default_root_dir: {tmp_path / "run"}
""")
    cli = FederatedCLI(args=["fit", "--config", str(config)])
    assert cli.datamodule.num_clients == 5 and cli.trainer.current_epoch == 2
    assert "val_acc" in cli.trainer.callback_metrics


def table(**columns) -> "datasets.Dataset":
    """A small in-memory dataset with the given columns."""
    return datasets.Dataset.from_dict(columns)


@pytest.mark.parametrize("kwargs, match", [
    (dict(features=5), r"features must be a column name or a non-empty list of them, got 5"),
    (dict(label=3), r"label must be a column name, got 3"),
    (dict(num_classes=0), r"num_classes must be >= 1 and an integer, got 0"),
])
def test_argument_types_are_checked_at_construction(kwargs, match):
    with pytest.raises(ValueError, match=match):
        HuggingFaceFederated(table(x=[1.0, 2.0], label=[0, 1]), num_clients=2, **{"features": "x", **kwargs})


@pytest.mark.parametrize("labels, kwargs, match", [
    ([0, -8, 0, 1], {}, r"label column 'label' holds -8 \(row 1\); labels are class indices in \[0, num_classes\)"),
    ([0, 10**9, 0, 1], {}, r"label column 'label' holds 1000000000 \(row 1\), which would make 1000000001 classes "
                           r"for 3 distinct labels.*num_classes="),
    ([0, 1, 4, 1], dict(num_classes=4), r"label column 'label' holds 4 \(row 2\), outside \[0, num_classes=4\)"),
])
def test_labels_must_be_class_indices(labels, kwargs, match):
    dm = HuggingFaceFederated(table(x=[1.0, 2.0, 3.0, 4.0], label=labels), features="x", num_clients=2, **kwargs)
    with pytest.raises(ValueError, match=match):
        dm.setup()


def test_class_label_names_bound_the_labels_and_num_classes_allows_sparse_ids():
    named = table(x=[1.0, 2.0, 3.0, 4.0], label=[0, 1, 2, 1]).cast_column("label", datasets.ClassLabel(names=["a", "b"]))
    with pytest.raises(ValueError, match=r"label column 'label' holds 2 \(row 2\), outside \[0, num_classes=2\) "
                                         r"\(the column's ClassLabel has 2 names\)"):
        HuggingFaceFederated(named, features="x", num_clients=2).setup()
    sparse = HuggingFaceFederated(table(x=[1.0, 2.0, 3.0, 4.0], label=[0, 999, 0, 999]), features="x", num_clients=2,
                                  num_classes=1000, val_fraction=0.0)
    sparse.setup()
    assert sparse.pool.tensors[1].tolist() == [0, 999, 0, 999]


@pytest.mark.parametrize("column, match", [
    ([1.0, None, 3.0, 4.0], r"column 'x' has a missing value \(None\) at row 1"),
    ([[1.0, 2.0], None, [3.0, 4.0], [1.0, 1.0]], r"column 'x' has a missing value \(None\) at row 1"),
    ([[1.0, 2.0], [3.0, 4.0], [None, 1.0], [1.0, 1.0]], r"feature column 'x' has a missing value \(None or NaN\) at row 2"),
])
def test_missing_feature_values_name_the_column_and_row(column, match):
    dm = HuggingFaceFederated(table(x=column, label=[0, 1, 0, 1]), features="x", num_clients=2)
    with pytest.raises(ValueError, match=match):
        dm.setup()
    with pytest.raises(ValueError, match=r"column 'label' has a missing value \(None\) at row 3"):
        HuggingFaceFederated(table(x=[1.0, 2.0, 3.0, 4.0], label=[0, 1, 0, None]), features="x", num_clients=2).setup()


def test_one_scalar_feature_column_becomes_one_feature_per_sample():
    dm = HuggingFaceFederated(table(x=[0.5, 1.5, 2.5, 3.5], label=[0, 1, 0, 1]), features="x", num_clients=2,
                              val_fraction=0.0)
    dm.setup()
    assert dm.pool.tensors[0].shape == (4, 1)


def test_an_empty_dataset_is_refused_as_empty():
    with pytest.raises(ValueError, match=r"the dataset \(split='train'\) is empty: it has no rows"):
        HuggingFaceFederated(table(x=[], label=[]), features="x", num_clients=2)
    both = datasets.DatasetDict({"train": table(x=[1.0, 2.0], label=[0, 1]),
                                 "test": table(x=[1.0], label=[0]).select([])})
    with pytest.raises(ValueError, match=r"the dataset \(test_split='test'\) is empty: it has no rows"):
        HuggingFaceFederated(both, features="x", test_split="test", num_clients=2)


def test_a_float_label_column_is_a_regression_target():
    """Float labels (scalars or fixed-length lists) are regression targets: float32, split at random,
    refused by the partitioners that read classes; a num_classes is refused them."""
    rng = np.random.default_rng(0)
    x, users = rng.normal(size=40).tolist(), [f"u{i % 4}" for i in range(40)]
    dm = HuggingFaceFederated(table(x=x, price=(rng.normal(size=40) * 10).tolist(), user=users), features="x",
                              label="price", partitioner=NaturalIdPartitioner(partition_by="user"), val_fraction=0.2)
    dm.setup()
    y = dm.pool.tensors[1]
    assert y.dtype == torch.float32 and not dm.has_class_labels and [len(v) for v in dm.splits["val"]] == [2] * 4
    vectors = HuggingFaceFederated(table(x=x, target=rng.normal(size=(40, 3)).tolist()), features="x", label="target",
                                   num_clients=4)
    vectors.setup()
    assert vectors.pool.tensors[1].shape == (40, 3) and vectors.describe_targets()["shape"] == [3]
    with pytest.raises(ValueError, match=r"partitioner=DirichletPartitioner\(alpha=0.5\) splits the pool by class, "
                                         r"but HuggingFaceFederated's targets are float32 numbers"):
        HuggingFaceFederated(table(x=x, price=x), features="x", label="price", num_clients=2,
                             partitioner=DirichletPartitioner(alpha=0.5)).setup()
    with pytest.raises(ValueError, match=r"must be class indices in \[0, num_classes=3\), got float32 labels"):
        HuggingFaceFederated(table(x=x, price=x), features="x", label="price", num_clients=2, num_classes=3).setup()
