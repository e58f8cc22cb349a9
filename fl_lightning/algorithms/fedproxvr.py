"""FedProxVR (Dinh et al., ICPP 2020): proximal SVRG / SARAH local updates.

Round s, every client n (all clients by default), with ``eta`` the local step size::

    w_0 = global model;   v_0 = grad F_n(w_0)       (full local gradient, one pass over the data,
                                                     deterministic: the client module in eval mode)
    w_1 = prox(w_0 - eta v_0)
    for t = 1..tau:        I_t = a minibatch;  v_t = SVRG or SARAH direction on I_t
                           w_{t+1} = prox(w_t - eta v_t)
    send w_{t'}            t' uniform in {0..tau} (the paper) or the last iterate w_{tau+1}

with ``prox(x) = (x + eta mu w_0) / (1 + eta mu)`` applied by the optimizer (``ProxSGD``). The
server takes the sample-weighted mean of the clients' models (the default aggregator and
server step with ``server_lr=1``). Nothing persists per client between rounds. The reference
point of the estimator (``w_0`` for SVRG, ``w_{t-1}`` for SARAH) is a second model of the run,
so a step takes its two gradients without moving the trained model.

With ``log_local_accuracy=True`` each client also measures the local accuracy ``theta`` it reached
(the paper's eq. 11, spec check C7): ``||grad J_n(w_n)|| / ||grad F_n(w_0)||`` with the surrogate
``J_n(w) = F_n(w) + mu/2 ||w - w_0||^2`` and ``w_n`` the model it sends, both gradients full passes
over its training data in eval mode; the round's mean over its clients is logged as
``round/client_theta``.
It costs one more full-gradient pass per client and round (two for ``sgd``), so it is off by default.

``estimator="sgd"`` is proximal SGD (tau minibatch steps, no full-gradient step); with
``mu=0`` and ``output_iterate="last"`` it is exactly FedAvg.

Both client backends run it: the batched one runs ``ProxSGD`` as a function
(:class:`~fl_lightning.optim.prox_sgd.FunctionalProxSGD`) and each client's full gradient eagerly
in ``client_init``; its steps are vectorized over the clients whose batches have one shape (clients
smaller than the batch size step as blocks of their own, so a federation of many small clients of
different sizes gains little).
"""

from __future__ import annotations

from typing import Any, Literal, Optional

import torch
from torch import Tensor

from fl_lightning.functional.fedproxvr_theory import achieved_local_accuracy
from fl_lightning.functional.variance_reduction import full_gradient, sarah_direction, svrg_direction
from fl_lightning.lightning_package import pl
from fl_lightning.module import FederatedModule
from fl_lightning.paper import PaperDefaults
from fl_lightning.optim.prox_sgd import ProxSGD
from fl_lightning.run import ClientRun, default_final
from fl_lightning.seeding import generator

Estimator = Literal["svrg", "sarah", "sgd"]
OutputIterate = Literal["random", "last"]


class FedProxVR(FederatedModule):
    """Federated learning with proximal stochastic variance-reduced local updates.

    Default aggregation (the paper's, spec A14): ``w_bar = sum_n (D_n / D) w_n`` over the round's
    devices, ``D = sum_n D_n``; ``weighting="uniform"`` gives ``(1/N) sum_n w_n``.

    Args:
        client: the client ``LightningModule`` (its ``training_step`` is the local loss).
        estimator: ``"svrg"``, ``"sarah"`` or ``"sgd"`` (proximal SGD, no full-gradient step).
        mu: proximal strength ``mu >= 0``.
        lr: local step size ``eta``. Exclusive with ``beta``/``smoothness``.
        beta: step-size parameter, ``eta = 1 / (beta * smoothness)`` (the paper's form).
        smoothness: the smoothness constant ``L`` of the per-sample losses (with ``beta``).
            With neither ``lr`` nor ``beta``, ``eta`` is the learning rate of the client's
            own optimizer in the round (the step size FedAvg would use, following the client's
            learning-rate schedule, if any); ``lr`` or ``beta`` fix it for every round.
        local_steps: ``tau``, the variance-reduced minibatch steps after the full-gradient step
            (0: the full-gradient step alone; for ``sgd``, no step: the client sends ``w_0``).
        output_iterate: ``"random"`` (the paper's Algorithm 1: a uniform ``t'`` in ``{0..tau}``)
            or ``"last"`` (the authors' code).
        clients_per_round: clients per round; None (default) takes all training clients, as the paper.
        full_gradient_batch_size: chunk size of the full-gradient pass (None: the datamodule's
            ``eval_batch_size``); it changes only the speed, not the gradient.
        log_local_accuracy: measure and log the local accuracy ``theta`` each client reached
            (``round/client_theta``, the mean over the round's clients; see above).
        **kwargs: the other ``FederatedModule`` arguments (``seed``, ``nonfinite_updates``...).
    """

    paper = PaperDefaults(min_local_steps=0)  # tau = 0: the full-gradient step alone (spec checks C6, C7)

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
        log_local_accuracy: bool = False,
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
        if beta is not None and smoothness is not None and not (beta > 0 and smoothness > 0):
            raise ValueError(f"beta and smoothness must be > 0, got beta={beta}, smoothness={smoothness}")
        if full_gradient_batch_size is not None and full_gradient_batch_size < 1:
            raise ValueError(f"full_gradient_batch_size must be >= 1, got {full_gradient_batch_size}")
        if kwargs.get("local_epochs") is not None:
            raise ValueError(f"local_epochs must be None: FedProxVR runs tau = local_steps steps, "
                             f"got {kwargs['local_epochs']}")
        per_round = 1 if clients_per_round is None else clients_per_round  # None: set to all clients in setup
        super().__init__(client, clients_per_round=per_round, local_steps=local_steps, **kwargs)
        self.estimator = estimator
        self.mu = mu
        self.output_iterate = output_iterate
        self.all_clients = clients_per_round is None
        self.full_gradient_batch_size = full_gradient_batch_size
        self.log_local_accuracy = log_local_accuracy
        self.round_metrics = ("theta",) if log_local_accuracy else ()
        if not log_local_accuracy:
            self.client_final = default_final  # type: ignore[method-assign]  # said: the default upload
        if lr is None and beta is not None and smoothness is not None:
            lr = 1.0 / (beta * smoothness)
        self.eta = lr  # None: the client optimizer's scheduled learning rate of the round

    def setup(self, stage: str) -> None:
        if self.all_clients and stage == "fit":
            self.clients_per_round = len(self.engine.datamodule.train_clients)
        super().setup(stage)

    # ------------------------------------------------------------ client side
    def output_index(self, client_id: int, round_idx: int, tau: Optional[int] = None) -> int:
        """The iterate the client sends: ``t'`` uniform in ``{0..tau}`` from (seed, round, client),
        or the last one (``tau + 1`` with a full-gradient step, ``tau`` for ``sgd``); ``tau``: the
        client's local steps of the round (default: ``local_steps``)."""
        tau = self.local_steps if tau is None else tau
        assert tau is not None
        if self.output_iterate == "last":
            return tau if self.estimator == "sgd" else tau + 1
        g = generator(self.seed, "output_iterate", round_idx, client_id)
        return int(torch.randint(0, tau + 1, (1,), generator=g))

    def client_init(self, run: ClientRun) -> None:
        """``w_0`` = the global model; ``v_0 = grad F_n(w_0)``, ``w_1 = prox(w_0 - eta v_0)``; the
        steps after it run up to the output iterate. ``v_0`` is taken in eval mode (no Dropout,
        BatchNorm on its running statistics, left unchanged), so it is a deterministic gradient."""
        target = self.output_index(run.client_id, run.round, run.local.num_steps)  # tau: the client's configured steps
        run.metrics["output_iterate"] = float(target)
        eta = self.eta if self.eta is not None else run.local.lr
        run.local.optimizer = ProxSGD(run.params, lr=eta, mu=self.mu)  # anchors: the global model
        if self.estimator == "sgd":
            run.local.num_steps = target
            if self.log_local_accuracy and target >= 1:
                run.scratch["anchor_gradient"] = self.full_gradient(run)
            return
        run.local.num_steps = max(target - 1, 0)
        if target >= 1:
            v0 = self.full_gradient(run)
            run.scratch["anchor_gradient"] = v0
            run.scratch["reference"] = run.layout.copy(run.end())  # w_0
            run.scratch["direction"] = v0
            run.step(v0)

    def client_step(self, run: ClientRun, batch: Any) -> Tensor:
        """``v_t`` from the gradients at ``w_t`` and at the reference point on the same batch;
        ``w_{t+1} = prox(w_t - eta v_t)``."""
        loss, grads = run.loss_and_grad(batch)
        if "reference" not in run.scratch:  # proximal SGD
            run.step(grads)
            return loss
        _, reference_grads = run.loss_and_grad(batch, model=run.scratch["reference"])
        previous = run.scratch["direction"]
        if self.estimator == "svrg":
            direction = [svrg_direction(g, r, v0) for g, r, v0 in zip(grads, reference_grads, previous)]
        else:
            direction = [sarah_direction(g, r, v) for g, r, v in zip(grads, reference_grads, previous)]
            run.scratch["direction"] = direction
            run.scratch["reference"] = run.layout.copy(run.end())  # w_t: the previous point of the next step
        run.step(direction)
        return loss

    def client_final(self, run: ClientRun) -> dict[str, Tensor]:
        """With ``log_local_accuracy`` (without it, the default upload is taken in the constructor): the local
        accuracy ``theta`` of the model sent (1 where the client sends the global model, ``t' = 0``), then the
        default upload (``end - start``)."""
        anchor_gradient = run.scratch.get("anchor_gradient")
        if anchor_gradient is None:  # t' = 0: w_n = w_0, so grad J_n(w_n) = grad F_n(w_0)
            run.metrics["theta"] = 1.0
        else:
            end = [p.detach() for p in run.params]
            theta = achieved_local_accuracy(self.full_gradient(run), end, run.layout.split_params(run.start),
                                            anchor_gradient, self.mu)
            run.metrics["theta"] = theta
        return super().client_final(run)

    def full_gradient(self, run: ClientRun) -> list[Tensor]:
        """``grad F_n`` at the run's current model, over the client's whole training split, in eval
        mode (no Dropout, BatchNorm on its running statistics, left unchanged): deterministic."""
        size = self.full_gradient_batch_size or run.data.eval_batch_size
        chunks = ((batch, len(batch[-1])) for batch in run.data.epoch(size))
        was_training = self.client.training
        self.client.eval()
        try:
            return full_gradient(lambda batch: run.loss_and_grad(batch)[1], chunks)
        finally:
            self.client.train(was_training)
