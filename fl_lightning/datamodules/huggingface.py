"""``HuggingFaceFederated``: a Hugging Face ``datasets.Dataset`` as a federation.

The dataset is converted once to tensors (a ``TensorDataset``, so a client's mini-batch is a
slice) and split by any partitioner: ``NaturalIdPartitioner(partition_by="user")`` gives one
client per value of a column, the label partitioners read the label column (or the column
their ``partition_by`` names), and ``FlowerPartitioner`` runs a flwr-datasets partitioner.

Supported columns (converted through numpy):

* an ``Image`` column: float32 ``[N, C, H, W]`` in [0, 1] (all images of one size);
* numeric columns: scalars, or lists / arrays of one shape per column, as float32; one scalar
  column gives ``[N, 1]``; several feature columns are flattened and concatenated into one
  ``[N, F]`` vector;
* the label column: class indices in ``[0, num_classes)`` (``ClassLabel`` or ``int``), as int64; or
  regression targets: floats (scalars, or lists of one shape: ``[N, k]``), as float32 (a column of
  integers meant as numbers is cast first: ``dataset.cast_column(label, Value("float32"))``).

Missing values (``None``, and NaN in a feature column) are refused, naming the column and the row.

Text and other types need a conversion first (``dataset.map``, ``class_encode_column``).
Needs the ``datasets`` package: ``pip install 'fl-lightning[hf]'``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional, Sequence, Union

import numpy as np
import torch
from torch.utils.data import Dataset, TensorDataset

from fl_lightning.datamodules.base import FederatedDataModule
from fl_lightning.datamodules.hf_datasets import import_datasets
from fl_lightning.validation import check_int

#: without ``num_classes``, labels may reach at most this many times their number of distinct values
MAX_LABEL_SPARSITY = 100


def load(source: str) -> Any:
    """The dataset (or dataset dict) at ``source``: a folder written by ``save_to_disk`` is read
    with ``load_from_disk``; anything else goes to ``load_dataset`` (a Hub name, or a folder or
    file of csv / json / parquet / arrow data). Neither runs code from the dataset (``datasets``
    >= 4 has no loading scripts)."""
    datasets = import_datasets()
    folder = Path(source)
    if folder.is_dir() and any((folder / name).is_file() for name in ("dataset_dict.json", "state.json")):
        return datasets.load_from_disk(str(folder))
    return datasets.load_dataset(source)


def column_array(dataset: Any, name: str) -> np.ndarray:
    """Column ``name`` of a ``datasets.Dataset`` as one numpy array (samples first)."""
    if name not in dataset.column_names:
        raise ValueError(f"column {name!r} is not in the dataset; its columns are {dataset.column_names}")
    column = dataset.select_columns([name]).with_format("arrow")[:].column(name)
    if column.null_count:
        row = int(np.flatnonzero(column.is_null().to_numpy(zero_copy_only=False))[0])
        raise ValueError(f"column {name!r} has a missing value (None) at row {row}: fill or drop such rows first "
                         "(dataset.map / dataset.filter)")
    values = dataset.select_columns([name]).with_format("numpy")[:][name]
    if values.dtype == object:
        try:
            values = np.stack(list(values))
        except ValueError as error:
            raise ValueError(f"column {name!r} has samples of different shapes; only fixed-shape columns can be "
                             "converted to tensors") from error
    return values


def check_labels(labels: np.ndarray, column: str, num_classes: Optional[int], named: bool = False) -> None:
    """Refuse labels that are not class indices: outside ``[0, num_classes)``, or, with ``num_classes``
    None (inferred as the largest label + 1), negative or so sparse that the largest exceeds
    ``MAX_LABEL_SPARSITY`` times the number of distinct labels. ``named``: ``num_classes`` is the
    number of names of the column's ``ClassLabel``."""
    if len(labels) == 0:
        return
    if num_classes is not None:
        outside = np.flatnonzero((labels < 0) | (labels >= num_classes))
        if len(outside):
            row = int(outside[0])
            source = f" (the column's ClassLabel has {num_classes} names)" if named else ""
            raise ValueError(f"label column {column!r} holds {labels[row]} (row {row}), outside "
                             f"[0, num_classes={num_classes}){source}")
        return
    row = int(np.argmin(labels))
    if labels[row] < 0:
        raise ValueError(f"label column {column!r} holds {labels[row]} (row {row}); labels are class indices in "
                         f"[0, num_classes): re-encode the column (dataset.map or "
                         f"dataset.class_encode_column({column!r}))")
    row = int(np.argmax(labels))
    distinct = len(np.unique(labels))
    if labels[row] > MAX_LABEL_SPARSITY * distinct:
        raise ValueError(f"label column {column!r} holds {labels[row]} (row {row}), which would make "
                         f"{int(labels[row]) + 1} classes for {distinct} distinct labels: re-encode the column "
                         f"(dataset.class_encode_column({column!r})), or give num_classes=<number of classes> if "
                         f"the ids are meant, or cast it to floats if they are regression targets "
                         f"(dataset.cast_column({column!r}, datasets.Value('float32')))")


def to_tensors(dataset: Any, features: Sequence[str], label: str,
               num_classes: Optional[int] = None) -> TensorDataset:
    """``(inputs, labels)`` of a ``datasets.Dataset``: see the module's docstring for the types
    (``num_classes``: see :func:`check_labels`; None takes a ``ClassLabel``'s number of names)."""
    datasets = import_datasets()
    inputs = []
    for name in features:
        values = column_array(dataset, name)
        if isinstance(dataset.features[name], datasets.Image):
            x = torch.from_numpy(values).float().div_(255.0)
            inputs.append(x.unsqueeze(1) if x.dim() == 3 else x.permute(0, 3, 1, 2))
        elif np.issubdtype(values.dtype, np.number) or values.dtype == bool:
            x = torch.from_numpy(values.astype(np.float32))
            nan = torch.isnan(x.reshape(len(x), -1)).any(dim=1).nonzero()
            if len(nan):
                raise ValueError(f"feature column {name!r} has a missing value (None or NaN) at row {int(nan[0])}: "
                                 "fill or drop such rows first (dataset.map / dataset.filter)")
            inputs.append(x.unsqueeze(1) if x.dim() == 1 else x)
        else:
            raise ValueError(f"feature column {name!r} holds {values.dtype} values; only images and numbers are "
                             "converted (map the column to numbers first)")
    if len(inputs) == 1:
        x = inputs[0]
    else:
        if any(isinstance(dataset.features[name], datasets.Image) for name in features):
            raise ValueError(f"features={list(features)} mixes an image column with others; give one image column")
        x = torch.cat([t.reshape(len(t), -1) for t in inputs], dim=1)
    y = column_array(dataset, label)
    if np.issubdtype(y.dtype, np.floating):  # regression targets (the datamodule refuses them num_classes)
        return TensorDataset(x, torch.from_numpy(y.astype(np.float32)))
    if not np.issubdtype(y.dtype, np.integer):
        raise ValueError(f"label column {label!r} holds {y.dtype} values, not integers (class indices) nor floats "
                         f"(regression targets); encode it first (dataset.class_encode_column({label!r}))")
    named = num_classes is None and isinstance(dataset.features[label], datasets.ClassLabel)
    check_labels(y, label, dataset.features[label].num_classes if named else num_classes, named)
    return TensorDataset(x, torch.from_numpy(y.astype(np.int64)))


class HuggingFaceFederated(FederatedDataModule):
    """A Hugging Face dataset split into clients.

    Args:
        dataset: a ``datasets.Dataset`` or ``datasets.DatasetDict``; or (e.g. from YAML) a
            string: a folder written by ``save_to_disk`` or a name / path for ``load_dataset``.
        features: the input column, or several numeric columns (concatenated).
        label: the label column: class indices in ``[0, num_classes)`` (integers), or regression
            targets (floats: the splits are then drawn at random, and partitioners that read classes refuse them).
        num_classes: the number of classes, bounding the labels; None takes the number of names of a
            ``ClassLabel`` column, and otherwise refuses negative labels and ids more than
            ``MAX_LABEL_SPARSITY`` (100) times the number of distinct labels.
        split: the split of a dataset dict to partition.
        test_split: the split of a dataset dict used as the global test set (None: none; the
            clients' ``test_fraction`` splits are then the test set).
        **kwargs: the ``FederatedDataModule`` arguments (``partitioner``, ``num_clients``,
            ``batch_size``, ``seed``...).
    """

    def __init__(
        self,
        dataset: Any,
        features: Union[str, list[str]] = "image",
        label: str = "label",
        split: str = "train",
        test_split: Optional[str] = None,
        num_classes: Optional[int] = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        given = features
        features = [features] if isinstance(features, str) else list(features) if isinstance(features, Sequence) else []
        if not features or not all(isinstance(f, str) for f in features):
            raise ValueError(f"features must be a column name or a non-empty list of them, got {given!r}")
        if not isinstance(label, str):
            raise ValueError(f"label must be a column name, got {label!r}")
        if num_classes is not None:
            check_int("num_classes", num_classes, 1)
        if not isinstance(dataset, str):
            self._check_dataset(dataset, split, test_split, features, label)
        self.dataset = dataset
        self.features = features
        self.label = label
        self.label_column = label
        self.split = split
        self.test_split = test_split
        self.num_classes = num_classes
        self._table: Any = None

    @staticmethod
    def _pick(dataset: Any, split: Optional[str], name: str) -> Any:
        """``dataset[split]`` of a dataset dict (the dataset itself when it is one ``Dataset``)."""
        if hasattr(dataset, "keys"):
            if split not in dataset:
                raise ValueError(f"{name}={split!r} is not a split of the dataset; its splits are {list(dataset)}")
            return dataset[split]
        if name == "test_split":
            raise ValueError(f"test_split={split!r} needs a DatasetDict, but the dataset is a single Dataset")
        return dataset

    def _check_dataset(self, dataset: Any, split: str, test_split: Optional[str], features: list[str],
                       label: str) -> None:
        """Refuse a dataset that is not a (map-style) ``Dataset``/``DatasetDict`` or lacks the columns."""
        datasets = import_datasets()
        if not isinstance(dataset, (datasets.Dataset, datasets.DatasetDict)):
            raise ValueError(f"dataset must be a datasets.Dataset, a datasets.DatasetDict or a path / name to load, "
                             f"got {type(dataset).__name__}")
        for name, chosen in (("split", split), ("test_split", test_split)):
            if chosen is None:
                continue
            table = self._pick(dataset, chosen, name)
            missing = [c for c in [*features, label] if c not in table.column_names]
            if missing:
                raise ValueError(f"columns {missing} are not in the dataset ({name}={chosen!r}); its columns are "
                                 f"{table.column_names}")
            if table.num_rows == 0:
                raise ValueError(f"the dataset ({name}={chosen!r}) is empty: it has no rows")

    def build_datasets(self) -> tuple[Dataset, Optional[Dataset]]:
        source = load(self.dataset) if isinstance(self.dataset, str) else self.dataset
        self._check_dataset(source, self.split, self.test_split, self.features, self.label)
        self._table = self._pick(source, self.split, "split")
        pool = to_tensors(self._table, self.features, self.label, self.num_classes)
        if self.test_split is None:
            return pool, None
        test = self._pick(source, self.test_split, "test_split")
        return pool, to_tensors(test, self.features, self.label, self.num_classes)

    def partition_column(self, name: str) -> Sequence:
        return column_array(self._table, name)

    def partition_keys(self) -> Sequence:
        raise ValueError("HuggingFaceFederated has no natural keys of its own: name the column, "
                         "NaturalIdPartitioner(partition_by=<column>)")
