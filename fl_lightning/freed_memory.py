"""Giving the memory the process freed back to the system, so that its resident memory follows what it holds.

A long federation allocates and frees tensors every round: client state read back from files,
new entries, updates, the clients' data. glibc keeps freed blocks below its mmap threshold (128 KiB
to 32 MiB) in its heaps, and gives a heap's memory back only from its top: a block that a longer-lived
allocation sits above stays resident, free, for good. Measured on a 10,000-client SCAFFOLD run (71 KiB
entries, 100 clients a round, ``client_state_memory`` 16 MiB): the store held 16 MiB, the process grew
471 MiB in 100 rounds (FedAvg's run, with no client state, 109 MiB), all of it free memory that
glibc's ``malloc_trim(0)`` gives back. Allocating the entries themselves outside the heap (one
mapping each) does not help (450 MiB): the heap fills with the round's short-lived blocks, split
by the long-lived small ones.

:class:`FreedMemory` calls ``malloc_trim(0)`` (which releases every whole free page of every heap,
wherever it lies) when the process's resident memory has grown by more than an allowance since it
last did: checking costs one read of ``/proc/self/statm`` (15-20 us), a trim 2-50 ms (more in a
larger heap), so it trims rarely (40 times in that run's 300 rounds, with a 32 MiB allowance: it
grew by 136 MiB at most instead of 653, ``benchmarks/scale.py``), and
never while the process's memory stays level (as in a sweep that keeps its freed memory for the
next round: ``experiments/sweep.py``'s ``keep_freed_memory``).
Where there is no glibc or no ``/proc`` (macOS, musl, Windows) it does nothing.
"""

from __future__ import annotations

import ctypes
import functools
import os
from typing import Callable, Optional


def resident_bytes() -> Optional[int]:
    """The process's resident memory in bytes (``/proc/self/statm``), or None where it cannot be read."""
    try:
        with open("/proc/self/statm", "rb") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError, AttributeError):
        return None


@functools.cache
def malloc_trim() -> Optional[Callable[[int], int]]:
    """glibc's ``malloc_trim``, or None where the C library has none (or cannot be loaded)."""
    try:
        return ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError, TypeError):
        return None


class FreedMemory:
    """Gives the memory the process freed back to the system (:func:`malloc_trim`'s ``malloc_trim(0)``)
    each time its resident memory has grown by more than an allowance over the least it was at since
    the last time. Holds only numbers (a module holding it pickles)."""

    def __init__(self) -> None:
        self._least: Optional[int] = None  # the least resident memory seen since the last trim

    def give_back(self, allowance: int) -> bool:
        """Give the freed memory back if the resident memory grew by more than ``allowance`` bytes;
        whether it did."""
        trim = malloc_trim()
        now = None if trim is None else resident_bytes()
        if now is None:
            return False
        if self._least is not None and now - self._least > allowance:
            trim(0)
            self._least = resident_bytes()
            return True
        self._least = now if self._least is None else min(self._least, now)
        return False
