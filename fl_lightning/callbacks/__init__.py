"""Callbacks with federated hooks: aggregators, attacks, personalization, metrics."""

from fl_lightning.callbacks.aggregation import WeightedMean
from fl_lightning.callbacks.base import Aggregator, FederatedCallback
from fl_lightning.callbacks.client_metrics import ClientMetrics

__all__ = ["Aggregator", "ClientMetrics", "FederatedCallback", "WeightedMean"]
