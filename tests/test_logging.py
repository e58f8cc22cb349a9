"""Evaluation every n rounds reaches Lightning's loggers (CSV and TensorBoard)."""

from __future__ import annotations

import csv

import pytest
import pytorch_lightning as pl
import torch
from pytorch_lightning.loggers import CSVLogger, TensorBoardLogger

from fl_lightning.algorithms import FedAvg
from fl_lightning.callbacks import ClientMetrics, FederatedCallback
from fl_lightning.models import LogisticRegression
from tests.helpers import TWO_PROCESSES, global_vector, synthetic, tiny_client, trainer


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


class SyncedLoss(LogisticRegression):
    """A client that also logs its loss with ``sync_dist=True``, as many Lightning modules do, and
    without, as most do."""

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        self.log("synced_loss", loss, sync_dist=True)
        self.log("own_loss", loss)
        return loss


def test_a_client_log_on_two_processes_is_the_mean_over_all_their_samples():
    """Two processes whose clients trained on different numbers of samples log the mean over all of
    them, what one process logs, with ``sync_dist=True`` (Lightning's own sync floors their mean sample
    count) or without (before, the first process's clients' mean: 1.3209 for 1.4404)."""
    logged = {}
    for devices in (1, 2):
        torch.manual_seed(0)
        module = FedAvg(SyncedLoss(in_features=20, num_classes=10, lr=0.1), clients_per_round=5, local_epochs=1)
        fit = trainer(2, devices=devices, strategy=TWO_PROCESSES if devices > 1 else "auto")
        fit.fit(module, synthetic(5, seed=1))  # 351 samples: 3 clients on one process, 2 on the other
        logged[devices] = {name: float(fit.callback_metrics[name]) for name in ("synced_loss", "train_loss",
                                                                              "own_loss")}, \
            global_vector(module)
    (one, model_one), (two, model_two) = logged[1], logged[2]
    assert one["synced_loss"] == pytest.approx(one["train_loss"], abs=1e-7)
    assert two["synced_loss"] == pytest.approx(one["synced_loss"], abs=1e-6)
    assert two["train_loss"] == pytest.approx(one["train_loss"], abs=1e-6)  # the bundled Classifier's: synced
    assert two["own_loss"] == pytest.approx(one["own_loss"], abs=1e-6)
    assert one["own_loss"] == pytest.approx(one["train_loss"], abs=1e-7)
    assert (model_two - model_one).abs().max() <= 1e-5


@pytest.mark.parametrize("lightning_imported_last", [False, True])
def test_the_progress_bar_counts_rounds_and_clients(capsys, caplog, lightning_imported_last):
    """Also where the unified ``lightning`` package was imported after ``pytorch_lightning``: Lightning then
    logs its notices under ``lightning.pytorch``'s logger (lightning_utilities keeps one, named on import)."""
    import importlib

    import lightning_utilities.core.rank_zero as rank_zero_module
    from pytorch_lightning.callbacks import TQDMProgressBar

    if lightning_imported_last:
        importlib.reload(importlib.import_module("lightning.pytorch.utilities.rank_zero"))
    else:
        importlib.reload(importlib.import_module("pytorch_lightning.utilities.rank_zero"))
    package = "lightning.pytorch" if lightning_imported_last else "pytorch_lightning"
    assert rank_zero_module.log.name == f"{package}.utilities.rank_zero"

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


def test_the_learning_rate_monitor_names_the_server_and_the_client_rates(tmp_path):
    from pytorch_lightning.callbacks import LearningRateMonitor

    logger = CSVLogger(tmp_path)
    module = FedAvg(tiny_client(lr=0.1), clients_per_round=2, local_steps=1, server_lr=0.5)
    trainer(2, logger=logger, callbacks=[LearningRateMonitor(logging_interval="epoch")]).fit(module, synthetic(4))
    with open(f"{logger.log_dir}/metrics.csv") as f:
        rows = list(csv.DictReader(f))
    assert {k for r in rows for k, v in r.items() if k.startswith("lr-") and v} == {"lr-server", "lr-client"}
    assert [float(r["lr-server"]) for r in rows if r.get("lr-server")] == [0.5, 0.5]
    assert [float(r["lr-client"]) for r in rows if r.get("lr-client")] == [0.1, 0.1]


def test_the_loggers_hyperparameters_hold_the_client_and_the_data(tmp_path):
    """hparams.yaml: the algorithm's arguments, the client's under ``client`` and the
    datamodule's under ``data`` (nested: the seed of each is its own, no collision)."""
    import yaml

    logger = TensorBoardLogger(tmp_path)
    module = FedAvg(tiny_client(lr=0.3), clients_per_round=2, local_steps=1, seed=5)
    trainer(1, logger=logger).fit(module, synthetic(4, seed=2))
    hparams = yaml.safe_load((tmp_path / "lightning_logs" / "version_0" / "hparams.yaml").read_text())
    assert hparams["clients_per_round"] == 2 and hparams["seed"] == 5
    assert hparams["client"]["class_path"].endswith(".LogisticRegression")
    assert {k: hparams["client"]["init_args"][k] for k in ("in_features", "lr")} == {"in_features": 20, "lr": 0.3}
    assert hparams["data"]["class_path"].endswith(".SyntheticFederated")
    assert hparams["data"]["init_args"]["num_clients"] == 4 and hparams["data"]["init_args"]["seed"] == 2
