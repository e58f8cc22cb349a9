"""A client's ``self.log`` during local training: buffered, logged once per round as the
batch-size-weighted mean, with the options of the client's call."""

from __future__ import annotations

import pytest
import pytorch_lightning as pl
import torch
import torch.nn.functional as F
from torch import nn

from fl_lightning.algorithms import FedAvg
from fl_lightning.local_logging import LocalLogBuffer
from tests.helpers import synthetic, trainer


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
