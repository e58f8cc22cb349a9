"""RAGA (Zuo et al., 2024): Robust Average Gradient Algorithm.

Honest client m, round t: K local SGD steps from the global model ``w^t`` with learning
rate ``eta^t``; it uploads the **average of the K minibatch gradients** (each taken at the
pre-step iterate), not a model and not a delta:

    z_m^t = (1/K) sum_k grad F_m(w_m^{t,k-1}; xi_m^{t,k})

The server takes the data-size-weighted geometric median of all uploads (Weiszfeld, float64,
``GeometricMedian`` aggregator) and steps ``w^{t+1} = w^t - eta^t z^t``. The paper's schedule
is ``eta^t = T / (100 t + 10 T)`` for both the local and the global step.

With a constant local rate the upload equals ``(w^t - w_m^{t,K}) / (eta K)``: with a mean
instead of the median, RAGA's server step is 1/K of FedAvg's (intended by the paper).
"""

from __future__ import annotations

from typing import Any, Literal, Optional

import pytorch_lightning as pl
import torch
from torch import Tensor

from fl_lightning.callbacks.attacks import forged_client
from fl_lightning.callbacks.robust_aggregation import GeometricMedian
from fl_lightning.module import FederatedModule
from fl_lightning.update import ClientUpdate

Schedule = Literal["paper", "constant"]
SCHEDULES: tuple[str, ...] = ("paper", "constant")


def paper_learning_rate(round_number: int, total_rounds: int) -> float:
    """RAGA's schedule ``eta^t = T / (100 t + 10 T)`` for round ``t`` in 1..T.

    ``t = 1``: about 0.099; ``t = T/2``: 1/60; ``t = T``: 1/110.
    """
    if total_rounds < 1:
        raise ValueError(f"total_rounds must be >= 1, got {total_rounds}")
    if round_number < 1:
        raise ValueError(f"round_number must be >= 1, got {round_number}")
    return total_rounds / (100.0 * round_number + 10.0 * total_rounds)


def set_learning_rate(optimizer: torch.optim.Optimizer, lr: float) -> torch.optim.Optimizer:
    """Set every parameter group's learning rate to ``lr``; return the optimizer."""
    for group in optimizer.param_groups:
        group["lr"] = lr
    return optimizer


class PaperSchedule:
    """Mixin for ``FederatedModule`` subclasses with RAGA's round-dependent learning rate.

    The subclass sets ``schedule`` (``"paper"``: ``paper_learning_rate``; ``"constant"``: the
    client optimizer's own rate for local steps) and ``total_rounds`` (None: the Trainer's
    ``max_epochs``). Local optimizers get the round's rate; a client whose upload an attack
    forges without reading it sends zeros of the right shape without training (``forged_client``).
    """

    schedule: Schedule
    total_rounds: Optional[int]

    def horizon(self) -> int:
        """``T``: ``total_rounds``, else the Trainer's ``max_epochs``."""
        if self.total_rounds is not None:
            return self.total_rounds
        max_epochs = self.trainer.max_epochs  # type: ignore[attr-defined]
        if max_epochs is None or max_epochs < 1:
            raise ValueError(f"the paper schedule needs total_rounds or trainer.max_epochs >= 1, got {max_epochs}")
        return max_epochs

    def round_lr(self) -> float:
        """The paper schedule's rate of the current round (``t = current_epoch + 1``)."""
        return paper_learning_rate(self.current_epoch + 1, self.horizon())  # type: ignore[attr-defined]

    def local_optimizer(self) -> torch.optim.Optimizer:
        optimizer = super().local_optimizer()  # type: ignore[misc]
        return set_learning_rate(optimizer, self.round_lr()) if self.schedule == "paper" else optimizer

    def client_update(self, client_id: int) -> ClientUpdate:
        if forged_client(self, client_id):  # type: ignore[arg-type]
            spec = self.update_spec()  # type: ignore[attr-defined]
            zeros = {name: torch.zeros(numel, device=self.device) for name, numel in spec.items()}  # type: ignore[attr-defined]
            return ClientUpdate(client_id, self.datamodule.num_samples(client_id), zeros)  # type: ignore[attr-defined]
        return self.honest_update(client_id)

    def honest_update(self, client_id: int) -> ClientUpdate:
        """The client's honest local work and upload (default: the base algorithm's ``client_update``)."""
        return super().client_update(client_id)  # type: ignore[misc]


def check_schedule(schedule: str, total_rounds: Optional[int]) -> None:
    """Validate the ``schedule`` and ``total_rounds`` arguments of the scheduled algorithms."""
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule must be one of {SCHEDULES}, got {schedule!r}")
    if total_rounds is not None and total_rounds < 1:
        raise ValueError(f"total_rounds must be >= 1, got {total_rounds}")


def require_parameters_only(module: FederatedModule) -> None:
    """Gradient-uploading algorithms need a client without floating buffers (e.g. no BatchNorm)."""
    if module.state.dim != module.state.num_params:
        raise ValueError(
            f"{type(module).__name__} uploads gradients, which have no value for the client's "
            f"{module.state.dim - module.state.num_params} floating buffer entries (BatchNorm statistics); "
            "use a client without floating buffers"
        )


class RAGA(PaperSchedule, FederatedModule):
    """Robust Average Gradient Algorithm: averaged local gradients, weighted geometric median.

    The aggregator is ``GeometricMedian(weighting="num_samples", eps, max_iter)`` unless the
    Trainer has an ``Aggregator`` callback (e.g. ``WeightedMean`` for an ablation).

    Args:
        client: the client LightningModule (its SGD optimizer; its rate is replaced by the schedule).
        schedule: ``"paper"`` (``eta^t = T/(100t + 10T)``, local and global) or ``"constant"``
            (the client optimizer's rate locally, ``server_lr`` globally).
        total_rounds: ``T`` of the schedule (None: the Trainer's ``max_epochs``).
        eps: Weiszfeld tolerance (objective decrease).
        max_iter: Weiszfeld iteration cap.
        **kwargs: the ``FederatedModule`` arguments (``clients_per_round``, ``local_steps`` = K, ``seed``...).
    """

    def __init__(
        self,
        client: pl.LightningModule,
        schedule: Schedule = "paper",
        total_rounds: Optional[int] = None,
        eps: float = 1e-5,
        max_iter: int = 100,
        **kwargs: Any,
    ) -> None:
        check_schedule(schedule, total_rounds)
        kwargs.setdefault("local_steps", 3)
        super().__init__(client, **kwargs)
        require_parameters_only(self)
        self.schedule = schedule
        self.total_rounds = total_rounds
        self.default_aggregator = GeometricMedian("num_samples", eps=eps, max_iter=max_iter)
        self._grad_sum: Optional[Tensor] = None

    def update_spec(self) -> dict[str, int]:
        return {"grad": self.state.num_params}

    def honest_update(self, client_id: int) -> ClientUpdate:
        """K local steps from the global model; upload the mean of the K minibatch gradients."""
        self.state.load(self.client_start(client_id))
        self._grad_sum = torch.zeros(self.state.num_params, device=self.device)
        metrics = self.local_train(client_id)
        grad = self._grad_sum / max(metrics["steps"], 1.0)
        self._grad_sum = None
        return ClientUpdate(client_id, self.datamodule.num_samples(client_id), {"grad": grad}, metrics)

    def adjust_local_gradients(self, client_id: int) -> None:
        assert self._grad_sum is not None
        self._grad_sum += self.state.grads()

    def server_update(self, aggregate: dict[str, Tensor]) -> None:
        """``w <- w - eta^t z`` (``eta^t``: the schedule, or ``server_lr`` when constant)."""
        lr = self.round_lr() if self.schedule == "paper" else self.server_lr
        z = aggregate["grad"].to(self.device)
        assert self.round_start is not None
        self.state.load(self.round_start - lr * z)
        self.log("raga/lr", lr, on_step=False, on_epoch=True, batch_size=1)
        self.log("raga/aggregate_norm", float(z.norm()), on_step=False, on_epoch=True, batch_size=1)
