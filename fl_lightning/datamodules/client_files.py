"""A federation stored one file per client, of which a datamodule reads only the clients it is told to.

:func:`write_client_files` writes a set-up datamodule's clients, each client's train, validation and
test splits in a file of its own (``client_<id>.pt``), and an index of every client's sample counts
(``index.json``). :class:`ClientFilesFederated` reads them back as a federation: every client
(a simulation, a deployment's server), or only those :meth:`ClientFilesFederated.select_clients`
names (a deployment node, which then needs only its own clients' files and the index). The splits
are the files': a client's data and their order are the same whichever clients are read, so its
rounds give the same bits on a node that holds only its own files.
"""

from __future__ import annotations

import json
import os
from typing import Any, Optional, Sequence

import numpy as np
import torch
from torch.utils.data import Dataset, TensorDataset

from fl_lightning.datamodules.base import FederatedDataModule, check_finite
from fl_lightning.datamodules.client_data import SPLITS
from fl_lightning.datamodules.targets import are_class_labels

#: the name of the index of a folder of client files
INDEX = "index.json"


def client_file(root: str, client_id: int) -> str:
    """The file of client ``client_id``'s splits under ``root``."""
    return os.path.join(root, f"client_{client_id}.pt")


def write_client_files(datamodule: FederatedDataModule, root: str, clients: Optional[Sequence[int]] = None) -> None:
    """Write ``datamodule``'s clients (set up here if it is not yet) into ``root``: each client's splits in its
    own file, ``{split: [tensor, ...]}`` (the columns of the pool's ``TensorDataset``), and the index of every
    client's sample counts. ``clients``: write only these clients' files (the index always names every client:
    a node's folder holds the index and its own clients' files).

    Raises:
        ValueError: a pool that is not a ``TensorDataset``, or a client id out of range.
    """
    if not datamodule.splits:
        datamodule.setup("fit")
    pool, num_clients = datamodule.pool, len(datamodule.splits["train"])
    if not isinstance(pool, TensorDataset):
        raise ValueError(f"write_client_files needs a datamodule whose pool is a TensorDataset, "
                         f"{type(datamodule).__name__}'s is {type(pool).__name__}")
    chosen = range(num_clients) if clients is None else clients
    bad = [c for c in chosen if not 0 <= c < num_clients]
    if bad:
        raise ValueError(f"clients must be ids in [0, {num_clients}), got {bad}")
    os.makedirs(root, exist_ok=True)
    for client_id in chosen:
        splits = {split: [t[torch.from_numpy(datamodule.splits[split][client_id])] for t in pool.tensors]
                  for split in SPLITS}
        torch.save(splits, client_file(root, client_id))
    counts = {split: [len(part) for part in datamodule.splits[split]] for split in SPLITS}
    with open(os.path.join(root, INDEX), "w") as file:
        json.dump({"num_clients": num_clients, "samples": counts}, file)


class ClientFilesFederated(FederatedDataModule):
    """The clients of a folder of client files (:func:`write_client_files`), each client's splits its file's.

    Every client is read unless :meth:`select_clients` chose some: then only their files are opened (and the
    index, which says every client's sample counts, :meth:`num_samples`). The other clients have no data here.

    Args:
        root: the folder of ``index.json`` and the ``client_<id>.pt`` files.
        batch_size: clients' local mini-batch size.
        eval_batch_size: batch size of evaluation loaders.
        print_summary: print the per-client summary at setup.
        pool_on_device: where the clients' samples live on an accelerator (see :class:`FederatedDataModule`).

    Raises:
        ValueError: ``root`` holds no index.
    """

    def __init__(self, root: str, batch_size: int = 32, eval_batch_size: int = 512, print_summary: bool = False,
                 pool_on_device: Optional[bool] = None) -> None:
        index = os.path.join(root, INDEX)
        if not os.path.isfile(index):
            raise ValueError(f"root must be a folder of client files with their {INDEX} (write_client_files), "
                             f"got {root!r}, which has no {INDEX}")
        with open(index) as file:
            self.index: dict[str, Any] = json.load(file)
        super().__init__(num_clients=int(self.index["num_clients"]), val_fraction=0.0, batch_size=batch_size,
                         eval_batch_size=eval_batch_size, print_summary=print_summary, pool_on_device=pool_on_device)
        self.root = root
        #: the clients whose files are read (None: every client's)
        self.selected: Optional[list[int]] = None

    def select_clients(self, clients: Sequence[int]) -> None:
        """Read only ``clients``' files at setup (a deployment node's clients).

        Raises:
            ValueError: no clients, ids out of range, or the datamodule is set up already.
        """
        num_clients = int(self.index["num_clients"])
        bad = [c for c in clients if not 0 <= c < num_clients]
        if not clients or bad:
            raise ValueError(f"clients must be one or more ids in [0, {num_clients}), got {list(clients)}")
        if self.splits:
            raise ValueError("select_clients must come before setup: the clients' files are read at setup")
        self.selected = sorted(int(c) for c in clients)

    def build_datasets(self) -> tuple[Dataset, Optional[Dataset]]:
        """(Not used: :meth:`setup` reads the files.)"""
        raise NotImplementedError("ClientFilesFederated reads its clients' files in setup")

    def setup(self, stage: Optional[str] = None) -> None:
        """Read the chosen clients' files: the pool is their samples, client after client, split after split;
        each client's splits its file's.

        Raises:
            ValueError: a file that is not a client's splits, or whose counts are not the index's.
        """
        if self.splits:
            return
        num_clients = int(self.index["num_clients"])
        counts = self.index["samples"]
        empty = np.array([], dtype=np.int64)
        self.splits = {split: [empty] * num_clients for split in SPLITS}
        columns: list[list[torch.Tensor]] = []
        offset = 0
        for client_id in range(num_clients) if self.selected is None else self.selected:
            path = client_file(self.root, client_id)
            data = torch.load(path, map_location="cpu", weights_only=True)
            for split in SPLITS:
                tensors = data.get(split) if isinstance(data, dict) else None
                size = len(tensors[0]) if tensors else -1
                if size != counts[split][client_id] or any(len(t) != size for t in tensors or ()):
                    raise ValueError(f"{path} must hold client {client_id}'s {split!r} split as tensors of "
                                     f"{counts[split][client_id]} samples (the index's), got "
                                     f"{[tuple(t.shape) for t in tensors or ()]}")
                self.splits[split][client_id] = np.arange(offset, offset + size, dtype=np.int64)
                offset += size
                columns.append(tensors)
        self.pool = TensorDataset(*[torch.cat(column) for column in zip(*columns)])
        check_finite(self.pool, f"{type(self).__name__}'s pool")
        self.pool_targets = self._read_targets(self.pool, "pool")
        self._class_labels = are_class_labels(self.pool_targets)
        self._partition_digest = None
        self.train_clients = list(range(num_clients))
        if self.print_summary:
            print(self.summary())

    def partition_name(self) -> str:
        """The partition in words: the files'."""
        return f"the client files of {self.root}"

    def num_samples(self, client_id: int) -> int:
        """Size of the client's training split (the index's: also of a client whose file is not read)."""
        return int(self.index["samples"]["train"][client_id])
