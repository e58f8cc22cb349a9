"""``fl-lightning``: LightningCLI over federated modules and datamodules.

::

    fl-lightning fit --config configs/quickstart.yaml
    fl-lightning fit --config configs/fedavg_mnist.yaml --model.local_steps 5 --trainer.max_epochs 50
    fl-lightning validate --config configs/quickstart.yaml --ckpt_path last.ckpt
    fl-lightning predict --config configs/quickstart.yaml --ckpt_path last   # -> <run>/predict/predictions.pt
    fl-lightning fit --config configs/quickstart.yaml --print_config
    fl-lightning fit --config configs/quickstart.yaml --trainer.max_epochs 60 --ckpt_path last
    fl-lightning pefll-predict --config configs/pefll/<run>.yaml --predict.ckpt_path last.ckpt
    fl-lightning plot runs/quickstart
    fl-lightning checkpoint --add-checksum old.ckpt

``plot`` draws a run's history (``fl_lightning.plotting``). ``checkpoint --add-checksum`` adds
its checksum to a checkpoint you trust that has none (:func:`fl_lightning.checkpoints.add_checksum`).

``pefll-predict`` takes the training config (model and data) and a trained PeFLL checkpoint and
writes each client's personalized model, generated with no finetuning (by default for the
clients held out as unseen), printing its accuracy on the client's test split.

``--model`` accepts any ``FederatedModule`` subclass and ``--data`` any
``FederatedDataModule`` subclass (``class_path`` + ``init_args``). The federated DDP
strategies are registered on import, so ``--trainer.strategy fl_ddp`` works.
"""

from __future__ import annotations

import argparse
import importlib
import os
import shutil
import sys
import warnings
from pathlib import Path
from typing import Any, NoReturn, Optional

import torch
from jsonargparse import Namespace

from fl_lightning import plotting
from fl_lightning.callbacks.checkpoint import VERSION_FOLDER, checkpoint_run, last_round_checkpoint
from fl_lightning.callbacks.history import RoundHistory
from fl_lightning.checkpoints import add_checksum, install_safe_io, load_checkpoint
from fl_lightning.cli_errors import debugging, exit_with_error, short_error
from fl_lightning.datamodules.base import FederatedDataModule
from fl_lightning.lightning_compat import set_logger_version
from fl_lightning.lightning_package import (BasePredictionWriter, LightningArgumentParser, LightningCLI,
                                           MisconfigurationException, ModelCheckpoint)
from fl_lightning.module import FederatedModule


DESCRIPTION = """fl-lightning: federated learning with one Lightning Trainer (a Trainer epoch is a round).

Besides the subcommands below, `fl-lightning plot RUN_DIR [RUN_DIR ...]` draws runs' metrics
per round and the label distribution of their clients (see `fl-lightning plot --help`),
`fl-lightning pefll-predict --config <PeFLL training config> --predict.ckpt_path <checkpoint>`
writes each client's personalized model with PeFLL-predict (see `fl-lightning pefll-predict
--help`), and `fl-lightning checkpoint --add-checksum PATH` adds its checksum to a checkpoint you
trust that has none (see `fl-lightning checkpoint --help`)."""


#: Lightning's advice, loading a checkpoint, to add its callbacks, where those missing are the ones the
#: CLI adds to ``fit`` only (their state keys: ``RoundCheckpoint{...}``, ``RoundHistory``)
_ADVICE_TO_ADD_FIT_CALLBACKS = (
    r"Be aware that when using `ckpt_path`, callbacks used to create the checkpoint need to be provided during "
    r"`Trainer` instantiation\. Please add the following callbacks: "
    r"\[(?:(?:'RoundHistory'|\"RoundCheckpoint\{[^\"]*\}\")(?:, )?)+\]\.$"
)


class FederatedArgumentParser(LightningArgumentParser):
    """``LightningCLI``'s parser, whose errors are a line or two (:func:`~fl_lightning.cli_errors.short_error`:
    the option, what is wrong, a "did you mean") and a pointer to ``--help``, with exit status 2, rather
    than the usage of every option and jsonargparse's whole tree of what it tried. With
    ``JSONARGPARSE_DEBUG=true``, jsonargparse's own error (an exception) is raised instead."""

    def error(self, message: str, ex: Optional[Exception] = None) -> NoReturn:
        if not self.exit_on_error or debugging():
            super().error(message, ex)
        parser = getattr(ex, "subcommand_parser", None) or self
        options = list(parser._option_string_actions)
        exit_with_error(short_error(message, options), parser.prog.replace(" [options]", ""))


class FederatedCLI(LightningCLI):
    """``LightningCLI`` in subclass mode for ``FederatedModule`` and ``FederatedDataModule``.

    Departures from ``LightningCLI``:

    * ``fit`` writes a resumable checkpoint after every round (``RoundCheckpoint``) unless the
      configuration has a checkpoint callback of its own or ``trainer.enable_checkpointing`` is
      false;
    * ``fit`` writes the run's per-round history and prints a summary at the end
      (``RoundHistory``) unless the configuration has one;
    * ``predict`` writes the predictions to ``predictions.pt`` in the run's folder
      (``PredictionWriter``) unless the configuration has a prediction writer;
    * ``--ckpt_path`` never replaces the configured model with the checkpoint's: a checkpoint of
      another algorithm is refused, and settings that differ from the checkpoint's are used as
      configured, with a warning naming each (``FederatedModule.on_load_checkpoint``);
    * ``--ckpt_path`` is read once: the file is checked, and the Trainer is handed the contents
      checked (a file replaced meanwhile is not read);
    * ``--ckpt_path last`` is the ``last.ckpt`` of the run's round checkpoints
      (:func:`~fl_lightning.callbacks.checkpoint.last_round_checkpoint`: the latest run's, in
      ``fit``, ``validate``, ``test`` and ``predict``), printed; with none, the command is refused,
      naming where it looked;
    * ``validate``, ``test`` and ``predict`` from a ``fit`` checkpoint do not repeat Lightning's
      advice to add the callbacks this CLI added to ``fit`` (``RoundCheckpoint``, ``RoundHistory``):
      their state resumes training, which these subcommands do not do. The advice stays for the
      configuration's own callbacks;
    * with a checkpoint of a run (``<run>/checkpoints/...``, a version folder of the configured
      logger), the command writes into that run's folder rather than a new version: ``fit`` continues
      the run there (its ``history.csv`` holds every round once), ``validate``, ``test`` and
      ``predict`` write into ``<run>/validate``, ``<run>/test``, ``<run>/predict``;
    * every subcommand prints the folder it writes into (``fl-lightning fit: writing into ...``);
      one that fails removes the folders it made, unless a round's checkpoint or history is in them
      (a wrong value found at setup leaves no empty version folder);
    * an error of the command line (a wrong value, an unknown option, a class path that names no
      class, a constructor's or ``--ckpt_path``'s refusal) is a line or two and exit status 2
      (:class:`FederatedArgumentParser`, :mod:`fl_lightning.cli_errors`).
    """

    def __init__(self, args: Optional[list[str]] = None, run: bool = True) -> None:
        #: the folders the subcommand will make, the topmost first (rank 0's; removed if it fails at the start)
        self._new_folders: list[str] = []
        super().__init__(
            FederatedModule,
            FederatedDataModule,
            subclass_mode_model=True,
            subclass_mode_data=True,
            args=args,
            run=run,
            save_config_kwargs={"overwrite": True},
            parser_kwargs={"description": DESCRIPTION},
            parser_class=FederatedArgumentParser,
        )

    def before_instantiate_classes(self) -> None:
        """Add a ``RoundCheckpoint`` to ``fit`` when the configuration has no checkpoint callback,
        and a ``RoundHistory`` when it has none; a ``PredictionWriter`` to ``predict`` when it has
        no prediction writer."""
        if self.subcommand == "predict":
            trainer = self.config["predict"]["trainer"]
            callbacks = list(trainer.get("callbacks") or [])
            if not any(_configured_is(c, BasePredictionWriter) for c in callbacks):
                callbacks.append(Namespace(class_path="fl_lightning.callbacks.PredictionWriter", init_args=Namespace()))
            trainer["callbacks"] = callbacks
        if self.subcommand != "fit":
            return
        trainer = self.config["fit"]["trainer"]
        callbacks = list(trainer.get("callbacks") or [])
        if trainer.get("enable_checkpointing") is not False and not any(_configured_is(c, ModelCheckpoint) for c in callbacks):
            callbacks.append(Namespace(class_path="fl_lightning.callbacks.RoundCheckpoint", init_args=Namespace()))
        if not any(_configured_is(c, RoundHistory) for c in callbacks):
            callbacks.append(Namespace(class_path="fl_lightning.callbacks.RoundHistory", init_args=Namespace()))
        trainer["callbacks"] = callbacks

    def instantiate_classes(self) -> None:
        """(``LightningCLI``'s, whose errors are a line or two.) A constructor's refusal of a configured
        value (a ``ValueError`` or ``TypeError``, Lightning's ``MisconfigurationException``) is reported
        as a parsing error is (:class:`FederatedArgumentParser`), not as jsonargparse's tree with the
        ``repr`` of every argument; ``JSONARGPARSE_DEBUG=true`` raises it instead, with its traceback."""
        try:
            super().instantiate_classes()
        except (ValueError, TypeError, MisconfigurationException) as refusal:
            if debugging():
                raise
            exit_with_error(short_error(str(refusal)), self._command())

    def _command(self) -> str:
        """The command as typed: ``fl-lightning fit``."""
        return f"{self.parser.prog} {self.subcommand}" if self.subcommand else self.parser.prog

    def _run_subcommand(self, subcommand: str) -> None:
        """Run the subcommand; where it fails, remove the folders it made unless a round's results are
        in them (:func:`remove_new_folders`)."""
        try:
            with warnings.catch_warnings():
                if subcommand != "fit":
                    warnings.filterwarnings("ignore", message=_ADVICE_TO_ADD_FIT_CALLBACKS)
                super()._run_subcommand(subcommand)
        except BaseException:
            remove_new_folders(self._new_folders)
            raise

    def _parse_ckpt_path(self) -> None:
        """(Replaces ``LightningCLI``'s, which merges the checkpoint's hyperparameters into the
        configuration.) Nothing: the checkpoint is read once the Trainer is built
        (:meth:`_prepare_subcommand_kwargs`)."""

    def _prepare_subcommand_kwargs(self, subcommand: str) -> dict[str, Any]:
        """The subcommand's arguments, ``--ckpt_path`` checked (a file that cannot be used is an error
        of the command line's: :meth:`_checked`); the Trainer's loggers set to write into the run of a
        checkpoint of a run (:meth:`_write_into_run`); the run's folder printed, and the folders it
        will make noted (for :meth:`_run_subcommand`)."""
        kwargs = super()._prepare_subcommand_kwargs(subcommand)
        if kwargs.get("ckpt_path"):
            try:
                kwargs["ckpt_path"] = self._checked(str(kwargs["ckpt_path"]), subcommand)
            except ValueError as refusal:  # CheckpointError included
                if debugging():
                    raise
                exit_with_error(str(refusal), self._command())
            self._write_into_run(kwargs["ckpt_path"], subcommand)
        folder = self.trainer.log_dir if self.trainer.is_global_zero else None  # no process group yet: no collective
        if folder is not None:  # None: a logger of a remote service, without a folder
            self._new_folders = missing_folders(folder)
            print(f"{self._command()}: writing into {folder}", flush=True)
        return kwargs

    def _write_into_run(self, ckpt_path: str, subcommand: str) -> None:
        """Where the checkpoint is a run's (``<run>/checkpoints/``, :func:`checkpoint_run`) and ``<run>``
        is a version folder of the Trainer's logger, the logger writes into it: ``fit`` continues the
        run there (its history holds every round once), ``validate``, ``test`` and ``predict`` write
        into ``<run>/<subcommand>/``. Otherwise the logger takes a new version folder, as Lightning's."""
        run = checkpoint_run(ckpt_path)
        if run is None:
            return
        name = os.path.basename(run)
        numbered = VERSION_FOLDER.fullmatch(name)
        version: str | int = os.path.join(name, subcommand) if subcommand != "fit" else (
            int(numbered[1]) if numbered else name)
        for logger in self.trainer.loggers:
            root = getattr(logger, "root_dir", None)
            if root is not None and os.path.realpath(root) == os.path.realpath(os.path.dirname(run)):
                set_logger_version(logger, version)

    def _checked(self, ckpt_path: str, subcommand: str) -> str:
        """``--ckpt_path``'s file (``last``: :func:`last_round_checkpoint`, printed), read once and
        checked, its contents handed to the Trainer; a checkpoint of another algorithm than the
        configured one is refused.

        Raises:
            CheckpointError: the file cannot be used, or ``last`` finds none.
            ValueError: another algorithm wrote the checkpoint.
        """
        if ckpt_path == "last":
            ckpt_path = last_round_checkpoint(self.trainer)
            if self.trainer.is_global_zero:
                print(f"--ckpt_path last: {ckpt_path}", flush=True)
        elif ckpt_path in ("best", "hpc", "registry") or "://" in ckpt_path:
            return ckpt_path
        checkpoint = load_checkpoint(ckpt_path, map_location=None)  # as the Trainer reads it
        saved = checkpoint.get("hyper_parameters", {}).get("_class_path")
        configured = self.config[subcommand]["model"].get("class_path")
        if saved is not None and configured is not None and _class_name(saved) != _class_name(configured):
            raise ValueError(
                f"--ckpt_path {ckpt_path} was written by {saved}, but the configured model is {configured}; "
                f"resume with --model.class_path {saved} (and its settings), or start a new run without --ckpt_path"
            )
        install_safe_io(self.trainer.strategy).hand_over(ckpt_path, checkpoint)
        return ckpt_path


class PeFLLPredictCLI(FederatedCLI):
    """The training config's model and data, plus the ``predict.*`` options of PeFLL-predict."""

    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        parser.add_argument("--predict.ckpt_path", type=str, required=True, help="trained PeFLL checkpoint")
        parser.add_argument("--predict.clients", type=Optional[list[int]], default=None,
                            help="client ids (default: the unseen clients, else all)")
        parser.add_argument("--predict.labels_hidden", type=bool, default=False,
                            help="do not use the clients' labels (needs a label-free embedding)")
        parser.add_argument("--predict.output_dir", type=str, default="personalized",
                            help="where client_<id>.pt state dicts are written")


def pefll_predict(args: list[str]) -> dict[int, float]:
    """Run PeFLL-predict from the command line; returns ``client id -> test accuracy`` (NaN without a test split)."""
    from fl_lightning.algorithms.pefll import PeFLL
    from fl_lightning.predict import predict_clients

    cli = PeFLLPredictCLI(args=args, run=False)
    options = cli.config["predict"]
    model, dm = cli.model, cli.datamodule
    if not isinstance(model, PeFLL):
        raise ValueError(f"pefll-predict needs a PeFLL model in the config, got {type(model).__name__}")
    checkpoint = load_checkpoint(options["ckpt_path"])
    model.load_state_dict(checkpoint["state_dict"])
    personal = predict_clients(model.eval(), dm, options["clients"], options["labels_hidden"], options["output_dir"])
    accuracies = {}
    for cid, client in personal.items():
        test = dm.client_data(cid, "test")
        if len(test) == 0:
            accuracies[cid] = float("nan")
            continue
        x, y = test.full()
        with torch.no_grad():
            accuracies[cid] = float((client(x).argmax(-1) == y).float().mean())
        print(f"client {cid}: test accuracy {accuracies[cid]:.4f} -> {Path(options['output_dir']) / f'client_{cid}.pt'}")
    return accuracies


#: the files that make a failed command's folder worth keeping: a round's checkpoint or history
_RESULTS = (".ckpt", "history.csv")


def missing_folders(folder: str) -> list[str]:
    """``folder`` and those of its parents that do not exist, the topmost first (none if it exists)."""
    missing: list[str] = []
    folder = os.path.abspath(folder)
    while not os.path.exists(folder):
        missing.insert(0, folder)
        parent = os.path.dirname(folder)
        if parent == folder:
            break
        folder = parent
    return missing


def remove_new_folders(folders: list[str]) -> None:
    """Remove the run folder a failed command made (the last of ``folders``, which
    :func:`missing_folders` found missing before it started) unless a round's results are in it (a
    checkpoint, ``history.csv``): what a failed start wrote (its ``config.yaml``, the loggers' first
    files) goes, and so do the parents it made, where nothing else came into them meanwhile."""
    if not folders or not os.path.isdir(folders[-1]):
        return
    if any(name.endswith(_RESULTS) for _, _, names in os.walk(folders[-1]) for name in names):
        return
    shutil.rmtree(folders[-1], ignore_errors=True)
    for parent in reversed(folders[:-1]):
        try:
            os.rmdir(parent)  # only if empty: another run may have started in it
        except OSError:
            return


def _class_name(class_path: str) -> str:
    """The class name of a class path (``fl_lightning.algorithms.FedAvg`` and
    ``fl_lightning.algorithms.fedavg.FedAvg`` name the same class)."""
    return class_path.rsplit(".", 1)[-1]


def _configured_is(callback: Any, cls: type) -> bool:
    """Whether a configured callback (an instance or a ``class_path`` entry) is a ``cls``."""
    if isinstance(callback, cls):
        return True
    class_path = callback.get("class_path") if isinstance(callback, (dict, Namespace)) else None
    if not isinstance(class_path, str):
        return False
    module, _, name = class_path.rpartition(".")
    try:
        configured = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError):
        return False
    return isinstance(configured, type) and issubclass(configured, cls)


def checkpoint_command(args: list[str]) -> None:
    """``fl-lightning checkpoint --add-checksum PATH [PATH ...]``: :func:`~fl_lightning.checkpoints.add_checksum`
    on each file, printing what was done."""
    parser = argparse.ArgumentParser(
        prog="fl-lightning checkpoint",
        description="Add its checksum to a checkpoint you trust that has none (written by another program, or by "
                    "fl_lightning before checkpoints carried one): checkpoints without one are refused, since a "
                    "change to their contents could not be detected.")
    parser.add_argument("--add-checksum", nargs="+", required=True, metavar="PATH", help="the checkpoint files")
    for path in parser.parse_args(args).add_checksum:
        print(f"{path}: {'checksum added' if add_checksum(path) else 'has a matching checksum already'}")


def main(args: Optional[list[str]] = None) -> None:
    """Entry point of the ``fl-lightning`` command."""
    argv = sys.argv[1:] if args is None else args
    if argv[:1] == ["pefll-predict"]:
        pefll_predict(argv[1:])
        return
    if argv[:1] == ["plot"]:
        plotting.main(argv[1:])
        return
    if argv[:1] == ["checkpoint"]:
        checkpoint_command(argv[1:])
        return
    FederatedCLI(args=args)


if __name__ == "__main__":
    main()
