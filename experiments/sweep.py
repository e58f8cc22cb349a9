"""Run a paper's experiment: each run of its plan is ``fl-lightning fit`` with the configs and
overrides the plan lists, and each run's per-round metrics go into a compact result file.

    python -m experiments.sweep feddro --list                        # the runs, as fl-lightning commands
    python -m experiments.sweep feddro --out runs/feddro.json        # run them all (one after the other)
    python -m experiments.sweep feddro --only 'fedavg_*' feddro_lam5_beta0.5_s0 --out runs/feddro.json
    python -m experiments.feddro.report runs/feddro.json             # the document's tables from that file

A plan, ``experiments/<paper>/plan.py``, has ``runs()``, the list of :class:`Run` (name, arguments,
the settings the tables group by, what to record), and may have ``summary(cli) -> dict``, figures
read once per run after training. Runs already in the output file are skipped, so a sweep that
was stopped resumes. Each run is the CLI in-process (``FederatedCLI``, the same parsing as
``fl-lightning fit``) with a :class:`Recorder` added, one torch thread, no logger and no progress
bar; its checkpoints go to ``runs/<paper>/<name>/``. The format of the result file:
:mod:`experiments.results`. ``docs/results/<paper>.json`` is such a file.
"""

from __future__ import annotations

import argparse
import fnmatch
import importlib
import shlex
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Sequence

import numpy as np
import pytorch_lightning as pl
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset, Subset

from experiments import results
from fl_lightning.cli import FederatedCLI


@dataclass(frozen=True)
class Run:
    """One ``fl-lightning fit`` run of a plan.

    Args:
        name: unique in the plan; the run's key in the result file.
        args: the arguments after ``fl-lightning fit`` (``--config`` files and overrides).
        params: the settings the document's tables group runs by.
        every: evaluate every ``every`` rounds, and after the last.
        at_start: also evaluate before the first round (round 0).
        train: also measure loss and accuracy on the pooled training splits.
        metrics: prefixes of the logged metrics to record at the evaluated rounds where a
            validation ran (what validation callbacks log: ``class/``, ``local``...).
    """

    name: str
    args: Sequence[str]
    params: dict[str, Any]
    every: int
    at_start: bool = False
    train: bool = False
    metrics: tuple[str, ...] = ()

    def command(self) -> str:
        """The run as a shell command."""
        return "fl-lightning fit " + shlex.join(self.args)


@torch.no_grad()
def evaluate(model: torch.nn.Module, dataset: Dataset, batch_size: int) -> tuple[float, float]:
    """Mean cross-entropy and accuracy of ``model`` on ``dataset``."""
    model.eval()
    device = next(model.parameters()).device
    loss, correct, n = 0.0, 0, 0
    for x, y in DataLoader(dataset, batch_size=batch_size):
        x, y = x.to(device), y.to(device)
        logits = model(x)
        loss += float(F.cross_entropy(logits, y, reduction="sum"))
        correct += int((logits.argmax(-1) == y).sum())
        n += len(y)
    model.train()
    return loss / n, correct / n


class Recorder(pl.Callback):
    """Records the global model's metrics at the rounds a :class:`Run` asks for: ``test_loss`` and
    ``test_acc`` on the global test set, ``val_loss`` and ``val_acc`` on the pooled validation
    splits (where the clients hold any: what tuning chooses on), ``train_loss`` and ``train_acc``
    on the pooled training splits (``train``), and the logged metrics named by ``metrics`` when a
    validation ran in that round. Test figures are measured here, whatever the Trainer validates on."""

    def __init__(self, every: int, at_start: bool = False, train: bool = False, metrics: Sequence[str] = ()) -> None:
        self.every = every
        self.at_start = at_start
        self.train = train
        self.metrics = tuple(metrics)
        self.history: list[dict[str, float]] = []
        self._validated_round = -1

    def measure(self, trainer: pl.Trainer, module: Any, round_number: int) -> dict[str, float]:
        """The evaluation after ``round_number`` rounds."""
        dm = trainer.datamodule
        point: dict[str, float] = {"round": round_number}
        point["test_loss"], point["test_acc"] = evaluate(module.client, dm.global_test_set(), dm.eval_batch_size)
        if any(len(split) for split in dm.splits["val"]):
            point["val_loss"], point["val_acc"] = evaluate(module.client, dm.validation_set(), dm.eval_batch_size)
        if self.train:
            pooled = Subset(dm.pool, np.concatenate(dm.splits["train"]).tolist())
            point["train_loss"], point["train_acc"] = evaluate(module.client, pooled, dm.eval_batch_size)
        if self._validated_round == round_number:
            point.update({k: float(v) for k, v in sorted(trainer.callback_metrics.items()) if k.startswith(self.metrics)})
        return point

    def on_train_start(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
        if self.at_start:
            self.history.append(self.measure(trainer, module, 0))

    def on_validation_end(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
        if not trainer.sanity_checking:
            self._validated_round = trainer.current_epoch + 1

    def on_train_epoch_end(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
        round_number = trainer.current_epoch + 1
        if round_number % self.every == 0 or round_number == trainer.max_epochs:
            self.history.append(self.measure(trainer, module, round_number))
            print(" ".join(f"{k}={v:.4f}" if isinstance(v, float) else f"{k}={v}"
                           for k, v in self.history[-1].items()), flush=True)


def fit(run: Run, paper: str, plan: Any, commit: str) -> results.Run:
    """Train ``run`` and return its record for the result file (``commit``: the code it runs)."""
    quiet = ["--trainer.logger", "false", "--trainer.enable_progress_bar", "false",
             "--trainer.enable_model_summary", "false", "--data.init_args.print_summary", "false",
             "--trainer.default_root_dir", f"runs/{paper}/{run.name}"]
    cli = FederatedCLI(args=[*run.args, *quiet], run=False)
    recorder = Recorder(run.every, run.at_start, run.train, run.metrics)
    cli.trainer.callbacks.append(recorder)
    start = time.perf_counter()
    cli.trainer.fit(cli.model, cli.datamodule)
    record = {"name": run.name, "commit": commit, "params": run.params,
              "wall_s": round(time.perf_counter() - start, 1), "history": recorder.history}
    if hasattr(plan, "summary"):
        record["summary"] = plan.summary(cli)
    return record


def main(argv: Optional[Sequence[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("paper", help="the plan: experiments/<paper>/plan.py")
    parser.add_argument("--list", action="store_true", help="print every run as a command and exit")
    parser.add_argument("--only", nargs="+", metavar="PATTERN", help="only the runs matching these names or patterns")
    parser.add_argument("--out", type=Path, help="result file (default: runs/<paper>.json)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (the documented runs used 1)")
    opts = parser.parse_args(argv)
    plan = importlib.import_module(f"experiments.{opts.paper}.plan")
    runs = plan.runs()
    if opts.only:
        unmatched = [p for p in opts.only if not any(fnmatch.fnmatchcase(r.name, p) for r in runs)]
        if unmatched:
            parser.error(f"no run of the plan matches {unmatched} (--list shows the names)")
        runs = [r for r in runs if any(fnmatch.fnmatchcase(r.name, p) for p in opts.only)]
    if opts.list:
        for run in runs:
            print(f"# {run.name}\n{run.command()}")
        return
    out = opts.out or Path("runs") / f"{opts.paper}.json"
    done = {r["name"] for r in results.load(out)}
    torch.set_num_threads(opts.threads)
    commit = results.commit()  # the code imported now, which every run of this process runs
    for run in runs:
        if run.name in done:
            continue
        print(f"== {run.name}: {run.command()}", flush=True)
        results.add(out, fit(run, opts.paper, plan, commit))


if __name__ == "__main__":
    main(sys.argv[1:])
