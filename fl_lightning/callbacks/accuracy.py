"""Classification accuracy of the engine's models on a client's data, for the metric callbacks.

The client module's output is read as logits (the predicted class: its argmax), so these
functions are for classification; the engine itself knows nothing of accuracy. A callback that
measures accuracy refuses, at setup, data that has none (:func:`check_accuracy_data`): targets
that are not class labels (a regression's), or samples that are not ``(inputs, label, ...)``.
"""

from __future__ import annotations

from typing import Any, Hashable, Mapping, Optional, TypeVar

import torch
from torch import Tensor

from fl_lightning.datamodules.client_data import ClientData
from fl_lightning.datamodules.targets import targets_in_words
from fl_lightning.hooks import Federation
from fl_lightning.lightning_package import move_data_to_device
from fl_lightning.seeding import keyed_rng

K = TypeVar("K", bound=Hashable)


def check_accuracy_data(module: Federation, who: str) -> None:
    """Refuse, for the callback ``who``, a datamodule whose accuracy cannot be measured: targets that
    are not class labels, or samples that are not a tuple or list ``(inputs, label, ...)`` (one
    training sample of a client is read to know, under a fixed RNG: nothing else draws differently).

    Raises:
        ValueError: naming the targets or the samples, and FederatedEvaluation, which takes any.
    """
    dm = module.engine.datamodule
    instead = ("evaluate the clients with FederatedEvaluation, which logs your module's own metrics (its "
               "validation_step's self.log calls, an MSE say) per client")
    if not dm.has_class_labels:
        raise ValueError(f"{who} measures accuracy (the argmax of the client's outputs against class labels), but "
                         f"{type(dm).__name__}'s targets are {targets_in_words(dm.describe_targets())}, not class "
                         f"labels: {instead}")
    with keyed_rng(0, "accuracy data"):
        batch = dm.client_data(dm.train_clients[0]).fetch(torch.zeros(1, dtype=torch.long))
    if not (isinstance(batch, (tuple, list)) and len(batch) >= 2):
        form = f"dicts with keys {list(batch)}" if isinstance(batch, Mapping) else f"of type {type(batch).__name__}"
        raise ValueError(f"{who} reads a batch as (inputs, labels, ...), but {type(dm).__name__}'s samples are {form}: "
                         f"{instead}")


def inputs_and_labels(batch: Any) -> tuple[Any, Tensor]:
    """The inputs and the labels of a batch ``(inputs, labels, ...)`` (:func:`check_accuracy_data`)."""
    return batch[0], batch[1]


def client_accuracy(module: Federation, client_id: int, data: ClientData, personalized: bool = True) -> float:
    """Accuracy on ``data`` of client ``client_id``'s model (``module.client_eval_state``), or
    of the global model if ``personalized`` is False."""
    return accuracy_of(module, module.client_eval_state(client_id) if personalized else None, data)


def accuracy_of(module: Federation, state: Optional[Tensor], data: ClientData) -> float:
    """Accuracy on ``data`` of the model ``state`` (None: the global model); the client module's
    output is read as logits (:func:`accuracies_of` for one piece of data)."""
    return accuracies_of(module, state, {None: data})[None]


@torch.no_grad()
def accuracies_of(module: Federation, state: Optional[Tensor], data: Mapping[K, ClientData]) -> dict[K, float]:
    """Accuracy of the model ``state`` (None: the global model) on each of ``data``'s values (a
    client's splits, say), under their keys. ``state`` is loaded into ``module.global_model`` once
    for all of them and the global model restored afterwards; the client module is left as it was."""
    saved = module.global_model.flatten() if state is not None else None
    if state is not None:
        module.global_model.load(state.to(module.device))
    was_training = module.client.training
    module.client.eval()
    counts = {}
    for key, split in data.items():  # the counts stay on the device: one read at the end, not one a batch
        correct = torch.zeros((), dtype=torch.long, device=module.device)
        for batch in split.epoch_batches(1, batch_size=module.engine.datamodule.eval_batch_size):
            x, y = inputs_and_labels(batch)
            logits = module.client(move_data_to_device(x, module.device))
            correct += (logits.argmax(-1) == move_data_to_device(y, logits.device)).sum()
        counts[key] = (correct, max(len(split), 1))
    accuracies = {key: int(correct) / size for key, (correct, size) in counts.items()}
    module.client.train(was_training)
    if saved is not None:
        module.global_model.load(saved)
    return accuracies
