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
client sampled again resumes its own ``v_i``. ``FedDeper*`` is FedDeper with half the
local steps (a config, not a class).
"""

from __future__ import annotations

import warnings
from typing import Any, Literal, Optional

import pytorch_lightning as pl
import torch
from torch import Tensor

from fl_lightning.algorithms.fedprox import add_proximal_gradient
from fl_lightning.module import FederatedModule
from fl_lightning.update import ClientUpdate

PERSONAL = "personal"
UpdateOrder = Literal["jacobi", "gauss_seidel"]


def depersonalization_anchor(global_model: Tensor, personal: Tensor) -> Tensor:
    """``2x - v``: the point the globalized model is pulled toward.

    The regularizer ``rho/(2 eta) ||v + y - 2x||^2`` equals ``mu/2 ||y - (2x - v)||^2`` with
    ``mu = rho / eta``: a proximal term centred on this anchor.
    """
    return 2.0 * global_model - personal


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
        self._anchor: Optional[Tensor] = None
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
        v = self.personal_model(client_id).clone()
        y = x.clone()
        opt_y, opt_v = self.local_optimizer(), self.local_optimizer()
        self._strength = depersonalization_strength(self.rho, check_plain_sgd(opt_y))
        p = self.state.num_params
        loss_y = loss_v = 0.0
        steps = 0
        with self.local_context(client_id):
            y_batches = self.local_batches(client_id)
            v_batches = self.local_batches(client_id, stream="personal_batches") if self.independent_batches else None
            for step, batch in enumerate(y_batches):
                v_batch = next(v_batches) if v_batches is not None else batch
                if self.update_order == "gauss_seidel":
                    v, loss = self._personal_step(v, opt_v, v_batch, step)
                    loss_v += loss
                self.state.load(y)
                self._anchor = depersonalization_anchor(x[:p], v[:p])
                loss_y += float(self.local_step(opt_y, batch, step))
                y = self.state.flatten()
                self._anchor = None
                if self.update_order == "jacobi":  # the y-step above used v_j, before v's own step
                    v, loss = self._personal_step(v, opt_v, v_batch, step)
                    loss_v += loss
                steps += 1
        self.store.set(client_id, PERSONAL, mix_personal(v, y, self.lam))
        metrics = {"loss": loss_y / max(steps, 1), "personal_loss": loss_v / max(steps, 1), "steps": float(steps)}
        return ClientUpdate(client_id, self.datamodule.num_samples(client_id), {"delta": y - x}, metrics)

    def _personal_step(self, v: Tensor, optimizer: torch.optim.Optimizer, batch: Any, step: int) -> tuple[Tensor, float]:
        """One plain SGD step of the personal model ``v``; returns the new ``v`` and the loss."""
        self.state.load(v)
        loss = float(self.local_step(optimizer, batch, step))
        return self.state.flatten(), loss

    def adjust_local_gradients(self, client_id: int) -> None:
        if self._anchor is not None and self.rho > 0:
            add_proximal_gradient(self.state.params, self._anchor, self._strength)

    def client_eval_state(self, client_id: int) -> Tensor:
        """The personal model ``v_i`` (after the round-end mixing)."""
        return self.personal_model(client_id)
