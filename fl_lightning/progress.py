"""Progress bars that count rounds and clients, not epochs and batches.

Lightning's bars read "Epoch 15: 10/10 ... 0.45it/s": in a federation the epoch is a round and a
training batch is a work item (a client, a block of clients, or a lock-step local step). These
bars read "Round 16/30: 10/10 clients". ``FederatedModule.configure_callbacks`` puts the right
one in place of the Trainer's TQDM or Rich bar, so nothing needs configuring.
"""

from __future__ import annotations

from typing import Any, Optional


from fl_lightning.lightning_compat import (
    progress_bar_leave,
    quiet_progress_bar_notice,
    rich_train_description,
    stop_rich_progress,
)
from fl_lightning.lightning_package import RichProgressBar, TQDMProgressBar, pl

quiet_progress_bar_notice()


def round_description(trainer: pl.Trainer) -> str:
    """``Round r/R`` of the current epoch (1-based)."""
    total = f"/{trainer.max_epochs}" if trainer.max_epochs is not None and trainer.max_epochs > 0 else ""
    return f"Round {trainer.current_epoch + 1}{total}"


def work_unit(module: Any) -> str:
    """What one work item of ``module``'s rounds is: ``client``, ``block`` or ``step``."""
    if getattr(module, "lockstep", False):
        return "step"
    if getattr(module, "client_backend", "sequential") == "batched":
        return "block"
    backend = getattr(getattr(module, "engine", None), "backend", None)
    return "block" if getattr(backend, "clients_per_block", 1) > 1 else "client"


class RoundProgressBar(TQDMProgressBar):
    """Lightning's TQDM bar, reading "Round r/R" and counting clients (or blocks, or lock-step steps)."""

    def init_train_tqdm(self) -> Any:
        bar = super().init_train_tqdm()
        bar.unit = work_unit(self.trainer.lightning_module)
        describe = bar.set_description

        def set_description(desc: Optional[str] = None, refresh: bool = True) -> None:
            # Lightning names each epoch as it starts ("Epoch 4"): the bar shows the round instead, so no
            # line ever reads "Epoch"
            if desc is not None and desc.startswith("Epoch"):
                desc = round_description(self.trainer)
            describe(desc, refresh)

        bar.set_description = set_description
        return bar


class RichRoundProgressBar(RichProgressBar):
    """Lightning's Rich bar, reading "Round r/R"."""

    # private Lightning API (checked: lightning_compat.OVERRIDDEN_PRIVATE_METHODS)
    def _get_train_description(self, current_epoch: int) -> str:
        return rich_train_description(self, round_description(self.trainer))

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Stop the live display when training ends, so the run's summary prints below the bar."""
        super().on_train_end(trainer, pl_module)
        stop_rich_progress(self)


def round_progress_bar(current: Any) -> Any:
    """The round-counting bar replacing ``current`` (the Trainer's bar), or None to keep it."""
    if isinstance(current, (RoundProgressBar, RichRoundProgressBar)) or current is None:
        return None
    if isinstance(current, RichProgressBar):
        return RichRoundProgressBar(refresh_rate=current.refresh_rate, leave=progress_bar_leave(current), theme=current.theme)
    if isinstance(current, TQDMProgressBar):
        return RoundProgressBar(refresh_rate=current.refresh_rate, leave=progress_bar_leave(current))
    return None
