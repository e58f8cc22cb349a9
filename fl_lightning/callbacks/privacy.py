"""``DifferentialPrivacy``: client-level differential privacy with clipping and Gaussian noise.

DP-FedAvg (McMahan, Ramage, Talwar and Zhang, "Learning Differentially Private Recurrent Language
Models", ICLR 2018): every client's update is clipped to L2 norm ``C`` (all its uploads together),
and Gaussian noise of standard deviation ``z C`` (``z`` the noise multiplier) protects each
client's participation:

* ``mode="central"`` (the trusted server adds it): the server averages the ``m`` clipped updates
  uniformly and adds ``N(0, (z C / m)^2)`` per coordinate to the mean;
* ``mode="local"`` (each client adds it): every client adds ``N(0, (z C)^2)`` to its clipped
  update before sending it. In a deployment (:mod:`fl_lightning.deployment`) the node does it, before
  the update leaves (:meth:`DifferentialPrivacy.privatize`, with the simulation's bits), and the
  server passes the updates on as they come (:attr:`DifferentialPrivacy.applied_on_clients`).

The callback logs ``privacy/noise_multiplier`` and, when Opacus is installed
(``pip install -e ".[privacy]"``; without it, a warning and no ``privacy/epsilon``),
``privacy/epsilon`` for ``delta`` from Opacus' RDP accountant:
central mode with sampling rate ``clients per round / training clients`` and one step per round
(the accountant assumes Poisson sampling; with a fixed number of clients per round the figure is
an approximation), local mode as if a client took part in every round (sampling rate 1). The
accountant's history (noise multiplier, sampling rate, rounds) is in the checkpoint: a run resumed
with another noise multiplier is warned about, and every change of noise multiplier or sampling
rate starts a segment; epsilon is that of their composition (the segments' RDP adds up). Noise is
drawn from generators keyed by (seed, round[, client]), so runs are reproducible and processes agree.
"""

from __future__ import annotations

import math
import warnings
from typing import Any, Literal, Optional, Sequence

from torch import Tensor

from fl_lightning.functional.privacy import clip_update, gaussian_noise
from fl_lightning.hooks import Aggregator, FederatedCallback, Federation
from fl_lightning.lightning_compat import log_agreed
from fl_lightning.lightning_package import pl
from fl_lightning.seeding import generator
from fl_lightning.update import ClientUpdate
from fl_lightning.validation import check_int, check_number

Mode = Literal["central", "local"]


def dp_epsilon(noise_multiplier: float, sample_rate: float, steps: int, delta: float) -> float:
    """Epsilon of ``steps`` Gaussian-mechanism steps by Opacus' RDP accountant (NaN without Opacus)."""
    return composed_epsilon([(noise_multiplier, sample_rate, steps)], delta)


def composed_epsilon(history: Sequence[Sequence[float]], delta: float) -> float:
    """Epsilon of a sequence of segments ``(noise_multiplier, sample_rate, steps)`` by Opacus' RDP
    accountant (NaN without Opacus): RDP composes additively, ``RDP(a) = sum_i steps_i RDP_i(a)``
    at every order ``a``, converted once to ``(epsilon, delta)``."""
    try:
        from opacus.accountants import RDPAccountant
    except ImportError:
        return float("nan")
    segments = [(float(z), float(q), int(steps)) for z, q, steps in history if steps > 0]
    if not segments:
        return 0.0
    accountant = RDPAccountant()
    accountant.history = segments
    return float(accountant.get_epsilon(delta))


def record_round(history: list[list], noise_multiplier: float, sample_rate: float) -> None:
    """Add one round to ``history`` (``[noise_multiplier, sample_rate, rounds]`` segments): to the
    last segment when its settings are the same, else as a new segment."""
    if history and history[-1][0] == noise_multiplier and history[-1][1] == sample_rate:
        history[-1][2] += 1
    else:
        history.append([noise_multiplier, sample_rate, 1])


def _not_uniform(module: Federation, aggregators: Sequence[Aggregator]) -> str:
    """Why ``module``'s uploads are not all averaged uniformly, with what to change ("" where they are):
    the aggregator's uploads with a weighted mean, the module's ``weighting`` (no ``Aggregator``
    callback) or the callback's; with a non-linear aggregator, a uniform mean in its place."""
    name = type(module).__name__
    declared = [n for n, s in module.engine.update_specs.items() if s.reduction not in ("mean", "aggregator")]
    if declared:
        reductions = ", ".join(repr(module.engine.update_specs[n].reduction) for n in declared)
        return f"{name} declares {declared} with the reduction {reductions}, which no setting changes"
    aggregated = list(module.engine.aggregated_sizes())
    reduction = module.engine.aggregator_reduction
    if not aggregated or reduction == "mean":
        return ""
    if aggregators:
        return (f"{name}'s {aggregated} are combined by the aggregator {type(aggregators[0]).__name__} "
                f"({'a weighted mean' if reduction else 'not a mean'}): put WeightedMean('uniform') in its place")
    if reduction is None:
        return (f"{name}'s {aggregated} are combined by its default aggregator, which is not a mean: add the "
                "aggregator WeightedMean('uniform')")
    return (f"{name}'s {aggregated} are weighted by the clients' sample counts: pass weighting='uniform' to {name} "
            "(YAML: model.init_args.weighting: uniform)")


class DifferentialPrivacy(FederatedCallback):
    """Clip every client's update and add Gaussian noise (central or local), and account the privacy.

    Args:
        clip_norm: ``C``, the bound on each client's update's L2 norm (> 0).
        noise_multiplier: ``z``: the noise's standard deviation is ``z C`` (>= 0).
        mode: ``"central"`` (the server's mean gets ``N(0, (z C / m)^2)``) or ``"local"``
            (each update gets ``N(0, (z C)^2)``).
        delta: the ``delta`` of the reported ``(epsilon, delta)``.
        seed: the noise's seed (default: the module's).
    """

    def __init__(self, clip_norm: float, noise_multiplier: float, mode: Mode = "central", delta: float = 1e-5,
                 seed: Optional[int] = None) -> None:
        self.clip_norm = check_number("clip_norm", clip_norm, 0.0, low_open=True)
        self.noise_multiplier = check_number("noise_multiplier", noise_multiplier, 0.0)
        if mode not in ("central", "local"):
            raise ValueError(f"mode must be 'central' or 'local', got {mode!r}")
        self.mode = mode
        self.delta = check_number("delta", delta, 0.0, 1.0, low_open=True)
        self.seed = seed if seed is None else check_int("seed", seed, 0)
        #: the accountant's history: ``[noise_multiplier, sample_rate, rounds]`` per segment of equal settings
        self.history: list[list] = []
        #: whether the clients clip and noise their own updates (:meth:`privatize`, local mode), so that the
        #: server passes them on unchanged: set by a deployment, whose nodes apply the local mode
        self.applied_on_clients = False
        self._warned = False

    @property
    def rounds(self) -> int:
        """Rounds accounted (over every segment)."""
        return sum(steps for _, _, steps in self.history)

    def _seed(self, module: Federation) -> int:
        return self.seed if self.seed is not None else module.seed

    def setup(self, trainer: pl.Trainer, pl_module: Federation, stage: str) -> None:
        if stage != "fit":
            return
        reason = _not_uniform(pl_module, [cb for cb in trainer.callbacks if isinstance(cb, Aggregator)])
        if reason:
            raise ValueError(f"DifferentialPrivacy needs every upload averaged uniformly (its noise is calibrated to "
                             f"C / m); {reason}")

    def on_client_update(self, trainer: pl.Trainer, module: Federation, update: ClientUpdate) -> ClientUpdate:
        if self.applied_on_clients and self.mode == "local":
            return update
        return self.privatize(update, module.current_epoch, module.seed)

    def privatize(self, update: ClientUpdate, round_idx: int, module_seed: int) -> ClientUpdate:
        """``update`` of round ``round_idx`` clipped to ``clip_norm`` and, in local mode, noised (from a
        generator keyed by the callback's seed, else ``module_seed``, the round and the client): what the
        server's ``on_client_update`` does in a simulation, and a deployment node before the update leaves."""
        tensors = clip_update(update.tensors, self.clip_norm)
        if self.mode == "local" and self.noise_multiplier > 0:
            g = generator(self.seed if self.seed is not None else module_seed, "dp-local", round_idx, update.client_id)
            std = self.noise_multiplier * self.clip_norm
            tensors = {name: t + gaussian_noise(t, std, g) for name, t in tensors.items()}
        return ClientUpdate(update.client_id, update.num_samples, tensors, dict(update.metrics))

    def on_aggregate(self, trainer: pl.Trainer, module: Federation, aggregate: dict[str, Tensor]) -> dict[str, Tensor]:
        if self.mode != "central" or self.noise_multiplier == 0:
            return aggregate
        g = generator(self._seed(module), "dp-central", module.current_epoch)
        std = self.noise_multiplier * self.clip_norm / max(module.engine.round_num_updates, 1)
        return {name: t + gaussian_noise(t, std, g) for name, t in aggregate.items()}

    def on_round_end(self, trainer: pl.Trainer, module: Federation, round_idx: int, aggregate: Any) -> None:
        rate = 1.0 if self.mode == "local" else module.clients_per_round / len(module.engine.datamodule.train_clients)
        for segment in self.history:  # the rounds of a checkpoint that kept no history (load_state_dict)
            segment[1] = rate if segment[1] is None else segment[1]
        record_round(self.history, self.noise_multiplier, rate)
        epsilon = composed_epsilon(self.history, self.delta)
        if math.isnan(epsilon) and not self._warned:
            warnings.warn("privacy/epsilon is not logged: it needs Opacus' accountant: pip install -e '.[privacy]'",
                          stacklevel=2)
            self._warned = True
        log_agreed(module, "privacy/noise_multiplier", self.noise_multiplier, on_step=False, on_epoch=True,
                   batch_size=1)
        if not math.isnan(epsilon):  # without Opacus: not logged, rather than a NaN in every round's metrics
            log_agreed(module, "privacy/epsilon", epsilon, on_step=False, on_epoch=True, batch_size=1)

    def state_dict(self) -> dict[str, Any]:
        return {"rounds": self.rounds, "history": [list(segment) for segment in self.history]}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore the accountant's history; a checkpoint of before it was kept (rounds only) is
        taken as having used this run's noise multiplier (and the first round's sampling rate)."""
        history = state_dict.get("history")
        if history is None:
            rounds = int(state_dict.get("rounds", 0))
            history = [[self.noise_multiplier, None, rounds]] if rounds else []
        self.history = [list(segment) for segment in history]
        if self.history and self.history[-1][0] != self.noise_multiplier:
            warnings.warn(f"resuming with noise_multiplier={self.noise_multiplier} (the checkpoint's rounds used "
                          f"{self.history[-1][0]}): privacy/epsilon composes the privacy spent by both",
                          UserWarning, stacklevel=2)
