"""A client module's torchmetrics objects in the batched backend's vectorized steps: updated for every
client as the sequential backend updates them, logged as it logs them; what the backend cannot run
refused at setup, before the first round; an outsider's module (BatchNorm, a Metric updated in
``training_step``, an LR scheduler, a dict returned) federated batched through the CLI."""

from __future__ import annotations

from pathlib import Path

import pytest
import pytorch_lightning as pl
import torch
import torch.nn.functional as F
from torch import nn
from torchmetrics import MeanMetric, MetricCollection
from torchmetrics.classification import MulticlassAccuracy, MulticlassF1Score

from fl_lightning.algorithms import SCAFFOLD, FedAvg
from fl_lightning.cli import FederatedCLI
from tests.helpers import synthetic, trainer

ROOT = Path(__file__).resolve().parents[1]
QUICK = str(ROOT / "configs" / "quickstart.yaml")


class MetricClient(pl.LightningModule):
    """A small classifier whose ``training_step`` uses its metric objects in one of the usual ways
    (``style``), misuses them, or does not use them (``"no metric"``)."""

    def __init__(self, style: str) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.style = style
        self.net = nn.Sequential(nn.Linear(20, 16), nn.ReLU(), nn.Linear(16, 10))
        self.acc = MulticlassAccuracy(num_classes=10)
        self.metrics = MetricCollection([MulticlassAccuracy(num_classes=10), MulticlassF1Score(num_classes=10)],
                                        prefix="train_")
        self.mean_loss = MeanMetric()

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        logits = self(x)
        loss = F.cross_entropy(logits, y)
        if self.style == "update, log the metric":
            self.acc.update(logits, y)
            self.log("train_acc", self.acc, on_step=False, on_epoch=True)
        elif self.style == "call, log the metric on step and epoch":
            self.acc(logits, y)
            self.log("train_acc", self.acc, on_step=True, on_epoch=True)
        elif self.style == "log the call's value":
            self.log("train_acc", self.acc(logits, y))
        elif self.style == "collection":
            self.metrics.update(logits, y)
            self.log_dict(self.metrics, on_epoch=True)
        elif self.style == "collection's values, a mean of the loss":
            self.log_dict(self.metrics(logits, y))
            self.mean_loss(loss)
            self.log("mean_loss", self.mean_loss)
        elif self.style == "compute":
            self.log("train_acc", self.acc.compute())
        elif self.style == "value in a computation":
            loss = loss + 0.0 * self.acc(logits, y)
        return {"loss": loss}

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def metric_states(module: pl.LightningModule) -> dict[str, torch.Tensor]:
    """The accumulated states of the client's metric objects."""
    return {f"{name}.{state}": getattr(m, state).clone() for name, m in module.client.named_modules()
            if hasattr(m, "_defaults") for state in m._defaults}


def fitted(style: str, backend: str, algorithm=FedAvg) -> tuple[pl.LightningModule, dict[str, float]]:
    module = algorithm(MetricClient(style), clients_per_round=4, local_steps=3, client_backend=backend,
                       clients_per_block=3, seed=1)  # blocks of 3 and 1
    t = trainer(2)
    t.fit(module, synthetic(6))
    return module, {k: float(v) for k, v in t.callback_metrics.items()}


@pytest.mark.parametrize("style, algorithm", [
    ("update, log the metric", FedAvg),
    ("call, log the metric on step and epoch", FedAvg),
    ("log the call's value", FedAvg),
    ("collection", FedAvg),
    ("collection's values, a mean of the loss", FedAvg),
    ("log the call's value", SCAFFOLD),  # a step that takes its gradient with torch.func.grad
])
def test_a_metric_updated_in_training_step_gives_the_sequential_backends_values(style, algorithm):
    """Two rounds of 4 clients in blocks of 3 and 1: the logged metrics equal the sequential backend's
    to 1e-6 (the metric's value over the round's steps of every client, the mean of its batch values),
    and the metrics' accumulated states are the same (every client's updates were made)."""
    sequential, logged = fitted(style, "sequential", algorithm)
    batched, logged_batched = fitted(style, "batched", algorithm)
    assert logged.keys() == logged_batched.keys()
    assert any(name.startswith(("train_", "mean_loss")) for name in logged), logged
    for name, value in logged.items():
        assert logged_batched[name] == pytest.approx(value, abs=1e-6), name
    states, batched_states = metric_states(sequential), metric_states(batched)
    assert states.keys() == batched_states.keys()
    for name, state in states.items():
        assert torch.allclose(state.float(), batched_states[name].float(), atol=1e-5), name


class Started(pl.Callback):
    """Whether the fit got past its setup."""

    def __init__(self) -> None:
        self.started = False

    def on_fit_start(self, trainer, pl_module) -> None:
        self.started = True


class PythonStateClient(MetricClient):
    """A ``training_step`` that keeps per-client Python state on the module."""

    def training_step(self, batch, batch_idx):
        self.seen_batches = getattr(self, "seen_batches", 0) + 1
        return super().training_step(batch, batch_idx)


class ItemClient(MetricClient):
    """A ``training_step`` that reads a tensor's value in Python."""

    def training_step(self, batch, batch_idx):
        out = super().training_step(batch, batch_idx)
        self.log("loss_value", out["loss"].item())
        return out


@pytest.mark.parametrize("client, match", [
    (lambda: MetricClient("compute"), r"the client's training_step cannot run in the batched backend: the "
                                      r"training_step reads self\.acc\.compute; in the batched backend a "
                                      r"training_step may update self\.acc .*client_backend='sequential'"),
    (lambda: MetricClient("value in a computation"), r"uses the value self\.acc\(\.\.\.\) returns in a computation; "
                                                     r".*client_backend='sequential'"),
    (lambda: PythonStateClient("no metric"),
     r"training_step changes Python state \(seen_batches\).*client_backend='sequential'"),
    (lambda: ItemClient("no metric"),
     r"ItemClient's training_step cannot be vectorized over clients: it reads a tensor's value in Python "
     r"\(\.item\(\).*client_backend='sequential'"),
])
def test_what_the_batched_step_cannot_run_is_refused_at_setup(client, match):
    """Refused in the module's setup (before the fit starts, so before any data is loaded for a
    round), naming the attribute and the way out; the client's metric objects are left untouched."""
    module = FedAvg(client(), clients_per_round=2, local_steps=2, client_backend="batched")
    started = Started()
    with pytest.raises(ValueError, match=match):
        trainer(1, callbacks=[started]).fit(module, synthetic(4))
    assert not started.started
    assert isinstance(module.client.acc, MulticlassAccuracy) and module.client.acc._update_count == 0
    assert not hasattr(module.client, "seen_batches")


class OutsiderNet(pl.LightningModule):
    """A module written for training on its own, as a new user brings it: BatchNorm, a torchmetrics
    ``Metric`` updated in ``training_step`` and logged, an LR scheduler, a dict returned."""

    def __init__(self, in_features: int = 60, num_classes: int = 10, lr: float = 0.05) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = nn.Sequential(nn.Linear(in_features, 32), nn.BatchNorm1d(32), nn.ReLU(),
                                 nn.Linear(32, num_classes))
        self.train_acc = MulticlassAccuracy(num_classes=num_classes)
        self.val_acc = MulticlassAccuracy(num_classes=num_classes)

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        logits = self(x)
        loss = F.cross_entropy(logits, y)
        self.train_acc(logits, y)
        self.log("train_acc", self.train_acc, on_step=False, on_epoch=True)
        self.log("train_loss", loss)
        return {"loss": loss, "logits": logits.detach()}

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.val_acc(self(x), y)
        self.log("val_acc", self.val_acc)

    def configure_optimizers(self):
        optimizer = torch.optim.SGD(self.parameters(), lr=self.hparams.lr, momentum=0.9)
        return [optimizer], [torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)]


def test_an_outsiders_module_federates_batched_through_the_cli(tmp_path, monkeypatch):
    """The quickstart's configuration with the outsider's module as the client: the batched backend's
    run logs what the sequential backend's logs (to 1e-5; BatchNorm's statistics are per client in
    both), and the client's learning rate follows its scheduler, once per round."""
    monkeypatch.setattr("sys.argv", ["fl-lightning"])
    logged = {}
    for backend in ("sequential", "batched"):
        cli = FederatedCLI(args=[
            "fit", "--config", QUICK, "--trainer.max_epochs", "2", "--trainer.logger", "false",
            "--trainer.enable_progress_bar", "false", "--trainer.check_val_every_n_epoch", "1",
            "--data.init_args.print_summary", "false", "--trainer.default_root_dir", str(tmp_path / backend),
            "--model.init_args.client.class_path", "tests.test_batched_metrics.OutsiderNet",
            "--model.init_args.local_steps", "3", "--model.init_args.client_backend", backend])
        assert cli.trainer.current_epoch == 2
        logged[backend] = {k: float(v) for k, v in cli.trainer.callback_metrics.items()}
        assert cli.model.lr_schedulers()[0].get_last_lr() == [0.05 * 0.5 ** 2]
    assert {"train_acc", "train_loss", "val_acc"} <= logged["batched"].keys()
    assert logged["batched"].keys() == logged["sequential"].keys()
    for name, value in logged["sequential"].items():
        assert logged["batched"][name] == pytest.approx(value, abs=1e-5), name
