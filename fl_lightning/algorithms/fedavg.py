"""FedAvg (McMahan et al., 2017), with the server learning rate and momentum of FedAvgM."""

from __future__ import annotations

from fl_lightning.module import FederatedModule


class FedAvg(FederatedModule):
    """Clients run local SGD from the global model; the server averages their deltas.

    ``x <- x - server_lr * m``, ``m <- server_momentum * m - mean(delta)``: with
    ``server_lr=1`` and ``server_momentum=0`` this is ``x <- x + mean(delta)``. The mean is the
    Trainer's aggregator (sample-weighted by default). All rules are ``FederatedModule``'s
    defaults; this class gives them their usual name.
    """
