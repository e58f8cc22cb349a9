"""FedDRO (Khanduri et al.) and the vanilla FedAvg for compositional problems it proves wrong.

Both solve ``min_x h(x) + f(g(x))`` with ``g`` the mean over *all* clients' data of an inner
function (a :class:`~fl_lightning.dro.CompositionalObjective` of per-sample losses). Every
client takes the SGD step ``x_k <- x_k - eta [grad h_k + grad g_k(x_k; b) grad f(y)]``; the
algorithms differ only in the estimate ``y`` of ``g`` used in ``grad f``:

* :class:`FedDRO` (Algorithm 2): a hybrid SARAH/SGD (STORM) estimate per client, recomputed on
  the same minibatch at the current and the previous local model (eq. 8), averaged by the
  server into ``y_bar`` at *every* local step;
* :class:`CompositionalFedAvg` (Algorithm 1): ``y_k = g_k(x_k; b)``, each client's own
  minibatch value (case ``"I"``, the federated MBSGD plug-in), or, at the first step after each
  model averaging, the global mean ``g(x_bar)`` (case ``"II"``).

Models are averaged every ``local_steps`` (= the paper's ``I``) steps: a round is ``I``
lock-step iterations of *all* clients. A work item is one local step of all this process's
clients; under DDP the estimate costs one all-reduce of ``d_g`` numbers per step, and the
model average is the engine's usual aggregate (one all-reduce per round). Per-client models
exist only for the round (all clients take part at every step, as in the paper); the
previous-iterate snapshot that eq. 8 needs crosses rounds in the client state store.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Iterator, Literal, Optional

import pytorch_lightning as pl
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from fl_lightning.distributed import all_reduce_sum
from fl_lightning.dro import CompositionalObjective, check_finite, storm_estimate, surrogate
from fl_lightning.module import FederatedModule
from fl_lightning.update import ClientUpdate

Case = Literal["I", "II"]


@contextmanager
def frozen_running_stats(module: nn.Module) -> Iterator[None]:
    """Batch-norm layers normalize with batch statistics but leave their running statistics alone.

    Used for the extra no-grad forwards of the inner-function estimate (spec A13): only the
    forward of the SGD step updates running statistics.
    """
    norms = [m for m in module.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm) and m.track_running_stats]
    for m in norms:
        m.track_running_stats = False
    try:
        yield
    finally:
        for m in norms:
            m.track_running_stats = True


class LockStepCompositional(FederatedModule):
    """Common machinery of :class:`FedDRO` and :class:`CompositionalFedAvg` (see the module docstring).

    Subclasses define :meth:`estimate_inner` and say with ``keeps_previous_iterate`` whether
    they need each client's previous iterate (kept across rounds in the state store). The client module's ``configure_optimizers`` must
    give plain SGD (no momentum), the local update of both algorithms.

    Args:
        client: the client ``LightningModule``; its forward gives logits (see :meth:`sample_losses`).
        objective: the compositional objective (``KLDRO``, ``ChiSquareDRO``...).
        local_steps: ``I``, the local steps between two model averagings (one round).
        clients_per_round: must equal the number of training clients (no client sampling).
        **kwargs: the other ``FederatedModule`` arguments (``seed``, ``nonfinite_updates``...).
    """

    #: whether :meth:`estimate_inner` reads ``self._prev`` (the model each client used at the previous step)
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
        # the objective is an object: keep it out of hyperparameters, so checkpoints load with weights_only
        self.save_hyperparameters(ignore=["client", "objective"])
        self.objective = objective
        self._models: dict[int, Tensor] = {}
        self._prev: dict[int, Tensor] = {}
        self._batches: dict[int, Iterator[Any]] = {}
        self._weights: dict[int, float] = {}
        self._losses: dict[int, list[float]] = {}
        self._y_in_use: Optional[Tensor] = None
        self._losses_in_use: Optional[list[float]] = None

    # ---------------------------------------------------------------- setup
    def setup(self, stage: str) -> None:
        super().setup(stage)
        if stage != "fit":
            return
        num_train = len(self.datamodule.train_clients)
        if self.clients_per_round != num_train:
            raise ValueError(
                f"{type(self).__name__} runs every training client at every step (the paper has no client "
                f"sampling): clients_per_round must equal the number of training clients ({num_train}), "
                f"got {self.clients_per_round}"
            )
        optimizer = self.local_optimizer()
        if type(optimizer) is not torch.optim.SGD or any(g["momentum"] != 0 for g in optimizer.param_groups):
            raise ValueError(
                f"{type(self).__name__}'s local update is plain SGD: the client's configure_optimizers must return "
                f"torch.optim.SGD with momentum=0, got {type(optimizer).__name__} {optimizer.defaults}"
            )

    # ------------------------------------------------------------- schedule
    def num_work_items(self) -> int:
        """``I`` lock-step iterations per round, on every process."""
        assert self.local_steps is not None
        return self.local_steps

    def round_work(self, clients: list[int]) -> list[int]:
        """The round's work items: the local step indices ``0 .. I-1``."""
        return list(range(self.num_work_items()))

    def on_train_epoch_start(self) -> None:
        super().on_train_epoch_start()
        start = self.round_start
        assert start is not None
        dm = self.datamodule
        total = float(sum(dm.num_samples(c) for c in self.round_clients))
        self._models = {c: start.clone() for c in self._rank_clients}
        if self.keeps_previous_iterate:
            self._prev = {c: self.store.get(c, "prev", default=start.clone, device=self.device) for c in self._rank_clients}
        self._batches = {c: self.local_batches(c) for c in self._rank_clients}
        self._weights = {c: dm.num_samples(c) / total for c in self._rank_clients}
        self._losses = {c: [] for c in self._rank_clients}

    def run_work_item(self, step: int) -> None:
        """One local step of all this process's clients; after the last, send the models."""
        batches = {c: next(self._batches[c]) for c in self._rank_clients}
        estimates = self.estimate_inner(step, batches)
        for c in self._rank_clients:
            self._sgd_step(c, batches[c], estimates[c], step)
        if step == self.num_work_items() - 1:
            self._send_models()

    # -------------------------------------------------- inner-function estimate
    def estimate_inner(self, step: int, batches: dict[int, Any]) -> dict[int, Tensor]:
        """The estimate ``y`` of ``g`` each of this process's clients uses at local step ``step``."""
        raise NotImplementedError

    def inner_mean(self, client_id: int, state: Tensor, batch: Any) -> Tensor:
        """``g_k(state; batch)``: the mean g-term (float64, no grad) of ``batch`` at model ``state``."""
        self.state.load(state)
        with torch.no_grad(), frozen_running_stats(self.client):
            _, g = self.objective.terms(self.sample_losses(batch))
        return check_finite(f"g of client {client_id}", g.mean(0))

    def server_mean(self, values: dict[int, Tensor]) -> Tensor:
        """``sum_k w_k values_k`` over all processes' clients, ``w_k = n_k / n`` (one all-reduce)."""
        local = torch.zeros(self.objective.dim, dtype=torch.float64, device=self.device)
        for c in self._rank_clients:
            local += self._weights[c] * values[c]
        return all_reduce_sum(local)

    # ------------------------------------------------------------- local step
    def sample_losses(self, batch: Any) -> Tensor:
        """Per-sample losses ``[b]`` of the client module on ``batch`` (default: cross-entropy of
        its forward on ``(x, y)``). Override for other losses."""
        x, y = batch
        return F.cross_entropy(self.client(x), y, reduction="none")

    def local_loss(self, batch: Any, step: int) -> Tensor:
        """The surrogate ``mean(h) + <grad f(y), mean(g)>`` whose gradient is the local direction."""
        assert self._y_in_use is not None and self._losses_in_use is not None
        losses = self.sample_losses(batch)
        self._losses_in_use.append(float(losses.detach().float().mean()))
        return surrogate(self.objective, losses, self._y_in_use).float()

    def _sgd_step(self, client_id: int, batch: Any, y: Tensor, step: int) -> None:
        """Load client ``client_id``'s model, remember it as the previous iterate, take the SGD step."""
        self.state.load(self._models[client_id])
        if self.keeps_previous_iterate:
            self._prev[client_id] = self._models[client_id]
        self._y_in_use, self._losses_in_use = y, self._losses[client_id]
        with self.local_context(client_id):
            self.local_step(self.local_optimizer(), batch, step)
        self._y_in_use, self._losses_in_use = None, None
        self._models[client_id] = self.state.flatten()

    def _send_models(self) -> None:
        assert self.round_start is not None
        for c in self._rank_clients:
            if self.keeps_previous_iterate:
                self.store.set(c, "prev", self._prev[c])
            losses = self._losses[c]
            metrics = {"loss": sum(losses) / max(len(losses), 1), "steps": float(len(losses))}
            delta = self._models[c] - self.round_start
            self.receive(ClientUpdate(c, self.datamodule.num_samples(c), {"delta": delta}, metrics))
        self._models, self._prev, self._batches = {}, {}, {}


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
        objective: the compositional objective (``fl_lightning.dro.KLDRO``...).
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
        self.y_bar: Optional[Tensor] = None

    def estimate_inner(self, step: int, batches: dict[int, Any]) -> dict[int, Tensor]:
        estimates = {}
        for c in self._rank_clients:
            g_cur = self.inner_mean(c, self._models[c], batches[c])
            if self.y_bar is None:
                estimates[c] = g_cur
            else:
                g_prev = self.inner_mean(c, self._prev[c], batches[c])
                estimates[c] = storm_estimate(self.y_bar.to(self.device), g_cur, g_prev, self.beta)
        raw = check_finite("y_bar (the averaged estimate of g)", self.server_mean(estimates))
        self.y_bar = self.objective.guard(raw)
        self.log("feddro/y_bar", float(self.y_bar[0]), on_step=False, on_epoch=True, batch_size=1)
        self.log("feddro/y_guarded", float((self.y_bar != raw).any()), on_step=False, on_epoch=True,
                 reduce_fx="sum", batch_size=1)
        return {c: self.y_bar for c in self._rank_clients}

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        super().on_save_checkpoint(checkpoint)
        checkpoint["feddro"] = {"y_bar": None if self.y_bar is None else self.y_bar.cpu()}

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        super().on_load_checkpoint(checkpoint)
        saved = checkpoint.get("feddro", {}).get("y_bar")
        self.y_bar = None if saved is None else saved.to(torch.float64)


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

    def estimate_inner(self, step: int, batches: dict[int, Any]) -> dict[int, Tensor]:
        local = {c: self.objective.guard(self.inner_mean(c, self._models[c], batches[c])) for c in self._rank_clients}
        if self.case == "II" and step == 0:
            y = self.objective.guard(check_finite("y (the averaged g)", self.server_mean(local)))
            return {c: y for c in self._rank_clients}
        return local
