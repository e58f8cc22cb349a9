"""The client protocol: hand-computed SCAFFOLD and FedProx rounds, declared uploads and state,
the client's per-round learning-rate schedule, and the keyed randomness of the client's own draws."""

from __future__ import annotations

import csv

import pytest
import pytorch_lightning as pl
import torch
import torch.nn.functional as F
from pytorch_lightning.callbacks import LearningRateMonitor
from pytorch_lightning.loggers import CSVLogger
from torch import nn

from fl_lightning.algorithms import SCAFFOLD, FedAvg, FedProx
from fl_lightning.backends import SequentialBackend
from fl_lightning.seeding import generator, sample_clients
from tests.helpers import TWO_PROCESSES, global_vector, straight_and_resumed, synthetic, tiny_client, trainer


def linear_grad(w: torch.Tensor, batch) -> torch.Tensor:
    """The gradient of the logistic regression's loss (20 inputs, 10 classes) at the flat ``w``."""
    w = w.clone().requires_grad_(True)
    logits = batch[0] @ w[:200].view(10, 20).T + w[200:]
    return torch.autograd.grad(F.cross_entropy(logits, batch[1]), w)[0]


def hand_scaffold(dm, x0, rounds, per_round, steps, lr, seed, weighting="uniform"):
    """SCAFFOLD (Algorithm 1, option II) written out: server c, client c_i, uniform mean of dc_i;
    the model deltas averaged uniformly (the paper's) or by sample count."""
    n = dm.num_clients
    x, c, ci = x0.clone(), torch.zeros_like(x0), {}
    for r in range(rounds):
        chosen = sample_clients(seed, r, list(range(n)), per_round)
        deltas, controls, sizes = [], [], []
        for i in chosen:
            y, own = x.clone(), ci.get(i, torch.zeros_like(x0))
            for batch in dm.client_data(i).step_batches(steps, generator(seed, "batches", r, i)):
                y = y - lr * (linear_grad(y, batch) - own + c)
            new = own - c + (x - y) / (steps * lr)
            deltas.append(y - x), controls.append(new - own), sizes.append(dm.num_samples(i))
            ci[i] = new
        w = torch.tensor(sizes if weighting == "num_samples" else [1] * len(sizes), dtype=torch.float64)
        x = x + ((torch.stack(deltas).double() * w[:, None]).sum(0) / w.sum()).float()
        c = c + len(chosen) / n * torch.stack(controls).double().mean(0).float()
    return x, c, ci


@pytest.mark.parametrize("weighting", [None, "num_samples"])
def test_scaffold_equals_the_hand_written_algorithm(weighting):
    """By default the model deltas' uniform mean, x <- x + (1/|S|) sum_i dy_i (Algorithm 1);
    ``weighting="num_samples"`` weighs them by sample count (the clients have unequal sizes)."""
    dm, lr, seed = synthetic(6), 0.1, 4
    module = SCAFFOLD(tiny_client(lr=lr), clients_per_round=3, local_steps=3, seed=seed, weighting=weighting)
    x0 = global_vector(module)
    trainer(3).fit(module, dm)
    x, c, ci = hand_scaffold(dm, x0, 3, 3, 3, lr, seed, weighting or "uniform")
    other, _, _ = hand_scaffold(dm, x0, 3, 3, 3, lr, seed, "num_samples" if weighting is None else "uniform")
    assert (x - other).abs().max() > 1e-3  # the two weightings differ on these clients
    assert torch.allclose(global_vector(module), x, atol=1e-5)
    assert torch.allclose(module.server_control.cpu(), c, atol=1e-5)
    assert sorted(module.engine.store.clients()) == sorted(ci)
    for i, value in ci.items():
        assert torch.allclose(module.engine.store.get(i, "control"), value, atol=1e-5)


def test_scaffold_server_control_is_the_mean_of_all_client_controls():
    """Clients of unequal size, partial participation: c == (1/N) sum_i c_i (never-sampled c_i = 0)."""
    dm = synthetic(8)
    dm.setup()
    assert len({dm.num_samples(c) for c in range(8)}) > 4  # unequal sizes
    module = SCAFFOLD(tiny_client(hidden=(8,)), clients_per_round=2, local_steps=4, seed=0)
    trainer(5).fit(module, dm)
    total = sum((module.engine.store.get(i, "control") for i in module.engine.store.clients()), torch.zeros(module.global_model.num_params))
    assert len(list(module.engine.store.clients())) < 8  # some clients never ran
    assert module.server_control.norm() > 0.1
    assert torch.allclose(module.server_control.cpu(), total / 8, atol=1e-6)


@pytest.mark.parametrize("option, value", [("momentum", 0.9), ("weight_decay", 0.001)])
def test_scaffold_refuses_a_local_optimizer_other_than_plain_sgd(option, value):
    """Option II's c_i+ = c_i - c + (x - y) / (K lr) assumes plain SGD steps: refused at setup."""
    client = tiny_client()
    setattr(client, option, value)  # the client's configure_optimizers reads it
    with pytest.raises(ValueError, match=rf"SCAFFOLD \(option II\) needs plain SGD: .*{option}={value}, allowed: 0"):
        trainer(1).fit(SCAFFOLD(client, clients_per_round=2, local_steps=1), synthetic(4))


def test_scaffold_needs_one_learning_rate_for_its_trainable_parameters():
    """Two rates for trainable parameters are refused (option II divides by K lr); a group of frozen
    parameters at another rate (here 0, first) does not count: the rate is 0.1 and the run trains."""
    def client_with(groups):
        client = tiny_client(hidden=(8,))
        client.configure_optimizers = lambda: torch.optim.SGD(groups(client.net), lr=0.1)
        return client

    two_rates = client_with(lambda net: [{"params": net[1].parameters(), "lr": 0.05}, {"params": net[3].parameters()}])
    with pytest.raises(ValueError, match=r"one learning rate \(lr\).*\[0\.05, 0\.1\]"):
        trainer(1).fit(SCAFFOLD(two_rates, clients_per_round=2, local_steps=1), synthetic(4))
    frozen = client_with(lambda net: [{"params": net[1].parameters(), "lr": 0.0}, {"params": net[3].parameters()}])
    frozen.net[1].requires_grad_(False)
    module = SCAFFOLD(frozen, clients_per_round=2, local_steps=2, nonfinite_updates="raise")
    trainer(2).fit(module, synthetic(4))
    assert 0 < module.server_control.norm() < 100


def test_fedprox_round_by_hand():
    """Two local steps of every client: y <- y - lr (g(y) + mu (y - x)); x <- weighted mean."""
    dm, lr, mu, seed = synthetic(4), 0.1, 0.5, 7
    module = FedProx(tiny_client(lr=lr), mu=mu, clients_per_round=4, local_steps=2, seed=seed)
    x = global_vector(module)
    trainer(1).fit(module, dm)
    ends, sizes = [], []
    for i in range(4):
        y = x.clone()
        for batch in dm.client_data(i).step_batches(2, generator(seed, "batches", 0, i)):
            y = y - lr * (linear_grad(y, batch) + mu * (y - x))
        ends.append(y), sizes.append(dm.num_samples(i))
    w = torch.tensor(sizes, dtype=torch.float64)
    expected = x + ((torch.stack(ends) - x).double() * w[:, None]).sum(0).float() / w.sum().float()
    assert torch.allclose(global_vector(module), expected, atol=1e-6)


# ------------------------------------------------------------------ declarations
class WrongUploads(FedAvg):
    def client_final(self, run):
        return {"delta": run.end() - run.start, "extra": torch.zeros(3)}


def test_undeclared_uploads_are_refused():
    with pytest.raises(ValueError, match=r"returned uploads \['delta', 'extra'\], but the declared uploads are \['delta'\]"):
        trainer(1).fit(WrongUploads(tiny_client(), clients_per_round=2, local_steps=1), synthetic(4))
    module = FedAvg(tiny_client())
    with pytest.raises(ValueError, match="reduction must be one of"):
        module.add_update("x", 3, reduction="median")
    with pytest.raises(ValueError, match="no upload named 'y'"):
        module.remove_update("y")


class Summed(FedAvg):
    """Uploads a constant per client, declared with each linear reduction."""

    def __init__(self, client, **kwargs):
        super().__init__(client, **kwargs)
        for reduction in ("weighted_mean", "mean", "sum"):
            self.add_update(reduction, 1, reduction=reduction)

    def client_final(self, run):
        value = torch.tensor([float(run.client_id)])
        return {"delta": run.end() - run.start, "weighted_mean": value, "mean": value, "sum": value}

    def server_update(self, aggregate):
        self.seen = {k: float(v) for k, v in aggregate.items() if k != "delta"}
        super().server_update(aggregate)


def test_each_declared_reduction():
    dm = synthetic(4)
    module = Summed(tiny_client(), clients_per_round=4, local_steps=1)
    trainer(1).fit(module, dm)
    n = torch.tensor([dm.num_samples(i) for i in range(4)], dtype=torch.float64)
    ids = torch.arange(4, dtype=torch.float64)
    assert module.seen["sum"] == pytest.approx(6.0)
    assert module.seen["mean"] == pytest.approx(1.5)
    assert module.seen["weighted_mean"] == pytest.approx(float((n * ids).sum() / n.sum()), rel=1e-6)


# ------------------------------------------------------------------ the local LR schedule
class RecordLR(FedAvg):
    """Records the learning rate of every client's local optimizer."""

    def client_init(self, run):
        self.lrs = getattr(self, "lrs", {})
        self.lrs.setdefault(run.round, set()).add(run.local.lr)


def scheduled_client(**kwargs):
    torch.manual_seed(0)
    from fl_lightning.models import LogisticRegression

    return LogisticRegression(in_features=20, num_classes=10, lr=0.1, lr_milestones=[2, 3], lr_gamma=0.5, **kwargs)


def test_the_client_scheduler_is_stepped_once_per_round(tmp_path):
    module = RecordLR(scheduled_client(), clients_per_round=3, local_steps=2)
    t = trainer(4, logger=CSVLogger(tmp_path), callbacks=[LearningRateMonitor(logging_interval="epoch")])
    t.fit(module, synthetic(4))
    assert {r: sorted(v) for r, v in module.lrs.items()} == {0: [0.1], 1: [0.1], 2: [0.05], 3: [0.025]}
    with open(tmp_path / "lightning_logs" / "version_0" / "metrics.csv") as f:
        logged = [(int(row["step"]), float(row["lr-client"])) for row in csv.DictReader(f) if row.get("lr-client")]
    # LearningRateMonitor shows the client's rate, each round's at the rounds done before it (the loggers' step)
    assert logged == [(0, 0.1), (1, 0.1), (2, 0.05), (3, 0.025)]
    assert t.fit_loop.epoch_loop._batches_that_stepped == 4


def test_a_resumed_schedule_continues_exactly(tmp_path):
    straight, resumed = straight_and_resumed(lambda: RecordLR(scheduled_client(), clients_per_round=3, local_steps=2, seed=3),
                                             lambda: synthetic(4), 4, 2, tmp_path)
    assert {r: resumed.lrs[r] for r in (2, 3)} == {r: straight.lrs[r] for r in (2, 3)} == {2: {0.05}, 3: {0.025}}
    assert torch.equal(global_vector(straight), global_vector(resumed))


class StepScheduled(pl.LightningModule):
    def __init__(self, config):
        super().__init__()
        self.layer = nn.Linear(20, 10)
        self.config = config

    def training_step(self, batch, batch_idx):
        return F.cross_entropy(self.layer(batch[0]), batch[1])

    def configure_optimizers(self):
        optimizer = torch.optim.SGD(self.parameters(), lr=0.1)
        if self.config == "step":
            return {"optimizer": optimizer, "lr_scheduler": {"scheduler": torch.optim.lr_scheduler.StepLR(optimizer, 1),
                                                             "interval": "step"}}
        return {"optimizer": optimizer, "lr_scheduler": torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer)}


@pytest.mark.parametrize("config, match", [("step", "interval='step'.*stepped once per round"),
                                           ("plateau", "ReduceLROnPlateau is not supported")])
def test_schedules_that_cannot_be_honored_are_refused(config, match):
    with pytest.raises(ValueError, match=match):
        trainer(1).fit(FedAvg(StepScheduled(config), clients_per_round=2, local_steps=1), synthetic(4))


# ------------------------------------------------------------------ keyed randomness of the client's own draws
class DropoutClient(pl.LightningModule):
    """A client whose training step draws random numbers itself (Dropout)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(20, 16), nn.ReLU(), nn.Dropout(0.5), nn.Linear(16, 10))

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        return F.cross_entropy(self(batch[0]), batch[1])

    def validation_step(self, batch, batch_idx):
        self.log("val_acc", (self(batch[0]).argmax(-1) == batch[1]).float().mean())

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


class ReversedBackend(SequentialBackend):
    """Runs the round's clients in the reverse order."""

    def round(self, context, clients):
        return super().round(context, list(reversed(clients)))


def dropout_fedavg(**kwargs):
    return FedAvg(DropoutClient(), clients_per_round=4, local_steps=3, seed=5, **kwargs)


def test_client_draws_do_not_depend_on_the_client_order_or_the_global_rng():
    a, b = dropout_fedavg(), dropout_fedavg()
    b.engine.backend = ReversedBackend()
    torch.manual_seed(1)
    trainer(3).fit(a, synthetic(6))
    torch.manual_seed(2)  # another global stream: the clients' draws are keyed, not global
    trainer(3).fit(b, synthetic(6))
    assert torch.equal(global_vector(a), global_vector(b))
    other = FedAvg(DropoutClient(), clients_per_round=4, local_steps=3, seed=6)
    trainer(3).fit(other, synthetic(6))
    assert not torch.equal(global_vector(a), global_vector(other))  # the seed does matter


def test_local_work_restores_the_global_rng():
    torch.manual_seed(3)
    expected = torch.rand(3)
    torch.manual_seed(3)
    module = dropout_fedavg()
    trainer(1).fit(module, synthetic(6))
    torch.manual_seed(3)
    with module.engine.context.local_work(0, "probe"):
        torch.rand(5)
    assert torch.equal(torch.rand(3), expected)


def test_a_dropout_client_resumes_bitwise(tmp_path):
    # whatever the global stream is at the resume
    straight, resumed = straight_and_resumed(dropout_fedavg, lambda: synthetic(6), 4, 2, tmp_path,
                                             before_resume=lambda: torch.manual_seed(123))
    assert torch.equal(global_vector(straight), global_vector(resumed))


class RankStream(pl.Callback):
    """Puts each process on another global RNG stream (seeded by its rank) as the fit starts, as
    processes of a real job are."""

    def on_fit_start(self, trainer, module):
        torch.manual_seed(1000 + trainer.global_rank)


@pytest.mark.slow
def test_a_dropout_client_gives_one_process_the_result_of_two():
    """``fl_ddp`` on two processes, each on another global RNG stream: only the engine's keying by
    (seed, round, client) makes the clients' Dropout draws agree with one process."""
    one, two = dropout_fedavg(), dropout_fedavg()
    trainer(3, callbacks=[RankStream()]).fit(one, synthetic(6))
    trainer(3, callbacks=[RankStream()], devices=2, strategy=TWO_PROCESSES).fit(two, synthetic(6))
    assert (global_vector(one) - global_vector(two)).abs().max() <= 1e-6
    assert (global_vector(one) - global_vector(dropout_fedavg())).abs().max() > 1e-3  # it trained


