"""Federated callback hooks, the weighted-mean aggregator and per-client metrics."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from fl_lightning.algorithms import FedAvg
from fl_lightning.callbacks import (
    Aggregator,
    ClassAccuracy,
    ClientMetrics,
    FederatedCallback,
    LabelFlipAttack,
    LocalFinetuning,
    PersonalizedAccuracy,
    WeightedMean,
)
from fl_lightning.callbacks.client_metrics import accuracy_summary
from fl_lightning.datamodules import FederatedDataModule
from fl_lightning.update import ClientUpdate
from tests.helpers import RegressionData, Regressor, global_vector, synthetic, tiny_client, trainer


def updates():
    return [
        ClientUpdate(2, 1, {"delta": torch.tensor([4.0, 0.0])}),
        ClientUpdate(0, 3, {"delta": torch.tensor([0.0, 4.0])}),
    ]


class _Module:
    device = torch.device("cpu")
    engine = SimpleNamespace(aggregated_sizes=lambda: {"delta": 2})


def test_weighted_mean_by_samples_and_uniform():
    by_samples = WeightedMean().aggregate(None, _Module(), updates())["delta"]
    uniform = WeightedMean("uniform").aggregate(None, _Module(), updates())["delta"]
    assert torch.equal(by_samples, torch.tensor([1.0, 3.0]))
    assert torch.equal(uniform, torch.tensor([2.0, 2.0]))
    assert WeightedMean().aggregate(None, _Module(), []) is None
    with pytest.raises(ValueError, match="weighting"):
        WeightedMean("median")


class Recorder(FederatedCallback):
    def __init__(self):
        self.events = []

    def on_round_start(self, trainer, module, round_idx, clients):
        self.events.append(("start", round_idx, tuple(clients)))

    def on_client_update(self, trainer, module, update):
        self.events.append(("update", update.client_id))
        return update

    def on_round_end(self, trainer, module, round_idx, aggregate):
        self.events.append(("end", round_idx, tuple(aggregate)))


def test_hooks_run_in_round_order():
    rec = Recorder()
    module = FedAvg(tiny_client(), clients_per_round=2, local_steps=1)
    trainer(2, callbacks=[rec]).fit(module, synthetic(4))
    kinds = [e[0] for e in rec.events]
    assert kinds == ["start", "update", "update", "end"] * 2
    assert rec.events[0][2] == tuple(sorted(e[1] for e in rec.events[1:3]))
    assert rec.events[3] == ("end", 0, ("delta",))


class HalfSteps(Aggregator):
    """A custom aggregator: half of the plain mean."""

    def aggregate(self, trainer, module, updates):
        return {"delta": 0.5 * WeightedMean("uniform").aggregate(trainer, module, updates)["delta"]}


def test_custom_aggregator_replaces_the_default():
    a = FedAvg(tiny_client(), clients_per_round=4, local_steps=2)
    b = FedAvg(tiny_client(), clients_per_round=4, local_steps=2)
    x0 = global_vector(a)
    trainer(1, callbacks=[WeightedMean("uniform")]).fit(a, synthetic(4))
    trainer(1, callbacks=[HalfSteps()]).fit(b, synthetic(4))
    assert torch.allclose(global_vector(b) - x0, 0.5 * (global_vector(a) - x0), atol=1e-6)


def test_two_aggregators_are_refused():
    with pytest.raises(ValueError, match="at most one Aggregator"):
        trainer(1, callbacks=[WeightedMean(), HalfSteps()]).fit(FedAvg(tiny_client(), clients_per_round=2), synthetic(4))


def test_accuracy_summary():
    out = accuracy_summary(torch.tensor([0.5, 1.0, 0.0, 0.75]), "c")
    assert out["c/acc_mean"] == pytest.approx(0.5625)
    assert out["c/acc_worst"] == 0.0
    assert out["c/acc_p10"] == pytest.approx(0.15)


def test_client_metrics_match_a_direct_evaluation():
    dm = synthetic(6, test_fraction=0.3)
    module = FedAvg(tiny_client(), clients_per_round=6, local_steps=5)
    metrics = ClientMetrics()
    t = trainer(2, callbacks=[metrics])
    t.fit(module, dm)
    direct = []
    with torch.no_grad():
        for cid in range(6):
            x, y = dm.client_data(cid, "test").full()
            direct.append(float((module.client(x).argmax(-1) == y).float().mean()))
    assert float(t.callback_metrics["clients_test/acc_mean"]) == pytest.approx(sum(direct) / 6, abs=1e-6)
    assert float(t.callback_metrics["clients_test/acc_worst"]) == pytest.approx(min(direct), abs=1e-6)
    with pytest.raises(ValueError, match="split"):
        ClientMetrics(split="holdout")


def test_client_metrics_name_their_split_and_warn_when_it_is_empty():
    assert ClientMetrics(split="val").prefixes == {"val": "clients_val"}
    assert ClientMetrics(split="train", clients="unseen").prefixes == {"train": "clients_unseen_train"}
    assert ClientMetrics(split=["val", "test"]).prefixes == {"val": "clients_val", "test": "clients_test"}
    t = trainer(1, callbacks=[ClientMetrics(split="test")])
    with pytest.warns(UserWarning, match=r"split='test'.*splits are empty: test_fraction=0 holds out no test data: "
                                         r"set test_fraction > 0"):
        t.fit(FedAvg(tiny_client(), clients_per_round=2, local_steps=1), synthetic(4, test_fraction=0.0))
    assert not any(name.startswith("clients_test/") for name in t.callback_metrics)


def test_client_metrics_on_several_splits_equal_one_callback_per_split_and_make_each_model_once():
    """``split=["val", "test"]`` logs what a callback per split logs, with each client's model made
    once (for LocalFinetuning: each client finetuned once, not once per split)."""
    from fl_lightning.callbacks import LocalFinetuning

    def fit(callbacks):
        made = []
        module = FedAvg(tiny_client(), clients_per_round=6, local_steps=3)
        global_model = module.client_eval_state
        module.client_eval_state = lambda cid: made.append(("global", cid)) or global_model(cid)
        finetune = module.engine.train_clients_locally

        def finetuned(ids, *args, **kwargs):
            for cid, state in finetune(ids, *args, **kwargs):
                made.append(("finetuned", cid))
                yield cid, state

        module.engine.train_clients_locally = finetuned
        t = trainer(2, callbacks=callbacks, check_val_every_n_epoch=2)
        t.fit(module, synthetic(6, val_fraction=0.2, test_fraction=0.3))
        return {k: float(v) for k, v in t.callback_metrics.items() if k.startswith(("clients_", "finetuned_"))}, made

    separate, made_separate = fit([ClientMetrics(split="val"), ClientMetrics(split="test"),
                                   LocalFinetuning(steps=4, split="val"), LocalFinetuning(steps=4, split="test")])
    together, made_together = fit([ClientMetrics(split=["val", "test"]), LocalFinetuning(steps=4, split=["val", "test"])])
    assert together == separate and len(together) == 12
    assert sorted(made_together) == sorted(set(made_separate))
    assert len(made_separate) == 2 * len(made_together) == 2 * 12  # 6 clients, the global and the finetuned model
    for bad in ("holdout", [], ["val", "val"], ["val", "holdout"]):
        with pytest.raises(ValueError, match=r"split must be 'train', 'val' or 'test', or a list of distinct ones"):
            ClientMetrics(split=bad)
    with pytest.raises(ValueError, match=r"prefix='mine' names one split's metrics and split=\['val', 'test'\] has 2"):
        LocalFinetuning(split=["val", "test"], prefix="mine")


@pytest.mark.parametrize("make, does", [
    (lambda: ClientMetrics(), "measures accuracy"),
    (lambda: LocalFinetuning(steps=1), "measures accuracy"),
    (lambda: ClassAccuracy(num_classes=2), "measures accuracy"),
    (lambda: PersonalizedAccuracy(), "measures accuracy"),
    (lambda: LabelFlipAttack(num_classes=2, count=1), "flips class labels"),
])
def test_accuracy_callbacks_refuse_data_without_class_labels_at_setup(make, does):
    """A regression's float targets have no accuracy: refused before the first round, naming the
    targets, where the accuracy would otherwise be computed (as 0) or fail at the first evaluation."""
    callback = make()
    with pytest.raises(ValueError, match=rf"{type(callback).__name__} .*{does}.*, but RegressionData's targets are "
                                         r"float32 numbers of shape \[\] \(mean .*\), not class labels"):
        trainer(1, callbacks=[callback]).fit(FedAvg(Regressor(), clients_per_round=2, local_steps=1), RegressionData())


def test_accuracy_callbacks_refuse_samples_that_are_not_inputs_and_labels():
    """Dict samples hold class labels, but an accuracy callback cannot tell their inputs."""

    class Dicts(torch.utils.data.Dataset):
        def __len__(self):
            return 40

        def __getitem__(self, i):
            return {"x": torch.full((20,), float(i)), "label": i % 2}

    class DictData(FederatedDataModule):
        def build_datasets(self):
            return Dicts(), None

    dm = DictData(num_clients=2)
    dm.setup()
    with pytest.raises(ValueError, match=r"ClientMetrics reads a batch as \(inputs, labels, ...\), but DictData's "
                                         r"samples are dicts with keys \['x', 'label'\]: evaluate the clients with "
                                         r"FederatedEvaluation"):
        ClientMetrics().setup(trainer(1), SimpleNamespace(engine=SimpleNamespace(datamodule=dm)), "fit")
