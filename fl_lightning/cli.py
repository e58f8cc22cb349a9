"""``fl-lightning``: LightningCLI over federated modules and datamodules.

::

    fl-lightning fit --config configs/quickstart.yaml
    fl-lightning fit --config configs/fedavg_mnist.yaml --model.local_steps 5 --trainer.max_epochs 50
    fl-lightning validate --config configs/quickstart.yaml --ckpt_path last.ckpt
    fl-lightning predict --config configs/quickstart.yaml --ckpt_path last.ckpt   # -> <log folder>/predictions.pt
    fl-lightning fit --config configs/quickstart.yaml --print_config
    fl-lightning pefll-predict --config configs/pefll/<run>.yaml --predict.ckpt_path last.ckpt
    fl-lightning plot runs/quickstart

``plot`` draws a run's history (``fl_lightning.plotting``).

``pefll-predict`` takes the training config (model and data) and a trained PeFLL checkpoint and
writes each client's personalized model, generated with no finetuning (by default for the
clients held out as unseen), printing its accuracy on the client's test split.

``--model`` accepts any ``FederatedModule`` subclass and ``--data`` any
``FederatedDataModule`` subclass (``class_path`` + ``init_args``). The federated DDP
strategies are registered on import, so ``--trainer.strategy fl_ddp`` works.
"""

from __future__ import annotations

import importlib
import sys
import warnings
from pathlib import Path
from typing import Any, Optional

import torch
from jsonargparse import Namespace
from pytorch_lightning.callbacks import BasePredictionWriter, ModelCheckpoint
from pytorch_lightning.cli import LightningArgumentParser, LightningCLI

from fl_lightning import plotting
from fl_lightning.callbacks.history import RoundHistory
from fl_lightning.checkpoints import load_checkpoint
from fl_lightning.datamodules.base import FederatedDataModule
from fl_lightning.module import FederatedModule


DESCRIPTION = """fl-lightning: federated learning with one Lightning Trainer (a Trainer epoch is a round).

Besides the subcommands below, `fl-lightning plot RUN_DIR [RUN_DIR ...]` draws runs' metrics
per round and the label distribution of their clients (see `fl-lightning plot --help`), and
`fl-lightning pefll-predict --config <PeFLL training config> --predict.ckpt_path <checkpoint>`
writes each client's personalized model with PeFLL-predict (see `fl-lightning pefll-predict
--help`)."""


#: Lightning's advice, loading a checkpoint, to add its callbacks, where those missing are the ones the
#: CLI adds to ``fit`` only (their state keys: ``RoundCheckpoint{...}``, ``RoundHistory``)
_ADVICE_TO_ADD_FIT_CALLBACKS = (
    r"Be aware that when using `ckpt_path`, callbacks used to create the checkpoint need to be provided during "
    r"`Trainer` instantiation\. Please add the following callbacks: "
    r"\[(?:(?:'RoundHistory'|\"RoundCheckpoint\{[^\"]*\}\")(?:, )?)+\]\.$"
)


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
    * ``validate``, ``test`` and ``predict`` from a ``fit`` checkpoint do not repeat Lightning's
      advice to add the callbacks this CLI added to ``fit`` (``RoundCheckpoint``, ``RoundHistory``):
      their state resumes training, which these subcommands do not do. The advice stays for the
      configuration's own callbacks.
    """

    def __init__(self, args: Optional[list[str]] = None, run: bool = True) -> None:
        super().__init__(
            FederatedModule,
            FederatedDataModule,
            subclass_mode_model=True,
            subclass_mode_data=True,
            args=args,
            run=run,
            save_config_kwargs={"overwrite": True},
            parser_kwargs={"description": DESCRIPTION},
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

    def _run_subcommand(self, subcommand: str) -> None:
        if subcommand == "fit":
            super()._run_subcommand(subcommand)
            return
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=_ADVICE_TO_ADD_FIT_CALLBACKS)
            super()._run_subcommand(subcommand)

    def _parse_ckpt_path(self) -> None:
        """(Replaces ``LightningCLI``'s, which merges the checkpoint's hyperparameters into the
        configuration.) Check the checkpoint file and refuse one written by another algorithm."""
        subcommand = self.config.get("subcommand")
        if not subcommand:
            return
        ckpt_path = self.config[subcommand].get("ckpt_path")
        if not ckpt_path or ckpt_path in ("last", "best", "hpc", "registry"):
            return
        hparams = load_checkpoint(ckpt_path).get("hyper_parameters", {})
        saved = hparams.get("_class_path")
        configured = self.config[subcommand]["model"].get("class_path")
        if saved is not None and configured is not None and _class_name(saved) != _class_name(configured):
            raise ValueError(
                f"--ckpt_path {ckpt_path} was written by {saved}, but the configured model is {configured}; "
                f"resume with --model.class_path {saved} (and its settings), or start a new run without --ckpt_path"
            )


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


def main(args: Optional[list[str]] = None) -> None:
    """Entry point of the ``fl-lightning`` command."""
    argv = sys.argv[1:] if args is None else args
    if argv[:1] == ["pefll-predict"]:
        pefll_predict(argv[1:])
        return
    if argv[:1] == ["plot"]:
        plotting.main(argv[1:])
        return
    FederatedCLI(args=args)


if __name__ == "__main__":
    main()
