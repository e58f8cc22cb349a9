"""The projects of ``examples/`` run as their READMEs say, on fewer rounds.

Each example is run from its own folder (as ``cd examples/<name>``), with the folder importable (as
``PYTHONPATH=.``): its Python script's ``main`` and its ``fl-lightning fit`` configuration.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import shutil
import sys
from pathlib import Path

import pytest

from fl_lightning.callbacks.history import read_history
from fl_lightning.cli import main as cli

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


@contextlib.contextmanager
def in_example(name: str, tmp_path: Path, monkeypatch):
    """A copy of ``examples/<name>`` as the working folder and on the import path; its modules forgotten
    after (two examples have a ``model.py``)."""
    folder = tmp_path / name
    shutil.copytree(EXAMPLES / name, folder)
    own = {path.stem for path in folder.glob("*.py")}
    monkeypatch.chdir(folder)
    monkeypatch.syspath_prepend(str(folder))
    monkeypatch.setattr(sys, "argv", ["fl-lightning"])
    try:
        yield folder
    finally:
        for module in own:
            sys.modules.pop(module, None)


def fit(*args: str) -> None:
    cli(["fit", *args, "--trainer.enable_progress_bar", "false", "--trainer.enable_model_summary", "false"])


def test_every_example_has_a_readme_and_a_test():
    examples = sorted(p.name for p in EXAMPLES.iterdir() if p.is_dir())
    assert examples == ["own_module", "regression", "robust_aggregation"]
    assert all((EXAMPLES / name / "README.md").exists() for name in examples)


@pytest.mark.slow
def test_own_module_trains_from_python_and_from_the_cli(tmp_path, monkeypatch):
    with in_example("own_module", tmp_path, monkeypatch) as folder:
        metrics = importlib.import_module("train").main(rounds=2)
        assert {"test_acc", "test_loss"} <= set(metrics) and metrics["test_acc"] > 0.5  # 4 classes: chance is 0.25
        fit("--config", "config.yaml", "--trainer.max_epochs", "2", "--trainer.check_val_every_n_epoch", "1")
        run = folder / "runs" / "own_module" / "lightning_logs" / "version_0"
        history = read_history(run)
        assert [row["round"] for row in history] == [1, 2] and "val_acc" in history[-1]
        assert len(json.loads((run / "partition.json").read_text())["clients"]) == 20


@pytest.mark.slow
def test_regression_logs_per_client_figures(tmp_path, monkeypatch):
    with in_example("regression", tmp_path, monkeypatch) as folder:
        figures = importlib.import_module("evaluate").main(rounds=2)
        assert {"val/mse", "val/mae", "clients_val/mse_worst", "clients_val/mae_mean"} <= set(figures)
        assert figures["clients_val/mse_worst"] >= figures["clients_val/mse_best"]
        fit("--config", "config.yaml", "--trainer.max_epochs", "2", "--trainer.check_val_every_n_epoch", "1")
        run = folder / "runs" / "regression" / "lightning_logs" / "version_0"
        rows = [json.loads(line) for line in (run / "client_metrics.jsonl").read_text().splitlines()]
        assert len(rows) == 2 and set(rows[-1]["metrics"]) == {"val/mse", "val/mae"}


@pytest.mark.slow
def test_robust_aggregators_withstand_the_attack_that_breaks_the_mean(tmp_path, monkeypatch):
    with in_example("robust_aggregation", tmp_path, monkeypatch) as folder:
        compare = importlib.import_module("compare")
        attacked = {name: compare.accuracy(name, rounds=3, attackers=3) for name in compare.AGGREGATORS}
        assert attacked["geometric median"] > attacked["mean"] + 0.2
        assert attacked["trimmed mean"] > attacked["mean"] + 0.2
        fit("--config", "config.yaml", "--config", "median.yaml", "--trainer.max_epochs", "1")
        history = read_history(folder / "runs" / "robust_aggregation" / "lightning_logs" / "version_0")
        assert history[-1]["round"] == 1
