"""What a torch optimizer's parameter groups say about a local step: its one learning rate
(for update rules written with one scalar ``lr``) and which parameters it moves."""

from __future__ import annotations

from typing import Iterable, Sequence

import torch
from torch import Tensor


def single_lr(rates: Iterable[float]) -> float:
    """The one learning rate of the parameters a local step moves, for an update rule written
    with one scalar ``lr`` (SCAFFOLD's control variates, FedDeper's personal model).

    Parameters the optimizer leaves alone (frozen, or not held by it: their rate is no rate of
    the rule) must not be passed in.

    Raises:
        ValueError: no rate (no trainable parameter), or several different ones.
    """
    distinct = sorted(set(float(r) for r in rates))
    if len(distinct) != 1:
        raise ValueError(
            f"the local optimizer's trainable parameters must have one learning rate (lr) for this algorithm's "
            f"update rule, got {distinct if distinct else 'no trainable parameter'}"
        )
    return distinct[0]


def optimizer_lr(optimizer: torch.optim.Optimizer) -> float:
    """The one learning rate of ``optimizer``'s parameter groups that hold trainable parameters
    (``requires_grad``); groups of frozen parameters do not count (see :func:`single_lr`)."""
    return single_lr(g["lr"] for g in optimizer.param_groups if any(p.requires_grad for p in g["params"]))


def moved_by(optimizer: torch.optim.Optimizer, params: Sequence[Tensor]) -> list[bool]:
    """Which of ``params`` a step of ``optimizer`` moves: those it holds that require a gradient."""
    held = {id(p) for g in optimizer.param_groups for p in g["params"]}
    return [id(p) in held and p.requires_grad for p in params]
