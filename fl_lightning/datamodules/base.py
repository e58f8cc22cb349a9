"""``FederatedDataModule``: client partitions of any map-style dataset.

A subclass says where the data comes from (:meth:`build_datasets`); the base class splits it
into clients (``iid``, ``dirichlet``, ``shards``, ``classes`` or ``natural``), gives each
client its own train/val/test split following its label distribution, holds out a fraction
of clients as unseen, and prints a summary. Everything is deterministic from ``seed``.

Loaders:

* ``train_dataloader`` yields the round's work items (the federated module decides how many);
  clients' mini-batches come from :meth:`client_data`, not from a DataLoader per client;
* ``val_dataloader``: the validation set, the union of the clients' val splits (held out of
  the training pool: ``val_fraction`` of every client's data, 10% by default). Never test data,
  so ``ModelCheckpoint`` and ``EarlyStopping`` select on data the reported figures do not use;
* ``test_dataloader`` / ``predict_dataloader``: the global test set (or, when the dataset has
  none, the union of the clients' test splits).
"""

from __future__ import annotations

import hashlib
from typing import Literal, Optional, Sequence

import numpy as np
import pytorch_lightning as pl
import torch
from pytorch_lightning.utilities import rank_zero_warn
from torch.utils.data import DataLoader, Dataset, DistributedSampler, Subset, TensorDataset

from fl_lightning.datamodules import partition as P
from fl_lightning.datamodules.client_data import ClientData
from fl_lightning.validation import check_int, check_number

Split = Literal["train", "val", "test"]


def labels_of(dataset: Dataset) -> np.ndarray:
    """The integer labels of a classification dataset (``targets``, a TensorDataset's last tensor, or by iteration)."""
    if isinstance(dataset, TensorDataset):
        return dataset.tensors[-1].cpu().numpy()
    if isinstance(dataset, Subset):
        return labels_of(dataset.dataset)[np.asarray(dataset.indices)]
    targets = getattr(dataset, "targets", None)
    if targets is not None:
        return np.asarray(targets.cpu() if isinstance(targets, torch.Tensor) else targets)
    return np.asarray([int(dataset[i][1]) for i in range(len(dataset))])


def work_item_loader(n: int) -> DataLoader:
    """A loader of the indices ``0 .. n-1`` of this process's work items in a round.

    Its sampler is a one-replica ``DistributedSampler``: the items are already this
    process's share, so Lightning must not split them again.
    """
    items = range(n)
    return DataLoader(items, batch_size=None, sampler=DistributedSampler(items, num_replicas=1, rank=0, shuffle=False))


class FederatedDataModule(pl.LightningDataModule):
    """Base class of federated datamodules.

    Args:
        num_clients: number of clients (for ``natural``, must equal the number of keys).
        partition: ``iid``, ``dirichlet``, ``shards``, ``classes`` or ``natural``.
        alpha: Dirichlet concentration (``dirichlet``), > 0.
        min_samples: smallest client size accepted by ``dirichlet``.
        shards_per_client: label-sorted shards per client (``shards``; 1 is the sorted split).
        classes_per_client: distinct classes per client (``classes``).
        val_fraction: fraction of each client's data held out as its validation split; their
            union is the validation set (``val_dataloader``). 0 runs without validation.
        test_fraction: fraction of each client's data held out as its test split.
        unseen_fraction: fraction of clients never sampled for training (evaluated as unseen).
        batch_size: clients' local mini-batch size.
        eval_batch_size: batch size of evaluation loaders.
        seed: seed of the partition and the splits.
        print_summary: print the per-client summary at setup.
    """

    def __init__(
        self,
        num_clients: int = 10,
        partition: str = "iid",
        alpha: float = 0.5,
        min_samples: int = 1,
        shards_per_client: int = 2,
        classes_per_client: int = 2,
        val_fraction: float = 0.1,
        test_fraction: float = 0.0,
        unseen_fraction: float = 0.0,
        batch_size: int = 32,
        eval_batch_size: int = 512,
        seed: int = 0,
        print_summary: bool = False,
    ) -> None:
        super().__init__()
        if partition not in P.PARTITIONS:
            raise ValueError(f"partition must be one of {P.PARTITIONS}, got {partition!r}")
        check_int("num_clients", num_clients, 1)
        if partition == "dirichlet":
            check_number("alpha", alpha, 0.0, low_open=True)
        check_int("min_samples", min_samples, 0)
        check_int("shards_per_client", shards_per_client, 1)
        check_int("classes_per_client", classes_per_client, 1)
        for name, value in (("val_fraction", val_fraction), ("test_fraction", test_fraction),
                            ("unseen_fraction", unseen_fraction)):
            check_number(name, value, 0.0, 1.0)
        if val_fraction + test_fraction >= 1.0:
            raise ValueError(f"val_fraction + test_fraction must be < 1, got {val_fraction + test_fraction}")
        check_int("batch_size", batch_size, 1)
        check_int("eval_batch_size", eval_batch_size, 1)
        check_int("seed", seed, 0)
        # checkpointed, but not merged into the logger's hyperparameters: the names a datamodule and
        # an algorithm share (seed, alpha) would make Lightning refuse to log them
        self.save_hyperparameters(logger=False)
        self.num_clients = num_clients
        self.partition = partition
        self.alpha = alpha
        self.min_samples = min_samples
        self.shards_per_client = shards_per_client
        self.classes_per_client = classes_per_client
        self.val_fraction = val_fraction
        self.test_fraction = test_fraction
        self.unseen_fraction = unseen_fraction
        self.batch_size = batch_size
        self.eval_batch_size = eval_batch_size
        self.seed = seed
        self.print_summary = print_summary
        self.pool: Optional[Dataset] = None
        self.test_set: Optional[Dataset] = None
        self.splits: dict[str, list[np.ndarray]] = {}
        self.unseen_clients: list[int] = []
        self.train_clients: list[int] = []

    # -------------------------------------------------------- subclass hooks
    def build_datasets(self) -> tuple[Dataset, Optional[Dataset]]:
        """The pool of samples to partition and the global test set (or None)."""
        raise NotImplementedError

    def partition_keys(self) -> Sequence:
        """Per-sample keys of the ``natural`` partition (writer, device...)."""
        raise ValueError(f"{type(self).__name__} has no natural partition; choose another partition")

    # ---------------------------------------------------------------- setup
    def setup(self, stage: Optional[str] = None) -> None:
        if self.splits:
            return
        self.pool, self.test_set = self.build_datasets()
        labels = labels_of(self.pool)
        if self.num_clients > len(labels):
            raise ValueError(f"num_clients={self.num_clients} is more than the {len(labels)} samples of the data: every "
                             "client needs at least one")
        parts = self._partition(labels)
        self.num_clients = len(parts)
        fractions = [self.val_fraction, self.test_fraction]
        if any(fractions):
            split = [P.stratified_split(p, labels, fractions, seed=self.seed + 1 + i) for i, p in enumerate(parts)]
        else:
            none = np.array([], dtype=np.int64)
            split = [(np.sort(p), none, none) for p in parts]
        self.splits = {name: [s[j] for s in split] for j, name in enumerate(("train", "val", "test"))}
        empty = [c for c, idx in enumerate(self.splits["train"]) if len(idx) == 0]
        if empty:
            raise ValueError(f"client(s) {empty[:10]} have no training samples after the val/test split")
        num_unseen = int(round(self.unseen_fraction * self.num_clients))
        if num_unseen >= self.num_clients:
            raise ValueError(f"unseen_fraction={self.unseen_fraction} holds out {num_unseen} of {self.num_clients} "
                             "clients, leaving none to train; lower it")
        order = np.random.default_rng(self.seed).permutation(self.num_clients)
        self.unseen_clients = sorted(order[:num_unseen].tolist())
        self.train_clients = sorted(order[num_unseen:].tolist())
        if self.print_summary:
            print(self.summary())

    def _partition(self, labels: np.ndarray) -> list[np.ndarray]:
        n, k, s = len(labels), self.num_clients, self.seed
        if self.partition == "iid":
            return P.iid(n, k, seed=s)
        if self.partition == "dirichlet":
            return P.dirichlet(labels, k, self.alpha, min_samples=self.min_samples, seed=s)
        if self.partition == "shards":
            return P.shards(labels, k, self.shards_per_client, seed=s)
        if self.partition == "classes":
            return P.classes(labels, k, self.classes_per_client, seed=s)
        return P.natural(self.partition_keys(), k)

    # --------------------------------------------------------------- access
    def client_data(self, client_id: int, split: Split = "train") -> ClientData:
        """Client ``client_id``'s ``split`` of the pool."""
        if split not in self.splits:
            raise ValueError(f"split must be one of {sorted(self.splits)}, got {split!r}")
        if not 0 <= client_id < self.num_clients:
            raise ValueError(f"client_id must be in [0, {self.num_clients}), got {client_id}")
        return ClientData(self.pool, torch.from_numpy(self.splits[split][client_id]), self.batch_size)

    def num_samples(self, client_id: int) -> int:
        """Size of the client's training split."""
        return len(self.splits["train"][client_id])

    def partition_hash(self) -> str:
        """A short digest of the data configuration: the datamodule's class, the labels of the
        pool and every client's split indices."""
        h = hashlib.sha256(type(self).__qualname__.encode())
        if self.pool is not None:
            h.update(np.ascontiguousarray(labels_of(self.pool), dtype=np.int64).tobytes())
        for name in ("train", "val", "test"):
            for idx in self.splits.get(name, []):
                h.update(np.asarray(idx, dtype=np.int64).tobytes())
                h.update(b"|")
        return h.hexdigest()[:16]

    def label_histogram(self, client_id: int, split: Split = "train") -> np.ndarray:
        """Counts per class of the client's ``split``."""
        labels = labels_of(self.pool)
        num_classes = int(labels.max()) + 1
        return np.bincount(labels[self.splits[split][client_id]], minlength=num_classes)

    def summary(self, max_clients: int = 20) -> str:
        """A table: samples per split and the training label histogram of each client."""
        lines = [
            f"{type(self).__name__}: {self.num_clients} clients, partition={self.partition}, "
            f"{len(self.train_clients)} training / {len(self.unseen_clients)} unseen",
            f"{'client':>6} {'train':>6} {'val':>5} {'test':>5}  label histogram (train)",
        ]
        for c in range(min(self.num_clients, max_clients)):
            hist = " ".join(str(int(v)) for v in self.label_histogram(c))
            mark = "*" if c in self.unseen_clients else " "
            lines.append(
                f"{c:>5}{mark} {len(self.splits['train'][c]):>6} {len(self.splits['val'][c]):>5} "
                f"{len(self.splits['test'][c]):>5}  [{hist}]"
            )
        if self.num_clients > max_clients:
            lines.append(f"... {self.num_clients - max_clients} more clients")
        sizes = np.array([len(i) for i in self.splits["train"]])
        lines.append(f"train sizes: min {sizes.min()}, median {int(np.median(sizes))}, max {sizes.max()}")
        return "\n".join(lines)

    # -------------------------------------------------------------- loaders
    def train_dataloader(self) -> DataLoader:
        return work_item_loader(self.trainer.lightning_module.num_work_items())

    def global_test_set(self) -> Dataset:
        """The global test set, or the union of the clients' test splits when there is none."""
        if self.test_set is not None:
            return self.test_set
        idx = np.concatenate(self.splits["test"])
        if len(idx) == 0:
            raise ValueError(f"{type(self).__name__} has no test set: set test_fraction > 0")
        return Subset(self.pool, idx.tolist())

    def validation_set(self) -> Dataset:
        """The union of the clients' val splits (empty, with a warning, when ``val_fraction=0``)."""
        idx = np.concatenate(self.splits["val"])
        if len(idx) == 0:
            rank_zero_warn(f"{type(self).__name__}(val_fraction={self.val_fraction}) has no validation data: "
                           "validation is skipped; set val_fraction > 0 to validate (and select checkpoints)")
        return Subset(self.pool, idx.tolist())

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.validation_set(), batch_size=self.eval_batch_size)

    def test_dataloader(self) -> DataLoader:
        return DataLoader(self.global_test_set(), batch_size=self.eval_batch_size)

    def predict_dataloader(self) -> DataLoader:
        """The global test set (``trainer.predict(module, datamodule=dm)``: the global model's outputs)."""
        return DataLoader(self.global_test_set(), batch_size=self.eval_batch_size)
