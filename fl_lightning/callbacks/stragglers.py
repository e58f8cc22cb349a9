"""``Stragglers``: clients that cannot do a round's full local work (systems heterogeneity).

FedProx's experiments (Li et al., 2020, Section 5.2, "systems heterogeneity") make a share of
each round's clients stragglers, devices that cannot finish the round's local work in time, and
compare two ways to handle them: drop them (FedAvg's, in the paper's comparison: their work never
arrives) or incorporate their partial solutions (FedProx's, which its proximal term keeps close
to the global model). The paper's FedProx runs incorporate partial work; so does this callback by
default. The draws are keyed by the seed, the round and the client, so a run gives the same
stragglers on any number of processes, in any client backend, and after a resume.
"""

from __future__ import annotations

import math
from typing import Any, Literal, Optional

import torch

from fl_lightning.client_config import ClientConfig
from fl_lightning.hooks import FederatedCallback, Federation
from fl_lightning.lightning_package import pl
from fl_lightning.lightning_compat import log_agreed
from fl_lightning.seeding import generator
from fl_lightning.validation import check_int, check_number

StragglerMode = Literal["partial", "drop"]


class Stragglers(FederatedCallback):
    """A ``fraction`` of each round's clients straggle: they do a random part of their local work
    (``mode="partial"``, FedProx's) or drop out of the round, sending nothing (``mode="drop"``).

    Of a round's ``m`` sampled clients, ``m - round(m (1 - fraction))`` straggle (FedProx's code keeps
    ``round(m (1 - fraction))`` clients active), drawn from ``(seed, round)``. A partial straggler
    whose configured work is ``W`` units (its ``local_steps``, or its ``local_epochs`` for a module
    that counts epochs) does ``w`` of them, uniform in ``{lo, ..., W - 1}`` with
    ``lo = max(1, ceil(min_fraction W))`` (at most ``W - 1``), drawn from ``(seed, round, client)``:
    with ``min_fraction=0``, FedProx's ``randint(1, E)``. A client with one unit of work cannot do
    less, and does it. The work is read from the configuration that the callbacks before this one
    give (:meth:`~fl_lightning.hooks.FederatedCallback.configure_client`): put ``Stragglers`` after a
    callback that sets the clients' work. Logs ``round/stragglers``, the number of the round's
    stragglers (dropped, or with partial work).

    Args:
        fraction: the share of each round's clients that straggle, in [0, 1].
        mode: ``"partial"`` (a straggler's partial work is aggregated) or ``"drop"`` (a straggler
            does no local work and sends no update).
        min_fraction: the least share of its work a partial straggler does, in [0, 1).
        seed: the seed of the draws (None: the module's ``seed``).

    Raises:
        ValueError: an argument out of range; at setup, a lock-step algorithm (FedDRO: every client
            takes the round's steps together), or partial work of a module whose clients do one
            unit of work (``local_steps=1`` or ``local_epochs=1``: there is no part of it).
    """

    def __init__(self, fraction: float, mode: StragglerMode = "partial", min_fraction: float = 0.0,
                 seed: Optional[int] = None) -> None:
        self.fraction = check_number("fraction", fraction, 0.0, 1.0, high_open=False)
        if mode not in ("partial", "drop"):
            raise ValueError(f"mode must be 'partial' or 'drop', got {mode!r}")
        self.mode = mode
        self.min_fraction = check_number("min_fraction", min_fraction, 0.0, 1.0)
        self.seed = None if seed is None else check_int("seed", seed, 0)
        #: the current round's stragglers
        self.stragglers: frozenset[int] = frozenset()

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit" or self.fraction == 0:
            return
        name = type(pl_module).__name__
        if getattr(pl_module, "lockstep", False):
            raise ValueError(f"Stragglers changes the local work of some of a round's clients, and {name} moves its "
                             "clients in lock-step: every client takes the round's local_steps; remove Stragglers")
        work = {"local_steps": getattr(pl_module, "local_steps", None),
                "local_epochs": getattr(pl_module, "local_epochs", None)}
        if self.mode == "partial" and 1 in work.values():
            unit = next(unit for unit, value in work.items() if value == 1)
            raise ValueError(f"Stragglers(mode='partial') gives a straggler part of its local work, and {name}'s "
                             f"clients do {unit}=1, which has no part: give more local work or use mode='drop'")

    def on_round_start(self, trainer: pl.Trainer, module: Federation, round_idx: int, clients: list[int]) -> None:
        """Draw the round's stragglers among all of its ``clients``."""
        count = len(clients) - round(len(clients) * (1 - self.fraction))
        order = torch.randperm(len(clients), generator=generator(self._seed(module), "stragglers", round_idx))
        self.stragglers = frozenset(clients[i] for i in order[:count].tolist())

    def configure_client(self, trainer: pl.Trainer, module: Federation, round_idx: int, client_id: int,
                         config: ClientConfig) -> ClientConfig:
        """A straggler's configuration: dropped, or a random part of its work."""
        if client_id not in self.stragglers:
            return config
        if self.mode == "drop":
            return config.replace(drop=True)
        if config.work <= 1:
            return config
        low = min(max(1, math.ceil(round(self.min_fraction * config.work, 9))), config.work - 1)
        g = generator(self._seed(module), "stragglers", round_idx, client_id)
        return config.replace(**{config.unit: int(torch.randint(low, config.work, (1,), generator=g))})

    def on_round_end(self, trainer: pl.Trainer, module: Federation, round_idx: int, aggregate: Any) -> None:
        log_agreed(module, "round/stragglers", float(len(self.stragglers)), on_step=False, on_epoch=True,
                   batch_size=1)

    def _seed(self, module: Federation) -> int:
        """The seed of the draws."""
        return self.seed if self.seed is not None else module.seed
