"""Randomness keyed by (seed, round, client).

Every random choice of a federation (which clients a round samples, the order of a client's
mini-batches, an attack's noise) is drawn from a generator derived from a fixed tuple of
integers, never from a global stream. Results therefore do not depend on the number of
processes, the order clients run in, or whether a run was resumed.
"""

from __future__ import annotations

import zlib
from typing import Union

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
    h = _splitmix64(int(seed) & _MASK)
    for key in keys:
        k = zlib.crc32(key.encode()) if isinstance(key, str) else int(key)
        h = _splitmix64(h ^ (k & _MASK))
    return h & ((1 << 63) - 1)


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
