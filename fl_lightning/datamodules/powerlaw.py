"""FedProxVR's image partition: every client holds exactly two labels, with power-law sizes.

Client ``k`` holds labels ``k mod C, (k + 1) mod C, ...`` (``labels_per_client`` of them).
Each holder of a label first receives ``min_per_label`` of its samples; the rest of the label
is shared among its holders in proportions drawn from ``lognormal(0, sigma)``, which gives the
heavy-tailed client sizes of the paper (following the authors' data generator). The paper
(Dinh et al., 2020) pools the whole data set and gives every client a 75/25 train/test split;
the global test accuracy is then over the union of the clients' test splits.
"""

from __future__ import annotations

from typing import Any, Optional

import numpy as np
import torch
from torch.utils.data import Dataset, TensorDataset

from fl_lightning.datamodules.vision import FashionMNISTFederated, MNISTFederated


def two_label_power_law(
    labels: np.ndarray,
    num_clients: int,
    labels_per_client: int = 2,
    min_per_label: int = 10,
    sigma: float = 2.0,
    used_fraction: float = 1.0,
    seed: int = 0,
) -> list[np.ndarray]:
    """Partition sample indices so that client ``k`` holds labels ``(k + j) mod C``, ``j < labels_per_client``.

    Args:
        labels: integer label of every sample.
        num_clients: number of clients.
        labels_per_client: distinct labels per client (2 in the paper).
        min_per_label: samples of each of its labels every client receives before the power law.
        sigma: the lognormal shape of the shares (larger = more unequal sizes).
        used_fraction: fraction of each label's samples handed out (the rest is unused), to
            match the paper's smaller client sizes or to shrink an experiment.
        seed: seed of the shuffle and the shares.

    Returns:
        one sorted index array per client.
    """
    labels = np.asarray(labels)
    classes = np.unique(labels)
    if num_clients < 1:
        raise ValueError(f"num_clients must be >= 1, got {num_clients}")
    if not 1 <= labels_per_client <= len(classes):
        raise ValueError(f"labels_per_client must be in [1, {len(classes)}], got {labels_per_client}")
    if min_per_label < 1:
        raise ValueError(f"min_per_label must be >= 1, got {min_per_label}")
    if not sigma >= 0:
        raise ValueError(f"sigma must be >= 0, got {sigma}")
    if not 0 < used_fraction <= 1:
        raise ValueError(f"used_fraction must be in (0, 1], got {used_fraction}")
    rng = np.random.default_rng(seed)
    holders: dict[int, list[int]] = {int(c): [] for c in classes}
    for k in range(num_clients):
        for j in range(labels_per_client):
            holders[int(classes[(k + j) % len(classes)])].append(k)
    parts: list[list[np.ndarray]] = [[] for _ in range(num_clients)]
    for c, owners in holders.items():
        if not owners:
            continue
        idx = rng.permutation(np.flatnonzero(labels == c))
        idx = idx[: int(round(used_fraction * len(idx)))]
        if len(idx) < min_per_label * len(owners):
            raise ValueError(
                f"label {c} has {len(idx)} samples (used_fraction={used_fraction}), fewer than "
                f"min_per_label={min_per_label} x {len(owners)} clients holding it"
            )
        base, rest = idx[: min_per_label * len(owners)], idx[min_per_label * len(owners):]
        shares = rng.lognormal(0.0, sigma, len(owners))
        cuts = (np.cumsum(shares)[:-1] / shares.sum() * len(rest)).astype(int)
        for i, (owner, extra) in enumerate(zip(owners, np.split(rest, cuts))):
            parts[owner] += [base[i * min_per_label : (i + 1) * min_per_label], extra]
    return [np.sort(np.concatenate(p)) for p in parts]


class TwoLabelPowerLaw:
    """Datamodule mixin: :func:`two_label_power_law` clients over the pooled train + test images.

    Put it before a ``TorchvisionFederated`` subclass. Use ``test_fraction=0.25`` for the
    paper's 75/25 per-client split.

    Args:
        labels_per_client, min_per_label, sigma, used_fraction: see :func:`two_label_power_law`.
        **kwargs: the datamodule's arguments (``partition`` is replaced by this rule).
    """

    def __init__(
        self,
        labels_per_client: int = 2,
        min_per_label: int = 10,
        sigma: float = 2.0,
        used_fraction: float = 1.0,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)  # type: ignore[call-arg]
        self.power_law = dict(labels_per_client=labels_per_client, min_per_label=min_per_label, sigma=sigma,
                              used_fraction=used_fraction)
        self.partition = "two_label_power_law"

    def build_datasets(self) -> tuple[Dataset, Optional[Dataset]]:
        train, test = super().build_datasets()  # type: ignore[misc]
        pooled = TensorDataset(*(torch.cat([a, b]) for a, b in zip(train.tensors, test.tensors)))
        return pooled, None

    def _partition(self, labels: np.ndarray) -> list[np.ndarray]:
        return two_label_power_law(labels, self.num_clients, seed=self.seed, **self.power_law)  # type: ignore[attr-defined]


class PowerLawMNIST(TwoLabelPowerLaw, MNISTFederated):
    """MNIST (70,000 images pooled) over clients with two labels each and power-law sizes."""


class PowerLawFashionMNIST(TwoLabelPowerLaw, FashionMNISTFederated):
    """Fashion-MNIST (70,000 images pooled) over clients with two labels each and power-law sizes."""
