"""Evaluation every n rounds reaches Lightning's loggers (CSV and TensorBoard)."""

from __future__ import annotations

import csv

from pytorch_lightning.loggers import CSVLogger, TensorBoardLogger

from fl_lightning.algorithms import FedAvg
from fl_lightning.callbacks import ClientMetrics
from tests.helpers import synthetic, tiny_client, trainer


def test_csv_and_tensorboard_get_global_and_client_metrics(tmp_path):
    csv_logger = CSVLogger(tmp_path, name="csv")
    tb_logger = TensorBoardLogger(tmp_path, name="tb")
    module = FedAvg(tiny_client(), clients_per_round=4, local_steps=2)
    trainer(4, logger=[csv_logger, tb_logger], check_val_every_n_epoch=2, callbacks=[ClientMetrics()]).fit(
        module, synthetic(6, test_fraction=0.2))
    with open(f"{csv_logger.log_dir}/metrics.csv") as f:
        rows = list(csv.DictReader(f))
    evaluated = sorted({int(r["epoch"]) for r in rows if r.get("val_acc")})
    assert evaluated == [1, 3]  # every 2 rounds
    assert any(r.get("clients/acc_worst") for r in rows)
    losses = [float(r["round/client_loss"]) for r in rows if r.get("round/client_loss")]
    assert len(losses) == 4 and losses[-1] < losses[0]  # one mean local loss per round, decreasing
    assert any(p.name.startswith("events.out.tfevents") for p in (tmp_path / "tb").rglob("*"))
