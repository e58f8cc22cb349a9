"""FedDeper (Zhou et al., 2022): depersonalized federated learning by alternating SGD.

Each sampled client trains two models on the same mini-batch at every local step: its
personal model ``v`` by plain SGD on its own loss, and the globalized model ``y`` (started
from the global model ``x``) on the surrogate ``f_i(y) + rho/(2 eta) ||v + y - 2x||^2``,
which pulls ``y`` toward the reflection ``2x - v`` of the personal model through ``x``:

    y_{j+1} = y_j - eta g_i(y_j) - rho (v_j + y_j - 2x)     (uses v_j, before v's own step)
    v_{j+1} = v_j - eta g_i(v_j)
    after tau steps:  v_i <- (1 - lam) v_tau + lam y_tau,   upload  y_tau - x

The server averages the uploads uniformly over the round's clients ``U`` (Algorithm 1 line 14,
spec A5): ``x <- x + (1/|U|) sum_{i in U} (y_i - x)``; ``weighting="num_samples"`` weighs them by
sample count. Parameters the local optimizer does not move (frozen, or left out of
``configure_optimizers``) stay put in ``y`` and in ``v``. ``v_i`` persists in the client state store
(lazily ``x^0``, the global model of round 0: Algorithm 1's input), so a client never sampled keeps
``x^0`` and a client sampled again resumes its own ``v_i``; ``personal_init="first_round"`` starts
each ``v_i`` instead from the global model of the round its client is first sampled in. During a
client's round ``y`` is the run's trained model and ``v`` a second model of the run
(``run.loss_and_grad(batch, model=v)``).
``FedDeper*`` is FedDeper with half the local steps (a config, not a class).
"""

from __future__ import annotations

import warnings
from typing import Any, Literal, Optional, Sequence

import torch
from torch import Tensor

from fl_lightning.functional.prox import depersonalization_gradient, depersonalization_strength
from fl_lightning.lightning_package import pl
from fl_lightning.module import FederatedModule
from fl_lightning.paper import PaperDefaults
from fl_lightning.optim.plain_sgd import require_plain_sgd
from fl_lightning.run import ClientRun
from fl_lightning.vectors import Layout

PERSONAL = "personal"
PERSONAL_BATCHES = "personal_batches"
UpdateOrder = Literal["jacobi", "gauss_seidel"]
PersonalInit = Literal["x0", "first_round"]


def sgd_step(
    model: Sequence[Tensor], grads: Sequence[Tensor], lr: float, moves: Optional[Sequence[bool]] = None
) -> list[Tensor]:
    """``w - lr g`` for the parameters of ``model`` (the first ``len(grads)`` tensors), the rest
    (floating buffers) unchanged: plain SGD, with ``torch.optim.SGD``'s arithmetic.

    ``moves[k]`` False leaves parameter ``k`` as it is (a parameter the local optimizer does not
    move: frozen, or not in ``configure_optimizers``); None moves every parameter."""
    stepped = [w if moves is not None and not moves[k] else w.add(g, alpha=-lr)
               for k, (w, g) in enumerate(zip(model, grads))]
    return stepped + list(model[len(grads):])


def mix_personal(personal: Tensor, globalized: Tensor, lam: float) -> Tensor:
    """``(1 - lam) v + lam y``: the personal model a client keeps after its round (eq. 6)."""
    return torch.lerp(personal, globalized, lam)


class FedDeper(FederatedModule):
    """FedDeper: a personal model per client that depersonalizes the uploaded update.

    Only ``y - x`` is uploaded (FedAvg's communication); each local step costs two
    gradient evaluations. The client module's ``training_step`` gives the loss of both models
    and its ``configure_optimizers`` must return plain SGD (its ``lr`` is ``eta``).

    Default aggregation (spec A5): the uniform mean ``x <- x + (1/|U|) sum_i (y_i - x)``;
    ``weighting="num_samples"`` gives ``x <- x + sum_i n_i (y_i - x) / sum_i n_i``.

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
        reset_personal: start every round's personal model from the global model (``v_0 = x``)
            instead of the stored ``v_i``: the initialization the paper sets aside for eq. (6),
            as an ablation (the stored ``v_i`` is still mixed and kept for evaluation).
        personal_init: each client's personal model before its first round: ``"x0"``, the
            global model of round 0 (Algorithm 1's input, ``v_i^0 = x^0``), or ``"first_round"``,
            the global model ``x^k`` of the round the client is first sampled in (``v_i = x^k``
            then; a client never sampled is evaluated with the last round's start). With many
            clients and few per round, ``"x0"`` leaves a client's first round pulling ``y`` toward
            ``2x^k - x^0``, away from the start, however far the global model has moved.
        **kwargs: the ``FederatedModule`` arguments (``clients_per_round``, ``local_steps``,
            ``weighting``...).
    """

    paper = PaperDefaults(weighting="uniform")

    def __init__(
        self,
        client: pl.LightningModule,
        rho: float = 0.03,
        lam: float = 0.5,
        independent_batches: bool = False,
        update_order: UpdateOrder = "jacobi",
        reset_personal: bool = False,
        personal_init: PersonalInit = "x0",
        **kwargs: Any,
    ) -> None:
        if not 0.0 <= rho < 1.0:
            raise ValueError(f"rho must be in [0, 1), got {rho}")
        if not 0.0 <= lam <= 1.0:
            raise ValueError(f"lam must be in [0, 1], got {lam}")
        if update_order not in ("jacobi", "gauss_seidel"):
            raise ValueError(f"update_order must be 'jacobi' or 'gauss_seidel', got {update_order!r}")
        if personal_init not in ("x0", "first_round"):
            raise ValueError(f"personal_init must be 'x0' or 'first_round', got {personal_init!r}")
        if lam < 0.5:
            warnings.warn(f"lam={lam} is below 0.5, outside FedDeper's convergence theory (lam in [0.5, 1])", stacklevel=2)
        super().__init__(client, **kwargs)
        self.rho = rho
        self.lam = lam
        self.independent_batches = independent_batches
        self.update_order = update_order
        self.reset_personal = reset_personal
        self.personal_init = personal_init
        #: x^0, the global model of round 0: every personal model's value before its first round
        #: (``personal_init="x0"``).
        self.register_buffer("initial_state", self.global_model.flatten())
        self.add_client_state(PERSONAL, default=self.initial_model if personal_init == "x0" else self.engine.round_start_model)
        if independent_batches:
            self.extra_batch_streams = (PERSONAL_BATCHES,)

    def setup(self, stage: str) -> None:
        super().setup(stage)
        require_plain_sgd(self.engine.local_optimizer(), "FedDeper")

    def on_train_epoch_start(self) -> None:
        super().on_train_epoch_start()
        if self.current_epoch == 0:
            assert self.engine.round_start is not None
            self.initial_state.copy_(self.engine.round_start)

    def initial_model(self) -> Tensor:
        """``x^0``, every personal model's value before its first round."""
        return self.initial_state

    def personal_model(self, client_id: int) -> Tensor:
        """Client ``client_id``'s stored personal model ``v_i`` (``x^0`` before its first round), on the device."""
        return self.engine.context.load_client_state(client_id)[PERSONAL]

    def client_init(self, run: ClientRun) -> None:
        run.scratch["x"] = run.layout.split_params(run.start)
        # v_0 = v_i (x with reset_personal); y_0 = x is the run's start
        run.scratch["v"] = run.layout.copy(run.start if self.reset_personal else run.state[PERSONAL])

    def client_step(self, run: ClientRun, batch: Any) -> dict[str, Tensor]:
        """``y <- y - eta g(y) - rho (v + y - 2x)`` and ``v <- v - eta g(v)``, in the configured order."""
        v, v_batch = run.scratch["v"], run.data.extra.get(PERSONAL_BATCHES, batch)
        lr = run.local.lr
        if self.update_order == "gauss_seidel":  # v steps first; the y-step pulls toward 2x - v_{j+1}
            loss_v, grads_v = run.loss_and_grad(v_batch, model=v)
            v = sgd_step(v, grads_v, lr, run.local.moves)
        loss_y, grads = run.loss_and_grad(batch)
        if self.rho > 0:
            grads = depersonalization_gradient(
                grads, run.params, v, run.scratch["x"], depersonalization_strength(self.rho, lr))
        run.step(grads)
        if self.update_order == "jacobi":  # the y-step above used v_j, before v's own step
            loss_v, grads_v = run.loss_and_grad(v_batch, model=v)
            v = sgd_step(v, grads_v, lr, run.local.moves)
        run.scratch["v"] = v
        return {"loss": loss_y, "personal_loss": loss_v}

    def client_final(self, run: ClientRun) -> dict[str, Tensor]:
        """Keep ``v_i <- (1 - lam) v + lam y``; upload ``y - x``."""
        y = run.end()
        run.state[PERSONAL] = mix_personal(Layout.flatten(run.scratch["v"]), y, self.lam)
        return {"delta": y - run.start}

    def client_eval_state(self, client_id: int) -> Tensor:
        """The personal model ``v_i`` (after the round-end mixing)."""
        return self.personal_model(client_id)
