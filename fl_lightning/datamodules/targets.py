"""The targets of a pool of samples: where they are read from, whether they are class labels, and
what they are in words.

A sample is a tuple or list ``(inputs, target, ...)``, whose target is its second element (a
``TensorDataset``'s second tensor), or a dict holding its target under a key (a datamodule's
``label_column``, ``"label"`` by default: Hugging Face's style). Other samples are refused, saying how
to adapt them.

Targets are **class labels** when they are one integer (or bool) per sample, none negative
(:func:`are_class_labels`): a datamodule then stratifies its clients' splits by class, counts labels
per client and lets the class partitioners (Dirichlet, pathological, shards...) read them. Any other
targets (floats, vectors ``[N, k]``, negative integers, dicts...) are those of another task, a
regression say: the splits are drawn at random and the targets are described by their type, shape
and a few statistics (:func:`describe_targets`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import torch
from torch import Tensor
from torch.utils.data import ConcatDataset, Dataset, Subset, TensorDataset

#: how a sample may hold its target, in words (the end of every refusal)
SUPPORTED = ("a sample must be a tuple or list (inputs, target, ...), whose target is its second element (a "
             "TensorDataset of (inputs, targets, ...)), or a dict holding its target under the datamodule's "
             "label_column")


def as_array(tensor: Tensor) -> np.ndarray:
    """A tensor's values as a numpy array, on the host (bfloat16, which numpy lacks, as float32)."""
    tensor = tensor.detach().cpu()
    return (tensor.float() if tensor.dtype == torch.bfloat16 else tensor).numpy()


def target_of(sample: Any, key: str = "label") -> Any:
    """A sample's target: the second element of a tuple or list, or the entry ``key`` of a dict.

    Raises:
        ValueError: the sample is of another kind, or a dict without ``key``; the message says what
            is supported and how to adapt the data.
    """
    if isinstance(sample, Mapping):
        if key not in sample:
            raise ValueError(f"the samples are dicts with keys {list(sample)}, and the datamodule's label_column "
                             f"{key!r} is not one of them: set label_column to the key of the targets (a class "
                             "attribute of your FederatedDataModule subclass), or override its targets_of")
        return sample[key]
    if isinstance(sample, (tuple, list)) and len(sample) >= 2:
        return sample[1]
    what = f"a {type(sample).__name__}" + (f" of {len(sample)}" if isinstance(sample, (tuple, list)) else "")
    raise ValueError(f"a sample is {what}, which holds no target: {SUPPORTED}; adapt the samples with a transform "
                     "in build_datasets (or a TensorDataset of (inputs, targets))")


def stack_targets(values: list[Any]) -> np.ndarray:
    """Samples' targets as one array, samples first: numbers and arrays of one shape stacked (Python
    ints as int64), anything else (dicts, arrays of several shapes) as a 1-D array of objects."""
    arrays = [as_array(v) if isinstance(v, Tensor) else v for v in values]
    if not arrays:
        return np.asarray(arrays)
    if not any(isinstance(a, Mapping) for a in arrays):
        try:
            return np.stack([np.asarray(a) for a in arrays])
        except ValueError:  # shapes differ
            pass
    stacked = np.empty(len(arrays), dtype=object)
    for i, value in enumerate(values):
        stacked[i] = value
    return stacked


def labels_of(dataset: Dataset, key: str = "label") -> np.ndarray:
    """The target of every sample of ``dataset``, samples first: a ``TensorDataset``'s second tensor
    (the first is the inputs), a table's column ``key`` (a Hugging Face ``datasets.Dataset``), a
    dataset's ``targets`` (torchvision's), else each sample's :func:`target_of`, read one by one.

    Args:
        dataset: any map-style dataset (``Subset`` and ``ConcatDataset`` are read through).
        key: where a dict sample (or a table) holds its target: the datamodule's ``label_column``.

    Raises:
        ValueError: a ``TensorDataset`` of one tensor, or samples that hold no target (:func:`target_of`).
    """
    if isinstance(dataset, TensorDataset):
        if len(dataset.tensors) < 2:
            raise ValueError(f"a TensorDataset of {len(dataset.tensors)} tensor holds no targets: {SUPPORTED}")
        return as_array(dataset.tensors[1])
    if isinstance(dataset, Subset):
        return labels_of(dataset.dataset, key)[np.asarray(dataset.indices, dtype=np.int64)]
    if isinstance(dataset, ConcatDataset):
        return np.concatenate([labels_of(d, key) for d in dataset.datasets])
    if key in (getattr(dataset, "column_names", None) or ()):
        column = dataset[key]  # type: ignore[index]
        return as_array(column) if isinstance(column, Tensor) else stack_targets(list(column))
    targets = getattr(dataset, "targets", None)
    if targets is not None:
        return np.asarray(targets.cpu() if isinstance(targets, Tensor) else targets)
    return stack_targets([target_of(dataset[i], key) for i in range(len(dataset))])  # type: ignore[arg-type]


def are_class_labels(targets: np.ndarray) -> bool:
    """Whether ``targets`` are class labels: one integer (or bool) per sample, none negative.

    >>> [are_class_labels(np.array(targets)) for targets in ([0, 2, 1], [0.5, 1.0], [-1, 1])]
    [True, False, False]
    """
    integers = np.issubdtype(targets.dtype, np.integer) or targets.dtype == bool
    return targets.ndim == 1 and integers and (len(targets) == 0 or bool(targets.min() >= 0))


def describe_targets(targets: np.ndarray) -> dict[str, Any]:
    """What ``targets`` are, as plain data (``partition.json`` holds it): ``kind`` (``"class labels"``,
    ``"numbers"`` or ``"objects"``), ``dtype`` and ``shape`` (one sample's), with ``num_classes`` (the
    largest label + 1) for class labels, ``mean``, ``std``, ``min`` and ``max`` (over every value)
    for other numbers, and ``type`` (with ``keys`` for dicts) for objects."""
    numeric = np.issubdtype(targets.dtype, np.number) or targets.dtype == bool
    kind = "class labels" if are_class_labels(targets) else "numbers" if numeric else "objects"
    out: dict[str, Any] = {"kind": kind, "dtype": str(targets.dtype), "shape": list(targets.shape[1:])}
    if not len(targets):
        return out
    if kind == "class labels":
        out["num_classes"] = int(targets.max()) + 1
    elif kind == "numbers":
        values = targets.astype(np.float64)
        out.update(mean=float(values.mean()), std=float(values.std()), min=float(values.min()),
                   max=float(values.max()))
    elif targets.dtype == object:
        first = targets[0]
        out["type"] = type(first).__name__
        if isinstance(first, Mapping):
            out["keys"] = [str(k) for k in first]
    return out


def targets_in_words(description: dict[str, Any]) -> str:
    """A :func:`describe_targets` description in words (``float32 numbers of shape [] (mean 0.1, std
    1, min -3, max 3)``)."""
    words = f"{description['dtype']} {description['kind']} of shape {description['shape']}"
    if "num_classes" in description:
        return f"{words} ({description['num_classes']} classes)"
    if "mean" in description:
        stats = ", ".join(f"{name} {description[name]:.4g}" for name in ("mean", "std", "min", "max"))
        return f"{words} ({stats})"
    if "type" in description:
        keys = f" with keys {description['keys']}" if "keys" in description else ""
        return f"{description['type']} {description['kind']}{keys}"
    return words
