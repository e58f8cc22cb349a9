"""``linear_sums`` / ``finish_linear``: the round's linear reductions, as their definitions say, bit for bit."""

from __future__ import annotations

import pytest
import torch

from fl_lightning.update import ClientUpdate, finish_linear, linear_sums

REDUCTIONS = {"delta": (1000, "weighted_mean"), "control": (37, "mean"), "count": (5, "sum")}


def updates(n: int, seed: int) -> list[ClientUpdate]:
    """``n`` updates in no particular client order, of values over many magnitudes (where the
    order and the precision of the sums show in the last bits)."""
    g = torch.Generator().manual_seed(seed)
    return [ClientUpdate(client_id=(7 * i) % 11, num_samples=int(torch.randint(1, 500, (1,), generator=g)),
                         tensors={name: torch.randn(size, generator=g) * 10.0 ** int(torch.randint(-6, 6, (1,), generator=g))
                                  for name, (size, _) in REDUCTIONS.items()})
            for i in range(n)]


def by_definition(ups: list[ClientUpdate], name: str, reduction: str, other: float = 0.0) -> torch.Tensor:
    """The reduction as documented: ``sum_i w_i u_i`` in fp32 in client-id order, widened to
    float64 (plus ``other``, another process's sum), divided there and rounded to fp32."""
    acc = torch.zeros(REDUCTIONS[name][0])
    for u in sorted(ups, key=lambda u: u.client_id):
        acc.add_(u.tensors[name], alpha=float(u.num_samples) if reduction == "weighted_mean" else 1.0)
    denominator = {"weighted_mean": float(sum(u.num_samples for u in ups)), "mean": float(len(ups)), "sum": 1.0}
    return ((acc.double() + other) / denominator[reduction]).float()


@pytest.mark.parametrize("n", [1, 2, 7])
def test_the_reductions_are_their_definitions_bitwise(n):
    ups = updates(n, seed=n)
    sums = linear_sums(ups, REDUCTIONS, torch.device("cpu"))
    assert sums.dtype == torch.float64 and sums[-3:].tolist() == [sum(u.num_samples for u in ups), n, 1.0]
    out = finish_linear(sums, REDUCTIONS)
    for name, (_, reduction) in REDUCTIONS.items():
        assert out[name].dtype == torch.float32
        assert torch.equal(out[name], by_definition(ups, name, reduction))
        assert torch.equal(out[name].view(torch.int32), by_definition(ups, name, reduction).view(torch.int32))


def test_two_processes_sums_add_before_the_division():
    """What the all-reduce hands ``finish_linear``: the sum of the processes' float64 vectors."""
    mine, theirs = updates(3, seed=10), updates(2, seed=11)
    for u in theirs:
        u.client_id += 100
    device = torch.device("cpu")
    out = finish_linear(linear_sums(mine, REDUCTIONS, device) + linear_sums(theirs, REDUCTIONS, device), REDUCTIONS)
    whole = finish_linear(linear_sums(mine + theirs, REDUCTIONS, device), REDUCTIONS)
    for name in REDUCTIONS:  # equal to float tolerance: one process sums in fp32, two partly in float64
        torch.testing.assert_close(out[name], whole[name], rtol=1e-5, atol=1e-6 * float(whole[name].abs().max()))


def test_no_update_gives_nothing_and_no_samples_give_zeros():
    assert finish_linear(linear_sums([], REDUCTIONS, torch.device("cpu")), REDUCTIONS) == {}
    empty = [ClientUpdate(client_id=0, num_samples=0, tensors={n: torch.ones(s) for n, (s, _) in REDUCTIONS.items()})]
    out = finish_linear(linear_sums(empty, REDUCTIONS, torch.device("cpu")), REDUCTIONS)
    assert torch.equal(out["delta"], torch.zeros(1000)) and torch.equal(out["control"], torch.ones(37))
