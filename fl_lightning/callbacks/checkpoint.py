"""``RoundCheckpoint``: a resumable checkpoint every round, written atomically.

A federation that crashes in round 300 should resume from round 299, not from the start.
Lightning's ``ModelCheckpoint(save_last=True, save_top_k=0)`` writes ``last.ckpt`` only when
training ends; ``RoundCheckpoint`` writes it at the end of every ``every_n_rounds``-th round
(and of the last one). A checkpoint is written to a temporary file and renamed over
``last.ckpt``: a kill at any moment leaves either the previous checkpoint or the new one,
never a partial file. Resume with ``ckpt_path=".../last.ckpt"`` (or ``ckpt_path="last"``): the
run continues bitwise as if it had never stopped (CPU).
"""

from __future__ import annotations

import os
from typing import Any, Optional

import pytorch_lightning as pl
from pytorch_lightning.callbacks import ModelCheckpoint


class RoundCheckpoint(ModelCheckpoint):
    """Writes ``<dirpath>/last.ckpt`` atomically every ``every_n_rounds`` rounds.

    Args:
        dirpath: the checkpoint folder (default: ``<the logger's log_dir>/checkpoints``, as
            ``ModelCheckpoint``).
        every_n_rounds: write after every ``n``-th round (and after the last round of the fit).
        **kwargs: other ``ModelCheckpoint`` arguments (``filename`` is not used: the file is ``last.ckpt``).
    """

    def __init__(self, dirpath: Optional[str] = None, every_n_rounds: int = 1, **kwargs: Any) -> None:
        if isinstance(every_n_rounds, bool) or not isinstance(every_n_rounds, int) or every_n_rounds < 1:
            raise ValueError(f"every_n_rounds must be >= 1 and an integer, got {every_n_rounds!r}")
        kwargs.setdefault("save_top_k", 0)
        super().__init__(dirpath=dirpath, save_last=False, **kwargs)
        self.every_n_rounds = every_n_rounds

    @property
    def path(self) -> str:
        """Where the checkpoint is written."""
        assert self.dirpath is not None, "the callback is set up by the Trainer"
        return os.path.join(self.dirpath, self.CHECKPOINT_NAME_LAST + self.FILE_EXTENSION)

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.sanity_checking or trainer.fast_dev_run:
            return
        done = trainer.current_epoch + 1
        last_round = trainer.max_epochs is not None and done >= trainer.max_epochs
        if done % self.every_n_rounds == 0 or last_round or trainer.should_stop:
            self.save_round(trainer)

    def save_round(self, trainer: pl.Trainer) -> None:
        """Write the checkpoint now (every process takes part; rank 0 writes and renames)."""
        path = self.path
        self.last_model_path = path  # part of the checkpoint's callback state
        temporary = path + ".tmp"
        trainer.save_checkpoint(temporary, self.save_weights_only)
        if trainer.is_global_zero:
            os.replace(temporary, path)  # atomic on POSIX file systems
        trainer.strategy.barrier()
