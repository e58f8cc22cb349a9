"""FedDRO (Khanduri et al.) and the vanilla FedAvg for compositional problems it proves wrong.

Both solve ``min_x h(x) + f(g(x))`` with ``g`` the mean over *all* clients' data of an inner
function (a :class:`~fl_lightning.functional.dro.CompositionalObjective` of per-sample losses).
Every client takes the SGD step ``x_k <- x_k - eta [grad h_k + grad g_k(x_k; b) grad f(y)]``; the
algorithms differ only in the estimate ``y`` of ``g`` used in ``grad f``:

* :class:`FedDRO` (Algorithm 2): a hybrid SARAH/SGD (STORM) estimate per client, recomputed on
  the same minibatch at the current and the previous local model (eq. 8), averaged by the
  server into ``y_bar`` at *every* local step;
* :class:`CompositionalFedAvg` (Algorithm 1): ``y_k = g_k(x_k; b)``, each client's own
  minibatch value (case ``"I"``, the federated MBSGD plug-in), or, at the first step after each
  model averaging, the global mean ``g(x_bar)`` (case ``"II"``).

Models are averaged every ``local_steps`` (= the paper's ``I``) steps: a round is ``I``
lock-step iterations of *all* clients (a ``LockstepModule``). At each step every client shares
its estimate (``client_share``), the engine averages them by sample count over all processes
(one all-reduce of ``d_g`` numbers), the server answers ``y_bar`` (``server_share``) and every
client steps with it (``client_step``); the model average is the engine's usual aggregate (one
all-reduce per round). Per-client models exist only for the round (all clients take part at
every step, as in the paper); the previous-iterate snapshot that eq. 8 needs crosses rounds in
the client state store, and ``y_bar`` crosses rounds as the engine's ``shared`` value.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Iterator, Literal, Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from fl_lightning.functional.dro import CompositionalObjective, check_finite, storm_estimate, surrogate
from fl_lightning.lightning_compat import batch_norm_layers, log_agreed
from fl_lightning.lightning_package import pl
from fl_lightning.lockstep import LockstepModule
from fl_lightning.optim.plain_sgd import require_plain_sgd
from fl_lightning.run import ClientRun, Model
from fl_lightning.vectors import Layout

Case = Literal["I", "II"]
PREVIOUS = "prev"


@contextmanager
def frozen_running_stats(module: nn.Module) -> Iterator[None]:
    """Batch-norm layers normalize with batch statistics but leave their running statistics alone.

    Used for the extra no-grad forwards of the inner-function estimate (spec A13): only the
    forward of the SGD step updates running statistics.
    """
    norms = [m for _, m in batch_norm_layers(module) if m.track_running_stats]
    for m in norms:
        m.track_running_stats = False
    try:
        yield
    finally:
        for m in norms:
            m.track_running_stats = True


class SampleLosses:
    """The per-sample losses a DRO algorithm reweights (FedDRO, its baselines)."""

    def sample_losses(self, output: Tensor, batch: Any) -> Tensor:
        """Per-sample losses ``[b]`` from the client module's ``output`` on ``batch`` (default:
        cross-entropy of logits against ``batch[1]``). Override for other losses."""
        return F.cross_entropy(output, batch[1], reduction="none")


class LockStepCompositional(SampleLosses, LockstepModule):
    """Common machinery of :class:`FedDRO` and :class:`CompositionalFedAvg` (see the module docstring).

    Subclasses define :meth:`inner_estimate` (the ``y`` a client plugs into ``grad f``) and say
    with ``keeps_previous_iterate`` whether they need each client's previous iterate (kept
    across rounds in the state store). The client module's ``configure_optimizers`` must give
    plain SGD (no momentum, no weight decay: :func:`~fl_lightning.optim.plain_sgd.require_plain_sgd`),
    the local update of both algorithms.

    Default aggregation (spec A7): the models are averaged by sample count,
    ``x_bar = sum_k (n_k / n) x_k``: the paper's ``1/K`` on its equal-size splits, and on unequal
    ones the weights that keep ``sum_k (n_k / n) g_k`` the mean over all data, as for ``y_bar``
    (always sample-weighted). ``weighting="uniform"`` averages the models with ``1/K``.

    Args:
        client: the client ``LightningModule``; its forward gives logits (see :meth:`sample_losses`).
        objective: the compositional objective (``KLDRO``, ``ChiSquareDRO``...).
        local_steps: ``I``, the local steps between two model averagings (one round).
        clients_per_round: must equal the number of training clients (no client sampling).
        **kwargs: the other ``FederatedModule`` arguments (``seed``, ``nonfinite_updates``...).
    """

    #: whether :meth:`inner_estimate` reads the model each client used at the previous step
    keeps_previous_iterate: bool = False

    def __init__(
        self,
        client: pl.LightningModule,
        objective: CompositionalObjective,
        local_steps: int = 1,
        clients_per_round: int = 8,
        **kwargs: Any,
    ) -> None:
        if not isinstance(objective, CompositionalObjective):
            raise TypeError(f"objective must be a CompositionalObjective, got {type(objective).__name__}")
        if kwargs.get("local_epochs") is not None:
            raise ValueError(f"local_epochs must be None: a round is local_steps lock-step iterations, got {kwargs['local_epochs']}")
        super().__init__(client, clients_per_round=clients_per_round, local_steps=local_steps, **kwargs)
        self.objective = objective
        if self.keeps_previous_iterate:
            # x_k^{-1} of a client's first round is the model it starts from
            self.add_client_state(PREVIOUS, default=self.engine.round_start_model)

    # ---------------------------------------------------------------- setup
    def setup(self, stage: str) -> None:
        super().setup(stage)
        if stage != "fit":
            return
        num_train = len(self.engine.datamodule.train_clients)
        if self.clients_per_round != num_train:
            raise ValueError(
                f"{type(self).__name__} runs every training client at every step (the paper has no client "
                f"sampling): clients_per_round must equal the number of training clients ({num_train}), "
                f"got {self.clients_per_round}"
            )
        require_plain_sgd(self.engine.local_optimizer(), type(self).__name__)

    # -------------------------------------------------- inner-function estimate
    def inner_mean(self, run: ClientRun, batch: Any, model: Model = None) -> Tensor:
        """``g_k(model; batch)``: the mean g-term (float64, no grad) of ``batch`` at ``model``
        (None: the client's current model). A non-finite value shows in the server's average
        (``server_share`` stops on it) or in the client's update (the engine excludes it)."""
        with torch.no_grad(), frozen_running_stats(self.client):
            output = run.forward(batch[0], model=model)
        _, g = self.objective.terms(self.sample_losses(output, batch))
        return g.mean(0)

    def inner_estimate(self, run: ClientRun, batch: Any) -> Tensor:
        """The estimate ``y`` of ``g`` that client ``run.client_id`` uses in its step on ``batch``."""
        raise NotImplementedError

    # ------------------------------------------------------------- local step
    def client_init(self, run: ClientRun) -> None:
        if self.keeps_previous_iterate:
            run.scratch[PREVIOUS] = run.layout.copy(run.state[PREVIOUS])

    def client_step(self, run: ClientRun, batch: Any) -> Tensor:
        """``x <- x - eta [grad h(x; b) + grad g(x; b) grad f(y)]``: SGD on the surrogate
        ``mean(h) + <grad f(y), mean(g)>``; returns the batch's mean per-sample loss."""
        y = self.inner_estimate(run, batch)
        if self.keeps_previous_iterate:
            run.scratch[PREVIOUS] = run.layout.copy(run.end())  # x_k^t, before its step

        def loss_fn(b: Any) -> tuple[Tensor, Tensor]:
            losses = self.sample_losses(run.forward(b[0]), b)
            return surrogate(self.objective, losses, y).float(), losses.detach().float().mean()

        (_, mean_loss), grads = run.loss_and_grad(batch, loss_fn=loss_fn, has_aux=True)
        run.step(grads)
        return mean_loss

    def client_final(self, run: ClientRun) -> dict[str, Tensor]:
        if self.keeps_previous_iterate:
            run.state[PREVIOUS] = Layout.flatten(run.scratch[PREVIOUS])
        return {"delta": run.end() - run.start}


class FedDRO(LockStepCompositional):
    """FedDRO (Algorithm 2): FedAvg on the model, a momentum estimate of ``g`` averaged every step.

    At step ``t`` client ``k`` computes, on one minibatch ``b``,
    ``y_k = (1 - beta)(y_bar^{t-1} - g_k(x_k^{t-1}; b)) + g_k(x_k^t; b)`` (eq. 8); the server
    averages ``y_bar^t = sum_k w_k y_k``; the client steps along
    ``grad h_k(x_k^t; b) + grad g_k(x_k^t; b) grad f(y_bar^t)`` (eq. 7). At the very first step
    ``y_bar^0 = sum_k w_k g_k(x^0; b)`` (spec A1/A2: eq. 8 with ``x^{-1} = x^0`` and
    ``y_bar^{-1} = y_bar^0`` gives exactly that). ``x_k^{t-1}`` is the model client ``k`` used at
    the previous step, before the update and before any averaging (spec A4), so
    ``y_bar^t - sum_k w_k g_k(x_k^t)`` shrinks by ``(1 - beta)`` per step in expectation.

    Args:
        client: the client ``LightningModule``.
        objective: the compositional objective (``fl_lightning.functional.dro.KLDRO``...).
        beta: momentum of the estimate, in (0, 1]; ``beta = 1`` is the paper's "modified FedAvg".
        local_steps: ``I``, local steps between model averagings.
        clients_per_round: must equal the number of training clients.
        **kwargs: the other ``FederatedModule`` arguments.
    """

    keeps_previous_iterate = True

    def __init__(
        self,
        client: pl.LightningModule,
        objective: CompositionalObjective,
        beta: float = 0.1,
        local_steps: int = 1,
        clients_per_round: int = 8,
        **kwargs: Any,
    ) -> None:
        if not 0 < beta <= 1:
            raise ValueError(f"beta must be in (0, 1], got {beta}")
        super().__init__(client, objective, local_steps=local_steps, clients_per_round=clients_per_round, **kwargs)
        self.beta = beta

    @property
    def y_bar(self) -> Optional[Tensor]:
        """The server's latest averaged estimate ``y_bar`` (float64), None before the first step."""
        return self.shared

    def client_share(self, run: ClientRun, batch: Any) -> Tensor:
        """``y_k``: eq. 8 on ``batch`` (at the very first step, ``g_k(x^0; b)``)."""
        g_cur = self.inner_mean(run, batch)
        if run.local.shared is None:
            return g_cur
        g_prev = self.inner_mean(run, batch, model=run.scratch[PREVIOUS])
        return storm_estimate(run.local.shared.to(g_cur.device), g_cur, g_prev, self.beta)

    def server_share(self, mean: Tensor) -> Tensor:
        """``y_bar = sum_k w_k y_k``, kept inside the objective's domain (its guard)."""
        raw = check_finite("y_bar (the averaged estimate of g)", mean)
        y_bar = self.objective.guard(raw)
        log_agreed(self, "feddro/y_bar", float(y_bar[0]), on_step=False, on_epoch=True, batch_size=1)
        log_agreed(self, "feddro/y_guarded", float((y_bar != raw).any()), on_step=False, on_epoch=True,
                   reduce_fx="sum", batch_size=1)
        return y_bar

    def inner_estimate(self, run: ClientRun, batch: Any) -> Tensor:
        assert run.local.shared is not None
        return run.local.shared


class CompositionalFedAvg(LockStepCompositional):
    """Vanilla FedAvg for compositional problems (Algorithm 1), the baseline FedDRO proves wrong.

    Each client plugs its own minibatch value ``y_k = g_k(x_k; b)`` into ``grad f`` (case
    ``"I"``: only models are averaged; with ``local_steps=1`` this is the "parallel MBSGD"
    baseline). In case ``"II"`` the first step after each averaging uses the global
    ``y = sum_k w_k g_k(x_bar; b_k)`` (one all-reduce per round). Biased: Thm 4.1 shows it
    stalls away from stationary points.

    Args:
        client: the client ``LightningModule``.
        objective: the compositional objective.
        case: ``"I"`` or ``"II"``.
        local_steps: ``I``, local steps between model averagings.
        clients_per_round: must equal the number of training clients.
        **kwargs: the other ``FederatedModule`` arguments.
    """

    def __init__(
        self,
        client: pl.LightningModule,
        objective: CompositionalObjective,
        case: Case = "I",
        local_steps: int = 1,
        clients_per_round: int = 8,
        **kwargs: Any,
    ) -> None:
        if case not in ("I", "II"):
            raise ValueError(f"case must be 'I' or 'II', got {case!r}")
        super().__init__(client, objective, local_steps=local_steps, clients_per_round=clients_per_round, **kwargs)
        self.case = case

    def _global_step(self, run: ClientRun) -> bool:
        return self.case == "II" and run.local.step_index == 0

    def client_share(self, run: ClientRun, batch: Any) -> Optional[Tensor]:
        """Case II, first step of a round: the client's ``g_k(x_bar; b)``; otherwise nothing."""
        return self.objective.guard(self.inner_mean(run, batch)) if self._global_step(run) else None

    def server_share(self, mean: Tensor) -> Tensor:
        return self.objective.guard(check_finite("y (the averaged g)", mean))

    def inner_estimate(self, run: ClientRun, batch: Any) -> Tensor:
        if self._global_step(run):
            assert run.local.shared is not None
            return run.local.shared
        return self.objective.guard(self.inner_mean(run, batch))
