"""Proximal terms (fl_lightning.functional.prox): FedProx's and FedDeper's gradients, the prox map."""

from __future__ import annotations

import pytest
import torch

from fl_lightning.functional.prox import (
    depersonalization_gradient,
    depersonalization_strength,
    prox_step,
    proximal_gradient,
)


def test_proximal_gradient_by_hand():
    grads = [torch.tensor([1.0, -1.0]), torch.tensor([[0.5]])]
    params = [torch.tensor([3.0, 0.0]), torch.tensor([[2.0]])]
    anchor = [torch.tensor([1.0, 1.0]), torch.tensor([[2.0]])]
    out = proximal_gradient(grads, params, anchor, mu=0.5)
    assert [t.tolist() for t in out] == [[2.0, -1.5], [[0.5]]]  # g + 0.5 (w - anchor)
    assert all(torch.equal(a, b) for a, b in zip(proximal_gradient(grads, params, anchor, 0.0), grads))


def test_proximal_gradient_is_the_gradient_of_the_penalized_loss():
    torch.manual_seed(0)
    w, anchor = torch.randn(4, requires_grad=True), torch.randn(4)
    loss = (w**3).sum()
    (g,) = torch.autograd.grad(loss, [w], retain_graph=True)
    (total,) = torch.autograd.grad(loss + 0.35 * (w - anchor).pow(2).sum(), [w])  # mu/2 = 0.35
    assert torch.allclose(proximal_gradient([g], [w.detach()], [anchor], 0.7)[0], total)


def test_depersonalization_by_hand():
    g, y, v, x = torch.tensor([1.0, 0.0]), torch.tensor([2.0, 1.0]), torch.tensor([0.0, 3.0]), torch.tensor([1.0, 1.0])
    (out,) = depersonalization_gradient([g], [y], [v], [x], strength=2.0)
    assert out.tolist() == [1.0, 4.0]  # g + 2 (y + v - 2x) = (1, 0) + 2 (0, 2)
    assert depersonalization_strength(0.03, 0.01) == pytest.approx(3.0)
    # it is FedProx's gradient with the anchor 2x - v
    (prox,) = proximal_gradient([g], [y], [2 * x - v], 2.0)
    assert torch.allclose(out, prox)


def test_depersonalization_gradient_is_the_regularizer_gradient():
    """``g + s (y + v - 2x)`` per parameter tensor, = g + autograd of ``s/2 ||v + y - 2x||^2``."""
    torch.manual_seed(0)
    ys = [torch.nn.Parameter(torch.randn(3, 2)), torch.nn.Parameter(torch.randn(4))]
    vs = [torch.randn(3, 2), torch.randn(4)]
    x = torch.randn(10)
    loss = sum((y ** 2).sum() for y in ys)  # any loss: the pull adds to its gradient
    loss.backward()
    loss_grads = [y.grad.clone() for y in ys]
    xs = [x[:6].view(3, 2), x[6:]]
    with torch.no_grad():
        pulled = depersonalization_gradient(loss_grads, ys, vs, xs, strength=3.0)
    reference = [y.detach().clone().requires_grad_(True) for y in ys]
    flat = torch.cat([(r + v).reshape(-1) for r, v in zip(reference, vs)])
    (1.5 * (flat - 2 * x).pow(2).sum()).backward()
    for p, g, r in zip(pulled, loss_grads, reference):
        assert torch.allclose(p, g + r.grad, atol=1e-6)


def test_prox_step_by_hand():
    x, anchor = torch.tensor([4.0, -2.0]), torch.tensor([1.0, 1.0])
    assert prox_step(x, anchor, lr=0.5, mu=2.0).tolist() == [2.5, -0.5]  # (x + anchor) / 2
    assert prox_step(x, anchor, lr=0.5, mu=0.0) is x


def test_prox_step_is_the_argmin_of_its_objective():
    g = torch.Generator().manual_seed(0)
    x, anchor = torch.randn(5, generator=g, dtype=torch.float64), torch.randn(5, generator=g, dtype=torch.float64)
    lr, mu = 0.3, 2.0
    w = x.clone()
    for _ in range(500):  # gradient descent on mu/2 |w - anchor|^2 + 1/(2 lr) |w - x|^2
        w -= 0.1 * (mu * (w - anchor) + (w - x) / lr)
    closed = prox_step(x, anchor, lr, mu)
    assert (closed - w).abs().max() < 1e-8
    assert torch.allclose((closed - anchor).norm(), (x - anchor).norm() / (1 + lr * mu))
    assert torch.allclose(prox_step(anchor, anchor, lr, mu), anchor)
