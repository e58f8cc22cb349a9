"""Robust statistics (fl_lightning.functional.robust) on hand-made examples and against reference minimizers."""

from __future__ import annotations

import pytest
import torch

from fl_lightning.functional.robust import (
    bulyan,
    centered_clipping,
    coordinate_median,
    geometric_median,
    krum,
    krum_scores,
    trim_count,
    trimmed_mean,
    weiszfeld_objective,
)


def _normalized(w: torch.Tensor) -> torch.Tensor:
    return w.double() / w.double().sum()


def _lbfgs_reference(z: torch.Tensor, a: torch.Tensor) -> float:
    """The best objective LBFGS reaches from the mean and from every point (a reference minimizer)."""
    best = float("inf")
    for start in [a @ z] + [p for p in z]:
        y = (start + 1e-3).clone().requires_grad_(True)
        opt = torch.optim.LBFGS([y], max_iter=500, tolerance_grad=1e-12, tolerance_change=1e-14, line_search_fn="strong_wolfe")

        def closure():
            opt.zero_grad()
            f = (a * torch.linalg.vector_norm(z - y, dim=1)).sum()
            f.backward()
            return f

        opt.step(closure)
        best = min(best, weiszfeld_objective(z, a, y.detach()))
    return best


def test_weiszfeld_objective_by_hand():
    z = torch.tensor([[0.0, 0.0], [3.0, 4.0], [0.0, 1.0]])
    a = torch.tensor([0.5, 0.25, 0.25])
    assert weiszfeld_objective(z, a, torch.zeros(2)) == pytest.approx(0.25 * 5 + 0.25 * 1)
    assert weiszfeld_objective(z, a, torch.tensor([0.0, 1.0])) == pytest.approx(0.5 * 1 + 0.25 * (9 + 9) ** 0.5)


@pytest.mark.parametrize("seed", range(4))
def test_geometric_median_matches_a_reference_optimizer(seed):
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(7, 3, generator=g, dtype=torch.float64) * 3
    a = _normalized(torch.rand(7, generator=g, dtype=torch.float64) + 0.1)
    result = geometric_median(z, a, eps=1e-10, max_iter=1000)
    assert result.converged and result.iterations <= 1000
    assert result.objective <= _lbfgs_reference(z, a) + 1e-5


def test_geometric_median_matches_brute_force_grid_search():
    g = torch.Generator().manual_seed(7)
    z = torch.randn(6, 2, generator=g, dtype=torch.float64)
    a = _normalized(torch.rand(6, generator=g, dtype=torch.float64) + 0.1)
    xs = torch.linspace(-3, 3, 601, dtype=torch.float64)
    grid = torch.cartesian_prod(xs, xs)  # step 0.01
    phi = (a * torch.cdist(grid, z)).sum(dim=1)
    best = grid[phi.argmin()]
    result = geometric_median(z, a, eps=1e-12, max_iter=2000)
    assert result.objective <= float(phi.min()) + 1e-12
    assert torch.linalg.vector_norm(result.median - best) < 0.02


def test_one_dimensional_geometric_median_is_the_weighted_median():
    z = torch.tensor([[0.0], [1.0], [2.0], [10.0], [11.0]])
    a = torch.tensor([0.1, 0.15, 0.3, 0.2, 0.25])  # cumulative weight passes 1/2 at z = 2
    result = geometric_median(z, a, eps=1e-12, max_iter=5000)
    assert abs(float(result.median) - 2.0) < 1e-4


def test_a_point_with_more_than_half_the_weight_is_the_minimizer():
    z = torch.tensor([[1.0, 1.0], [5.0, -2.0], [-3.0, 4.0]], dtype=torch.float64)
    a = torch.tensor([0.6, 0.2, 0.2], dtype=torch.float64)
    result = geometric_median(z, a, eps=1e-12, max_iter=5000)
    assert result.objective <= weiszfeld_objective(z, a, z[0]) + 1e-5


def test_collinear_points_give_the_middle_point():
    z = torch.tensor([[0.0, 0.0], [1.0, 1.0], [5.0, 5.0]], dtype=torch.float64)
    result = geometric_median(z, None, eps=1e-14, max_iter=5000)
    assert torch.allclose(result.median, torch.tensor([1.0, 1.0], dtype=torch.float64), atol=1e-4)


def test_geometric_median_is_equivariant():
    g = torch.Generator().manual_seed(1)
    z = torch.randn(9, 4, generator=g, dtype=torch.float64)
    a = _normalized(torch.rand(9, generator=g, dtype=torch.float64) + 0.1)
    q, _ = torch.linalg.qr(torch.randn(4, 4, generator=g, dtype=torch.float64))
    c = torch.randn(4, generator=g, dtype=torch.float64)
    base = geometric_median(z, a, eps=1e-13, max_iter=5000).median
    moved = geometric_median(2.5 * z @ q.T + c, a, eps=1e-13, max_iter=5000).median
    assert torch.allclose(moved, 2.5 * q @ base + c, atol=1e-5)


def test_breakdown_median_stays_with_the_honest_cluster():
    g = torch.Generator().manual_seed(2)
    honest = torch.randn(6, 5, generator=g, dtype=torch.float64) * 0.1 + 1.0
    far = torch.full((4, 5), 1e6, dtype=torch.float64)
    z = torch.cat([honest, far])
    a = _normalized(torch.ones(10))  # Byzantine weight 0.4
    c_alpha = float(a[:6].sum())
    bound = (2 * float((a[:6] * honest.norm(dim=1)).sum()) + 1e-5) / (2 * c_alpha - 1)  # Lemma 3
    median = geometric_median(z, a).median
    assert float(median.norm()) <= bound
    assert float((median - honest.mean(0)).norm()) < 1.0
    mean = a @ z
    assert float(mean.norm()) > 1e5  # the weighted mean breaks down
    heavy = _normalized(torch.tensor([1.0] * 6 + [2.25] * 4))  # Byzantine weight 0.6
    assert float(geometric_median(z, heavy).median.norm()) > 1e5  # above 1/2 it follows the attackers


def test_geometric_median_logs_iterations_and_respects_the_cap():
    z = torch.randn(20, 10, generator=torch.Generator().manual_seed(0))
    result = geometric_median(z, max_iter=2, eps=1e-30)
    assert result.iterations == 2 and not result.converged


@pytest.mark.parametrize(
    "kwargs, match",
    [({"eps": 0}, "eps"), ({"max_iter": 0}, "max_iter"), ({"nu": 0}, "nu"), ({"stop": "never"}, "stop")],
)
def test_geometric_median_rejects_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        geometric_median(torch.zeros(3, 2), **kwargs)


def test_bad_weights_and_shapes_are_rejected():
    with pytest.raises(ValueError, match="weights"):
        geometric_median(torch.zeros(3, 2), torch.tensor([1.0, -1.0, 1.0]))
    with pytest.raises(ValueError, match="points"):
        geometric_median(torch.zeros(3))


HAND = torch.tensor([[1.0, 10.0], [2.0, 20.0], [3.0, 30.0], [4.0, 40.0], [100.0, -100.0]])


def test_coordinate_median_by_hand():
    assert coordinate_median(HAND).tolist() == [3.0, 20.0]
    assert coordinate_median(HAND[:4]).tolist() == [2.5, 25.0]  # even n: mean of the middle two


def test_trimmed_mean_by_hand():
    assert trimmed_mean(HAND, 1).tolist() == [3.0, 20.0]  # drops 1 and 100 / -100 and 40
    assert trimmed_mean(HAND, 0).tolist() == pytest.approx([22.0, 0.0])
    with pytest.raises(ValueError, match="num_trimmed"):
        trimmed_mean(HAND, 3)


@pytest.mark.parametrize("n, fraction, count", [(5, 0.1, 1), (9, 0.1, 1), (10, 0.1, 1), (19, 0.1, 1), (20, 0.1, 2),
                                                (10, 0.25, 2), (3, 0.4, 1)])
def test_trim_count_is_the_floor_but_at_least_one(n, fraction, count):
    assert trim_count(n, fraction) == count


@pytest.mark.parametrize("fraction", [0.0, 0.5, -0.1])
def test_trim_count_refuses_a_fraction_outside_the_open_interval(fraction):
    with pytest.raises(ValueError, match=rf"trim_fraction must be in \(0, 0.5\), got {fraction}"):
        trim_count(10, fraction)


def test_krum_picks_the_most_central_point_and_multi_krum_averages():
    z = torch.tensor([[0.0], [1.0], [2.0], [3.0], [50.0], [60.0]])
    scores = krum_scores(z, num_byzantine=1)  # n - f - 2 = 3 nearest neighbours
    assert scores.tolist()[:4] == [14.0, 6.0, 6.0, 14.0]
    assert krum(z, 1).tolist() == [1.0]  # tie 1 vs 2 broken by the lower index
    assert krum(z, 1, num_selected=4).tolist() == [1.5]
    with pytest.raises(ValueError, match="num_byzantine"):
        krum(z, 2)


def test_bulyan_by_hand():
    """n = 7, f = 1: Krum picks 2, 1, 3, 0, then 50 (with one neighbour, the outlier pair wins);
    per coordinate, the 3 picked values closest to their median 2 are 2, 1, 3."""
    z = torch.tensor([[0.0], [1.0], [2.0], [3.0], [4.0], [50.0], [60.0]])
    assert bulyan(z, 1).tolist() == [2.0]
    two = torch.cat([z, -z], dim=1)  # coordinates are trimmed independently
    assert bulyan(two, 1).tolist() == [2.0, -2.0]
    assert bulyan(z[:3], 0).tolist() == [1.0]  # f = 0: the mean of all (Krum picks everything)
    with pytest.raises(ValueError, match="n >= 4 \\* num_byzantine \\+ 3; got n=6, num_byzantine=1"):
        bulyan(z[:6], 1)


def test_centered_clipping_by_hand():
    z = torch.tensor([[1.0, 0.0], [0.0, 1.0], [100.0, 0.0]])
    v = centered_clipping(z, torch.zeros(2), tau=1.0)
    assert v.tolist() == pytest.approx([2 / 3, 1 / 3])  # the far point moves the centre by at most tau/n
    with pytest.raises(ValueError, match="tau"):
        centered_clipping(z, torch.zeros(2), tau=0.0)
    with pytest.raises(ValueError, match="center"):
        centered_clipping(z, torch.zeros(3), tau=1.0)


def _rising_step_case() -> tuple[torch.Tensor, torch.Tensor]:
    """Points and weights where Weiszfeld's second step with the distance floor ``nu = 0.1`` would
    raise the objective by about 1.2e-3 (found by a search over small random cases, seed 0)."""
    torch.manual_seed(0)
    for trial in range(19):
        n, p = torch.randint(3, 8, ()).item(), torch.randint(1, 4, ()).item()
        z = torch.randn(n, p, dtype=torch.float64)
        if trial % 2:
            z[1] = z[0]
        a = torch.rand(n, dtype=torch.float64)
        a[0] += torch.rand(()).item() * 3
    return z, a / a.sum()


def test_a_step_that_would_raise_the_objective_is_not_reported_as_convergence():
    """With a distance floor (``nu``) Weiszfeld's step can raise the objective: the iteration stops
    at the best iterate, and says it did not converge (it used to report True); the same points
    without the floor converge."""
    z, a = _rising_step_case()
    y = a @ z
    for _ in range(2):  # the two steps from the weighted mean: the second rises by more than eps
        b = a / torch.linalg.vector_norm(z - y, dim=1).clamp_min(0.1)
        y_next = (b @ z) / b.sum()
        rise = weiszfeld_objective(z, a, y_next) - weiszfeld_objective(z, a, y)
        y = y_next
    assert rise > 1e-3
    for stop in ("objective_abs", "objective_rel"):
        stalled = geometric_median(z, a, eps=1e-5, nu=0.1, stop=stop)
        assert stalled.iterations == 2 and not stalled.converged, stop
        assert stalled.objective <= weiszfeld_objective(z, a, a @ z)
    assert geometric_median(z, a, eps=1e-5, nu=1e-8, max_iter=1000).converged
