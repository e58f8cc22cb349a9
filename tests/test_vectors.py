"""A flat state vector's named views (``Layout.params_of``, ``Layout.buffers_of``): the parameters' and the
floating buffers' entries, as views that write through, also of a stack of vectors."""

from __future__ import annotations

import torch
from torch import nn

from fl_lightning.vectors import ModelVector


def layout_of_a_model_with_buffers() -> tuple[ModelVector, int, int]:
    model = nn.Sequential(nn.Linear(3, 2), nn.BatchNorm1d(2))  # 6 + 2 + 2 + 2 parameters, 2 + 2 floating buffers
    vector = ModelVector(model)
    return vector, vector.num_params, vector.dim


def test_the_views_are_the_parameters_and_the_buffers():
    model, p, dim = layout_of_a_model_with_buffers()
    assert (p, dim) == (12, 16)
    state = model.flatten()
    assert torch.equal(model.layout.params_of(state), torch.cat([t.reshape(-1) for t in model.params]))
    buffers = model.tensors[len(model.params):]
    assert torch.equal(model.layout.buffers_of(state), torch.cat([t.reshape(-1) for t in buffers]))


def test_the_views_write_through():
    model, p, dim = layout_of_a_model_with_buffers()
    state = torch.zeros(dim)
    model.layout.params_of(state).add_(1.0)
    model.layout.buffers_of(state).sub_(2.0)
    assert torch.equal(state, torch.cat([torch.ones(p), torch.full((dim - p,), -2.0)]))


def test_rows_of_a_stack_are_viewed_alike():
    model, p, dim = layout_of_a_model_with_buffers()
    stack = torch.arange(3 * dim, dtype=torch.float32).view(3, dim)
    assert torch.equal(model.layout.params_of(stack), stack[:, :p])
    assert torch.equal(model.layout.buffers_of(stack), stack[:, p:])
