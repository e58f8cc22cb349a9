"""The Flower app of a deployment, built from the same YAML as ``fl-lightning fit``.

A Flower app is a folder with a ``pyproject.toml`` naming its ``ServerApp`` and ``ClientApp``
(``configs/deployment/`` is one): its ``app.py`` makes them with :func:`server_app` and :func:`node_app`
from the folder it is in. Its run config (``[tool.flwr.app.config]``, or ``flwr run --run-config``) says:

* ``config``: the YAML(s) of the run, as given to ``fl-lightning fit --config`` (several separated by
  commas, composed in that order), relative to the app's folder or absolute;
* ``args``: more ``fl-lightning fit`` options (``"--trainer.max_epochs=3 --trainer.default_root_dir=runs/x"``);
* ``timeout``: seconds a round waits for its replies (``0``: until every node answers);
* ``ckpt-path``: resume the server from this round checkpoint (``last``: the run's latest).

The server runs ``fl-lightning fit`` on these (:class:`DeploymentCLI`: the same callbacks, round
checkpoints and history as a simulation) with its clients on the SuperNodes; its datamodule, where it is a
:class:`~fl_lightning.datamodules.ClientFilesFederated`, reads only the clients' index. Each SuperNode builds the
configured algorithm and datamodule from the same YAML, without a Trainer run, and holds the clients its
``--node-config`` names: ``clients="0,2,4"`` and ``state-dir="/path"`` (the folder of their state), and,
optionally, ``args="..."``: more ``fl-lightning fit`` options of this node's (where its data are).
"""

from __future__ import annotations

import os
import shlex
import warnings
from typing import Any, Mapping, Optional

from flwr.app import Context
from flwr.clientapp import ClientApp
from flwr.serverapp import Grid, ServerApp

from fl_lightning.cli import FederatedCLI
from fl_lightning.deployment.node import ClientNode, client_app, node_clients
from fl_lightning.deployment.server import deploy


#: LightningCLI's warning that ``sys.argv`` has options besides ``args``: those of the Flower process it runs in
_FLOWER_ARGV = "LightningCLI's args parameter is intended to run from within Python"


class DeploymentCLI(FederatedCLI):
    """``fl-lightning fit`` (:class:`~fl_lightning.cli.FederatedCLI`) with the model's clients on the nodes of
    ``grid`` (:func:`~fl_lightning.deployment.deploy`).

    Args:
        grid: the ``ServerApp``'s ``Grid``.
        timeout: seconds a round waits for its replies (None: until every node answers).
        args: the command line, ``["fit", "--config", ...]``.
    """

    def __init__(self, grid: Grid, timeout: Optional[float], args: list[str]) -> None:
        self._grid, self._timeout = grid, timeout
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=_FLOWER_ARGV)
            super().__init__(args=args)

    def _command(self) -> str:
        """The command as the server's output names it (the process is Flower's ``flwr-serverapp``, whose
        name is not a command to type)."""
        return f"fl-lightning {self.subcommand} (deployed, in Flower's ServerApp)"

    def before_instantiate_classes(self) -> None:
        """:class:`~fl_lightning.cli.FederatedCLI`'s, and the Trainer's ``default_root_dir`` made absolute: a
        relative one is the ``ServerApp`` process's folder, the SuperLink's (not where ``flwr run`` was typed),
        and the run's folder printed (``writing into ...``) says it whole."""
        super().before_instantiate_classes()
        trainer = self.config[self.subcommand]["trainer"]
        trainer["default_root_dir"] = os.path.abspath(trainer.get("default_root_dir") or os.getcwd())

    def instantiate_classes(self) -> None:
        """The configured classes, the model's client backend that of the deployment (and a datamodule that can read
        its clients' index alone told to: :func:`~fl_lightning.deployment.deploy`)."""
        super().instantiate_classes()
        deploy(self.model, self._grid, self._timeout, self.datamodule)


def cli_args(directory: str, run_config: Mapping[str, Any]) -> list[str]:
    """The ``fl-lightning`` options of a run config (``config`` and ``args``), the configs' paths resolved
    against the app's ``directory``.

    Raises:
        ValueError: no ``config``.
    """
    config = str(run_config.get("config", "")).strip()
    if not config:
        raise ValueError("the run config needs 'config': the YAML of the run (as fl-lightning fit --config), "
                         "relative to the app's folder")
    paths = [os.path.join(directory, path.strip()) for path in config.split(",")]
    return [option for path in paths for option in ("--config", path)] + shlex.split(str(run_config.get("args", "")))


def round_timeout(run_config: Mapping[str, Any]) -> Optional[float]:
    """The run config's ``timeout`` (absent or ``0``: None, no timeout).

    Raises:
        ValueError: a negative or non-numeric timeout.
    """
    value = run_config.get("timeout", 0)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
        raise ValueError(f"the run config's 'timeout' must be seconds >= 0 (0: none), got {value!r}")
    return float(value) or None


def server_app(directory: str) -> ServerApp:
    """Flower's ``ServerApp`` of the app in ``directory``: ``fl-lightning fit`` of the run config's YAML with
    its clients on the nodes (:class:`DeploymentCLI`)."""
    app = ServerApp()

    @app.main()
    def main(grid: Grid, context: Context) -> None:
        args = ["fit", *cli_args(directory, context.run_config)]
        ckpt_path = str(context.run_config.get("ckpt-path", ""))
        if ckpt_path:
            args += ["--ckpt_path", ckpt_path]
        DeploymentCLI(grid, round_timeout(context.run_config), args)

    return app


def build_node(directory: str, context: Context) -> ClientNode:
    """A SuperNode's :class:`~fl_lightning.deployment.node.ClientNode`: the run config's algorithm,
    datamodule and callbacks (no Trainer run: the node applies the callbacks of the client's side, local
    differential privacy), the clients and state folder of its node config (``clients``, ``state-dir``) and
    its ``args``, more ``fl-lightning fit`` options of this node's (``--data.init_args.root=/data/fl``: where
    its own clients' files are, :class:`~fl_lightning.datamodules.ClientFilesFederated`).

    Raises:
        ValueError: the node config lacks them.
    """
    missing = [key for key in ("clients", "state-dir") if key not in context.node_config]
    if missing:
        raise ValueError(f"the SuperNode's --node-config lacks {missing}: give the clients it holds and the folder "
                         "of their state, e.g. --node-config 'clients=\"0,2\" state-dir=\"/var/fl/node_a\"'")
    args = cli_args(directory, context.run_config) + shlex.split(str(context.node_config.get("args", "")))
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=_FLOWER_ARGV)
        cli = FederatedCLI(args=args, run=False)
    return ClientNode(cli.model, cli.datamodule, node_clients(context.node_config["clients"]),
                      str(context.node_config["state-dir"]), callbacks=cli.trainer.callbacks)


def node_app(directory: str) -> ClientApp:
    """Flower's ``ClientApp`` of the app in ``directory``: a node built by :func:`build_node`."""
    return client_app(lambda context: build_node(directory, context))
