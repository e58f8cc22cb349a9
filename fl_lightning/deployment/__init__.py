"""Deployment on Flower's Deployment Engine: the same algorithm as in simulation, its clients on SuperNodes.

The server side is the usual ``Trainer`` + ``FederatedModule`` + callbacks inside Flower's ``ServerApp``,
whose client backend sends each sampled client's round to the SuperNode that holds it
(:func:`deploy`, :class:`DeploymentBackend`); the node side (:class:`ClientNode`, :func:`client_app`) runs
the client's round with :func:`~fl_lightning.backends.run_client` on the node's own data and keeps the
client's state on the node's disk. Needs the ``[flower]`` extra (``pip install "fl-lightning[flower]"``).
See docs/deployment.md.
"""

try:
    import flwr  # noqa: F401
except ImportError as error:  # pragma: no cover - the extra is installed in the tests
    raise ImportError("fl_lightning.deployment needs Flower: pip install \"fl-lightning[flower]\" "
                      "(flwr>=1.42,<1.43)") from error

from fl_lightning.deployment.local_grid import LocalGrid
from fl_lightning.deployment.messages import Job, ReplyError
from fl_lightning.deployment.node import ClientNode, NodeStateStore, client_app, node_clients
from fl_lightning.deployment.server import (LEFT_OUT, STATE_VERSION, DeploymentBackend, check_deployable, deploy,
                                            deployment_refusals)

__all__ = ["LEFT_OUT", "STATE_VERSION", "ClientNode", "DeploymentBackend", "Job", "LocalGrid", "NodeStateStore",
           "ReplyError", "check_deployable", "client_app", "deploy", "deployment_refusals", "node_clients"]
