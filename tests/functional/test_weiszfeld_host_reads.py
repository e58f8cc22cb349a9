"""geometric_median reads its stopping decision once per chunk of iterations, with the result of the
per-iteration loop it replaced (kept below as the oracle, with the truthful ``converged`` flag: a
step that would raise the objective beyond the tolerance stops the loop unconverged), bit for bit."""

from __future__ import annotations

import math

import pytest
import torch

from fl_lightning.functional import robust
from fl_lightning.functional.robust import STOP_RULES, GeometricMedianResult, _check_points, geometric_median


def _per_iteration_reference(points, weights=None, eps=1e-5, max_iter=100, nu=1e-8, stop="objective_abs"):
    """The loop as it was before chunking: the host decides after every iteration whether to stop."""

    def objective(z, a, y):
        return float((a.double() * torch.linalg.vector_norm(z.double() - y.double(), dim=1)).sum())

    z, a = _check_points(points, weights)
    y = a @ z
    f = objective(z, a, y)
    for it in range(1, max_iter + 1):
        dist = torch.linalg.vector_norm(z - y, dim=1).clamp_min(nu)
        beta = a / dist
        y_new = (beta @ z) / beta.sum()
        f_new = objective(z, a, y_new)
        if stop == "objective_abs":
            done = abs(f - f_new) <= eps
        elif stop == "objective_rel":
            done = abs(f - f_new) <= eps * f_new
        else:
            done = float(torch.linalg.vector_norm(y_new - y)) <= eps
        if f_new <= f:
            y, f = y_new, f_new
        elif not done:  # the step would raise the objective by more than the tolerance: stalled
            return GeometricMedianResult(y, f, it, False)
        if done:
            return GeometricMedianResult(y, f, it, True)
    return GeometricMedianResult(y, f, max_iter, False)


def _assert_same(got: GeometricMedianResult, want: GeometricMedianResult) -> None:
    assert torch.equal(got.median, want.median)
    assert got.median.dtype == want.median.dtype and got.median.shape == want.median.shape
    assert type(got.objective) is float and got.objective == want.objective
    assert type(got.iterations) is int and got.iterations == want.iterations
    assert type(got.converged) is bool and got.converged == want.converged


def _points(seed: int, n: int, p: int, weighted: bool):
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(n, p, generator=g, dtype=torch.float32)
    z[: max(1, n // 5)] += 50.0 * torch.randn(p, generator=g)  # a cluster of outliers
    weights = torch.rand(n, generator=g) + 0.1 if weighted else None
    return z, weights


CASES = [(seed, n, p, weighted) for seed, (n, p) in enumerate([(3, 2), (7, 5), (20, 10), (50, 33)]) for weighted in (False, True)]


@pytest.mark.parametrize("stop", STOP_RULES)
@pytest.mark.parametrize("seed, n, p, weighted", CASES)
def test_chunked_loop_equals_the_per_iteration_loop(stop, seed, n, p, weighted):
    z, weights = _points(seed, n, p, weighted)
    outcomes = set()
    for eps in (1e-1, 1e-4, 1e-8, 1e-30):
        for max_iter in (1, 3, 8, 13, 100):
            want = _per_iteration_reference(z, weights, eps=eps, max_iter=max_iter, stop=stop)
            outcomes.add((want.converged, want.iterations == 1))
            for check_every in (1, 3, 8):
                got = geometric_median(z, weights, eps=eps, max_iter=max_iter, stop=stop, check_every=check_every)
                _assert_same(got, want)
            _assert_same(geometric_median(z, weights, eps=eps, max_iter=max_iter, stop=stop), want)
    assert (False, False) in outcomes and (True, False) in outcomes  # some hit the cap, some stop early


@pytest.mark.parametrize("stop", STOP_RULES)
def test_convergence_at_the_first_iteration(stop):
    z = torch.tensor([[0.0, 0.0], [1.0, 0.0], [0.0, 1.0], [1.0, 1.0]])  # the mean is the median
    want = _per_iteration_reference(z, stop=stop)
    assert want.converged and want.iterations == 1
    _assert_same(geometric_median(z, stop=stop), want)


@pytest.mark.parametrize("stop", STOP_RULES)
def test_a_step_that_raises_the_objective_is_rejected_and_stops_the_loop(stop):
    """The uphill step is not taken and the loop stops, reporting no convergence (RAGA issue, item 4)."""
    z = torch.randn(5, 2, generator=torch.Generator().manual_seed(2))  # with nu = 1 the first step goes uphill
    want = _per_iteration_reference(z, eps=1e-30, nu=1.0, stop=stop)
    assert not want.converged and want.iterations == 1 and torch.equal(want.median, torch.full((5,), 0.2, dtype=torch.float64) @ z.double())
    _assert_same(geometric_median(z, eps=1e-30, nu=1.0, stop=stop), want)


def test_the_host_reads_the_decision_once_per_chunk(monkeypatch):
    reads = []
    read = robust._read_state
    monkeypatch.setattr(robust, "_read_state", lambda state: reads.append(1) or read(state))
    z, weights = _points(2, 20, 10, True)
    for stop in STOP_RULES:
        for eps, max_iter in ((1e-4, 100), (1e-30, 13), (1e-30, 16), (1e-1, 5)):
            for check_every in (1, 3, 8):
                reads.clear()
                result = geometric_median(z, weights, eps=eps, max_iter=max_iter, stop=stop, check_every=check_every)
                assert len(reads) == math.ceil(result.iterations / check_every)


@pytest.mark.parametrize("check_every", [0, 2.5, True])
def test_check_every_must_be_a_positive_integer(check_every):
    with pytest.raises(ValueError, match="check_every must be >= 1 and an integer"):
        geometric_median(torch.zeros(3, 2), check_every=check_every)
