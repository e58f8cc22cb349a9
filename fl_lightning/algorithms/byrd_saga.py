"""Byrd-SAGA (Wu, Ling, Chen and Giannakis, 2020): SAGA gradients, geometric-median aggregation.

Each client splits its training split once into ``J = ceil(S / b)`` fixed minibatches (the
SAGA components; ``b`` the datamodule's batch size) and keeps a table of their last
gradients ``G_j`` in the client state store (``G_bar`` is the table's mean). Each round it takes one
step: pick ``j`` uniformly, ``g = grad f_j(w^t)``, upload ``v = g - G_j + G_bar``, then
``G_bar += (g - G_j) / J`` and ``G_j = g``. The first time a client is sampled it fills its
table with a full pass at the current model (as the authors' code does at ``w^1``).

The server steps ``w <- w - gamma v*`` with ``v*`` the **unweighted** geometric median
(movement tolerance 1e-5, 80 iterations) and ``gamma = 0.1`` (``schedule="constant"``) or
RAGA's ``T/(100t + 10T)`` (``schedule="paper"``).
"""

from __future__ import annotations

from typing import Any, Optional

import pytorch_lightning as pl
import torch
from torch import Tensor

from fl_lightning.algorithms.raga import PaperSchedule, Schedule, check_schedule, require_parameters_only
from fl_lightning.callbacks.robust_aggregation import GeometricMedian
from fl_lightning.module import FederatedModule
from fl_lightning.seeding import generator
from fl_lightning.update import ClientUpdate


def saga_direction(grad: Tensor, stored: Tensor, table_mean: Tensor) -> Tensor:
    """SAGA's variance-reduced gradient ``g - G_j + G_bar``."""
    return grad - stored + table_mean


def fixed_minibatches(num_samples: int, batch_size: int, g: torch.Generator) -> list[Tensor]:
    """A random split of ``range(num_samples)`` into ``ceil(num_samples / batch_size)`` minibatches."""
    if num_samples < 1 or batch_size < 1:
        raise ValueError(f"need num_samples >= 1 and batch_size >= 1, got {num_samples}, {batch_size}")
    return list(torch.randperm(num_samples, generator=g).split(batch_size))


class ByrdSAGA(PaperSchedule, FederatedModule):
    """Byrd-SAGA: one SAGA step per client per round, geometric median of the uploads.

    Args:
        client: the client LightningModule (only its loss is used; no local optimizer).
        step_size: ``gamma`` of the server step with ``schedule="constant"``.
        schedule: ``"constant"`` (``gamma = step_size``) or ``"paper"`` (RAGA's ``T/(100t + 10T)``).
        total_rounds: ``T`` of the paper schedule (None: the Trainer's ``max_epochs``).
        **kwargs: the ``FederatedModule`` arguments (``local_steps`` is 1).
    """

    def __init__(
        self,
        client: pl.LightningModule,
        step_size: float = 0.1,
        schedule: Schedule = "constant",
        total_rounds: Optional[int] = None,
        **kwargs: Any,
    ) -> None:
        check_schedule(schedule, total_rounds)
        if not step_size > 0:
            raise ValueError(f"step_size must be > 0, got {step_size}")
        if kwargs.get("local_steps", 1) != 1 or kwargs.get("local_epochs") is not None:
            raise ValueError(f"Byrd-SAGA takes one step per round; got local_steps={kwargs.get('local_steps')}, "
                             f"local_epochs={kwargs.get('local_epochs')}")
        kwargs["local_steps"] = 1
        super().__init__(client, **kwargs)
        require_parameters_only(self)
        self.step_size = step_size
        self.schedule = schedule
        self.total_rounds = total_rounds
        self.default_aggregator = GeometricMedian("uniform", eps=1e-5, max_iter=80, stop="movement")

    def update_spec(self) -> dict[str, int]:
        return {"grad": self.state.num_params}

    def batch_gradient(self, client_id: int, positions: Tensor) -> tuple[Tensor, float]:
        """The flat gradient of the client's loss on the samples at ``positions`` of its split, and the loss."""
        data = self.datamodule.client_data(client_id, "train")
        batch = tuple(t.to(self.device) for t in data.fetch(positions))
        for cb in self._callbacks:
            batch = cb.on_local_batch(self.trainer, self, client_id, batch)
        with self.local_context(client_id):
            loss = self.local_loss(batch, 0)
            grads = torch.autograd.grad(loss, self.state.params, allow_unused=True)
        flat = torch.cat([
            torch.zeros(p.numel(), device=self.device) if g is None else g.reshape(-1).float()
            for p, g in zip(self.state.params, grads)
        ])
        return flat, float(loss.detach())

    def honest_update(self, client_id: int) -> ClientUpdate:
        """One SAGA step at the global model; the table is filled at the client's first round."""
        self.state.load(self.client_start(client_id))
        n = self.datamodule.num_samples(client_id)
        chunks = fixed_minibatches(n, self.datamodule.batch_size, generator(self.seed, "saga-batches", client_id))
        table = self.store.get(client_id, "saga_table")
        if table is None:
            table = torch.stack([self.batch_gradient(client_id, c)[0].cpu() for c in chunks])
        table = table.to(self.device)
        table_mean = table.mean(dim=0)
        j = int(torch.randint(len(chunks), (1,), generator=generator(self.seed, "saga-pick", self.current_epoch, client_id)))
        grad, loss = self.batch_gradient(client_id, chunks[j])
        direction = saga_direction(grad, table[j], table_mean)
        table[j] = grad
        self.store.set(client_id, "saga_table", table)
        return ClientUpdate(client_id, n, {"grad": direction}, {"loss": loss, "steps": 1.0})

    def server_update(self, aggregate: dict[str, Tensor]) -> None:
        """``w <- w - gamma v*``."""
        lr = self.round_lr() if self.schedule == "paper" else self.step_size
        assert self.round_start is not None
        self.state.load(self.round_start - lr * aggregate["grad"].to(self.device))
