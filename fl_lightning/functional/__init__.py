"""The mathematics of federated learning as pure functions on tensors.

Following torchmetrics' ``functional`` convention, everything here is a function (or a small
value object) of tensors and numbers: no Lightning, no module state, no communication. The
algorithms, callbacks and optimizers of ``fl_lightning`` are thin layers over these functions,
which are tested on their own against hand-computed values.

* :mod:`~fl_lightning.functional.prox`: proximal terms, their gradients (FedProx, FedDeper)
  and their proximal map (FedProxVR);
* :mod:`~fl_lightning.functional.variance_reduction`: the SVRG, SARAH and SAGA estimators and
  the full gradient over chunks;
* :mod:`~fl_lightning.functional.robust`: robust statistics of a stack of updates (geometric
  median, coordinate median, trimmed mean, Krum, Bulyan, centered clipping);
* :mod:`~fl_lightning.functional.attacks`: Byzantine attack formulas and the choice of Byzantine clients;
* :mod:`~fl_lightning.functional.dro`: distributionally robust objectives as compositional problems;
* :mod:`~fl_lightning.functional.privacy`: clipping an update and Gaussian noise (DP-FedAvg);
* :mod:`~fl_lightning.functional.norms`: the joint norm of a model's worth of tensors (clipping, FedProxVR's theory);
* :mod:`~fl_lightning.functional.partition`: client partitions of labels or keys (the
  partitioner objects of :mod:`fl_lightning.datamodules.partitioners` wrap them);
* :mod:`~fl_lightning.functional.client_summaries`: a metric's distribution over clients (the
  sample-weighted and uniform means, the worst and best client, percentiles);
* :mod:`~fl_lightning.functional.fedproxvr_theory`: FedProxVR's convergence theory as numbers
  (imported from its module: its names are the paper's).
"""

from fl_lightning.functional.attacks import (
    alie_attack,
    alie_z,
    data_fraction,
    flip_labels,
    gaussian_attack,
    ipm_attack,
    scaling_attack,
    select_byzantine,
    sign_flip_attack,
)
from fl_lightning.functional.client_summaries import summarize
from fl_lightning.functional.dro import (
    KLDRO,
    ChiSquareDRO,
    CompositionalObjective,
    NonFiniteEstimateError,
    check_finite,
    objective_value,
    storm_estimate,
    surrogate,
)
from fl_lightning.functional.privacy import clip_update, gaussian_noise
from fl_lightning.functional.prox import (
    depersonalization_gradient,
    depersonalization_strength,
    prox_step,
    proximal_gradient,
)
from fl_lightning.functional.robust import (
    GeometricMedianResult,
    bulyan,
    centered_clipping,
    coordinate_median,
    geometric_median,
    krum,
    krum_scores,
    trim_count,
    trimmed_mean,
    weiszfeld_objective,
)
from fl_lightning.functional.variance_reduction import (
    full_gradient,
    saga_direction,
    sarah_direction,
    svrg_direction,
)

__all__ = [
    "ChiSquareDRO",
    "CompositionalObjective",
    "GeometricMedianResult",
    "KLDRO",
    "NonFiniteEstimateError",
    "alie_attack",
    "alie_z",
    "bulyan",
    "centered_clipping",
    "check_finite",
    "clip_update",
    "coordinate_median",
    "data_fraction",
    "depersonalization_gradient",
    "depersonalization_strength",
    "flip_labels",
    "full_gradient",
    "gaussian_attack",
    "gaussian_noise",
    "geometric_median",
    "ipm_attack",
    "krum",
    "krum_scores",
    "objective_value",
    "prox_step",
    "proximal_gradient",
    "saga_direction",
    "sarah_direction",
    "scaling_attack",
    "select_byzantine",
    "sign_flip_attack",
    "storm_estimate",
    "summarize",
    "surrogate",
    "svrg_direction",
    "trim_count",
    "trimmed_mean",
    "weiszfeld_objective",
]
