"""Byzantine attacks as callbacks: chosen clients upload forged messages.

A ``ByzantineAttack`` picks its Byzantine clients once, at the start of fit, from the seed:
by ``count`` or by ``fraction`` of the training data (RAGA states robustness in data mass,
``1 - C_alpha``). The set is fixed for the run; whenever one of its clients is sampled, its
upload is replaced in ``on_client_update``, whatever the algorithm uploads (a delta, an averaged
gradient, ...): every tensor of the update is forged. A geometric median only resists a
Byzantine share of the weight below 1/2, so a fraction of 0.5 or more is refused unless
``allow_majority=True``.

Attacks that read the honest uploads (the colluding sign flip, ALIE, IPM) are omniscient:
they forge in ``on_round_updates``, before aggregation, from the mean and standard deviation
of all processes' honest uploads of the round (one all-reduce per round).

The label-flip attack poisons the Byzantine clients' data instead, in ``on_local_batch``, so
it reaches every algorithm. The engine skips the local training of clients whose upload will be
forged without being read (``forges_upload``; the result is the same, only faster).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal, Optional

import torch
from torch import Tensor

from fl_lightning.datamodules.targets import targets_in_words
from fl_lightning.distributed import all_reduce_sum
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
from fl_lightning.hooks import FederatedCallback, Federation
from fl_lightning.lightning_compat import log_agreed
from fl_lightning.lightning_package import pl
from fl_lightning.seeding import generator
from fl_lightning.validation import check_int, check_number
from fl_lightning.update import ClientUpdate


@dataclass
class HonestStatistics:
    """Per-name mean and standard deviation (population) of the round's honest uploads."""

    mean: dict[str, Tensor]
    std: dict[str, Tensor]
    count: int


class ByzantineAttack(FederatedCallback):
    """Base class: chooses the Byzantine clients and forges their uploads.

    Args:
        fraction: target share of the training samples held by Byzantine clients (the
            achieved share is the largest not above it, see ``attacks.select_byzantine``).
        count: or a number of Byzantine clients (exclusive with ``fraction``).
        seed: seed of the choice and of the attack's noise (default: the module's seed).
        allow_majority: allow a Byzantine share >= 0.5, where no median-type rule can help.
    """

    def __init__(
        self,
        fraction: Optional[float] = None,
        count: Optional[int] = None,
        seed: Optional[int] = None,
        allow_majority: bool = False,
    ) -> None:
        if (fraction is None) == (count is None):
            raise ValueError(f"give exactly one of fraction and count, got fraction={fraction}, count={count}")
        if fraction is not None:
            check_number("fraction", fraction, 0.0, 1.0, high_open=False)
        if count is not None:
            check_int("count", count, 0)
        if seed is not None:
            check_int("seed", seed, 0)
        if fraction is not None and fraction >= 0.5 and not allow_majority:
            raise ValueError(
                f"fraction={fraction}: Byzantine clients would hold half the data or more, where the geometric "
                "median's guarantee is void; pass allow_majority=True to run it anyway"
            )
        self.fraction = fraction
        self.count = count
        self.seed = seed
        self.allow_majority = allow_majority
        self.byzantine: list[int] = []
        self.achieved_fraction = 0.0
        self._round_clients: list[int] = []

    @property
    def omniscient(self) -> bool:
        """Whether the forged uploads depend on the honest ones."""
        return False

    def attack_seed(self, module: Federation) -> int:
        """The seed of the choice and the noise."""
        return self.seed if self.seed is not None else module.seed

    # ------------------------------------------------------------ selection
    def choose(self, module: Federation) -> list[int]:
        """Choose (and remember) the Byzantine clients among the datamodule's training clients."""
        dm = module.engine.datamodule
        clients = list(dm.train_clients)
        sizes = [dm.num_samples(c) for c in clients]
        g = generator(self.attack_seed(module), "byzantine")
        positions = select_byzantine(sizes, g, fraction=self.fraction, count=self.count)
        self.achieved_fraction = data_fraction(sizes, positions)
        if self.achieved_fraction >= 0.5 and not self.allow_majority:
            raise ValueError(
                f"count={self.count}: the Byzantine clients hold {self.achieved_fraction:.3f} of the data (>= 0.5), "
                "where the geometric median's guarantee is void; pass allow_majority=True to run it anyway"
            )
        self.byzantine = sorted(clients[i] for i in positions)
        return self.byzantine

    #: whether the attack replaces uploads (False for attacks on the clients' data)
    forges_uploads: bool = True

    def on_fit_start(self, trainer: pl.Trainer, pl_module: Federation) -> None:
        if self.forges_uploads and not pl_module.engine.update_specs:
            raise ValueError(
                f"{type(self).__name__} forges what Byzantine clients upload, and {type(pl_module).__name__} uploads "
                "nothing (its clients train alone); poison their data with LabelFlipAttack instead"
            )
        self.choose(pl_module)

    def is_byzantine(self, client_id: int) -> bool:
        """Whether ``client_id`` is Byzantine."""
        return client_id in self.byzantine

    @property
    def reads_own_upload(self) -> bool:
        """Whether a forged upload depends on the Byzantine client's own honest upload."""
        return False

    def forges_upload(self, trainer: pl.Trainer, module: Federation, client_id: int) -> bool:
        """Whether ``client_id``'s local training is wasted: it is Byzantine and its forged upload
        ignores its own honest one."""
        return self.is_byzantine(client_id) and not self.reads_own_upload

    # ---------------------------------------------------------------- round
    def on_round_start(self, trainer: pl.Trainer, module: Federation, round_idx: int, clients: list[int]) -> None:
        self._round_clients = list(clients)

    def on_client_update(self, trainer: pl.Trainer, module: Federation, update: ClientUpdate) -> ClientUpdate:
        if self.omniscient or not self.is_byzantine(update.client_id):
            return update
        return self._forged(module, update, None)

    def on_round_updates(
        self, trainer: pl.Trainer, module: Federation, updates: list[ClientUpdate]
    ) -> list[ClientUpdate]:
        if not self.omniscient:
            return updates
        stats = self._honest_statistics(module, [u for u in updates if not self.is_byzantine(u.client_id)])
        return [self._forged(module, u, stats) if self.is_byzantine(u.client_id) else u for u in updates]

    def on_round_end(self, trainer: pl.Trainer, module: Federation, round_idx: int, aggregate: Any) -> None:
        log_agreed(module, "attack/byzantine_fraction", self.achieved_fraction, on_step=False, on_epoch=True,
                   batch_size=1)

    def _forged(self, module: Federation, update: ClientUpdate, stats: Optional[HonestStatistics]) -> ClientUpdate:
        return ClientUpdate(update.client_id, update.num_samples, self.forge(module, update, stats), dict(update.metrics))

    def _honest_statistics(self, module: Federation, honest: list[ClientUpdate]) -> HonestStatistics:
        """Mean and std of all processes' ``honest`` uploads of the round (one all-reduce)."""
        names = module.engine.upload_sizes()
        device = module.device
        flat = torch.zeros(2 * sum(names.values()) + 1, dtype=torch.float64, device=device)
        p = sum(names.values())
        for u in honest:
            row = torch.cat([u.tensors[n].reshape(-1).to(device, torch.float64) for n in names])
            flat[:p] += row
            flat[p : 2 * p] += row * row
            flat[-1] += 1
        flat = all_reduce_sum(flat)
        count = int(flat[-1])
        mean = flat[:p] / max(count, 1)
        std = (flat[p : 2 * p] / max(count, 1) - mean * mean).clamp_min(0).sqrt()
        sizes = list(names.values())
        return HonestStatistics(
            {n: m.float() for n, m in zip(names, mean.split(sizes))},
            {n: s.float() for n, s in zip(names, std.split(sizes))},
            count,
        )

    def forge(self, module: Federation, update: ClientUpdate, stats: Optional[HonestStatistics]) -> dict[str, Tensor]:
        """The Byzantine tensors replacing ``update.tensors`` (``stats`` is given to omniscient attacks)."""
        raise NotImplementedError


class GaussianAttack(ByzantineAttack):
    """Byzantine clients upload fresh ``N(0, std^2 I)`` vectors (RAGA's experiments, ``std = 1``).

    The noise comes from ``generator(seed, "attack", round, client)``.

    Args:
        std: standard deviation of the noise (> 0, finite).
        **kwargs: the ``ByzantineAttack`` arguments.
    """

    def __init__(self, std: float = 1.0, **kwargs: Any) -> None:
        check_number("std", std, 0.0, low_open=True)
        super().__init__(**kwargs)
        self.std = std

    def forge(self, module: Federation, update: ClientUpdate, stats: Optional[HonestStatistics]) -> dict[str, Tensor]:
        g = generator(self.attack_seed(module), "attack", module.current_epoch, update.client_id)
        return {k: gaussian_attack(v.shape, g, self.std).to(v.device) for k, v in update.tensors.items()}


class SignFlipAttack(ByzantineAttack):
    """Byzantine clients upload ``-scale`` times a reference.

    Args:
        scale: the factor ``c``, finite (Byrd-SAGA's code: 3).
        reference: ``"honest_mean"`` (all Byzantine clients send the same ``-c * mean``: colluding,
            omniscient) or ``"own"`` (each sends ``-c`` times its own honest upload).
        **kwargs: the ``ByzantineAttack`` arguments.
    """

    def __init__(self, scale: float = 3.0, reference: Literal["honest_mean", "own"] = "honest_mean", **kwargs: Any) -> None:
        if reference not in ("honest_mean", "own"):
            raise ValueError(f"reference must be 'honest_mean' or 'own', got {reference!r}")
        check_number("scale", scale, -math.inf)
        super().__init__(**kwargs)
        self.scale = scale
        self.reference = reference

    @property
    def omniscient(self) -> bool:
        return self.reference == "honest_mean"

    @property
    def reads_own_upload(self) -> bool:
        return self.reference == "own"

    def forge(self, module: Federation, update: ClientUpdate, stats: Optional[HonestStatistics]) -> dict[str, Tensor]:
        source = stats.mean if stats is not None else update.tensors
        return {k: sign_flip_attack(source[k], self.scale).to(v.device) for k, v in update.tensors.items()}


class ScalingAttack(ByzantineAttack):
    """Byzantine clients upload ``factor`` times their honest upload.

    Args:
        factor: the scale, finite (e.g. 10 to boost, -1 to reverse).
        **kwargs: the ``ByzantineAttack`` arguments.
    """

    def __init__(self, factor: float = 10.0, **kwargs: Any) -> None:
        check_number("factor", factor, -math.inf)
        super().__init__(**kwargs)
        self.factor = factor

    @property
    def reads_own_upload(self) -> bool:
        return True

    def forge(self, module: Federation, update: ClientUpdate, stats: Optional[HonestStatistics]) -> dict[str, Tensor]:
        return {k: scaling_attack(v, self.factor) for k, v in update.tensors.items()}


class ALIEAttack(ByzantineAttack):
    """A Little Is Enough (Baruch et al., 2019): ``mean - z * std`` of the honest uploads.

    Args:
        z: the shift in standard deviations (finite); None: ``alie_z(n, f)`` of the round's n clients
            and f Byzantine among them.
        **kwargs: the ``ByzantineAttack`` arguments.
    """

    def __init__(self, z: Optional[float] = None, **kwargs: Any) -> None:
        if z is not None:
            check_number("z", z, -math.inf)
        super().__init__(**kwargs)
        self.z = z

    @property
    def omniscient(self) -> bool:
        return True

    def forge(self, module: Federation, update: ClientUpdate, stats: Optional[HonestStatistics]) -> dict[str, Tensor]:
        assert stats is not None
        f = sum(self.is_byzantine(c) for c in self._round_clients)
        z = self.z if self.z is not None else alie_z(len(self._round_clients), f)
        return {k: alie_attack(stats.mean[k], stats.std[k], z).to(v.device) for k, v in update.tensors.items()}


class IPMAttack(ByzantineAttack):
    """Inner-product manipulation (Xie et al., 2020): ``-epsilon * mean`` of the honest uploads.

    Args:
        epsilon: the factor, > 0 and finite (small: 0.1; large: 100).
        **kwargs: the ``ByzantineAttack`` arguments.
    """

    def __init__(self, epsilon: float = 0.1, **kwargs: Any) -> None:
        check_number("epsilon", epsilon, 0.0, low_open=True)
        super().__init__(**kwargs)
        self.epsilon = epsilon

    @property
    def omniscient(self) -> bool:
        return True

    def forge(self, module: Federation, update: ClientUpdate, stats: Optional[HonestStatistics]) -> dict[str, Tensor]:
        assert stats is not None
        return {k: ipm_attack(stats.mean[k], self.epsilon).to(v.device) for k, v in update.tensors.items()}


class LabelFlipAttack(ByzantineAttack):
    """Byzantine clients train honestly on flipped labels ``y -> C - 1 - y``; uploads pass unchanged.

    Args:
        num_classes: number of classes ``C``: the datamodule's (checked at setup).
        **kwargs: the ``ByzantineAttack`` arguments.
    """

    forges_uploads = False

    def __init__(self, num_classes: int = 10, **kwargs: Any) -> None:
        check_int("num_classes", num_classes, 2)
        super().__init__(**kwargs)
        self.num_classes = num_classes

    @property
    def reads_own_upload(self) -> bool:
        return True

    def setup(self, trainer: pl.Trainer, pl_module: Federation, stage: str) -> None:
        """Refuse a ``num_classes`` other than the datamodule's, or, where it does not know its
        classes, not above its largest label: the flipped labels would not be the data's classes,
        and the run would fail only once a Byzantine client is sampled."""
        if stage != "fit":
            return
        dm = pl_module.engine.datamodule
        if not dm.has_class_labels:
            raise ValueError(f"LabelFlipAttack flips class labels, but {type(dm).__name__}'s targets are "
                             f"{targets_in_words(dm.describe_targets())}, not class labels: choose another attack")
        if dm.num_classes is not None:
            if dm.num_classes == self.num_classes:
                return
            found, wanted = f"{type(dm).__name__} has num_classes={dm.num_classes}", dm.num_classes
        else:
            largest = int(dm.pool_targets.max())
            if self.num_classes > largest:
                return
            found, wanted = f"{type(dm).__name__}'s labels reach {largest}", largest + 1
        raise ValueError(f"LabelFlipAttack(num_classes={self.num_classes}) flips a label y to "
                         f"{self.num_classes - 1} - y, but {found}: the flipped labels would not be its classes; "
                         f"give num_classes={wanted}")

    def on_client_update(self, trainer: pl.Trainer, module: Federation, update: ClientUpdate) -> ClientUpdate:
        return update

    def on_local_batch(self, trainer: pl.Trainer, module: Federation, client_id: int, batch: Any) -> Any:
        if not self.is_byzantine(client_id):
            return batch
        if isinstance(batch, Mapping):  # dict samples: the labels under the datamodule's label_column
            key = module.engine.datamodule.label_column
            return {**batch, key: flip_labels(batch[key], self.num_classes)}
        return (batch[0], flip_labels(batch[1], self.num_classes), *batch[2:])

