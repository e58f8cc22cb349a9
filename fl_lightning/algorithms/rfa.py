"""RFA (Pillutla, Kakade and Harchaoui, 2022): robust federated averaging.

Clients run K local SGD steps from the global model and upload their model delta, as in
FedAvg; the server replaces the weighted mean by the sample-weighted geometric median,
computed with a few iterations of smoothed Weiszfeld (``nu = 1e-5``, 4 iterations, relative
objective tolerance 1e-6, as in the authors' code), and applies ``w <- w + median``.

As the RAGA paper's baseline, local steps use RAGA's schedule ``eta^t = T/(100t + 10T)`` by
default (``schedule="paper"``). An ``Aggregator`` callback replaces the geometric median; with
``WeightedMean`` this is FedAvg under the same schedule (the RAGA experiments' FedAvg).
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch.optim.lr_scheduler import LRScheduler

from fl_lightning.algorithms.fedavg import FedAvg
from fl_lightning.algorithms.raga import Schedule, check_schedule, paper_schedule
from fl_lightning.callbacks.robust_aggregation import GeometricMedian
from fl_lightning.lightning_package import pl
from fl_lightning.paper import PaperDefaults


class RFA(FedAvg):
    """FedAvg with the geometric median of the model deltas.

    The aggregate is the geometric median with the paper's weights ``alpha_i = n_i / sum_i n_i``,
    ``argmin_z sum_i alpha_i ||z - delta_i||`` (``weighting="num_samples"``, the default);
    ``weighting="uniform"`` gives ``alpha_i = 1/|S|``.

    Args:
        client: the client LightningModule.
        schedule: ``"paper"`` (local rate ``T/(100t + 10T)``) or ``"constant"`` (the client optimizer's).
        total_rounds: ``T`` of the schedule (None: the Trainer's ``max_epochs``).
        nu: smoothing of the Weiszfeld distances.
        max_iter: Weiszfeld iterations.
        ftol: relative objective tolerance.
        **kwargs: the ``FederatedModule`` arguments (``local_steps`` = K, 3 by default as in the
            RAGA experiments; ``server_lr`` scales the median step).
    """

    paper = PaperDefaults(local_steps=3)

    def __init__(
        self,
        client: pl.LightningModule,
        schedule: Schedule = "paper",
        total_rounds: Optional[int] = None,
        nu: float = 1e-5,
        max_iter: int = 4,
        ftol: float = 1e-6,
        **kwargs: Any,
    ) -> None:
        check_schedule(schedule, total_rounds)
        super().__init__(client, **kwargs)
        self.schedule = schedule
        self.total_rounds = total_rounds
        self.default_aggregator = GeometricMedian(self.weighting, eps=ftol, max_iter=max_iter, nu=nu,
                                                  stop="objective_rel")

    def local_lr_scheduler(self, optimizer: torch.optim.Optimizer) -> Optional[LRScheduler]:
        return paper_schedule(optimizer, self.schedule, self.total_rounds, self.trainer)
