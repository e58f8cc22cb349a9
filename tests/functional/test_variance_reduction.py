"""Variance-reduced gradient estimators (fl_lightning.functional.variance_reduction)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from fl_lightning.functional.variance_reduction import (
    full_gradient,
    saga_direction,
    sarah_direction,
    svrg_direction,
)


def test_directions_by_hand():
    g, g_ref, v = torch.tensor([1.0, 2.0]), torch.tensor([0.5, -1.0]), torch.tensor([3.0, 0.0])
    assert svrg_direction(g, g_ref, v).tolist() == [3.5, 3.0]
    assert sarah_direction(g, g_ref, v).tolist() == [3.5, 3.0]
    assert torch.equal(svrg_direction(g_ref, g_ref, v), v)  # at the snapshot SVRG is the full gradient
    assert saga_direction(torch.tensor([3.0]), torch.tensor([1.0]), torch.tensor([0.5])).tolist() == [2.5]
    table = torch.tensor([[1.0, 0.0], [3.0, 2.0]])  # G_j; G_bar = (2, 1)
    assert saga_direction(torch.tensor([0.0, 4.0]), table[1], table.mean(0)).tolist() == [-1.0, 3.0]


def test_full_gradient_weights_chunks_by_size():
    """The mean loss of chunks with means 1, 4 and 2 over 1, 2 and 5 samples: (1 + 8 + 10) / 8."""
    chunks = [(torch.tensor([1.0]), 1), (torch.tensor([3.0, 5.0]), 2), (torch.tensor([0.0, 1.0, 2.0, 3.0, 4.0]), 5)]
    grads = full_gradient(lambda batch: [batch.mean().reshape(1), -batch.mean().reshape(1, 1)], chunks)
    assert [g.dtype for g in grads] == [torch.float32, torch.float32]
    assert grads[0].tolist() == [19 / 8] and grads[1].tolist() == [[-19 / 8]]
    with pytest.raises(ValueError, match="at least one"):
        full_gradient(lambda batch: [batch], [])


def test_full_gradient_from_unequal_chunks_equals_the_one_batch_gradient():
    torch.manual_seed(0)
    model = nn.Linear(3, 2).double()
    x, y = torch.randn(10, 3, dtype=torch.float64), torch.randint(0, 2, (10,))
    params = list(model.parameters())

    def grad(batch):
        return torch.autograd.grad(nn.functional.cross_entropy(model(batch[0]), batch[1]), params)

    whole = grad((x, y))
    chunks = [((x[a:b], y[a:b]), b - a) for a, b in ((0, 3), (3, 4), (4, 10))]
    for part, expected in zip(full_gradient(grad, chunks), whole):
        assert (part.double() - expected).abs().max() < 1e-6
