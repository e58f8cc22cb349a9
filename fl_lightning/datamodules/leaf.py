"""FEMNIST from LEAF (Caldas et al., 2018): handwritten characters, one client per writer.

LEAF ships its preprocessed data as JSON files (``{"users": [...], "user_data": {user: {"x":
[[784 floats], ...], "y": [labels]}}}``) under ``<root>/train`` and ``<root>/test``; make them
with LEAF's ``preprocess.sh -s niid --sf 1.0 -k 0 -t sample`` (no download happens here). The
train and test files are pooled and partitioned ``natural``-ly by writer; each writer's test
split is ``test_fraction`` of its own samples (LEAF's default split is 90/10 per writer too).
Images are 1x28x28 in [0, 1]; ``pad_to=32`` zero-pads them to 32x32 (PeFLL's setting).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Optional, Sequence

import numpy as np
import torch
import torch.nn.functional as F
from torch.utils.data import Dataset, TensorDataset

from fl_lightning.datamodules.base import FederatedDataModule
from fl_lightning.datamodules.partitioners import NaturalIdPartitioner, Partitioner


def read_leaf(folder: Path) -> tuple[list[np.ndarray], list[np.ndarray], list[str]]:
    """Per-user (inputs, labels) and user names of every LEAF JSON file in ``folder``."""
    xs, ys, users = [], [], []
    for path in sorted(folder.glob("*.json")):
        blob = json.loads(path.read_text())
        for user in blob["users"]:
            entry = blob["user_data"][user]
            xs.append(np.asarray(entry["x"], dtype=np.float32))
            ys.append(np.asarray(entry["y"], dtype=np.int64))
            users.append(user)
    return xs, ys, users


class FEMNISTFederated(FederatedDataModule):
    """LEAF FEMNIST, one client per writer (62 classes).

    Args:
        root: folder holding LEAF's ``train/`` and ``test/`` JSON folders.
        pad_to: zero-pad the 28x28 images to this size (28 = no padding).
        num_clients: number of writers in the files (checked), or None to take them all.
        test_fraction: each writer's held-out test share.
        **kwargs: the other ``FederatedDataModule`` arguments.
    """

    num_classes = 62

    def __init__(
        self,
        root: str = "data/femnist",
        pad_to: int = 28,
        num_clients: Optional[int] = None,
        test_fraction: float = 0.1,
        **kwargs: Any,
    ) -> None:
        super().__init__(num_clients=num_clients, test_fraction=test_fraction, **kwargs)
        if pad_to < 28:
            raise ValueError(f"pad_to must be >= 28, got {pad_to}")
        self.root = Path(root)
        self.pad_to = pad_to
        self._writers: Optional[np.ndarray] = None

    def build_datasets(self) -> tuple[Dataset, Optional[Dataset]]:
        per_user: list[tuple[list[np.ndarray], list[np.ndarray], list[str]]] = []
        for split in ("train", "test"):
            folder = self.root / split
            if not folder.is_dir():
                raise RuntimeError(f"FEMNIST not found: no folder {str(folder)!r} (make it with LEAF's preprocess.sh)")
            per_user.append(read_leaf(folder))
        names = sorted({u for _, _, users in per_user for u in users})
        index = {u: i for i, u in enumerate(names)}
        if self.num_clients is not None and self.num_clients != len(names):
            raise ValueError(f"num_clients={self.num_clients} but the LEAF files hold {len(names)} writers")
        x = np.concatenate([a for xs, _, _ in per_user for a in xs])
        y = np.concatenate([a for _, ys, _ in per_user for a in ys])
        self._writers = np.concatenate(
            [np.full(len(a), index[u]) for xs, _, users in per_user for a, u in zip(xs, users)])
        images = torch.from_numpy(x).view(-1, 1, 28, 28)
        pad = self.pad_to - 28
        images = F.pad(images, (pad // 2, pad - pad // 2, pad // 2, pad - pad // 2))
        return TensorDataset(images, torch.from_numpy(y)), None

    def default_partitioner(self) -> Partitioner:
        """One client per writer (``NaturalIdPartitioner()``)."""
        return NaturalIdPartitioner()

    def partition_keys(self) -> Sequence:
        assert self._writers is not None
        return self._writers
