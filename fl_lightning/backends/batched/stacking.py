"""Pytrees stacked over the clients of a block: a run's carry (its tensors, stacked along a new
client dimension, and its non-tensor leaves, which must agree over the block)."""

from __future__ import annotations

from typing import Any, Callable, Iterator, Optional, Sequence

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
    """The clients' carries stacked leaf by leaf: (stacked tensors, the pytree spec, the shared non-tensor leaves).

    Only the first carry goes through ``tree_flatten`` (for the spec): the others are walked by
    :func:`plain_leaves`, which a block of a thousand clients needs (a generic flatten costs about a
    tenth of a millisecond per carry), unless a carry holds a node other than a plain dict, list or tuple."""
    leaves, spec = tree_flatten(carries[0])
    walked = [plain_leaves(c) for c in carries]
    if any(w is None for w in walked) or not _same_leaves(walked[0][0], leaves):  # type: ignore[index]
        flat = [(leaves, spec)] + [tree_flatten(c) for c in carries[1:]]
    else:
        flat = walked  # type: ignore[assignment]
    if any(structure != flat[0][1] for _, structure in flat[1:]):
        raise ValueError("the clients of a block hold different run values (scratch/state keys or list lengths); "
                         "the batched backend needs the same structure for every client: use client_backend='sequential'")
    split = [split_leaves(leaves) for leaves, _ in flat]
    static = split[0][1]
    for _, other in split[1:]:
        if other != static:
            raise ValueError(f"the clients of a block hold different non-tensor run values ({other} vs "
                             f"{static}); a batched step reads tensors only: use client_backend='sequential'")
    return [torch.stack(column) for column in zip(*(tensors for tensors, _ in split))], spec, static


#: the leaves :func:`plain_leaves` knows (``tree_flatten`` also takes them as leaves)
_LEAF_TYPES = (int, float, bool, str, type(None))


def plain_leaves(tree: Any) -> Optional[tuple[list[Any], tuple]]:
    """The leaves of a pytree of plain dicts, lists and tuples in ``tree_flatten``'s order, and its
    structure (a tuple that compares equal for equal structures); None where it holds another node."""
    leaves: list[Any] = []
    structure: list[Any] = []
    return (leaves, tuple(structure)) if _walk(tree, leaves, structure) else None


def _walk(tree: Any, leaves: list[Any], structure: list[Any]) -> bool:
    kind = type(tree)
    if kind is dict:
        structure.append((dict, tuple(tree)))
        return all(_walk(value, leaves, structure) for value in tree.values())
    if kind is list or kind is tuple:
        structure.append((kind, len(tree)))
        return all(_walk(value, leaves, structure) for value in tree)
    if isinstance(tree, Tensor) or kind in _LEAF_TYPES:
        leaves.append(tree)
        structure.append(None)
        return True
    return False


def _same_leaves(a: list[Any], b: list[Any]) -> bool:
    """Whether two leaf lists hold the same objects (the walk agrees with ``tree_flatten`` here)."""
    return len(a) == len(b) and all(x is y for x, y in zip(a, b))


def plain_unflattener(spec: Any) -> Optional[Callable[[Sequence[Any]], Any]]:
    """A function that rebuilds ``tree_unflatten(leaves, spec)`` from ``leaves``, for a spec of plain
    dicts, lists and tuples (None for any other node): built once per block, it spares each of a
    thousand clients the generic unflatten's per-node dispatch (:func:`plain_leaves`' counterpart)."""
    build = _builder(spec)
    return None if build is None else (lambda leaves: build(iter(leaves)))


def _builder(spec: Any) -> Optional[Callable[[Iterator[Any]], Any]]:
    if spec.is_leaf():
        return next
    children = spec.children() if callable(getattr(spec, "children", None)) else spec.children_specs
    builders = [_builder(child) for child in children]
    if any(b is None for b in builders):
        return None
    if spec.type is dict:
        keys = list(spec.context)
        return lambda it: {key: build(it) for key, build in zip(keys, builders)}
    if spec.type is list:
        return lambda it: [build(it) for build in builders]
    if spec.type is tuple:
        return lambda it: tuple(build(it) for build in builders)
    return None
