"""FedProx (Li et al., 2020): local objectives with a proximal term toward the global model."""

from __future__ import annotations

from typing import Any

from torch import Tensor

from fl_lightning.functional.prox import proximal_gradient
from fl_lightning.lightning_package import pl
from fl_lightning.module import FederatedModule
from fl_lightning.run import ClientRun


class FedProx(FederatedModule):
    """FedAvg whose clients minimize ``F_i(w) + mu/2 ||w - x||^2``, ``x`` the global model.

    The proximal gradient is added to the client's (unscaled) gradient at each local step, so
    the client module's loss is used unchanged.

    Default aggregation: the sample-weighted mean ``x <- x + sum_k n_k delta_k / sum_k n_k``.
    Li et al. (Algorithm 2) sample ``K`` devices with probabilities ``p_k = n_k / n`` and average
    them uniformly, ``(1/K) sum_k w_k``: an unbiased estimate of ``sum_k p_k w_k``. This framework
    samples clients uniformly, and under uniform sampling the unbiased equivalent of that average
    is the ``n_k``-weighted mean. ``weighting="uniform"`` gives ``(1/|S|) sum_k delta_k`` (the
    paper's average without its sampling).

    Args:
        mu: proximal strength, >= 0 (``mu=0`` is FedAvg).
        **kwargs: the ``FederatedModule`` arguments.
    """

    def __init__(self, client: pl.LightningModule, mu: float = 0.01, **kwargs: Any) -> None:
        if not mu >= 0:
            raise ValueError(f"mu must be >= 0, got {mu}")
        super().__init__(client, **kwargs)
        self.mu = mu

    def client_step(self, run: ClientRun, batch: Any) -> Tensor:
        """``w <- opt(w, g(w) + mu (w - x))``."""
        loss, grads = run.loss_and_grad(batch)
        if self.mu > 0:
            grads = proximal_gradient(grads, run.params, run.layout.split_params(run.start), self.mu)
        run.step(grads)
        return loss
