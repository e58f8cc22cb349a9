"""The batched backend's block bookkeeping: ``stack_carries`` (the carries stacked leaf by leaf,
walked quickly where they are plain dicts, lists and tuples, through ``tree_flatten`` otherwise,
with the same result) and the garbage collector paused for a block."""

from __future__ import annotations

from collections import OrderedDict

import pytest
import torch

from fl_lightning.backends.batched.stacking import plain_leaves, plain_unflattener, stack_carries
from fl_lightning.lightning_compat import tree_flatten, tree_unflatten


def carry(i: int, scratch=None):
    return {"tensors": [torch.full((2, 3), float(i)), torch.full((3,), -float(i))], "opt": [], "start": torch.ones(4) * i,
            "state": {"c": torch.zeros(2) + i}, "scratch": {"k": 3, "v": (torch.tensor(float(i)), None)}
            if scratch is None else scratch}


def test_plain_walk_gives_tree_flattens_leaves_in_order():
    c = carry(1)
    leaves, _ = plain_leaves(c)
    expected, _ = tree_flatten(c)
    assert len(leaves) == len(expected) and all(a is b for a, b in zip(leaves, expected))
    assert plain_leaves({"x": OrderedDict(a=1)}) is None  # another node: the caller falls back


@pytest.mark.parametrize("scratch", [None, OrderedDict(k=3)])
def test_stacked_carries_unflatten_to_each_clients_values(scratch):
    carries = [carry(i, scratch) for i in range(3)]
    tensors, spec, static = stack_carries(carries)
    assert [t.shape[0] for t in tensors] == [3] * len(tensors)
    leaves = tree_flatten(carries[0])[0]
    tensor_positions = [j for j, x in enumerate(leaves) if isinstance(x, torch.Tensor)]
    for i, c in enumerate(carries):
        merged = list(leaves)
        for j, t in zip(tensor_positions, tensors):
            merged[j] = t[i]
        rebuilt = tree_unflatten(merged, spec)
        assert all(torch.equal(a, b) for a, b in zip(rebuilt["tensors"], c["tensors"]))
        assert torch.equal(rebuilt["state"]["c"], c["state"]["c"])


def test_different_structures_or_values_are_refused():
    with pytest.raises(ValueError, match="different run values"):
        stack_carries([carry(0), carry(1, {"k": 3})])
    with pytest.raises(ValueError, match="different non-tensor run values"):
        stack_carries([carry(0, {"k": 3}), carry(1, {"k": 4})])


def test_the_collector_is_paused_for_a_block_and_restored_after():
    import gc

    from fl_lightning.backends.batched.backend import collection_paused

    assert gc.isenabled()
    with pytest.raises(RuntimeError):
        with collection_paused():
            assert not gc.isenabled()
            raise RuntimeError("a failing block")
    assert gc.isenabled()
    gc.disable()
    try:
        with collection_paused():
            assert not gc.isenabled()
        assert not gc.isenabled()  # a collector the user had turned off stays off
    finally:
        gc.enable()


def test_plain_unflattener_rebuilds_what_tree_unflatten_does_and_declines_other_nodes():
    plain = [{"tensors": [torch.ones(2), torch.zeros(1)], "opt": [], "start": torch.ones(3), "state": {},
              "scratch": {"a": (1, None, [torch.ones(1)]), "b": []}}, [1, 2, (3,)], torch.ones(1), ()]
    for tree in plain:
        leaves, spec = tree_flatten(tree)
        rebuilt, expected = plain_unflattener(spec)(leaves), tree_unflatten(leaves, spec)
        assert repr(rebuilt) == repr(expected) and type(rebuilt) is type(expected)
        assert [x is y for x, y in zip(tree_flatten(rebuilt)[0], leaves)] == [True] * len(leaves)
    assert plain_unflattener(tree_flatten({"x": OrderedDict(a=torch.ones(1))})[1]) is None
