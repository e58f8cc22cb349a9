"""``HuggingFaceFederated``: a Hugging Face ``datasets.Dataset`` as a federation.

The dataset is converted once to tensors (a ``TensorDataset``, so a client's mini-batch is a
slice) and split by any partitioner: ``NaturalIdPartitioner(partition_by="user")`` gives one
client per value of a column, the label partitioners read the label column (or the column
their ``partition_by`` names), and ``FlowerPartitioner`` runs a flwr-datasets partitioner.

Supported columns (converted through numpy):

* an ``Image`` column: float32 ``[N, C, H, W]`` in [0, 1] (all images of one size);
* numeric columns: scalars, or lists / arrays of one shape per column, as float32; several
  feature columns are flattened and concatenated into one ``[N, F]`` vector;
* the label column: integers (``ClassLabel`` or ``int``), as int64.

Text and other types need a conversion first (``dataset.map``, ``class_encode_column``).
Needs the ``datasets`` package: ``pip install 'fl-lightning[hf]'``.
"""

from __future__ import annotations

from pathlib import Path
from types import ModuleType
from typing import Any, Optional, Sequence, Union

import numpy as np
import torch
from torch.utils.data import Dataset, TensorDataset

from fl_lightning.datamodules.base import FederatedDataModule


def import_datasets() -> ModuleType:
    """The ``datasets`` package, or an ImportError that says how to install it."""
    try:
        import datasets
    except ImportError as error:
        raise ImportError("Hugging Face datasets are not installed: pip install 'fl-lightning[hf]' (or "
                          "pip install datasets)") from error
    return datasets


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
    values = dataset.select_columns([name]).with_format("numpy")[:][name]
    if values.dtype == object:
        try:
            values = np.stack(list(values))
        except ValueError as error:
            raise ValueError(f"column {name!r} has samples of different shapes; only fixed-shape columns can be "
                             "converted to tensors") from error
    return values


def to_tensors(dataset: Any, features: Sequence[str], label: str) -> TensorDataset:
    """``(inputs, labels)`` of a ``datasets.Dataset``: see the module's docstring for the types."""
    datasets = import_datasets()
    inputs = []
    for name in features:
        values = column_array(dataset, name)
        if isinstance(dataset.features[name], datasets.Image):
            x = torch.from_numpy(values).float().div_(255.0)
            inputs.append(x.unsqueeze(1) if x.dim() == 3 else x.permute(0, 3, 1, 2))
        elif np.issubdtype(values.dtype, np.number) or values.dtype == bool:
            inputs.append(torch.from_numpy(values.astype(np.float32)))
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
    if not np.issubdtype(y.dtype, np.integer):
        raise ValueError(f"label column {label!r} holds {y.dtype} values, not integers; encode it first "
                         f"(dataset.class_encode_column({label!r}))")
    return TensorDataset(x, torch.from_numpy(y.astype(np.int64)))


class HuggingFaceFederated(FederatedDataModule):
    """A Hugging Face dataset split into clients.

    Args:
        dataset: a ``datasets.Dataset`` or ``datasets.DatasetDict``; or (e.g. from YAML) a
            string: a folder written by ``save_to_disk`` or a name / path for ``load_dataset``.
        features: the input column, or several numeric columns (concatenated).
        label: the integer label column.
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
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        features = [features] if isinstance(features, str) else list(features)
        if not features or not all(isinstance(f, str) for f in features):
            raise ValueError(f"features must be a column name or a non-empty list of them, got {features!r}")
        if not isinstance(dataset, str):
            self._check_dataset(dataset, split, test_split, features, label)
        self.dataset = dataset
        self.features = features
        self.label = label
        self.label_column = label
        self.split = split
        self.test_split = test_split
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

    def build_datasets(self) -> tuple[Dataset, Optional[Dataset]]:
        source = load(self.dataset) if isinstance(self.dataset, str) else self.dataset
        self._check_dataset(source, self.split, self.test_split, self.features, self.label)
        self._table = self._pick(source, self.split, "split")
        pool = to_tensors(self._table, self.features, self.label)
        if self.test_split is None:
            return pool, None
        return pool, to_tensors(self._pick(source, self.test_split, "test_split"), self.features, self.label)

    def partition_column(self, name: str) -> Sequence:
        return column_array(self._table, name)

    def partition_keys(self) -> Sequence:
        raise ValueError("HuggingFaceFederated has no natural keys of its own: name the column, "
                         "NaturalIdPartitioner(partition_by=<column>)")
