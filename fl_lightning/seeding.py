"""Randomness keyed by (seed, round, client).

Every random choice of a federation (which clients a round samples, the order of a client's
mini-batches, an attack's noise) is drawn from a generator derived from a fixed tuple of
integers, never from a global stream. The client module's own draws (``nn.Dropout``, random
augmentation) use the global torch RNG, so a client's local work runs with it forked and
seeded from the same kind of key (:func:`keyed_rng`). Results therefore do not depend on the
number of processes, the order clients run in, or whether a run was resumed.
"""

from __future__ import annotations

import functools
import zlib
from contextlib import contextmanager
from typing import Callable, Iterator, Optional, Union

import torch

_MASK = (1 << 64) - 1
Key = Union[int, str]


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK
    return x ^ (x >> 31)


def derive_seed(seed: int, *keys: Key) -> int:
    """Mix ``seed`` and ``keys`` (ints or strings) into one 63-bit seed.

    Strings name a stream (``"sample"``, ``"batches"``...) so that two uses of the same
    (round, client) never share random numbers.
    """
    if not keys:
        return _mixed(int(seed), ()) & ((1 << 63) - 1)
    return _mix(_mixed(int(seed), keys[:-1]), keys[-1]) & ((1 << 63) - 1)


def _mix(h: int, key: Key) -> int:
    k = zlib.crc32(key.encode()) if isinstance(key, str) else int(key)
    return _splitmix64(h ^ (k & _MASK))


@functools.lru_cache(maxsize=256)
def _mixed(seed: int, keys: tuple[Key, ...]) -> int:
    """The hash of ``seed`` and ``keys`` before the final mask: the prefix that every client of a
    round's stream shares, ``(seed, stream, round)``, is mixed once per round, not once per client."""
    h = _splitmix64(seed & _MASK)
    for key in keys:
        h = _mix(h, key)
    return h


def generator(seed: int, *keys: Key, device: Union[str, torch.device] = "cpu") -> torch.Generator:
    """A fresh ``torch.Generator`` seeded from ``derive_seed(seed, *keys)``."""
    g = torch.Generator(device=device)
    g.manual_seed(derive_seed(seed, *keys))
    return g


def sample_clients(seed: int, round_idx: int, candidates: list[int], num: int) -> list[int]:
    """Sample ``num`` distinct clients of ``candidates`` for round ``round_idx``, sorted by id."""
    if not 0 < num <= len(candidates):
        raise ValueError(f"clients_per_round must be in [1, {len(candidates)}], got {num}")
    if num == len(candidates):
        return sorted(candidates)
    perm = torch.randperm(len(candidates), generator=generator(seed, "sample", round_idx))
    return sorted(candidates[i] for i in perm[:num].tolist())


@contextmanager
def keyed_rng(seed: int, *keys: Key, device: Optional[torch.device] = None) -> Iterator[None]:
    """Run the block with the global torch RNG (CPU, and ``device`` if it is a CUDA device)
    seeded from ``derive_seed(seed, *keys)``, and restore the RNG state afterwards.

    What the block draws from the global RNG (``torch.rand``, ``nn.Dropout``...) then depends on
    the key only, and the draws outside the block are unchanged by it.
    """
    with keyed_rngs(seed, *keys, device=device) as reseed:
        reseed()
        yield


@contextmanager
def keyed_rngs(seed: int, *keys: Key, device: Optional[torch.device] = None) -> Iterator[Callable[..., None]]:
    """:func:`keyed_rng` for a sequence of keys: the global RNG's state is saved once and restored
    at the end, and the block receives ``reseed(*more)``, which seeds it from ``derive_seed(seed,
    *keys, *more)``. The draws after each ``reseed`` are those of a ``keyed_rng(seed, *keys, *more)``
    of their own, at the cost of one seeding instead of a save and a restore of the RNG's state
    as well (a block's local steps: one each)."""
    cuda = None
    if device is not None and torch.device(device).type == "cuda":
        index = torch.device(device).index
        cuda = torch.cuda.current_device() if index is None else index

    def reseed(*more: Key) -> None:
        s = derive_seed(seed, *keys, *more)
        torch.default_generator.manual_seed(s)
        if cuda is not None:
            torch.cuda.default_generators[cuda].manual_seed(s)

    with torch.random.fork_rng(devices=[] if cuda is None else [cuda]):
        yield reseed
