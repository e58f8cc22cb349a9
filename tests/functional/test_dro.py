"""DRO objectives and FedDRO's estimate (fl_lightning.functional.dro), against hand computations."""

from __future__ import annotations

import math

import pytest
import torch

from fl_lightning.functional.dro import (
    KLDRO,
    ChiSquareDRO,
    NonFiniteEstimateError,
    check_finite,
    objective_value,
    storm_estimate,
    surrogate,
)


def test_storm_estimate_by_hand():
    y_bar, g_cur, g_prev = torch.tensor([2.0]), torch.tensor([5.0]), torch.tensor([1.5])
    assert storm_estimate(y_bar, g_cur, g_prev, beta=0.25).tolist() == [0.75 * 0.5 + 5.0]
    assert storm_estimate(y_bar, g_cur, g_prev, beta=1.0).tolist() == [5.0]  # the plain minibatch value


def test_y_bar_error_decays_geometrically():
    """With exact g values an error delta in y_bar shrinks by (1 - beta) per step."""
    g = [torch.tensor([1.0 + 0.1 * t], dtype=torch.float64) for t in range(6)]
    y = g[0] + 0.5
    for t in range(1, 6):
        y = storm_estimate(y, g[t], g[t - 1], beta=0.3)
        assert float(y - g[t]) == pytest.approx(0.5 * 0.7**t)


def test_kl_terms_outer_and_gradient_by_hand():
    objective = KLDRO(lam=2.0, shift=1.0)
    h, g = objective.terms(torch.tensor([0.0, 4.0], dtype=torch.float16))
    assert h.dtype == g.dtype == torch.float64 and g.shape == (2, 1)
    assert h.tolist() == [0.0, 0.0]
    assert g[:, 0].tolist() == pytest.approx([math.exp(-1.0), math.exp(1.0)])
    y = torch.tensor([math.e], dtype=torch.float64)
    assert float(objective.outer(y)) == pytest.approx(2.0)  # log(e) + shift
    assert objective.outer_grad(y).tolist() == pytest.approx([1 / math.e])
    scaled = KLDRO(lam=2.0, scale_by_lambda=True, shift=1.0)
    assert scaled.scale == 2.0 and float(scaled.outer(y)) == pytest.approx(4.0)


def test_kl_objective_is_log_mean_exp_and_shift_invariant():
    losses = torch.tensor([0.1, 2.0, 5.0])
    exact = 2.0 * math.log(float(torch.exp(losses / 2.0).mean()))
    assert float(objective_value(KLDRO(2.0, scale_by_lambda=True), losses)) == pytest.approx(exact)
    assert float(objective_value(KLDRO(2.0, scale_by_lambda=False), losses)) == pytest.approx(exact / 2.0)
    for shift in (0.0, 3.0):  # the surrogate's gradient does not depend on the shift
        objective = KLDRO(2.0, shift=shift)
        x = torch.tensor([0.1, 2.0, 5.0], requires_grad=True)
        y = objective.terms(x.detach())[1].mean(0)
        surrogate(objective, x, y).backward()
        weights = torch.softmax(x.detach() / 2.0, 0) / 2.0
        assert torch.allclose(x.grad, weights.float(), atol=1e-6)


def test_chi_square_objective_is_mean_plus_variance():
    """The corrected eq. 5: mean(l) + Var(l) / (2 lam), and the surrogate weights (1 + (l - y) / lam) / b."""
    losses = torch.tensor([0.5, 1.0, 3.0], dtype=torch.float64)
    objective = ChiSquareDRO(lam=2.0)
    # mean 1.5, variance (1 + 0.25 + 2.25) / 3 = 7/6
    assert float(objective_value(objective, losses)) == pytest.approx(1.5 + (7 / 6) / 4.0)
    assert float(objective.outer(torch.tensor([3.0]))) == pytest.approx(-9 / 4)
    assert objective.outer_grad(torch.tensor([3.0])).tolist() == pytest.approx([-1.5])
    x = losses.clone().requires_grad_(True)
    surrogate(objective, x, losses.mean().reshape(1)).backward()
    assert x.grad.tolist() == pytest.approx([(1 - 0.5) / 3, (1 - 0.25) / 3, (1 + 0.75) / 3])


def test_kl_guard_keeps_y_bar_above_the_smallest_g():
    objective = KLDRO(1.0, shift=2.0)
    assert float(objective.guard(torch.tensor([-5.0], dtype=torch.float64))) == pytest.approx(math.exp(-2.0))
    assert float(objective.guard(torch.tensor([3.0], dtype=torch.float64))) == 3.0
    chi = ChiSquareDRO()
    assert float(chi.guard(torch.tensor([-5.0]))) == -5.0  # f is defined everywhere


def test_check_finite_names_the_value():
    value = torch.tensor([1.0, 2.0])
    assert check_finite("y_bar", value) is value
    with pytest.raises(NonFiniteEstimateError, match="y_bar is not finite"):
        check_finite("y_bar", torch.tensor([1.0, float("inf")]))
    with pytest.raises(FloatingPointError):
        check_finite("g", torch.tensor([float("nan")]))


@pytest.mark.parametrize(
    "make, match",
    [
        (lambda: KLDRO(lam=0.0), "lam must be > 0, got 0.0"),
        (lambda: KLDRO(shift=math.inf), "shift must be finite"),
        (lambda: ChiSquareDRO(lam=-1.0), "lam must be > 0, got -1.0"),
    ],
)
def test_bad_arguments_fail_clearly(make, match):
    with pytest.raises(ValueError, match=match):
        make()
