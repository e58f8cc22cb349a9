"""Run a paper's experiment: each run of its plan is ``fl-lightning fit`` with the configs and
overrides the plan lists, and each run's per-round metrics go into a compact result file.

    python -m experiments.sweep feddro --list                        # the runs, as fl-lightning commands
    python -m experiments.sweep feddro --out runs/feddro.json        # run them all (one after the other)
    python -m experiments.sweep feddro --only 'tune/fedavg_*' tune/feddro_lr0.05_lam2_I1_s0 --out runs/feddro.json
    python -m experiments.sweep feddro --jobs 4 --out runs/feddro.json   # four runs at a time, one process each
    python -m experiments.feddro.report runs/feddro.json             # the document's tables from that file

A plan, ``experiments/<paper>/plan.py``, has ``runs()``, the list of :class:`Run` (name, arguments,
the settings the tables group by, what to record), and may have ``summary(cli) -> dict``, figures
read once per run after training. Runs already in the output file are skipped, so a sweep that
was stopped resumes. Each run is the CLI in-process (``FederatedCLI``, the same parsing as
``fl-lightning fit``) with a :class:`Recorder` added, one torch thread, no logger and no progress
bar; its output goes to ``runs/<paper>/<name>/``. The run's own checkpoint callbacks (the configs'
``RoundCheckpoint``, Lightning's default ``ModelCheckpoint``) are left out: what the sweep keeps is
the record, and one checkpoint per run at its evaluated rounds
(``runs/<paper>/<name>/resume/last.ckpt``, the recorder's history included), from which a run that
was stopped resumes, bitwise as if it had not stopped; it goes once the run is recorded.
The format of the result file:
:mod:`experiments.results`. ``docs/results/<paper>.json`` is such a file.

With ``--jobs N`` the pending runs go, in plan order (so that the first seeds come first), to N
slots, each run to the first slot that is free, so that no slot idles while runs are left, whatever
their lengths. A slot is a process of its own that runs the runs it is handed one after the other,
as a sweep without ``--jobs`` does (so the imports and a GPU's set-up are paid once a slot, not once
a run). Slot ``k``'s runs write their records to a part file beside the result file
(``<out>.part<k>.json``, their output to ``<out>.part<k>.log``); the parts are merged into the
result file when the last run ends, and at the start of the next sweep if the sweep was stopped. A
run that fails ends its slot's process, and is reported at the end; the slot's next run starts a
new process, and the others go on.

With ``--time-limit S`` (a machine lent for a while) each run stops at its first evaluated round after
``S`` seconds from the sweep's start, and a run not begun by then is not started. A run so stopped is
recorded with its evaluations so far and ``"stopped"`` (the round it stopped after, of how many); a
later sweep runs it again (resuming from its checkpoint where that is still there) and replaces it.
With ``--until-round N`` each run stops likewise at its first evaluated round from round N on, and a
run recorded as stopped there is not started again: a sweep of long runs on a machine lent for less
than they take advances all of them together (``--until-round 100``, then ``200`` in a later session,
``--out`` a file kept between the sessions, the checkpoints under ``runs/`` too), so that every row of a
table has its seeds at a common round, where ``--time-limit`` alone would take the first runs far and
leave the rest unstarted.
A run records the project commit it ran on (:func:`experiments.results.commit`), the device it
trained on and the process's environment (:func:`experiments.results.environment`: versions, threads).
A sweep refuses to start, and stops before its next run, while code under ``fl_lightning/``,
``experiments/`` or ``configs/`` holds uncommitted changes or the checkout has moved to another commit
than the one its processes imported: a record names a commit that reproduces it. Run long sweeps from a
checkout of their own (``git worktree add``) while you work on another. Each process keeps the memory its runs free for their next allocations
(:func:`keep_freed_memory`: glibc would map large vectors anew every round). ``--backend batched``
runs every client of the plan on the batched backend (a GPU sweep of plans written for the
sequential one: the same figures to float tolerance), recorded with each run.
"""

from __future__ import annotations

import argparse
import ctypes
import fnmatch
import gc
import glob
import importlib
import os
import shlex
import select
import shutil
import subprocess
import sys
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, Optional, Sequence
from unittest.mock import patch

import numpy as np
import pytorch_lightning as pl
import torch
import torch.nn.functional as F
from pytorch_lightning.callbacks import Checkpoint
from torch.utils.data import DataLoader, Dataset, Subset

from experiments import results
from fl_lightning.backends import BACKENDS
from fl_lightning.callbacks.checkpoint import RoundCheckpoint
from fl_lightning.cli import FederatedCLI
from fl_lightning.functional.dro import KLDRO, objective_value
from fl_lightning.module import NonFiniteUpdateError

#: the project's root (what a parallel sweep's workers import from)
ROOT = Path(__file__).resolve().parents[1]
#: what a run that diverges raises (a non-finite estimate or update the algorithm refuses to go on
#: with): recorded as the run's outcome, not a failure of the sweep
DIVERGED = (FloatingPointError, NonFiniteUpdateError)


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
        classes: also record each evaluated set's balanced (mean per-class) and worst-class
            accuracy, and each class's on the test set (:func:`measures`).
        dro_lam: also record the KL-DRO objective with this lambda on the pooled training splits
            (``train_kl_dro``; measured there whether or not ``train`` is set).
    """

    name: str
    args: Sequence[str]
    params: dict[str, Any]
    every: int
    at_start: bool = False
    train: bool = False
    metrics: tuple[str, ...] = ()
    classes: bool = False
    dro_lam: Optional[float] = None

    def command(self) -> str:
        """The run as a shell command."""
        return "fl-lightning fit " + shlex.join(self.args)


@torch.no_grad()
def per_sample(model: torch.nn.Module, dataset: Dataset, batch_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per sample of ``dataset``: the cross-entropy of ``model`` (as float64), whether its prediction
    is right, and the label."""
    model.eval()
    device = next(model.parameters()).device
    losses, right, labels = [], [], []
    for x, y in DataLoader(dataset, batch_size=batch_size):
        x, y = x.to(device), y.to(device)
        logits = model(x)
        losses.append(F.cross_entropy(logits, y, reduction="none").double().cpu())
        right.append((logits.argmax(-1) == y).cpu())
        labels.append(y.cpu())
    model.train()
    return torch.cat(losses), torch.cat(right), torch.cat(labels)


def evaluate(model: torch.nn.Module, dataset: Dataset, batch_size: int) -> tuple[float, float]:
    """Mean cross-entropy and accuracy of ``model`` on ``dataset``."""
    losses, right, _ = per_sample(model, dataset, batch_size)
    return float(losses.mean()), float(right.double().mean())


def measures(losses: torch.Tensor, right: torch.Tensor, labels: torch.Tensor, classes: bool = False,
             dro_lam: Optional[float] = None) -> dict[str, float]:
    """``loss`` and ``acc`` of per-sample figures (:func:`per_sample`); with ``classes``, the mean
    per-class accuracy ``acc_balanced``, the lowest ``acc_worst_class`` and each ``acc_class<c>``
    (classes present in ``labels``); with ``dro_lam``, the KL-DRO objective
    ``kl_dro = lam log mean_i exp(loss_i / lam)`` (the exact inner maximum of the KL-regularized DRO problem;
    NaN or inf where a loss is)."""
    out = {"loss": float(losses.mean()), "acc": float(right.double().mean())}
    if classes:
        present = labels.unique()
        per_class = {int(c): float(right[labels == c].double().mean()) for c in present}
        out["acc_balanced"] = sum(per_class.values()) / len(per_class)
        out["acc_worst_class"] = min(per_class.values())
        out.update({f"acc_class{c}": v for c, v in per_class.items()})
    if dro_lam is not None:
        if torch.isfinite(losses).all():
            shift = float(losses.max()) / dro_lam  # exp(loss / lam - shift) <= 1: no overflow at any lambda
            out["kl_dro"] = float(objective_value(KLDRO(dro_lam, scale_by_lambda=True, shift=shift), losses))
        else:  # an overflowing model: NaN, or inf
            out["kl_dro"] = float("nan") if losses.isnan().any() else float("inf")
    return out


class Recorder(pl.Callback):
    """Records the global model's metrics at the rounds a :class:`Run` asks for: ``test_loss`` and
    ``test_acc`` on the global test set, ``val_loss`` and ``val_acc`` on the pooled validation
    splits (where the clients hold any: what tuning chooses on), ``train_loss`` and ``train_acc``
    on the pooled training splits (``train``), the per-class figures of each (``classes``), the
    KL-DRO objective on the training splits (``dro_lam``), and the logged metrics named by
    ``metrics`` when a validation ran in that round. Test figures are measured here, whatever the
    Trainer validates on. A method without a global model (PeFLL, pFedHN, Local only) has only
    the ``metrics``: its clients' own models are what its callbacks (``ClientMetrics``) evaluate.
    A model that overflows is measured as it is (NaN or infinite losses, the accuracy of its
    predictions): only the errors of :data:`DIVERGED` stop a run."""

    def __init__(self, every: int, at_start: bool = False, train: bool = False, metrics: Sequence[str] = (),
                 classes: bool = False, dro_lam: Optional[float] = None) -> None:
        self.every = every
        self.at_start = at_start
        self.train = train
        self.metrics = tuple(metrics)
        self.classes = classes
        self.dro_lam = dro_lam
        self.history: list[dict[str, float]] = []
        self.wall_s = 0.0  # training time before this process (a resumed run's), see state_dict
        self.commits: list[str] = []  # the code of each process that ran this run (fit sets it)
        self._validated_round = -1
        self._started = time.perf_counter()

    def measure(self, trainer: pl.Trainer, module: Any, round_number: int) -> dict[str, float]:
        """The evaluation after ``round_number`` rounds."""
        dm = trainer.datamodule
        sets = {}
        if module.has_global_model:  # a personalized method's clients are measured by its callbacks (``metrics``)
            sets["test"] = dm.global_test_set()
            if any(len(split) for split in dm.splits["val"]):
                sets["val"] = dm.validation_set()
            if self.train or self.dro_lam is not None:
                sets["train"] = Subset(dm.pool, np.concatenate(dm.splits["train"]).tolist())
        point: dict[str, float] = {"round": round_number}
        for name, dataset in sets.items():
            figures = measures(*per_sample(module.client, dataset, dm.eval_batch_size), self.classes,
                               self.dro_lam if name == "train" else None)
            if name == "train" and not self.train:
                figures = {"kl_dro": figures["kl_dro"]}
            if name != "test":  # each class's accuracy on the test set only
                figures = {k: v for k, v in figures.items() if not k.startswith("acc_class")}
            point.update({f"{name}_{key}": value for key, value in figures.items()})
        if self._validated_round == round_number:
            point.update({k: float(v) for k, v in sorted(trainer.callback_metrics.items()) if k.startswith(self.metrics)})
        return point

    def elapsed(self) -> float:
        """Training wall time in seconds, over the processes that ran this run."""
        return self.wall_s + time.perf_counter() - self._started

    def state_dict(self) -> dict[str, Any]:
        """The history so far and the time it took (in the run's checkpoints: a resumed run goes on with them)."""
        return {"history": self.history, "wall_s": self.elapsed(), "validated_round": self._validated_round,
                "commits": self.commits}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.history, self.wall_s = list(state["history"]), state["wall_s"]
        self._validated_round, self._started = state["validated_round"], time.perf_counter()
        self.commits = [c for c in state["commits"] if c not in self.commits] + self.commits

    def on_train_start(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
        if self.at_start and not self.history:  # a resumed run has it
            self.history.append(self.measure(trainer, module, 0))

    def on_validation_end(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
        if not trainer.sanity_checking:
            self._validated_round = trainer.current_epoch + 1

    def on_train_epoch_end(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
        round_number = trainer.current_epoch + 1
        if round_number % self.every == 0 or round_number == trainer.max_epochs:
            self.history.append(self.measure(trainer, module, round_number))
            print(" ".join(f"{k}={v:.4f}" if isinstance(v, float) else f"{k}={v}"
                           for k, v in self.history[-1].items() if "_acc_class" not in k), flush=True)


@dataclass(frozen=True)
class Limits:
    """Where a sweep stops its runs: at the wall-clock time ``stop_at`` (``time.time()``; None: no time
    limit) and at round ``until`` (None: no round limit)."""

    stop_at: Optional[float] = None
    until: Optional[int] = None

    def reason(self, round_number: int) -> Optional[str]:
        """Which limit a run that has just ended round ``round_number`` has reached (None: neither)."""
        if self.until is not None and round_number >= self.until:
            return "round limit"
        if self.timed_out():
            return "time limit"
        return None

    def timed_out(self) -> bool:
        """Whether the time limit has passed: no run starts after it."""
        return self.stop_at is not None and time.time() >= self.stop_at

    def options(self) -> list[str]:
        """These limits as a slot's command-line options (:func:`slot_command`)."""
        return ([] if self.stop_at is None else ["--stop-at", repr(self.stop_at)]) + \
            ([] if self.until is None else ["--until-round", str(self.until)])


class Limit(pl.Callback):
    """Stops the run at its first evaluated round (every ``every`` rounds, as the recorder and the
    resume checkpoint) at which one of ``limits`` is reached."""

    def __init__(self, limits: Limits, every: int) -> None:
        self.limits, self.every = limits, every
        #: why and after which round the run stopped (None: it ran to its end)
        self.stopped: Optional[str] = None

    def on_train_epoch_end(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
        round_number = trainer.current_epoch + 1
        if round_number % self.every or round_number >= trainer.max_epochs:
            return
        reason = self.limits.reason(round_number)
        if reason is not None:
            trainer.should_stop = True
            self.stopped = f"{reason}, after round {round_number} of {trainer.max_epochs}"


def split_sizes(cli: Any) -> dict[str, int]:
    """The federation's pooled training and validation split sizes (a plan's ``summary`` part)."""
    dm = cli.datamodule
    return {"train_samples": sum(len(s) for s in dm.splits["train"]),
            "val_samples": sum(len(s) for s in dm.splits["val"])}


def resume_dir(paper: str, name: str) -> Path:
    """Where run ``name`` of ``paper``'s plan checkpoints itself until it is recorded."""
    return Path("runs") / paper / name / "resume"


def in_process_cli(args: Sequence[str]) -> FederatedCLI:
    """``fl-lightning fit``'s CLI over ``args`` alone, not run (``run=False``): the process's own command
    line (a sweep's, an experiment's) is set aside while it parses, so LightningCLI does not warn, once
    a run, that arguments were given both ways."""
    with patch.object(sys, "argv", sys.argv[:1]):
        return FederatedCLI(args=list(args), run=False)


def fit(run: Run, paper: str, plan: Any, commit: str, limits: Limits = Limits(),
        backend: Optional[str] = None) -> results.Run:
    """Train ``run`` and return its record for the result file (``commit``: the code it runs;
    ``backend``: the clients' backend where it is not the configs'). A run that diverges
    (:data:`DIVERGED`) is recorded with its evaluations so far and ``"diverged"``: the error and the
    round it stopped in; one stopped by one of ``limits`` (:class:`Limit`) with ``"stopped"``. The
    record names the device the run trained on (``"device"``) and the backend where it was given
    (``"backend"``)."""
    chosen = [] if backend is None else ["--model.init_args.client_backend", backend]
    quiet = ["--trainer.logger", "false", "--trainer.enable_progress_bar", "false",
             "--trainer.enable_model_summary", "false", "--data.init_args.print_summary", "false",
             "--trainer.default_root_dir", f"runs/{paper}/{run.name}"]
    cli = in_process_cli([*run.args, *chosen, *quiet])
    recorder = Recorder(run.every, run.at_start, run.train, run.metrics, run.classes, run.dro_lam)
    recorder.commits = [commit]
    resume = resume_dir(paper, run.name)
    # no checkpoint of the run's own (a PeFLL run's default one wrote 106 MB a round); the recorder, then the
    # resume checkpoint: the checkpoint of a round holds that round's evaluation
    cli.trainer.callbacks = [c for c in cli.trainer.callbacks if not isinstance(c, Checkpoint)]
    cli.trainer.callbacks += [recorder, RoundCheckpoint(str(resume), every_n_rounds=run.every, asynchronous=False)]
    limit = Limit(limits, run.every)
    cli.trainer.callbacks.append(limit)
    last = resume / "last.ckpt"
    if last.exists():
        print(f"{run.name}: resuming from {last}", flush=True)
    diverged = None
    try:
        cli.trainer.fit(cli.model, cli.datamodule, ckpt_path=str(last) if last.exists() else None)
    except DIVERGED as error:
        diverged = f"round {cli.trainer.current_epoch + 1}: {type(error).__name__}: {error}"
        print(f"{run.name} diverged in {diverged}", flush=True)
    record = results.record(run.name, commit, run.params, recorder.elapsed(), recorder.history,
                            device_name(cli.trainer))
    if backend is not None:
        record["backend"] = backend
    if len(recorder.commits) > 1:  # stopped and resumed on other code: every commit it ran on
        record["commits"] = recorder.commits
    if diverged is not None:
        record["diverged"] = diverged
    if limit.stopped is not None:
        record["stopped"] = limit.stopped
    if hasattr(plan, "summary"):
        record["summary"] = plan.summary(cli)
    return record


def device_name(trainer: pl.Trainer) -> str:
    """The device ``trainer`` trains on, as a reader would name it: ``cpu`` or ``cuda: NVIDIA H100 80GB HBM3``."""
    device = trainer.strategy.root_device
    return f"cuda: {torch.cuda.get_device_name(device)}" if device.type == "cuda" else device.type


def part_path(out: Path, k: int) -> Path:
    """The result file of worker ``k`` of a parallel sweep into ``out``."""
    return out.with_name(f"{out.stem}.part{k}{out.suffix}")


def merge_parts(out: Path) -> int:
    """Add the runs of ``out``'s part files (a parallel sweep's workers') to ``out`` and remove the
    parts; returns how many runs were added."""
    parts = sorted(out.parent.glob(f"{glob.escape(out.stem)}.part*{out.suffix}"))
    if not parts:
        return 0
    runs = {run["name"]: run for run in results.load(out)}
    added = [run for part in parts for run in results.load(part)]
    runs.update((run["name"], run) for run in added)  # a rerun replaces the earlier record
    results.save(out, runs.values())
    for part in parts:
        part.unlink()
    return len(added)


def record_run(run: Run, paper: str, plan: Any, out: Path, commit: str, limits: Limits = Limits(),
               backend: Optional[str] = None) -> None:
    """Train ``run`` (:func:`fit`) and add its record to ``out``; once it is recorded for good (not
    stopped by a limit), its resume checkpoint goes. The run's memory is handed back, so that
    the next run of the process sizes its blocks by the device's free memory as a new process would."""
    check_unchanged(commit)
    print(f"== {run.name}: {run.command()}", flush=True)
    started = time.perf_counter()
    record = fit(run, paper, plan, commit, limits, backend)
    results.add(out, record)
    print(f"{run.name}: recorded after {time.perf_counter() - started:.0f} s ({record['wall_s']:.0f} s of training "
          "and evaluation)", flush=True)
    if "stopped" not in record:
        shutil.rmtree(resume_dir(paper, run.name), ignore_errors=True)
    gc.collect()
    if torch.cuda.is_initialized():
        torch.cuda.empty_cache()


def check_unchanged(commit: str) -> None:
    """Refuse to start a run while the checkout is no longer ``commit``, the code this process imported
    (configs and plans are read again by every run).

    Raises:
        UncommittedChangesError: code changes that are not committed (:func:`experiments.results.commit`).
        RuntimeError: the checkout is at another commit now.
    """
    now = results.commit()
    if now != commit:
        raise RuntimeError(f"the checkout moved from {commit} to {now} while the sweep ran: its processes run "
                           f"{commit}'s code and would read {now}'s configs; start the sweep again")


def serve(runs: Sequence[Run], paper: str, plan: Any, out: Path, ready: int, limits: Limits = Limits(),
          backend: Optional[str] = None) -> None:
    """A slot of a parallel sweep: record the runs whose names its sweep writes to stdin, one a
    line, one after the other, and write each name to the file descriptor ``ready`` once it is
    recorded. Ends at the end of stdin."""
    by_name = {run.name: run for run in runs}
    commit = results.commit()  # the code this slot imported
    with os.fdopen(ready, "w", buffering=1) as done:
        for line in sys.stdin:
            record_run(by_name[line.strip()], paper, plan, out, commit, limits, backend)
            done.write(line)


def slot_command(paper: str, part: Path, ready: int, options: Sequence[str]) -> list[str]:
    """The command of a parallel sweep's slot that records into ``part`` (:func:`serve`)."""
    return [sys.executable, "-m", "experiments.sweep", paper, "--serve", str(ready), "--out", str(part), *options]


@dataclass
class Slot:
    """A parallel sweep's slot: its process, the stream its finished runs' names come back on, and
    the run it is on (None: idle)."""

    process: subprocess.Popen
    done: IO[str]
    run: Optional[str] = None


def run_parallel(paper: str, names: Sequence[str], out: Path, jobs: int, threads: int,
                 limits: Limits = Limits(), backend: Optional[str] = None) -> None:
    """Run the plan's runs ``names`` (in this order) in ``jobs`` slots, each run in the first slot
    that is free, and merge their results into ``out`` (``limits``: the sweep's, see :class:`Limit`;
    ``backend``: see :func:`fit`)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    out.parent.mkdir(parents=True, exist_ok=True)
    options = ["--threads", str(threads), *limits.options()]
    if backend is not None:
        options += ["--backend", backend]
    queue, slots, failed = deque(names), {}, []

    def start(k: int) -> Slot:
        read, write = os.pipe()
        with part_path(out, k).with_suffix(".log").open("a") as log:
            process = subprocess.Popen(slot_command(paper, part_path(out, k), write, options), stdin=subprocess.PIPE,
                                       stdout=log, stderr=subprocess.STDOUT, env=env, pass_fds=(write,), text=True)
        os.close(write)
        return Slot(process, os.fdopen(read))

    def end(k: int) -> None:  # the slot's process ended during its run
        slot = slots.pop(k)
        slot.done.close()
        failed.append(f"{slot.run} (exit {slot.process.wait()}, output in {part_path(out, k).with_suffix('.log')})")

    def close(slot: Slot) -> None:  # the end of the slot's runs: its process exits
        slot.process.stdin.close()
        slot.process.wait()
        slot.done.close()

    print(f"{len(names)} runs, {jobs} at a time, output in {part_path(out, 0).with_suffix('.log')} ...", flush=True)
    while True:
        for k in range(jobs):  # the next runs to the free slots, the first slot first
            if not queue or (k in slots and slots[k].run is not None):
                continue
            if limits.timed_out():
                print(f"time limit: {queue[0]} and the runs after it are not started", flush=True)
                queue.clear()
                break
            if k not in slots:
                slots[k] = start(k)
            slot = slots[k]
            slot.run = queue.popleft()
            try:
                slot.process.stdin.write(slot.run + "\n")
                slot.process.stdin.flush()
            except BrokenPipeError:  # it ended before its run began
                end(k)
        if not queue:  # nothing left to hand out: an idle slot's process ends now, its memory freed
            for k in [k for k, slot in slots.items() if slot.run is None]:
                close(slots.pop(k))
        busy = {slot.done: k for k, slot in slots.items() if slot.run is not None}
        if not busy:
            break
        for stream in select.select(list(busy), [], [])[0]:
            k = busy[stream]
            if stream.readline():
                slots[k].run = None
            else:
                end(k)
    for slot in slots.values():
        close(slot)
    print(f"{merge_parts(out)} runs added to {out}", flush=True)
    if failed:
        raise SystemExit(f"{len(failed)} of {len(names)} runs failed: {'; '.join(failed)}")


def use_threads(threads: int) -> None:
    """Run torch's operations on ``threads`` intra-op threads, named in ``OMP_NUM_THREADS`` too: the
    sweep's choice, which the engine keeps (``fl_lightning.cpu_threads``)."""
    os.environ["OMP_NUM_THREADS"] = str(threads)
    torch.set_num_threads(threads)


def keep_freed_memory() -> None:
    """Keep the memory a run frees for its next allocations (glibc's ``M_MMAP_MAX`` 0 and
    ``M_TRIM_THRESHOLD`` at its largest; a no-op elsewhere). glibc maps each allocation above its
    threshold (32 MiB at most) anew and unmaps it when it is freed, so a model's large vectors are
    page-faulted in again every round: PeFLL's and pFedHN's hypernetwork updates (8.7 M entries, 35
    MB) are summed and divided in 44-53 ms a round instead of 128-161 ms, and a 500-client pFedHN
    run's 60 rounds take 44-45 s instead of 53 s on this CPU. The arithmetic is the same. The client
    state store's giving back of freed memory (:class:`fl_lightning.freed_memory.FreedMemory`) does not
    undo it: it trims only once the process's resident memory has grown past the store's budget (1 GiB
    by default, 32 MiB at least), which the memory kept here for the next round never makes it do."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return
    m_trim_threshold, m_mmap_max = -1, -4
    mallopt(m_mmap_max, 0)
    mallopt(m_trim_threshold, 2**31 - 1)


def main(argv: Optional[Sequence[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("paper", help="the plan: experiments/<paper>/plan.py")
    parser.add_argument("--list", action="store_true", help="print every run as a command and exit")
    parser.add_argument("--only", nargs="+", metavar="PATTERN", help="only the runs matching these names or patterns")
    parser.add_argument("--out", type=Path, help="result file (default: runs/<paper>.json)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (the documented runs used 1)")
    parser.add_argument("--jobs", type=int, default=1, help="runs at a time, one process a slot")
    parser.add_argument("--time-limit", type=float, metavar="SECONDS",
                        help="stop every run at its first evaluated round after this many seconds (recorded as "
                             "stopped; a later sweep runs it again); start no run after it")
    parser.add_argument("--until-round", type=int, metavar="N",
                        help="stop every run at its first evaluated round from round N on (recorded as stopped; a "
                             "later sweep with a larger N resumes it); a run recorded there already is skipped")
    parser.add_argument("--backend", choices=sorted(BACKENDS),
                        help="the clients' backend of every run (default: the configs'); recorded with each run")
    parser.add_argument("--stop-at", type=float, help=argparse.SUPPRESS)  # a slot's: the sweep's limit, as time.time()
    parser.add_argument("--serve", type=int, metavar="FD", help=argparse.SUPPRESS)  # a slot's: see serve()
    opts = parser.parse_args(argv)
    if opts.jobs < 1 or opts.threads < 1:
        parser.error(f"--jobs and --threads must be >= 1, got --jobs {opts.jobs} --threads {opts.threads}")
    if opts.time_limit is not None and not opts.time_limit > 0:
        parser.error(f"--time-limit must be > 0 seconds, got {opts.time_limit}")
    if opts.until_round is not None and opts.until_round < 1:
        parser.error(f"--until-round must be a round >= 1, got {opts.until_round}")
    limits = Limits(time.time() + opts.time_limit if opts.time_limit is not None else opts.stop_at, opts.until_round)
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
    try:
        commit = results.commit()  # the code imported now, which every run of this process runs
    except results.UncommittedChangesError as error:
        raise SystemExit(f"experiments.sweep: {error}") from None
    if opts.serve is not None:
        use_threads(opts.threads)
        keep_freed_memory()
        serve(runs, opts.paper, plan, out, opts.serve, limits, opts.backend)
        return
    merge_parts(out)  # the finished runs of a parallel sweep that was stopped
    done = {r["name"] for r in results.load(out) if "stopped" not in r
            or limits.until is not None and r["history"][-1]["round"] >= limits.until}
    pending = [run.name for run in runs if run.name not in done]
    if opts.jobs > 1 and len(pending) > 1:
        run_parallel(opts.paper, pending, out, opts.jobs, opts.threads, limits, opts.backend)
        return
    use_threads(opts.threads)
    keep_freed_memory()
    for run in runs:
        if run.name in done:
            continue
        if limits.timed_out():
            print(f"time limit: {run.name} and the runs after it are not started", flush=True)
            break
        record_run(run, opts.paper, plan, out, commit, limits, opts.backend)


if __name__ == "__main__":
    main(sys.argv[1:])
