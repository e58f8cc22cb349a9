"""The centralized DRO methods FedDRO is compared with (Khanduri et al., Fig. 1): FastDRO and PDSGD.

Both are single-machine methods; the paper runs their "parallel" versions, whose step uses ``K``
times the data of a client's step (8 clients x 16 = 128 samples). On this engine that is a
one-client federation over all the training data with batch ``K b`` (``num_clients: 1``): a
round is ``local_steps`` steps of the one client, and the "averaging" of one model is the model.
FastDRO also runs as a federation of several clients (each a minibatch method, averaged like
FedAvg); PDSGD keeps a dual weight per training sample, normalized over all of them, so it
needs the one client that holds them all.

Both train the client on per-sample losses (``sample_losses``, cross-entropy of logits unless
overridden, as :class:`~fl_lightning.algorithms.feddro.FedDRO`), with the client's plain SGD.
"""

from __future__ import annotations

import math
import warnings
from typing import Any, Literal

import torch
from torch import Tensor

from fl_lightning.algorithms.feddro import SampleLosses
from fl_lightning.functional.dro import chi_square_penalty, chi_square_weights, cvar_weights, kl_dual_step
from fl_lightning.lightning_package import pl
from fl_lightning.module import FederatedModule
from fl_lightning.optim.plain_sgd import require_plain_sgd
from fl_lightning.run import ClientRun
from fl_lightning.seeding import generator

RobustLoss = Literal["cvar", "chi_square"]
DUAL = "log_dual"


class FastDRO(SampleLosses, FederatedModule):
    """Levy et al. (2020)'s minibatch DRO: SGD on each minibatch's robust loss.

    Each local step, on a batch of per-sample losses ``l``: the worst-case weights ``q`` of the
    batch (:func:`~fl_lightning.functional.dro.cvar_weights` at level ``alpha``, or
    :func:`~fl_lightning.functional.dro.chi_square_weights` with penalty ``lam``), and
    ``x <- x - eta sum_i q_i grad l_i(x)`` (``q`` held fixed: the gradient of the batch's robust
    loss, by Danskin's theorem). The step's reported loss is the batch's robust loss
    (``sum_i q_i l_i``, minus the chi-square penalty).

    Default aggregation: FedAvg's sample-weighted mean (the paper's baseline is one client).

    Args:
        client: the client ``LightningModule``; its forward gives logits (see :meth:`sample_losses`).
        robust_loss: ``"cvar"`` (the mean of the batch's upper ``alpha``-tail of losses) or
            ``"chi_square"`` (the chi-square-penalized worst case, penalty ``lam``).
        alpha: CVaR's level in (0, 1] (1: the mean loss, ERM).
        lam: the chi-square penalty (> 0; large: the mean loss).
        **kwargs: the other ``FederatedModule`` arguments (``clients_per_round``, ``local_steps``...).
    """

    def __init__(self, client: pl.LightningModule, robust_loss: RobustLoss = "cvar", alpha: float = 0.1,
                 lam: float = 1.0, **kwargs: Any) -> None:
        if robust_loss not in ("cvar", "chi_square"):
            raise ValueError(f"robust_loss must be 'cvar' or 'chi_square', got {robust_loss!r}")
        if not 0 < alpha <= 1:
            raise ValueError(f"alpha must be in (0, 1], got {alpha}")
        if not lam > 0:
            raise ValueError(f"lam must be > 0, got {lam}")
        super().__init__(client, **kwargs)
        self.robust_loss = robust_loss
        self.alpha = alpha
        self.lam = lam

    def setup(self, stage: str) -> None:
        super().setup(stage)
        if stage == "fit":
            require_plain_sgd(self.engine.local_optimizer(), type(self).__name__)

    def robust_value(self, losses: Tensor) -> Tensor:
        """The batch's robust loss, its worst-case weights held fixed (their gradient is not needed)."""
        with torch.no_grad():
            q = cvar_weights(losses, self.alpha) if self.robust_loss == "cvar" else chi_square_weights(losses, self.lam)
        value = (q * losses).sum()
        return value - chi_square_penalty(q, self.lam) if self.robust_loss == "chi_square" else value

    def client_step(self, run: ClientRun, batch: Any) -> Tensor:
        """One SGD step on the batch's robust loss; returns it."""

        def loss_fn(b: Any) -> tuple[Tensor, Tensor]:
            value = self.robust_value(self.sample_losses(run.forward(b[0]), b).float())
            return value, value.detach()

        (_, value), grads = run.loss_and_grad(batch, loss_fn=loss_fn, has_aux=True)
        run.step(grads)
        return value


class PDSGD(SampleLosses, FederatedModule):
    """Stochastic primal-dual SGD for KL-penalized DRO (the PDSGD baseline of FedDRO's Fig. 1, after Xu 2020).

    The saddle point over the ``n`` training samples, with a dual weight ``q_i`` per sample:

        min_x max_{q in simplex} sum_i q_i l_i(x) - lam KL(q || 1/n)

    whose value at the inner max is ``lam log mean_i exp(l_i / lam)``, FedDRO's KL objective
    (:class:`~fl_lightning.functional.dro.KLDRO` with ``scale_by_lambda=True``). Each step draws a
    minibatch ``B`` of ``b`` sample indices uniformly (with replacement), then, simultaneously,

        x <- x - eta (n / b) sum_{i in B} q_i grad l_i(x)                 (an unbiased primal gradient)
        q <- proximal mirror ascent with step dual_lr on the estimate (n / b) l_B, zero off B

    (:func:`~fl_lightning.functional.dro.kl_dual_step`). The duals start uniform and persist
    across rounds in the client state (a client's ``log q``). The paper's setting for it is not
    reported; ``lam`` and ``dual_lr`` are this implementation's choices, to be tuned like the
    primal rate. Needs a one-client federation (the duals are normalized over every sample).

    The dual step moves a sampled log-weight by about ``dual_lr (n / b) l_i``: with ``n >> b`` a
    ``dual_lr`` above ``b / n`` puts the dual mass on the latest batches, whose weights then scale
    the next primal steps down (on MNIST-ST, ``n = 26914``, ``b = 128``, one epoch at lr 0.05:
    ``dual_lr = 0.1`` stops the model after its first step, ``0.005 = b / n`` leaves it at 18 %
    training accuracy, ``0.0005`` reaches 96 %). Setup warns when ``dual_lr n / b > 1``.

    Args:
        client: the client ``LightningModule`` (forward: logits; see :meth:`sample_losses`).
        lam: the KL penalty (> 0), FedDRO's ``lam``.
        dual_lr: the dual step size (> 0).
        local_steps: primal-dual steps per round.
        **kwargs: the other ``FederatedModule`` arguments (``local_epochs`` is refused).
    """

    def __init__(self, client: pl.LightningModule, lam: float = 5.0, dual_lr: float = 0.1, local_steps: int = 10,
                 **kwargs: Any) -> None:
        if not lam > 0:
            raise ValueError(f"lam must be > 0, got {lam}")
        if not dual_lr > 0:
            raise ValueError(f"dual_lr must be > 0, got {dual_lr}")
        if kwargs.get("local_epochs") is not None:
            raise ValueError(f"local_epochs must be None: PDSGD draws local_steps minibatches of its own, "
                             f"got {kwargs['local_epochs']}")
        kwargs.setdefault("clients_per_round", 1)
        super().__init__(client, local_steps=local_steps, **kwargs)
        self.lam = lam
        self.dual_lr = dual_lr
        self.add_client_state(DUAL)  # uniform at the client's first round

    def setup(self, stage: str) -> None:
        super().setup(stage)
        if stage != "fit":
            return
        clients = len(self.engine.datamodule.train_clients)
        if clients != 1:
            raise ValueError(f"PDSGD keeps one dual weight per training sample, normalized over all of them: it runs "
                             f"on a one-client federation holding every sample (num_clients: 1), got {clients} "
                             "training clients")
        require_plain_sgd(self.engine.local_optimizer(), type(self).__name__)
        dm = self.engine.datamodule
        n, b = dm.num_samples(dm.train_clients[0]), dm.batch_size
        if self.dual_lr * n / b > 1:
            warnings.warn(f"PDSGD: dual_lr={self.dual_lr} with {n} samples and batch {b} moves a sampled dual log-weight "
                          f"by dual_lr * n / b = {self.dual_lr * n / b:.3g} times its loss per step: the duals pile onto "
                          f"the latest batches and the primal steps shrink; use dual_lr below b / n = {b / n:.3g}",
                          stacklevel=2)

    def client_init(self, run: ClientRun) -> None:
        """The duals (uniform at the first round) and this round's minibatch indices, keyed by (seed, round)."""
        n, b = run.data.num_samples, run.data.batch_size
        if DUAL not in run.state:
            run.state[DUAL] = torch.full((n,), -math.log(n), device=run.start.device, dtype=torch.float64)
        assert run.local.num_steps is not None
        positions = torch.randint(n, (run.local.num_steps, b), generator=generator(self.seed, "pdsgd", run.round, run.client_id))
        run.scratch["positions"] = positions.to(run.state[DUAL].device)  # moved once, read at every step
        run.data.batches = (run.data.fetch(p) for p in positions)

    def client_step(self, run: ClientRun, batch: Any) -> Tensor:
        """The primal step with the batch's dual weights, then the dual step with the batch's losses."""
        positions = run.scratch["positions"][run.local.step_index]
        n, b = run.data.num_samples, len(positions)
        weights = (n / b) * run.state[DUAL][positions].exp()

        def loss_fn(batch_: Any) -> tuple[Tensor, Tensor]:
            losses = self.sample_losses(run.forward(batch_[0]), batch_)
            return (weights.to(losses.dtype) * losses).sum(), losses.detach()

        (_, losses), grads = run.loss_and_grad(batch, loss_fn=loss_fn, has_aux=True)
        run.step(grads)
        estimate = torch.zeros_like(run.state[DUAL]).index_add_(0, positions, losses.double() * (n / b))
        run.state[DUAL] = kl_dual_step(run.state[DUAL], estimate, self.lam, self.dual_lr)
        return losses.mean()
