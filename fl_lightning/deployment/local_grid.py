"""A ``Grid`` that delivers messages to ``ClientApp`` s in this process: a deployment's exchanges without a
SuperLink, for tests and for trying a configuration (Flower's own tests call a ``ClientApp`` directly the
same way)."""

from __future__ import annotations

from typing import Iterable, Optional

from flwr.app import Context, Message, RecordDict
from flwr.clientapp import ClientApp
from flwr.supercore.run import Run
from flwr.serverapp import Grid
from flwr.supercore.task_identity import TaskIdentity


class LocalGrid(Grid):
    """Delivers each message to the ``ClientApp`` of its node, in this process.

    Args:
        apps: each node's id and its ``ClientApp``.
        node_configs: each node's ``node_config`` (its ``Context``'s).
        run_config: the run's config (every ``Context``'s ``run_config``).

    Attributes:
        down: the nodes that do not answer now (their messages get no reply, as a node that is gone).
    """

    def __init__(self, apps: dict[int, ClientApp], node_configs: dict[int, dict],
                 run_config: Optional[dict] = None) -> None:
        self.apps = apps
        self.contexts = {node: Context(run_id=1, node_id=node, node_config=dict(node_configs[node]),
                                       state=RecordDict(), run_config=dict(run_config or {})) for node in apps}
        self.down: set[int] = set()
        self._run: Optional[Run] = None
        self._sent = 0
        if TaskIdentity._run_id is None:  # what a ServerApp process is told by its SuperLink: its messages' sender
            TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 1, 0, 0

    def set_run(self, run: Run) -> None:
        self._run = run

    @property
    def run(self) -> Run:
        assert self._run is not None, "no run set"
        return self._run

    def create_message(self, content: RecordDict, message_type: str, dst_node_id: int, group_id: str,
                       ttl: Optional[float] = None) -> Message:
        return Message(content, dst_node_id, message_type, ttl=ttl, group_id=group_id)

    def get_node_ids(self) -> Iterable[int]:
        return [node for node in self.apps if node not in self.down]

    def push_messages(self, messages: Iterable[Message]) -> Iterable[str]:
        raise NotImplementedError("LocalGrid delivers with send_and_receive")

    def pull_messages(self, message_ids: Iterable[str]) -> Iterable[Message]:
        raise NotImplementedError("LocalGrid delivers with send_and_receive")

    def send_and_receive(self, messages: Iterable[Message], *, timeout: Optional[float] = None) -> Iterable[Message]:
        """Each message's reply from its node's ``ClientApp`` (none from a node that is down)."""
        replies = []
        for message in messages:
            self._sent += 1
            message.metadata.__dict__["_message_id"] = f"message-{self._sent}"  # the SuperLink sets it
            node = message.metadata.dst_node_id
            if node in self.down or node not in self.apps:
                continue
            replies.append(self.apps[node](message, self.contexts[node]))
        return replies
