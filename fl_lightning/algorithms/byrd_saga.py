"""Byrd-SAGA (Wu, Ling, Chen and Giannakis, 2020): SAGA gradients, geometric-median aggregation.

Each client splits its training split once into ``J = ceil(S / b)`` fixed minibatches (the
SAGA components; ``b`` the datamodule's batch size) and keeps a table of their last
gradients ``G_j`` in the client state store (``G_bar`` is the table's mean). Each round it takes one
step: pick ``j`` uniformly, ``g = grad f_j(w^t)``, upload ``v = g - G_j + G_bar``, then
``G_bar += (g - G_j) / J`` and ``G_j = g``. The first time a client is sampled it fills its
table with a full pass at the current model (as the authors' code does at ``w^1``).

The server steps ``w <- w - gamma v*`` with ``v*`` the **unweighted** geometric median
(movement tolerance 1e-5, 80 iterations) and ``gamma = 0.1`` (``schedule="constant"``) or
RAGA's ``T/(100t + 10T)`` (``schedule="paper"``, a per-round scheduler of the local rate, which
Byrd-SAGA reads for its server step).
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch import Tensor
from torch.optim.lr_scheduler import LRScheduler

from fl_lightning.algorithms.raga import Schedule, check_schedule, paper_schedule, require_parameters_only
from fl_lightning.callbacks.robust_aggregation import GeometricMedian
from fl_lightning.functional.variance_reduction import saga_direction
from fl_lightning.lightning_package import pl
from fl_lightning.module import FederatedModule
from fl_lightning.paper import PaperDefaults
from fl_lightning.run import ClientRun
from fl_lightning.seeding import generator
from fl_lightning.vectors import Layout

TABLE = "saga_table"


def fixed_minibatches(num_samples: int, batch_size: int, g: torch.Generator) -> list[Tensor]:
    """A random split of ``range(num_samples)`` into ``ceil(num_samples / batch_size)`` minibatches."""
    if num_samples < 1 or batch_size < 1:
        raise ValueError(f"need num_samples >= 1 and batch_size >= 1, got {num_samples}, {batch_size}")
    return list(torch.randperm(num_samples, generator=g).split(batch_size))


class ByrdSAGA(FederatedModule):
    """Byrd-SAGA: one SAGA step per client per round, geometric median of the uploads.

    The aggregate is the unweighted geometric median ``argmin_z sum_i ||z - v_i||`` (the paper's,
    ``weighting="uniform"``); ``weighting="num_samples"`` weighs each distance by ``n_i``.

    Args:
        client: the client LightningModule (only its loss is used; no local optimizer).
        step_size: ``gamma`` of the server step with ``schedule="constant"``.
        schedule: ``"constant"`` (``gamma = step_size``) or ``"paper"`` (RAGA's ``T/(100t + 10T)``).
        total_rounds: ``T`` of the paper schedule (None: the Trainer's ``max_epochs``).
        **kwargs: the ``FederatedModule`` arguments (``local_steps`` is 1).
    """

    paper = PaperDefaults(weighting="uniform")

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
        self.default_aggregator = GeometricMedian(self.weighting, eps=1e-5, max_iter=80, stop="movement")
        self.remove_update("delta")
        self.add_update("grad", self.global_model.num_params)
        self.add_client_state(TABLE)  # filled at the client's first round

    def local_lr_scheduler(self, optimizer: torch.optim.Optimizer) -> Optional[LRScheduler]:
        return paper_schedule(optimizer, self.schedule, self.total_rounds, self.trainer)

    def client_init(self, run: ClientRun) -> None:
        """Fill the gradient table at the client's first round; pick this round's minibatch ``j``."""
        chunks = fixed_minibatches(run.data.num_samples, run.data.batch_size,
                                   generator(self.seed, "saga-batches", run.client_id))
        if TABLE not in run.state:
            run.state[TABLE] = torch.stack([Layout.flatten(run.loss_and_grad(run.data.fetch(c))[1]) for c in chunks])
        j = int(torch.randint(len(chunks), (1,), generator=generator(self.seed, "saga-pick", run.round, run.client_id)))
        run.scratch["j"] = j
        run.data.batches = [run.data.fetch(chunks[j])]

    def client_step(self, run: ClientRun, batch: Any) -> Tensor:
        """``g = grad f_j(w^t)``: a gradient only, no local optimizer step."""
        loss, grads = run.loss_and_grad(batch)
        run.scratch["grad"] = Layout.flatten(grads)
        return loss

    def client_final(self, run: ClientRun) -> dict[str, Tensor]:
        """Upload ``g - G_j + G_bar``; then ``G_j = g`` (so ``G_bar`` moves by ``(g - G_j) / J``)."""
        table, j, grad = run.state[TABLE].clone(), run.scratch["j"], run.scratch["grad"]
        direction = saga_direction(grad, table[j], table.mean(dim=0))
        table[j] = grad
        run.state[TABLE] = table
        return {"grad": direction}

    def server_update(self, aggregate: dict[str, Tensor]) -> None:
        """``w <- w - gamma v*``."""
        lr = self.engine.local_lr if self.schedule == "paper" else self.step_size
        assert self.engine.round_start is not None
        self.global_model.load(self.engine.round_start - lr * aggregate["grad"].to(self.device))
