"""FedProxVR (Dinh et al., ICPP 2020): proximal SVRG / SARAH local updates.

Round s, every client n (all clients by default), with ``eta`` the local step size:

    w_0 = global model;   v_0 = grad F_n(w_0)       (full local gradient, one pass over the data)
    w_1 = prox(w_0 - eta v_0)
    for t = 1..tau:        I_t = a minibatch;  v_t = SVRG or SARAH direction on I_t
                           w_{t+1} = prox(w_t - eta v_t)
    send w_{t'}            t' uniform in {0..tau} (the paper) or the last iterate w_{tau+1}

with ``prox(x) = (x + eta mu w_0) / (1 + eta mu)`` applied by the optimizer (``ProxSGD``). The
server takes the sample-weighted mean of the clients' models (the default aggregator and
server step with ``server_lr=1``). Nothing persists per client between rounds. The reference
point of the estimator (``w_0`` for SVRG, ``w_{t-1}`` for SARAH) lives in the client module's
:meth:`~fl_lightning.module.FederatedModule.twin`, so a step takes its two gradients without
moving the model between them.

``estimator="sgd"`` is proximal SGD (tau minibatch steps, no full-gradient step); with
``mu=0`` and ``output_iterate="last"`` it is exactly FedAvg.
"""

from __future__ import annotations

from itertools import islice
from typing import Any, Iterator, Literal, Optional

import pytorch_lightning as pl
import torch
from lightning_fabric.utilities.apply_func import move_data_to_device
from torch import Tensor

from fl_lightning.module import FederatedModule
from fl_lightning.optim.variance_reduction import (
    ProxSGD,
    full_gradient,
    loss_gradient,
    sarah_direction,
    svrg_direction,
)
from fl_lightning.seeding import generator
from fl_lightning.update import ClientUpdate
from fl_lightning.vectors import StateVector

Estimator = Literal["svrg", "sarah", "sgd"]
OutputIterate = Literal["random", "last"]


class FedProxVR(FederatedModule):
    """Federated learning with proximal stochastic variance-reduced local updates.

    Args:
        client: the client ``LightningModule`` (its ``training_step`` is the local loss).
        estimator: ``"svrg"``, ``"sarah"`` or ``"sgd"`` (proximal SGD, no full-gradient step).
        mu: proximal strength ``mu >= 0``.
        lr: local step size ``eta``. Exclusive with ``beta``/``smoothness``.
        beta: step-size parameter, ``eta = 1 / (beta * smoothness)`` (the paper's form).
        smoothness: the smoothness constant ``L`` of the per-sample losses (with ``beta``).
            With neither ``lr`` nor ``beta``, ``eta`` is the learning rate of the client's
            own optimizer (the step size FedAvg would use).
        local_steps: ``tau``, the variance-reduced minibatch steps after the full-gradient step.
        output_iterate: ``"random"`` (the paper's Algorithm 1: a uniform ``t'`` in ``{0..tau}``)
            or ``"last"`` (the authors' code).
        clients_per_round: clients per round; None (default) takes all training clients, as the paper.
        full_gradient_batch_size: chunk size of the full-gradient pass (None: the datamodule's
            ``eval_batch_size``); it changes only the speed, not the gradient.
        **kwargs: the other ``FederatedModule`` arguments (``seed``, ``nonfinite_updates``...).
    """

    def __init__(
        self,
        client: pl.LightningModule,
        estimator: Estimator = "svrg",
        mu: float = 0.01,
        lr: Optional[float] = None,
        beta: Optional[float] = None,
        smoothness: Optional[float] = None,
        local_steps: int = 20,
        output_iterate: OutputIterate = "random",
        clients_per_round: Optional[int] = None,
        full_gradient_batch_size: Optional[int] = None,
        **kwargs: Any,
    ) -> None:
        if estimator not in ("svrg", "sarah", "sgd"):
            raise ValueError(f"estimator must be 'svrg', 'sarah' or 'sgd', got {estimator!r}")
        if not mu >= 0:
            raise ValueError(f"mu must be >= 0, got {mu}")
        if output_iterate not in ("random", "last"):
            raise ValueError(f"output_iterate must be 'random' or 'last', got {output_iterate!r}")
        if lr is not None and (beta is not None or smoothness is not None):
            raise ValueError(f"give lr or (beta, smoothness), not both: lr={lr}, beta={beta}, smoothness={smoothness}")
        if (beta is None) != (smoothness is None):
            raise ValueError(f"beta and smoothness go together, got beta={beta}, smoothness={smoothness}")
        if lr is not None and not lr > 0:
            raise ValueError(f"lr must be > 0, got {lr}")
        if beta is not None and not (beta > 0 and smoothness > 0):  # type: ignore[operator]
            raise ValueError(f"beta and smoothness must be > 0, got beta={beta}, smoothness={smoothness}")
        if full_gradient_batch_size is not None and full_gradient_batch_size < 1:
            raise ValueError(f"full_gradient_batch_size must be >= 1, got {full_gradient_batch_size}")
        per_round = 1 if clients_per_round is None else clients_per_round  # None: set to all clients in setup
        super().__init__(client, clients_per_round=per_round, local_steps=local_steps, **kwargs)
        self.estimator = estimator
        self.mu = mu
        self.output_iterate = output_iterate
        self.all_clients = clients_per_round is None
        self.full_gradient_batch_size = full_gradient_batch_size
        if lr is None and beta is not None:
            lr = 1.0 / (beta * smoothness)  # type: ignore[operator]
        self.eta = lr  # None: the client optimizer's learning rate, read in setup
        self._steps = local_steps
        self._reference: Optional[StateVector] = None  # the twin, holding SVRG's w_0 or SARAH's w_{t-1}
        self._reference_params: list[Tensor] = []  # its parameters, looked up once per client
        self._reference_direction: Optional[Tensor] = None  # SVRG: v_0; SARAH: v_{t-1}
        self._reference_grad: Optional[Tensor] = None  # the minibatch gradient at the reference point

    def setup(self, stage: str) -> None:
        if self.all_clients and stage == "fit":
            self.clients_per_round = len(self.datamodule.train_clients)
        super().setup(stage)
        if self.eta is None:
            self.eta = float(self.local_optimizer().param_groups[0]["lr"])

    # ------------------------------------------------------------ client side
    def output_index(self, client_id: int) -> int:
        """The iterate the client sends: ``t'`` uniform in ``{0..tau}`` from (seed, round, client),
        or the last one (``tau + 1`` with a full-gradient step, ``tau`` for ``sgd``)."""
        tau = self.local_steps
        if self.output_iterate == "last":
            return tau if self.estimator == "sgd" else tau + 1
        g = generator(self.seed, "output_iterate", self.current_epoch, client_id)
        return int(torch.randint(0, tau + 1, (1,), generator=g))

    def client_update(self, client_id: int) -> ClientUpdate:
        """Full-gradient prox step, then the variance-reduced prox steps up to the output iterate."""
        start = self.client_start(client_id)
        self.state.load(start)
        optimizer = ProxSGD(self.state.params, lr=self.eta, mu=self.mu)  # anchors: the global model
        target = self.output_index(client_id)
        metrics: dict[str, float] = {"steps": 0.0}
        if self.estimator == "sgd":
            self._steps = target
        else:
            self._steps = max(target - 1, 0)
            if target >= 1:
                v0 = self.local_full_gradient(client_id)
                self._write_grads(v0)
                optimizer.step()
                self._reference, self._reference_direction = StateVector(self.twin()), v0
                self._reference.load(start)
                self._reference_params = self._reference.params
        if self._steps > 0:
            metrics = self.local_train(client_id, optimizer)
        metrics["output_iterate"] = float(target)
        self._reference = self._reference_direction = self._reference_grad = None
        self._reference_params = []
        return ClientUpdate(
            client_id, self.datamodule.num_samples(client_id), {"delta": self.state.flatten() - start}, metrics
        )

    def local_full_gradient(self, client_id: int) -> Tensor:
        """``grad F_n`` at the current model: the exact mean-loss gradient over the client's training split."""
        data = self.datamodule.client_data(client_id, "train")
        size = self.full_gradient_batch_size or self.datamodule.eval_batch_size
        chunks = ((move_data_to_device(b, self.device), len(b[-1])) for b in data.epoch_batches(1, batch_size=size))
        with self.local_context(client_id), self.trainer.precision_plugin.forward_context():
            return full_gradient(lambda batch: self.local_loss(batch, 0), self.state.params, chunks)

    def local_batches(self, client_id: int) -> Iterator[Any]:
        """The first ``t' - 1`` (or ``tau``) of the client's minibatches: the steps up to the output iterate."""
        return islice(super().local_batches(client_id), self._steps)

    def local_step(
        self, optimizer: torch.optim.Optimizer, batch: Any, step: int, module: Optional[pl.LightningModule] = None
    ) -> Tensor:
        """One variance-reduced prox step: the gradient at the reference point on ``batch``, then the
        step itself (the direction is formed in :meth:`adjust_local_gradients`). Outside a client's
        variance-reduced steps (``sgd``, or local work of a callback) a plain step."""
        reference = self._reference
        if module is None and reference is not None:
            with self.trainer.precision_plugin.forward_context():
                loss = self.module_loss(reference.module, batch, step)
                self._reference_grad = loss_gradient(loss, self._reference_params)
            if self.estimator == "sarah":
                reference.copy_from(self.state)  # w_t is the previous point of the next step
        return super().local_step(optimizer, batch, step, module)

    def adjust_local_gradients(self, client_id: int) -> None:
        """Replace the minibatch gradient by the SVRG or SARAH direction (during a client's
        variance-reduced steps)."""
        if self._reference_grad is None:
            return
        assert self._reference_direction is not None
        grad = self.state.grads()
        if self.estimator == "svrg":
            direction = svrg_direction(grad, self._reference_grad, self._reference_direction)
        else:
            direction = sarah_direction(grad, self._reference_grad, self._reference_direction)
            self._reference_direction = direction
        self._write_grads(direction)

    def _write_grads(self, flat: Tensor) -> None:
        for p, g in zip(self.state.params, flat.split([p.numel() for p in self.state.params])):
            p.grad = g.view_as(p).to(device=p.device, dtype=p.dtype).clone()

