"""The Flower app of a deployment: ``fl-lightning fit`` of the run config's YAML, its clients on SuperNodes
(see docs/deployment.md and :mod:`fl_lightning.deployment.app`)."""

import os

from fl_lightning.deployment.app import node_app, server_app

HERE = os.path.dirname(os.path.abspath(__file__))
server = server_app(HERE)
client = node_app(HERE)
