"""RAGA, RFA and Byrd-SAGA: uploads, schedule, server steps, robustness in a run, DDP equality."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from fl_lightning.algorithms.byrd_saga import ByrdSAGA, fixed_minibatches
from fl_lightning.algorithms.fedavg import FedAvg
from fl_lightning.algorithms.raga import RAGA, paper_learning_rate
from fl_lightning.algorithms.rfa import RFA
from fl_lightning.callbacks import FederatedCallback
from fl_lightning.callbacks.aggregation import WeightedMean
from fl_lightning.callbacks.attacks import ALIEAttack, GaussianAttack, LabelFlipAttack
from fl_lightning.callbacks.robust_aggregation import CoordinateMedian, GeometricMedian
from fl_lightning.models import LogisticRegression
from tests.helpers import TWO_PROCESSES, global_vector, synthetic, tiny_client, trainer


class Record(FederatedCallback):
    """Keeps every update the module receives."""

    def __init__(self) -> None:
        self.updates = []

    def on_client_update(self, trainer, module, update):
        self.updates.append(update)
        return update


def fit(module, rounds=2, callbacks=(), clients=8, **data):
    trainer(rounds, callbacks=list(callbacks)).fit(module, synthetic(clients, **data))
    return module


def test_paper_schedule():
    assert paper_learning_rate(1, 1000) == pytest.approx(0.0990099, abs=1e-7)
    assert paper_learning_rate(500, 1000) == pytest.approx(1 / 60)
    assert paper_learning_rate(1000, 1000) == pytest.approx(1 / 110)
    with pytest.raises(ValueError, match="round_number"):
        paper_learning_rate(0, 10)


def test_raga_uploads_the_mean_local_gradient():
    """With a constant local rate: z = (w - w_K) / (lr K), where w_K is FedAvg's end point on the same batches."""
    lr, k = 0.1, 4
    raga_rec, fedavg_rec = Record(), Record()
    fit(RAGA(tiny_client(lr=lr), schedule="constant", clients_per_round=3, local_steps=k, seed=2), 1, [raga_rec])
    fit(FedAvg(tiny_client(lr=lr), clients_per_round=3, local_steps=k, seed=2), 1, [fedavg_rec])
    assert [u.client_id for u in raga_rec.updates] == [u.client_id for u in fedavg_rec.updates]
    for z, d in zip(raga_rec.updates, fedavg_rec.updates):
        assert torch.allclose(z.tensors["grad"], -d.tensors["delta"] / (lr * k), atol=1e-5)


def test_one_local_step_with_the_mean_is_sgd():
    """K = 1, one client, mean aggregation: RAGA's server step is FedAvg's (plain SGD) step."""
    raga = fit(RAGA(tiny_client(lr=0.2), schedule="constant", server_lr=0.2, clients_per_round=1, local_steps=1, seed=4),
               3, [WeightedMean()], clients=1)
    fedavg = fit(FedAvg(tiny_client(lr=0.2), clients_per_round=1, local_steps=1, seed=4), 3, clients=1)
    assert torch.allclose(global_vector(raga), global_vector(fedavg), atol=1e-6)


def test_raga_steps_with_the_paper_schedule():
    module = RAGA(tiny_client(), clients_per_round=4, seed=0, total_rounds=100)
    t = trainer(3)
    t.fit(module, synthetic(8))
    assert float(t.callback_metrics["raga/lr"]) == pytest.approx(paper_learning_rate(3, 100))
    assert isinstance(module.engine.aggregator, GeometricMedian) and module.engine.aggregator.weighting == "num_samples"
    assert module.local_steps == 3


def test_lr_scale_multiplies_the_paper_schedule_for_both_steps():
    """lr_scale c: the round's rate (the clients' and the server step's) is c * T / (100 t + 10 T)."""
    module = RAGA(tiny_client(), clients_per_round=4, seed=0, total_rounds=100, lr_scale=3.0)
    t = trainer(2)
    t.fit(module, synthetic(8))
    assert float(t.callback_metrics["raga/lr"]) == pytest.approx(3.0 * paper_learning_rate(2, 100))


@pytest.mark.parametrize("kwargs, match", [(dict(lr_scale=0.0), "lr_scale must be > 0"),
                                           (dict(lr_scale=2.0, schedule="constant"), "lr_scale scales the paper schedule")])
def test_bad_lr_scale_is_refused(kwargs, match):
    with pytest.raises(ValueError, match=match):
        RAGA(tiny_client(), clients_per_round=2, seed=0, **kwargs)


def test_the_paper_schedule_beside_a_client_schedule_is_refused():
    """RAGA's schedule replaces the client's: a client with lr_milestones would silently lose them."""
    client = LogisticRegression(in_features=20, num_classes=10, lr=0.1, lr_milestones=[2])
    with pytest.raises(ValueError, match="PaperLR.*MultiStepLR.*lr_milestones"):
        fit(RAGA(client, clients_per_round=2, total_rounds=4, seed=0), 1)
    constant = RAGA(LogisticRegression(in_features=20, num_classes=10, lr=0.1, lr_milestones=[1]), schedule="constant",
                    clients_per_round=2, seed=0)
    fit(constant, 2)  # the client's own schedule, which "constant" leaves in place
    assert constant.engine.local_lr == pytest.approx(0.01)


def test_constant_schedule_steps_the_server_with_the_local_rate():
    """eq. 14 with the paper's eta_m^{t,k} = eta^t: w <- w - eta z, eta the client optimizer's rate."""
    lr, rec = 0.05, Record()
    module = RAGA(tiny_client(lr=lr), schedule="constant", clients_per_round=1, local_steps=2, seed=1)
    start = global_vector(module)
    fit(module, 1, [rec], clients=1)
    assert torch.allclose(global_vector(module), start - lr * rec.updates[0].tensors["grad"], atol=1e-6)


@pytest.mark.parametrize("schedule", ["paper", "constant"])
def test_server_lr_fixes_the_global_rate(schedule):
    server_lr, rec = 0.5, Record()
    module = RAGA(tiny_client(lr=0.05), schedule=schedule, server_lr=server_lr, total_rounds=10, clients_per_round=1,
                  local_steps=2, seed=1)
    start = global_vector(module)
    fit(module, 1, [rec], clients=1)
    assert torch.allclose(global_vector(module), start - server_lr * rec.updates[0].tensors["grad"], atol=1e-6)


@pytest.mark.parametrize("algorithm", [RAGA, RFA])
def test_local_epochs_replace_the_default_local_steps(algorithm):
    assert algorithm(tiny_client()).local_steps == 3
    module = algorithm(tiny_client(), local_epochs=1, clients_per_round=2, total_rounds=2)
    assert (module.local_steps, module.local_epochs) == (None, 1)
    fit(module, 1)


@pytest.mark.parametrize("option, value", [("momentum", 0.9), ("weight_decay", 0.01)])
def test_raga_refuses_a_local_optimizer_other_than_plain_sgd(option, value):
    """The upload is the mean of the raw gradients of plain SGD steps (eq. 13): momentum or weight
    decay would change the trajectory the gradients are taken on, silently."""
    client = tiny_client()
    setattr(client, option, value)
    with pytest.raises(ValueError, match=f"RAGA needs plain SGD: the client's optimizer has {option}={value}"):
        fit(RAGA(client, clients_per_round=2, total_rounds=2), 1)


def test_default_aggregators_of_the_baselines():
    rfa, saga = RFA(tiny_client()), ByrdSAGA(tiny_client())
    assert (rfa.default_aggregator.max_iter, rfa.default_aggregator.nu) == (4, 1e-5)
    assert rfa.default_aggregator.stop == "objective_rel"
    assert saga.default_aggregator.weighting == "uniform" and saga.default_aggregator.stop == "movement"


def test_raga_resists_a_gaussian_attack_where_the_mean_breaks():
    def final(callbacks):
        module = RAGA(tiny_client(), clients_per_round=10, seed=1, total_rounds=50)
        return global_vector(fit(module, 3, callbacks, clients=10))

    clean = final([])
    robust = final([GaussianAttack(fraction=0.3, std=10.0)])
    broken = final([GaussianAttack(fraction=0.3, std=10.0), WeightedMean()])
    assert float((robust - clean).norm()) * 10 < float((broken - clean).norm())


def test_label_flip_reaches_raga_clients():
    clean = global_vector(fit(RAGA(tiny_client(), clients_per_round=8, seed=1), 2))
    flipped = global_vector(fit(RAGA(tiny_client(), clients_per_round=8, seed=1), 2, [LabelFlipAttack(fraction=0.4)]))
    assert float((flipped - clean).norm()) > 1e-4


def test_fixed_minibatches():
    chunks = fixed_minibatches(10, 4, torch.Generator().manual_seed(0))
    assert [len(c) for c in chunks] == [4, 4, 2]
    assert sorted(torch.cat(chunks).tolist()) == list(range(10))


def test_byrd_saga_with_one_minibatch_is_gradient_descent():
    """One client whose split is one minibatch: v = g - g + g = g, so the step is full-batch GD."""
    saga = fit(ByrdSAGA(tiny_client(lr=0.3), step_size=0.3, clients_per_round=1, seed=0), 3, [WeightedMean()],
               clients=1, batch_size=1000)
    fedavg = fit(FedAvg(tiny_client(lr=0.3), clients_per_round=1, local_steps=1, seed=0), 3, clients=1, batch_size=1000)
    assert torch.allclose(global_vector(saga), global_vector(fedavg), atol=1e-6)


def test_byrd_saga_keeps_a_table_per_client():
    saga = fit(ByrdSAGA(tiny_client(), clients_per_round=4, seed=0), 2, batch_size=8)
    client = next(saga.engine.store.clients())
    table = saga.engine.store.get(client, "saga_table")
    n = saga.trainer.datamodule.num_samples(client)
    assert table.shape == (-(-n // 8), saga.global_model.num_params)


class WithBatchNorm(LogisticRegression):
    def __init__(self) -> None:
        super().__init__(in_features=20)
        self.net = nn.Sequential(nn.BatchNorm1d(20), nn.Linear(20, 10))


@pytest.mark.parametrize(
    "build, match",
    [
        (lambda: RAGA(tiny_client(), schedule="cosine"), "schedule"),
        (lambda: RAGA(tiny_client(), total_rounds=0), "total_rounds"),
        (lambda: RAGA(WithBatchNorm()), "buffer"),
        (lambda: ByrdSAGA(tiny_client(), local_steps=3), "one step"),
        (lambda: ByrdSAGA(tiny_client(), step_size=0), "step_size"),
    ],
)
def test_bad_arguments_are_refused(build, match):
    with pytest.raises(ValueError, match=match):
        build()


def _ddp_run(devices, build, callbacks):
    import pytorch_lightning as pl

    pl.seed_everything(0)
    module = build()
    strategy = TWO_PROCESSES if devices > 1 else "auto"
    trainer(2, callbacks=callbacks(), devices=devices, strategy=strategy).fit(module, synthetic(8))
    return global_vector(module)


@pytest.mark.slow
@pytest.mark.parametrize(
    "build, callbacks",
    [
        (lambda: RAGA(tiny_client(hidden=(8,)), clients_per_round=5, seed=3, total_rounds=20), lambda: [ALIEAttack(count=2)]),
        (lambda: FedAvg(tiny_client(hidden=(8,)), clients_per_round=5, local_steps=2, seed=3),
         lambda: [GaussianAttack(count=2), CoordinateMedian()]),
    ],
    ids=["raga-alie-geometric_median", "fedavg-gaussian-coordinate_median"],
)
def test_two_processes_equal_one(build, callbacks):
    one = _ddp_run(1, build, callbacks)
    two = _ddp_run(2, build, callbacks)
    assert (one - two).abs().max() <= 1e-5
