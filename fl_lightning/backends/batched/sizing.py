"""How many clients a vectorized block holds when the user leaves it to the engine
(``clients_per_block=None``): every client of the round, as far as memory allows."""

from __future__ import annotations

import os
from typing import Optional

import torch

#: the share of the device's free memory a block's stacked client tensors may take
MEMORY_SHARE = 0.25


def free_memory(device: torch.device) -> Optional[int]:
    """Bytes free on ``device``: the CUDA allocator's view of the GPU, the host's available physical
    memory for the CPU (where the OS says it), None where neither is known."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    if device.type == "cpu":
        try:
            return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        except (AttributeError, ValueError, OSError):  # not a POSIX system that reports it
            return None
    return None


def block_size(clients: int, client_bytes: int, free: Optional[int], share: float = MEMORY_SHARE) -> int:
    """Clients per block for ``clients`` clients a round (this process's), each holding
    ``client_bytes`` in the block: all of them, or as many as fit in ``share`` of ``free`` bytes
    (at least 1; ``free=None``: no bound).

    >>> block_size(50, 4 * 10**6, 8 * 10**9)
    50
    >>> block_size(1000, 4 * 10**8, 8 * 10**9)
    5
    """
    if clients < 1 or client_bytes < 0:
        raise ValueError(f"need clients >= 1 and client_bytes >= 0, got clients={clients}, client_bytes={client_bytes}")
    if free is None or client_bytes == 0:
        return clients
    return max(1, min(clients, int(share * free) // client_bytes))
