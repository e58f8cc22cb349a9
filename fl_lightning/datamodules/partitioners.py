"""Partitioners: how a datamodule's pool of samples is split into clients.

Each is a small object holding its options, a thin wrapper over a pure function of
:mod:`fl_lightning.functional.partition`. The names and options are flwr-datasets' (``IidPartitioner``,
``DirichletPartitioner``, ``PathologicalPartitioner``, ``ShardPartitioner``,
``NaturalIdPartitioner``) plus this library's own (``SortedPartitioner``, ``PowerLawPartitioner``)
and an adapter for any flwr-datasets partitioner (``FlowerPartitioner``). Where the semantics
differ from Flower's, the class says so; ``docs/partitioners.md`` has the table.

A datamodule takes one as ``partitioner=`` (in YAML: ``class_path`` / ``init_args``)::

    MNISTFederated(num_clients=100, partitioner=DirichletPartitioner(alpha=0.3))

``num_partitions`` and ``seed`` may be left out: the datamodule's ``num_clients`` and ``seed``
are used. A partitioner reads the samples' labels, or the column its ``partition_by`` names
(datamodules over a table, such as ``HuggingFaceFederated``; ``"label"`` always means the labels).

The flwr-named partitioners give flwr-datasets' partitions for the same labels, options and
seed (``IidPartitioner``: those of ``FederatedDataset(shuffle=True, seed=seed)``).

The old string shortcuts (``partition="iid"|"dirichlet"|"shards"|"classes"|"natural"`` with
``alpha``, ``min_samples``, ``shards_per_client``, ``classes_per_client``) are
:func:`from_shortcut`: they give the same clients as before for the same seed, except
``partition="shards"`` with ``shards_per_client >= 2``, now Flower's shards.
"""

from __future__ import annotations

import copy
import inspect
import numbers
from abc import ABC, abstractmethod
from typing import Any, ClassVar, Optional, Sequence, Union

import numpy as np

from fl_lightning.datamodules.hf_datasets import import_datasets
from fl_lightning.functional import partition as F
from fl_lightning.validation import check_int

#: the strings ``partition=`` takes in place of a partitioner (``docs/partitioners.md``: what each builds)
SHORTCUTS: tuple[str, ...] = ("iid", "dirichlet", "shards", "classes", "natural")


class Partitioner(ABC):
    """Splits the samples of a pool into partitions (one per client).

    Args:
        num_partitions: number of partitions; None takes the datamodule's ``num_clients``.
        partition_by: the column to partition by; None (or ``"label"``) means the labels.
        seed: seed of the partition; None takes the datamodule's ``seed``.
    """

    #: ``partition_by=None`` means the datamodule's natural keys (writer, device...), not the labels
    reads_keys: ClassVar[bool] = False
    #: the number of partitions comes from the data (``num_partitions``, if set, is checked against it)
    counts_partitions: ClassVar[bool] = False

    @property
    def reads_labels(self) -> bool:
        """Whether the partitions depend on the values of the labels (read as classes), not only on
        their number: a datamodule whose targets are not class labels (regression values...) refuses
        such a partitioner, unless its ``partition_by`` names another column."""
        return not self.reads_keys

    def __init__(self, num_partitions: Optional[int] = None, partition_by: Optional[str] = None,
                 seed: Optional[int] = None) -> None:
        if num_partitions is not None:
            check_int("num_partitions", num_partitions, 1)
        if partition_by is not None and not isinstance(partition_by, str):
            raise ValueError(f"partition_by must be a column name or None, got {partition_by!r}")
        if seed is not None:
            check_int("seed", seed, 0)
        self.num_partitions = num_partitions
        self.partition_by = partition_by
        self.seed = seed

    def split(self, values: Sequence, num_partitions: Optional[int] = None, seed: int = 0) -> list[np.ndarray]:
        """One sorted array of sample indices per partition.

        Args:
            values: the label (or the ``partition_by`` value, or natural key) of every sample.
            num_partitions: the caller's number of partitions (a datamodule's ``num_clients``);
                must agree with this partitioner's ``num_partitions`` when both are set.
            seed: used unless this partitioner has a ``seed`` of its own.
        """
        if num_partitions is not None and self.num_partitions is not None and num_partitions != self.num_partitions:
            raise ValueError(f"{self!r} makes {self.num_partitions} partitions but {num_partitions} were asked for; "
                             "set one of the two (the partitioner's num_partitions or the datamodule's num_clients)")
        count = self.num_partitions if self.num_partitions is not None else num_partitions
        if count is None and not self.counts_partitions:
            raise ValueError(f"{self!r} needs num_partitions: give it to the partitioner or set the datamodule's "
                             "num_clients")
        return self._split(np.asarray(values), count, self.seed if self.seed is not None else seed)

    @abstractmethod
    def _split(self, values: np.ndarray, num_partitions: Optional[int], seed: int) -> list[np.ndarray]:
        """The partitions of ``values`` (``num_partitions`` is None only when ``counts_partitions``)."""

    def _arguments(self) -> dict[str, Any]:
        """The constructor's arguments that differ from their defaults."""
        parameters = inspect.signature(type(self).__init__).parameters
        return {name: getattr(self, name) for name, p in parameters.items()
                if name != "self" and (p.default is inspect.Parameter.empty or getattr(self, name) != p.default)}

    def __repr__(self) -> str:
        return f"{type(self).__name__}({', '.join(f'{k}={v!r}' for k, v in self._arguments().items())})"

    def __eq__(self, other: object) -> bool:
        return type(self) is type(other) and self._arguments() == other._arguments()  # type: ignore[attr-defined]

    __hash__ = None  # type: ignore[assignment]


class IidPartitioner(Partitioner):
    """Shuffled samples cut into ``num_partitions`` parts whose sizes differ by at most one.

    Flower's cuts the dataset in its stored order, which ``FederatedDataset(shuffle=True,
    seed=seed)`` shuffles first; this one shuffles with ``seed`` the same way, so its partitions
    are that pipeline's (flwr-datasets' ``IidPartitioner`` has no seed of its own).
    """

    def __init__(self, num_partitions: Optional[int] = None, seed: Optional[int] = None) -> None:
        super().__init__(num_partitions, None, seed)

    @property
    def reads_labels(self) -> bool:
        return False  # their number only: any targets

    def _split(self, values: np.ndarray, num_partitions: Optional[int], seed: int) -> list[np.ndarray]:
        assert num_partitions is not None
        return F.iid(len(values), num_partitions, seed)


class DirichletPartitioner(Partitioner):
    """Label skew: each class is divided over the partitions in proportions ~ Dir(alpha)
    (:func:`fl_lightning.functional.partition.dirichlet`).

    Args:
        num_partitions: number of partitions (None: the datamodule's ``num_clients``).
        partition_by: the column of labels (None: the labels).
        alpha: concentration: one number > 0, or one per partition (as Flower's). Small is skewed,
            large is near iid.
        min_partition_size: draws are repeated until every partition has at least this many
            samples (Flower's default, 10). A partition is never empty: 0 counts as 1.
        self_balancing: a partition already above the average size gets no more classes (Flower's).
        seed: seed of the draws (None: the datamodule's ``seed``).
        sample_order: ``"dataset"`` (Flower's): a class's samples are cut in stored order;
            ``"shuffled"``: each class is shuffled first, this library's draw before it matched
            Flower (the RAGA and SCAFFOLD results in ``docs/results`` were run with it).

    The partitions are Flower's for the same labels, options and seed, as long as Flower finds
    one in its 11 draws (this one tries up to 1000) and leaves no partition empty (here
    ``min_partition_size=0`` counts as 1). No ``shuffle`` option (the order within a partition
    does not matter here: clients draw their batches from their own generator).
    """

    def __init__(self, num_partitions: Optional[int] = None, partition_by: Optional[str] = None, *,
                 alpha: Union[float, list[float]], min_partition_size: int = 10, self_balancing: bool = False,
                 seed: Optional[int] = None, sample_order: F.SampleOrder = "dataset") -> None:
        super().__init__(num_partitions, partition_by, seed)
        F.check_dirichlet(alpha, min_partition_size, self_balancing, sample_order)
        if num_partitions is not None:
            F.dirichlet_concentration(alpha, num_partitions)
        self.alpha = alpha if isinstance(alpha, numbers.Real) else [float(a) for a in alpha]
        self.min_partition_size = min_partition_size
        self.self_balancing = self_balancing
        self.sample_order = sample_order

    def _split(self, values: np.ndarray, num_partitions: Optional[int], seed: int) -> list[np.ndarray]:
        assert num_partitions is not None
        return F.dirichlet(values, num_partitions, self.alpha, self.min_partition_size, self.self_balancing, seed,
                           sample_order=self.sample_order)


class PathologicalPartitioner(Partitioner):
    """Every partition holds exactly ``num_classes_per_partition`` classes, a class's samples
    split evenly among its holders (:func:`fl_lightning.functional.partition.pathological`).

    Args:
        num_partitions: number of partitions (None: the datamodule's ``num_clients``).
        partition_by: the column of labels (None: the labels).
        num_classes_per_partition: classes per partition.
        class_assignment_mode: ``"random"`` (Flower's default), ``"deterministic"``,
            ``"first-deterministic"`` as in Flower, or this library's ``"round-robin"`` (classes
            dealt in turn over a random class order: every class used, equally often; the
            ``partition="classes"`` shortcut).
        seed: seed of the assignment (None: the datamodule's ``seed``).
        sample_order: ``"dataset"`` (Flower's): a class's samples are split in stored order;
            ``"shuffled"``: each class is shuffled first, this library's draw before it matched
            Flower (the PeFLL results in ``docs/results`` were run with it).

    With Flower's three modes the partitions are Flower's for the same labels, options and
    seed. No ``shuffle`` option.
    """

    def __init__(self, num_partitions: Optional[int] = None, partition_by: Optional[str] = None, *,
                 num_classes_per_partition: int, class_assignment_mode: F.ClassAssignmentMode = "random",
                 seed: Optional[int] = None, sample_order: F.SampleOrder = "dataset") -> None:
        super().__init__(num_partitions, partition_by, seed)
        F.check_pathological(num_classes_per_partition, class_assignment_mode, sample_order)
        self.num_classes_per_partition = num_classes_per_partition
        self.class_assignment_mode = class_assignment_mode
        self.sample_order = sample_order

    def _split(self, values: np.ndarray, num_partitions: Optional[int], seed: int) -> list[np.ndarray]:
        assert num_partitions is not None
        return F.pathological(values, num_partitions, self.num_classes_per_partition, self.class_assignment_mode,
                              seed, self.sample_order)


class ShardPartitioner(Partitioner):
    """Samples sorted by label, cut into shards, shards dealt at random (McMahan et al., 2017;
    :func:`fl_lightning.functional.partition.shards`).

    Args:
        num_partitions: number of partitions (None: the datamodule's ``num_clients``).
        partition_by: the column of labels (None: the labels).
        num_shards_per_partition: shards per partition.
        shard_size: samples per shard.
        keep_incomplete_shard: keep the last, smaller shard (unless ``shard_size`` and
            ``num_shards_per_partition`` are both given).
        seed: seed of the deal (None: the datamodule's ``seed``).

    The partitions are Flower's for the same labels, options and seed; with
    ``num_shards_per_partition`` the samples of the shards not dealt are unused, as in Flower.
    No ``shuffle`` option.
    """

    def __init__(self, num_partitions: Optional[int] = None, partition_by: Optional[str] = None,
                 num_shards_per_partition: Optional[int] = None, shard_size: Optional[int] = None,
                 keep_incomplete_shard: bool = False, seed: Optional[int] = None) -> None:
        super().__init__(num_partitions, partition_by, seed)
        F.check_shards(num_shards_per_partition, shard_size, keep_incomplete_shard)
        self.num_shards_per_partition = num_shards_per_partition
        self.shard_size = shard_size
        self.keep_incomplete_shard = keep_incomplete_shard

    def _split(self, values: np.ndarray, num_partitions: Optional[int], seed: int) -> list[np.ndarray]:
        assert num_partitions is not None
        return F.shards(values, num_partitions, self.num_shards_per_partition, self.shard_size,
                        self.keep_incomplete_shard, seed)


class NaturalIdPartitioner(Partitioner):
    """One partition per distinct key (writer, device, user...), in sorted key order, as Flower's.

    Args:
        partition_by: the column of keys; None takes the datamodule's natural keys (FEMNIST's
            writers, Synthetic's generated clients). Flower requires the column.
        num_partitions: if set, the number of distinct keys it must find (None: any).
    """

    reads_keys = True
    counts_partitions = True

    def __init__(self, partition_by: Optional[str] = None, num_partitions: Optional[int] = None) -> None:
        super().__init__(num_partitions, partition_by, None)

    def _split(self, values: np.ndarray, num_partitions: Optional[int], seed: int) -> list[np.ndarray]:
        return F.natural(values, num_partitions)


class SortedPartitioner(Partitioner):
    """This library's "sorted" split: samples sorted by label and cut into ``num_partitions``
    consecutive parts, partition ``i`` the ``i``-th (about one class per partition when there
    are as many partitions as classes; FedDeper's setting; :func:`fl_lightning.functional.partition.sorted_split`).
    The ``partition="shards", shards_per_client=1`` shortcut.

    Args:
        num_partitions: number of partitions (None: the datamodule's ``num_clients``).
        partition_by: the column of labels (None: the labels).
        seed: seed of the order within a label (None: the datamodule's ``seed``).
    """

    def _split(self, values: np.ndarray, num_partitions: Optional[int], seed: int) -> list[np.ndarray]:
        assert num_partitions is not None
        return F.sorted_split(values, num_partitions, seed)


class PowerLawPartitioner(Partitioner):
    """FedProxVR's split (Dinh et al., 2020): partition ``k`` holds the consecutive classes
    ``(k + j) mod C``, ``j < num_classes_per_partition``, with power-law sizes
    (:func:`fl_lightning.functional.partition.power_law`). The paper pools train and test
    images (``pool_test_set=True``) and splits every client 75/25 (``test_fraction=0.25``).

    Args:
        num_partitions: number of partitions (None: the datamodule's ``num_clients``).
        partition_by: the column of labels (None: the labels).
        num_classes_per_partition: classes per partition (2 in the paper).
        min_per_class: samples of each of its classes every partition gets before the power law.
        sigma: lognormal shape of the shares (larger: more unequal sizes).
        used_fraction: fraction of each class handed out (the rest unused).
        seed: seed of the shuffle and the shares (None: the datamodule's ``seed``).
    """

    def __init__(self, num_partitions: Optional[int] = None, partition_by: Optional[str] = None,
                 num_classes_per_partition: int = 2, min_per_class: int = 10, sigma: float = 2.0,
                 used_fraction: float = 1.0, seed: Optional[int] = None) -> None:
        super().__init__(num_partitions, partition_by, seed)
        F.check_power_law(num_classes_per_partition, min_per_class, sigma, used_fraction)
        self.num_classes_per_partition = num_classes_per_partition
        self.min_per_class = min_per_class
        self.sigma = sigma
        self.used_fraction = used_fraction

    def _split(self, values: np.ndarray, num_partitions: Optional[int], seed: int) -> list[np.ndarray]:
        assert num_partitions is not None
        return F.power_law(values, num_partitions, self.num_classes_per_partition, self.min_per_class, self.sigma,
                           self.used_fraction, seed)


class FlowerPartitioner(Partitioner):
    """Any flwr-datasets partitioner (``flwr_datasets.partitioner``) as this library's.

    Flower's partitioners read one column of a Hugging Face dataset (their ``partition_by``),
    or only its number of rows. This adapter hands a copy of ``partitioner`` a one-column
    ``datasets.Dataset`` named ``partition_by`` (default ``"label"``) that holds the
    datamodule's labels (or its ``partition_by`` column) and reads back the rows of each of
    its partitions. Build the Flower partitioner with the same ``partition_by``.

    The partitions, their number and their randomness are Flower's (its own ``seed``); the
    datamodule's ``num_clients``, if set, must equal Flower's ``num_partitions``. Needs
    ``flwr-datasets`` (``pip install flwr-datasets``).

    Args:
        partitioner: a ``flwr_datasets.partitioner.Partitioner`` with no dataset assigned.
        partition_by: the column Flower's partitioner reads (None: the labels, as ``"label"``);
            must be the Flower partitioner's own ``partition_by``, if it has one.
    """

    counts_partitions = True

    def __init__(self, partitioner: Any, partition_by: Optional[str] = None) -> None:
        super().__init__(None, partition_by, None)
        if not (hasattr(type(partitioner), "load_partition") and hasattr(type(partitioner), "num_partitions")):
            raise ValueError(f"partitioner must be a flwr_datasets.partitioner.Partitioner, got {partitioner!r}")
        handed = partition_by or "label"
        reads = getattr(partitioner, "_partition_by", None)  # where flwr-datasets keeps the column it reads
        if isinstance(reads, str) and reads != handed:
            raise ValueError(
                f"{type(partitioner).__name__} reads the column {reads!r} (its partition_by), but FlowerPartitioner("
                f"partition_by={partition_by!r}) hands it the column {handed!r}: give FlowerPartitioner(partitioner, "
                f"partition_by={reads!r}) to partition by the datamodule's column {reads!r}, or build the Flower "
                f"partitioner with partition_by={handed!r}")
        self.partitioner = partitioner

    @property
    def reads_labels(self) -> bool:
        """Whether Flower's partitioner reads a column (its ``partition_by``; an ``IidPartitioner``
        reads none)."""
        return isinstance(getattr(self.partitioner, "_partition_by", None), str)

    def _split(self, values: np.ndarray, num_partitions: Optional[int], seed: int) -> list[np.ndarray]:
        datasets = import_datasets()
        column = self.partition_by or "label"
        flower = copy.deepcopy(self.partitioner)
        flower.dataset = datasets.Dataset.from_dict({column: values.tolist(), "_row": np.arange(len(values))})
        count = getattr(flower, "_num_partitions", None)  # a count given to flwr-datasets, read before it partitions
        if not isinstance(count, int):
            count = flower.num_partitions
        if count > len(values):
            raise ValueError(f"the Flower partitioner's num_partitions={count} is more than the {len(values)} samples "
                             "to partition: every client needs at least one")
        parts = [np.sort(np.asarray(flower.load_partition(i)["_row"], dtype=np.int64)) for i in range(count)]
        if num_partitions is not None and num_partitions != len(parts):
            raise ValueError(f"the Flower partitioner makes {len(parts)} partitions but num_clients={num_partitions}; "
                             "leave num_clients unset or make them agree")
        empty = [i for i, p in enumerate(parts) if len(p) == 0]
        if empty:
            raise ValueError(f"the Flower partitioner left partition(s) {empty[:10]} with no samples; every client "
                             "needs data")
        return parts


def from_shortcut(
    partition: str,
    alpha: float = 0.5,
    min_samples: int = 1,
    shards_per_client: int = 2,
    classes_per_client: int = 2,
) -> Partitioner:
    """The partitioner of an old ``partition=`` string and its flat arguments (the same clients
    as before for the same seed, except ``"shards"`` with ``shards_per_client >= 2``: Flower's shards).

    ``"iid"``: ``IidPartitioner()``; ``"dirichlet"``: ``DirichletPartitioner(alpha=alpha,
    min_partition_size=min_samples, sample_order="shuffled")``; ``"shards"``: ``SortedPartitioner()`` when
    ``shards_per_client=1``, else ``ShardPartitioner(num_shards_per_partition=shards_per_client)``;
    ``"classes"``: ``PathologicalPartitioner(num_classes_per_partition=classes_per_client,
    class_assignment_mode="round-robin", sample_order="shuffled")``; ``"natural"``: ``NaturalIdPartitioner()``.
    """
    if partition == "iid":
        return IidPartitioner()
    if partition == "dirichlet":
        check_int("min_samples", min_samples, 0)
        return DirichletPartitioner(alpha=alpha, min_partition_size=min_samples, sample_order="shuffled")
    if partition == "shards":
        check_int("shards_per_client", shards_per_client, 1)
        if shards_per_client == 1:
            return SortedPartitioner()
        return ShardPartitioner(num_shards_per_partition=shards_per_client)
    if partition == "classes":
        check_int("classes_per_client", classes_per_client, 1)
        return PathologicalPartitioner(num_classes_per_partition=classes_per_client,
                                       class_assignment_mode="round-robin", sample_order="shuffled")
    if partition == "natural":
        return NaturalIdPartitioner()
    raise ValueError(f"partition must be one of {SHORTCUTS}, got {partition!r}")


__all__ = [
    "DirichletPartitioner",
    "FlowerPartitioner",
    "IidPartitioner",
    "NaturalIdPartitioner",
    "PathologicalPartitioner",
    "Partitioner",
    "PowerLawPartitioner",
    "SHORTCUTS",
    "ShardPartitioner",
    "SortedPartitioner",
    "from_shortcut",
]
