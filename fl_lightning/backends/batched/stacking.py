"""Pytrees stacked over the clients of a block: a run's carry (its tensors, stacked along a new
client dimension, and its non-tensor leaves, which must agree over the block)."""

from __future__ import annotations

from typing import Any, Sequence

import torch
from torch import Tensor

from fl_lightning.lightning_compat import tree_flatten


def split_leaves(leaves: list[Any]) -> tuple[list[Tensor], dict[int, Any]]:
    """The tensor leaves, and the other leaves by position."""
    return [x for x in leaves if isinstance(x, Tensor)], {j: x for j, x in enumerate(leaves) if not isinstance(x, Tensor)}


def merge_leaves(tensors: Sequence[Tensor], static: dict[int, Any]) -> list[Any]:
    """The leaves of :func:`split_leaves` put back in order."""
    out, it = [], iter(tensors)
    for j in range(len(tensors) + len(static)):
        out.append(static[j] if j in static else next(it))
    return out


def stack_carries(carries: list[dict[str, Any]]) -> tuple[list[Tensor], Any, dict[int, Any]]:
    """The clients' carries stacked leaf by leaf: (stacked tensors, the pytree spec, the shared non-tensor leaves)."""
    flat = [tree_flatten(c) for c in carries]
    spec = flat[0][1]
    if any(s != spec for _, s in flat[1:]):
        raise ValueError("the clients of a block hold different run values (scratch/state keys or list lengths); "
                         "the batched backend needs the same structure for every client: use client_backend='sequential'")
    tensors, static = split_leaves(flat[0][0])
    for leaves, _ in flat[1:]:
        if split_leaves(leaves)[1] != static:
            raise ValueError(f"the clients of a block hold different non-tensor run values ({split_leaves(leaves)[1]} vs "
                             f"{static}); a batched step reads tensors only: use client_backend='sequential'")
    columns = [split_leaves(leaves)[0] for leaves, _ in flat]
    return [torch.stack(column) for column in zip(*columns)], spec, static
