"""The index of a folder of client files: what a federation's server needs to know of its clients.

A folder written by :func:`~fl_lightning.datamodules.write_client_files` holds ``index.json`` beside the
clients' files: every client's sample counts per split, which clients train (the others are unseen), a
checksum of each client's file, what the targets are (and, for class labels, each client's training label
counts) and whether the folder has a global test set. It is plain JSON, read without running code: a
deployment's server reads it and nothing of the clients' data (:class:`ClientIndex`).

The file of ``SyntheticFederated(num_clients=2, dim=20, min_samples=20, max_samples=60, seed=0)``::

    {"version": 1, "num_clients": 2,
     "samples": {"train": [42, 43], "val": [6, 6], "test": [12, 11]},
     "unseen_clients": [],
     "checksums": ["crc32:8b9a0a0d", "crc32:735b1f37"],
     "targets": {"kind": "class labels", "dtype": "int64", "shape": [], "num_classes": 8},
     "label_counts": [[0, 11, 0, 0, 0, 0, 0, 31], [1, 0, 1, 0, 2, 0, 20, 19]],
     "test_set": false}
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from typing import Any, NoReturn, Optional

from fl_lightning.datamodules.client_data import SPLITS

#: the name of the index of a folder of client files
INDEX = "index.json"
#: the version of the index's format that this module reads and writes
VERSION = 1


@dataclass(frozen=True)
class ClientIndex:
    """Every client of a folder of client files, as its ``index.json`` says (module docstring).

    Attributes:
        num_clients: the number of clients, ids ``0 .. num_clients - 1``.
        samples: every client's sample count of each split, ``{"train": [...], "val": [...], "test": [...]}``.
        unseen_clients: the clients never sampled for training.
        checksums: each client's file's :func:`~fl_lightning.checkpoints.checksum` (of its splits as read).
        targets: what the targets are (:func:`~fl_lightning.datamodules.targets.describe_targets`).
        label_counts: each client's training label counts (class labels only; else None).
        test_set: whether the folder has a global test set.
    """

    num_clients: int
    samples: dict[str, list[int]]
    unseen_clients: list[int]
    checksums: list[str]
    targets: dict[str, Any]
    label_counts: Optional[list[list[int]]]
    test_set: bool

    @property
    def train_clients(self) -> list[int]:
        """The clients sampled for training: every client but the unseen ones."""
        unseen = set(self.unseen_clients)
        return [c for c in range(self.num_clients) if c not in unseen]

    def write(self, root: str) -> None:
        """Write the index into ``root`` (``index.json``)."""
        with open(os.path.join(root, INDEX), "w") as file:
            json.dump({"version": VERSION, **asdict(self)}, file)

    @classmethod
    def read(cls, root: str) -> "ClientIndex":
        """The index of the folder ``root``, checked.

        Raises:
            ValueError: ``root`` has no index, or one that is not JSON or not this format (naming the field, its
                value and what it must be).
        """
        path = os.path.join(root, INDEX)
        if not os.path.isfile(path):
            raise ValueError(f"root must be a folder of client files with their {INDEX} (write_client_files), "
                             f"got {root!r}, which has no {INDEX}")
        try:
            with open(path) as file:
                data = json.load(file)
        except (UnicodeDecodeError, json.JSONDecodeError) as error:
            raise ValueError(f"{path} must be the JSON index that write_client_files writes: {error}") from error
        return _checked(data, path)


def _checked(data: Any, path: str) -> ClientIndex:
    """The :class:`ClientIndex` of ``data``, read from ``path``.

    Raises:
        ValueError: a field that is missing or not what it must be.
    """

    def refuse(field: str, must: str) -> NoReturn:
        value = repr(data.get(field, "<missing>") if isinstance(data, dict) else data)
        raise ValueError(f"{path}: {field!r} must be {must}, got {value[:120]}"
                         f" (an index of write_client_files, version {VERSION}: write the files again)")

    if not isinstance(data, dict):
        refuse("the index", "a JSON object")
    if data.get("version") != VERSION:
        refuse("version", str(VERSION))
    n = data.get("num_clients")
    if not _is_int(n) or n < 1:
        refuse("num_clients", "an integer >= 1")

    def counts(value: Any, length: int) -> bool:
        return isinstance(value, list) and len(value) == length and all(_is_int(v) and v >= 0 for v in value)

    samples = data.get("samples")
    if not isinstance(samples, dict) or sorted(samples) != sorted(SPLITS) or \
            not all(counts(samples[s], n) for s in SPLITS):
        refuse("samples", f"{{'train': [...], 'val': [...], 'test': [...]}}, each {n} sample counts (integers >= 0)")
    unseen = data.get("unseen_clients")
    if not isinstance(unseen, list) or not all(_is_int(c) and 0 <= c < n for c in unseen) or len(set(unseen)) == n:
        refuse("unseen_clients", f"a list of client ids in [0, {n}), not all of them")
    checksums = data.get("checksums")
    if not isinstance(checksums, list) or len(checksums) != n or not all(isinstance(c, str) for c in checksums):
        refuse("checksums", f"{n} strings, each client's file's checksum")
    if not isinstance(data.get("targets"), dict):
        refuse("targets", "the description of the targets, a JSON object")
    labels = data.get("label_counts")
    if labels is not None and not (isinstance(labels, list) and len(labels) == n and
                                   all(counts(row, len(labels[0])) for row in labels)):
        refuse("label_counts", f"null or {n} lists of label counts of one length")
    if not isinstance(data.get("test_set"), bool):
        refuse("test_set", "true or false")
    return ClientIndex(n, {s: samples[s] for s in SPLITS}, sorted(unseen), checksums, data["targets"], labels,
                       data["test_set"])


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
