"""SCAFFOLD (Karimireddy et al., 2020) with option II control variates.

Client i keeps a control variate ``c_i`` (in the client state store, created lazily as
zeros, off the accelerator); the server keeps ``c``. Each local step uses the corrected
gradient ``g(y) - c_i + c``. After K steps of learning rate eta:

    c_i+ = c_i - c + (x - y) / (K eta)         (option II)
    uploads: delta = y - x,  control = c_i+ - c_i

and the server applies ``x <- x + server_lr * mean(delta)`` and
``c <- c + (|S| / N) * mean(control)``.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from fl_lightning.module import FederatedModule
from fl_lightning.update import ClientUpdate


def scaffold_control_delta(start: Tensor, end: Tensor, server_control: Tensor, steps: int, lr: float) -> Tensor:
    """Option II: ``c_i+ - c_i = -c + (x - y) / (K lr)`` for parameter vectors ``x=start``, ``y=end``."""
    return (start - end) / (steps * lr) - server_control


class SCAFFOLD(FederatedModule):
    """Stochastic controlled averaging; plain SGD local optimizers are assumed (as in the paper).

    Args:
        **kwargs: the ``FederatedModule`` arguments.
    """

    def __init__(self, client: Any, **kwargs: Any) -> None:
        super().__init__(client, **kwargs)
        self.register_buffer("server_control", torch.zeros(self.state.num_params))
        self._correction: Tensor | None = None

    def update_spec(self) -> dict[str, int]:
        return {"delta": self.state.dim, "control": self.state.num_params}

    def client_update(self, client_id: int) -> ClientUpdate:
        zeros = lambda: torch.zeros(self.state.num_params)  # noqa: E731
        c_i = self.store.get(client_id, "control", default=zeros).to(self.device)
        self._correction = self.server_control - c_i
        start = self.client_start(client_id)
        self.state.load(start)
        optimizer = self.local_optimizer()
        lr = optimizer.param_groups[0]["lr"]
        metrics = self.local_train(client_id, optimizer)
        end = self.state.flatten()
        p = self.state.num_params
        control = scaffold_control_delta(start[:p], end[:p], self.server_control, int(metrics["steps"]), lr)
        self.store.set(client_id, "control", c_i + control)
        self._correction = None
        return ClientUpdate(
            client_id, self.datamodule.num_samples(client_id), {"delta": end - start, "control": control}, metrics
        )

    def adjust_local_gradients(self, client_id: int) -> None:
        assert self._correction is not None
        offset = 0
        for param in self.state.params:
            n = param.numel()
            if param.grad is not None:
                param.grad.add_(self._correction[offset : offset + n].view_as(param).to(param.dtype))
            offset += n

    def server_update(self, aggregate: dict[str, Tensor]) -> None:
        super().server_update(aggregate)
        fraction = self.clients_per_round / len(self.datamodule.train_clients)
        self.server_control += fraction * aggregate["control"].to(self.device)
