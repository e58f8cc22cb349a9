"""RoundHistory (per-round history.csv/json, partition.json, the end-of-run summary) and the
plots drawn from it (``fl-lightning plot``)."""

from __future__ import annotations

import csv
import io
import json
from pathlib import Path

import pytest

from fl_lightning.algorithms import FedAvg
from fl_lightning.callbacks import ClientMetrics, FederatedCallback, RoundCheckpoint, RoundHistory
from fl_lightning.callbacks import history as history_module
from fl_lightning.callbacks.history import read_history, summary_table
from fl_lightning.cli import FederatedCLI, main
from fl_lightning.plotting import Run, load_run, metric_names, plot_label_distribution, plot_metrics
from tests.helpers import RegressionData, Regressor, synthetic, tiny_client, trainer

PNG = b"\x89PNG\r\n\x1a\n"
QUICKSTART = str(Path(__file__).parents[1] / "configs" / "quickstart.yaml")


class PoisonRound2(FederatedCallback):
    """Turns the first update of round 2 into NaN; records what validation logged."""

    def __init__(self) -> None:
        self.validated: dict[int, float] = {}

    def on_client_update(self, trainer, module, update):
        if module.current_epoch == 1 and update.client_id == module.engine.round_clients[0]:
            update.tensors["delta"] = update.tensors["delta"] * float("nan")
        return update

    def on_validation_end(self, trainer, module):
        self.validated[module.current_epoch + 1] = float(trainer.callback_metrics["val_acc"])


def fit(tmp_path, rounds=4, **kwargs):
    record, history = PoisonRound2(), RoundHistory(dirpath=str(tmp_path))
    module = FedAvg(tiny_client(), clients_per_round=3, local_steps=2, seed=1)
    t = trainer(rounds, callbacks=[record, history, ClientMetrics(split="val")], check_val_every_n_epoch=2, **kwargs)
    with pytest.warns(RuntimeWarning, match="NaN or Inf"):
        t.fit(module, synthetic(6))
    return t, record, history


def test_history_has_a_row_per_round_with_fresh_metrics_only(tmp_path, capsys):
    _, record, history = fit(tmp_path)
    rows = json.loads((tmp_path / "history.json").read_text())
    assert rows == history.rows
    assert [r["round"] for r in rows] == [1, 2, 3, 4]
    assert [r["updates"] for r in rows] == [3, 2, 3, 3] and [r["round/excluded"] for r in rows] == [0, 1, 0, 0]
    assert all(len(r["clients"]) == 3 and r["clients"] == sorted(r["clients"]) for r in rows)
    # validation ran after rounds 2 and 4: its metrics are in those rows, with the logged values, and nowhere else
    assert {r["round"]: r["val_acc"] for r in rows if "val_acc" in r} == record.validated == pytest.approx(
        {2: rows[1]["val_acc"], 4: rows[3]["val_acc"]})
    assert ["clients_val/acc_mean" in r for r in rows] == [False, True, False, True]
    assert all("round/client_loss" in r and "train_loss" in r for r in rows)
    with open(tmp_path / "history.csv", newline="") as f:
        table = list(csv.DictReader(f))
    assert [int(r["round"]) for r in table] == [1, 2, 3, 4] and table[0]["val_acc"] == ""
    assert float(table[3]["val_acc"]) == pytest.approx(rows[3]["val_acc"])
    out = capsys.readouterr().out
    assert "4 rounds, 3 clients in the last, 1 update left out for NaN/Inf" in out
    best = max((2, 4), key=lambda r: record.validated[r])
    line = next(line for line in out.splitlines() if line.startswith("val_acc "))
    assert line.split()[1:] == [f"{record.validated[2]:.4g}", f"{record.validated[4]:.4g}",
                               f"{record.validated[best]:.4g}", str(best)]


class PoisonEveryUpdateOfRound2(FederatedCallback):
    """Turns every update of round 2 into NaN: the round keeps none."""

    def on_client_update(self, trainer, module, update):
        if module.current_epoch == 1:
            update.tensors = {name: t * float("nan") for name, t in update.tensors.items()}
        return update


def test_a_round_that_keeps_no_update_repeats_no_client_figure(tmp_path):
    history = RoundHistory(dirpath=str(tmp_path), summary=False, json_every_s=0)
    t = trainer(3, callbacks=[PoisonEveryUpdateOfRound2(), history])
    with pytest.warns(RuntimeWarning, match="NaN or Inf"):
        t.fit(FedAvg(tiny_client(), clients_per_round=3, local_steps=2, seed=1), synthetic(6))
    rows = read_history(tmp_path)
    assert [(r["updates"], r["round/excluded"], r["round/refused"]) for r in rows] == [
        (3, 0.0, 0.0), (0, 3.0, 0.0), (3, 0.0, 0.0)]
    assert "round/refused" not in t.callback_metrics  # logged from a fit's first refused round on only
    figures = ("round/client_loss", "train_loss")  # the engine's mean local loss, the client module's own
    assert [[name in r for name in figures] for r in rows] == [[True, True], [False, False], [True, True]]
    with open(tmp_path / "history.csv", newline="") as f:
        assert [line[name] for line in csv.DictReader(f) for name in figures][2:4] == ["", ""]


def test_partition_file_holds_every_clients_label_counts(tmp_path):
    dm = synthetic(6)
    history = RoundHistory(dirpath=str(tmp_path), summary=False)
    trainer(1, callbacks=[history]).fit(FedAvg(tiny_client(), clients_per_round=2, local_steps=1), dm)
    partition = json.loads((tmp_path / "partition.json").read_text())
    assert partition["datamodule"] == "SyntheticFederated" and partition["unseen_clients"] == []
    assert partition["train_sizes"] == [dm.num_samples(c) for c in range(6)]
    assert [sum(counts) for counts in partition["clients"]] == partition["train_sizes"]
    assert partition["clients"][3] == dm.label_histogram(3).tolist()
    assert partition["targets"] == {"kind": "class labels", "dtype": "int64", "shape": [], "num_classes": 10}


def test_a_regression_runs_partition_file_describes_its_targets_and_the_plot_says_so(tmp_path, capsys):
    """Float targets have no label counts: partition.json says what they are, ``fl-lightning plot``
    draws the metrics (the client's own val/mse and train/mse among them) and no heatmap."""
    dm = RegressionData()
    history = RoundHistory(dirpath=str(tmp_path), summary=False)
    trainer(2, callbacks=[history]).fit(FedAvg(Regressor(), clients_per_round=2, local_steps=1), dm)
    partition = json.loads((tmp_path / "partition.json").read_text())
    assert "clients" not in partition and partition["train_sizes"] == [27] * 4
    assert partition["targets"] == dm.describe_targets() and partition["targets"]["kind"] == "numbers"
    main(["plot", str(tmp_path), "--out", str(tmp_path / "plots")])
    assert [p.name for p in (tmp_path / "plots").iterdir()] == ["metrics.png"]
    assert "no partition.png: the targets are float32 numbers of shape [] (mean" in capsys.readouterr().out
    assert {"val/mse", "val/mae", "train/mse"} <= set(metric_names([load_run(tmp_path)]))


def test_history_resumes_with_the_checkpoint(tmp_path):
    history = RoundHistory(dirpath=str(tmp_path / "a"), summary=False)
    module = FedAvg(tiny_client(), clients_per_round=2, local_steps=1)
    t = trainer(2, callbacks=[history], enable_checkpointing=True, default_root_dir=str(tmp_path))
    t.fit(module, synthetic(4))
    ckpt = tmp_path / "two.ckpt"
    t.save_checkpoint(ckpt)
    resumed = RoundHistory(dirpath=str(tmp_path / "b"), summary=False)
    trainer(4, callbacks=[resumed]).fit(FedAvg(tiny_client(), clients_per_round=2, local_steps=1), synthetic(4),
                                        ckpt_path=str(ckpt))
    straight = RoundHistory(dirpath=str(tmp_path / "c"), summary=False)
    trainer(4, callbacks=[straight]).fit(FedAvg(tiny_client(), clients_per_round=2, local_steps=1), synthetic(4))
    assert [r["round"] for r in resumed.rows] == [1, 2, 3, 4]
    assert [r["clients"] for r in resumed.rows] == [r["clients"] for r in straight.rows]
    assert resumed.rows[3]["round/client_loss"] == pytest.approx(straight.rows[3]["round/client_loss"], abs=1e-6)


def test_the_checkpointed_rows_are_one_text_read_back_as_they_were():
    """A checkpoint holds the rows as one string (copying and checksumming it every round costs the
    same whatever the round); loading gives the rows back exactly, NaN included, and so does the
    state of checkpoints written before (the rows themselves)."""
    history = RoundHistory(summary=False)
    rows = [{"round": 1, "clients": [0, 3], "updates": 2, "round/client_loss": 0.1 + 0.2, "val_acc": float("nan")},
            {"round": 2, "clients": [1], "updates": 1, "round/client_loss": 1e-300, "round/excluded": 1.0}]
    history.load_state_dict({"rows": rows})  # an earlier checkpoint's form
    state = history.state_dict()
    assert list(state) == ["rows_json"] and isinstance(state["rows_json"], str)
    again = RoundHistory(summary=False)
    again.load_state_dict(state)
    assert json.dumps(again.rows) == json.dumps(rows) and again.rows[0]["round/client_loss"] == 0.1 + 0.2
    assert again.state_dict() == state
    assert RoundHistory(summary=False).state_dict() == {"rows_json": "[]"}


def test_a_run_resumed_from_its_round_checkpoint_has_every_round_once(tmp_path):
    """RoundCheckpoint saves at the round's end: the row of the round it saves (validation metrics
    included) is in it, so 3 rounds resumed to 5 give the rows of an uninterrupted run."""
    def run(folder, rounds, checkpoints="ckpt", **fit_kwargs):
        history = RoundHistory(dirpath=str(tmp_path / folder), summary=False)
        module = FedAvg(tiny_client(), clients_per_round=2, local_steps=1, seed=3)
        checkpoint = RoundCheckpoint(dirpath=str(tmp_path / checkpoints))
        t = trainer(rounds, callbacks=[history, ClientMetrics(split="val"), checkpoint],
                    enable_checkpointing=True, check_val_every_n_epoch=2)
        t.fit(module, synthetic(4), **fit_kwargs)
        return json.loads((tmp_path / folder / "history.json").read_text())

    run("first", 3)
    resumed = run("resumed", 5, ckpt_path=str(tmp_path / "ckpt" / "last.ckpt"))
    straight = run("straight", 5, checkpoints="straight-ckpt")  # a folder of its own: another run's
    assert [r["round"] for r in resumed] == [1, 2, 3, 4, 5]
    assert ["val_acc" in r for r in resumed] == [False, True, False, True, False]
    assert resumed == straight


def test_plots_are_written_for_several_runs(tmp_path):
    fit(tmp_path / "a")
    fit(tmp_path / "b")
    runs = [load_run(tmp_path / "a", "A"), load_run(tmp_path / "b", "B")]
    for path in (plot_metrics(runs, tmp_path / "m.png", ["val_acc", "round/client_loss"]),
                 plot_label_distribution(runs[0].partition, tmp_path / "p.png")):
        assert path.read_bytes()[:8] == PNG and path.stat().st_size > 5000
    with pytest.raises(ValueError, match=r"metrics \['test_acc'\] were not logged by these runs; logged: \["):
        plot_metrics(runs, tmp_path / "x.png", ["test_acc"])


def test_the_default_plot_metrics_come_from_what_was_logged():
    """Global validation accuracy and loss under the client's own names (``val/acc``, ``val_acc``),
    then the mean client loss, then the per-client mean accuracies."""
    logged = {"round": 1, "val/acc": 0.5, "val/loss": 1.0, "round/client_loss": 0.3, "clients_val/acc_mean": 0.4,
              "train_loss": 0.2, "round/excluded": 0.0}
    run = Run("a", Path("."), [logged], None)
    assert metric_names([run]) == ["val/acc", "val/loss", "train_loss", "round/client_loss", "clients_val/acc_mean"]
    regression = Run("r", Path("."), [{"round": 1, "val/mse": 2.0, "val/mae": 1.0, "train/mse": 2.5,
                                       "clients_val/mse_mean": 2.1, "clients_val/mse_worst": 4.0,
                                       "round/client_loss": 2.5}], None)
    assert metric_names([regression]) == ["val/mae", "val/mse", "train/mse", "round/client_loss",
                                          "clients_val/mse_mean"]
    other = Run("b", Path("."), [{"round": 1, "val_loss": 1.0, "val_acc": 0.5, "round/client_loss": 0.3}], None)
    assert metric_names([other]) == ["val_acc", "val_loss", "round/client_loss"]


def test_plot_command_finds_the_newest_run_below_a_folder(tmp_path, capsys):
    fit(tmp_path / "root" / "lightning_logs" / "version_0")
    main(["plot", str(tmp_path / "root"), "--out", str(tmp_path / "plots")])
    assert {p.name for p in (tmp_path / "plots").iterdir()} == {"metrics.png", "partition.png"}
    assert "wrote" in capsys.readouterr().out
    with pytest.raises(FileNotFoundError, match="no history.json in or below"):
        main(["plot", str(tmp_path / "nothing")])
    with pytest.raises(SystemExit):
        main(["plot", str(tmp_path / "root"), "--labels", "a", "b"])
    assert "--labels needs one label per run" in capsys.readouterr().err


def cli_args(tmp_path, callbacks: str) -> list[str]:
    return ["fit", "--config", QUICKSTART, "--trainer.default_root_dir", str(tmp_path),
            "--trainer.max_epochs", "2", "--trainer.enable_progress_bar", "false", "--trainer.logger", "false",
            "--data.init_args.print_summary", "false", "--trainer.callbacks", callbacks]


def test_the_cli_adds_a_history_unless_one_is_configured(tmp_path, capsys):
    cli = FederatedCLI(args=cli_args(tmp_path / "a", "[]"))
    assert sum(isinstance(c, RoundHistory) for c in cli.trainer.callbacks) == 1
    assert [r["round"] for r in json.loads((tmp_path / "a" / "history.json").read_text())] == [1, 2]
    assert "fl_lightning: 2 rounds, 10 clients in the last" in capsys.readouterr().out
    own = '[{"class_path": "fl_lightning.callbacks.RoundHistory", "init_args": {"dirpath": "%s", "summary": false}}]'
    cli = FederatedCLI(args=cli_args(tmp_path / "b", own % (tmp_path / "mine")))
    assert sum(isinstance(c, RoundHistory) for c in cli.trainer.callbacks) == 1
    assert (tmp_path / "mine" / "history.json").is_file() and not (tmp_path / "b" / "history.json").exists()
    assert "fl_lightning:" not in capsys.readouterr().out


def test_a_python_api_run_with_a_logger_gets_the_history_and_summary_of_the_cli(tmp_path, capsys):
    """``Trainer(logger=...).fit``: the module adds a RoundHistory into the logger's folder (files, summary and
    where they are); the Trainer's own RoundHistory is used instead; without a logger, none is added."""
    from pytorch_lightning.loggers import CSVLogger

    module = FedAvg(tiny_client(), clients_per_round=2, local_steps=1, seed=3)
    t = trainer(2, logger=CSVLogger(str(tmp_path)))
    t.fit(module, synthetic(4))
    run = tmp_path / "lightning_logs" / "version_0"
    assert [r["round"] for r in read_history(run)] == [1, 2] and (run / "partition.json").is_file()
    assert sum(isinstance(c, RoundHistory) for c in t.callbacks) == 1
    out = capsys.readouterr().out.splitlines()
    assert "fl_lightning: 2 rounds, 2 clients in the last, 0 updates left out for NaN/Inf" in out
    assert out[-1] == f"history: {run} (history.csv, history.json, partition.json)"
    # resumed from a checkpoint of the run by the Python API (a new version folder): the summary says where it was
    t.save_checkpoint(run / "checkpoints" / "round2.ckpt")
    resumed = trainer(3, logger=CSVLogger(str(tmp_path)))
    resumed.fit(FedAvg(tiny_client(), clients_per_round=2, local_steps=1, seed=3), synthetic(4),
                ckpt_path=str(run / "checkpoints" / "round2.ckpt"))
    assert [r["round"] for r in read_history(tmp_path / "lightning_logs" / "version_1")] == [1, 2, 3]
    assert capsys.readouterr().out.splitlines()[-1] == (
        f"history: {tmp_path}/lightning_logs/version_1 (history.csv, history.json, partition.json); resumed after "
        f"round 2 from {run}/checkpoints/round2.ckpt, whose run's folder {run} holds the logs of the rounds before")
    own = RoundHistory(dirpath=str(tmp_path / "mine"), summary=False)
    t = trainer(1, logger=CSVLogger(str(tmp_path / "other")), callbacks=[own])
    t.fit(FedAvg(tiny_client(), clients_per_round=2, local_steps=1), synthetic(4))
    assert [c for c in t.callbacks if isinstance(c, RoundHistory)] == [own]
    assert (tmp_path / "mine" / "history.csv").is_file() and not (tmp_path / "other" / "lightning_logs" / "version_0"
                                                                   / "history.csv").exists()
    assert "fl_lightning:" not in capsys.readouterr().out
    t = trainer(1, logger=False)
    t.fit(FedAvg(tiny_client(), clients_per_round=2, local_steps=1), synthetic(4))
    assert not any(isinstance(c, RoundHistory) for c in t.callbacks)


def full_rewrite(rows) -> tuple[bytes, bytes]:
    """The bytes of ``history.csv`` and ``history.json`` as RoundHistory wrote them before it
    appended (a full rewrite of every row after every round): the reference the files must equal."""
    columns = ["round", "updates"] + sorted({k for row in rows for k in row} - {"round", "updates", "clients"})
    text = io.StringIO(newline="")
    writer = csv.DictWriter(text, fieldnames=columns + ["clients"])
    writer.writeheader()
    for row in rows:
        writer.writerow({**{k: row.get(k, "") for k in columns}, "clients": " ".join(map(str, row["clients"]))})
    return text.getvalue().encode(), json.dumps(rows).encode()


class CountWrites:
    """Counts the full writes of the history files (``write_csv``, ``write_json``) and the appended rows."""

    def __init__(self, monkeypatch) -> None:
        self.calls: dict[str, int] = {"write_csv": 0, "append_csv_row": 0, "write_json": 0}
        for name in self.calls:
            monkeypatch.setattr(history_module, name, self.counted(name, getattr(history_module, name)))

    def counted(self, name, write):
        def wrapper(*args, **kwargs):
            self.calls[name] += 1
            return write(*args, **kwargs)
        return wrapper


class CheckFilesEachRound(FederatedCallback):
    """After RoundHistory closed a round: history.csv is what a full rewrite writes, and
    history.json holds the rows of its last write; raises after round ``fail_after``."""

    def __init__(self, history: RoundHistory, folder: Path, fail_after: int = 0) -> None:
        self.history, self.folder, self.fail_after = history, folder, fail_after
        self.json_rounds: list[int] = []

    def on_train_epoch_end(self, trainer, module):
        assert (self.folder / "history.csv").read_bytes() == full_rewrite(self.history.rows)[0]
        self.json_rounds.append(len(json.loads((self.folder / "history.json").read_text())))
        if len(self.history.rows) == self.fail_after:
            raise RuntimeError("stop here")


def test_the_final_files_are_those_a_full_rewrite_of_every_round_writes(tmp_path):
    _, _, history = fit(tmp_path)  # validation from round 2 on: its columns appear then
    assert "val_acc" not in history.rows[0] and "val_acc" in history.rows[1]
    assert ((tmp_path / "history.csv").read_bytes(), (tmp_path / "history.json").read_bytes()) == full_rewrite(history.rows)


def test_a_round_appends_its_row_and_history_json_waits_for_json_every_s(tmp_path, monkeypatch):
    """50 rounds, validation (new columns) first at round 3: history.csv is complete after every
    round, rewritten only when its columns grow; history.json is written after the first round
    and at the end, and the final files are those of a full rewrite."""
    writes = CountWrites(monkeypatch)
    history = RoundHistory(dirpath=str(tmp_path), summary=False, json_every_s=3600)
    check = CheckFilesEachRound(history, tmp_path)
    module = FedAvg(tiny_client(), clients_per_round=2, local_steps=1, seed=1)
    trainer(50, callbacks=[history, check], check_val_every_n_epoch=3).fit(module, synthetic(4))
    assert ["val_acc" in r for r in history.rows[:4]] == [False, False, True, False]
    assert writes.calls == {"write_csv": 2, "append_csv_row": 48, "write_json": 2}
    assert check.json_rounds == [1] * 50
    assert ((tmp_path / "history.csv").read_bytes(), (tmp_path / "history.json").read_bytes()) == full_rewrite(history.rows)


def test_json_every_s_0_writes_history_json_after_every_round(tmp_path, monkeypatch):
    writes = CountWrites(monkeypatch)
    history = RoundHistory(dirpath=str(tmp_path), summary=False, json_every_s=0)
    check = CheckFilesEachRound(history, tmp_path)
    trainer(4, callbacks=[history, check]).fit(FedAvg(tiny_client(), clients_per_round=2, local_steps=1), synthetic(4))
    assert check.json_rounds == [1, 2, 3, 4] and writes.calls["write_json"] == 4
    with pytest.raises(ValueError, match=r"json_every_s must be a finite number of seconds >= 0 .* got -1"):
        RoundHistory(json_every_s=-1)


def test_a_fit_that_raises_leaves_history_json_complete(tmp_path):
    history = RoundHistory(dirpath=str(tmp_path), summary=False, json_every_s=3600)
    check = CheckFilesEachRound(history, tmp_path, fail_after=3)
    with pytest.raises(RuntimeError, match="stop here"):
        trainer(5, callbacks=[history, check]).fit(FedAvg(tiny_client(), clients_per_round=2, local_steps=1), synthetic(4))
    assert check.json_rounds == [1, 1, 1] and [r["round"] for r in history.rows] == [1, 2, 3]
    assert ((tmp_path / "history.csv").read_bytes(), (tmp_path / "history.json").read_bytes()) == full_rewrite(history.rows)


def test_the_rounds_only_history_csv_holds_are_read_back(tmp_path):
    """A run killed between two writes of history.json: read_history and the plots take the rounds
    it lacks from history.csv, as they were logged."""
    _, _, history = fit(tmp_path)
    (tmp_path / "history.json").write_text(json.dumps(history.rows[:1]))
    assert read_history(tmp_path) == history.rows == load_run(tmp_path).rows
    assert [list(r) for r in read_history(tmp_path)] == [list(r) for r in history.rows]


def test_the_summary_counts_in_words_one_round_one_client_one_update():
    one = [{"round": 1, "clients": [4], "round/client_loss": 0.5, "round/excluded": 1.0}]
    first_line = "fl_lightning: 1 round, 1 client in the last, 1 update left out for NaN/Inf"
    assert summary_table(one).splitlines()[0] == first_line
    two = [dict(one[0], clients=[4, 7], **{"round/excluded": 0.0}), dict(one[0], round=2, clients=[1, 2])]
    assert summary_table(two).splitlines()[0].startswith("fl_lightning: 2 rounds, 2 clients in the last, 1 update left")


def test_the_summary_counts_the_refused_rounds_and_gives_them_no_best():
    rows = [{"round": r, "clients": [4], "round/client_loss": 0.5, "round/excluded": 0.0, "round/refused": refused}
            for r, refused in ((1, 0.0), (2, 1.0), (3, 1.0))]
    lines = summary_table(rows).splitlines()
    assert lines[0] == ("fl_lightning: 3 rounds, 1 client in the last, 0 updates left out for NaN/Inf, 2 rounds "
                        "refused (a result not finite)")
    assert next(line for line in lines if line.startswith("round/refused")).split()[1:] == ["0", "1", "-"]
    assert "refused" not in summary_table(rows[:1]).splitlines()[0]


def test_the_heatmap_marks_unseen_clients_only_where_there_are_some():
    from fl_lightning.plotting import label_distribution_figure

    partition = {"datamodule": "D", "clients": [[3, 0], [1, 2], [0, 4]], "unseen_clients": []}
    assert label_distribution_figure(partition).axes[0].get_ylabel() == "client"
    held_out = label_distribution_figure({**partition, "unseen_clients": [1]}).axes[0]
    assert held_out.get_ylabel() == "client (* unseen)"
    assert [t.get_text() for t in held_out.get_yticklabels()] == ["0", "1*", "2"]


def test_runs_that_logged_the_same_values_stay_apart():
    """Two runs with the same rows: their lines lie on top of each other, in other dashes and markers,
    the markers at other rounds."""
    from fl_lightning.plotting import metrics_figure

    rows = [{"round": r, "val_acc": 0.1 * r} for r in range(1, 41)]
    a, b = metrics_figure([Run("A", Path("."), rows, None), Run("B", Path("."), rows, None)], ["val_acc"]).axes[0].lines
    assert a.get_linestyle() != b.get_linestyle() and a.get_marker() != b.get_marker()
    assert a.get_markevery()[0] != b.get_markevery()[0]  # the marks start at other rounds
    assert a.get_fillstyle() == b.get_fillstyle() == "none"
