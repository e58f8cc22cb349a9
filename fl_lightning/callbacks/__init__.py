"""Callbacks with federated hooks: aggregators, attacks, personalization, metrics.

The base classes ``FederatedCallback`` and ``Aggregator`` live in :mod:`fl_lightning.hooks`
(beside the engine, which calls them) and are re-exported here."""

from fl_lightning.callbacks.aggregation import WeightedMean
from fl_lightning.callbacks.attacks import (
    ALIEAttack,
    ByzantineAttack,
    GaussianAttack,
    IPMAttack,
    LabelFlipAttack,
    ScalingAttack,
    SignFlipAttack,
)
from fl_lightning.callbacks.checkpoint import RoundCheckpoint
from fl_lightning.callbacks.class_metrics import ClassAccuracy
from fl_lightning.callbacks.client_metrics import ClientMetrics
from fl_lightning.callbacks.federated_evaluation import FederatedEvaluation
from fl_lightning.callbacks.finetune import LocalFinetuning
from fl_lightning.callbacks.history import RoundHistory
from fl_lightning.callbacks.personalized import PersonalizedAccuracy
from fl_lightning.callbacks.predictions import PredictionWriter
from fl_lightning.callbacks.privacy import DifferentialPrivacy
from fl_lightning.callbacks.robust_aggregation import (
    Bulyan,
    CenteredClipping,
    CoordinateMedian,
    GeometricMedian,
    Krum,
    RobustAggregator,
    TrimmedMean,
)
from fl_lightning.callbacks.stragglers import Stragglers
from fl_lightning.hooks import Aggregator, FederatedCallback

__all__ = [
    "ALIEAttack",
    "Aggregator",
    "Bulyan",
    "ByzantineAttack",
    "CenteredClipping",
    "ClassAccuracy",
    "ClientMetrics",
    "CoordinateMedian",
    "DifferentialPrivacy",
    "FederatedCallback",
    "FederatedEvaluation",
    "GaussianAttack",
    "GeometricMedian",
    "IPMAttack",
    "Krum",
    "LabelFlipAttack",
    "LocalFinetuning",
    "PersonalizedAccuracy",
    "PredictionWriter",
    "RobustAggregator",
    "RoundCheckpoint",
    "RoundHistory",
    "ScalingAttack",
    "SignFlipAttack",
    "Stragglers",
    "TrimmedMean",
    "WeightedMean",
]
