"""Evaluation every n rounds reaches Lightning's loggers (CSV and TensorBoard)."""

from __future__ import annotations

import csv

import pytest
import pytorch_lightning as pl
from pytorch_lightning.loggers import CSVLogger, TensorBoardLogger

from fl_lightning.algorithms import FedAvg
from fl_lightning.callbacks import ClientMetrics, FederatedCallback
from tests.helpers import synthetic, tiny_client, trainer


def test_csv_and_tensorboard_get_global_and_client_metrics(tmp_path):
    csv_logger = CSVLogger(tmp_path, name="csv")
    tb_logger = TensorBoardLogger(tmp_path, name="tb")
    module = FedAvg(tiny_client(), clients_per_round=4, local_steps=2)
    trainer(4, logger=[csv_logger, tb_logger], check_val_every_n_epoch=2, callbacks=[ClientMetrics()]).fit(
        module, synthetic(6, test_fraction=0.2))
    with open(f"{csv_logger.log_dir}/metrics.csv") as f:
        rows = list(csv.DictReader(f))
    evaluated = sorted({int(float(r["epoch"])) for r in rows if r.get("val_acc")})
    assert evaluated == [1, 3]  # every 2 rounds
    assert any(r.get("clients_test/acc_worst") for r in rows)
    losses = [float(r["round/client_loss"]) for r in rows if r.get("round/client_loss")]
    assert len(losses) == 4 and losses[-1] < losses[0]  # one mean local loss per round, decreasing
    assert any(p.name.startswith("events.out.tfevents") for p in (tmp_path / "tb").rglob("*"))


def test_metrics_are_logged_per_round_with_the_round_as_step(tmp_path):
    """Global, client and federated metrics reach the logger every round, at step = round, even
    with log_every_n_steps far above the work items of a round."""
    logger = CSVLogger(tmp_path)
    t = trainer(4, logger=logger, log_every_n_steps=1000, check_val_every_n_epoch=2)
    t.fit(FedAvg(tiny_client(), clients_per_round=3, local_steps=2), synthetic(4))
    with open(f"{logger.log_dir}/metrics.csv") as f:
        rows = list(csv.DictReader(f))
    assert sorted(int(r["step"]) for r in rows if r.get("train_loss")) == [1, 2, 3, 4]  # the client's own log
    assert sorted(int(r["step"]) for r in rows if r.get("round/client_loss")) == [1, 2, 3, 4]
    assert sorted(int(r["step"]) for r in rows if r.get("val_acc")) == [2, 4]  # after rounds 2 and 4


def test_the_progress_bar_counts_rounds_and_clients(capsys, caplog):
    from pytorch_lightning.callbacks import TQDMProgressBar

    from fl_lightning.progress import RoundProgressBar

    seen = []

    class Probe(FederatedCallback):
        def on_round_start(self, trainer, module, round_idx, clients):
            bar = trainer.progress_bar_callback
            seen.append((type(bar), bar.train_progress_bar.desc, bar.train_progress_bar.unit))

    t = pl.Trainer(max_epochs=2, callbacks=[TQDMProgressBar(), Probe()], logger=False, enable_checkpointing=False,
                   enable_model_summary=False, num_sanity_val_steps=0, accelerator="cpu")
    with caplog.at_level("INFO"):
        t.fit(FedAvg(tiny_client(), clients_per_round=3, local_steps=1), synthetic(4))
    assert seen == [(RoundProgressBar, "Round 1/2: ", "client"), (RoundProgressBar, "Round 2/2: ", "client")]
    captured = capsys.readouterr()
    shown = captured.out + captured.err
    assert "Round 2/2" in shown and "Epoch" not in shown  # no line names an epoch, not even for a moment
    assert "will override existing callbacks" not in caplog.text  # the bar's replacement is not news


def test_the_rich_progress_bar_counts_rounds():
    pytest.importorskip("rich")
    from pytorch_lightning.callbacks import RichProgressBar

    from fl_lightning.progress import RichRoundProgressBar

    seen = []

    class Probe(FederatedCallback):
        def on_round_start(self, trainer, module, round_idx, clients):
            bar = trainer.progress_bar_callback
            seen.append((type(bar), bar._get_train_description(trainer.current_epoch).strip()))

    t = pl.Trainer(max_epochs=2, callbacks=[RichProgressBar(), Probe()], logger=False, enable_checkpointing=False,
                   enable_model_summary=False, num_sanity_val_steps=0, accelerator="cpu")
    t.fit(FedAvg(tiny_client(), clients_per_round=3, local_steps=1), synthetic(4))
    assert seen == [(RichRoundProgressBar, "Round 1/2"), (RichRoundProgressBar, "Round 2/2")]
