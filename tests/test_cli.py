"""``fl-lightning``: fit/validate/test subcommands, --print_config, dotted overrides (the shipped
configs: ``tests/test_configs.py``)."""

from __future__ import annotations

import functools
import json
import re
import typing
import warnings
from pathlib import Path

import pytest
import pytorch_lightning as pl
import torch
import yaml

from fl_lightning import algorithms
from fl_lightning.checkpoints import load_checkpoint, with_checksum
from fl_lightning.cli import _ADVICE_TO_ADD_FIT_CALLBACKS, FederatedCLI, main
from fl_lightning.module_checkpoint import FederatedCheckpointing

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


def test_evaluating_a_fit_checkpoint_does_not_ask_for_the_fit_only_callbacks(tmp_path):
    """``fit`` added a RoundCheckpoint and a RoundHistory; Lightning's advice to add them back to
    ``validate`` / ``test`` / ``predict`` (which do not resume training) is not given. The test fails
    if Lightning rewords its advice: the filter would then let it through."""
    root = ["--trainer.default_root_dir", str(tmp_path)]
    FederatedCLI(args=["fit", "--config", QUICK, *FAST, *root])
    checkpoint = next(tmp_path.rglob("last.ckpt"))
    assert {"RoundHistory"} < set(load_checkpoint(checkpoint)["callbacks"])  # so Lightning would advise adding them
    for subcommand in ("validate", "test", "predict"):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            FederatedCLI(args=[subcommand, "--config", QUICK, *FAST, *root, "--ckpt_path", str(checkpoint)])
        assert not [w for w in caught if "callbacks used to create the checkpoint" in str(w.message)], subcommand


@pytest.mark.parametrize("missing, filtered", [
    (["RoundHistory", "RoundCheckpoint{'monitor': None, 'every_n_epochs': 1}"], True),
    (["RoundHistory"], True),
    (["RoundHistory", "EarlyStopping{'monitor': 'val_loss', 'mode': 'min'}"], False),
    (["ModelCheckpoint{'monitor': None}"], False),
])
def test_the_advice_is_dropped_only_for_the_callbacks_fit_adds(missing, filtered):
    advice = ("Be aware that when using `ckpt_path`, callbacks used to create the checkpoint need to be provided "
              f"during `Trainer` instantiation. Please add the following callbacks: {missing}.")
    assert bool(re.match(_ADVICE_TO_ADD_FIT_CALLBACKS, advice, re.I)) is filtered


def test_fl_ddp_strategy_is_known_to_the_cli(tmp_path):
    cli = FederatedCLI(args=["--config", QUICK, *FAST, "--trainer.strategy", "fl_ddp",
                             "--trainer.devices", "1", "--trainer.default_root_dir", str(tmp_path)], run=False)
    assert type(cli.trainer.strategy).__name__ == "FederatedDDPStrategy"


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


PEFLL = """
seed_everything: 0
model:
  class_path: fl_lightning.algorithms.pefll.PeFLL
  init_args:
    client: {class_path: fl_lightning.models.LogisticRegression, init_args: {in_features: 20, lr: 0.1}}
    embedding:
      class_path: fl_lightning.models.hypernetwork.MLPEmbedding
      init_args: {in_features: 20, num_classes: 10, descriptor_dim: 4, hidden: [8]}
    hypernetwork_size: S
    hypernetwork_width: 8
    clients_per_round: 3
    local_steps: 2
data:
  class_path: fl_lightning.datamodules.SyntheticFederated
  init_args: {num_clients: 8, dim: 20, max_samples: 60, unseen_fraction: 0.25, batch_size: 8}
trainer:
  max_epochs: 2
  logger: false
  enable_progress_bar: false
  num_sanity_val_steps: 0
  callbacks:
    - class_path: pytorch_lightning.callbacks.ModelCheckpoint
      init_args: {save_last: true, save_top_k: 0}
"""


def test_pefll_predict_subcommand(tmp_path, capsys):
    config = tmp_path / "pefll.yaml"
    config.write_text(PEFLL)
    main(["fit", "--config", str(config), "--trainer.default_root_dir", str(tmp_path)])
    ckpt = next(tmp_path.rglob("last.ckpt"))
    out = tmp_path / "personal"
    main(["pefll-predict", "--config", str(config), "--predict.ckpt_path", str(ckpt), "--predict.output_dir", str(out)])
    printed = capsys.readouterr().out
    unseen = sorted(int(p.stem.split("_")[1]) for p in out.glob("client_*.pt"))
    assert len(unseen) == 2 and all(f"client {c}: test accuracy" in printed for c in unseen)
    # the Python API on the same checkpoint, called as docs/results/pefll.md writes it (no client=, no embedding=)
    from fl_lightning.datamodules import SyntheticFederated
    from fl_lightning.predict import load_pefll, personalize, predict_clients

    dm = SyntheticFederated(num_clients=8, dim=20, max_samples=60, unseen_fraction=0.25, batch_size=8)
    models = predict_clients(str(ckpt), dm)
    assert sorted(models) == unseen
    written = torch.load(out / f"client_{unseen[0]}.pt", weights_only=True)
    torch.testing.assert_close(models[unseen[0]].state_dict(), written)
    x, y = dm.client_data(unseen[0], "train").full()
    torch.testing.assert_close(personalize(load_pefll(str(ckpt)), (x, y)).state_dict(), written)


def test_predict_writes_the_predictions_into_the_run_folder(tmp_path):
    from fl_lightning.callbacks import PredictionWriter

    cli = FederatedCLI(args=["predict", "--config", QUICK, *FAST, "--trainer.default_root_dir", str(tmp_path)])
    assert sum(isinstance(c, PredictionWriter) for c in cli.trainer.callbacks) == 1
    predictions = torch.load(tmp_path / "predictions.pt", weights_only=True)
    assert predictions.shape == (len(cli.datamodule.global_test_set()), 10)
    x, _ = cli.datamodule.global_test_set()[:]
    torch.testing.assert_close(predictions, cli.model.client(x))


@pytest.mark.parametrize("name", algorithms.__all__)
def test_every_algorithm_types_its_client_as_a_lightning_module(name):
    """The CLI can merge a client override (``--model.init_args.client.init_args.lr``) into a
    config that switched the algorithm only when ``client`` is typed as a ``LightningModule``
    (``Any`` dropped the client's class: SCAFFOLD's did)."""
    cls = getattr(algorithms, name)
    hints = typing.get_type_hints(cls.__init__)
    if "client" in hints:
        assert hints["client"] is pl.LightningModule, f"{name}.__init__(client: {hints['client']})"


def test_client_override_after_switching_the_algorithm(capsys):
    with pytest.raises(SystemExit):
        main(["fit", "--config", QUICK, "--model.class_path", "fl_lightning.algorithms.SCAFFOLD",
              "--model.init_args.client.init_args.lr", "0.05", "--print_config"])
    model = yaml.safe_load(capsys.readouterr().out)["model"]
    assert model["class_path"] == "fl_lightning.algorithms.SCAFFOLD"
    assert model["init_args"]["client"]["init_args"]["lr"] == 0.05
    assert model["init_args"]["client"]["class_path"].endswith("LogisticRegression")


# ------------------------------------------------------------------ --ckpt_path
def quick(tmp_path: Path, *extra: str, subcommand: str = "fit") -> list[str]:
    """The quickstart, small and quiet, in ``tmp_path`` (with its logger's version folders)."""
    return [subcommand, "--config", QUICK, "--trainer.enable_progress_bar", "false", "--data.init_args.print_summary",
            "false", "--model.init_args.local_steps", "2", "--trainer.default_root_dir", str(tmp_path), *extra]


#: fewer and smaller clients than the quickstart's, for the tests of many commands
SMALL = ["--data.init_args.num_clients", "6", "--data.init_args.max_samples", "100",
         "--model.init_args.clients_per_round", "2"]


def loaded_rounds(monkeypatch) -> list[int]:
    """The round counter (``global_step``) of every checkpoint the module loads from now on."""
    loaded: list[int] = []
    load = FederatedCheckpointing.on_load_checkpoint

    def recording(module, checkpoint):
        loaded.append(checkpoint["global_step"])
        load(module, checkpoint)

    monkeypatch.setattr(FederatedCheckpointing, "on_load_checkpoint", recording)
    return loaded


def test_ckpt_path_last_is_the_latest_runs_round_checkpoint(tmp_path, monkeypatch, capsys):
    """Each new run writes into a new version folder; ``last`` resumes the latest run's ``last.ckpt``
    (printed), in ``fit`` (which continues in that run's folder) and in ``validate`` (``test`` and
    ``predict`` take the same way)."""
    loaded = loaded_rounds(monkeypatch)
    FederatedCLI(args=quick(tmp_path, *SMALL, "--trainer.max_epochs", "1"))
    FederatedCLI(args=quick(tmp_path, *SMALL, "--trainer.max_epochs", "1"))
    FederatedCLI(args=quick(tmp_path, *SMALL, "--trainer.max_epochs", "2", "--ckpt_path", "last"))
    FederatedCLI(args=quick(tmp_path, *SMALL, "--ckpt_path", "last", subcommand="validate"))
    assert loaded == [1, 2]
    chosen = [line for line in capsys.readouterr().out.splitlines() if line.startswith("--ckpt_path last")]
    folder = tmp_path / "lightning_logs"
    assert chosen == [f"--ckpt_path last: {folder}/version_1/checkpoints/last.ckpt"] * 2
    assert sorted(p.name for p in folder.iterdir()) == ["version_0", "version_1"]


@pytest.mark.parametrize("subcommand, logger, looked", [
    ("fit", "false", "checkpoints"), ("predict", "true", "lightning_logs/version_*/checkpoints")])
def test_ckpt_path_last_without_a_checkpoint_is_refused_naming_where_it_looked(tmp_path, subcommand, logger, looked,
                                                                               capsys):
    """Not a run from round 0 with a warning: an error (of the command line's: a line and exit status 2, no
    traceback), which leaves no folder. A killed write's ``last.ckpt.tmp`` is no checkpoint."""
    (tmp_path / "checkpoints").mkdir()
    (tmp_path / "checkpoints" / "last.ckpt.tmp").write_bytes(b"PK\x03\x04 a checkpoint cut short")
    with pytest.raises(SystemExit) as exited:
        FederatedCLI(args=quick(tmp_path, "--trainer.logger", logger, "--ckpt_path", "last", subcommand=subcommand))
    assert exited.value.code == 2
    assert capsys.readouterr().err.splitlines() == [
        f"error: ckpt_path 'last': no last.ckpt of a run, looked in {tmp_path}/{looked}: train first, or pass the "
        "checkpoint's path", f"tip: fl-lightning {subcommand} --help lists the options"]
    assert [p.name for p in tmp_path.iterdir()] == ["checkpoints"]


def test_the_cli_resumes_the_checkpoint_it_checked(tmp_path, monkeypatch):
    """The file is replaced (by another valid checkpoint) after ``--ckpt_path`` was checked and
    before the Trainer loads it: the run resumes the checked contents, not the new file."""
    quiet = ["--trainer.logger", "false"]
    FederatedCLI(args=quick(tmp_path, *quiet, "--trainer.max_epochs", "1"))
    checked = tmp_path / "checkpoints" / "last.ckpt"
    replacement = load_checkpoint(checked)
    replacement["global_step"] = 1000
    fit = pl.Trainer.fit

    @functools.wraps(fit)  # the CLI's arguments are those of Trainer.fit's signature
    def replace_then_fit(trainer, *args, **kwargs):
        torch.save(with_checksum(replacement), checked)
        return fit(trainer, *args, **kwargs)

    monkeypatch.setattr(pl.Trainer, "fit", replace_then_fit)
    loaded = loaded_rounds(monkeypatch)
    cli = FederatedCLI(args=quick(tmp_path, *quiet, "--trainer.max_epochs", "2", "--ckpt_path", str(checked)))
    assert loaded == [1] and cli.trainer.current_epoch == 2


def test_a_round_checkpoint_listed_in_yaml_is_the_one_built_in_python(tmp_path, capsys):
    """jsonargparse fills in no ModelCheckpoint argument (``save_top_k: 1`` wrote ``epoch=*.ckpt``
    files beside ``last.ckpt``, not atomically): the folder holds ``last.ckpt`` alone (and its
    owner), and ``--ckpt_path last`` resumes from the configured ``dirpath``."""
    folder = tmp_path / "rounds"
    config = tmp_path / "round.yaml"
    config.write_text(yaml.safe_dump({"trainer": {"callbacks": [
        {"class_path": "fl_lightning.callbacks.RoundCheckpoint", "init_args": {"dirpath": str(folder)}}]}}))
    with pytest.raises(SystemExit):
        main(["fit", "--config", QUICK, "--config", str(config), "--print_config"])
    callbacks = yaml.safe_load(capsys.readouterr().out)["trainer"]["callbacks"]
    assert callbacks == [{"class_path": "fl_lightning.callbacks.RoundCheckpoint",
                          "init_args": {"dirpath": str(folder), "every_n_rounds": 1, "asynchronous": True}}]
    every_round = ["--trainer.check_val_every_n_epoch", "1"]  # where ModelCheckpoint(save_top_k=1) would write
    FederatedCLI(args=quick(tmp_path, "--config", str(config), *every_round, "--trainer.max_epochs", "2"))
    assert sorted(p.name for p in folder.iterdir()) == ["last.ckpt", "owner.json"]
    FederatedCLI(args=quick(tmp_path, "--config", str(config), "--trainer.max_epochs", "3", "--ckpt_path", "last"))
    assert f"--ckpt_path last: {folder}/last.ckpt" in capsys.readouterr().out
    assert load_checkpoint(folder / "last.ckpt")["global_step"] == 3


# ------------------------------------------------------------------ the run's folder
class Killed(pl.Callback):
    """Raises when round ``at`` (1-based) starts: a run killed between two of its checkpoints."""

    def __init__(self, at: int) -> None:
        self.at = at

    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.current_epoch + 1 == self.at:
            raise RuntimeError("killed")


def history_rounds(folder: Path) -> list[int]:
    """The rounds of ``history.csv`` in ``folder``, as its lines hold them."""
    return [int(line.split(",")[0]) for line in (folder / "history.csv").read_text().splitlines()[1:]]


def test_a_resumed_run_continues_in_its_own_folder(tmp_path, capsys):
    """Killed at the start of round 4 with a checkpoint every second round: the history holds round 3, the
    checkpoint round 2. Resumed with ``--ckpt_path last``, the run writes into the same version folder, and its
    history holds every round once (round 3 run again, replacing the killed run's); the printed lines say where."""
    every_2 = ["--trainer.callbacks+=fl_lightning.callbacks.RoundCheckpoint", "--trainer.callbacks.every_n_rounds", "2"]
    killed = ["--trainer.callbacks+=tests.test_cli.Killed", "--trainer.callbacks.at", "4"]
    with pytest.raises(RuntimeError, match="killed"):
        FederatedCLI(args=quick(tmp_path, *SMALL, *every_2, *killed, "--trainer.max_epochs", "5"))
    run = tmp_path / "lightning_logs" / "version_0"
    assert history_rounds(run) == [1, 2, 3] and load_checkpoint(run / "checkpoints" / "last.ckpt")["global_step"] == 2
    capsys.readouterr()
    FederatedCLI(args=quick(tmp_path, *SMALL, "--trainer.max_epochs", "4", "--ckpt_path", "last"))
    assert [p.name for p in (tmp_path / "lightning_logs").iterdir()] == ["version_0"]
    assert history_rounds(run) == [1, 2, 3, 4]
    assert [row["round"] for row in json.loads((run / "history.json").read_text())] == [1, 2, 3, 4]
    assert load_checkpoint(run / "checkpoints" / "last.ckpt")["global_step"] == 4
    out = capsys.readouterr().out.splitlines()
    assert f"fl-lightning fit: writing into {run}" in out
    assert (f"history: {run} (history.csv, history.json, partition.json); resumed after round 2 from "
            f"{run}/checkpoints/last.ckpt") in out


def test_evaluations_of_a_runs_checkpoint_write_into_its_folder(tmp_path, capsys):
    """``validate``, ``test`` and ``predict`` with a checkpoint of a run write into ``<run>/<subcommand>/`` and
    say so; predict prints its file's path."""
    FederatedCLI(args=quick(tmp_path, *SMALL, "--trainer.max_epochs", "1"))
    run = tmp_path / "lightning_logs" / "version_0"
    checkpoint = str(run / "checkpoints" / "last.ckpt")
    for subcommand in ("validate", "test", "predict"):
        capsys.readouterr()
        FederatedCLI(args=quick(tmp_path, *SMALL, "--ckpt_path", checkpoint, subcommand=subcommand))
        out = capsys.readouterr().out.splitlines()
        assert f"fl-lightning {subcommand}: writing into {run / subcommand}" in out
        assert (run / subcommand / "config.yaml").is_file()
    assert f"predictions: {run}/predict/predictions.pt" in out
    assert torch.load(run / "predict" / "predictions.pt", weights_only=True).shape[1] == 10
    assert [p.name for p in (tmp_path / "lightning_logs").iterdir()] == ["version_0"]
    # a checkpoint outside a run's checkpoints folder: a new run folder, as Lightning's
    (tmp_path / "kept.ckpt").write_bytes((run / "checkpoints" / "last.ckpt").read_bytes())
    FederatedCLI(args=quick(tmp_path, *SMALL, "--ckpt_path", str(tmp_path / "kept.ckpt"), subcommand="validate"))
    assert f"fl-lightning validate: writing into {tmp_path}/lightning_logs/version_1" in capsys.readouterr().out


@pytest.mark.parametrize("failure", ["setup", "ckpt_path", "round"])
def test_a_failed_start_leaves_no_folder(tmp_path, failure):
    """A value refused at setup, or a checkpoint that is not there: the command leaves no (empty) version folder,
    so the next run is ``version_0``, as the README says. A run that failed after a round keeps its folder."""
    bad = {"setup": ["--model.init_args.clients_per_round", "100"],
           "ckpt_path": ["--ckpt_path", str(tmp_path / "missing.ckpt")],
           "round": ["--trainer.callbacks+=tests.test_cli.Killed", "--trainer.callbacks.at", "2"]}[failure]
    with pytest.raises((ValueError, SystemExit, RuntimeError)):
        FederatedCLI(args=quick(tmp_path, *SMALL, *bad, "--trainer.max_epochs", "2"))
    if failure == "round":
        assert history_rounds(tmp_path / "lightning_logs" / "version_0") == [1]
        return
    assert list(tmp_path.iterdir()) == []
    FederatedCLI(args=quick(tmp_path, *SMALL, "--trainer.max_epochs", "1"))
    assert [p.name for p in (tmp_path / "lightning_logs").iterdir()] == ["version_0"]
