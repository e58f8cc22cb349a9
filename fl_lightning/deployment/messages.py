"""What the server and a node say to each other, as Flower records.

A round's job for one client is a ``train`` message (:func:`job_content`, read back by :func:`read_job`):
the client, the round, the start model and the declared broadcast state (:class:`~flwr.app.ArrayRecord`),
the round's local settings, which stored version of the client's state to start from and, at the client's
first round, the default entries of its state. The node answers with the client's uploads, its sample
count, its metrics, the client module's ``self.log`` calls of its round (each step's value, as the server's
log buffer adds them: ``train_loss`` as in a simulation) and whether its new state is finite
(:func:`reply_content`, read back and checked by :func:`read_reply`), and the local differential privacy it
applied to the update before it left (:func:`local_privacy`: the server refuses an update without the
run's). Tensors travel as NumPy arrays: exactly their bits; a dtype NumPy lacks (``bfloat16``) as its
raw bits, the Array's dtype naming it (:func:`array`).

A ``query.clients`` message asks a node which clients it holds (:func:`clients_content`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping, Optional, Sequence

import numpy as np
import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, MetricRecord, RecordDict
from torch import Tensor

from fl_lightning.backends.client_round import LocalSettings
from fl_lightning.callbacks.privacy import DifferentialPrivacy
from fl_lightning.update import ClientUpdate, UpdateSpec

#: the message type of a client's round
TRAIN = "train"
#: the message type asking a node which clients it holds
CLIENTS_QUERY = "query.clients"
#: the state version of a client with no stored state (its entries are the defaults the job carries)
NO_STATE = -1


class ReplyError(ValueError):
    """A node's reply that cannot be part of the round (malformed, from another node or for another job)."""


#: how the ``dtype`` of an :class:`~flwr.app.Array` names a torch dtype NumPy lacks (``torch.bfloat16``): its
#: data are the tensor's raw bits as a NumPy array of signed integers of the same width
TORCH_DTYPE = "torch."
_BITS = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def array(tensor: Tensor) -> Array:
    """``tensor`` as an Array (a CPU NumPy copy: the same bits). A dtype NumPy lacks (``bfloat16``, the
    ``float8`` ones) travels as its raw bits, integers of its width, the Array's ``dtype`` naming the torch
    dtype (``torch.bfloat16``)."""
    tensor = tensor.detach().cpu()
    try:
        return Array(tensor.numpy())
    except TypeError:  # NumPy has no such dtype
        bits = Array(tensor.view(_BITS[tensor.element_size()]).numpy())
        return Array(f"{TORCH_DTYPE}{str(tensor.dtype).removeprefix('torch.')}", bits.shape, bits.stype, bits.data)


def tensor_of(value: Array) -> Tensor:
    """The tensor of an Array of :func:`array`.

    Raises:
        ValueError: a ``torch.`` dtype that is not one, or whose width is not the data's.
    """
    data = torch.from_numpy(np.array(value.numpy()))
    if not value.dtype.startswith(TORCH_DTYPE):
        return data
    dtype = getattr(torch, value.dtype.removeprefix(TORCH_DTYPE), None)
    if not isinstance(dtype, torch.dtype) or data.dtype != _BITS.get(dtype.itemsize):
        raise ValueError(f"an array of dtype {value.dtype!r} carries {data.dtype} data: the dtype must be a torch "
                         f"dtype and the data its raw bits as signed integers of its width")
    return data.view(dtype)


def arrays(tensors: Mapping[str, Tensor]) -> ArrayRecord:
    """``tensors`` as an ArrayRecord (:func:`array`: exactly their bits, whatever their dtype)."""
    return ArrayRecord({name: array(t) for name, t in tensors.items()})


def tensors_of(record: ArrayRecord) -> dict[str, Tensor]:
    """The tensors of an ArrayRecord of :func:`arrays`."""
    return {name: tensor_of(value) for name, value in record.items()}


@dataclass(frozen=True)
class Job:
    """One client's round as a node receives it.

    Attributes:
        client_id: the client.
        round_idx: the round.
        start: the start model (flat).
        broadcast: the algorithm's declared broadcast state.
        steps, epochs, lrs, precision: the round's local settings (:class:`LocalSettings` less the device).
        state_version: the stored version of the client's state to start from (:data:`NO_STATE`: none yet).
        defaults: the client's default state entries (sent with :data:`NO_STATE`).
        threads: the CPU intra-op threads of the server's fit, which the node's round runs with: the same
            arithmetic as the simulation's (the fit runs one thread for a small client,
            :mod:`fl_lightning.cpu_threads`; torch's reductions give other bits on more threads).
    """

    client_id: int
    round_idx: int
    start: Tensor
    broadcast: dict[str, Tensor]
    steps: Optional[int]
    epochs: Optional[int]
    lrs: list[float]
    precision: str
    state_version: int
    defaults: dict[str, Tensor] = field(default_factory=dict)
    threads: int = 1

    def settings(self, device: str) -> LocalSettings:
        """The round's local settings on ``device``."""
        return LocalSettings(self.steps, self.epochs, self.lrs, self.precision, device)


def job_content(job: Job) -> RecordDict:
    """The content of ``job``'s ``train`` message."""
    config = ConfigRecord({"client": job.client_id, "round": job.round_idx, "lrs": [float(lr) for lr in job.lrs],
                           "precision": job.precision, "state_version": job.state_version, "threads": job.threads})
    if job.steps is not None:
        config["steps"] = job.steps
    if job.epochs is not None:
        config["epochs"] = job.epochs
    return RecordDict({"job": config, "start": arrays({"start": job.start}), "broadcast": arrays(job.broadcast),
                       "defaults": arrays(job.defaults)})


def read_job(content: RecordDict) -> Job:
    """The job of a ``train`` message's content.

    Raises:
        ValueError: a record or a field is missing or of the wrong kind.
    """
    try:
        config = content.config_records["job"]
        start = tensors_of(content.array_records["start"])["start"]
        return Job(int(config["client"]), int(config["round"]), start, tensors_of(content.array_records["broadcast"]),
                   _optional_int(config.get("steps")), _optional_int(config.get("epochs")),
                   [float(lr) for lr in config["lrs"]], str(config["precision"]), int(config["state_version"]),
                   tensors_of(content.array_records["defaults"]), int(config["threads"]))
    except (KeyError, TypeError) as error:
        raise ValueError(f"a train message lacks its job's {error}") from error


def _optional_int(value: Any) -> Optional[int]:
    return None if value is None else int(value)


#: a client's ``self.log`` calls of its round: ``{name: (options, adds)}``, each add starting with a step's value
#: times its batch size and the batch size (:meth:`~fl_lightning.local_logging.LocalLogBuffer.parts`)
ClientLogs = Mapping[str, tuple[Mapping[str, Any], list[tuple[Any, ...]]]]


def local_privacy(callbacks: Iterable[object]) -> list[DifferentialPrivacy]:
    """The ``DifferentialPrivacy`` callbacks of ``callbacks`` in local mode: a deployment's nodes apply them."""
    return [cb for cb in callbacks if isinstance(cb, DifferentialPrivacy) and cb.mode == "local"]


def privacy_settings(callbacks: Sequence[DifferentialPrivacy]) -> list[float]:
    """What a reply says of the local differential privacy its node applied: each callback's clip norm and noise
    multiplier, in order."""
    return [float(value) for cb in callbacks for value in (cb.clip_norm, cb.noise_multiplier)]


def reply_content(round_idx: int, update: ClientUpdate, state_finite: bool, logs: ClientLogs,
                  privacy: Sequence[float] = ()) -> RecordDict:
    """The content of the reply to a client's job: its uploads, sample count, metrics (floats), its module's
    ``self.log`` calls (``logs``; of their options only those of plain values travel), whether the new
    state it stored is finite, and the local differential privacy the node applied to the uploads
    (:func:`privacy_settings`)."""
    metrics = MetricRecord({name: float(value) for name, value in update.metrics.items()})
    config = ConfigRecord({"client": update.client_id, "round": round_idx, "num_samples": update.num_samples,
                           "state_finite": state_finite, "privacy": [float(v) for v in privacy]})
    totals = {name: torch.stack([add[0].reshape(()).float().cpu() for add in adds]) for name, (_, adds) in
              logs.items()}
    weights = {name: torch.tensor([add[1] for add in adds], dtype=torch.int64) for name, (_, adds) in logs.items()}
    options = ConfigRecord({name: json.dumps({k: v for k, v in opts.items() if isinstance(v, (bool, int, float, str))
                                              and k != "reduce_fx"}) for name, (opts, _) in logs.items()})
    return RecordDict({"reply": config, "uploads": arrays(update.tensors), "metrics": metrics,
                       "log_totals": arrays(totals), "log_weights": arrays(weights), "log_options": options})


@dataclass(frozen=True)
class Reply:
    """A node's checked answer to a job: the client's update, its module's ``self.log`` calls and whether its
    new stored state is finite."""

    update: ClientUpdate
    state_finite: bool
    logs: dict[str, tuple[dict[str, Any], list[tuple[Tensor, int]]]] = field(default_factory=dict)


def read_reply(content: RecordDict, client_id: int, round_idx: int, specs: Mapping[str, UpdateSpec],
               num_samples: int, privacy: Sequence[float] = ()) -> Reply:
    """The reply to client ``client_id``'s job of round ``round_idx``, checked: it must name that client and
    round, carry the declared uploads (``specs``: names and sizes) as finite-or-not fp32 vectors and the
    client's sample count ``num_samples``, and say that its node applied the run's local differential privacy
    (``privacy``, :func:`privacy_settings`).

    Raises:
        ReplyError: anything else (it is never aggregated).
    """
    try:
        config = content.config_records["reply"]
        uploads = tensors_of(content.array_records["uploads"])
        metrics = dict(content.metric_records["metrics"])
        said = (int(config["client"]), int(config["round"]))
        samples, finite = int(config["num_samples"]), bool(config["state_finite"])
        applied = [float(v) for v in config["privacy"]]  # type: ignore[union-attr]
        logs = _read_logs(content)
    except (KeyError, TypeError, ValueError) as error:
        raise ReplyError(f"a malformed reply for client {client_id} in round {round_idx}: no {error}") from error
    if said != (client_id, round_idx):
        raise ReplyError(f"a reply for client {said[0]} in round {said[1]} came for the job of client {client_id} in "
                         f"round {round_idx}")
    if applied != list(privacy):
        raise ReplyError(f"the node of client {client_id} applied local differential privacy (clip norm, noise "
                         f"multiplier) {applied or 'none'}, the run's is {list(privacy) or 'none'}")
    if set(uploads) != set(specs):
        raise ReplyError(f"the reply of client {client_id} carries uploads {sorted(uploads)}, the declared ones are "
                         f"{sorted(specs)}")
    for name, spec in specs.items():
        value = uploads[name]
        if value.dtype != torch.float32 or value.dim() != 1 or value.numel() != spec.size:
            raise ReplyError(f"the reply of client {client_id}: upload {name!r} is {value.dtype} of shape "
                             f"{tuple(value.shape)}, declared float32 of shape ({spec.size},)")
    if samples != num_samples:
        raise ReplyError(f"the reply of client {client_id} counts {samples} training samples, the server "
                         f"{num_samples}")
    bad = [name for name, value in metrics.items() if not isinstance(value, (int, float))]
    if bad:
        raise ReplyError(f"the reply of client {client_id} has metrics that are not numbers: {bad}")
    return Reply(ClientUpdate(client_id, samples, uploads, {k: float(v) for k, v in metrics.items()}), finite, logs)


def _read_logs(content: RecordDict) -> dict[str, tuple[dict[str, Any], list[tuple[Tensor, int]]]]:
    """The ``self.log`` calls of a reply (:func:`reply_content`).

    Raises:
        KeyError, ValueError: a record is missing, or its names, kinds or lengths do not agree.
    """
    totals = tensors_of(content.array_records["log_totals"])
    weights = tensors_of(content.array_records["log_weights"])
    options = content.config_records["log_options"]
    if not set(totals) == set(weights) == set(options):
        raise ValueError(f"the same names in the logs' 'log_totals' {sorted(totals)}, 'log_weights' {sorted(weights)} "
                         f"and 'log_options' {sorted(options)}")
    logs = {}
    for name, total in totals.items():
        weight = weights[name]
        if (total.dtype, weight.dtype, total.dim()) != (torch.float32, torch.int64, 1) or total.shape != weight.shape:
            raise ValueError(f"the logged {name!r} as float32 totals and int64 weights of one length, got "
                             f"{total.dtype} {tuple(total.shape)} and {weight.dtype} {tuple(weight.shape)}")
        opts = json.loads(str(options[name]))
        if not isinstance(opts, dict):
            raise ValueError(f"the logged {name!r}'s options as a JSON object, got {opts!r}")
        logs[name] = (opts, [(t, int(w)) for t, w in zip(total, weight)])
    return logs


def clients_content(clients: list[int]) -> RecordDict:
    """A node's answer to :data:`CLIENTS_QUERY`: the clients it holds."""
    return RecordDict({"clients": ConfigRecord({"clients": [int(c) for c in clients]})})


def read_clients(content: RecordDict) -> list[int]:
    """The clients of a :func:`clients_content` answer.

    Raises:
        ReplyError: a malformed answer.
    """
    try:
        return [int(c) for c in content.config_records["clients"]["clients"]]
    except (KeyError, TypeError, ValueError) as error:
        raise ReplyError(f"a malformed answer to {CLIENTS_QUERY}: no {error}") from error


def is_finite(tensors: Mapping[str, Tensor]) -> bool:
    """Whether every entry of ``tensors`` is finite."""
    return all(bool(torch.isfinite(t).all()) for t in tensors.values() if t.is_floating_point())
