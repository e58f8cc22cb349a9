"""``RoundHistory``: the run's per-round history on disk, and a summary at the end.

After every round the callback appends one row to ``history.csv`` and ``history.json`` in the
run's log folder: the round (1-based: the loggers' step), the sampled clients, the updates left out for NaN/Inf, the mean
client loss, and every scalar metric logged for that round (training, validation, client
metrics). The files are rewritten each round, so a crash keeps the rounds done. At the start it
writes ``partition.json``: every client's label counts (train split) and which clients are held
out. When the run ends it prints a table of each metric's first, last and best value.
``fl-lightning plot RUN_DIR`` (:mod:`fl_lightning.plotting`) draws the files.
``fl-lightning fit`` adds this callback unless the configuration has one.
"""

from __future__ import annotations

import csv
import json
import math
import os
from typing import Any, Optional

import pytorch_lightning as pl
from torch import Tensor

from fl_lightning.callbacks.metric_direction import direction_from_name
from fl_lightning.hooks import FederatedCallback, Federation

#: metrics that are accounting, not quality: the summary gives no best value for them
NO_BEST = ("excluded", "epsilon", "noise_multiplier", "byzantine_fraction", "weiszfeld", "num_clients")


class RoundHistory(FederatedCallback):
    """Writes ``history.csv``, ``history.json`` and ``partition.json`` into ``dirpath`` and
    prints a summary when the fit ends.

    Args:
        dirpath: the folder (default: the Trainer's ``log_dir``, else its ``default_root_dir``).
        summary: print the end-of-run table.
    """

    def __init__(self, dirpath: Optional[str] = None, summary: bool = True) -> None:
        self.dirpath = dirpath
        self.summary = summary
        self.rows: list[dict[str, Any]] = []
        self._open: Optional[dict[str, Any]] = None
        self._before_validation: dict[str, float] = {}
        self._validation_names: set[str] = set()
        self._validated = False
        self._folder: Optional[str] = None

    def folder(self, trainer: pl.Trainer) -> str:
        """Where the files go. Every process must call it: ``trainer.log_dir`` is a collective
        (rank 0 broadcasts its folder), and a call on rank 0 alone deadlocks a DDP run."""
        return self.dirpath or trainer.log_dir or trainer.default_root_dir

    # ------------------------------------------------------------ collecting
    def on_fit_start(self, trainer: pl.Trainer, pl_module: Federation) -> None:
        dm = pl_module.datamodule
        self._folder = self.folder(trainer)  # on every process (a collective), before rank 0 writes
        if trainer.is_global_zero:
            partition = {
                "datamodule": type(dm).__name__,
                "clients": [dm.label_histogram(c).tolist() for c in range(dm.num_clients)],
                "train_sizes": [dm.num_samples(c) for c in range(dm.num_clients)],
                "unseen_clients": list(dm.unseen_clients),
            }
            os.makedirs(self._folder, exist_ok=True)
            with open(os.path.join(self._folder, "partition.json"), "w") as f:
                json.dump(partition, f)

    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not trainer.sanity_checking:
            self._before_validation = _scalars(trainer.callback_metrics)

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.sanity_checking:
            return
        # Lightning keeps a metric's last value until it is logged again: a row takes the
        # validation metrics only in the rounds that validated, and the metrics that appear or
        # change while validating are the validation metrics
        after = _scalars(trainer.callback_metrics)
        self._validation_names |= {k for k, v in after.items() if self._before_validation.get(k) != v}
        self._validated = True

    def on_round_end(self, trainer: pl.Trainer, module: Federation, round_idx: int, aggregate: Any) -> None:
        self._open = {"round": round_idx + 1, "clients": list(module.round_clients),
                      "updates": module.round_num_updates}

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # the round ended in its last work item and its validation ran after it: every metric of
        # the round is in. Checkpoint callbacks run after this hook (Lightning calls them last),
        # so the checkpoint of a round holds the round's row and a resumed run loses none
        self._close(trainer)

    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # after on_train_end, where the progress bar closes its line
        if self.summary and trainer.is_global_zero and self.rows:
            print(summary_table(self.rows))

    def _close(self, trainer: pl.Trainer) -> None:
        if self._open is None:
            return
        row, self._open = self._open, None
        for name, value in sorted(_scalars(trainer.callback_metrics).items()):
            if name not in ("step", "epoch") and (self._validated or name not in self._validation_names):
                row[name] = value
        self._validated = False
        row.setdefault("round/excluded", 0.0)
        self.rows.append(row)
        if trainer.is_global_zero:
            self._write()

    def _write(self) -> None:
        folder = self._folder
        assert folder is not None, "set in on_fit_start"
        os.makedirs(folder, exist_ok=True)
        with open(os.path.join(folder, "history.json"), "w") as f:
            json.dump(self.rows, f)
        columns = ["round", "updates"] + sorted({k for row in self.rows for k in row} - {"round", "updates", "clients"})
        with open(os.path.join(folder, "history.csv"), "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=columns + ["clients"])
            writer.writeheader()
            for row in self.rows:
                writer.writerow({**{k: row.get(k, "") for k in columns}, "clients": " ".join(map(str, row["clients"]))})

    # ------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:
        return {"rows": self.rows}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.rows = list(state_dict.get("rows", []))


def _scalars(metrics: dict[str, Any]) -> dict[str, float]:
    """The scalar entries of a metrics dict, as floats."""
    out = {}
    for name, value in metrics.items():
        if isinstance(value, Tensor) and value.numel() == 1:
            out[name] = float(value)
        elif isinstance(value, (int, float)):
            out[name] = float(value)
    return out


def summary_table(rows: list[dict[str, Any]]) -> str:
    """A table of every metric's first, last and best value over ``rows`` (the best's round in brackets)."""
    names = sorted({k for row in rows for k, v in row.items() if isinstance(v, float)} - {"updates"})
    excluded = int(sum(row.get("round/excluded", 0.0) for row in rows))
    width = max([28, *(len(name) for name in names)])
    lines = [f"fl_lightning: {len(rows)} rounds, {len(rows[-1]['clients'])} clients in the last, "
             f"{excluded} updates left out for NaN/Inf",
             f"{'metric':<{width}} {'first':>10} {'last':>10} {'best':>10}  round"]
    for name in names:
        series = [(row["round"], row[name]) for row in rows if name in row and not math.isnan(row[name])]
        if not series:
            continue
        if any(word in name for word in NO_BEST):
            lines.append(f"{name:<{width}} {series[0][1]:>10.4g} {series[-1][1]:>10.4g} {'-':>10}")
            continue
        lower = direction_from_name(name) is False  # higher is better unless the name says otherwise
        best_round, best = (min if lower else max)(series, key=lambda item: item[1])
        lines.append(f"{name:<{width}} {series[0][1]:>10.4g} {series[-1][1]:>10.4g} {best:>10.4g}  {best_round}")
    return "\n".join(lines)
