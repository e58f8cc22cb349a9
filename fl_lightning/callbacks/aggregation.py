"""The default aggregator: the (sample-)weighted mean of the round's updates."""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal, Optional

import pytorch_lightning as pl
import torch
from torch import Tensor

from fl_lightning.callbacks.base import Aggregator
from fl_lightning.distributed import all_reduce_sum
from fl_lightning.update import ClientUpdate

if TYPE_CHECKING:
    from fl_lightning.module import FederatedModule

Weighting = Literal["num_samples", "uniform"]


def weighted_sums(updates: list[ClientUpdate], weighting: Weighting) -> tuple[dict[str, Tensor], float]:
    """Per-name sums of ``w_i * tensor_i`` in float64 and the total weight ``sum w_i``."""
    sums: dict[str, Tensor] = {}
    total = 0.0
    for u in sorted(updates, key=lambda u: u.client_id):
        w = float(u.num_samples) if weighting == "num_samples" else 1.0
        total += w
        for name, t in u.tensors.items():
            acc = sums.get(name)
            sums[name] = t.double() * w if acc is None else acc.add_(t.double(), alpha=w)
    return sums, total


class WeightedMean(Aggregator):
    """``sum_i w_i u_i / sum_i w_i`` with ``w_i`` the client's sample count (or 1).

    Accumulates in float64 in client-id order, so the result does not depend on the order
    clients ran in; under DDP it costs one all-reduce per round.

    Args:
        weighting: ``"num_samples"`` (FedAvg's weighting) or ``"uniform"``.
    """

    def __init__(self, weighting: Weighting = "num_samples") -> None:
        if weighting not in ("num_samples", "uniform"):
            raise ValueError(f"weighting must be 'num_samples' or 'uniform', got {weighting!r}")
        self.weighting = weighting

    def aggregate(
        self, trainer: pl.Trainer, module: "FederatedModule", updates: list[ClientUpdate]
    ) -> Optional[dict[str, Tensor]]:
        sums, total = weighted_sums(updates, self.weighting)
        names = module.update_spec()
        flat = torch.cat(
            [sums[n].reshape(-1) if n in sums else torch.zeros(numel, dtype=torch.float64, device=module.device)
             for n, numel in names.items()]
            + [torch.tensor([total], dtype=torch.float64, device=module.device)]
        )
        flat = all_reduce_sum(flat)
        total = float(flat[-1])
        if total == 0.0:
            return None
        out = {}
        for (name, numel), part in zip(names.items(), flat[:-1].split(list(names.values()))):
            out[name] = (part / total).float()
        return out
