"""PeFLL-predict (Algorithm 1 of Scott et al., ICLR 2024): a trained PeFLL + a client's data ->
the client's personalized model, with no finetuning.

::

    server -> client   the embedding network phi
    client             v = mean of phi(x, y) over its data (no gradient)
    client -> server   v
    server             theta = h((v - m) / s)                 one forward pass
    server -> client   theta

It works the same for a client that took part in training and for one that never did; with
an embedding network trained without labels (``use_labels=False``) the client's labels may be
hidden. Label masking (the paper's App. A.3) gives probability 0 to the classes the client
does not hold: :func:`mask_absent_classes`.

::

    from fl_lightning.predict import load_pefll, personalize
    model = personalize(load_pefll("last.ckpt"), (x, y))  # a client module (checkpoint of fl-lightning fit)
    model = personalize(load_pefll("last.ckpt", embedding=embedding), (x, y))  # of Trainer.fit in Python
    logits = model(x_new)
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any, Iterator, Optional, Sequence, Union

import torch
from torch import Tensor
from torch.utils.data import DataLoader, Dataset

from fl_lightning.algorithms.pefll import PeFLL
from fl_lightning.checkpoints import load_checkpoint
from fl_lightning.datamodules.base import FederatedDataModule
from fl_lightning.lightning_package import pl
from fl_lightning.vectors import ModelVector

ClientInput = Union[Dataset, tuple[Tensor, Tensor], Tensor]


def _batches(data: ClientInput, batch_size: int, labels_hidden: bool) -> Iterator[tuple[Tensor, Optional[Tensor]]]:
    """``(x, y)`` batches of the client's data (``y=None`` when labels are hidden or absent)."""
    if isinstance(data, Tensor):
        chunks: Any = ((x, None) for x in data.split(batch_size))
    elif isinstance(data, tuple):
        if len(data) != 2:
            raise ValueError(f"data as a tuple must be (x, y), got a tuple of {len(data)}")
        x_all, y_all = data
        chunks = zip(x_all.split(batch_size), y_all.split(batch_size))
    elif isinstance(data, Dataset):
        chunks = (tuple(b[:2]) for b in DataLoader(data, batch_size=batch_size))
    else:
        raise ValueError(f"data must be a Dataset, an (x, y) tuple or an x tensor, got {type(data).__name__}")
    for x, y in chunks:
        yield x, (None if labels_hidden else y)


def client_descriptor(model: PeFLL, data: ClientInput, labels_hidden: bool = False, batch_size: int = 512) -> Tensor:
    """The client's descriptor (hypernetwork input) from all its samples: Algorithm 1, lines 1-4.

    Raises:
        ValueError: labels are hidden (or ``data`` is an unlabelled tensor) but the embedding
            network reads labels.
    """
    unlabelled = labels_hidden or isinstance(data, Tensor)
    if unlabelled and model.uses_labels:
        raise ValueError(
            "labels_hidden=True (or unlabelled data) needs a PeFLL whose embedding network was built with "
            "use_labels=False; this one reads labels"
        )
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    was_training = model.training
    model.eval()
    try:
        return model.descriptor(_batches(data, batch_size, unlabelled))
    finally:
        model.train(was_training)


def personalize(model: PeFLL, data: ClientInput, labels_hidden: bool = False, batch_size: int = 512) -> pl.LightningModule:
    """PeFLL-predict: a copy of the client module holding the client's generated parameters.

    No optimizer step, no backward pass: one embedding pass over ``data`` and one hypernetwork
    forward pass.

    Args:
        model: a trained ``PeFLL`` (see :func:`load_pefll`).
        data: the client's samples: a ``Dataset`` of ``(x, y)``, an ``(x, y)`` tuple of tensors,
            or an ``x`` tensor alone (unlabelled; needs a label-free embedding).
        labels_hidden: ignore the labels of ``data`` (needs a label-free embedding).
        batch_size: samples per embedding forward pass.

    Returns:
        the personalized client ``LightningModule`` (in eval mode, on the model's device).
    """
    theta = model.generate(client_descriptor(model, data, labels_hidden, batch_size))
    personal = copy.deepcopy(model.client)
    ModelVector(personal).load(theta.to(next(personal.parameters()).device))
    return personal.eval()


def mask_absent_classes(logits: Tensor, present: Tensor) -> Tensor:
    """Label masking: logits of the classes not in ``present`` (class indices) set to ``-inf``."""
    keep = torch.zeros(logits.shape[-1], dtype=torch.bool, device=logits.device)
    keep[present.to(logits.device).long()] = True
    return logits.masked_fill(~keep, float("-inf"))


def load_pefll(checkpoint_path: Union[str, Path], map_location: Any = "cpu", allow_unverified: bool = False,
               **overrides: Any) -> PeFLL:
    """A ``PeFLL`` restored from a Lightning checkpoint (``fl-lightning fit`` or ``Trainer.fit``),
    in eval mode.

    The checkpoint holds tensors and plain hyper-parameters only (it is read with
    ``weights_only=True``: loading it runs no code). The client module is rebuilt from the class
    and hyper-parameters the checkpoint records; the embedding network from its ``class_path`` and
    ``init_args`` when ``fl-lightning fit`` wrote the checkpoint (its configuration is in the
    hyper-parameters). A checkpoint of ``Trainer.fit`` in Python holds no recipe of the embedding:
    pass ``embedding=``. See :meth:`FederatedModule.load_from_checkpoint` for the classes a
    checkpoint may name.

    Args:
        checkpoint_path: the ``.ckpt`` file.
        map_location: where to load the tensors.
        allow_unverified: accept a checkpoint without a checksum (one you trust; see
            :func:`~fl_lightning.checkpoints.load_checkpoint`).
        **overrides: constructor arguments in place of the checkpoint's: ``embedding`` (the
            embedding network, built as for training), ``client`` (the client module, for one that
            cannot be rebuilt from its hyper-parameters), ``allowed_classes``.

    Raises:
        ValueError: the checkpoint holds no embedding network's recipe and ``embedding`` is not given.
    """
    if "embedding" not in overrides:
        hparams = load_checkpoint(checkpoint_path, map_location, name="checkpoint_path",
                                  allow_unverified=allow_unverified).get("hyper_parameters", {})
        if not isinstance(hparams.get("embedding"), dict):
            raise ValueError(
                f"checkpoint_path {str(checkpoint_path)!r} does not record the embedding network (a checkpoint of "
                "Trainer.fit in Python): pass embedding=<the embedding network, built as for training>"
            )
    return PeFLL.load_from_checkpoint(checkpoint_path, map_location=map_location, allow_unverified=allow_unverified,
                                      **overrides).eval()


def predict_clients(
    model: Union[PeFLL, str, Path],
    datamodule: FederatedDataModule,
    client_ids: Optional[Sequence[int]] = None,
    labels_hidden: bool = False,
    output_dir: Union[str, Path, None] = None,
    **overrides: Any,
) -> dict[int, pl.LightningModule]:
    """PeFLL-predict for clients of a datamodule (what ``fl-lightning pefll-predict`` runs).

    Each client's descriptor comes from its whole training split.

    Args:
        model: a trained ``PeFLL``, or the path of its checkpoint (see :func:`load_pefll`).
        datamodule: the federation the clients belong to (set up here if needed).
        client_ids: the clients to personalize (default: the unseen clients, else all).
        labels_hidden: the clients' labels are not used (needs a label-free embedding).
        output_dir: if given, each model's ``state_dict`` is saved as ``client_<id>.pt`` there.
        **overrides: passed to :func:`load_pefll` when ``model`` is a path.

    Returns:
        ``client id -> personalized client module``.
    """
    if not isinstance(model, PeFLL):
        model = load_pefll(model, **overrides)
    datamodule.setup("predict")
    ids = list(client_ids) if client_ids is not None else (datamodule.unseen_clients or list(range(datamodule.num_clients)))
    out = {}
    for cid in ids:
        out[cid] = personalize(model, datamodule.client_data(cid, "train").full(), labels_hidden=labels_hidden)
    if output_dir is not None:
        folder = Path(output_dir)
        folder.mkdir(parents=True, exist_ok=True)
        for cid, personal in out.items():
            torch.save(personal.state_dict(), folder / f"client_{cid}.pt")
    return out
