"""Partitions as pure functions: labels (or keys) and a seed in, one index array per partition out.

Every function returns ``list[np.ndarray]``: one sorted ``int64`` array of sample indices per
partition, the partitions disjoint. It is deterministic given ``seed`` and raises
``ValueError`` naming the parameter, the value and what is allowed on bad input (more
partitions than samples, a non-positive ``alpha``, a partition left with no samples...). No
partition is ever empty: a client needs data.

The names and options follow flwr-datasets' partitioners (``num_partitions``,
``min_partition_size``, ``num_classes_per_partition``...), and :func:`iid`, :func:`dirichlet`,
:func:`shards`, :func:`pathological` and :func:`natural` give the same partitions as
flwr-datasets' for the same labels, options and seed (``docs/partitioners.md`` lists what differs
beyond that). The objects a datamodule takes (``fl_lightning.datamodules.partitioners``) are thin
wrappers over these functions.
"""

from __future__ import annotations

import math
import numbers
import warnings
from typing import Literal, Optional, Sequence, Union, get_args

import numpy as np

ClassAssignmentMode = Literal["random", "deterministic", "first-deterministic", "round-robin"]
CLASS_ASSIGNMENT_MODES: tuple[str, ...] = get_args(ClassAssignmentMode)

#: the order in which a class's samples are cut: ``"dataset"`` (stored order, flwr-datasets') or
#: ``"shuffled"`` (each class shuffled with the seed first: this library's draw before it matched Flower)
SampleOrder = Literal["dataset", "shuffled"]
#: the values of :data:`SampleOrder`
SAMPLE_ORDERS: tuple[str, ...] = get_args(SampleOrder)

Alpha = Union[float, Sequence[float]]


# ---------------------------------------------------------------- argument checks
def _require(ok: bool, name: str, value: object, allowed: str) -> None:
    """A ValueError naming the parameter, the value and what is allowed, unless ``ok``."""
    if not ok:
        raise ValueError(f"{name} must be {allowed}, got {value!r}")


def _is_int(value: object, minimum: int) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool) and value >= minimum


def _is_real(value: object) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value)


def check_partitions(num_samples: int, num_partitions: int) -> None:
    """Refuse fewer than one partition, or more partitions than samples."""
    _require(_is_int(num_partitions, 1), "num_partitions", num_partitions, ">= 1 and an integer")
    if num_partitions > num_samples:
        raise ValueError(f"num_partitions={num_partitions} is more than the {num_samples} samples to partition")


def check_alpha(alpha: Alpha) -> None:
    """Refuse an ``alpha`` that is neither a number > 0 nor a non-empty list of numbers > 0."""
    if isinstance(alpha, numbers.Real) and not isinstance(alpha, bool):
        _require(_is_real(alpha) and alpha > 0, "alpha", alpha, "> 0 and finite")
        return
    try:
        values = np.asarray(alpha, dtype=float) if isinstance(alpha, (list, tuple, np.ndarray)) else None
    except (TypeError, ValueError):
        values = None
    if values is None or values.ndim != 1 or len(values) == 0 or not (np.isfinite(values).all() and (values > 0).all()):
        raise ValueError(f"alpha must be a number > 0 or a list of numbers > 0 (one per partition), got {alpha!r}")


def dirichlet_concentration(alpha: Alpha, num_partitions: int) -> np.ndarray:
    """``alpha`` as the vector of ``num_partitions`` concentrations of the Dirichlet draws:
    a number > 0 (the same for every partition) or one number > 0 per partition."""
    check_alpha(alpha)
    if isinstance(alpha, numbers.Real):
        return np.full(num_partitions, float(alpha))
    values = np.asarray(alpha, dtype=float)
    if len(values) != num_partitions:
        raise ValueError(f"alpha has {len(values)} values but num_partitions={num_partitions}: give one number or "
                         "one per partition")
    return values


def check_sample_order(sample_order: str) -> None:
    """Refuse a ``sample_order`` that is not one of :data:`SAMPLE_ORDERS`."""
    _require(sample_order in SAMPLE_ORDERS, "sample_order", sample_order, f"one of {SAMPLE_ORDERS}")


def check_dirichlet(alpha: Alpha, min_partition_size: int, self_balancing: bool,
                    sample_order: SampleOrder = "dataset") -> None:
    """Refuse Dirichlet arguments that are invalid whatever the data."""
    check_alpha(alpha)
    _require(_is_int(min_partition_size, 0), "min_partition_size", min_partition_size, ">= 0 and an integer")
    _require(isinstance(self_balancing, bool), "self_balancing", self_balancing, "True or False")
    check_sample_order(sample_order)


def check_shards(num_shards_per_partition: Optional[int], shard_size: Optional[int],
                 keep_incomplete_shard: bool) -> None:
    """Refuse shard arguments that are invalid whatever the data."""
    if num_shards_per_partition is None and shard_size is None:
        raise ValueError("give num_shards_per_partition, shard_size or both; got neither")
    for name, value in (("num_shards_per_partition", num_shards_per_partition), ("shard_size", shard_size)):
        _require(value is None or _is_int(value, 1), name, value, ">= 1 and an integer, or None")
    _require(isinstance(keep_incomplete_shard, bool), "keep_incomplete_shard", keep_incomplete_shard, "True or False")


def check_pathological(num_classes_per_partition: int, class_assignment_mode: str,
                       sample_order: SampleOrder = "dataset") -> None:
    """Refuse pathological-split arguments that are invalid whatever the data."""
    _require(_is_int(num_classes_per_partition, 1), "num_classes_per_partition", num_classes_per_partition,
             ">= 1 and an integer")
    _require(class_assignment_mode in CLASS_ASSIGNMENT_MODES, "class_assignment_mode", class_assignment_mode,
             f"one of {CLASS_ASSIGNMENT_MODES}")
    check_sample_order(sample_order)


def check_power_law(num_classes_per_partition: int, min_per_class: int, sigma: float, used_fraction: float) -> None:
    """Refuse power-law arguments that are invalid whatever the data."""
    _require(_is_int(num_classes_per_partition, 1), "num_classes_per_partition", num_classes_per_partition,
             ">= 1 and an integer")
    _require(_is_int(min_per_class, 1), "min_per_class", min_per_class, ">= 1 and an integer")
    _require(_is_real(sigma) and sigma >= 0, "sigma", sigma, ">= 0 and finite")
    _require(_is_real(used_fraction) and 0 < used_fraction <= 1, "used_fraction", used_fraction, "in (0, 1]")


def _check_classes_per_partition(num_classes_per_partition: int, classes: np.ndarray) -> None:
    if num_classes_per_partition > len(classes):
        raise ValueError(f"num_classes_per_partition must be in [1, {len(classes)}] (the number of classes), "
                         f"got {num_classes_per_partition}")


def _nonempty(parts: list[np.ndarray], what: str) -> list[np.ndarray]:
    empty = [i for i, p in enumerate(parts) if len(p) == 0]
    if empty:
        raise ValueError(f"{what} left partition(s) {empty[:10]} with no samples; use fewer partitions or "
                         "another partitioner")
    return [np.sort(np.asarray(p, dtype=np.int64)) for p in parts]


def _label_order(labels: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """The sample indices sorted by label, in random order within a label."""
    return np.lexsort((rng.permutation(len(labels)), labels))


# ----------------------------------------------------------------------- partitions
def iid(num_samples: int, num_partitions: int, seed: int = 0) -> list[np.ndarray]:
    """Shuffle and cut into ``num_partitions`` parts whose sizes differ by at most one.

    flwr-datasets' ``IidPartitioner`` cuts the dataset in its stored order, which its
    ``FederatedDataset(shuffle=True, seed=seed)`` shuffles first with this same permutation: the
    partitions are those of that pipeline.

    >>> [part.tolist() for part in iid(10, 3, seed=0)]
    [[2, 4, 6, 7], [3, 5, 9], [0, 1, 8]]
    """
    check_partitions(num_samples, num_partitions)
    perm = np.random.default_rng(seed).permutation(num_samples)
    return _nonempty(list(np.array_split(perm, num_partitions)), "iid")


def _balanced(proportions: np.ndarray, sizes: np.ndarray, average: float) -> np.ndarray:
    """Self-balancing: no share for a partition already above ``average`` samples, the others
    renormalized. The sum runs left to right as in flwr-datasets (``np.sum`` adds pairwise, which
    can change the last bit and so move a cut by one sample)."""
    kept = np.where(sizes > average, 0.0, proportions)
    return kept / np.cumsum(kept)[-1]


def dirichlet(
    labels: Sequence[int],
    num_partitions: int,
    alpha: Alpha,
    min_partition_size: int = 10,
    self_balancing: bool = False,
    seed: int = 0,
    max_tries: int = 1000,
    sample_order: SampleOrder = "dataset",
) -> list[np.ndarray]:
    """Label skew: the samples of each class are divided over the partitions in proportions ~ Dir(alpha).

    Class by class (in sorted order), the proportions ``p ~ Dir(alpha)`` are drawn and the
    class's samples cut at ``floor(cumsum(p) * n_class)``. The whole draw is repeated (up to
    ``max_tries`` times) until every partition holds at least ``max(min_partition_size, 1)``
    samples. Small ``alpha`` gives few classes per partition; large ``alpha`` tends to iid.
    With ``sample_order="dataset"`` the partitions are flwr-datasets' ``DirichletPartitioner``'s
    for the same seed (which gives up after 11 draws).

    Args:
        labels: the label of every sample.
        num_partitions: number of partitions.
        alpha: the concentration, one number for all partitions or one per partition.
        min_partition_size: the fewest samples a partition may have (0 counts as 1).
        self_balancing: a partition that already holds more than ``len(labels) / num_partitions``
            samples gets nothing of the classes still to be divided (the other proportions are
            renormalized), as in Flower and the code of Yurochkin et al. (2019).
        seed: seed of the draws.
        max_tries: how many draws to try before giving up.
        sample_order: ``"dataset"``: a class's samples are cut in stored order (Flower's);
            ``"shuffled"``: each class is shuffled before its proportions are drawn (this
            library's draw before it matched Flower; the same distribution, other partitions).
    """
    labels = np.asarray(labels)
    check_partitions(len(labels), num_partitions)
    check_dirichlet(alpha, min_partition_size, self_balancing, sample_order)
    concentration = dirichlet_concentration(alpha, num_partitions)
    smallest = max(min_partition_size, 1)
    if smallest * num_partitions > len(labels):
        raise ValueError(f"min_partition_size={min_partition_size} is not achievable with num_partitions="
                         f"{num_partitions} and {len(labels)} samples")
    rng = np.random.default_rng(seed)
    average = len(labels) / num_partitions
    for _ in range(max_tries):
        parts: list[list[int]] = [[] for _ in range(num_partitions)]
        for c in np.unique(labels):
            idx = np.flatnonzero(labels == c)
            if sample_order == "shuffled":
                idx = rng.permutation(idx)
            props = rng.dirichlet(concentration)
            if self_balancing:
                props = _balanced(props, np.array([len(p) for p in parts]), average)
            cuts = (np.cumsum(props) * len(idx)).astype(int)[:-1]
            for partition, chunk in enumerate(np.split(idx, cuts)):
                parts[partition].extend(chunk.tolist())
        if min(len(p) for p in parts) >= smallest:
            return [np.sort(np.asarray(p, dtype=np.int64)) for p in parts]
    raise ValueError(
        f"dirichlet(alpha={alpha}) gave a partition fewer than min_partition_size={smallest} samples in "
        f"{max_tries} draws; raise alpha, lower min_partition_size or use fewer partitions"
    )


def shards(
    labels: Sequence[int],
    num_partitions: int,
    num_shards_per_partition: Optional[int] = None,
    shard_size: Optional[int] = None,
    keep_incomplete_shard: bool = False,
    seed: int = 0,
) -> list[np.ndarray]:
    """Sort by label, cut into shards of consecutive samples, deal the shards out at random
    (McMahan et al., 2017), as flwr-datasets' ``ShardPartitioner`` (the same partitions for the
    same seed).

    The samples are sorted by label, stably (within a label in stored order), and cut into
    shards of ``shard_size`` samples; a random permutation of the shards is dealt out in turn:

    * ``num_shards_per_partition`` only: ``shard_size = len(labels) // (num_partitions *
      num_shards_per_partition)``; every partition gets ``num_shards_per_partition`` shards, the
      samples of the shards not dealt are unused. With ``keep_incomplete_shard`` the last,
      smaller shard is among those that may be dealt.
    * ``shard_size`` only: ``len(labels) // shard_size`` shards (one more, smaller, with
      ``keep_incomplete_shard``), all dealt, as evenly as possible (the first partitions get one
      more shard).
    * both: every partition gets ``num_shards_per_partition`` shards of ``shard_size`` samples;
      the samples of the shards not dealt are unused.
    """
    labels = np.asarray(labels)
    n = len(labels)
    check_partitions(n, num_partitions)
    check_shards(num_shards_per_partition, shard_size, keep_incomplete_shard)
    if num_shards_per_partition is not None:
        dealt = num_partitions * num_shards_per_partition
        per_partition = np.full(num_partitions, num_shards_per_partition)
        if shard_size is None:
            if dealt > n:
                raise ValueError(f"num_partitions * num_shards_per_partition = {dealt} shards exceed the {n} samples")
            shard_size = n // dealt
            usable = math.ceil(n / shard_size) if keep_incomplete_shard else n // shard_size
        else:
            if dealt * shard_size > n:
                raise ValueError(f"num_partitions * num_shards_per_partition * shard_size = {dealt * shard_size} "
                                 f"samples is more than the {n} samples")
            usable = n // shard_size
    else:
        usable = dealt = math.ceil(n / shard_size) if keep_incomplete_shard else n // shard_size
        if usable < num_partitions:
            raise ValueError(f"shard_size={shard_size} cuts the {n} samples into {usable} shards, fewer than "
                             f"num_partitions={num_partitions}; lower shard_size")
        per_partition = np.full(num_partitions, usable // num_partitions)
        per_partition[: usable % num_partitions] += 1
    order = np.argsort(labels, kind="stable")
    deal = np.random.default_rng(seed).permutation(usable)[:dealt]
    return _nonempty([np.concatenate([order[s * shard_size : (s + 1) * shard_size] for s in shard_ids])
                      for shard_ids in np.split(deal, np.cumsum(per_partition)[:-1])], "shards")


def sorted_split(labels: Sequence[int], num_partitions: int, seed: int = 0) -> list[np.ndarray]:
    """Sort by label and cut into ``num_partitions`` consecutive parts (sizes differ by at most
    one); partition ``i`` is the ``i``-th part. With as many partitions as classes, about one
    class per partition (FedDeper's "sorted" split). Within a label the order is random."""
    labels = np.asarray(labels)
    check_partitions(len(labels), num_partitions)
    order = _label_order(labels, np.random.default_rng(seed))
    return _nonempty(list(np.array_split(order, num_partitions)), "sorted_split")


def _assign_classes(classes: np.ndarray, num_partitions: int, per_partition: int, mode: str,
                    rng: np.random.Generator) -> list[list]:
    """The classes each partition holds (see :func:`pathological`)."""
    c = len(classes)
    if mode == "deterministic":
        return [[classes[(p + i) % c] for i in range(per_partition)] for p in range(num_partitions)]
    if mode == "random":
        return [rng.choice(classes, size=per_partition, replace=False).tolist() for _ in range(num_partitions)]
    if mode == "first-deterministic":
        owned = []
        for p in range(num_partitions):
            mine = [classes[p % c]]
            while len(mine) < per_partition:
                k = rng.choice(classes, size=1)[0]
                if k not in mine:
                    mine.append(k)
            owned.append(mine)
        return owned
    order = rng.permutation(classes)  # round-robin
    return [[order[(p * per_partition + i) % c] for i in range(per_partition)] for p in range(num_partitions)]


def pathological(
    labels: Sequence[int],
    num_partitions: int,
    num_classes_per_partition: int,
    class_assignment_mode: ClassAssignmentMode = "random",
    seed: int = 0,
    sample_order: SampleOrder = "dataset",
) -> list[np.ndarray]:
    """Every partition holds exactly ``num_classes_per_partition`` classes; a class's samples are
    split evenly among the partitions holding it, in partition order (Li et al., 2022; pFedHN, PeFLL).

    ``class_assignment_mode`` says which classes partition ``p`` holds (``C`` classes, sorted):

    * ``"random"``: a random choice without replacement, for each partition;
    * ``"deterministic"``: classes ``(p + i) mod C``, ``i < num_classes_per_partition``;
    * ``"first-deterministic"``: class ``p mod C``, the others at random;
    * ``"round-robin"``: the classes dealt in turn over a random order of the classes, so
      every class is used when ``num_partitions * num_classes_per_partition >= C`` and each
      is held by equally many partitions (plus or minus one).

    With the first three and ``sample_order="dataset"`` (a class's samples split in stored
    order) the partitions are flwr-datasets' ``PathologicalPartitioner``'s for the same seed;
    ``sample_order="shuffled"`` shuffles each class first (this library's draw before it
    matched Flower: the same classes and sizes, other samples). Classes no partition holds are
    left out, with a warning.
    """
    labels = np.asarray(labels)
    check_partitions(len(labels), num_partitions)
    check_pathological(num_classes_per_partition, class_assignment_mode, sample_order)
    classes = np.unique(labels)
    _check_classes_per_partition(num_classes_per_partition, classes)
    rng = np.random.default_rng(seed)
    owned = _assign_classes(classes, num_partitions, num_classes_per_partition, class_assignment_mode, rng)
    holders: dict = {}
    for partition, held in enumerate(owned):
        for k in held:
            holders.setdefault(k.item() if isinstance(k, np.generic) else k, []).append(partition)
    unused = [k.item() for k in classes if k.item() not in holders]
    if unused:
        warnings.warn(f"classes {unused[:10]} are in no partition (num_partitions={num_partitions}, "
                      f"num_classes_per_partition={num_classes_per_partition}, class_assignment_mode="
                      f"{class_assignment_mode!r})", UserWarning, stacklevel=2)
    parts: list[list[np.ndarray]] = [[] for _ in range(num_partitions)]
    for k, owners in holders.items():
        idx = np.flatnonzero(labels == k)
        if sample_order == "shuffled":
            idx = rng.permutation(idx)
        if len(idx) < len(owners):
            raise ValueError(f"class {k!r} has {len(idx)} sample(s) for the {len(owners)} partitions holding it, so "
                             "a partition would get no samples of it; lower num_partitions or "
                             "num_classes_per_partition")
        for partition, chunk in zip(owners, np.array_split(idx, len(owners))):
            parts[partition].append(chunk)
    return _nonempty([np.concatenate(p) if p else np.array([], dtype=np.int64) for p in parts], "pathological")


def natural(keys: Sequence, num_partitions: Optional[int] = None) -> list[np.ndarray]:
    """One partition per distinct key (writer, device, user...), in sorted key order.

    ``num_partitions``, if given, must equal the number of distinct keys.
    """
    keys = np.asarray(keys)
    uniq, inverse = np.unique(keys, return_inverse=True)
    if num_partitions is not None and num_partitions != len(uniq):
        raise ValueError(f"num_partitions={num_partitions} but the natural partition has {len(uniq)} distinct keys")
    return [np.flatnonzero(inverse == i) for i in range(len(uniq))]


def power_law(
    labels: Sequence[int],
    num_partitions: int,
    num_classes_per_partition: int = 2,
    min_per_class: int = 10,
    sigma: float = 2.0,
    used_fraction: float = 1.0,
    seed: int = 0,
) -> list[np.ndarray]:
    """FedProxVR's split (Dinh et al., 2020): partition ``k`` holds the classes ``(k + j) mod C``,
    ``j < num_classes_per_partition``, with heavy-tailed sizes.

    Each holder of a class first receives ``min_per_class`` of its samples; the rest of the
    class is shared among its holders in proportions drawn from ``lognormal(0, sigma)``
    (following the authors' data generator).

    Args:
        labels: the label of every sample.
        num_partitions: number of partitions.
        num_classes_per_partition: distinct classes per partition (2 in the paper).
        min_per_class: samples of each of its classes every partition receives before the power law.
        sigma: the lognormal shape of the shares (larger = more unequal sizes).
        used_fraction: fraction of each class's samples handed out (the rest is unused), to
            match the paper's smaller client sizes or to shrink an experiment.
        seed: seed of the shuffle and the shares.
    """
    labels = np.asarray(labels)
    _require(_is_int(num_partitions, 1), "num_partitions", num_partitions, ">= 1 and an integer")
    check_power_law(num_classes_per_partition, min_per_class, sigma, used_fraction)
    classes = np.unique(labels)
    _check_classes_per_partition(num_classes_per_partition, classes)
    rng = np.random.default_rng(seed)
    holders: dict[int, list[int]] = {int(c): [] for c in classes}
    for k in range(num_partitions):
        for j in range(num_classes_per_partition):
            holders[int(classes[(k + j) % len(classes)])].append(k)
    unheld = [c for c, owners in holders.items() if not owners]
    if unheld:
        warnings.warn(f"power_law: classes {unheld} are held by no partition ({num_partitions} partitions x "
                      f"{num_classes_per_partition} classes < {len(classes)} classes); their samples are unused",
                      stacklevel=2)
    parts: list[list[np.ndarray]] = [[] for _ in range(num_partitions)]
    for c, owners in holders.items():
        if not owners:
            continue
        idx = rng.permutation(np.flatnonzero(labels == c))
        idx = idx[: int(round(used_fraction * len(idx)))]
        if len(idx) < min_per_class * len(owners):
            raise ValueError(
                f"class {c} has {len(idx)} samples (used_fraction={used_fraction}), fewer than "
                f"min_per_class={min_per_class} x {len(owners)} partitions holding it"
            )
        base, rest = idx[: min_per_class * len(owners)], idx[min_per_class * len(owners):]
        shares = rng.lognormal(0.0, sigma, len(owners))
        cuts = (np.cumsum(shares)[:-1] / shares.sum() * len(rest)).astype(int)
        for i, (owner, extra) in enumerate(zip(owners, np.split(rest, cuts))):
            parts[owner] += [base[i * min_per_class : (i + 1) * min_per_class], extra]
    return [np.sort(np.concatenate(p)) for p in parts]


# ------------------------------------------------------------------ within a partition
def _cut(shuffled: np.ndarray, fractions: Sequence[float]) -> list[np.ndarray]:
    """``shuffled`` cut into ``round(f * len)`` samples for each of ``fractions`` at its end, the
    rest first."""
    counts = [int(round(f * len(shuffled))) for f in fractions]
    start = len(shuffled) - sum(counts)
    parts = [shuffled[:start]]
    for n in counts:
        parts.append(shuffled[start : start + n])
        start += n
    return parts


def stratified_split(
    indices: np.ndarray, labels: np.ndarray, fractions: Sequence[float], seed: int
) -> list[np.ndarray]:
    """Split ``indices`` into parts of the given ``fractions`` (the rest is the first part),
    class by class, so every part follows the partition's own label distribution: of a class's
    ``n`` samples, a part of fraction ``f`` takes ``round(f * n)``."""
    rng = np.random.default_rng(seed)
    parts: list[list[np.ndarray]] = [[] for _ in range(len(fractions) + 1)]
    for c in np.unique(labels[indices]):
        for part, cut in zip(parts, _cut(rng.permutation(indices[labels[indices] == c]), fractions)):
            part.append(cut)
    return [np.sort(np.concatenate(p)) if p else np.array([], dtype=np.int64) for p in parts]


def random_split(indices: np.ndarray, fractions: Sequence[float], seed: int) -> list[np.ndarray]:
    """Split ``indices`` at random into parts of the given ``fractions`` (the rest is the first
    part): a part of fraction ``f`` takes ``round(f * len(indices))`` samples. The split of targets
    that are not class labels (regression values, vectors...), which no class stratifies."""
    shuffled = np.random.default_rng(seed).permutation(indices)
    return [np.sort(part).astype(np.int64) for part in _cut(shuffled, fractions)]
