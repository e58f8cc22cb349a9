"""``RoundCheckpoint``: a resumable checkpoint every round, written atomically, off the training thread.

A federation that crashes in round 300 should resume from round 299, not from the start.
Lightning's ``ModelCheckpoint(save_last=True, save_top_k=0)`` writes ``last.ckpt`` only when
training ends; ``RoundCheckpoint`` writes it at the end of every ``every_n_rounds``-th round
(and of the last one). A checkpoint is written to a temporary file, flushed to disk and renamed
over ``last.ckpt``: a kill at any moment leaves either the previous checkpoint or the new one,
never a partial file. Resume with ``ckpt_path=".../last.ckpt"`` (or ``ckpt_path="last"``): the
run continues bitwise as if it had never stopped (CPU).

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

import os
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Optional

import pytorch_lightning as pl
import torch
from lightning_utilities.core.apply_func import apply_to_collection
from pytorch_lightning.callbacks import ModelCheckpoint
from pytorch_lightning.strategies import Strategy
from pytorch_lightning.utilities.rank_zero import rank_zero_warn

from fl_lightning.lightning_compat import dump_checkpoint


class RoundCheckpoint(ModelCheckpoint):
    """Writes ``<dirpath>/last.ckpt`` atomically every ``every_n_rounds`` rounds.

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
        **kwargs: other ``ModelCheckpoint`` arguments (``filename`` is not used: the file is ``last.ckpt``).
    """

    def __init__(self, dirpath: Optional[str] = None, every_n_rounds: int = 1, asynchronous: bool = True,
                 **kwargs: Any) -> None:
        if isinstance(every_n_rounds, bool) or not isinstance(every_n_rounds, int) or every_n_rounds < 1:
            raise ValueError(f"every_n_rounds must be >= 1 and an integer, got {every_n_rounds!r}")
        if not isinstance(asynchronous, bool):
            raise ValueError(f"asynchronous must be True or False, got {asynchronous!r}")
        kwargs.setdefault("save_top_k", 0)
        super().__init__(dirpath=dirpath, save_last=False, **kwargs)
        self.every_n_rounds = every_n_rounds
        self.asynchronous = asynchronous
        self._writer: Optional[ThreadPoolExecutor] = None
        self._pending: Optional[Future[None]] = None

    @property
    def path(self) -> str:
        """Where the checkpoint is written."""
        assert self.dirpath is not None, "the callback is set up by the Trainer"
        return os.path.join(self.dirpath, self.CHECKPOINT_NAME_LAST + self.FILE_EXTENSION)

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        super().setup(trainer, pl_module, stage)
        if self.asynchronous and type(trainer.strategy).save_checkpoint is not Strategy.save_checkpoint:
            raise ValueError(f"RoundCheckpoint(asynchronous=True) writes checkpoints from rank 0 on a background "
                             f"thread, but the strategy {type(trainer.strategy).__name__} writes its own checkpoints: "
                             "pass asynchronous=False")

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
        if not strategy.is_global_zero:
            return
        descriptor = os.open(temporary, os.O_RDONLY)
        try:
            os.fsync(descriptor)  # the data reaches the disk before the rename does
        finally:
            os.close(descriptor)
        os.replace(temporary, path)  # atomic on POSIX file systems

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
