"""A federation stored one file per client, of which a datamodule reads only the clients it is told to.

:func:`write_client_files` writes a set-up datamodule's clients into a folder, each client's train,
validation and test splits in a file of its own, with the datamodule's global test set (if it has one)
and the index of every client (:class:`~fl_lightning.datamodules.client_index.ClientIndex`)::

    root/
      index.json       every client's sample counts, whether it trains, its file's checksum, label counts
      test_set.pt      the global test set, {"test": [tensor, ...]} (only if the datamodule has one)
      client_<id>.pt   client <id>'s splits, {"train": [tensor, ...], "val": [...], "test": [...]}

(each list holds the columns of the pool's ``TensorDataset``: inputs, targets, ...).
:class:`ClientFilesFederated` reads them back as a federation: every client (a simulation), only those
:meth:`~ClientFilesFederated.select_clients` names (a deployment's node, whose folder then needs only the
index and its own clients' files), or none, the index alone (:meth:`~ClientFilesFederated.read_index_only`:
a deployment's server, whose folder needs only the index, and the global test set to test on). The splits
are the files': a client's data and their order are the same whichever clients are read, so its rounds
give the same bits on a node that holds only its own files; which clients train, their sample counts, the
partition's record and its hash are the index's, the same whichever are read.
"""

from __future__ import annotations

import hashlib
import json
import os
from typing import Any, Optional, Sequence

import numpy as np
import torch
from torch import Tensor
from torch.utils.data import Dataset, TensorDataset

from fl_lightning.checkpoints import checksum
from fl_lightning.datamodules.base import FederatedDataModule, check_finite
from fl_lightning.datamodules.client_data import SPLITS, ClientData, Split
from fl_lightning.datamodules.client_index import INDEX, ClientIndex
from fl_lightning.datamodules.targets import are_class_labels, describe_targets, labels_of
from fl_lightning.lightning_package import rank_zero_warn

#: the name of the global test set's file in a folder of client files
TEST_SET = "test_set.pt"


def client_file(root: str, client_id: int) -> str:
    """The file of client ``client_id``'s splits under ``root``."""
    return os.path.join(root, f"client_{client_id}.pt")


def write_client_files(datamodule: FederatedDataModule, root: str,
                       clients: Optional[Sequence[int]] = None) -> ClientIndex:
    """Write ``datamodule``'s clients (set up here if it is not yet) into ``root`` (the module docstring gives the
    layout): each client's splits in its own file, the global test set if the datamodule has one, and the index of
    every client. ``clients``: write only these clients' files (a node's folder: the index and its own clients'
    files; ``[]``: none, a deployment server's folder). Returns the index.

    Raises:
        ValueError: a pool or test set that is not a ``TensorDataset``, or a client id out of range.
    """
    if not datamodule.splits:
        datamodule.setup("fit")
    pool, test_set, num_clients = datamodule.pool, datamodule.test_set, len(datamodule.splits["train"])
    for dataset, name in ((pool, "pool"), (test_set, "test set")):
        if dataset is not None and not isinstance(dataset, TensorDataset):
            raise ValueError(f"write_client_files needs a datamodule whose {name} is a TensorDataset, "
                             f"{type(datamodule).__name__}'s is {type(dataset).__name__}")
    assert isinstance(pool, TensorDataset)
    chosen = set(range(num_clients) if clients is None else clients)
    bad = sorted(c for c in chosen if not 0 <= c < num_clients)
    if bad:
        raise ValueError(f"clients must be ids in [0, {num_clients}), got {bad}")
    os.makedirs(root, exist_ok=True)
    checksums = []
    for client_id in range(num_clients):
        splits = {split: [t[torch.from_numpy(datamodule.splits[split][client_id])] for t in pool.tensors]
                  for split in SPLITS}
        checksums.append(checksum(splits))
        if client_id in chosen:
            torch.save(splits, client_file(root, client_id))
    if test_set is not None:
        torch.save({"test": list(test_set.tensors)}, os.path.join(root, TEST_SET))
    # the targets as a reader of every client's file has them: client after client, split after split
    targets = labels_of(pool, ClientFilesFederated.label_column)
    read = targets[np.concatenate([datamodule.splits[split][c] for c in range(num_clients) for split in SPLITS])]
    label_counts = None
    if are_class_labels(read):
        label_counts = [np.bincount(targets[datamodule.splits["train"][c]], minlength=int(read.max()) + 1).tolist()
                        for c in range(num_clients)]
    index = ClientIndex(num_clients, {split: [len(part) for part in datamodule.splits[split]] for split in SPLITS},
                        sorted(int(c) for c in datamodule.unseen_clients), checksums, describe_targets(read),
                        label_counts, test_set is not None)
    index.write(root)
    return index


class ClientFilesFederated(FederatedDataModule):
    """The clients of a folder of client files (:func:`write_client_files`), each client's splits its file's.

    Every client is read unless :meth:`select_clients` chose some (only their files are opened) or
    :meth:`read_index_only` none (no client's file is opened). Which clients train, their sample counts
    (:meth:`num_samples`), training label counts, the partition's hash and record are the index's: the same
    whichever clients are read. The other clients have no data here: asking for it is an error.

    Args:
        root: the folder of ``index.json``, the ``client_<id>.pt`` files and, if written, ``test_set.pt``.
        batch_size: clients' local mini-batch size.
        eval_batch_size: batch size of evaluation loaders.
        print_summary: print the per-client summary at setup.
        pool_on_device: where the clients' samples live on an accelerator (see :class:`FederatedDataModule`).

    Raises:
        ValueError: ``root`` holds no index, or a malformed one (:meth:`ClientIndex.read
            <fl_lightning.datamodules.client_index.ClientIndex.read>`).
    """

    def __init__(self, root: str, batch_size: int = 32, eval_batch_size: int = 512, print_summary: bool = False,
                 pool_on_device: Optional[bool] = None) -> None:
        #: what the folder's index says of every client
        self.index = ClientIndex.read(root)
        super().__init__(num_clients=self.index.num_clients, val_fraction=0.0, batch_size=batch_size,
                         eval_batch_size=eval_batch_size, print_summary=print_summary, pool_on_device=pool_on_device)
        self.root = root
        #: the clients whose files are read (None: every client's; empty: none, the index only)
        self.selected: Optional[list[int]] = None

    def select_clients(self, clients: Sequence[int]) -> None:
        """Read only ``clients``' files at setup (a deployment node's clients).

        Raises:
            ValueError: no clients, ids the index does not have, or the datamodule is set up already.
        """
        num_clients = self.index.num_clients
        bad = [c for c in clients if not 0 <= c < num_clients]
        if not clients or bad:
            raise ValueError(f"clients must be one or more of the client ids of {os.path.join(self.root, INDEX)}, "
                             f"[0, {num_clients}), got {list(clients)}" + (f" ({bad} not in it)" if bad else ""))
        self._before_setup("select_clients")
        self.selected = sorted(int(c) for c in clients)

    def read_index_only(self) -> None:
        """Read no client's file at setup, only the index (a deployment's server: its clients' data stay on their
        nodes). The clients train and are weighted as the index says; there is no validation data (validating
        on the clients' splits is the nodes' to do); the global test set is the folder's ``test_set.pt``.

        Raises:
            ValueError: the datamodule is set up already.
        """
        self._before_setup("read_index_only")
        self.selected = []

    def _before_setup(self, method: str) -> None:
        if self.splits:
            raise ValueError(f"{method} must come before setup: the clients' files are read at setup")

    @property
    def index_only(self) -> bool:
        """Whether no client's file is read (:meth:`read_index_only`)."""
        return self.selected == []

    def holds_data(self, client_id: int) -> bool:
        """Whether client ``client_id``'s file is read here."""
        return self.selected is None or client_id in self.selected

    def build_datasets(self) -> tuple[Dataset, Optional[Dataset]]:
        """(Not used: :meth:`setup` reads the files.)"""
        raise NotImplementedError("ClientFilesFederated reads its clients' files in setup")

    def setup(self, stage: Optional[str] = None) -> None:
        """Read the chosen clients' files: the pool is their samples, client after client, split after split;
        each client's splits its file's. Which clients train is the index's.

        Raises:
            ValueError: a file that is not its client's splits as the index names them (sample counts, checksum).
        """
        if self.splits:
            return
        num_clients = self.index.num_clients
        empty = np.array([], dtype=np.int64)
        self.splits = {split: [empty] * num_clients for split in SPLITS}
        columns: list[list[Tensor]] = []
        offset = 0
        for client_id in range(num_clients) if self.selected is None else self.selected:
            data = self._read_client(client_id)
            for split in SPLITS:
                size = len(data[split][0])
                self.splits[split][client_id] = np.arange(offset, offset + size, dtype=np.int64)
                offset += size
                columns.append(data[split])
        if columns:
            self.pool = TensorDataset(*[torch.cat(column) for column in zip(*columns)])
            check_finite(self.pool, f"{type(self).__name__}'s pool")
            self.pool_targets = self._read_targets(self.pool, "pool")
        self._class_labels = self.index.label_counts is not None
        self._partition_digest = None
        self.unseen_clients = list(self.index.unseen_clients)
        self.train_clients = self.index.train_clients
        if self.print_summary:
            print(self.summary())

    def _read_client(self, client_id: int) -> dict[str, list[Tensor]]:
        """Client ``client_id``'s splits, read from its file (without running code) and checked against the index.

        Raises:
            ValueError: not ``{split: [tensor, ...]}`` of the index's sample counts, or another checksum.
        """
        path = client_file(self.root, client_id)
        data = torch.load(path, map_location="cpu", weights_only=True)
        counts = {split: self.index.samples[split][client_id] for split in SPLITS}
        if not isinstance(data, dict) or sorted(data) != sorted(SPLITS) or not all(
                isinstance(data[s], list) and data[s] and all(isinstance(t, Tensor) and t.dim() and len(t) == counts[s]
                                                              for t in data[s]) for s in SPLITS):
            got = {k: [tuple(t.shape) if isinstance(t, Tensor) else type(t).__name__ for t in v]
                   if isinstance(v, list) else type(v).__name__ for k, v in data.items()} \
                if isinstance(data, dict) else type(data).__name__
            raise ValueError(f"{path} must hold client {client_id}'s splits as {{split: [tensor, ...]}} of {counts} "
                             f"samples (the index's), got {got}")
        found, expected = checksum(data), self.index.checksums[client_id]
        if found != expected:
            raise ValueError(f"{path} must be the file of client {client_id} that {INDEX} names (checksum {expected}), "
                             f"got one whose checksum is {found}: a file of another partition, or changed since")
        return data

    def client_data(self, client_id: int, split: Split = "train") -> ClientData:
        """Client ``client_id``'s ``split``, of a client whose file is read.

        Raises:
            ValueError: a client whose file is not read here (its data are on its node).
        """
        if 0 <= client_id < self.index.num_clients and not self.holds_data(client_id):
            read = "only the index" if self.index_only else f"only the files of clients {self.selected}"
            raise ValueError(f"client_id must be a client whose file is read here: {type(self).__name__} of "
                             f"{self.root!r} reads {read}, got {client_id} (its data are on the node that holds it)")
        return super().client_data(client_id, split)

    def place_pool(self, device: torch.device) -> None:
        """As :meth:`FederatedDataModule.place_pool`; nothing to place when only the index is read."""
        if not (self.index_only and self.splits):
            super().place_pool(device)

    def num_samples(self, client_id: int) -> int:
        """Size of the client's training split (the index's: also of a client whose file is not read)."""
        return self.index.samples["train"][client_id]

    def split_size(self, client_id: int, split: Split) -> int:
        """Size of the client's ``split`` (the index's: also of a client whose file is not read)."""
        return self.index.samples[split][client_id]

    @property
    def has_class_labels(self) -> bool:
        """Whether the targets are class labels (the index's)."""
        return self.index.label_counts is not None

    def describe_targets(self) -> dict[str, Any]:
        """What the targets are (the index's: the targets of every client's splits)."""
        return dict(self.index.targets)

    def label_histogram(self, client_id: int, split: Split = "train") -> np.ndarray:
        """Counts per class of the client's ``split`` (class labels only): the index's for the training split
        (also of a client whose file is not read), the file's for the others."""
        if split == "train" and self.index.label_counts is not None:
            return np.array(self.index.label_counts[client_id], dtype=np.int64)
        self.client_data(client_id, split)  # refused if the client's file is not read
        return super().label_histogram(client_id, split)

    def partition_hash(self) -> str:
        """A short digest of the partition: the index's sample counts and files' checksums (the same whichever
        clients' files are read)."""
        record = json.dumps([type(self).__qualname__, self.index.samples, self.index.checksums]).encode()
        return hashlib.sha256(record).hexdigest()[:16]

    def partition_name(self) -> str:
        """The partition in words: the files'."""
        return f"the client files of {self.root}"

    def validation_set(self) -> Dataset:
        """The union of the read clients' validation splits; none when only the index is read (with a warning:
        the server's validation is skipped)."""
        if self.index_only:
            rank_zero_warn(f"{type(self).__name__} of {self.root!r} reads only the index (read_index_only): the "
                           "clients' validation splits are on their nodes, so the server's validation is skipped")
            return TensorDataset(torch.empty(0))
        return super().validation_set()

    def global_test_set(self) -> Dataset:
        """The folder's global test set (``test_set.pt``, read at the first call), or, where it has none, the
        union of the read clients' test splits.

        Raises:
            ValueError: no test set: none written, and only the index read; a malformed ``test_set.pt``.
        """
        if self.index.test_set:
            if self.test_set is None:
                self.test_set = self._read_test_set()
            return self.test_set
        if self.index_only:
            raise ValueError(f"{type(self).__name__} of {self.root!r} has no global test set ({INDEX} says none was "
                             f"written, {TEST_SET}) and reads only the index: the clients' test splits are on their "
                             "nodes; write a datamodule that has a test set (write_client_files writes it)")
        return super().global_test_set()

    def _read_test_set(self) -> TensorDataset:
        path = os.path.join(self.root, TEST_SET)
        if not os.path.isfile(path):
            raise ValueError(f"{self.root!r} must hold the global test set that its {INDEX} names, {TEST_SET} "
                             "(write_client_files writes it)")
        data = torch.load(path, map_location="cpu", weights_only=True)
        tensors = data.get("test") if isinstance(data, dict) else None
        if not (isinstance(tensors, list) and tensors and all(isinstance(t, Tensor) and t.dim() for t in tensors)
                and len({len(t) for t in tensors}) == 1):
            raise ValueError(f"{path} must hold the global test set as {{'test': [tensor, ...]}} of one length, "
                             f"got {type(data).__name__}")
        test_set = TensorDataset(*tensors)
        check_finite(test_set, f"{type(self).__name__}'s test set")
        return test_set

    def summary(self, max_clients: int = 20) -> str:
        """The per-client table (:meth:`FederatedDataModule.summary`), of the index's counts; when only the index
        is read, the counts only."""
        if not self.index_only:
            return super().summary(max_clients)
        train = np.array(self.index.samples["train"])
        return (f"{type(self).__name__}: {self.index.num_clients} clients, {len(self.train_clients)} training / "
                f"{len(self.unseen_clients)} unseen, the index of {self.root} only (their data are on their nodes); "
                f"train sizes: min {train.min()}, median {int(np.median(train))}, max {train.max()}")
