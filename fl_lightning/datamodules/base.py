"""``FederatedDataModule``: client partitions of any map-style dataset.

A subclass says where the data comes from (:meth:`build_datasets`); the base class optionally
adds the test set to the pool (``pool_test_set``) and subsamples it (``subsample``), splits it
into clients with a ``partitioner`` (:mod:`fl_lightning.datamodules.partitioners`; the old
``partition="iid"|"dirichlet"|"shards"|"classes"|"natural"`` strings are shortcuts), gives
each client its own train/val/test split, holds out a fraction of clients as unseen, and prints a
summary. Everything is deterministic from ``seed``.

The samples' targets may be of any kind (:mod:`fl_lightning.datamodules.targets`): class labels
(one integer per sample, none negative) give splits that follow each client's label distribution
(stratified by class) and label counts per client; other targets (regression values, vectors,
dicts) give splits drawn at random and a description (type, shape, statistics) in their place, and
the partitioners and subsamples that read classes refuse them.

Loaders:

* ``train_dataloader`` yields the round's work items: their number, ``work_items_per_round``,
  is set by the engine that fits the datamodule (a ``FederatedModule``, in its setup); clients'
  mini-batches come from :meth:`client_data`, not from a DataLoader per client;
* ``val_dataloader``: the validation set, the union of the clients' val splits (held out of
  the training pool: ``val_fraction`` of every client's data, 10% by default). Never test data,
  so ``ModelCheckpoint`` and ``EarlyStopping`` select on data the reported figures do not use;
* ``test_dataloader`` / ``predict_dataloader``: the global test set (or, when the dataset has
  none, the union of the clients' test splits).
"""

from __future__ import annotations

import hashlib
from typing import Any, Iterator, Optional, Sequence

import numpy as np
import torch
from torch import Tensor
from torch.utils.data import ConcatDataset, DataLoader, Dataset, DistributedSampler, Subset, TensorDataset

from fl_lightning.checkpoints import check_weights_only, checksum, is_plain
from fl_lightning.file_arguments import AllowedClasses, load_from_checkpoint
from fl_lightning.datamodules.client_data import SPLITS, ClientData, Split
from fl_lightning.datamodules.partitioners import SHORTCUTS, IidPartitioner, Partitioner, from_shortcut
from fl_lightning.datamodules.subsample import Subsample
from fl_lightning.datamodules.targets import are_class_labels, describe_targets, labels_of, targets_in_words
from fl_lightning.functional.partition import random_split, stratified_split
from fl_lightning.lightning_package import pl, rank_zero_warn
from fl_lightning.seeding import keyed_rng
from fl_lightning.validation import check_int, check_number



def check_class_labels(labels: np.ndarray, num_classes: int, where: str) -> None:
    """Refuse ``labels`` that are not class indices in ``[0, num_classes)`` (not integers, negative
    or too large), naming the first bad one and ``where`` they are."""
    if not (np.issubdtype(labels.dtype, np.integer) or labels.dtype == bool):
        raise ValueError(f"the labels of {where} must be class indices in [0, num_classes={num_classes}), got "
                         f"{labels.dtype} labels: a classification datamodule's labels are integers")
    outside = np.flatnonzero((labels < 0) | (labels >= num_classes))
    if len(outside):
        first = int(outside[0])
        raise ValueError(f"the labels of {where} must be class indices in [0, num_classes={num_classes}), got "
                         f"{labels[first]} at sample {first} ({len(outside)} sample(s) outside): fix the labels or "
                         "num_classes")


def check_finite(dataset: Dataset, where: str) -> None:
    """Refuse a tensor-backed ``dataset`` (a ``TensorDataset``) that holds NaN or Inf in a floating
    tensor (inputs or targets), naming the tensor and the first such sample: such a sample makes
    every update of a client that draws it NaN, excluded from its round. One pass over memory, its
    smallest and largest values (which are NaN where any is): about 40 ms for MNIST's 60,000 images
    on one CPU thread (``torch.isfinite`` takes 25 times longer); other datasets are not read."""
    if not isinstance(dataset, TensorDataset):
        return
    tensors = dataset.tensors
    for position, tensor in enumerate(tensors):
        if not tensor.is_floating_point() or not tensor.numel() or \
                bool(torch.isfinite(torch.stack(torch.aminmax(tensor))).all()):
            continue
        bad = ~torch.isfinite(tensor.reshape(len(tensor), -1))
        sample = int(bad.any(dim=1).nonzero()[0])
        value = tensor.reshape(len(tensor), -1)[sample][bad[sample]][0].item()
        what = {0: "the inputs", 1: "the labels or targets"}.get(position, f"tensor {position}")
        raise ValueError(f"{where} holds {value} in {what} (its tensor {position} of {len(tensors)}) at sample "
                         f"{sample}: drop or fill non-finite samples before building the datamodule")


def feature_checksums(dataset: Dataset, samples: int = 512) -> Iterator[str]:
    """What the data fingerprint reads of the samples' features: a checksum of every tensor of a
    ``TensorDataset`` but its targets (the second; one pass over memory: about 0.15 s for MNIST's
    60,000 images, a tenth of its setup), else of ``samples`` samples spread evenly over the
    dataset, read under a fixed torch RNG (random transforms draw the same each time)."""
    if isinstance(dataset, TensorDataset):
        yield from (checksum(t) for position, t in enumerate(dataset.tensors) if position != 1)
        return
    picked = np.unique(np.linspace(0, len(dataset) - 1, min(len(dataset), samples)).astype(np.int64))
    with keyed_rng(0, "data fingerprint"):
        for i in picked:
            item = dataset[int(i)]
            parts = item if isinstance(item, (tuple, list)) else [item]
            # (arrays and images: anything with __array_interface__)
            yield checksum([torch.as_tensor(np.array(p)) if hasattr(p, "__array_interface__") else p for p in parts])


def targets_digest(targets: np.ndarray, class_labels: bool) -> bytes:
    """What the data fingerprint reads of the pool's targets: class labels as int64 (as every
    fingerprint before other targets were taken), other numbers by their dtype, shape and bytes,
    objects (dicts...) by their :func:`~fl_lightning.checkpoints.checksum`."""
    if class_labels:
        return np.ascontiguousarray(targets, dtype=np.int64).tobytes()
    if targets.dtype == object:
        return checksum(targets.tolist()).encode()
    return f"{targets.dtype}{targets.shape}".encode() + np.ascontiguousarray(targets).tobytes()


def concat(first: Dataset, second: Dataset) -> Dataset:
    """``first`` followed by ``second`` (tensor datasets stay one ``TensorDataset``)."""
    if isinstance(first, TensorDataset) and isinstance(second, TensorDataset):
        return TensorDataset(*(torch.cat([a, b]) for a, b in zip(first.tensors, second.tensors)))
    return ConcatDataset([first, second])


def take(dataset: Dataset, indices: np.ndarray) -> Dataset:
    """The samples ``indices`` of ``dataset`` (a ``TensorDataset`` is sliced, so batches stay cheap)."""
    if isinstance(dataset, TensorDataset):
        index = torch.as_tensor(indices, dtype=torch.long)
        return TensorDataset(*(t[index] for t in dataset.tensors))
    return Subset(dataset, np.asarray(indices).tolist())


def pool_size(pool: Dataset) -> Optional[int]:
    """The bytes of a tensor-backed pool (a ``TensorDataset``), or None for any other dataset."""
    if not isinstance(pool, TensorDataset):
        return None
    return sum(t.numel() * t.element_size() for t in pool.tensors)


def check_pool_on_device(value: Any) -> Optional[bool]:
    """``value`` as the ``pool_on_device`` option; a ValueError unless it is None, True or False."""
    if not (value is None or isinstance(value, bool)):
        raise ValueError(f"pool_on_device must be None (automatic), True or False, got {value!r}")
    return value


def decide_pool_on_device(pool_bytes: Optional[int], free_bytes: Optional[int], pool_on_device: Optional[bool],
                          device_type: str) -> bool:
    """Whether the pool is moved to the engine's device (``FederatedDataModule``'s ``pool_on_device``).

    Args:
        pool_bytes: the pool's size (:func:`pool_size`); None: it is not tensor-backed (it cannot move).
        free_bytes: the device's free memory; None: unknown (a device other than CUDA).
        pool_on_device: None chooses: on a CUDA device, when the pool is tensor-backed and takes
            less than a quarter of the free memory (the rest is left to the models, activations and
            optimizer states of the clients in flight); True requires it (a ValueError where it
            cannot be: not tensor-backed, or larger than the free memory); False keeps it on the host.
        device_type: ``torch.device.type`` of the engine's device.

    On a CPU device there is nothing to move (the host is the device): False, whatever the option.
    """
    check_pool_on_device(pool_on_device)
    if device_type == "cpu" or pool_on_device is False:
        return False
    if pool_bytes is None:
        if pool_on_device:
            raise ValueError(f"pool_on_device=True, but the pool is not tensor-backed (a TensorDataset): it cannot be "
                             f"put on the {device_type} device; use pool_on_device=None or False")
        return False
    if free_bytes is None:
        return bool(pool_on_device)  # free memory unknown: only where asked
    if pool_on_device:
        if pool_bytes > free_bytes:
            raise ValueError(f"pool_on_device=True, but the pool's {pool_bytes / 2**20:.1f} MiB do not fit in the "
                             f"{free_bytes / 2**20:.1f} MiB free on the {device_type} device; use pool_on_device=None "
                             "(automatic) or False")
        return True
    return pool_bytes < free_bytes / 4


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
        num_clients: number of clients; None takes the partitioner's ``num_partitions``, or the
            number of keys of a natural partition, or 10.
        partitioner: how the pool is split into clients (default ``IidPartitioner()``); see
            :mod:`fl_lightning.datamodules.partitioners`.
        partition: shortcut for a partitioner: ``iid``, ``dirichlet``, ``shards``, ``classes`` or
            ``natural`` (:func:`~fl_lightning.datamodules.partitioners.from_shortcut`); not with
            ``partitioner``.
        alpha: Dirichlet concentration of ``partition="dirichlet"`` (default 0.5), > 0.
        min_samples: smallest client size of ``partition="dirichlet"`` (default 1).
        shards_per_client: label-sorted shards per client of ``partition="shards"`` (default 2;
            1 is the sorted split).
        classes_per_client: distinct classes per client of ``partition="classes"`` (default 2).
        subsample: which samples of the pool are kept before partitioning (e.g. the "-ST"
            ``ImbalancedSubsample``); the test set is unchanged.
        pool_test_set: add the global test set to the pool before partitioning; the clients'
            test splits (``test_fraction``) are then the test set (FedProxVR's setting).
        val_fraction: fraction of each client's data held out as its validation split; their
            union is the validation set (``val_dataloader``). 0 runs without validation.
        test_fraction: fraction of each client's data held out as its test split.
        unseen_fraction: fraction of clients never sampled for training (evaluated as unseen).
        batch_size: clients' local mini-batch size.
        eval_batch_size: batch size of evaluation loaders.
        seed: seed of the partition (unless the partitioner has its own) and the splits.
        print_summary: print the per-client summary at setup.
        pool_on_device: where a tensor-backed pool (a ``TensorDataset``) lives while the engine
            runs on an accelerator (:meth:`place_pool`). None (default) chooses: on the CUDA device
            when it takes less than a quarter of the device's free memory, so that a mini-batch is
            one gather on the device instead of a gather on the host and a copy every local step,
            while the rest stays free for the clients in flight; else on the host. True requires it
            (a ValueError naming the pool's size and the free memory where it cannot be); False
            keeps it on the host. On a CPU device nothing moves, whatever the value (True is not
            an error: the host is the device). Pools that are not tensors stay on the host; on
            CUDA their batches are copied from pinned memory one step ahead.

    Attributes:
        work_items_per_round: how many work items this process runs in a round, the length of
            ``train_dataloader``; not an argument: the engine that fits the datamodule sets it
            (a ``FederatedModule``, in its setup), so the datamodule knows nothing of the engine.
    """

    #: the ``partition_by`` value that means the labels (a datamodule over a table: its label column), and
    #: the key of the target in samples that are dicts (``{"x": ..., "label": ...}``: :meth:`targets_of`)
    label_column: str = "label"
    #: the number of classes, where the datamodule knows it (a classification dataset); None: unknown,
    #: or targets that are not classes. Known, the labels are checked at setup to be class indices in
    #: ``[0, num_classes)``, and a bundled classifier (``fl_lightning.models``) with another number of
    #: classes is refused
    num_classes: Optional[int] = None

    def __init__(
        self,
        num_clients: Optional[int] = None,
        partitioner: Optional[Partitioner] = None,
        partition: Optional[str] = None,
        alpha: Optional[float] = None,
        min_samples: Optional[int] = None,
        shards_per_client: Optional[int] = None,
        classes_per_client: Optional[int] = None,
        subsample: Optional[Subsample] = None,
        pool_test_set: bool = False,
        val_fraction: float = 0.1,
        test_fraction: float = 0.0,
        unseen_fraction: float = 0.0,
        batch_size: int = 32,
        eval_batch_size: int = 512,
        seed: int = 0,
        print_summary: bool = False,
        pool_on_device: Optional[bool] = None,
    ) -> None:
        super().__init__()
        self.partitioner = resolve_partitioner(
            partitioner, partition, alpha=alpha, min_samples=min_samples, shards_per_client=shards_per_client,
            classes_per_client=classes_per_client) or self.default_partitioner()
        if num_clients is not None:
            check_int("num_clients", num_clients, 1)
        wanted = self.partitioner.num_partitions
        if num_clients is not None and wanted is not None and num_clients != wanted:
            raise ValueError(f"num_clients={num_clients} but the partitioner makes num_partitions={wanted}; "
                             "set one of the two")
        if num_clients is None:
            num_clients = wanted if wanted is not None or self.partitioner.counts_partitions else 10
        if subsample is not None and not isinstance(subsample, Subsample):
            raise ValueError(f"subsample must be a Subsample (e.g. ImbalancedSubsample) or None, got {subsample!r}")
        for name, value in (("val_fraction", val_fraction), ("test_fraction", test_fraction),
                            ("unseen_fraction", unseen_fraction)):
            check_number(name, value, 0.0, 1.0)
        if val_fraction + test_fraction >= 1.0:
            raise ValueError(f"val_fraction + test_fraction must be < 1, got {val_fraction + test_fraction}")
        check_int("batch_size", batch_size, 1)
        check_int("eval_batch_size", eval_batch_size, 1)
        check_int("seed", seed, 0)
        # checkpointed, but not merged into the logger's hyperparameters: the names a datamodule and
        # an algorithm share (seed, alpha) would make Lightning refuse to log them. Objects (the
        # partitioner, a subsample, a dataset) are kept as their repr, so that checkpoints hold
        # plain data only and load with weights_only=True
        self.save_hyperparameters(logger=False)
        objects = {k: v for k, v in self.hparams.items() if not is_plain(v)}
        if objects:
            self.save_hyperparameters(ignore=list(objects), logger=False)
            self.hparams.update({k: repr(v) for k, v in objects.items()})
        self.num_clients: Optional[int] = num_clients
        self.partition = partition
        self.subsample = subsample
        self.pool_test_set = pool_test_set
        self.val_fraction = val_fraction
        self.test_fraction = test_fraction
        self.unseen_fraction = unseen_fraction
        self.batch_size = batch_size
        self.eval_batch_size = eval_batch_size
        self.seed = seed
        self.print_summary = print_summary
        self.pool_on_device = check_pool_on_device(pool_on_device)
        self.pool: Optional[Dataset] = None
        #: the target of every sample of the pool (:meth:`targets_of`), once set up
        self.pool_targets: Optional[np.ndarray] = None
        self._class_labels = False  # whether pool_targets are class labels (are_class_labels)
        #: every client's split indices on the accelerator, when the pool is there (:meth:`place_pool`)
        self._device_splits: Optional[dict[str, tuple[Tensor, ...]]] = None
        #: each client split's ClientData by (client, split), with the indices it was made of (:meth:`client_data`)
        self._client_data: dict[tuple[int, str], tuple[Any, ClientData]] = {}
        self.test_set: Optional[Dataset] = None
        self.splits: dict[str, list[np.ndarray]] = {}
        self._partition_digest: Optional[str] = None  # partition_hash(), once the splits are made
        self.unseen_clients: list[int] = []
        self.train_clients: list[int] = []
        self.work_items_per_round: Optional[int] = None

    @classmethod
    def load_from_checkpoint(  # type: ignore[override]
        cls, checkpoint_path: Any, map_location: Any = None, hparams_file: Any = None,
        allowed_classes: AllowedClasses = (), weights_only: Optional[bool] = None, allow_unverified: bool = False,
        **kwargs: Any,
    ) -> "FederatedDataModule":
        """The datamodule of a checkpoint, as Lightning's but safe: read with ``weights_only=True``,
        its checksum checked (``allow_unverified=True`` accepts a trusted file without one), building
        only fl_lightning's own partitioners and subsamples (as a CLI run records them) and the
        classes in ``allowed_classes`` (:func:`fl_lightning.file_arguments.load_from_checkpoint`)."""
        check_weights_only(weights_only)
        return load_from_checkpoint(cls, checkpoint_path, map_location, hparams_file, None, allowed_classes,
                                    allow_unverified, **kwargs)

    # -------------------------------------------------------- subclass hooks
    def build_datasets(self) -> tuple[Dataset, Optional[Dataset]]:
        """The pool of samples to partition and the global test set (or None)."""
        raise NotImplementedError

    def default_partitioner(self) -> Partitioner:
        """The partitioner used when neither ``partitioner`` nor ``partition`` is given."""
        return IidPartitioner()

    def partition_keys(self) -> Sequence:
        """Per-sample keys of the natural partition (writer, device...) of the pool :meth:`build_datasets` built."""
        raise ValueError(f"{type(self).__name__} has no natural partition; choose another partition")

    def targets_of(self, dataset: Dataset) -> np.ndarray:
        """The target of every sample of ``dataset`` (the pool or the test set), samples first: by default
        :func:`~fl_lightning.datamodules.targets.labels_of` (a ``TensorDataset``'s second tensor, a
        dataset's ``targets``, or each sample's second element or ``label_column`` entry). Override
        where the targets are elsewhere or can be read without reading every sample."""
        return labels_of(dataset, self.label_column)

    def partition_column(self, name: str) -> Sequence:
        """The values of column ``name`` for every sample of the pool :meth:`build_datasets` built
        (what a partitioner's ``partition_by`` names)."""
        raise ValueError(f"{type(self).__name__} has no column {name!r}: its partitioners read the labels "
                         f"(partition_by=None or {self.label_column!r}) or its natural keys (NaturalIdPartitioner())")

    # ---------------------------------------------------------------- setup
    def setup(self, stage: Optional[str] = None) -> None:
        if self.splits:
            return
        pool, self.test_set = self.build_datasets()
        for dataset, name in ((pool, "pool"), (self.test_set, "test set")):
            check_finite(dataset, f"{type(self).__name__}'s {name}")
        built = len(pool)
        if self.pool_test_set:
            if self.test_set is None:
                raise ValueError(f"pool_test_set=True but {type(self).__name__} has no test set to add to the pool")
            pool, self.test_set = concat(pool, self.test_set), None
        labels = self._read_targets(pool, "pool")
        if self.num_classes is not None:
            check_class_labels(labels, self.num_classes, f"{type(self).__name__}'s pool")
            if self.test_set is not None:
                check_class_labels(self._read_targets(self.test_set, "test set"), self.num_classes,
                                   f"{type(self).__name__}'s test set")
        self._class_labels = are_class_labels(labels)
        if self.subsample is not None and self.subsample.reads_labels and not self._class_labels:
            raise ValueError(self._not_classes(f"subsample={self.subsample!r}", "keeps samples by class",
                                               "subsample the pool in build_datasets instead", labels))
        kept = None if self.subsample is None else np.asarray(self.subsample.indices(labels))
        self.pool = pool if kept is None else take(pool, kept)
        labels = labels if kept is None else labels[kept]
        self.pool_targets = labels
        if self.num_clients is not None and self.num_clients > len(labels):
            raise ValueError(f"num_clients={self.num_clients} is more than the {len(labels)} samples of the data: every "
                             "client needs at least one")
        values = self._partition_values(labels, built, kept)
        parts = self.partitioner.split(values, self.num_clients, seed=self.seed)
        self.num_clients = len(parts)
        fractions = [self.val_fraction, self.test_fraction]
        if any(fractions) and self._class_labels:
            split = [stratified_split(p, labels, fractions, seed=self.seed + 1 + i) for i, p in enumerate(parts)]
        elif any(fractions):
            split = [random_split(p, fractions, seed=self.seed + 1 + i) for i, p in enumerate(parts)]
        else:
            none = np.array([], dtype=np.int64)
            split = [(np.sort(p), none, none) for p in parts]
        self.splits = {name: [s[j] for s in split] for j, name in enumerate(SPLITS)}
        self._partition_digest = None
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

    def _read_targets(self, dataset: Dataset, name: str) -> np.ndarray:
        """:meth:`targets_of` ``dataset`` (the datamodule's ``name``), its refusal naming the datamodule."""
        try:
            return self.targets_of(dataset)
        except ValueError as error:
            raise ValueError(f"{type(self).__name__}'s {name}: {error}") from error

    def _not_classes(self, what: str, does: str, instead: str, targets: np.ndarray) -> str:
        """The refusal of ``what``, which ``does`` something with classes, on ``targets`` that are not class labels."""
        return (f"{what} {does}, but {type(self).__name__}'s targets are "
                f"{targets_in_words(describe_targets(targets))}, not class labels (one integer per sample, none "
                f"negative): {instead}")

    def _partition_values(self, labels: np.ndarray, built: int, kept: Optional[np.ndarray]) -> np.ndarray:
        """What the partitioner reads: the labels of the pool, or its natural keys, or the
        ``partition_by`` column (both given for the built pool, then subsampled like it).
        A partitioner that reads classes is refused targets that are not class labels."""
        by = self.partitioner.partition_by
        if by == self.label_column or (by is None and not self.partitioner.reads_keys):
            if self.partitioner.reads_labels and not self._class_labels:
                raise ValueError(self._not_classes(
                    f"partitioner={self.partitioner!r}", "splits the pool by class",
                    "use IidPartitioner(), NaturalIdPartitioner() (the datamodule's natural keys, or "
                    "partition_by=<a column>), or a class partitioner with partition_by=<a column> of the "
                    "datamodule (partition_column)", labels))
            return labels
        values = np.asarray(self.partition_keys() if by is None else self.partition_column(by))
        what = "natural keys" if by is None else f"values in column {by!r}"
        if len(values) != built or self.pool_test_set:
            raise ValueError(f"{type(self).__name__} gives {len(values)} {what} for a pool of {built} samples"
                             f"{' plus the test set (pool_test_set=True)' if self.pool_test_set else ''}: every "
                             "sample needs one")
        return values if kept is None else values[kept]

    def place_pool(self, device: torch.device) -> None:
        """Put a tensor-backed pool, and every client's split indices, on ``device`` or on the host,
        as ``pool_on_device`` decides (:func:`decide_pool_on_device`). Called by the engine once it
        knows its device (a ``FederatedModule``, in its setup); under DDP each process puts its own
        copy on its own device. The pool stays where it was put until the next call."""
        if self.pool is None:
            raise RuntimeError(f"{type(self).__name__}.place_pool() was called before setup() built the pool")
        pool, device = self.pool, torch.device(device)
        size, free = pool_size(pool), None
        if device.type == "cuda":
            device = torch.device("cuda", torch.cuda.current_device() if device.index is None else device.index)
            free, _ = torch.cuda.mem_get_info(device)
            if isinstance(pool, TensorDataset) and pool.tensors[0].device == device:
                free += size  # placed before: its memory counts as free
        on_device = decide_pool_on_device(size, free, self.pool_on_device, device.type)
        if not isinstance(pool, TensorDataset):
            return
        target = device if on_device else torch.device("cpu")
        pool.tensors = tuple(t.to(target) for t in pool.tensors)
        self._device_splits = None
        if on_device:
            self._device_splits = {
                name: torch.from_numpy(np.concatenate(parts).astype(np.int64)).to(target).split([len(p) for p in parts])
                for name, parts in self.splits.items()}

    # --------------------------------------------------------------- access
    def client_data(self, client_id: int, split: Split = "train") -> ClientData:
        """Client ``client_id``'s ``split`` of the pool (its indices on the pool's device)."""
        if split not in self.splits:
            raise ValueError(f"split must be one of {sorted(self.splits)}, got {split!r}")
        if not 0 <= client_id < self.num_clients:
            raise ValueError(f"client_id must be in [0, {self.num_clients}), got {client_id}")
        source = (self.splits if self._device_splits is None else self._device_splits)[split][client_id]
        # made once and kept while the split's indices, the pool and the batch size are the same objects and
        # value (a block of a thousand clients asks for each several times a round; its making is most of a call)
        kept = self._client_data.get((client_id, split))
        if kept is not None and kept[0] is source and kept[1].dataset is self.pool and \
                kept[1].batch_size == self.batch_size and kept[1].eval_batch_size == self.eval_batch_size:
            return kept[1]
        data = ClientData(self.pool, source if self._device_splits is not None else torch.from_numpy(source),
                          self.batch_size, self.eval_batch_size)
        self._client_data[(client_id, split)] = (source, data)
        return data

    def num_samples(self, client_id: int) -> int:
        """Size of the client's training split."""
        return len(self.splits["train"][client_id])

    def split_size(self, client_id: int, split: Split) -> int:
        """Size of the client's ``split``."""
        return len(self.splits[split][client_id])

    def holds_data(self, client_id: int) -> bool:
        """Whether this process has client ``client_id``'s data (here: every client's; a datamodule that reads only
        some clients' data says which, :class:`~fl_lightning.datamodules.ClientFilesFederated`)."""
        return True

    def partition_hash(self) -> str:
        """A short digest of the data configuration: the datamodule's class, the targets
        (:func:`targets_digest`) and the features of the pool (:func:`feature_checksums`) and every
        client's split indices (computed once per setup: every checkpoint names it)."""
        if self._partition_digest is not None:
            return self._partition_digest
        h = hashlib.sha256(type(self).__qualname__.encode())
        if self.pool is not None:
            h.update(targets_digest(self.pool_targets, self._class_labels))
            for features in feature_checksums(self.pool):
                h.update(features.encode())
        for name in SPLITS:
            for idx in self.splits.get(name, []):
                h.update(np.asarray(idx, dtype=np.int64).tobytes())
                h.update(b"|")
        self._partition_digest = h.hexdigest()[:16]
        return self._partition_digest

    def partition_name(self) -> str:
        """The partition in words: the shortcut and its partitioner, or the partitioner."""
        return f"{self.partition} ({self.partitioner!r})" if self.partition else repr(self.partitioner)

    @property
    def has_class_labels(self) -> bool:
        """Whether the pool's targets are class labels (:func:`~fl_lightning.datamodules.targets.are_class_labels`):
        the splits are then stratified by class and the clients' labels counted; known once set up."""
        if self.pool_targets is None:
            raise RuntimeError(f"{type(self).__name__}.has_class_labels was asked for before setup() read the targets")
        return self._class_labels

    def describe_targets(self) -> dict[str, Any]:
        """What the pool's targets are, as plain data (:func:`~fl_lightning.datamodules.targets.describe_targets`)."""
        if self.pool_targets is None:
            raise RuntimeError(f"{type(self).__name__}.describe_targets() was called before setup() read the targets")
        return describe_targets(self.pool_targets)

    def label_histogram(self, client_id: int, split: Split = "train") -> np.ndarray:
        """Counts per class of the client's ``split`` (class labels only)."""
        if not self.has_class_labels:
            raise ValueError(self._not_classes("label_histogram()", "counts classes",
                                               "describe_targets() says what they are", self.pool_targets))
        labels = self.pool_targets
        num_classes = int(labels.max()) + 1
        return np.bincount(labels[self.splits[split][client_id]], minlength=num_classes)

    def partition_record(self) -> dict[str, Any]:
        """The partition as plain data (``RoundHistory`` writes it to ``partition.json``): the
        datamodule, every client's label counts (``clients``, train split; class labels only), its
        training size, the unseen clients, and what the targets are (:meth:`describe_targets`)."""
        counts = {"clients": [self.label_histogram(c).tolist() for c in range(self.num_clients)]} \
            if self.has_class_labels else {}
        return {"datamodule": type(self).__name__, **counts,
                "train_sizes": [self.num_samples(c) for c in range(self.num_clients)],
                "unseen_clients": list(self.unseen_clients), "targets": self.describe_targets()}

    def empty_split_reason(self, split: Split, clients: Sequence[int]) -> str:
        """Why ``clients`` hold no sample in their ``split`` (``val`` or ``test``), in words: the
        fraction is 0, or each is too small for it (its size, or its largest class's, and the rounding)."""
        fraction = self.val_fraction if split == "val" else self.test_fraction
        if fraction == 0:
            return f"{split}_fraction=0 holds out no {split} data: set {split}_fraction > 0"
        per_class = self.has_class_labels
        sizes = []
        for c in clients[:5]:
            held = np.concatenate([self.splits[s][c] for s in SPLITS])
            sizes.append((c, int(np.bincount(self.pool_targets[held]).max()) if per_class else len(held)))
        examples = ", ".join(f"client {c}: round({fraction} x {n}) = 0" for c, n in sizes)
        more = f" and {len(clients) - 5} more" if len(clients) > 5 else ""
        what = "the samples of each class of a client" if per_class else "a client's samples"
        return (f"{split}_fraction={fraction} holds out round({fraction} x n) of {what}, and {len(clients)} "
                f"client(s) are too small for any ({examples}{more}): raise {split}_fraction, or make fewer, larger "
                "clients")

    def summary(self, max_clients: int = 20) -> str:
        """A table: samples per split and the training label histogram of each client (for targets
        that are not class labels: what they are, and each client's mean and standard deviation of
        its scalar numeric targets)."""
        classes = self.has_class_labels
        description = self.describe_targets()
        scalar = not classes and description["kind"] == "numbers" and not description["shape"]
        lines = [
            f"{type(self).__name__}: {self.num_clients} clients, partition={self.partition_name()}, "
            f"{len(self.train_clients)} training / {len(self.unseen_clients)} unseen",
        ]
        if not classes:
            lines.append(f"targets: {targets_in_words(description)}; not class labels: splits drawn at random")
        column = "label histogram (train)" if classes else f"{'mean':>9} {'std':>9}  of the targets (train)" \
            if scalar else ""
        lines.append(f"{'client':>6} {'train':>6} {'val':>5} {'test':>5}  {column}".rstrip())
        for c in range(min(self.num_clients, max_clients)):
            if classes:
                cells = "[" + " ".join(str(int(v)) for v in self.label_histogram(c)) + "]"
            elif scalar and self.holds_data(c):
                values = self.pool_targets[self.splits["train"][c]].astype(np.float64)
                cells = f"{values.mean():>9.4g} {values.std():>9.4g}"
            else:
                cells = ""
            mark = "*" if c in self.unseen_clients else " "
            lines.append(
                f"{c:>5}{mark} {self.split_size(c, 'train'):>6} {self.split_size(c, 'val'):>5} "
                f"{self.split_size(c, 'test'):>5}  {cells}".rstrip()
            )
        if self.num_clients > max_clients:
            lines.append(f"... {self.num_clients - max_clients} more clients")
        sizes = np.array([self.num_samples(c) for c in range(self.num_clients)])
        lines.append(f"train sizes: min {sizes.min()}, median {int(np.median(sizes))}, max {sizes.max()}")
        return "\n".join(lines)

    # -------------------------------------------------------------- loaders
    def train_dataloader(self) -> DataLoader:
        """The indices of this process's ``work_items_per_round`` work items (:func:`work_item_loader`)."""
        if self.work_items_per_round is None:
            raise RuntimeError(
                f"{type(self).__name__}.train_dataloader() was asked for before work_items_per_round was set: the train "
                "loader of a FederatedDataModule yields the engine's work items: fit it with a FederatedModule, which "
                "sets work_items_per_round in its setup"
            )
        return work_item_loader(check_int("work_items_per_round", self.work_items_per_round, 1))

    def global_test_set(self) -> Dataset:
        """The global test set, or the union of the clients' test splits when there is none."""
        if self.test_set is not None:
            return self.test_set
        idx = np.concatenate(self.splits["test"])
        if len(idx) == 0:
            raise ValueError(f"{type(self).__name__} has no test set: set test_fraction > 0")
        return Subset(self.pool, idx.tolist())

    def validation_set(self) -> Dataset:
        """The union of the clients' val splits (empty, with a warning saying why, when every
        client's is: ``val_fraction=0``, or clients too small for it)."""
        idx = np.concatenate(self.splits["val"])
        if len(idx) == 0:
            reason = self.empty_split_reason("val", range(self.num_clients))
            rank_zero_warn(f"{type(self).__name__}(val_fraction={self.val_fraction}) has no validation data, so "
                           f"validation (and selecting checkpoints on it) is skipped: {reason}")
        return Subset(self.pool, idx.tolist())

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.validation_set(), batch_size=self.eval_batch_size)

    def test_dataloader(self) -> DataLoader:
        return DataLoader(self.global_test_set(), batch_size=self.eval_batch_size)

    def predict_dataloader(self) -> DataLoader:
        """The global test set (``trainer.predict(module, datamodule=dm)``: the global model's outputs)."""
        return DataLoader(self.global_test_set(), batch_size=self.eval_batch_size)


def resolve_partitioner(
    partitioner: Optional[Partitioner],
    partition: Optional[str],
    **flat: Optional[float],
) -> Optional[Partitioner]:
    """The partitioner of a datamodule's arguments: ``partitioner``, or the shortcut ``partition``
    with its flat arguments (``alpha``, ``min_samples``, ``shards_per_client``,
    ``classes_per_client``; None ones take their defaults), or None when neither is given."""
    given = {name: value for name, value in flat.items() if value is not None}
    if partitioner is not None:
        if not isinstance(partitioner, Partitioner):
            raise ValueError(f"partitioner must be a Partitioner (e.g. DirichletPartitioner(alpha=0.5)) or None, "
                             f"got {partitioner!r}")
        shortcut = {"partition": partition, **given} if partition is not None else given
        if shortcut:
            name, value = next(iter(shortcut.items()))
            raise ValueError(f"{name}={value!r} is a shortcut argument, but partitioner={partitioner!r} is given; "
                             "give the partitioner or the shortcut, not both")
        return partitioner
    if partition is not None and partition not in SHORTCUTS:
        raise ValueError(f"partition must be one of {SHORTCUTS}, got {partition!r}")
    uses = {"dirichlet": ("alpha", "min_samples"), "shards": ("shards_per_client",),
            "classes": ("classes_per_client",)}
    for name, value in given.items():
        if name not in uses.get(partition or "", ()):
            owner = next(shortcut for shortcut, names in uses.items() if name in names)
            raise ValueError(f"{name}={value!r} is an argument of partition={owner!r}, but partition={partition!r}")
    return None if partition is None else from_shortcut(partition, **given)
