"""DifferentialPrivacy: clipping, central and local Gaussian noise keyed by (seed, round[, client]),
the uniform mean it needs, and the reported (epsilon, delta)."""

from __future__ import annotations

import importlib.util
import math

import pytest
import torch

from fl_lightning.algorithms import RFA, SCAFFOLD, FedAvg
from fl_lightning.callbacks import DifferentialPrivacy, FederatedCallback, WeightedMean
from fl_lightning.callbacks.privacy import dp_epsilon
from fl_lightning.functional.privacy import clip_update, gaussian_noise
from fl_lightning.seeding import generator
from tests.helpers import global_vector, synthetic, tiny_client, trainer

HAS_OPACUS = importlib.util.find_spec("opacus") is not None


class Uploads(FederatedCallback):
    """Records the updates as the aggregator receives them (after the other callbacks)."""

    def on_round_updates(self, trainer, module, updates):
        self.updates = {u.client_id: u.tensors["delta"].clone() for u in updates}
        return updates


def test_clip_update_bounds_the_joint_norm():
    tensors = {"a": torch.tensor([3.0, 0.0]), "b": torch.tensor([4.0])}
    clipped = clip_update(tensors, 1.0)
    assert math.isclose(float(torch.cat(list(clipped.values())).norm()), 1.0, rel_tol=1e-6)
    assert torch.equal(clip_update(tensors, 10.0)["a"], tensors["a"])  # within the bound: unchanged


def run(dp, rounds=1, seed=3):
    recorder = Uploads()
    module = FedAvg(tiny_client(), clients_per_round=4, local_steps=3, seed=seed)
    x0 = global_vector(module)
    t = trainer(rounds, callbacks=[dp, recorder, WeightedMean("uniform")])
    t.fit(module, synthetic(6))
    return x0, global_vector(module), recorder.updates, t


def test_central_noise_is_added_to_the_uniform_mean_of_clipped_updates():
    clip, z = 0.05, 2.0
    x0, x, uploads, _ = run(DifferentialPrivacy(clip_norm=clip, noise_multiplier=z))
    assert all(float(u.norm()) <= clip * (1 + 1e-5) for u in uploads.values())
    mean = torch.stack(list(uploads.values())).double().mean(0).float()
    noise = gaussian_noise(mean, z * clip / len(uploads), generator(3, "dp-central", 0))
    assert torch.allclose(x, x0 + mean + noise, atol=1e-6)


def test_local_noise_is_added_by_each_client():
    clip, z = 0.05, 0.5
    x0, x, uploads, _ = run(DifferentialPrivacy(clip_norm=clip, noise_multiplier=z, mode="local"))
    _, _, clean, _ = run(DifferentialPrivacy(clip_norm=clip, noise_multiplier=0.0, mode="local"))
    for cid, upload in uploads.items():
        noise = gaussian_noise(upload, z * clip, generator(3, "dp-local", 0, cid))
        assert torch.allclose(upload, clean[cid] + noise, atol=1e-6)


@pytest.mark.parametrize("mode", ["central", "local"])
def test_the_noise_needs_a_uniform_mean(mode):
    needs = r"DifferentialPrivacy needs every upload averaged uniformly \(its noise is calibrated to C / m\); "
    fix = {  # the refusal names what to change: the module's weighting, the aggregator callback, or a mean for a median
        "FedAvg": r"FedAvg's \['delta'\] are weighted by the clients' sample counts: pass weighting='uniform' to "
                  r"FedAvg \(YAML: model.init_args.weighting: uniform\)$",
        "callback": r"FedAvg's \['delta'\] are combined by the aggregator WeightedMean \(a weighted mean\): put "
                    r"WeightedMean\('uniform'\) in its place$",
        "RFA": r"RFA's \['delta'\] are combined by its default aggregator, which is not a mean: add the aggregator "
               r"WeightedMean\('uniform'\)$",
    }
    for case, module, callbacks in [("FedAvg", FedAvg, []), ("callback", FedAvg, [WeightedMean("num_samples")]),
                                    ("RFA", RFA, [])]:
        with pytest.raises(ValueError, match=needs + fix[case]):
            trainer(1, callbacks=[DifferentialPrivacy(1.0, 1.0, mode=mode), *callbacks]).fit(
                module(tiny_client(), clients_per_round=2, local_steps=1), synthetic(4))
    trainer(1, callbacks=[DifferentialPrivacy(1.0, 1.0), WeightedMean("uniform")]).fit(  # control is a uniform mean
        SCAFFOLD(tiny_client(), clients_per_round=2, local_steps=1), synthetic(4))
    trainer(1, callbacks=[DifferentialPrivacy(1.0, 1.0)]).fit(  # the module's weighting makes its mean uniform
        FedAvg(tiny_client(), clients_per_round=2, local_steps=1, weighting="uniform"), synthetic(4))
    trainer(1, callbacks=[DifferentialPrivacy(1.0, 1.0)]).fit(  # SCAFFOLD's paper mean is uniform
        SCAFFOLD(tiny_client(), clients_per_round=2, local_steps=1), synthetic(4))
    with pytest.raises(ValueError, match="noise_multiplier must be >= 0 and finite, got -1.0"):
        DifferentialPrivacy(1.0, -1.0)
    with pytest.raises(ValueError, match="mode must be 'central' or 'local', got 'both'"):
        DifferentialPrivacy(1.0, 1.0, mode="both")


def test_the_privacy_spent_is_logged_per_round():
    dp = DifferentialPrivacy(clip_norm=0.1, noise_multiplier=1.1, delta=1e-5)
    if HAS_OPACUS:
        _, _, _, t = run(dp, rounds=3)
        expected = dp_epsilon(1.1, 4 / 6, 3, 1e-5)
        assert float(t.callback_metrics["privacy/epsilon"]) == pytest.approx(expected, rel=1e-5)
        assert 0 < dp_epsilon(1.1, 4 / 6, 1, 1e-5) < expected  # more rounds, more privacy spent
    else:
        with pytest.warns(UserWarning, match="pip install -e '.\\[privacy\\]'"):
            _, _, _, t = run(dp, rounds=3)
        assert "privacy/epsilon" not in t.callback_metrics
    assert float(t.callback_metrics["privacy/noise_multiplier"]) == pytest.approx(1.1)
    assert dp.state_dict() == {"rounds": 3, "history": [[1.1, 4 / 6, 3]]}
    old = DifferentialPrivacy(clip_norm=0.1, noise_multiplier=1.1)
    old.load_state_dict({"rounds": 3})  # a checkpoint of before the history was kept: its rounds at this run's noise
    assert old.rounds == 3 and old.history == [[1.1, None, 3]]


def test_without_opacus_epsilon_is_not_logged(monkeypatch):
    """The accountant's NaN stays out of the metrics (and so out of the history and its summary): a warning says
    what is missing, once."""
    monkeypatch.setitem(__import__("sys").modules, "opacus.accountants", None)  # as if Opacus were not installed
    assert math.isnan(dp_epsilon(1.0, 0.1, 10, 1e-5))
    with pytest.warns(UserWarning, match=r"^privacy/epsilon is not logged: it needs Opacus' accountant: "
                                         r"pip install -e '\.\[privacy\]'$") as caught:
        _, _, _, t = run(DifferentialPrivacy(clip_norm=0.1, noise_multiplier=1.1), rounds=2)
    assert len([w for w in caught if "Opacus" in str(w.message)]) == 1
    assert "privacy/epsilon" not in t.callback_metrics
    assert float(t.callback_metrics["privacy/noise_multiplier"]) == pytest.approx(1.1)


@pytest.mark.skipif(not HAS_OPACUS, reason="needs Opacus (the [privacy] extra)")
@pytest.mark.parametrize("z, steps", [(1.1, 3), (2.0, 100), (1.0, 10)])
def test_epsilon_of_full_participation_matches_the_gaussian_mechanisms_rdp(z, steps):
    """With every client in every round (sample rate 1) the RDP of T Gaussian steps is T a / (2 z^2); the
    classic conversion min_a [T a / (2 z^2) + log(1/delta) / (a - 1)] bounds epsilon from above, and
    Opacus' tighter conversion gives at most 10% less."""
    classic = min(steps * a / (2 * z * z) + math.log(1e5) / (a - 1) for a in (1 + i / 100 for i in range(1, 20000)))
    assert 0.9 * classic <= dp_epsilon(z, 1.0, steps, 1e-5) <= classic


@pytest.mark.skipif(not HAS_OPACUS, reason="needs Opacus (the [privacy] extra)")
def test_a_resume_with_another_noise_multiplier_accounts_both_segments(tmp_path):
    """3 rounds at z = 0.3, resumed at z = 3.0 to 6 rounds: the RDP of the two segments adds up, so epsilon is that
    of the mixed history (and more than the first segment alone); the change is warned about."""
    from fl_lightning.callbacks import RoundCheckpoint
    from fl_lightning.callbacks.privacy import composed_epsilon

    def fit(z, rounds, **kwargs):
        dp = DifferentialPrivacy(clip_norm=0.1, noise_multiplier=z, mode="local")
        t = trainer(rounds, callbacks=[dp, WeightedMean("uniform"), RoundCheckpoint(dirpath=str(tmp_path))],
                    enable_checkpointing=True)
        t.fit(FedAvg(tiny_client(), clients_per_round=4, local_steps=1, seed=3), synthetic(6), **kwargs)
        return float(t.callback_metrics["privacy/epsilon"]), dp

    first, _ = fit(0.3, 3)
    with pytest.warns(UserWarning, match=r"noise_multiplier=3\.0.*checkpoint's rounds used 0\.3"):
        resumed, dp = fit(3.0, 6, ckpt_path=str(tmp_path / "last.ckpt"))
    assert dp.state_dict()["history"] == [[0.3, 1.0, 3], [3.0, 1.0, 3]]
    assert resumed == pytest.approx(composed_epsilon([(0.3, 1.0, 3), (3.0, 1.0, 3)], 1e-5), rel=1e-6)
    assert resumed > first == pytest.approx(dp_epsilon(0.3, 1.0, 3, 1e-5), rel=1e-6)
    # by formula: with sample rate 1 the RDP of order a is sum_i T_i a / (2 z_i^2); Opacus' conversion is within
    # 10% below the classic min_a [RDP(a) + log(1/delta) / (a - 1)]
    rdp = 3 / (2 * 0.3**2) + 3 / (2 * 3.0**2)
    classic = min(a * rdp + math.log(1e5) / (a - 1) for a in (1 + i / 100 for i in range(1, 20000)))
    assert 0.9 * classic <= resumed <= classic
