"""``RoundHistory``: the run's per-round history on disk, and a summary at the end.

After every round the callback adds one row to ``history.csv`` and ``history.json`` in the
run's log folder: the round (1-based: the loggers' step), the sampled clients, the updates left out
for NaN/Inf, whether the round was refused (its result not finite), the mean client loss, and every
scalar metric logged for that round (training, validation, client metrics); a metric not logged in
the round (the client losses of a round that kept no update) has no value in its row, not an earlier
round's. A round costs the same whatever the run's length: its row is appended to ``history.csv``
(the file is rewritten only when a metric appears for the first time, since the header names every
column), so a crash keeps the rounds done; ``history.json`` is rewritten at most every
``json_every_s`` seconds, and when the fit ends or fails. At the start it writes ``partition.json``
(``FederatedDataModule.partition_record``): every client's label counts (train split; class labels
only), which clients are held out, and what the targets are.
When the run ends it prints a table of each metric's first, last and best value, and where the
files are (and, for a resumed run, the checkpoint it resumed and the folder of the run that wrote
it, where that is another). :func:`read_history` reads the rows back; ``fl-lightning plot RUN_DIR``
(:mod:`fl_lightning.plotting`) draws them.

Every federation has one where the Trainer has a logger: a ``FederatedModule`` adds a
``RoundHistory()`` (writing into the logger's folder) unless the Trainer has a ``RoundHistory`` of
its own, which is used instead (``RoundHistory(summary=False)``: the files without the table;
another ``dirpath``); without a logger, none is added. ``fl-lightning fit`` adds one unless the
configuration has one, also without a logger (into ``default_root_dir``).
"""

from __future__ import annotations

import csv
import json
import math
import os
import time
from typing import Any, Optional

from torch import Tensor

from fl_lightning.callbacks.checkpoint import checkpoint_run
from fl_lightning.callbacks.metric_direction import direction_from_name
from fl_lightning.hooks import FederatedCallback, Federation, add_default_callback
from fl_lightning.lightning_compat import unlogged_training_metrics
from fl_lightning.lightning_package import pl

#: the accounting metrics every row holds, with their values in a round that did not log them
#: (``round/refused`` is logged from a fit's first refused round on)
ROW_DEFAULTS = {"round/excluded": 0.0, "round/refused": 0.0}
#: metrics that are accounting, not quality: the summary gives no best value for them
NO_BEST = ("excluded", "refused", "epsilon", "noise_multiplier", "byzantine_fraction", "weiszfeld", "num_clients")


class RoundHistory(FederatedCallback):
    """Writes ``history.csv``, ``history.json`` and ``partition.json`` into ``dirpath`` and
    prints a summary when the fit ends.

    Args:
        dirpath: the folder (default: the Trainer's ``log_dir``, else its ``default_root_dir``).
        summary: print the end-of-run table.
        json_every_s: rewrite ``history.json`` at most this often (seconds; 0: after every round).
            It is written after the fit's first round, when the fit ends and when it raises, so a
            finished or failed run's files hold the same rows; a process killed outright (SIGKILL,
            power loss) may leave ``history.json`` up to this many seconds behind
            ``history.csv``, which always holds every round done (:func:`read_history` reads both).
    """

    def __init__(self, dirpath: Optional[str] = None, summary: bool = True, json_every_s: float = 10.0) -> None:
        if not json_every_s >= 0 or math.isinf(json_every_s):
            raise ValueError(f"RoundHistory: json_every_s must be a finite number of seconds >= 0 "
                             f"(0: after every round), got {json_every_s!r}")
        self.dirpath = dirpath
        self.summary = summary
        self.json_every_s = json_every_s
        self.rows: list[dict[str, Any]] = []
        #: each row as JSON text, the checkpoint's form of the rows (:meth:`state_dict`)
        self._row_texts: list[str] = []
        self._open: Optional[dict[str, Any]] = None
        self._before_validation: dict[str, float] = {}
        self._validation_names: set[str] = set()
        self._validated = False
        self._folder: Optional[str] = None
        self._csv_columns: Optional[list[str]] = None  # the header of the history.csv written by this fit
        self._json_written_at: Optional[float] = None  # time.monotonic() of this fit's last history.json
        self._json_behind = False  # rows closed since history.json was last written
        self._resumed: Optional[tuple[str, int]] = None  # this fit's checkpoint, and the rounds done in it

    @staticmethod
    def default(trainer: pl.Trainer) -> Optional["RoundHistory"]:
        """The ``RoundHistory`` every federation's Trainer gets (:func:`~fl_lightning.hooks.add_default_callback`):
        one into the logger's folder where the Trainer has a logger and no ``RoundHistory`` of its own, else None."""
        if not trainer.loggers or any(isinstance(c, RoundHistory) for c in trainer.callbacks):
            return None
        return RoundHistory()

    def folder(self, trainer: pl.Trainer) -> str:
        """Where the files go. Every process must call it: ``trainer.log_dir`` is a collective
        (rank 0 broadcasts its folder), and a call on rank 0 alone deadlocks a DDP run."""
        return self.dirpath or trainer.log_dir or trainer.default_root_dir

    # ------------------------------------------------------------ collecting
    def on_fit_start(self, trainer: pl.Trainer, pl_module: Federation) -> None:
        dm = pl_module.engine.datamodule
        self._folder = self.folder(trainer)  # on every process (a collective), before rank 0 writes
        # the fit's first row rewrites both files (the folder may be new, or hold a crashed run's)
        self._csv_columns, self._json_written_at, self._json_behind = None, None, False
        if trainer.is_global_zero:
            partition = dm.partition_record()
            os.makedirs(self._folder, exist_ok=True)
            with open(os.path.join(self._folder, "partition.json"), "w") as f:
                json.dump(partition, f)

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # after the checkpoint's training state is restored: its rounds are the current epoch
        ckpt_path = trainer.ckpt_path
        self._resumed = (str(ckpt_path), trainer.current_epoch) if ckpt_path else None

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
        self._open = {"round": round_idx + 1, "clients": list(module.engine.round_clients),
                      "updates": module.engine.round_num_updates}

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # the round ended in its last work item and its validation ran after it: every metric of
        # the round is in. Checkpoint callbacks run after this hook (Lightning calls them last),
        # so the checkpoint of a round holds the round's row and a resumed run loses none
        self._close(trainer)

    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._write_json_if_behind(trainer)
        # after on_train_end, where the progress bar closes its line
        if self.summary and trainer.is_global_zero and self.rows:
            assert self._folder is not None, "set in on_fit_start"
            print(summary_table(self.rows))
            print(where_written(self._folder, self._resumed))

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        self._write_json_if_behind(trainer)

    def _close(self, trainer: pl.Trainer) -> None:
        if self._open is None:
            return
        row, self._open = self._open, None
        # a metric keeps its last value in callback_metrics until it is logged again: a row takes the
        # validation metrics in the rounds that validated, the training metrics in the rounds that logged them
        unlogged = unlogged_training_metrics(trainer)
        logged = {name: value for name, value in _scalars(trainer.callback_metrics).items()
                  if name not in ("step", "epoch")
                  and (self._validated if name in self._validation_names else name not in unlogged)}
        row.update(sorted({**ROW_DEFAULTS, **logged}.items()))
        self._validated = False
        self.rows.append(row)
        self._row_texts.append(json.dumps(row))
        if trainer.is_global_zero:
            self._write()

    def _write(self) -> None:
        folder = self._folder
        assert folder is not None, "set in on_fit_start"
        os.makedirs(folder, exist_ok=True)
        path, row = os.path.join(folder, "history.csv"), self.rows[-1]
        if self._csv_columns is not None and row.keys() <= {*self._csv_columns, "clients"}:
            append_csv_row(path, row, self._csv_columns)
        else:  # the fit's first row, or a metric's first: the header changes
            self._csv_columns = csv_columns(self.rows)
            write_csv(path, self.rows, self._csv_columns)
        self._json_behind = True
        if self._json_written_at is None or time.monotonic() - self._json_written_at >= self.json_every_s:
            self._write_json()

    def _write_json_if_behind(self, trainer: pl.Trainer) -> None:
        if self._json_behind and trainer.is_global_zero:
            self._write_json()

    def _write_json(self) -> None:
        assert self._folder is not None, "set in on_fit_start"
        write_json(os.path.join(self._folder, "history.json"), self.rows)
        self._json_written_at, self._json_behind = time.monotonic(), False

    # ------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:
        """The rows as one JSON text: a checkpoint is written every round, and copied on the way
        (``RoundCheckpoint``) and checksummed by walking it, so rows as nested lists and dicts would
        make each checkpoint cost more than the last (a thousand rounds: ~20,000 values walked and
        copied every round); one string costs the same in every round. Each row is made text once,
        when its round closes."""
        return {"rows_json": "[" + ",".join(self._row_texts) + "]"}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        # "rows": the rows themselves, as checkpoints written before the rows were one text hold them
        self.rows = json.loads(state_dict["rows_json"]) if "rows_json" in state_dict else list(state_dict.get("rows", []))
        self._row_texts = [json.dumps(row) for row in self.rows]


add_default_callback(RoundHistory.default)


def where_written(folder: str, resumed: Optional[tuple[str, int]] = None) -> str:
    """The summary's last line: the folder of the history files and, for a fit that resumed
    ``resumed = (checkpoint, rounds done in it)``, the checkpoint, and the folder of the run that wrote
    it where that is another (its logs and checkpoints of the earlier rounds)."""
    line = f"history: {folder} (history.csv, history.json, partition.json)"
    if resumed is None:
        return line
    checkpoint, rounds = resumed
    line += f"; resumed after round {rounds} from {checkpoint}"
    run = checkpoint_run(checkpoint)
    if run is not None and os.path.realpath(run) != os.path.realpath(folder):
        line += f", whose run's folder {run} holds the logs of the rounds before"
    return line


def csv_columns(rows: list[dict[str, Any]]) -> list[str]:
    """The columns of ``history.csv`` before ``clients`` (the last): ``round``, ``updates``, then
    every other name in ``rows``, sorted."""
    return ["round", "updates"] + sorted({k for row in rows for k in row} - {"round", "updates", "clients"})


def _csv_writer(f: Any, columns: list[str]) -> csv.DictWriter:
    return csv.DictWriter(f, fieldnames=columns + ["clients"])


def _csv_row(row: dict[str, Any], columns: list[str]) -> dict[str, Any]:
    return {**{k: row.get(k, "") for k in columns}, "clients": " ".join(map(str, row["clients"]))}


def write_csv(path: str, rows: list[dict[str, Any]], columns: list[str]) -> None:
    """Write ``history.csv`` anew: the header, then a line per row (a metric a row lacks is empty)."""
    with open(path, "w", newline="") as f:
        writer = _csv_writer(f, columns)
        writer.writeheader()
        writer.writerows(_csv_row(row, columns) for row in rows)


def append_csv_row(path: str, row: dict[str, Any], columns: list[str]) -> None:
    """Append ``row`` to a ``history.csv`` whose header is ``columns`` (and ``clients``)."""
    with open(path, "a", newline="") as f:
        _csv_writer(f, columns).writerow(_csv_row(row, columns))


def write_json(path: str, rows: list[dict[str, Any]]) -> None:
    """Write ``history.json`` anew: the list of rows."""
    with open(path, "w") as f:
        json.dump(rows, f)


def read_history(folder: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """The rows ``RoundHistory`` wrote into ``folder``: those of ``history.json``, then the rounds
    only ``history.csv`` holds yet (a run in progress, or one killed between two writes of
    ``history.json``: see ``json_every_s``), read back as written (``round`` and ``updates`` ints,
    ``clients`` a list of ints, every other non-empty cell a float)."""
    with open(os.path.join(folder, "history.json")) as f:
        rows: list[dict[str, Any]] = json.load(f)
    csv_path = os.path.join(folder, "history.csv")
    if not os.path.isfile(csv_path):
        return rows
    with open(csv_path, newline="") as f:
        table = list(csv.DictReader(f))
    done = rows[-1]["round"] if rows else 0
    for line in table:
        if int(line["round"]) > done:
            clients = line.pop("clients")
            row: dict[str, Any] = {"round": int(line.pop("round")), "clients": [int(c) for c in clients.split()],
                                   "updates": int(line.pop("updates"))}
            rows.append({**row, **{k: float(v) for k, v in line.items() if v != ""}})
    return rows


def _scalars(metrics: dict[str, Any]) -> dict[str, float]:
    """The scalar entries of a metrics dict, as floats."""
    out = {}
    for name, value in metrics.items():
        if isinstance(value, Tensor) and value.numel() == 1:
            out[name] = float(value)
        elif isinstance(value, (int, float)):
            out[name] = float(value)
    return out


def _counted(n: int, noun: str) -> str:
    """``n`` and ``noun``, plural unless ``n`` is 1: ``"1 round"``, ``"30 rounds"``."""
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"


def summary_table(rows: list[dict[str, Any]]) -> str:
    """A table of every metric's first, last and best value over ``rows``, and the best's round."""
    names = sorted({k for row in rows for k, v in row.items() if isinstance(v, float)} - {"updates"})
    excluded = int(sum(row.get("round/excluded", 0.0) for row in rows))
    refused = int(sum(row.get("round/refused", 0.0) for row in rows))
    width = max([28, *(len(name) for name in names)])
    lines = [f"fl_lightning: {_counted(len(rows), 'round')}, {_counted(len(rows[-1]['clients']), 'client')} in the "
             f"last, {_counted(excluded, 'update')} left out for NaN/Inf"
             + (f", {_counted(refused, 'round')} refused (a result not finite)" if refused else ""),
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
