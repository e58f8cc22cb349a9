"""What the engine checks of the client module against the data once at setup, before any round.

* :func:`check_classes`: a bundled classifier (:class:`~fl_lightning.models.Classifier`) scores as
  many classes as a datamodule that knows its classes holds;
* :func:`check_client_takes_data`: the client's ``training_step`` runs on one real batch (the first
  samples of the largest training client and the samples of the smallest and largest label, in the
  setup's trial: :mod:`fl_lightning.backends.trial`); where it fails (inputs of another size than
  the model's, labels outside its classes or of another type), the error says what the batch
  holds, what the model's first and last layers expect, and the way out, in place of a traceback
  deep in torch that a client would reach at its first step. It checks any client, whatever its
  task: a regression client's float targets are what its own loss takes.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

from fl_lightning.backends.context import ClientContext
from fl_lightning.backends.trial import largest_client, trial_setting
from fl_lightning.lightning_package import pl
from fl_lightning.models.classifier import Classifier

#: the errors of a step whose inputs do not fit the model (shapes, dtypes, indices), which the check explains
STEP_ERRORS = (RuntimeError, IndexError, TypeError, ValueError)


def check_classes(client: pl.LightningModule, datamodule: Any) -> None:
    """Refuse a bundled classifier whose ``num_classes`` differs from the datamodule's, where the
    datamodule knows its classes (``FederatedDataModule.num_classes``)."""
    known = getattr(datamodule, "num_classes", None)
    scored = client.hparams.get("num_classes") if isinstance(client, Classifier) else None
    if known is not None and scored is not None and scored != known:
        raise ValueError(f"the client {type(client).__name__} scores num_classes={scored} classes, but "
                         f"{type(datamodule).__name__} has num_classes={known}: give the model num_classes={known}")


def describe_tensor(tensor: Tensor, with_values: bool) -> str:
    """A tensor in words: its shape and dtype and, ``with_values``, the range of its values."""
    words = f"shape {list(tensor.shape)} ({str(tensor.dtype).removeprefix('torch.')}"
    if with_values and tensor.numel():
        words += f", values in [{tensor.min().item():g}, {tensor.max().item():g}]"
    return words + ")"


def describe_batch(batch: Any) -> str:
    """What a batch holds, in words: each tensor's shape and dtype, and the values of the targets
    (the second tensor of a tuple or list, a ``"target"``/``"label"``/``"y"`` entry of a dict)."""
    if isinstance(batch, Tensor):
        return f"a tensor of {describe_tensor(batch, False)}"
    if isinstance(batch, Mapping):
        targets = {"target", "targets", "label", "labels", "y"}
        return ", ".join(f"{key!r}: {describe_tensor(value, key in targets)}" for key, value in batch.items()
                         if isinstance(value, Tensor))
    if isinstance(batch, (tuple, list)) and all(isinstance(t, Tensor) for t in batch):
        names = ["inputs", "targets", *(f"tensor {i}" for i in range(2, len(batch)))]
        return ", ".join(f"{name} of {describe_tensor(t, i == 1)}" for i, (name, t) in enumerate(zip(names, batch)))
    return f"a {type(batch).__name__}"


def describe_model(client: nn.Module) -> str:
    """The client's first and last layers that hold parameters (what its inputs and its outputs
    must fit), in words; empty where it holds none."""
    layers = [(name, m) for name, m in client.named_modules() if next(m.parameters(recurse=False), None) is not None]
    if not layers:
        return ""
    (first_name, first), (last_name, last) = layers[0], layers[-1]
    if first is last:
        return f"its one layer ({first_name}) is {first!r}"
    return f"its first layer ({first_name}) is {first!r} and its last ({last_name}) is {last!r}"


def first_line(error: BaseException) -> str:
    """The first line of an error's message (CUDA errors add lines of advice)."""
    return next(iter(str(error).splitlines()), "")


def extreme_samples(labels: np.ndarray) -> list[int]:
    """The samples that hold the smallest and the largest of the pool's ``labels`` (where the labels
    are numbers, one per sample; none otherwise): a trial that takes them meets the whole range of labels."""
    if labels.ndim != 1 or not len(labels) or not np.issubdtype(labels.dtype, np.number):
        return []
    return list(dict.fromkeys([int(labels.argmin()), int(labels.argmax())]))


def check_client_takes_data(context: ClientContext) -> None:
    """Run the client's ``training_step`` once (in the setup's trial, which leaves no trace) on a
    batch of a local step's size: the largest training client's first samples, the last of them
    replaced by the pool's samples of the smallest and largest label (:func:`extreme_samples`). Nothing
    is tried where that client's data are not here (``holds_data``: a deployment's server, which reads
    only its clients' index).

    Raises:
        ValueError: the step fails with one of :data:`STEP_ERRORS` (chained): the message names
            what the batch holds and what the model expects. Other errors pass unchanged; the
            step's result is not read (the engine checks the loss at the first step).
    """
    data = context.algorithm.engine.datamodule
    client_id = largest_client(data)
    if client_id is None or not data.holds_data(client_id):  # (a deployment's server: the data are on the nodes)
        return
    split = data.client_data(client_id, "train")
    indices = split.indices[:split.step_batch_size].clone()
    extremes = extreme_samples(data.pool_targets)[:len(indices)]
    if extremes:
        indices[len(indices) - len(extremes):] = torch.tensor(extremes, dtype=indices.dtype)
    with trial_setting(context) as tensors:
        batch = context.gather(indices)
        try:
            context.stateless.training_step(tensors, batch, 0)
        except STEP_ERRORS as error:
            model = describe_model(context.client)
            raise ValueError(
                f"the client module {type(context.client).__name__} cannot take the data of {type(data).__name__}: "
                f"its training_step fails on a batch of client {client_id}'s first samples"
                f"{' and the samples of the smallest and largest label' if extremes else ''}, holding "
                f"{describe_batch(batch)}{'; ' + model if model else ''}. Make the model's input size fit the inputs "
                "and its outputs the targets (a classifier's labels are integer class indices in [0, number of "
                f"outputs)), or fix the data. The step raised {type(error).__name__}: {first_line(error)}"
            ) from error
