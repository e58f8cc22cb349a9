"""Personalized evaluation on local test sets drawn from the global test set.

FedDeper's paper (and most label-skew studies) evaluates client ``i`` on the test samples of
the labels client ``i`` holds in training, not on a held-out part of its own training data.
:func:`local_test_indices` builds these local test sets (each class's test samples are cut
into contiguous pieces among the clients holding that class, in proportion to their training
counts of it: for the sorted one-class split this is "the test digits of my digit");
:func:`add_extra_classes` adds ``k`` classes the client does not hold (the paper's Fig. 5b).

:class:`PersonalizedAccuracy` evaluates, after each validation, every training client's own
model (``FederatedModule.client_eval_state``) and the global model on its local test set and
logs the mean and the worst client accuracy of each.
"""

from __future__ import annotations

from typing import Optional

import numpy as np
import torch

from fl_lightning.callbacks.accuracy import check_accuracy_data, client_accuracy
from fl_lightning.datamodules.client_data import ClientData
from fl_lightning.distributed import map_clients
from fl_lightning.hooks import FederatedCallback, Federation
from fl_lightning.lightning_compat import log_agreed
from fl_lightning.lightning_package import pl
from fl_lightning.seeding import derive_seed
from fl_lightning.validation import check_int


def local_test_indices(train_labels: list[np.ndarray], test_labels: np.ndarray) -> list[np.ndarray]:
    """Each client's local test set: indices into ``test_labels`` following its training labels.

    For each class ``c``, the test samples of ``c`` (in index order) are cut into contiguous
    pieces, one per client holding ``c`` in training, sized in proportion to the clients'
    training counts of ``c``. A class no client holds is left out.
    """
    test_labels = np.asarray(test_labels)
    num_classes = int(max([test_labels.max(initial=-1)] + [int(np.max(t, initial=-1)) for t in train_labels])) + 1
    counts = np.stack([np.bincount(np.asarray(t, dtype=np.int64), minlength=num_classes) for t in train_labels])
    parts: list[list[np.ndarray]] = [[] for _ in train_labels]
    for c in range(num_classes):
        held = counts[:, c]
        if held.sum() == 0:
            continue
        idx = np.flatnonzero(test_labels == c)
        ends = np.round(np.cumsum(held) / held.sum() * len(idx)).astype(int)
        starts = np.concatenate([[0], ends[:-1]])
        for client in np.flatnonzero(held):
            parts[client].append(idx[starts[client] : ends[client]])
    return [np.sort(np.concatenate(p)) if p else np.array([], dtype=np.int64) for p in parts]


def add_extra_classes(local: np.ndarray, test_labels: np.ndarray, k: int, rng: np.random.Generator) -> np.ndarray:
    """``local`` plus test samples of ``k`` random classes absent from it.

    Each extra class brings as many samples as the largest class of ``local`` has (the
    client's "own class"), drawn without replacement from the test samples of that class.
    """
    test_labels = np.asarray(test_labels)
    if k == 0 or len(local) == 0:
        return local
    own, own_counts = np.unique(test_labels[local], return_counts=True)
    candidates = np.setdiff1d(np.unique(test_labels), own)
    if k > len(candidates):
        raise ValueError(f"extra_classes={k} but only {len(candidates)} classes are absent from the local test set")
    per_class = int(own_counts.max())
    extra = []
    for c in rng.choice(candidates, size=k, replace=False):
        pool = np.flatnonzero(test_labels == c)
        extra.append(rng.choice(pool, size=min(per_class, len(pool)), replace=False))
    return np.sort(np.concatenate([local, *extra]))


class PersonalizedAccuracy(FederatedCallback):
    """Log, after each validation, the personal and the global model's accuracy on local test sets.

    Logged (``<prefix>`` is ``local`` or ``local+<k>``): ``<prefix>/personal_acc_mean``,
    ``<prefix>/personal_acc_worst`` (each client's ``client_eval_state``, for personalized
    algorithms only) and ``<prefix>/global_acc_mean``, ``<prefix>/global_acc_worst`` (the
    global model). Clients are divided over processes and the results gathered.

    Args:
        extra_classes: classes the client does not hold added to its local test set (Fig. 5b).
        seed: seed of the extra classes' draw (per client, from ``(seed, "extra_classes", client)``).
        prefix: metric name prefix (default ``local``, or ``local+<extra_classes>``).
    """

    def __init__(self, extra_classes: int = 0, seed: int = 0, prefix: Optional[str] = None) -> None:
        self.extra_classes = check_int("extra_classes", extra_classes, 0)
        self.seed = check_int("seed", seed, 0)
        self.prefix = prefix or ("local" if extra_classes == 0 else f"local+{extra_classes}")
        self._local: Optional[list[np.ndarray]] = None

    def local_sets(self, module: Federation) -> list[np.ndarray]:
        """Every client's local test set (indices into the global test set), built once."""
        if self._local is None:
            dm = module.engine.datamodule
            pool_labels = dm.pool_targets
            test_labels = dm.targets_of(dm.global_test_set())
            local = local_test_indices([pool_labels[idx] for idx in dm.splits["train"]], test_labels)
            rngs = [np.random.default_rng(derive_seed(self.seed, "extra_classes", c)) for c in range(len(local))]
            self._local = [add_extra_classes(idx, test_labels, self.extra_classes, rng) for idx, rng in zip(local, rngs)]
        return self._local

    def setup(self, trainer: pl.Trainer, pl_module: Federation, stage: str) -> None:
        check_accuracy_data(pl_module, type(self).__name__)
        self._local = None
        self.local_sets(pl_module)  # the datamodule is set up by now; a bad extra_classes fails here

    def evaluate(self, module: Federation) -> dict[int, tuple[float, Optional[float]]]:
        """``{client: (global accuracy, personal accuracy or None)}`` over the training clients."""
        dm = module.engine.datamodule
        test_set = dm.global_test_set()
        local = self.local_sets(module)

        def accuracies(cid: int) -> Optional[tuple[float, Optional[float]]]:
            if len(local[cid]) == 0:
                return None
            data = ClientData(test_set, local[cid], dm.eval_batch_size)
            glob = client_accuracy(module, cid, data, personalized=False)
            personal = client_accuracy(module, cid, data) if module.client_eval_state(cid) is not None else None
            return glob, personal

        return map_clients(accuracies, list(dm.train_clients))

    def on_validation_epoch_end(self, trainer: pl.Trainer, pl_module: Federation) -> None:
        if trainer.sanity_checking:
            return
        results = self.evaluate(pl_module)
        if not results:
            return
        ordered = [results[c] for c in sorted(results)]
        columns = {"global": [g for g, _ in ordered], "personal": [p for _, p in ordered if p is not None]}
        for name, values in columns.items():
            if values:
                acc = torch.tensor(values, dtype=torch.float64)
                log_agreed(pl_module, f"{self.prefix}/{name}_acc_mean", float(acc.mean()), batch_size=1)
                log_agreed(pl_module, f"{self.prefix}/{name}_acc_worst", float(acc.min()), batch_size=1)
