"""``SyntheticFederated``: the Synthetic(alpha, beta) benchmark of FedProx (Li et al., 2020).

Generated, no download. Client k draws ``u_k ~ N(0, alpha)``, ``B_k ~ N(0, beta)``; its
softmax-regression labeler ``W_k ~ N(u_k, 1)`` (10 x 60), ``b_k ~ N(u_k, 1)``; its inputs
``x ~ N(v_k, Sigma)`` with ``v_k ~ N(B_k, 1)`` per coordinate and ``Sigma = diag(j^-1.2)``;
labels ``y = argmax(W_k x + b_k)``. ``alpha`` controls how much the labelers differ,
``beta`` how much the inputs differ. ``iid=True`` gives one shared labeler and
``v_k = 0`` for all clients. Client sizes follow a lognormal power law (``lognormal(4, 2) +
min_samples``, capped). Each client is one ``natural`` partition; its test split is a
``test_fraction`` of its own samples.
"""

from __future__ import annotations

import os
from typing import Any, Optional, Sequence

import numpy as np
import torch
from torch.utils.data import Dataset, TensorDataset

from fl_lightning.datamodules.base import FederatedDataModule
from fl_lightning.datamodules.partitioners import NaturalIdPartitioner, Partitioner
from fl_lightning.validation import check_int, check_number


def check_synthetic(alpha: float, beta: float, dim: int, num_classes: int, min_samples: int, max_samples: int) -> None:
    """Refuse Synthetic(alpha, beta) arguments that generate no (or meaningless) data."""
    if not (isinstance(alpha, (int, float)) and isinstance(beta, (int, float)) and alpha >= 0 and beta >= 0):
        raise ValueError(f"alpha and beta must be >= 0, got alpha={alpha!r}, beta={beta!r}")
    check_number("alpha", alpha, 0.0)
    check_number("beta", beta, 0.0)
    check_int("dim", dim, 1)
    check_int("num_classes", num_classes, 2)
    check_int("min_samples", min_samples, 1)
    check_int("max_samples", max_samples, 1)
    if max_samples < min_samples:
        raise ValueError(f"max_samples must be >= min_samples, got min_samples={min_samples}, "
                         f"max_samples={max_samples}")


def synthetic_clients(
    num_clients: int,
    alpha: float,
    beta: float,
    iid: bool = False,
    dim: int = 60,
    num_classes: int = 10,
    min_samples: int = 50,
    max_samples: int = 2000,
    seed: int = 0,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Generate (inputs [N, dim], labels [N], client of each sample [N])."""
    check_int("num_clients", num_clients, 1)
    check_synthetic(alpha, beta, dim, num_classes, min_samples, max_samples)
    rng = np.random.default_rng(seed)
    sizes = np.minimum(rng.lognormal(4, 2, num_clients).astype(int) + min_samples, max_samples)
    sigma = np.array([(j + 1) ** -1.2 for j in range(dim)])
    shared_w, shared_b = rng.normal(0, 1, (num_classes, dim)), rng.normal(0, 1, num_classes)
    xs, ys, owner = [], [], []
    for k, n in enumerate(sizes):
        if iid:
            w, b, v = shared_w, shared_b, np.zeros(dim)
        else:
            u, bk = rng.normal(0, np.sqrt(alpha)), rng.normal(0, np.sqrt(beta))
            w, b = rng.normal(u, 1, (num_classes, dim)), rng.normal(u, 1, num_classes)
            v = rng.normal(bk, 1, dim)
        x = rng.normal(v, np.sqrt(sigma), (n, dim))
        xs.append(x)
        ys.append(np.argmax(x @ w.T + b, axis=1))
        owner.append(np.full(n, k))
    return np.concatenate(xs).astype(np.float32), np.concatenate(ys), np.concatenate(owner)


class SyntheticFederated(FederatedDataModule):
    """Synthetic(alpha, beta) clients; the default dataset of the quickstart.

    Args:
        alpha: spread of the clients' labelers (0 = same mean).
        beta: spread of the clients' input distributions.
        iid: one labeler and input distribution for all clients (Synthetic-IID).
        dim: input dimension (60 in FedProx).
        num_classes: number of classes (10 in FedProx).
        min_samples: smallest client size before the power law adds to it.
        max_samples: cap on a client's size (>= ``min_samples``).
        test_fraction: each client's held-out test share (FedProx uses 0.2).
        **kwargs: the ``FederatedDataModule`` arguments (``num_clients``, ``batch_size``, ``seed``...).
    """

    def __init__(
        self,
        alpha: float = 1.0,
        beta: float = 1.0,
        iid: bool = False,
        dim: int = 60,
        num_classes: int = 10,
        min_samples: int = 50,
        max_samples: int = 2000,
        num_clients: int = 30,
        test_fraction: float = 0.2,
        **kwargs: Any,
    ) -> None:
        super().__init__(num_clients=num_clients, test_fraction=test_fraction, **kwargs)
        check_synthetic(alpha, beta, dim, num_classes, min_samples, max_samples)
        check_int("num_clients", num_clients, 1)
        needed = num_clients * min_samples * (dim + 2) * 4  # bytes of the smallest possible data
        memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") if hasattr(os, "sysconf") else None
        if memory is not None and needed > memory:
            raise ValueError(f"num_clients={num_clients} needs at least {needed / 2**30:.1f} GiB of data "
                             f"(min_samples={min_samples} samples of dim={dim} each); this machine has "
                             f"{memory / 2**30:.1f} GiB")
        self.synthetic = dict(alpha=alpha, beta=beta, iid=iid, dim=dim, num_classes=num_classes,
                              min_samples=min_samples, max_samples=max_samples)
        self.num_classes = num_classes
        self._owner: Optional[np.ndarray] = None

    def build_datasets(self) -> tuple[Dataset, Optional[Dataset]]:
        x, y, owner = synthetic_clients(self.num_clients, seed=self.seed, **self.synthetic)
        self._owner = owner
        return TensorDataset(torch.from_numpy(x), torch.from_numpy(y).long()), None

    def default_partitioner(self) -> Partitioner:
        """One client per generated client (``NaturalIdPartitioner()``)."""
        return NaturalIdPartitioner()

    def partition_keys(self) -> Sequence:
        assert self._owner is not None
        return self._owner
