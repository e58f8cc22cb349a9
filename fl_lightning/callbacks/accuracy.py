"""Classification accuracy of the engine's models on a client's data, for the metric callbacks.

The client module's output is read as logits (the predicted class: its argmax), so these
functions are for classification; the engine itself knows nothing of accuracy.
"""

from __future__ import annotations

from typing import Hashable, Mapping, Optional, TypeVar

import torch
from lightning_fabric.utilities.apply_func import move_data_to_device
from torch import Tensor

from fl_lightning.datamodules.client_data import ClientData
from fl_lightning.hooks import Federation

K = TypeVar("K", bound=Hashable)


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
        for x, y in split.epoch_batches(1, batch_size=module.datamodule.eval_batch_size):
            logits = module.client(move_data_to_device(x, module.device))
            correct += (logits.argmax(-1) == move_data_to_device(y, logits.device)).sum()
        counts[key] = (correct, max(len(split), 1))
    accuracies = {key: int(correct) / size for key, (correct, size) in counts.items()}
    module.client.train(was_training)
    if saved is not None:
        module.global_model.load(saved)
    return accuracies
