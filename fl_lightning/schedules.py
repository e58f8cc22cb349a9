"""The local learning rate over rounds.

A client module's ``configure_optimizers`` may return a learning-rate scheduler beside its
optimizer. In a federation local optimizers are created fresh for each client each round, so
the rule is: **the scheduler is stepped once per round, and every fresh local optimizer of
round r starts at the scheduled learning rate of round r** (per parameter group).

The engine keeps a *template* of the client's optimizer, never stepped, with the scheduler
attached to it; both are registered with Lightning (``FederatedModule.configure_optimizers``),
so checkpoints save and resume them exactly and ``LearningRateMonitor`` reports the client's
rate (as ``lr-client``). Schedulers stepped per optimizer step (``interval: "step"``) and
``ReduceLROnPlateau`` are refused: a round has many local steps and one scheduler step.
"""

from __future__ import annotations

import math
import warnings
from typing import Any, Callable, Optional, Sequence

import torch
from torch.optim.lr_scheduler import ConstantLR, LRScheduler, MultiStepLR, ReduceLROnPlateau


def split_optimizer_config(config: Any) -> tuple[torch.optim.Optimizer, Optional[LRScheduler]]:
    """The optimizer and the scheduler (or None) of a ``configure_optimizers`` result holding one optimizer.

    Accepted: an optimizer; ``[optimizer]``; ``([optimizer], [scheduler])``;
    ``{"optimizer": ..., "lr_scheduler": scheduler or {"scheduler": ..., "interval": "epoch"}}``.
    """
    if isinstance(config, torch.optim.Optimizer):
        return config, None
    if isinstance(config, dict) and "optimizer" in config:
        optimizer, _ = split_optimizer_config(config["optimizer"])
        return optimizer, _scheduler_of(config.get("lr_scheduler"))
    if isinstance(config, (list, tuple)):
        if len(config) == 2 and isinstance(config[0], (list, tuple)):
            optimizer, _ = split_optimizer_config(list(config[0]))
            schedulers = list(config[1]) if isinstance(config[1], (list, tuple)) else [config[1]]
            if len(schedulers) > 1:
                raise ValueError(f"the client's configure_optimizers must return at most one scheduler, got {len(schedulers)}")
            return optimizer, _scheduler_of(schedulers[0] if schedulers else None)
        if len(config) == 1:
            return split_optimizer_config(config[0])
    raise ValueError(
        "the client's configure_optimizers must return exactly one optimizer (optionally with a scheduler), "
        f"got {config!r}"
    )


def _scheduler_of(entry: Any) -> Optional[LRScheduler]:
    """The scheduler of a ``lr_scheduler`` entry (a scheduler or a Lightning scheduler dict)."""
    if entry is None:
        return None
    if isinstance(entry, dict):
        interval = entry.get("interval", "epoch")
        if interval != "epoch" or entry.get("frequency", 1) != 1:
            raise ValueError(
                f"the client's lr_scheduler has interval={interval!r}, frequency={entry.get('frequency', 1)}; "
                "in a federation it is stepped once per round: use interval 'epoch' and frequency 1"
            )
        entry = entry.get("scheduler")
    if isinstance(entry, ReduceLROnPlateau):
        raise ValueError("ReduceLROnPlateau is not supported as the client's scheduler: it is stepped once per "
                         "round without a monitored metric; use an epoch-based scheduler (StepLR, MultiStepLR...)")
    if not isinstance(entry, LRScheduler):
        raise ValueError(f"the client's lr_scheduler must be a torch LRScheduler, got {type(entry).__name__}")
    return entry


class LocalSchedule:
    """The template local optimizer and its per-round scheduler (see the module docstring)."""

    def __init__(self) -> None:
        self.template: Optional[torch.optim.Optimizer] = None
        self.scheduler: Optional[LRScheduler] = None

    split = staticmethod(split_optimizer_config)

    def build(
        self, config: Any, override: Callable[[torch.optim.Optimizer], Optional[LRScheduler]]
    ) -> tuple[torch.optim.Optimizer, LRScheduler]:
        """The template and its scheduler from the client's ``configure_optimizers`` result;
        ``override(template)`` may give the algorithm's own schedule (refused beside the client's
        own: one of the two would be silently ignored). Without any, a constant one."""
        template, scheduler = split_optimizer_config(config)
        custom = override(template)
        if custom is not None and scheduler is not None:
            raise ValueError(
                f"the algorithm schedules the local learning rate itself ({type(custom).__name__}) and the client's "
                f"configure_optimizers returns an lr scheduler too ({type(scheduler).__name__}): one of the two would "
                "be ignored; drop the client's scheduler (e.g. its lr_milestones) or the algorithm's schedule"
            )
        if custom is not None:
            scheduler = custom
        if scheduler is None:
            scheduler = ConstantLR(template, factor=1.0, total_iters=0)
        if scheduler.optimizer is not template:
            raise ValueError("the local lr scheduler must be built on the optimizer it is given")
        self.template, self.scheduler = template, scheduler
        return template, scheduler

    def lrs(self) -> list[float]:
        """The scheduled learning rate of each parameter group, this round."""
        assert self.template is not None
        return [float(group["lr"]) for group in self.template.param_groups]

    def apply(self, optimizer: torch.optim.Optimizer) -> None:
        """Start ``optimizer`` (a fresh local optimizer) at this round's scheduled learning rates."""
        if self.template is not None:
            set_lrs(optimizer, self.lrs())

    def step(self) -> None:
        """Advance the schedule by one round (the template optimizer itself is never stepped)."""
        if self.scheduler is None:
            return
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=r"Detected call of `lr_scheduler.step\(\)` before")
            self.scheduler.step()


def set_lrs(optimizer: torch.optim.Optimizer, lrs: Sequence[float]) -> None:
    """Set the learning rate of each of ``optimizer``'s parameter groups to ``lrs`` (one per group).

    Raises:
        ValueError: ``lrs`` does not have one rate per group.
    """
    if len(lrs) != len(optimizer.param_groups):
        raise ValueError(
            f"the client's configure_optimizers returned {len(optimizer.param_groups)} parameter groups, "
            f"its first call {len(lrs)}: it must build the same optimizer every time"
        )
    for group, lr in zip(optimizer.param_groups, lrs):
        group["lr"] = lr


# ------------------------------------------------------------------ lr drops placed in epochs
def check_lr_drops(epochs: Sequence[float], gamma: float) -> list[float]:
    """``epochs`` as a list, refused unless increasing and > 0, and ``gamma`` unless in (0, 1]
    (the arguments ``lr_drop_epochs`` and ``lr_drop_gamma`` of a ``FederatedModule``)."""
    epochs = [float(e) for e in epochs]
    if epochs != sorted(set(epochs)) or any(not math.isfinite(e) or e <= 0 for e in epochs):
        raise ValueError(f"lr_drop_epochs must be increasing numbers > 0 (passes over a client's training split), "
                         f"got {epochs}")
    if not 0 < gamma <= 1:
        raise ValueError(f"lr_drop_gamma must be in (0, 1], got {gamma}")
    return epochs


def epochs_per_round(train_sizes: Sequence[int], batch_size: int, local_steps: Optional[int],
                     local_epochs: Optional[int]) -> float:
    """How many passes over its training split a client makes in one round.

    With ``local_epochs`` it is ``local_epochs``. With ``local_steps`` it is
    ``local_steps / s``, ``s`` the steps of one pass: a client of ``n`` training samples draws
    batches of ``b = min(batch_size, n)`` from a fresh permutation cut into ``n // b`` batches
    (:meth:`~fl_lightning.datamodules.client_data.ClientData.step_indices`), so ``s = n // b``,
    averaged over the training clients (equal-size splits differ by one sample at most).
    """
    if local_epochs is not None:
        return float(local_epochs)
    assert local_steps is not None
    if not train_sizes or min(train_sizes) < 1:
        raise ValueError(f"every training client needs samples to place lr drops in epochs, got sizes {list(train_sizes)}")
    steps = sum(n // min(batch_size, n) for n in train_sizes) / len(train_sizes)
    return local_steps / steps


def lr_drop_rounds(epochs: Sequence[float], per_round: float) -> list[int]:
    """The rounds after which the rate drops: the first round count whose passes reach each epoch,
    ``ceil(e / per_round)`` (``per_round`` from :func:`epochs_per_round`); drops that fall in the
    same round are refused (the epochs are closer than a round)."""
    if not per_round > 0:
        raise ValueError(f"lr_drop_epochs={list(epochs)} need rounds that pass over the data, got {per_round:g} "
                         "passes a round (local_steps=0)")
    rounds = [max(1, math.ceil(e / per_round - 1e-9)) for e in epochs]
    if len(set(rounds)) != len(rounds):
        raise ValueError(f"lr_drop_epochs={list(epochs)} put two drops in one round (a round is {per_round:.4g} "
                         "epochs): give epochs at least a round apart")
    return rounds


def lr_drop_scheduler(optimizer: torch.optim.Optimizer, epochs: Sequence[float], gamma: float,
                      per_round: float) -> MultiStepLR:
    """The per-round schedule that multiplies the rate by ``gamma`` once a client has made each of
    ``epochs`` passes over its training split (rounds from :func:`lr_drop_rounds`).

    Example: CIFAR10-ST on 8 clients keeps 25,500 images, 3,187 or 3,188 per client, of which the
    default ``val_fraction=0.1`` holds out 318 or 319: 2,868 to 2,870 train, ``2870 // 16 = 179``
    steps per pass at batch 16. With ``local_steps=1`` a drop at epoch 90 is after round
    ``ceil(90 * 179) = 16,110`` (without a validation split it would be ``90 * 199 = 17,910``).
    """
    return MultiStepLR(optimizer, lr_drop_rounds(epochs, per_round), gamma=gamma)
