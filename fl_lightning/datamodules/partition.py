"""Partitioners: pure functions from labels (or keys) to per-client index lists.

Each returns ``list[np.ndarray]`` (one sorted array of sample indices per client), is
deterministic given its ``seed`` and raises ``ValueError`` naming the parameter on bad input
(more clients than samples, a non-positive ``alpha``, a client left with no samples...).
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

PARTITIONS = ("iid", "dirichlet", "shards", "classes", "natural")


def _check_clients(num_samples: int, num_clients: int) -> None:
    if num_clients < 1:
        raise ValueError(f"num_clients must be >= 1, got {num_clients}")
    if num_clients > num_samples:
        raise ValueError(f"num_clients={num_clients} is more than the {num_samples} samples to partition")


def _check_nonempty(parts: list[np.ndarray], what: str) -> list[np.ndarray]:
    empty = [i for i, p in enumerate(parts) if len(p) == 0]
    if empty:
        raise ValueError(f"{what} left client(s) {empty[:10]} with no samples; use fewer clients or another partition")
    return [np.sort(p) for p in parts]


def iid(num_samples: int, num_clients: int, seed: int = 0) -> list[np.ndarray]:
    """Shuffle and split into ``num_clients`` parts whose sizes differ by at most one."""
    _check_clients(num_samples, num_clients)
    perm = np.random.default_rng(seed).permutation(num_samples)
    return _check_nonempty(list(np.array_split(perm, num_clients)), "iid")


def dirichlet(
    labels: Sequence[int], num_clients: int, alpha: float, min_samples: int = 1, seed: int = 0, max_tries: int = 1000
) -> list[np.ndarray]:
    """Label-skewed split: each class is divided over clients with proportions ~ Dir(alpha).

    Redraws (up to ``max_tries``) until every client holds at least ``min_samples`` samples.
    Small ``alpha`` gives few classes per client; large ``alpha`` tends to iid.
    """
    labels = np.asarray(labels)
    _check_clients(len(labels), num_clients)
    if not alpha > 0:
        raise ValueError(f"alpha must be > 0, got {alpha}")
    if min_samples < 0 or min_samples * num_clients > len(labels):
        raise ValueError(
            f"min_samples={min_samples} is not achievable with {num_clients} clients and {len(labels)} samples"
        )
    rng = np.random.default_rng(seed)
    classes = np.unique(labels)
    for _ in range(max_tries):
        parts: list[list[int]] = [[] for _ in range(num_clients)]
        for c in classes:
            idx = rng.permutation(np.flatnonzero(labels == c))
            props = rng.dirichlet(np.full(num_clients, alpha))
            cuts = (np.cumsum(props)[:-1] * len(idx)).astype(int)
            for client, chunk in enumerate(np.split(idx, cuts)):
                parts[client].extend(chunk.tolist())
        if min(len(p) for p in parts) >= max(min_samples, 1):
            return [np.sort(np.asarray(p, dtype=np.int64)) for p in parts]
    raise ValueError(
        f"dirichlet(alpha={alpha}) gave a client fewer than min_samples={max(min_samples, 1)} samples in "
        f"{max_tries} draws; raise alpha, lower min_samples or use fewer clients"
    )


def shards(labels: Sequence[int], num_clients: int, shards_per_client: int = 2, seed: int = 0) -> list[np.ndarray]:
    """Sort by label, cut into ``num_clients * shards_per_client`` equal shards, deal them out.

    ``shards_per_client=1`` is the "sorted" split (about one class per client when
    ``num_clients`` equals the number of classes).
    """
    labels = np.asarray(labels)
    _check_clients(len(labels), num_clients)
    if shards_per_client < 1:
        raise ValueError(f"shards_per_client must be >= 1, got {shards_per_client}")
    num_shards = num_clients * shards_per_client
    if num_shards > len(labels):
        raise ValueError(f"{num_shards} shards (num_clients * shards_per_client) exceed the {len(labels)} samples")
    rng = np.random.default_rng(seed)
    order = np.lexsort((rng.permutation(len(labels)), labels))  # by label, random within a label
    pieces = np.array_split(order, num_shards)
    deal = rng.permutation(num_shards) if shards_per_client > 1 else np.arange(num_shards)
    parts = [np.concatenate([pieces[s] for s in deal[c * shards_per_client : (c + 1) * shards_per_client]])
             for c in range(num_clients)]
    return _check_nonempty(parts, "shards")


def classes(labels: Sequence[int], num_clients: int, classes_per_client: int = 2, seed: int = 0) -> list[np.ndarray]:
    """Each client gets ``classes_per_client`` distinct classes; a class's samples are split
    evenly among the clients that hold it (the "pathological" split of pFedHN/PeFLL).

    Classes are assigned round-robin over a random class order so every class is used.
    """
    labels = np.asarray(labels)
    _check_clients(len(labels), num_clients)
    all_classes = np.unique(labels)
    if not 1 <= classes_per_client <= len(all_classes):
        raise ValueError(f"classes_per_client must be in [1, {len(all_classes)}], got {classes_per_client}")
    rng = np.random.default_rng(seed)
    order = rng.permutation(all_classes)
    owned = [[order[(c * classes_per_client + j) % len(order)] for j in range(classes_per_client)]
             for c in range(num_clients)]
    holders: dict[int, list[int]] = {}
    for client, cls in enumerate(owned):
        for k in cls:
            holders.setdefault(int(k), []).append(client)
    parts: list[list[np.ndarray]] = [[] for _ in range(num_clients)]
    for k, owners in holders.items():
        idx = rng.permutation(np.flatnonzero(labels == k))
        for client, chunk in zip(owners, np.array_split(idx, len(owners))):
            parts[client].append(chunk)
    return _check_nonempty([np.concatenate(p) if p else np.array([], dtype=np.int64) for p in parts], "classes")


def natural(keys: Sequence, num_clients: int | None = None) -> list[np.ndarray]:
    """One client per distinct key (writer, device, user...), in sorted key order.

    ``num_clients``, if given, must equal the number of distinct keys.
    """
    keys = np.asarray(keys)
    uniq, inverse = np.unique(keys, return_inverse=True)
    if num_clients is not None and num_clients != len(uniq):
        raise ValueError(f"num_clients={num_clients} but the natural partition has {len(uniq)} distinct keys")
    return [np.flatnonzero(inverse == i) for i in range(len(uniq))]


def stratified_split(
    indices: np.ndarray, labels: np.ndarray, fractions: Sequence[float], seed: int
) -> list[np.ndarray]:
    """Split ``indices`` into parts of the given ``fractions`` (the rest is the first part),
    class by class, so every part follows the client's own label distribution."""
    rng = np.random.default_rng(seed)
    parts: list[list[np.ndarray]] = [[] for _ in range(len(fractions) + 1)]
    for c in np.unique(labels[indices]):
        idx = rng.permutation(indices[labels[indices] == c])
        counts = [int(round(f * len(idx))) for f in fractions]
        start = len(idx) - sum(counts)
        parts[0].append(idx[:start])
        for j, n in enumerate(counts):
            parts[j + 1].append(idx[start : start + n])
            start += n
    return [np.sort(np.concatenate(p)) if p else np.array([], dtype=np.int64) for p in parts]
