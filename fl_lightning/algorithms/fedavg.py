"""FedAvg (McMahan et al., 2017), with the server learning rate and momentum of FedAvgM."""

from __future__ import annotations

from fl_lightning.module import FederatedModule


class FedAvg(FederatedModule):
    """Clients run local SGD from the global model; the server averages their deltas.

    ``x <- x - server_lr * m``, ``m <- server_momentum * m - mean(delta)``: with
    ``server_lr=1`` and ``server_momentum=0`` this is ``x <- x + mean(delta)``. The mean is, by
    default, the paper's sample-weighted one, ``mean(delta) = sum_k n_k delta_k / sum_k n_k``
    (McMahan et al., Algorithm 1); ``weighting="uniform"`` gives ``(1/|S|) sum_k delta_k``, and so
    does a server optimizer of Reddi et al. (``FedAdam``, ``FedYogi``, ``FedAdagrad``: their
    Algorithm 2 averages uniformly) unless ``weighting`` is given. An ``Aggregator`` callback
    replaces the mean. All rules are ``FederatedModule``'s defaults; this class gives them their
    usual name.
    """
