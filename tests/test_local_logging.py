"""A client's ``self.log`` during local training: buffered, logged once per round as the
batch-size-weighted mean, with the options of the client's call."""

from __future__ import annotations

import math

import pytest
import pytorch_lightning as pl
import torch
import torch.nn.functional as F
from torch import nn

from fl_lightning.algorithms import FedAvg
from fl_lightning.callbacks import FederatedCallback
from fl_lightning.local_logging import LocalLogBuffer
from tests.helpers import synthetic, tiny_client, trainer


class LoggingClient(pl.LightningModule):
    """Logs its loss (epoch mean, on the progress bar), a step value and a running max at every step."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.layer = nn.Linear(20, 10)
        self.history: list[tuple[int, float, float]] = []  # (epoch, loss, batch size) of every local step

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self.layer(x), y)
        self.history.append((self.trainer.current_epoch, float(loss.detach()), len(y)))
        self.log("user_loss", loss, on_step=False, on_epoch=True, prog_bar=True)
        self.log("user_step_value", 2.0)
        self.log("user_max", loss, on_step=False, on_epoch=True, reduce_fx="max")
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


@pytest.fixture(scope="module")
def fitted():
    client = LoggingClient()
    calls: list[str] = []
    original = pl.LightningModule.log

    def counting_log(module, name, *args, **kwargs):
        calls.append(name)
        return original(module, name, *args, **kwargs)

    t = trainer(2)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(pl.LightningModule, "log", counting_log)
        t.fit(FedAvg(client, clients_per_round=3, local_steps=4), synthetic(6, batch_size=7))
    return t, client, calls


def test_client_logs_are_the_round_mean_of_its_local_steps(fitted):
    t, client, _ = fitted
    last = [(loss, n) for epoch, loss, n in client.history if epoch == 1]
    assert len(last) == 3 * 4
    expected = sum(loss * n for loss, n in last) / sum(n for _, n in last)
    assert float(t.callback_metrics["user_loss"]) == pytest.approx(expected, rel=1e-6)
    assert "user_loss" in t.progress_bar_metrics  # the client's options are kept
    assert float(t.callback_metrics["user_step_value"]) == 2.0


def test_other_reductions_pass_through_unbuffered(fitted):
    t, client, calls = fitted
    last = [loss for epoch, loss, _ in client.history if epoch == 1]
    assert float(t.callback_metrics["user_max"]) == pytest.approx(max(last), rel=1e-6)
    steps = len(client.history)
    assert calls.count("user_max") == steps  # one Lightning call per local step
    assert calls.count("user_loss") == 2 and calls.count("user_step_value") == 2  # one per round


class NaNBatches(FederatedCallback):
    """The local batches of each round's first client hold NaN features: its losses and its update
    are NaN, and the round excludes it."""

    def on_local_batch(self, trainer, module, client_id, batch):
        return (batch[0] * float("nan"), batch[1]) if client_id == module.engine.round_clients[0] else batch


def test_the_steps_of_an_excluded_client_are_left_out_of_the_client_logs():
    client = LoggingClient()
    t = trainer(2, callbacks=[NaNBatches()])
    with pytest.warns(RuntimeWarning, match="NaN or Inf"):
        t.fit(FedAvg(client, clients_per_round=3, local_steps=4), synthetic(6, batch_size=7))
    last = [(loss, n) for epoch, loss, n in client.history if epoch == 1]
    kept = [(loss, n) for loss, n in last if not math.isnan(loss)]
    assert len(last) == 3 * 4 and len(kept) == 2 * 4  # the excluded client's 4 steps are NaN
    expected = sum(x * n for x, n in kept) / sum(n for _, n in kept)
    assert float(t.callback_metrics["user_loss"]) == pytest.approx(expected, rel=1e-6)
    assert float(t.callback_metrics["round/excluded"]) == 1.0


@pytest.mark.parametrize("backend", ["sequential", "batched"])
def test_the_logged_loss_of_the_kept_clients_is_their_mean_loss(backend):
    """Every batch of 4 samples: the clients' logged ``train_loss`` (the mean over their steps) is the
    engine's ``round/client_loss`` (the mean over the kept clients of their mean step loss)."""
    t = trainer(2, callbacks=[NaNBatches()])
    with pytest.warns(RuntimeWarning, match="NaN or Inf"):
        t.fit(FedAvg(tiny_client(), clients_per_round=3, local_steps=3, client_backend=backend, clients_per_block=2),
              synthetic(6, batch_size=4))
    assert float(t.callback_metrics["round/excluded"]) == 1.0
    assert float(t.callback_metrics["train_loss"]) == pytest.approx(float(t.callback_metrics["round/client_loss"]),
                                                                    rel=1e-5)


def test_drop_leaves_out_every_value_of_the_given_clients():
    buffer = LocalLogBuffer()
    buffer.client_id = 3
    buffer.log("x", 1.0, batch_size=2)  # client 3's step
    buffer.add("x", torch.tensor([4.0, 10.0, 30.0]), 2, {}, (5, 3, 7))  # a block's step: clients 5, 3 and 7
    buffer.client_id = 7
    buffer.log("y", 8.0, batch_size=1)
    buffer.client_id = 5
    buffer.log("x", 0.5, batch_size=4)
    buffer.drop([3, 7])
    assert set(buffer._entries) == {"x"}
    entry = buffer._entries["x"]
    assert float(entry.total) == 4.0 + 0.5 * 4 and entry.weight == 2 + 4


def test_buffer_requires_a_client():
    buffer = LocalLogBuffer()
    buffer.log("x", 1.0)
    with pytest.raises(RuntimeError, match="bind"):
        buffer.flush()


def test_positional_options_are_named():
    """``self.log(name, value, True)`` is ``prog_bar=True`` as in Lightning."""
    buffer = LocalLogBuffer()
    buffer.log("x", torch.tensor(3.0), True, batch_size=2)
    buffer.log("x", 1.0, True, batch_size=6)
    entry = buffer._entries["x"]
    assert entry.options == {"prog_bar": True} and entry.weight == 8
    assert float(entry.total / entry.weight) == pytest.approx(1.5)
