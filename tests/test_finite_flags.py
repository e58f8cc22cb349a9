"""The round's updates read at its end with one device read: ``finite_flags`` checks them for NaN
and Inf together, ``read_metrics`` reads their metrics together."""

from __future__ import annotations

import torch

from fl_lightning.update import ClientUpdate, all_finite, finite_flags, read_metrics


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


def test_rows_of_a_stacked_tensor_are_checked_with_one_reduction_per_stacked_tensor(monkeypatch):
    """A batched block's uploads are rows of one stacked tensor: one reduction for all of them (on a
    GPU, one launch, not one per client), the same flags as checking each row, with the other
    tensors and one device read."""
    calls = []
    aminmax, amin = torch.aminmax, torch.Tensor.amin
    monkeypatch.setattr(torch, "aminmax", lambda t, **kw: calls.append(tuple(t.shape)) or aminmax(t, **kw))
    monkeypatch.setattr(torch.Tensor, "amin", lambda t, *a, **kw: calls.append(tuple(t.shape)) or amin(t, *a, **kw))
    stacked = torch.arange(12.0).reshape(4, 3).clone()  # a tensor of its own (not a view)
    stacked[2, 1] = float("nan")
    scalars = torch.tensor([1.0, float("inf"), 2.0])
    rows, values = stacked.unbind(0), scalars.unbind(0)
    groups = [[rows[i], values[i % 3]] for i in range(4)] + [[torch.ones(2)], [rows[3][1:]]]
    expected = [all(bool(torch.isfinite(t).all()) for t in g) for g in groups]
    assert expected == [True, False, False, True, True, True]
    assert finite_flags(groups) == expected
    assert sorted(calls) == [(2,), (2,), (3, 1), (4, 3)]  # one per stacked tensor; a row's slice is checked alone


def test_row_of_finds_only_whole_rows():
    from fl_lightning.update import row_of

    base = torch.zeros(5, 2, 3)
    assert row_of(base[3])[1] == 3 and row_of(base[3])[0] is base
    assert row_of(base[1, 1]) is None and row_of(base[:, 0]) is None and row_of(base.transpose(0, 1)[0]) is None
    assert row_of(torch.zeros(3)) is None and row_of(base.reshape(10, 3)[2]) is None


def test_the_updates_tensor_metrics_are_read_with_one_read(monkeypatch):
    reads = []
    tolist = torch.Tensor.tolist
    monkeypatch.setattr(torch.Tensor, "tolist", lambda self: reads.append(1) or tolist(self))
    updates = [ClientUpdate(i, 10, {}, {"loss": torch.tensor(0.5 + i, dtype=torch.float64), "steps": 3.0,
                                        "norm": torch.tensor([2.0 * i])}) for i in range(3)]
    updates.append(ClientUpdate(3, 10, {}, {"steps": 1.0}))
    read_metrics(updates)
    assert len(reads) == 1
    assert [u.metrics for u in updates] == [{"loss": 0.5, "steps": 3.0, "norm": 0.0}, {"loss": 1.5, "steps": 3.0, "norm": 2.0},
                                            {"loss": 2.5, "steps": 3.0, "norm": 4.0}, {"steps": 1.0}]
    assert all(type(v) is float for u in updates for v in u.metrics.values())
    read_metrics(updates)  # nothing left to read
    assert len(reads) == 1
