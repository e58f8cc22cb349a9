"""``fl-lightning``'s errors: a wrong value, an unknown option or a class path that names no class is
reported in a line or two (the option, what is wrong, a "did you mean") and a pointer to ``--help``,
with exit status 2, without the usage of every option or jsonargparse's tree (``fl_lightning.cli_errors``)."""

from __future__ import annotations

from pathlib import Path

import pytest

from fl_lightning import algorithms, datamodules
from fl_lightning.cli import main
from fl_lightning.cli_errors import short_error
from fl_lightning.datamodules.base import FederatedDataModule
from fl_lightning.module import FederatedModule

ROOT = Path(__file__).resolve().parents[1]
QUICK = str(ROOT / "configs" / "quickstart.yaml")
TIP = "tip: fl-lightning fit --help lists the options"


@pytest.fixture(autouse=True)
def _argv(monkeypatch, tmp_path):
    monkeypatch.setattr("sys.argv", ["fl-lightning"])
    monkeypatch.delenv("JSONARGPARSE_DEBUG", raising=False)
    monkeypatch.chdir(tmp_path)


def error_lines(capsys, *args: str, subcommand: str = "fit") -> list[str]:
    """What ``fl-lightning <subcommand> --config quickstart.yaml ARGS`` writes on stderr; it must exit with 2."""
    with pytest.raises(SystemExit) as exited:
        main([subcommand, "--config", QUICK, "--trainer.max_epochs", "1", *args])
    assert exited.value.code == 2
    captured = capsys.readouterr()
    assert "usage:" not in captured.err and "Namespace(" not in captured.err
    return captured.err.splitlines()


@pytest.mark.parametrize("args, error", [
    # a wrong value
    (["--model.init_args.clients_per_round", "many"], "--model.init_args.clients_per_round: expected int or null, "
                                                      "got 'many'"),
    (["--model.init_args.client.init_args.lr", "abc"], "--model.init_args.client.init_args.lr: expected float, "
                                                       "got 'abc'"),
    (["--seed_everything", "abc"], "--seed_everything: expected bool or int, got 'abc'"),
    (["--model.init_args.client_backend", "batchd"], "--model.init_args.client_backend: 'batchd' is not one of "
                                                     "'sequential', 'batched'; did you mean 'batched'?"),
    (["--model.init_args.weighting", "unifrom"], "--model.init_args.weighting: 'unifrom' is not one of 'num_samples', "
                                                 "'uniform', or null; did you mean 'uniform'?"),
    (["--config", "missing.yaml"], "--config: File does not exist: '{cwd}/missing.yaml'"),
    # an option the parser does not know, or a class does not take
    (["--trainer.max_epohcs", "3"], "unknown option --trainer.max_epohcs (did you mean --trainer.max_epochs?)"),
    (["--modle.init_args.seed", "3"], "unknown option --modle.init_args.seed (did you mean --model.init_args.seed?)"),
    (["--model.init_args.clients_per_rond", "3"], "--model.init_args.clients_per_rond: FedAvg takes no argument "
                                                  "'clients_per_rond'; did you mean 'clients_per_round'?"),
    (["--model.init_args.client.init_args.lrr", "3"], "--model.init_args.client.init_args.lrr: LogisticRegression "
                                                      "takes no argument 'lrr'; did you mean 'lr'?"),
    (["--trainer.callbacks+=fl_lightning.callbacks.WeightedMean", "--trainer.callbacks.weightin", "uniform"],
     "--trainer.callbacks.init_args.weightin: WeightedMean takes no argument 'weightin'; did you mean 'weighting'?"),
    # a class path that names no class
    (["--model.init_args.client.class_path", "fl_lightning.models.MLPP"],
     "--model.init_args.client.class_path: no class 'fl_lightning.models.MLPP'; did you mean MLP?"),
    (["--trainer.logger.class_path", "CSVLoger"], "--trainer.logger.class_path: no class 'CSVLoger'; did you mean "
                                                  "CSVLogger?"),
    (["--data.init_args.partitioner", "DirichletPartitionr"],
     "--data.init_args.partitioner.class_path: no class 'DirichletPartitionr'; did you mean DirichletPartitioner?"),
    # a constructor's refusal (at instantiation)
    (["--model.init_args.local_steps", "0"], "fl_lightning.algorithms.FedAvg: local_steps must be >= 1 and an "
                                             "integer, got 0"),
    (["--data.init_args.num_clients", "0"], "fl_lightning.datamodules.SyntheticFederated: num_clients must be >= 1 "
                                            "and an integer, got 0"),
    (["--trainer.callbacks+=fl_lightning.callbacks.DifferentialPrivacy", "--trainer.callbacks.clip_norm", "-1",
      "--trainer.callbacks.noise_multiplier", "1"], "clip_norm must be > 0 and finite, got -1.0"),
    (["--trainer.devices", "x"], "`devices` selected with `CPUAccelerator` should be an int > 0."),
    (["--trainer.limit_val_batches", "-1"], "You have passed invalid value -1 for limit_val_batches, it has to be in "
                                            "[0.0, 1.0] or an int."),
])
def test_a_wrong_value_or_option_is_one_line(capsys, tmp_path, args, error):
    assert error_lines(capsys, *args) == [f"error: {error.format(cwd=tmp_path)}", TIP]


@pytest.mark.parametrize("option, value, kind, base, names", [
    ("--model.class_path", "FedAVG", "algorithms", FederatedModule, algorithms.__all__),
    ("--model", "fl_lightning.algorithms.FedAVG", "algorithms", FederatedModule, algorithms.__all__),
    ("--data.class_path", "SyntheticFederatd", "datamodules", FederatedDataModule,
     [n for n in datamodules.__all__ if n.endswith("Federated") and n != "FederatedDataModule"]),
])
def test_a_class_path_that_names_no_class_lists_those_there_are(capsys, option, value, kind, base, names):
    """``FedAVG``: the closest name, and every algorithm (datamodule) that ``--model`` (``--data``) takes.
    The misspellings are near one name only: other tests' datamodule subclasses are candidates too."""
    first, listing, tip = error_lines(capsys, option, value)
    close = {"FedAVG": "FedAvg", "fl_lightning.algorithms.FedAVG": "FedAvg", "SyntheticFederatd": "SyntheticFederated"}
    assert first == f"error: {option.removesuffix('.class_path')}.class_path: no class {value!r}; did you mean " \
                    f"{close[value]}?"
    assert tip == TIP
    assert listing.startswith(f"{kind}: ")
    listed = listing.removeprefix(f"{kind}: ").split(", ")
    assert set(names) <= set(listed) and listed == sorted(listed)


def test_a_misspelt_subcommand(capsys):
    with pytest.raises(SystemExit) as exited:
        main(["fitt", "--config", QUICK])
    assert exited.value.code == 2
    assert capsys.readouterr().err.splitlines() == [
        "error: argument subcommand: invalid choice: 'fitt' (choose from 'fit', 'validate', 'test', 'predict'); "
        "did you mean 'fit'?", "tip: fl-lightning --help lists the options"]


def test_help_print_config_and_the_debug_switch_are_unchanged(capsys, monkeypatch):
    """``--help`` and ``--print_config`` print as Lightning's CLI does; ``JSONARGPARSE_DEBUG`` raises jsonargparse's
    own error, with its whole message."""
    with pytest.raises(SystemExit) as exited:
        main(["fit", "--help"])
    assert exited.value.code == 0 and capsys.readouterr().out.startswith("usage: fl-lightning [options] fit")
    with pytest.raises(SystemExit) as exited:
        main(["fit", "--config", QUICK, "--print_config"])
    assert exited.value.code in (0, None) and "class_path: fl_lightning.algorithms.FedAvg" in capsys.readouterr().out
    monkeypatch.setenv("JSONARGPARSE_DEBUG", "true")
    with pytest.raises(Exception, match="Does not validate against any of the Union subtypes"):
        main(["fit", "--config", QUICK, "--model.init_args.clients_per_round", "many"])
    with pytest.raises(ValueError, match="local_steps must be >= 1"):
        main(["fit", "--config", QUICK, "--model.init_args.local_steps", "0"])


def test_a_message_of_another_form_is_kept_less_the_given_values_repr():
    message = "Something went wrong\n  Given value type: <class 'Namespace'>\n  Given value: Namespace(a=1)"
    assert short_error(message) == "Something went wrong"
