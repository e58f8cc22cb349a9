"""The round loop of FederatedModule: federating an unchanged LightningModule, determinism,
order independence, bad input and non-finite updates."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import pytorch_lightning as pl
import torch
import torch.nn.functional as F
from torch import nn

from fl_lightning import FederatedCallback, NonFiniteUpdateError
from fl_lightning.algorithms import FedAvg, FedProx
from fl_lightning.algorithms.feddeper import sgd_step
from fl_lightning.backends import SequentialBackend
from fl_lightning.seeding import generator
from fl_lightning.vectors import ModelVector
from tests.helpers import global_vector, synthetic, tiny_client, trainer

ROOT = Path(__file__).resolve().parents[1]


class PlainClassifier(pl.LightningModule):
    """A user's ordinary LightningModule: nothing federated in it."""

    def __init__(self):
        super().__init__()
        self.layer = nn.Linear(20, 10)
        self.train_steps = 0

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self.layer(x), y)
        self.log("user_loss", loss, on_step=False, on_epoch=True)
        self.train_steps += 1
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("user_acc", (self.layer(x).argmax(-1) == y).float().mean())

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_unchanged_lightning_module_is_federated():
    torch.manual_seed(0)
    client = PlainClassifier()
    t = trainer(3)
    t.fit(FedAvg(client, clients_per_round=4, local_steps=5), synthetic(8))
    assert client.train_steps == 3 * 4 * 5
    assert "user_loss" in t.callback_metrics and "user_acc" in t.callback_metrics
    assert t.current_epoch == 3


def test_fedavg_learns():
    module = FedAvg(tiny_client(), clients_per_round=8, local_steps=10)
    t = trainer(8)
    dm = synthetic(8)
    before = t.validate(module, dm, verbose=False)[0]["val_acc"]
    t.fit(module, dm)
    after = t.validate(module, dm, verbose=False)[0]["val_acc"]
    assert after > before + 0.2


def test_local_epochs_run_whole_passes():
    client = PlainClassifier()
    dm = synthetic(4)
    trainer(1).fit(FedAvg(client, clients_per_round=4, local_steps=None, local_epochs=2), dm)
    batches = sum(-(-dm.num_samples(c) // dm.batch_size) for c in range(4))
    assert client.train_steps == 2 * batches


def test_same_seed_same_model_other_seed_other_model():
    runs = []
    for seed in (5, 5, 6):
        module = FedAvg(tiny_client(), clients_per_round=3, local_steps=3, seed=seed)
        trainer(2).fit(module, synthetic(8))
        runs.append(global_vector(module))
    assert torch.equal(runs[0], runs[1])
    assert not torch.equal(runs[0], runs[2])


class ReversedOrder(SequentialBackend):
    """Runs the round's clients in the reverse order."""

    def round(self, context, clients):
        return super().round(context, list(reversed(clients)))


def test_result_does_not_depend_on_client_order():
    a, b = FedAvg(tiny_client(), clients_per_round=5, local_steps=3), FedAvg(tiny_client(), clients_per_round=5, local_steps=3)
    b.engine.backend = ReversedOrder()
    trainer(3).fit(a, synthetic(8))
    trainer(3).fit(b, synthetic(8))
    assert torch.equal(global_vector(a), global_vector(b))


class BatchCount(pl.Callback):
    """Counts the Trainer's training batches (work items)."""

    def __init__(self):
        self.batches = 0

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.batches += 1


@pytest.mark.parametrize("algorithm", ["fedavg", "feddro"])
def test_sequential_blocks_run_a_block_of_clients_per_work_item_with_the_same_results(algorithm):
    """The sequential backend with ``clients_per_block=3``: a round of 5 clients is 2 Trainer batches
    (lock-step FedDRO, whose rounds take every client, keeps a batch per local step), the clients'
    results are bitwise those of a batch per client, and the progress bar counts blocks."""
    from fl_lightning.algorithms import FedDRO
    from fl_lightning.functional.dro import KLDRO
    from fl_lightning.progress import work_unit

    def make(block):
        if algorithm == "feddro":
            return FedDRO(tiny_client(), KLDRO(lam=2.0), local_steps=3, clients_per_round=5, seed=1,
                          clients_per_block=block)
        return FedAvg(tiny_client(), clients_per_round=5, local_steps=3, seed=1, clients_per_block=block)

    modules, counts, losses = [], [], []
    for block in (None, 3):
        module, count = make(block), BatchCount()
        trainer(2, callbacks=[count]).fit(module, synthetic(5))
        modules.append(module)
        counts.append(count.batches)
        losses.append(module.trainer.callback_metrics["round/client_loss"])
    assert torch.equal(global_vector(modules[0]), global_vector(modules[1]))
    assert torch.equal(losses[0], losses[1])
    if algorithm == "feddro":
        assert counts == [2 * 3, 2 * 3]  # a work item per local step either way
        assert work_unit(modules[1]) == "step"
    else:
        assert counts == [2 * 5, 2 * 2]
        assert (work_unit(modules[0]), work_unit(modules[1])) == ("client", "block")


def test_fedavg_is_mean_of_deltas_by_hand():
    """One round, all clients, one local step: x1 = x0 + sum_i n_i (y_i - x0) / sum n_i."""
    dm = synthetic(3)
    module = FedAvg(tiny_client(), clients_per_round=3, local_steps=1, seed=2)
    x0 = global_vector(module)
    trainer(1).fit(module, dm)
    deltas, weights = [], []
    for cid in range(3):
        client = tiny_client()
        batch = next(dm.client_data(cid).step_batches(1, __import__("fl_lightning").seeding.generator(2, "batches", 0, cid)))
        loss = F.cross_entropy(client(batch[0]), batch[1])
        loss.backward()
        with torch.no_grad():
            for p in client.parameters():
                p -= 0.1 * p.grad
        deltas.append(torch.cat([p.detach().reshape(-1) for p in client.parameters()]) - x0)
        weights.append(dm.num_samples(cid))
    w = torch.tensor(weights, dtype=torch.float64)
    expected = x0 + (torch.stack(deltas).double() * w[:, None]).sum(0).float() / w.sum().float()
    assert torch.allclose(global_vector(module), expected, atol=1e-6)


def test_fedprox_with_mu_zero_is_fedavg():
    a = FedAvg(tiny_client(), clients_per_round=4, local_steps=3)
    b = FedProx(tiny_client(), mu=0.0, clients_per_round=4, local_steps=3)
    trainer(2).fit(a, synthetic(8))
    trainer(2).fit(b, synthetic(8))
    assert torch.equal(global_vector(a), global_vector(b))


def test_fedprox_pulls_toward_global_model():
    a = FedAvg(tiny_client(), clients_per_round=4, local_steps=20)
    b = FedProx(tiny_client(), mu=1.0, clients_per_round=4, local_steps=20)
    x0 = global_vector(a)
    trainer(1).fit(a, synthetic(8))
    trainer(1).fit(b, synthetic(8))
    assert (global_vector(b) - x0).norm() < (global_vector(a) - x0).norm()


def test_server_momentum_changes_the_trajectory():
    a = FedAvg(tiny_client(), clients_per_round=4, local_steps=3)
    b = FedAvg(tiny_client(), clients_per_round=4, local_steps=3, server_momentum=0.9)
    trainer(3).fit(a, synthetic(8))
    trainer(3).fit(b, synthetic(8))
    assert not torch.allclose(global_vector(a), global_vector(b))


class MetricTypes(FederatedCallback):
    """Records the type of each update's local loss when the client hands it in and at the round's end."""

    def __init__(self) -> None:
        self.handed_in: list[type] = []
        self.losses: list[list[float]] = []

    def on_client_update(self, trainer, module, update):
        self.handed_in.append(type(update.metrics["loss"]))
        return update

    def on_round_updates(self, trainer, module, updates):
        self.losses.append([u.metrics["loss"] for u in updates])
        return updates


def test_local_losses_stay_on_the_device_until_the_round_reads_them_together():
    """A client's mean local loss is not read when it ends (no device sync per client): the round's
    end reads every client's at once, and logs their mean."""
    types = MetricTypes()
    module = FedAvg(tiny_client(), clients_per_round=4, local_steps=3)
    fit = trainer(2, callbacks=[types])
    fit.fit(module, synthetic(6))
    assert types.handed_in == [torch.Tensor] * 8
    assert all(type(loss) is float for losses in types.losses for loss in losses)
    last = types.losses[-1]
    assert float(fit.callback_metrics["round/client_loss"]) == pytest.approx(sum(last) / len(last), rel=1e-6)


class Poison(FederatedCallback):
    def on_client_update(self, trainer, module, update):
        if update.client_id == module.engine.round_clients[0]:
            update.tensors["delta"][0] = float("nan")
        return update


def test_nonfinite_update_is_excluded_and_reported():
    module = FedAvg(tiny_client(), clients_per_round=4, local_steps=2)
    t = trainer(2, callbacks=[Poison()])
    with pytest.warns(RuntimeWarning, match="NaN or Inf"):
        t.fit(module, synthetic(8))
    assert torch.isfinite(global_vector(module)).all()
    assert float(t.callback_metrics["round/excluded"]) == 1.0


def test_nonfinite_update_can_stop_the_run():
    module = FedAvg(tiny_client(), clients_per_round=4, local_steps=2, nonfinite_updates="raise")
    with pytest.raises(NonFiniteUpdateError, match="client"):
        trainer(1, callbacks=[Poison()]).fit(module, synthetic(8))


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"clients_per_round": 0}, "clients_per_round must be >= 1"),
        ({"local_steps": 3, "local_epochs": 1}, "exactly one of local_steps and local_epochs"),
        ({"clients_per_round": 2.5}, r"clients_per_round must be >= 1 and an integer, got 2.5"),
        ({"local_steps": 2.5}, r"local_steps must be >= 1 and an integer, got 2.5"),
        ({"server_lr": float("nan")}, "server_lr must be > 0 and finite, got nan"),
        ({"local_steps": 0}, "local_steps must be >= 1"),
        ({"server_lr": 0.0}, "server_lr must be > 0"),
        ({"server_momentum": 1.0}, r"server_momentum must be in \[0, 1\)"),
        ({"nonfinite_updates": "ignore"}, "nonfinite_updates must be"),
    ],
)
def test_bad_module_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        FedAvg(tiny_client(), **kwargs)


def test_more_clients_per_round_than_clients():
    with pytest.raises(ValueError, match="clients_per_round=9 is above the number of training clients"):
        trainer(1).fit(FedAvg(tiny_client(), clients_per_round=9), synthetic(8))


def test_client_must_be_a_lightning_module():
    with pytest.raises(TypeError, match="LightningModule"):
        FedAvg(nn.Linear(2, 2))


class LossShapeClient(PlainClassifier):
    """A training_step whose loss is per sample (``"vector"``), detached (``"detached"``) or one
    element of shape ``(1,)`` (``"one"``, allowed)."""

    def __init__(self, kind: str):
        torch.manual_seed(0)
        super().__init__()
        self.kind = kind

    def training_step(self, batch, batch_idx):
        x, y = batch
        losses = F.cross_entropy(self.layer(x), y, reduction="none")
        if self.kind == "vector":
            return losses
        if self.kind == "detached":
            return {"loss": losses.mean().detach()}
        return losses.mean().reshape(1)


@pytest.mark.parametrize("backend", ["sequential", "batched"])
@pytest.mark.parametrize(
    "kind, match",
    [
        ("vector", r"the client's training_step returned a loss of shape \(16,\): it must be a scalar tensor "
                   r"\(one element\); reduce it, e.g. with \.mean\(\)"),
        ("detached", r"the client's training_step returned a loss that does not require grad"),
    ],
)
def test_a_loss_that_is_not_a_differentiable_scalar_is_refused(backend, kind, match):
    module = FedAvg(LossShapeClient(kind), clients_per_round=2, local_steps=1, client_backend=backend)
    t = trainer(1)
    with pytest.raises(ValueError, match=match):
        t.fit(module, synthetic(4))
    assert t.global_step == 0  # no round finished


@pytest.mark.parametrize("backend", ["sequential", "batched"])
def test_a_one_element_loss_counts_as_a_scalar(backend):
    module = FedAvg(LossShapeClient("one"), clients_per_round=2, local_steps=2, client_backend=backend)
    trainer(1).fit(module, synthetic(4))
    assert torch.isfinite(global_vector(module)).all()


# ------------------------------------------------------------------ a second model in a run
class SecondModel(FedProx):
    """FedProx whose clients also train a second model (from the start) by plain SGD on the same
    batches, with ``run.loss_and_grad(batch, model=...)``."""

    def client_init(self, run):
        run.scratch["other"] = run.layout.copy(run.end())

    def client_step(self, run, batch):
        loss, grads = run.loss_and_grad(batch, model=run.scratch["other"])
        run.scratch["other"] = sgd_step(run.scratch["other"], grads, run.local.lr)
        self.prox_steps = getattr(self, "prox_steps", 0) + 1
        return super().client_step(run, batch)

    def client_final(self, run):
        self.other = ModelVector(self.client).layout.flatten(run.scratch["other"])
        return super().client_final(run)


def test_second_model_logs_as_the_client_and_leaves_the_module_tree_alone():
    torch.manual_seed(0)
    module = SecondModel(PlainClassifier(), mu=10.0, clients_per_round=2, local_steps=3)
    keys = set(module.state_dict())
    t = trainer(2)
    t.fit(module, synthetic(4))
    assert set(module.state_dict()) == keys  # nothing added to the checkpointed tree
    # its training_step's self.log went to the client's round buffer: 2 rounds x 2 clients x (3 + 3) steps
    assert module.client.train_steps == 2 * 2 * 6
    assert "user_loss" in t.callback_metrics


def test_second_model_steps_are_plain_steps_of_its_own_loss():
    """``loss_and_grad(model=...)`` is the gradient of the client's training loss at that model;
    FedProx's pull applies to the trained model's steps only."""
    torch.manual_seed(0)
    module = SecondModel(PlainClassifier(), mu=10.0, clients_per_round=1, local_steps=3)
    dm = synthetic(4)
    x0 = global_vector(module)
    trainer(1).fit(module, dm)
    (cid,) = module.engine.round_clients
    reference = PlainClassifier()
    ModelVector(reference).load(x0)
    optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    for batch in dm.client_data(cid, "train").step_batches(3, generator(module.seed, "batches", 0, cid)):
        optimizer.zero_grad()
        F.cross_entropy(reference.layer(batch[0]), batch[1]).backward()
        optimizer.step()
    assert torch.allclose(module.other, ModelVector(reference).flatten(), atol=1e-6)
    assert module.prox_steps == 3
    assert not torch.allclose(module.other, global_vector(module), atol=1e-3)  # the pulled model differs


def test_layout_splits_and_flattens_in_state_order():
    module = nn.Sequential(nn.Linear(3, 2), nn.BatchNorm1d(2))
    module[1].running_mean.fill_(5.0)
    vector = ModelVector(module)
    flat = vector.flatten()
    parts = vector.layout.split(flat)
    assert [p.shape for p in parts] == [t.shape for t in vector.tensors]
    assert all(torch.equal(p, t) for p, t in zip(parts, vector.tensors))
    assert [p.shape for p in vector.layout.split_params(flat)] == [p.shape for p in module.parameters()]
    assert torch.equal(vector.layout.flatten(parts), flat)
    with pytest.raises(ValueError, match="state vector has 3 entries, the model has 16"):
        vector.layout.split(torch.zeros(3))
    # written back in place, cast to each tensor's dtype; flattened to fp32 whatever the tensors' dtype
    target = [torch.empty(t.shape, dtype=torch.bfloat16 if i == 0 else torch.float32)
              for i, t in enumerate(vector.tensors)]
    values = torch.arange(16, dtype=torch.float32)
    vector.layout.write(target, values)
    assert all(torch.equal(t, p.to(t.dtype)) for t, p in zip(target, vector.layout.split(values)))
    assert torch.equal(vector.layout.flatten(target), values)  # integers up to 15: exact in bf16
    assert vector.layout.flatten(target).dtype == torch.float32
    vector.load(values + 1)
    assert torch.equal(vector.flatten(), values + 1)
    with pytest.raises(ValueError, match="state vector has 3 entries"):
        vector.layout.write(target, torch.zeros(3))


def test_a_logger_accepts_hyperparameters_the_module_and_the_data_share(tmp_path):
    """The module's seed differs from the datamodule's (and an algorithm may have an alpha, as
    Synthetic(alpha, beta) has): Lightning must not refuse to log them."""
    from pytorch_lightning.loggers import CSVLogger

    t = trainer(1, logger=CSVLogger(tmp_path))
    t.fit(FedAvg(tiny_client(), clients_per_round=2, local_steps=1, seed=3), synthetic(4, seed=0))
    assert t.current_epoch == 1


def test_the_author_meets_few_names():
    """Engine v4's bounds on what an algorithm's author meets (``benchmarks/author_surface.py`` counts them): at
    most 20 names of a ``FederatedModule`` beyond Lightning's and its constructor's, 15 of a ``ClientRun``, and a
    backend protocol of at most 6 public methods, 4 of them abstract."""
    spec = importlib.util.spec_from_file_location("author_surface", ROOT / "benchmarks" / "author_surface.py")
    assert spec is not None and spec.loader is not None
    counter = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(counter)
    names = counter.surface()
    assert len(names["author"]) <= 20, names["author"]
    assert len(names["run"]) <= 15, names["run"]
    assert len(names["backend"]) <= 6 and len(names["abstract"]) <= 4, (names["backend"], names["abstract"])
