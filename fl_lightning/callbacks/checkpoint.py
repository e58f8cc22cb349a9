"""``RoundCheckpoint``: a resumable checkpoint every round, written atomically, off the training thread;
:func:`last_round_checkpoint`: the file ``ckpt_path="last"`` resumes; :func:`checkpoint_run`: the run
folder of a checkpoint.

A federation that crashes in round 300 should resume from round 299, not from the start.
Lightning's ``ModelCheckpoint(save_last=True, save_top_k=0)`` writes ``last.ckpt`` only when
training ends; ``RoundCheckpoint`` writes it at the end of every ``every_n_rounds``-th round
(and of the last one). A checkpoint is written to a temporary file (``last.ckpt.tmp``), flushed
to disk and renamed over ``last.ckpt``: a kill at any moment leaves either the previous
checkpoint or the new one, never a partial file; the temporary file a kill left is removed when
the next run writing into the folder starts (nothing reads it as a checkpoint). Resume with
``ckpt_path=".../last.ckpt"`` (or ``ckpt_path="last"``: :func:`last_round_checkpoint`): the run
continues bitwise as if it had never stopped (CPU).

A folder holds one run's checkpoint: a run claims its ``dirpath`` when training starts, by
writing its name in ``owner.json`` there, and a run whose folder another run claimed (or that
holds a ``last.ckpt`` of another run) is refused before training, unless it resumes from that
folder's ``last.ckpt`` (it then continues that run, and becomes the owner).

A round can take a few milliseconds on a GPU, less than writing its checkpoint. So the
checkpoint is gathered on the training thread (every process takes part, as in
``Trainer.save_checkpoint``), every tensor in it is copied (training updates parameters,
optimizer state and client state in place), and one background thread on rank 0 writes the
copy while the next round trains. One write is pending at most: a round that ends while the
previous write is still running waits for it. A write that fails raises its error on the
training thread at the next checkpoint or when ``fit`` ends; ``fit`` returns once ``last.ckpt``
is complete. ``asynchronous=False`` writes on the training thread instead.
"""

from __future__ import annotations

import json
import os
import re
import socket
import time
import uuid
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Optional

import torch
from lightning_utilities.core.apply_func import apply_to_collection

from fl_lightning.checkpoints import CheckpointError, replace_durably
from fl_lightning.lightning_compat import dump_checkpoint
from fl_lightning.lightning_package import ModelCheckpoint, Strategy, pl, rank_zero_warn

#: the checkpoint's file name in its folder
LAST = "last.ckpt"
#: the file naming the run that writes a folder's ``last.ckpt``
OWNER = "owner.json"


class RoundCheckpoint(ModelCheckpoint):
    """Writes ``<dirpath>/last.ckpt`` atomically every ``every_n_rounds`` rounds.

    The one file holds everything a resume needs; no other file is written (none of
    ``ModelCheckpoint``'s ``epoch=...`` files: its other arguments, such as ``save_top_k``,
    ``monitor`` or ``save_weights_only``, are not taken, so a ``RoundCheckpoint`` listed in a YAML
    configuration is the one built in Python). When training starts, the run claims ``dirpath``
    (``owner.json``); a ``dirpath`` that another run claimed, or that holds another run's
    ``last.ckpt``, is refused before training (pass another ``dirpath``, or resume that run from
    its ``last.ckpt``). A temporary file a killed write left (``last.ckpt.tmp``) is removed then.

    Lightning's ``AsyncCheckpointIO`` plugin is not used: it queues writes without bound, does
    not rename atomically, and would make every checkpoint of the Trainer asynchronous.

    Args:
        dirpath: the checkpoint folder (default: ``<the logger's log_dir>/checkpoints``, as
            ``ModelCheckpoint``).
        every_n_rounds: write after every ``n``-th round (and after the last round of the fit).
        asynchronous: write the file on a background thread while training goes on (the
            default); ``False`` writes it on the training thread, before the next round starts
            (simpler to debug). Asynchronous writing needs a strategy that writes checkpoints
            from rank 0 through its ``checkpoint_io`` (single device, ``fl_ddp``), not one that
            writes its own (sharded) checkpoints.
    """

    def __init__(self, dirpath: Optional[str] = None, every_n_rounds: int = 1, asynchronous: bool = True) -> None:
        if isinstance(every_n_rounds, bool) or not isinstance(every_n_rounds, int) or every_n_rounds < 1:
            raise ValueError(f"every_n_rounds must be >= 1 and an integer, got {every_n_rounds!r}")
        if not isinstance(asynchronous, bool):
            raise ValueError(f"asynchronous must be True or False, got {asynchronous!r}")
        super().__init__(dirpath=dirpath, save_top_k=0, save_last=False)
        self.every_n_rounds = every_n_rounds
        self.asynchronous = asynchronous
        #: this callback's run, as ``owner.json`` names it
        self.run = uuid.uuid4().hex
        self._writer: Optional[ThreadPoolExecutor] = None
        self._pending: Optional[Future[None]] = None

    @property
    def path(self) -> str:
        """Where the checkpoint is written."""
        assert self.dirpath is not None, "the callback is set up by the Trainer"
        return os.path.join(self.dirpath, LAST)

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        super().setup(trainer, pl_module, stage)
        if self.asynchronous and type(trainer.strategy).save_checkpoint is not Strategy.save_checkpoint:
            raise ValueError(f"RoundCheckpoint(asynchronous=True) writes checkpoints from rank 0 on a background "
                             f"thread, but the strategy {type(trainer.strategy).__name__} writes its own checkpoints: "
                             "pass asynchronous=False")

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Claim ``dirpath`` for this run (rank 0), or refuse it before training (every process)."""
        super().on_train_start(trainer, pl_module)
        if trainer.fast_dev_run:
            return  # nothing is written
        refusal = trainer.strategy.broadcast(self._refusal(trainer.ckpt_path) if trainer.is_global_zero else None)
        if refusal is not None:
            raise ValueError(refusal)
        if trainer.is_global_zero:
            self._claim()
        trainer.strategy.barrier()

    def _refusal(self, ckpt_path: Any) -> Optional[str]:
        """Why this run may not write into ``dirpath`` (None: it may): another run claimed it, or
        it holds a ``last.ckpt`` this run does not resume (``ckpt_path``: the file the run resumes)."""
        assert self.dirpath is not None
        owner_file, last = os.path.join(self.dirpath, OWNER), self.path
        if _same_file(ckpt_path, last):  # this run continues the folder's
            return None
        if os.path.isfile(owner_file):
            try:
                with open(owner_file) as file:
                    owner = json.load(file)
                who = f"run {owner['run']}, started {owner['started']} on {owner['host']} by process {owner['pid']}"
            except (OSError, ValueError, KeyError, TypeError):
                owner, who = {}, f"{owner_file} cannot be read"
            if owner.get("run") == self.run:
                return None
            held = f", and holds its {LAST}" if os.path.isfile(last) else f" (it may be writing its first {LAST})"
            problem, remove = f"belongs to another run ({who}){held}", owner_file
        elif os.path.isfile(last):
            problem = (f"holds a {LAST} that this run does not resume (no {OWNER}: an earlier fl_lightning's or "
                       "another callback's)")
            remove = last
        else:
            return None
        return (f"RoundCheckpoint's dirpath {self.dirpath!r} {problem}: this run would overwrite it. Pass another "
                f"dirpath, or resume that run (ckpt_path={last!r}); if its checkpoint may be overwritten, "
                f"remove {remove}")

    def _claim(self) -> None:
        """Name this run in ``owner.json`` and remove the temporary file a killed write left."""
        assert self.dirpath is not None
        os.makedirs(self.dirpath, exist_ok=True)
        owner_file = os.path.join(self.dirpath, OWNER)
        owner = {"run": self.run, "host": socket.gethostname(), "pid": os.getpid(),
                 "started": time.strftime("%Y-%m-%d %H:%M:%S")}
        with open(owner_file + ".tmp", "w") as file:
            json.dump(owner, file)
        replace_durably(owner_file + ".tmp", owner_file)
        if os.path.exists(self.path + ".tmp"):
            os.remove(self.path + ".tmp")

    def _find_last_checkpoints(self, trainer: pl.Trainer) -> set[str]:
        """(Lightning's ``ckpt_path="last"`` in Python.) The file :func:`last_round_checkpoint` finds, if any."""
        try:
            return {last_round_checkpoint(trainer)}
        except CheckpointError:
            return set()

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.sanity_checking or trainer.fast_dev_run:
            return
        done = trainer.current_epoch + 1
        last_round = trainer.max_epochs is not None and done >= trainer.max_epochs
        if done % self.every_n_rounds == 0 or last_round or trainer.should_stop:
            self.save_round(trainer)

    def save_round(self, trainer: pl.Trainer) -> None:
        """Checkpoint the round now: every process gathers its state; rank 0 writes it (on the
        background thread when ``asynchronous``) once the previous write is done."""
        self.wait()  # one write at a time, done before gathering: the client store keeps the on-disk one's files
        path = self.path
        self.last_model_path = path  # part of the checkpoint's callback state
        with trainer.profiler.profile("save_checkpoint"):
            checkpoint = dump_checkpoint(trainer, self.save_weights_only)
        if not self.asynchronous:
            self.write(trainer.strategy, checkpoint, path)  # every process, as Trainer.save_checkpoint
        elif trainer.is_global_zero:
            copy = snapshot(checkpoint)
            copied = torch.cuda.Event() if torch.cuda.is_initialized() else None
            if copied is not None:
                copied.record()  # the copies are queued on the training thread's CUDA stream
            if self._writer is None:
                self._writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="RoundCheckpoint")
            self._pending = self._writer.submit(self._write_after, copied, trainer.strategy, copy, path)
        trainer.strategy.barrier()

    def write(self, strategy: Strategy, checkpoint: dict[str, Any], path: str) -> None:
        """Write ``checkpoint`` to ``<path>.tmp`` through ``strategy`` and, on rank 0, flush it to
        disk and rename it over ``path`` (on the background thread when ``asynchronous``)."""
        temporary = path + ".tmp"
        strategy.save_checkpoint(checkpoint, temporary)
        if strategy.is_global_zero:
            replace_durably(temporary, path)

    def _write_after(self, copied: Optional[torch.cuda.Event], strategy: Strategy, checkpoint: dict[str, Any],
                     path: str) -> None:
        """:meth:`write` once the CUDA copies of the snapshot (``copied``, if any) are done."""
        if copied is not None:
            copied.synchronize()
        self.write(strategy, checkpoint, path)

    def wait(self) -> None:
        """Wait for the pending write, if any; raise its error if it failed."""
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.result()

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        super().on_train_end(trainer, pl_module)
        self.wait()
        trainer.strategy.barrier()  # every process returns from fit with last.ckpt complete

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        super().on_exception(trainer, pl_module, exception)
        try:
            self.wait()
        except Exception as error:  # the run's own exception is the one raised
            rank_zero_warn(f"RoundCheckpoint could not write {self.path}: {error!r}; the file holds an earlier round")
        self._stop_writer()

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        super().teardown(trainer, pl_module, stage)
        try:
            self.wait()
        finally:
            self._stop_writer()

    def _stop_writer(self) -> None:
        """End the background thread (a later fit starts a new one)."""
        if self._writer is not None:
            self._writer.shutdown()
            self._writer = None


def _same_file(a: Any, b: str) -> bool:
    """Whether the local path ``a`` (or None) names the existing file ``b``."""
    try:
        return a is not None and os.path.samefile(a, b)
    except (OSError, TypeError, ValueError):
        return False


def last_round_checkpoint(trainer: pl.Trainer) -> str:
    """The file ``ckpt_path="last"`` means for ``trainer``'s run: the ``last.ckpt`` of its round checkpoints.

    Where it looks: the ``dirpath`` of each ``RoundCheckpoint`` of ``trainer`` given one (the first
    that holds a ``last.ckpt``); otherwise the run's checkpoint folders where ``ModelCheckpoint``
    puts them, the newest run first: ``<save_dir>/<name>/version_<n>/checkpoints`` of the first
    logger, the highest version ``n`` that holds a ``last.ckpt`` (or the logger's own version
    when it is a name), or ``<default_root_dir>/checkpoints`` without a logger. Runs are ordered
    by their version number, not by the rounds their files hold: the latest run's checkpoint is
    chosen, as resuming it continues where the run was stopped.

    Raises:
        CheckpointError: no ``last.ckpt`` is there, naming every folder looked in.
    """
    folders = [c.dirpath for c in trainer.callbacks if isinstance(c, RoundCheckpoint) and c.dirpath]
    if not folders and trainer.loggers:
        logger = trainer.loggers[0]
        base = os.path.join(logger.save_dir or trainer.default_root_dir, str(logger.name))
        if isinstance(logger.version, str):
            folders = [os.path.join(base, logger.version, "checkpoints")]
        else:
            numbered = (VERSION_FOLDER.fullmatch(name) for name in _entries(base))
            versions = sorted((int(m.group(1)) for m in numbered if m), reverse=True)
            folders = [os.path.join(base, f"version_{n}", "checkpoints") for n in versions]
            folders = folders or [os.path.join(base, "version_*", "checkpoints")]
    elif not folders:
        folders = [os.path.join(trainer.default_root_dir, "checkpoints")]
    for folder in folders:
        if os.path.isfile(os.path.join(folder, LAST)):
            return os.path.join(folder, LAST)
    raise CheckpointError(f"ckpt_path 'last': no {LAST} of a run, looked in {', '.join(folders)}: train first, or "
                          "pass the checkpoint's path")


def checkpoint_run(ckpt_path: Any) -> Optional[str]:
    """The folder of the run that wrote the checkpoint file ``ckpt_path``: ``<run>`` of
    ``<run>/checkpoints/<file>``, where ``RoundCheckpoint`` and ``ModelCheckpoint`` put a run's
    checkpoints unless given a ``dirpath`` (``<run>``: the logger's version folder, else
    ``default_root_dir``); None for a file elsewhere, or for what is not a local file."""
    if not isinstance(ckpt_path, (str, os.PathLike)) or "://" in str(ckpt_path) or not os.path.isfile(ckpt_path):
        return None
    folder = os.path.dirname(os.path.abspath(ckpt_path))
    return os.path.dirname(folder) if os.path.basename(folder) == "checkpoints" else None


#: the name of a logger's run folder (the number is its version)
VERSION_FOLDER = re.compile(r"version_(\d+)")


def _entries(folder: str) -> list[str]:
    """The names in ``folder`` (none if it does not exist)."""
    return os.listdir(folder) if os.path.isdir(folder) else []


def snapshot(checkpoint: Any) -> Any:
    """A copy of ``checkpoint`` that later in-place updates of its tensors do not change: every
    tensor cloned on its device (so the file records the same devices), every dict, list and
    tuple rebuilt. Tensors that shared memory are copied separately (equal values).

    Plain dicts, lists and tuples are walked here, and only other containers (an ``OrderedDict``
    state dict, a named tuple) by Lightning's ``apply_to_collection``, which keeps their types and
    costs five times as much per node: a checkpoint naming thousands of clients' state entries is
    copied every round."""
    kind = type(checkpoint)
    if isinstance(checkpoint, torch.Tensor):
        return checkpoint.detach().clone()
    if kind is dict:
        return {key: snapshot(value) for key, value in checkpoint.items()}
    if kind is list:
        return [snapshot(value) for value in checkpoint]
    if kind is tuple:
        return tuple(snapshot(value) for value in checkpoint)
    if kind in _IMMUTABLE:
        return checkpoint
    return apply_to_collection(checkpoint, torch.Tensor, lambda t: t.detach().clone())


#: leaves :func:`snapshot` keeps as they are
_IMMUTABLE = (str, int, float, bool, bytes, type(None))
