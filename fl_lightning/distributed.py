"""The few collectives a federation needs, as no-ops in a single process.

A mean aggregate is one all-reduce per round; a robust aggregate one all-gather of the
round's updates. Both work with any initialized ``torch.distributed`` process group (gloo on
CPU, NCCL on GPU).
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from fl_lightning.update import ClientUpdate


def is_distributed() -> bool:
    """Whether a process group with more than one process is running."""
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def rank_and_world() -> tuple[int, int]:
    """(rank, world size) of this process; (0, 1) without a process group."""
    if is_distributed():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def all_reduce_sum(tensor: Tensor) -> Tensor:
    """The sum of ``tensor`` over processes (in place; returned for chaining)."""
    if is_distributed():
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
    return tensor


def all_gather_object(obj: Any) -> list[Any]:
    """Every process's ``obj``, in rank order."""
    if not is_distributed():
        return [obj]
    out: list = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def map_clients(fn: Callable[[int], Any], client_ids: Sequence[int]) -> dict[int, Any]:
    """``{client: fn(client)}`` for ``client_ids``, leaving out clients where ``fn`` gives None.

    Each process computes its share (:func:`my_clients`) and every process receives the whole
    mapping (:func:`gather_clients`): per-client evaluations cost 1/world each.
    """
    return gather_clients({cid: value for cid in my_clients(client_ids) if (value := fn(cid)) is not None})


def my_clients(client_ids: Sequence[int]) -> list[int]:
    """This process's share of ``client_ids``: ``client_ids[rank::world]``."""
    rank, world = rank_and_world()
    return list(client_ids[rank::world])


def gather_clients(mine: dict[int, Any]) -> dict[int, Any]:
    """Every process's per-client values (each its :func:`my_clients`' share), on every process
    (one ``all_gather_object``)."""
    merged: dict[int, Any] = {}
    for part in all_gather_object(mine):
        merged.update(part)
    return merged


def gather_updates(updates: list[ClientUpdate]) -> list[ClientUpdate]:
    """The round's updates from every process, on every process, sorted by client id.

    Tensors are exchanged with one padded ``all_gather`` per tensor name; ids, sample counts
    and metrics travel as small objects.
    """
    if not is_distributed():
        return sorted(updates, key=lambda u: u.client_id)
    meta = all_gather_object([(u.client_id, u.num_samples, u.metrics) for u in updates])
    names = all_gather_object({k: (v.shape, v.dtype) for k, v in updates[0].tensors.items()} if updates else None)
    spec = next((n for n in names if n is not None), None)
    if spec is None:
        return []
    most = max(len(m) for m in meta)
    device = _collective_device()
    stacked: dict[str, list[Tensor]] = {}
    for name, (shape, dtype) in spec.items():
        local = torch.zeros((most, *shape), dtype=dtype, device=device)
        for i, u in enumerate(updates):
            local[i] = u.tensors[name].to(device)
        parts = [torch.empty_like(local) for _ in range(dist.get_world_size())]
        dist.all_gather(parts, local)
        stacked[name] = parts
    out = []
    for r, entries in enumerate(meta):
        for i, (cid, n, metrics) in enumerate(entries):
            out.append(ClientUpdate(cid, n, {k: v[r][i] for k, v in stacked.items()}, metrics))
    return sorted(out, key=lambda u: u.client_id)


def _collective_device() -> torch.device:
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
