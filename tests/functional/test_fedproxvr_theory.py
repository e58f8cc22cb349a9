"""FedProxVR's theory calculator (fl_lightning.functional.fedproxvr_theory): Lemma 1's bounds,
Theorem 1's constant, problem (23) (the paper's Fig. 1).

The reference values of problem (23) are the spec's independent calibration (§6, C10: a grid
solve at resolution ~0.1, L = 1, lam = 0.5)."""

from __future__ import annotations

import math

import pytest

import torch

from fl_lightning.functional.fedproxvr_theory import (
    achieved_local_accuracy,
    local_accuracy,
    optimal_parameters,
    rate_constant,
    sarah_steps_upper_bound,
    steps_lower_bound,
    svrg_min_a,
    svrg_steps_upper_bound,
)

GAMMAS = (1e-4, 1e-3, 1e-2, 1e-1, 1.0)
#: sigma2 -> (beta*, mu*) per gamma, spec C10
REFERENCE = {
    0.0: ((43.3, 22.6, 15.1, 13.0, 12.7), (11.5, 12.8, 14.1, 14.9, 15.0)),
    1.0: ((48.0, 27.0, 19.4, 17.7, 17.4), (19.0, 20.8, 22.3, 23.0, 23.2)),
}
THETA_SIGMA0 = (0.11, 0.17, 0.24, 0.29, 0.29)


def test_lemma1_bounds():
    assert sarah_steps_upper_bound(7) == pytest.approx(27.125)
    assert svrg_min_a(10) == pytest.approx(183.9, abs=0.05)
    assert svrg_min_a(20) == pytest.approx(344.0, abs=0.05)
    a = svrg_min_a(10)
    assert a - 4 == pytest.approx(4 * (a * 11) ** 0.5)  # the side condition holds with equality
    # the paper's settings (beta <= 10) are outside SVRG's analysis at tau = 10 or 20
    assert all(svrg_steps_upper_bound(beta, tau) < 0 for beta in (5, 7, 9, 10) for tau in (10, 20))


def test_formulas_by_hand():
    # Lemma 1 at beta = 5, mu = 2, theta = 1/2 (L = 1, lam = 1/2): 3 (25 + 4) / (1/4 * 3/2 * 1 * 2)
    assert steps_lower_bound(5.0, 2.0, 0.5) == pytest.approx(116.0)
    # eq. (22): sqrt(24 (25 + 4) / (3/2 * 1 * (125 - 20) * 2))
    assert local_accuracy(5.0, 2.0) == pytest.approx(math.sqrt(696 / 315))
    # eq. (14) at beta = 20, tau = 0: a = (2 + 2 sqrt 2)^2, (5 * 400 - 80) / 8 / a - 2
    assert svrg_steps_upper_bound(20.0, 0.0) == pytest.approx(240 / (2 + 2 * math.sqrt(2)) ** 2 - 2)
    # Theorem 1 at mu = 20, theta = 0.1, sigma2 = 0: mu_bar = 19.5, spread = 1.01
    theta = 1 - 0.1 * math.sqrt(2) - 2 / 19.5 * math.sqrt(1.01) - 2 * 20 / 19.5**2 * 1.01
    assert rate_constant(20.0, 0.1) == pytest.approx(theta / 20)
    # L = 1/2, lam = 1, sigma2 = 1, theta = 0: mu_bar = 1, spread = 2; a negative Theta is returned as is
    assert rate_constant(2.0, 0.0, smoothness=0.5, lam=1.0, sigma2=1.0) == pytest.approx((1 - math.sqrt(2) - 4) / 2)


def test_eq22_makes_the_lower_bound_meet_the_upper_bound():
    """theta from eq. (22) is the accuracy at which Lemma 1's two bounds coincide (eqs. 15-16)."""
    for beta, mu in ((12.0, 15.0), (40.0, 11.0), (5.0, 2.0)):
        theta = local_accuracy(beta, mu)
        if theta < 1:
            assert steps_lower_bound(beta, mu, theta) == pytest.approx(sarah_steps_upper_bound(beta))


@pytest.mark.parametrize("sigma2", [0.0, 1.0])
def test_problem23_matches_the_calibration_and_the_papers_trends(sigma2):
    solutions = [optimal_parameters(g, sigma2=sigma2) for g in GAMMAS]
    betas, mus = REFERENCE[sigma2]
    for s, beta, mu in zip(solutions, betas, mus):
        assert s.beta == pytest.approx(beta, rel=0.02)
        assert s.mu == pytest.approx(mu, rel=0.02)
        assert 0 < s.theta < 1 and s.rate > 0
        assert s.rate == pytest.approx(rate_constant(s.mu, s.theta, sigma2=sigma2))
        assert s.tau == pytest.approx(sarah_steps_upper_bound(s.beta))
    if sigma2 == 0.0:
        assert [round(s.theta, 2) for s in solutions] == pytest.approx(THETA_SIGMA0, abs=0.011)
    # Sec. 4.3: as computation gets dearer (gamma up) the optimal beta and tau fall and mu rises
    assert all(a.beta > b.beta and a.tau > b.tau and a.mu < b.mu for a, b in zip(solutions, solutions[1:]))


def test_more_dissimilarity_needs_more_penalty_and_converges_slower():
    for gamma in (1e-3, 1e-1):
        a, b = optimal_parameters(gamma, sigma2=0.0), optimal_parameters(gamma, sigma2=1.0)
        assert b.mu > a.mu and b.beta > a.beta and b.theta < a.theta and b.rate < a.rate


@pytest.mark.parametrize(
    "call,match",
    [
        (lambda: steps_lower_bound(3.0, 1.0, 0.5), "beta must be > 3"),
        (lambda: steps_lower_bound(10.0, 0.4, 0.5), "mu must exceed"),
        (lambda: steps_lower_bound(10.0, 1.0, 1.5), "theta must be in"),
        (lambda: rate_constant(0.5, 0.1), "mu must exceed"),
        (lambda: svrg_min_a(-1), "tau must be >= 0"),
        (lambda: optimal_parameters(-1.0), "gamma must be >= 0"),
        (lambda: optimal_parameters(0.1, sigma2=1e6), "no feasible"),
    ],
)
def test_invalid_input(call, match):
    with pytest.raises(ValueError, match=match):
        call()


def test_the_achieved_local_accuracy_is_the_surrogate_gradient_norm_over_the_first():
    anchor = [torch.tensor([1.0, 2.0]), torch.tensor([[0.0]])]
    grad_anchor = [torch.tensor([3.0, 0.0]), torch.tensor([[4.0]])]  # norm 5
    assert float(achieved_local_accuracy(grad_anchor, anchor, anchor, grad_anchor, mu=2.0)) == 1.0  # w_n = w_bar
    end = [torch.tensor([1.5, 2.0]), torch.tensor([[-1.0]])]
    grad_end = [torch.tensor([0.0, 1.0]), torch.tensor([[0.5]])]
    # grad J = grad F(w_n) + 2 (w_n - w_bar) = (1, 1, -1.5): norm sqrt(4.25)
    theta = achieved_local_accuracy(grad_end, end, anchor, grad_anchor, mu=2.0)
    assert theta.dim() == 0 and float(theta) == pytest.approx(math.sqrt(4.25) / 5)
