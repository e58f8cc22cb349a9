"""``finite_flags``: the round's updates checked for NaN and Inf together, with one device read."""

from __future__ import annotations

import torch

from fl_lightning.update import all_finite, finite_flags


def test_each_group_is_flagged_with_one_read(monkeypatch):
    reads = []
    tolist = torch.Tensor.tolist
    monkeypatch.setattr(torch.Tensor, "tolist", lambda self: reads.append(1) or tolist(self))
    ok, nan, inf = torch.ones(3), torch.tensor([1.0, float("nan")]), torch.tensor([-float("inf")])
    ints, big = torch.arange(3), torch.tensor([3e38])  # an integer tensor; a float32 near its maximum
    groups = [[ok, ok], [ok, nan], [inf], [], [torch.empty(0)], [ok.double(), ok.half()], [ints, big],
              [ints, torch.tensor([float("inf")], dtype=torch.bfloat16)]]
    assert finite_flags(groups) == [True, False, False, True, True, True, True, False]
    assert len(reads) == 1
    assert finite_flags([[], []]) == [True, True] and len(reads) == 1  # nothing to read


def test_all_finite_is_one_group():
    assert all_finite([torch.zeros(2), torch.ones(1)]) and not all_finite([torch.tensor([float("inf")])])
