"""The robust aggregator callbacks (fl_lightning.callbacks.robust_aggregation) on hand-made updates."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from fl_lightning.callbacks.aggregation import WeightedMean
from fl_lightning.callbacks.robust_aggregation import (
    Bulyan,
    CenteredClipping,
    CoordinateMedian,
    GeometricMedian,
    Krum,
    TrimmedMean,
)
from fl_lightning.update import ClientUpdate


def _module(names):
    return SimpleNamespace(engine=SimpleNamespace(aggregated_sizes=lambda: names), device=torch.device("cpu"))


def _updates():
    rows = [[1.0, 10.0, 0.0], [2.0, 20.0, 1.0], [3.0, 30.0, 2.0], [4.0, 40.0, 3.0], [100.0, -100.0, 1e4]]
    return [ClientUpdate(i, 10 * (i + 1), {"a": torch.tensor(r[:2]), "b": torch.tensor(r[2:])}) for i, r in enumerate(rows)]


@pytest.mark.parametrize(
    "aggregator, expected",
    [
        (CoordinateMedian(), {"a": [3.0, 20.0], "b": [2.0]}),
        (TrimmedMean(num_trimmed=1), {"a": [3.0, 20.0], "b": [2.0]}),
        (TrimmedMean(trim_fraction=0.2), {"a": [3.0, 20.0], "b": [2.0]}),
        (Krum(num_byzantine=1), {"a": [2.0, 20.0], "b": [1.0]}),
        (Bulyan(num_byzantine=0), {"a": [22.0, 0.0], "b": [2001.199951171875]}),  # f = 0: the mean
    ],
)
def test_aggregator_callbacks_concatenate_names_and_split_back(aggregator, expected):
    out = aggregator.aggregate(None, _module({"a": 2, "b": 1}), _updates())
    assert {k: v.tolist() for k, v in out.items()} == expected
    assert all(v.dtype == torch.float32 for v in out.values())


def test_trimmed_mean_drops_at_least_one_upload_at_each_end():
    """Five uploads and the default 10%: floor(0.1 * 5) = 0 would be the plain mean, which lets the
    1e4 outlier through; at least one is dropped at each end."""
    out = TrimmedMean().aggregate(None, _module({"a": 2, "b": 1}), _updates())
    assert {k: v.tolist() for k, v in out.items()} == {"a": [3.0, 20.0], "b": [2.0]}


def test_geometric_median_callback_weights_by_samples_and_resists_the_outlier():
    updates = _updates()
    gm = GeometricMedian(eps=1e-10, max_iter=1000).aggregate(None, _module({"a": 2, "b": 1}), updates)
    mean = WeightedMean().aggregate(None, SimpleNamespace(engine=SimpleNamespace(aggregated_sizes=lambda: {"a": 2, "b": 1}),
                                                             device="cpu"), updates)
    assert float(gm["b"]) < 10 and float(mean["b"]) > 3000
    uniform = GeometricMedian("uniform", eps=1e-10, max_iter=1000).aggregate(None, _module({"a": 2, "b": 1}), updates)
    assert not torch.allclose(uniform["a"], gm["a"])


def test_centered_clipping_keeps_its_centre_in_the_state_dict():
    cc = CenteredClipping(tau=1.0)
    first = cc.aggregate(None, _module({"a": 2, "b": 1}), _updates())
    state = cc.state_dict()
    again = CenteredClipping(tau=1.0)
    again.load_state_dict(state)
    assert torch.equal(again.center, cc.center)
    assert first["a"].norm() <= 1.0 + 1e-6  # from 0, each point moves the centre by <= tau / n


@pytest.mark.parametrize(
    "build, match",
    [
        (lambda: GeometricMedian(weighting="sqrt"), "weighting"),
        (lambda: TrimmedMean(trim_fraction=0.5), "trim_fraction"),
        (lambda: TrimmedMean(trim_fraction=0.0), r"trim_fraction must be in \(0, 0.5\), got 0.0"),
        (lambda: TrimmedMean(num_trimmed=0), "num_trimmed must be >= 1 and an integer, got 0"),
        (lambda: TrimmedMean(num_trimmed=1.5), "num_trimmed must be >= 1 and an integer, got 1.5"),
        (lambda: Krum(num_byzantine=-1), "num_byzantine"),
        (lambda: CenteredClipping(tau=-1), "tau"),
    ],
)
def test_aggregator_arguments_are_checked(build, match):
    with pytest.raises(ValueError, match=match):
        build()


@pytest.mark.parametrize(
    "aggregator, per_round, match",
    [
        (Bulyan(num_byzantine=2), 10, r"Bulyan\(num_byzantine=2\) needs at least 4 \* num_byzantine \+ 3 = 11 uploads "
                                      r"per round; clients_per_round=10"),
        (Krum(num_byzantine=2), 6, r"Krum\(num_byzantine=2\) needs more than 2 \* num_byzantine \+ 2 = 6 uploads per "
                                   r"round; clients_per_round=6"),
        (Krum(num_byzantine=0, num_selected=5), 4, r"Krum\(num_selected=5\) selects more uploads than a round has"),
        (TrimmedMean(), 2, r"TrimmedMean\(trim_fraction=0.1\) drops 1 upload at each end and keeps at least one: it "
                           r"needs at least 3 uploads per round, got 2"),
        (TrimmedMean(num_trimmed=2), 4, r"TrimmedMean\(num_trimmed=2\) drops 2 uploads at each end and keeps at least "
                                        r"one: it needs at least 5 uploads per round, got 4"),
    ],
)
def test_a_round_too_small_for_the_rule_is_refused_before_training(aggregator, per_round, match):
    from fl_lightning.algorithms import FedAvg
    from tests.helpers import synthetic, tiny_client, trainer

    t = trainer(1, callbacks=[aggregator])
    with pytest.raises(ValueError, match=match):
        t.fit(FedAvg(tiny_client(), clients_per_round=per_round, local_steps=1), synthetic(12))
    assert t.current_epoch == 0 and t.global_step == 0  # no client trained


@pytest.mark.parametrize("aggregator", [Bulyan(num_byzantine=1), Krum(num_byzantine=1, num_selected=3)])
def test_bulyan_and_krum_resist_a_scaled_sign_flip_on_the_engine(aggregator):
    """Eight clients per round (all of them), one Byzantine flipping and scaling its delta by 1e3: the
    aggregate stays near the honest clients' (the plain mean is dragged far away)."""
    from fl_lightning.algorithms import FedAvg
    from fl_lightning.callbacks import SignFlipAttack
    from tests.helpers import global_vector, synthetic, tiny_client, trainer

    def run(callbacks):
        torch.manual_seed(0)
        module = FedAvg(tiny_client(), clients_per_round=8, local_steps=2)
        start = global_vector(module)
        trainer(1, callbacks=callbacks).fit(module, synthetic(8))
        return (global_vector(module) - start).norm()

    honest = run([])
    robust = run([SignFlipAttack(count=1, scale=1e3, reference="own", allow_majority=False), aggregator])
    attacked_mean = run([SignFlipAttack(count=1, scale=1e3, reference="own")])
    assert robust < 3 * honest < attacked_mean / 10


@pytest.mark.parametrize(
    "build, match",
    [
        (lambda: Krum(num_byzantine=1.5), r"num_byzantine must be >= 0 and an integer, got 1.5"),
        (lambda: Krum(num_byzantine=True), r"num_byzantine must be >= 0 and an integer, got True"),
        (lambda: Krum(num_byzantine=1, num_selected=2.5), r"num_selected must be >= 1 and an integer, got 2.5"),
        (lambda: Bulyan(num_byzantine=0.5), r"num_byzantine must be >= 0 and an integer, got 0.5"),
        (lambda: GeometricMedian(max_iter=2.5), r"max_iter must be >= 1 and an integer, got 2.5"),
        (lambda: GeometricMedian(eps=float("nan")), r"eps must be > 0 and finite, got nan"),
        (lambda: CenteredClipping(iterations=1.5), r"iterations must be >= 1 and an integer, got 1.5"),
        (lambda: CenteredClipping(tau=float("inf")), r"tau must be > 0 and finite, got inf"),
    ],
)
def test_integer_and_finite_arguments_are_checked_at_construction(build, match):
    with pytest.raises(ValueError, match=match):
        build()


def test_the_functional_rules_check_their_integer_arguments():
    from fl_lightning.functional.robust import bulyan, krum

    points = torch.randn(9, 3, generator=torch.Generator().manual_seed(0))
    with pytest.raises(ValueError, match=r"num_byzantine must be >= 0 and an integer, got 1.5"):
        krum(points, 1.5)
    with pytest.raises(ValueError, match=r"num_selected must be in \[1, 9\] and an integer, got 2.5"):
        krum(points, 1, num_selected=2.5)
    with pytest.raises(ValueError, match=r"num_byzantine must be >= 0 and an integer, got 1.5"):
        bulyan(points, 1.5)


@pytest.mark.parametrize(
    "aggregator, match",
    [
        (Krum(num_byzantine=2), r"Krum\(num_byzantine=2\) needs more than 2 \* num_byzantine \+ 2 = 6 uploads per "
                                r"round; this round has 5"),
        (Krum(num_byzantine=0, num_selected=6), r"Krum\(num_selected=6\) selects more uploads than a round has "
                                                r"\(this round has 5\)"),
        (Bulyan(num_byzantine=1), r"Bulyan\(num_byzantine=1\) needs at least 4 \* num_byzantine \+ 3 = 7 uploads per "
                                  r"round; this round has 5"),
    ],
)
def test_a_round_left_too_small_is_refused_naming_the_rule(aggregator, match):
    """Skipped (non-finite) uploads can leave a round with fewer than clients_per_round uploads."""
    with pytest.raises(ValueError, match=match):
        aggregator.aggregate(None, _module({"a": 2, "b": 1}), _updates())
