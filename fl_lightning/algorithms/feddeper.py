"""FedDeper (Zhou et al., 2022): depersonalized federated learning by alternating SGD.

Each sampled client trains two models on the same mini-batch at every local step: its
personal model ``v`` by plain SGD on its own loss, and the globalized model ``y`` (started
from the global model ``x``) on the surrogate ``f_i(y) + rho/(2 eta) ||v + y - 2x||^2``,
which pulls ``y`` toward the reflection ``2x - v`` of the personal model through ``x``:

    y_{j+1} = y_j - eta g_i(y_j) - rho (v_j + y_j - 2x)     (uses v_j, before v's own step)
    v_{j+1} = v_j - eta g_i(v_j)
    after tau steps:  v_i <- (1 - lam) v_tau + lam y_tau,   upload  y_tau - x

The server averages the uploads as FedAvg does. ``v_i`` persists in the client state store
(lazily ``x^0``, the global model of round 0), so a client never sampled keeps ``x^0`` and a
client sampled again resumes its own ``v_i``. During a client's round ``y`` trains in the client
module and ``v`` in its :meth:`~fl_lightning.module.FederatedModule.twin`, so a local step
moves no state between them. ``FedDeper*`` is FedDeper with half the local steps (a config,
not a class).
"""

from __future__ import annotations

import warnings
from typing import Any, Literal, Optional

import pytorch_lightning as pl
import torch
from torch import Tensor

from fl_lightning.module import FederatedModule, mean_loss
from fl_lightning.update import ClientUpdate
from fl_lightning.vectors import StateVector

PERSONAL = "personal"
UpdateOrder = Literal["jacobi", "gauss_seidel"]


def add_depersonalization_gradient(
    globalized: list[Tensor], personal: list[Tensor], global_model: Tensor, strength: float
) -> None:
    """``grad_y += strength * (y + v - 2x)``, in place: the gradient of ``strength/2 ||v + y - 2x||^2``.

    With ``strength = rho / eta`` this is the regularizer ``rho/(2 eta) ||v + y - 2x||^2``, a
    proximal term centred on the reflection ``2x - v`` of the personal model through ``x``.
    ``globalized`` and ``personal`` are the parameters of ``y`` and ``v`` (same architecture,
    same order); ``global_model`` is ``x`` as a flat vector in that order.
    """
    offset = 0
    with torch.no_grad():
        for y, v in zip(globalized, personal):
            n = y.numel()
            if y.grad is not None:
                x = global_model[offset : offset + n].view_as(y).to(y.dtype)
                y.grad.add_(y, alpha=strength).add_(v, alpha=strength).add_(x, alpha=-2.0 * strength)
            offset += n


def depersonalization_strength(rho: float, lr: float) -> float:
    """``rho / eta``: the proximal coefficient that makes one SGD step of rate ``eta`` pull by exactly ``rho``."""
    return rho / lr


def mix_personal(personal: Tensor, globalized: Tensor, lam: float) -> Tensor:
    """``(1 - lam) v + lam y``: the personal model a client keeps after its round (eq. 6)."""
    return torch.lerp(personal, globalized, lam)


def check_plain_sgd(optimizer: torch.optim.Optimizer) -> float:
    """The learning rate of ``optimizer`` if it is plain SGD (FedDeper's update rule), else ValueError."""
    if not isinstance(optimizer, torch.optim.SGD):
        raise ValueError(f"FedDeper needs the client's optimizer to be plain torch.optim.SGD, got {type(optimizer).__name__}")
    for group in optimizer.param_groups:
        for name in ("momentum", "weight_decay", "dampening"):
            if group.get(name, 0) != 0:
                raise ValueError(f"FedDeper needs plain SGD: the client's optimizer has {name}={group[name]}, allowed: 0")
        if group.get("nesterov", False):
            raise ValueError("FedDeper needs plain SGD: the client's optimizer has nesterov=True, allowed: False")
    lrs = {group["lr"] for group in optimizer.param_groups}
    if len(lrs) != 1:
        raise ValueError(f"FedDeper needs one learning rate for all parameters, got {sorted(lrs)}")
    return lrs.pop()


class FedDeper(FederatedModule):
    """FedDeper: a personal model per client that depersonalizes the uploaded update.

    Only ``y - x`` is uploaded (FedAvg's communication); each local step costs two
    gradient evaluations. The client module's ``training_step`` gives the loss of both models
    and its ``configure_optimizers`` must return plain SGD (its ``lr`` is ``eta``).

    Args:
        client: the client ``LightningModule`` (plain SGD).
        rho: pull strength per local step toward ``2x - v``, in [0, 1) (0 gives FedAvg's ``x``).
        lam: mixing rate of the personal model with ``y`` at the round end, in [0, 1]; the
            theory covers [0.5, 1] (a smaller value warns).
        independent_batches: draw ``v``'s mini-batches from a stream of their own instead of
            stepping ``y`` and ``v`` on the same batch (the paper does not say which; spec A2).
        update_order: ``"jacobi"`` (the spec's reading of Algorithm 1 and of the proofs: the
            y-step uses ``v_j``) or ``"gauss_seidel"`` (``v`` steps first and the y-step uses
            ``v_{j+1}``: the literal "alternating" reading, spec A1).
        **kwargs: the ``FederatedModule`` arguments (``clients_per_round``, ``local_steps``...).
    """

    def __init__(
        self,
        client: pl.LightningModule,
        rho: float = 0.03,
        lam: float = 0.5,
        independent_batches: bool = False,
        update_order: UpdateOrder = "jacobi",
        **kwargs: Any,
    ) -> None:
        if not 0.0 <= rho < 1.0:
            raise ValueError(f"rho must be in [0, 1), got {rho}")
        if not 0.0 <= lam <= 1.0:
            raise ValueError(f"lam must be in [0, 1], got {lam}")
        if update_order not in ("jacobi", "gauss_seidel"):
            raise ValueError(f"update_order must be 'jacobi' or 'gauss_seidel', got {update_order!r}")
        if lam < 0.5:
            warnings.warn(f"lam={lam} is below 0.5, outside FedDeper's convergence theory (lam in [0.5, 1])", stacklevel=2)
        super().__init__(client, **kwargs)
        self.rho = rho
        self.lam = lam
        self.independent_batches = independent_batches
        self.update_order = update_order
        #: x^0, the global model of round 0: every personal model's value before its first round.
        self.register_buffer("initial_state", self.state.flatten())
        #: while a client's steps run: x and the parameters of y and v, for the pull of the y-steps
        self._pull: Optional[tuple[Tensor, list[Tensor], list[Tensor]]] = None
        self._strength = 0.0

    def setup(self, stage: str) -> None:
        super().setup(stage)
        check_plain_sgd(self.local_optimizer())

    def on_train_epoch_start(self) -> None:
        super().on_train_epoch_start()
        if self.current_epoch == 0:
            assert self.round_start is not None
            self.initial_state.copy_(self.round_start)

    def personal_model(self, client_id: int) -> Tensor:
        """Client ``client_id``'s stored personal model ``v_i`` (``x^0`` before its first round), on the device."""
        return self.store.get(client_id, PERSONAL, default=lambda: self.initial_state, device=self.device)

    def client_update(self, client_id: int) -> ClientUpdate:
        x = self.client_start(client_id)
        personal = self.twin()
        personal_state = StateVector(personal)
        self.state.load(x)  # y_0 = x
        personal_state.load(self.personal_model(client_id))  # v_0 = v_i
        opt_y, opt_v = self.local_optimizer(), self.local_optimizer(personal)
        self._strength = depersonalization_strength(self.rho, check_plain_sgd(opt_y))
        losses_y: list[Tensor] = []
        losses_v: list[Tensor] = []
        with self.local_context(client_id):
            y_batches = self.local_batches(client_id)
            v_batches = self.local_batches(client_id, stream="personal_batches") if self.independent_batches else None
            self._pull = (x, self.state.params, personal_state.params)
            try:
                for step, batch in enumerate(y_batches):
                    v_batch = next(v_batches) if v_batches is not None else batch
                    if self.update_order == "gauss_seidel":
                        losses_v.append(self.local_step(opt_v, v_batch, step, module=personal))
                    losses_y.append(self.local_step(opt_y, batch, step))  # pulls toward 2x - v
                    if self.update_order == "jacobi":  # the y-step above used v_j, before v's own step
                        losses_v.append(self.local_step(opt_v, v_batch, step, module=personal))
            finally:
                self._pull = None
        y, v = self.state.flatten(), personal_state.flatten()
        self.store.set(client_id, PERSONAL, mix_personal(v, y, self.lam))
        metrics = {"loss": mean_loss(losses_y), "personal_loss": mean_loss(losses_v), "steps": float(len(losses_y))}
        return ClientUpdate(client_id, self.datamodule.num_samples(client_id), {"delta": y - x}, metrics)

    def adjust_local_gradients(self, client_id: int) -> None:
        """The depersonalization pull of a y-step (none in local work outside a FedDeper round,
        e.g. a finetuning callback's)."""
        if self._pull is not None and self.rho > 0:
            x, globalized, personal = self._pull
            add_depersonalization_gradient(globalized, personal, x, self._strength)

    def client_eval_state(self, client_id: int) -> Tensor:
        """The personal model ``v_i`` (after the round-end mixing)."""
        return self.personal_model(client_id)
