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
    return SimpleNamespace(aggregated_sizes=lambda: names, device=torch.device("cpu"))


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


def test_geometric_median_callback_weights_by_samples_and_resists_the_outlier():
    updates = _updates()
    gm = GeometricMedian(eps=1e-10, max_iter=1000).aggregate(None, _module({"a": 2, "b": 1}), updates)
    mean = WeightedMean().aggregate(None, SimpleNamespace(aggregated_sizes=lambda: {"a": 2, "b": 1}, device="cpu"), updates)
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
        (lambda: Krum(num_byzantine=-1), "num_byzantine"),
        (lambda: CenteredClipping(tau=-1), "tau"),
    ],
)
def test_aggregator_arguments_are_checked(build, match):
    with pytest.raises(ValueError, match=match):
        build()
