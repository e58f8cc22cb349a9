"""The server side of a deployment: a client backend that sends the round's jobs to the SuperNodes.

The usual ``Trainer`` + ``FederatedModule`` + callbacks run the federation inside Flower's ``ServerApp``;
only the client backend differs (:func:`deploy` puts a :class:`DeploymentBackend` in its place). The
backend runs a round as one work item: one ``train`` message per sampled client to the node that holds it
(nodes say which clients they hold when asked, :data:`~fl_lightning.deployment.messages.CLIENTS_QUERY`),
then the replies, each checked (:func:`~fl_lightning.deployment.messages.read_reply`), handed to the round
as the clients' updates. A reply that is malformed, from a node other than the client's, or for another
client or round is refused with a warning and never aggregated; a client whose node does not answer
within ``timeout`` is left out of the round with a warning and counted (:data:`LEFT_OUT`, logged every round),
and the run goes on. The client module's ``self.log`` calls on the nodes come back with the replies and are
logged as a simulation logs them (``train_loss``); ``DifferentialPrivacy`` in local mode is left to the nodes,
whose replies must say they applied the run's.

The clients' data stay on their nodes: the server needs of them only their ids and sample counts, which a
:class:`~fl_lightning.datamodules.ClientFilesFederated` reads from its clients' index alone (:func:`deploy` tells
it to), opening no client's file.

The clients' state stays on their nodes. The server keeps, per client, only which round's state the
client has (a scalar entry of the client state store, :data:`STATE_VERSION`, stored as the engine stores
a client's state: only if the round keeps the client's update): each job names it, so that an update the
server dropped does not advance the client's state, and a server resumed from its checkpoint names the
versions of that checkpoint.
"""

from __future__ import annotations

import warnings
from typing import Iterable, Optional

import torch
from flwr.app import Message
from flwr.serverapp import Grid

from fl_lightning.algorithms.pefll import HypernetworkFederation
from fl_lightning.backends.base import ClientBackend, LockstepGroup, refusal
from fl_lightning.backends.block import ClientBlock
from fl_lightning.backends.client_round import ClientRoundResult
from fl_lightning.backends.context import ClientContext
from fl_lightning.backends.sequential import train_one_by_one
from fl_lightning.broadcast import broadcast_state
from fl_lightning.deployment.messages import (CLIENTS_QUERY, NO_STATE, TRAIN, Job, ReplyError, clients_content,
                                              job_content, local_privacy, privacy_settings, read_clients, read_reply)
from fl_lightning.hooks import FederatedCallback
from fl_lightning.lightning_compat import log_agreed
from fl_lightning.module import FederatedModule
from fl_lightning.validation import check_number

#: the metric of the clients left out of a round (their node gave no valid reply, or none holds them now)
LEFT_OUT = "round/left_out"

#: the client state store's entry in which the server keeps the round of a client's state on its node
STATE_VERSION = "deployment_state_version"


def deployment_refusals(algorithm: FederatedModule, callbacks: Iterable[object] = ()) -> list[str]:
    """Why ``algorithm`` (with the Trainer's ``callbacks``) cannot run on a deployment, each with the reason;
    empty when it can."""
    name = type(algorithm).__name__
    reasons = []
    if getattr(algorithm, "lockstep", False):
        reasons.append(f"{name} moves its clients in lock-step: every local step waits for the server's reply to "
                       "all clients' shared values, a round trip per step that a deployment does not make")
    if isinstance(algorithm, HypernetworkFederation):
        reasons.append(f"{name}'s server networks train on the clients' data (the server reads client data in its "
                       "round), which stays on the nodes in a deployment")
    for cb in callbacks:
        if isinstance(cb, FederatedCallback) and type(cb).on_local_batch is not FederatedCallback.on_local_batch:
            reasons.append(f"the callback {type(cb).__name__} changes the clients' local batches (on_local_batch), "
                           "which are on the nodes in a deployment")
        if isinstance(cb, FederatedCallback) and type(cb).configure_client is not FederatedCallback.configure_client:
            reasons.append(f"the callback {type(cb).__name__} configures each client's round (configure_client: "
                           "its local work, learning rate or dropping it), which a deployment's jobs do not carry yet")
    return reasons


def check_deployable(algorithm: FederatedModule, callbacks: Iterable[object] = ()) -> None:
    """Refuse ``algorithm`` if it cannot run on a deployment (:func:`deployment_refusals`).

    Raises:
        ValueError: with every reason.
    """
    reasons = deployment_refusals(algorithm, callbacks)
    if reasons:
        raise ValueError("cannot deploy: " + "; ".join(reasons))


class DeploymentBackend(ClientBackend):
    """Runs the round's clients on Flower SuperNodes through ``grid`` (a ``ServerApp``'s).

    Args:
        grid: the ``Grid`` of the ``ServerApp``.
        timeout: seconds a round waits for its replies (None: until every node answers).
    """

    def __init__(self, grid: Grid, timeout: Optional[float] = None) -> None:
        super().__init__(1)
        if timeout is not None:
            check_number("timeout", timeout, 0.0, low_open=True)
        self.grid, self.timeout = grid, timeout
        #: the node holding each client (asked of the nodes; again when the nodes change)
        self.node_of: dict[int, int] = {}
        self._nodes: set[int] = set()
        #: the clients left out of the last round: no answer, or a reply refused
        self.left_out: list[int] = []
        #: the local differential privacy every reply must say its node applied (:func:`privacy_settings`)
        self.privacy: list[float] = []

    def setup(self, context: ClientContext, clients_per_round: int, fit: bool) -> None:
        """Refuse what a deployment cannot run (:func:`deployment_refusals`); one work item a round, all its
        messages sent at once; the nodes asked which clients they hold; the local mode of
        ``DifferentialPrivacy`` left to the nodes (each reply must say its node applied it).

        Raises:
            ValueError: an algorithm or callback a deployment cannot run, a client held by two nodes, or
                training clients held by none.
        """
        reasons = deployment_refusals(context.algorithm, context.trainer.callbacks)  # type: ignore[arg-type]
        if reasons:
            raise refusal(context, reasons)
        self.clients_per_block = clients_per_round
        privacy = local_privacy(context.trainer.callbacks)
        for cb in privacy:
            cb.applied_on_clients = True
        self.privacy = privacy_settings(privacy)
        self.discover()
        missing = sorted(set(context.algorithm.engine.datamodule.train_clients) - set(self.node_of))
        if missing:
            raise ValueError(f"no node holds training client(s) {missing[:10]} (the nodes hold "
                             f"{sorted(self.node_of)}): give each client to a node in its node config 'clients'")

    def discover(self) -> None:
        """Ask every node which clients it holds (:data:`CLIENTS_QUERY`). A node that does not answer (a node
        restarting, not ready within the timeout) is asked again at the next round.

        Raises:
            ValueError: a client held by two nodes.
        """
        nodes = sorted(self.grid.get_node_ids())
        messages = [Message(clients_content([]), node, CLIENTS_QUERY) for node in nodes]
        node_of: dict[int, int] = {}
        answered = set()
        for reply in self.grid.send_and_receive(messages, timeout=self.timeout):
            node = reply.metadata.src_node_id
            if reply.has_error() or node not in nodes:
                continue
            try:
                held = read_clients(reply.content)
            except ReplyError as error:
                warnings.warn(f"node {node}: {error}", RuntimeWarning, stacklevel=2)
                continue
            for client in held:
                if client in node_of and node_of[client] != node:
                    raise ValueError(f"client {client} is held by nodes {node_of[client]} and {node}: give each client "
                                     "to one node")
                node_of[client] = node
            answered.add(node)
        self.node_of, self._nodes = node_of, answered

    def run_clients(self, context: ClientContext, clients: list[int]) -> ClientBlock:
        """The round of ``clients``: a job to each one's node; the checked replies' results."""
        if set(self.grid.get_node_ids()) != self._nodes:
            self.discover()  # a node joined, left or came back (with a new id)
        algorithm = context.algorithm
        round_idx = context.round
        lrs = [group["lr"] for group in algorithm.engine.local_optimizer().param_groups]
        precision = str(context.trainer.precision)
        broadcast = broadcast_state(algorithm)
        assert algorithm.engine.round_start is not None, "the round has not started"
        start = algorithm.engine.round_start
        sent: dict[int, int] = {}
        messages = []
        results = []
        self.left_out = []
        for client_id in clients:
            if context.is_forged(client_id):
                results.append(context.forged_result(client_id))
                continue
            node = self.node_of.get(client_id)
            if node is None:
                self._leave_out(round_idx, client_id, "no node holds it now")
                continue
            version = self._state_version(algorithm, client_id)
            defaults = context.load_client_state(client_id) if version == NO_STATE else {}
            job = Job(client_id, round_idx, start, broadcast, algorithm.local_steps, algorithm.local_epochs, lrs,
                      precision, version, defaults, torch.get_num_threads())
            messages.append(Message(job_content(job), node, TRAIN, group_id=str(round_idx)))
            sent[client_id] = node
        updates = {}
        for reply in self.grid.send_and_receive(messages, timeout=self.timeout):
            node = reply.metadata.src_node_id
            if reply.has_error():
                warnings.warn(f"round {round_idx}: node {node} refused a job: {reply.error.reason}", RuntimeWarning,
                              stacklevel=2)
                continue
            try:
                client_id = _claimed_client(reply)
                if sent.get(client_id) != node:
                    raise ReplyError(f"a reply for client {client_id} came from node {node}, which was sent no job "
                                     f"for it this round")
                got = read_reply(reply.content, client_id, round_idx, algorithm.engine.update_specs,
                                 algorithm.engine.datamodule.num_samples(client_id), self.privacy)
            except ReplyError as error:
                warnings.warn(f"round {round_idx}: {error}; refused, not aggregated", RuntimeWarning, stacklevel=2)
                continue
            if client_id not in updates:
                updates[client_id] = got
        for client_id in sent:
            if client_id not in updates:
                self._leave_out(round_idx, client_id, f"node {sent[client_id]} gave no valid reply"
                                f"{'' if self.timeout is None else f' within {self.timeout} s'}")
        log_agreed(algorithm, LEFT_OUT, float(len(self.left_out)), on_step=False, on_epoch=True, batch_size=1)
        for client_id in clients:  # in the round's order, as the sequential backend hands them over
            if client_id in updates:
                got = updates[client_id]
                for name, (options, adds) in got.logs.items():  # the client module's self.log calls, as it ran here
                    for total, weight in adds:
                        context.logs.add(name, total, weight, options, [client_id])
                marker = float(round_idx) if got.state_finite else float("nan")  # NaN: excluded as a non-finite state
                state = {STATE_VERSION: torch.tensor(marker, dtype=torch.float64)} if algorithm.engine.state_specs else None
                results.append(ClientRoundResult(got.update, state or {}))
        return ClientBlock.of(results)

    @staticmethod
    def _state_version(algorithm: FederatedModule, client_id: int) -> int:
        """The round of client ``client_id``'s state on its node that the server kept (:data:`NO_STATE`: none)."""
        if not algorithm.engine.state_specs:
            return NO_STATE
        value = algorithm.engine.store.get(client_id, STATE_VERSION)
        return NO_STATE if value is None else int(value)

    def _leave_out(self, round_idx: int, client_id: int, why: str) -> None:
        self.left_out.append(client_id)
        warnings.warn(f"round {round_idx}: client {client_id} is left out of the round: {why}", RuntimeWarning,
                      stacklevel=3)

    def train_clients_plainly(self, context: ClientContext, client_ids: list[int], start: torch.Tensor,
                              steps: Optional[int], stream: str, round_idx: int):  # type: ignore[override]
        """Plain local training on the server's data (what evaluation callbacks ask: finetuning); the nodes'
        data are not reached, and a server that reads only its clients' index has none (an error names the
        client)."""
        return train_one_by_one(context, client_ids, start, steps, stream, round_idx)

    def lockstep_group(self, context: ClientContext, clients: list[int]) -> LockstepGroup:
        """None: a deployment does not run lock-step rounds (lock-step algorithms are refused at setup)."""
        raise ValueError("a deployment does not run lock-step rounds")


def _claimed_client(reply: Message) -> int:
    """The client a reply says it answers for.

    Raises:
        ReplyError: it says none.
    """
    try:
        return int(reply.content.config_records["reply"]["client"])
    except (KeyError, TypeError, ValueError) as error:
        raise ReplyError(f"a malformed reply from node {reply.metadata.src_node_id}: no {error}") from error


def deploy(module: FederatedModule, grid: Grid, timeout: Optional[float] = None,
           datamodule: Optional[object] = None) -> FederatedModule:
    """Make ``module`` run its clients on the SuperNodes of ``grid``: its client backend becomes a
    :class:`DeploymentBackend`. ``datamodule``: the server's, which a fit of ``module`` will be given; one that can
    read its clients' index alone (``read_index_only``: :class:`~fl_lightning.datamodules.ClientFilesFederated`) is
    told to, so that the server opens no client's data. Returns ``module``.

    Raises:
        ValueError: an algorithm that cannot be deployed (:func:`deployment_refusals`), refused before anything
            starts (the Trainer's callbacks are checked at setup); a ``datamodule`` set up already.
    """
    check_deployable(module)
    read_index_only = getattr(datamodule, "read_index_only", None)
    if callable(read_index_only):
        read_index_only()
    module.engine.backend = DeploymentBackend(grid, timeout)
    module.client_backend = "deployment"  # type: ignore[assignment]
    return module
