"""FedProx (Li et al., 2020): local objectives with a proximal term toward the global model."""

from __future__ import annotations

from typing import Any

import pytorch_lightning as pl
import torch

from fl_lightning.module import FederatedModule


def add_proximal_gradient(params: list[torch.Tensor], anchor: torch.Tensor, mu: float) -> None:
    """``grad += mu * (w - anchor)``: the gradient of ``mu/2 ||w - anchor||^2``, in place.

    ``anchor`` is the flat vector of the parameters (in ``params`` order).
    """
    offset = 0
    for p in params:
        n = p.numel()
        if p.grad is not None:
            p.grad.add_(p.detach() - anchor[offset : offset + n].view_as(p).to(p.dtype), alpha=mu)
        offset += n


class FedProx(FederatedModule):
    """FedAvg whose clients minimize ``F_i(w) + mu/2 ||w - x||^2``.

    The proximal gradient is added to the client's (unscaled) gradients before each local
    step, so the client module's loss is used unchanged.

    Args:
        mu: proximal strength, >= 0 (``mu=0`` is FedAvg).
        **kwargs: the ``FederatedModule`` arguments.
    """

    def __init__(self, client: pl.LightningModule, mu: float = 0.01, **kwargs: Any) -> None:
        if mu < 0:
            raise ValueError(f"mu must be >= 0, got {mu}")
        super().__init__(client, **kwargs)
        self.mu = mu

    def adjust_local_gradients(self, client_id: int) -> None:
        if self.mu > 0:
            assert self.round_start is not None
            add_proximal_gradient(self.state.params, self.round_start, self.mu)
