"""``fl-lightning``: fit/validate/test subcommands, --print_config, dotted overrides, every shipped config."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from fl_lightning.cli import FederatedCLI, main

ROOT = Path(__file__).resolve().parents[1]
QUICK = str(ROOT / "configs" / "quickstart.yaml")


@pytest.fixture(autouse=True)
def _argv(monkeypatch):
    monkeypatch.setattr("sys.argv", ["fl-lightning"])


FAST = ["--trainer.max_epochs", "2", "--trainer.logger", "false", "--trainer.enable_progress_bar", "false",
        "--trainer.check_val_every_n_epoch", "1", "--data.init_args.print_summary", "false"]


def test_fit_with_dotted_override(tmp_path):
    cli = FederatedCLI(args=["fit", "--config", QUICK, *FAST, "--model.init_args.local_steps", "3",
                             "--trainer.default_root_dir", str(tmp_path)])
    assert cli.model.local_steps == 3
    assert cli.trainer.current_epoch == 2
    assert "val_acc" in cli.trainer.callback_metrics


@pytest.mark.parametrize("subcommand", ["validate", "test"])
def test_validate_and_test_subcommands(tmp_path, subcommand):
    cli = FederatedCLI(args=[subcommand, "--config", QUICK, *FAST, "--trainer.default_root_dir", str(tmp_path)])
    prefix = "val" if subcommand == "validate" else "test"
    assert f"{prefix}_acc" in cli.trainer.callback_metrics


def test_fl_ddp_strategy_is_known_to_the_cli(tmp_path):
    cli = FederatedCLI(args=["--config", QUICK, *FAST, "--trainer.strategy", "fl_ddp",
                             "--trainer.devices", "1", "--trainer.default_root_dir", str(tmp_path)], run=False)
    assert type(cli.trainer.strategy).__name__ == "FederatedDDPStrategy"


CONFIGS = sorted(p for p in (ROOT / "configs").rglob("*.yaml"))


@pytest.fixture(scope="module")
def parser():
    """The CLI's parser, built once (building it is the slow part)."""
    import sys

    argv, sys.argv = sys.argv, ["fl-lightning"]
    try:
        return FederatedCLI(args=["--config", QUICK, *FAST], run=False).parser
    finally:
        sys.argv = argv


@pytest.mark.parametrize("config", CONFIGS, ids=[str(p.relative_to(ROOT / "configs")) for p in CONFIGS])
def test_every_config_parses(config, parser):
    cfg = parser.parse_args(["--config", str(config)])
    assert cfg.model.class_path and cfg.data.class_path


def test_print_config(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", "--config", QUICK, "--print_config"])
    assert exit_info.value.code in (0, None)
    printed = yaml.safe_load(capsys.readouterr().out)
    assert printed["model"]["class_path"] == "fl_lightning.algorithms.FedAvg"


def test_bad_override_names_the_parameter(capsys):
    with pytest.raises(SystemExit):
        main(["fit", "--config", QUICK, "--model.init_args.clients_per_round", "many"])
    assert "clients_per_round" in capsys.readouterr().err
