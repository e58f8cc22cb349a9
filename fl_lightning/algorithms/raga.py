"""RAGA (Zuo et al., 2024): Robust Average Gradient Algorithm.

Honest client m, round t: K local SGD steps from the global model ``w^t`` with learning
rate ``eta^t``; it uploads the **average of the K minibatch gradients** (each taken at the
pre-step iterate), not a model and not a delta:

    z_m^t = (1/K) sum_k grad F_m(w_m^{t,k-1}; xi_m^{t,k})

The server takes the data-size-weighted geometric median of all uploads (Weiszfeld, float64,
``GeometricMedian`` aggregator) and steps ``w^{t+1} = w^t - eta^t z^t`` (eq. 14). The paper
uses one rate for both, ``eta_m^{t,k} = eta^t``, with the schedule ``eta^t = T / (100 t + 10 T)``:
a per-round learning-rate scheduler of the local optimizer (:class:`PaperLR`), read by the
server step. The local rule is plain SGD (eq. 13): momentum or weight decay are refused.

With a constant local rate the upload equals ``(w^t - w_m^{t,K}) / (eta K)``: with a mean
instead of the median, RAGA's server step is 1/K of FedAvg's (intended by the paper).
"""

from __future__ import annotations

from typing import Any, Literal, Optional

import torch
from torch import Tensor
from torch.optim.lr_scheduler import LRScheduler

from fl_lightning.callbacks.robust_aggregation import GeometricMedian
from fl_lightning.lightning_compat import log_agreed
from fl_lightning.lightning_package import pl
from fl_lightning.module import FederatedModule
from fl_lightning.paper import PaperDefaults
from fl_lightning.optim.plain_sgd import require_plain_sgd
from fl_lightning.run import ClientRun
from fl_lightning.validation import check_number
from fl_lightning.vectors import Layout

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


class PaperLR(LRScheduler):
    """RAGA's ``eta^t = T / (100 t + 10 T)`` as a per-round scheduler (round ``t = last_epoch + 1``),
    times ``scale``; the optimizer's own rate is replaced, not scaled.

    Args:
        optimizer: the (template) local optimizer.
        total_rounds: ``T``.
        scale: the factor on the schedule (1: the paper's).
    """

    def __init__(self, optimizer: torch.optim.Optimizer, total_rounds: int, last_epoch: int = -1,
                 scale: float = 1.0) -> None:
        if total_rounds < 1:
            raise ValueError(f"total_rounds must be >= 1, got {total_rounds}")
        self.total_rounds = total_rounds
        self.scale = check_number("scale", scale, 0.0, low_open=True)
        super().__init__(optimizer, last_epoch)

    def get_lr(self) -> list[float]:
        rate = self.scale * paper_learning_rate(self.last_epoch + 1, self.total_rounds)
        return [rate for _ in self.optimizer.param_groups]


def check_schedule(schedule: str, total_rounds: Optional[int]) -> None:
    """Validate the ``schedule`` and ``total_rounds`` arguments of the scheduled algorithms."""
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule must be one of {SCHEDULES}, got {schedule!r}")
    if total_rounds is not None and total_rounds < 1:
        raise ValueError(f"total_rounds must be >= 1, got {total_rounds}")


def paper_schedule(
    optimizer: torch.optim.Optimizer, schedule: str, total_rounds: Optional[int], trainer: pl.Trainer,
    scale: float = 1.0,
) -> Optional[LRScheduler]:
    """:class:`PaperLR` (times ``scale``) on ``optimizer`` if ``schedule`` is ``"paper"`` (``T``:
    ``total_rounds``, else the Trainer's ``max_epochs``), else None (the client's own schedule)."""
    if schedule != "paper":
        return None
    horizon = total_rounds if total_rounds is not None else trainer.max_epochs
    if horizon is None or horizon < 1:
        raise ValueError(f"the paper schedule needs total_rounds or trainer.max_epochs >= 1, got {horizon}")
    return PaperLR(optimizer, horizon, scale=scale)


def require_parameters_only(module: FederatedModule) -> None:
    """Gradient-uploading algorithms need a client without floating buffers (e.g. no BatchNorm)."""
    if module.global_model.dim != module.global_model.num_params:
        raise ValueError(
            f"{type(module).__name__} uploads gradients, which have no value for the client's "
            f"{module.global_model.dim - module.global_model.num_params} floating buffer entries (BatchNorm statistics); "
            "use a client without floating buffers"
        )


class RAGA(FederatedModule):
    """Robust Average Gradient Algorithm: averaged local gradients, weighted geometric median.

    The aggregator is ``GeometricMedian(weighting, eps, max_iter)`` unless the Trainer has an
    ``Aggregator`` callback (e.g. ``WeightedMean`` for an ablation): by default (the paper's,
    ``weighting="num_samples"``) the median with weights ``alpha_m = S_m / sum_m S_m``,
    ``argmin_z sum_m alpha_m ||z - z_m||``; ``weighting="uniform"`` gives ``alpha_m = 1/M``.

    Args:
        client: the client LightningModule (plain SGD; its rate is replaced by the paper schedule).
        schedule: the local rate ``eta_m^{t,k}``: ``"paper"`` (``T/(100t + 10T)``) or
            ``"constant"`` (the client optimizer's rate, following its own schedule if any).
        total_rounds: ``T`` of the schedule (None: the Trainer's ``max_epochs``).
        lr_scale: a factor on the paper schedule, ``eta^t = lr_scale * T / (100 t + 10 T)`` (1, the
            paper's; the handle that tunes RAGA's step size; refused with ``schedule="constant"``,
            where the client's rate is the handle).
        server_lr: the global rate ``eta^t`` of eq. 14; None (the paper's choice) takes the round's
            local rate, a number fixes it for every round (the theory's separate global rate).
        eps: Weiszfeld tolerance (objective decrease).
        max_iter: Weiszfeld iteration cap.
        **kwargs: the ``FederatedModule`` arguments (``clients_per_round``, ``local_steps`` = K,
            3 by default as in the paper's experiments, ``seed``...).
    """

    paper = PaperDefaults(local_steps=3)

    def __init__(
        self,
        client: pl.LightningModule,
        schedule: Schedule = "paper",
        total_rounds: Optional[int] = None,
        lr_scale: float = 1.0,
        server_lr: Optional[float] = None,
        eps: float = 1e-5,
        max_iter: int = 100,
        **kwargs: Any,
    ) -> None:
        check_schedule(schedule, total_rounds)
        check_number("lr_scale", lr_scale, 0.0, low_open=True)
        if schedule == "constant" and lr_scale != 1.0:
            raise ValueError(f"lr_scale scales the paper schedule; with schedule='constant' set the client's lr instead "
                             f"(got lr_scale={lr_scale})")
        if server_lr is not None:
            kwargs["server_lr"] = server_lr  # checked by FederatedModule
        super().__init__(client, **kwargs)
        require_parameters_only(self)
        self.schedule = schedule
        self.total_rounds = total_rounds
        self.lr_scale = lr_scale
        #: the fixed global rate, or None: the round's local rate
        self.global_lr = server_lr
        self.default_aggregator = GeometricMedian(self.weighting, eps=eps, max_iter=max_iter)
        self.remove_update("delta")
        self.add_update("grad", self.global_model.num_params)

    def setup(self, stage: str) -> None:
        super().setup(stage)
        require_plain_sgd(self.engine.local_optimizer(), type(self).__name__)

    def local_lr_scheduler(self, optimizer: torch.optim.Optimizer) -> Optional[LRScheduler]:
        return paper_schedule(optimizer, self.schedule, self.total_rounds, self.trainer, self.lr_scale)

    def client_step(self, run: ClientRun, batch: Any) -> Tensor:
        """One SGD step; the gradient (at the pre-step iterate) is added to the round's sum, which
        the first step starts (no ``client_init``: the batched backend's runs then share the round's
        start instead of each copying it)."""
        loss, grads = run.loss_and_grad(batch)
        total = run.scratch.get("grad_sum")
        run.scratch["grad_sum"] = [g.clone() for g in grads] if total is None else [s + g for s, g in zip(total, grads)]
        run.step(grads)
        return loss

    def client_final(self, run: ClientRun) -> dict[str, Tensor]:
        """Upload the mean of the K minibatch gradients."""
        return {"grad": Layout.flatten(run.scratch["grad_sum"]) / max(run.local.steps_taken, 1)}

    def server_update(self, aggregate: dict[str, Tensor]) -> None:
        """``w <- w - eta^t z`` (eq. 14; ``eta^t``: the round's local rate, or ``server_lr`` if given)."""
        lr = self.engine.local_lr if self.global_lr is None else self.global_lr
        z = aggregate["grad"].to(self.device)
        assert self.engine.round_start is not None
        self.global_model.load(self.engine.round_start - lr * z)
        log_agreed(self, "raga/lr", lr, on_step=False, on_epoch=True, batch_size=1)
        log_agreed(self, "raga/aggregate_norm", float(z.norm()), on_step=False, on_epoch=True, batch_size=1)
