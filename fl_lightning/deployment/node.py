"""The node side of a deployment: the clients a SuperNode holds, their rounds and their stored state.

A :class:`ClientNode` holds the algorithm (a copy of the server's, no Trainer), a datamodule that builds
only this node's clients, and a :class:`NodeStateStore` of their state entries on the node's disk. It
answers a ``train`` message by running the client's round with
:func:`~fl_lightning.backends.run_client` from the job's start model, broadcast state and local settings,
starting from the stored state version the job names; it stores the new state as the round's version and
replies with the uploads (clipped and noised first where the run's ``DifferentialPrivacy`` is in local
mode) and the client module's ``self.log`` calls. The server names, in each job, the version of the last
round it kept for the client: a round whose update the server dropped (non-finite, too late, a refused
round) does not advance the client's state, and a node restarted keeps what its disk holds.

:func:`client_app` makes Flower's ``ClientApp`` of a node from a function that builds its
:class:`ClientNode` from the node's ``Context`` (its ``node_config``).
"""

from __future__ import annotations

import os
import re
from typing import Any, Callable, Iterable, Mapping, Optional, Sequence

import torch
from flwr.app import Context, Error, Message, RecordDict
from flwr.clientapp import ClientApp
from torch import Tensor

from fl_lightning.backends.client_round import run_client
from fl_lightning.deployment.messages import (CLIENTS_QUERY, NO_STATE, TRAIN, Job, clients_content, is_finite,
                                              local_privacy, privacy_settings, read_job, reply_content)
from fl_lightning.local_logging import LocalLogBuffer
from fl_lightning.module import FederatedModule

#: the error code of a job the node refuses (Flower's codes below 100 are its own)
REFUSED_JOB = 100


class NodeStateStore:
    """The node's clients' state entries: one file per client and version (the round that wrote it),
    ``<directory>/client_<id>/round_<version>.pt``, written atomically and read without running code. A
    :class:`ClientNode` keeps two versions of a client (:meth:`keep`): the one its last job named and the one
    that job wrote, the versions the next job may name.

    Args:
        directory: the folder of the files (made if missing).
    """

    def __init__(self, directory: str) -> None:
        self.directory = os.path.abspath(directory)
        os.makedirs(self.directory, exist_ok=True)

    def _folder(self, client_id: int) -> str:
        return os.path.join(self.directory, f"client_{client_id}")

    def _path(self, client_id: int, version: int) -> str:
        return os.path.join(self._folder(client_id), f"round_{version}.pt")

    def versions(self, client_id: int) -> list[int]:
        """The versions stored for ``client_id``, oldest first."""
        folder = self._folder(client_id)
        names = os.listdir(folder) if os.path.isdir(folder) else []
        return sorted(int(m.group(1)) for m in map(re.compile(r"round_(\d+)\.pt$").match, names) if m)

    def load(self, client_id: int, version: int) -> dict[str, Tensor]:
        """Client ``client_id``'s entries of ``version``.

        Raises:
            ValueError: the node holds no such version.
        """
        path = self._path(client_id, version)
        if not os.path.exists(path):
            raise ValueError(f"the node holds no state of client {client_id} of round {version} (it holds rounds "
                             f"{self.versions(client_id)} in {self._folder(client_id)})")
        return torch.load(path, map_location="cpu", weights_only=True)

    def save(self, client_id: int, version: int, state: Mapping[str, Tensor]) -> None:
        """Store ``state`` as client ``client_id``'s entries of ``version`` (replacing a file of that version)."""
        os.makedirs(self._folder(client_id), exist_ok=True)
        path = self._path(client_id, version)
        torch.save({k: v.detach().cpu() for k, v in state.items()}, path + ".tmp")
        os.replace(path + ".tmp", path)

    def keep(self, client_id: int, versions: Sequence[int]) -> None:
        """Remove ``client_id``'s stored versions other than ``versions``."""
        for version in self.versions(client_id):
            if version not in versions:
                os.remove(self._path(client_id, version))


class ClientNode:
    """What one SuperNode runs: the rounds of the clients it holds.

    Args:
        algorithm: the algorithm, configured as the server's (its client hooks and declarations; no Trainer).
        datamodule: the node's data: it must build the training splits of ``clients`` (and need build no
            other client's); set up here if it is not yet. One that can read only some clients'
            data (``select_clients``, :class:`~fl_lightning.datamodules.ClientFilesFederated`) is told to
            read only ``clients``'.
        clients: the clients this node holds (its ``node_config``'s).
        state_dir: the folder of the clients' stored state.
        device: where the clients' rounds run.
        callbacks: the configuration's Trainer callbacks: the node applies those of the client's side, the
            local mode of ``DifferentialPrivacy`` (clipping and noise, before the update leaves).

    Raises:
        ValueError: no clients, or a lock-step algorithm (its clients need the server at every step).
    """

    def __init__(self, algorithm: FederatedModule, datamodule: object, clients: Sequence[int], state_dir: str,
                 device: str = "cpu", callbacks: Iterable[object] = ()) -> None:
        if not clients:
            raise ValueError("a node must hold at least one client: give its ids (node config 'clients')")
        if getattr(algorithm, "lockstep", False):
            raise ValueError(f"{type(algorithm).__name__} moves its clients in lock-step and cannot be deployed")
        self.algorithm, self.datamodule, self.device = algorithm, datamodule, device
        self.clients = sorted(int(c) for c in clients)
        select = getattr(datamodule, "select_clients", None)
        if callable(select) and not getattr(datamodule, "splits", None):
            select(self.clients)
        self.store = NodeStateStore(state_dir)
        #: the local differential privacy applied to every update before it leaves
        self.privacy = local_privacy(callbacks)

    def handle(self, message: Message) -> Message:
        """The reply to ``message``: a job's result, the node's clients, or an error reply naming what the node
        cannot serve (nothing is stored then)."""
        try:
            if message.metadata.message_type == CLIENTS_QUERY:
                return Message(clients_content(self.clients), reply_to=message)
            if message.metadata.message_type != TRAIN:
                raise ValueError(f"the node serves {TRAIN!r} and {CLIENTS_QUERY!r} messages, got "
                                 f"{message.metadata.message_type!r}")
            return Message(self.train(read_job(message.content)), reply_to=message)
        except ValueError as error:
            return Message(Error(REFUSED_JOB, str(error)), reply_to=message)

    def train(self, job: Job) -> RecordDict:
        """Run ``job``'s round (on the job's CPU threads); store the client's new state as the round's version; the
        reply's content.

        Raises:
            ValueError: a client this node does not hold, a state version it does not hold, or settings and
                state that are not the algorithm's.
        """
        if job.client_id not in self.clients:
            raise ValueError(f"client {job.client_id} is not held by this node (it holds {self.clients})")
        if job.state_version == NO_STATE:
            state = dict(job.defaults)
        else:
            state = self.store.load(job.client_id, job.state_version)
        setup = getattr(self.datamodule, "setup")
        if not getattr(self.datamodule, "splits", None):
            setup("fit")
        data = self.datamodule.client_data(job.client_id, "train")  # type: ignore[attr-defined]
        threads = torch.get_num_threads()
        torch.set_num_threads(job.threads)  # the simulation's arithmetic (Job.threads)
        logs = NodeLogs()
        try:
            result = run_client(self.algorithm, job.client_id, job.round_idx, job.start, state,
                                job.settings(self.device), data, broadcast=job.broadcast, logs=logs)
        finally:
            torch.set_num_threads(threads)
        if result.state:
            self.store.save(job.client_id, job.round_idx, result.state)
            self.store.keep(job.client_id, [v for v in (job.state_version, job.round_idx) if v != NO_STATE])
        update = result.update
        for cb in self.privacy:
            update = cb.privatize(update, job.round_idx, self.algorithm.seed)
        return reply_content(job.round_idx, update, is_finite(result.state), logs.parts(),
                             privacy_settings(self.privacy))


class NodeLogs(LocalLogBuffer):
    """A client module's ``self.log`` calls of a round on a node, each step's value kept for the reply (the
    server adds them to its own buffer and logs the round's mean, as a simulation: ``train_loss``). Calls that
    are not a mean of scalars (a torchmetrics ``Metric``, another ``reduce_fx``), which a simulation logs
    through Lightning as they are made, are dropped: the node has no Trainer to log them."""

    def _log_now(self, name: str, value: Any, *args: Any, agreed: bool = False, **kwargs: Any) -> None:
        """Nothing: the node has no Trainer (see the class)."""


def node_clients(value: object) -> list[int]:
    """The client ids of a node config's ``clients`` value (``"0,1,5"``, or one integer).

    Raises:
        ValueError: anything else.
    """
    if isinstance(value, int) and not isinstance(value, bool):
        return [value]
    if isinstance(value, str) and re.fullmatch(r"\s*\d+(\s*,\s*\d+)*\s*", value):
        return [int(v) for v in value.split(",")]
    raise ValueError(f"node config 'clients' must be client ids separated by commas (\"0,1,5\"), got {value!r}")


def client_app(build: Callable[[Context], ClientNode], nodes: Optional[dict[int, ClientNode]] = None) -> ClientApp:
    """Flower's ``ClientApp`` of the nodes that ``build`` makes from their ``Context``: it answers ``train``
    and ``query.clients`` messages (:meth:`ClientNode.handle`). A node is built once per process and node
    (``nodes`` keeps them: every Flower message may start a fresh process, which builds it again; its state
    is on its disk)."""
    app = ClientApp()
    built = {} if nodes is None else nodes

    def node_of(context: Context) -> ClientNode:
        if context.node_id not in built:
            built[context.node_id] = build(context)
        return built[context.node_id]

    @app.train()
    def train(message: Message, context: Context) -> Message:
        return node_of(context).handle(message)

    @app.query("clients")
    def clients(message: Message, context: Context) -> Message:
        return node_of(context).handle(message)

    return app
