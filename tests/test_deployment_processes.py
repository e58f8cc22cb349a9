"""A real Flower deployment on this machine (marked ``deployment``: ``pytest -m deployment``): one SuperLink and
two SuperNodes started by the test on free localhost ports, as docs/deployment.md starts them, and always
stopped (also when the test fails); the Flower app of ``configs/deployment`` run on them with ``flwr run``
gives the bits of ``fl-lightning fit`` of the same YAML.

Every Flower message starts a fresh ClientApp process (it imports torch and Lightning): a run takes minutes
on a loaded machine, so the default run (``pytest``, ``pytest -n 2``) leaves these out (pyproject's
``addopts``) and ``pytest -m deployment`` runs them. Each round's end is seen as the round checkpoint's
change; the test prints the start-up and per-round latency.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Iterator, Optional

import pytest
import torch

pytest.importorskip("flwr")

from fl_lightning.checkpoints import load_checkpoint  # noqa: E402
from fl_lightning.cli import main  # noqa: E402

pytestmark = pytest.mark.deployment

ROOT = Path(__file__).resolve().parents[1]
APP = ROOT / "configs" / "deployment"
BIN = Path(sys.executable).parent
#: seconds to wait for the SuperNodes to connect, and for a run
CONNECT_TIMEOUT, RUN_TIMEOUT = 300, 1500
NODES = {"a": "0,2", "b": "1,3"}


def free_ports(count: int) -> list[int]:
    sockets = [socket.socket() for _ in range(count)]
    for s in sockets:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in sockets]
    for s in sockets:
        s.close()
    return ports


class LocalDeployment:
    """A SuperLink and a SuperNode per entry of :data:`NODES` on localhost, their logs and state in ``folder``."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        link, *nodes = free_ports(1 + len(NODES))
        self.address = f"127.0.0.1:{link}"
        home = folder / "flwr"
        home.mkdir()
        (home / "config.toml").write_text(f'[superlink]\ndefault = "here"\n\n[superlink.here]\naddress = '
                                          f'"{self.address}"\ninsecure = true\n')
        self.env = dict(os.environ, FLWR_HOME=str(home), PATH=f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}",
                        PYTHONPATH=os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]))
        self.processes: list[subprocess.Popen] = []
        self.start("link", ["flower-superlink", "--insecure", "--disable-runtime-dependency-installation",
                            "--host", "127.0.0.1", "--port", str(link)])
        for (name, clients), port in zip(NODES.items(), nodes):
            self.start(f"node_{name}", ["flower-supernode", "--insecure", "--superlink", self.address, "--port",
                                        str(port), "--node-config",
                                        f'clients="{clients}" state-dir="{folder / ("state_" + name)}"'])

    def start(self, name: str, command: list[str]) -> None:
        """Start ``command`` in a session of its own (stopped with its children by :meth:`stop`)."""
        with open(self.folder / f"{name}.log", "w") as log:
            self.processes.append(subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=self.env,
                                                   cwd=self.folder, start_new_session=True))

    def log(self, name: str) -> str:
        return (self.folder / f"{name}.log").read_text()

    def wait_for_nodes(self) -> None:
        deadline = time.monotonic() + CONNECT_TIMEOUT
        while not all("SuperNode ID" in self.log(f"node_{name}") for name in NODES):
            assert all(p.poll() is None for p in self.processes), self.logs()
            assert time.monotonic() < deadline, f"the SuperNodes did not connect in {CONNECT_TIMEOUT} s\n{self.logs()}"
            time.sleep(1)

    def run(self, root: Path, run_config: str) -> tuple[subprocess.CompletedProcess, list[float]]:
        """``flwr run`` of the app with ``run_config``, writing into ``root``; its output and the times (from its
        start, seconds) at which each round's checkpoint was written."""
        checkpoint = root / "lightning_logs" / "version_0" / "checkpoints" / "last.ckpt"
        ends: list[float] = []
        done = threading.Event()
        start = time.monotonic()

        def watch() -> None:
            seen: Optional[float] = None
            while not done.wait(0.2):
                stamp = checkpoint.stat().st_mtime if checkpoint.exists() else None
                if stamp is not None and stamp != seen:
                    seen = stamp
                    ends.append(time.monotonic() - start)

        watcher = threading.Thread(target=watch)
        watcher.start()
        try:
            result = subprocess.run(["flwr", "run", str(APP), "here", "--stream", "--run-config",
                                     f'args="--trainer.default_root_dir={root}" {run_config}'],
                                    capture_output=True, text=True, env=self.env, timeout=RUN_TIMEOUT)
        finally:
            done.set()
            watcher.join()
        return result, ends

    def logs(self) -> str:
        return "\n".join(f"--- {p.name}\n{p.read_text()[-3000:]}" for p in sorted(self.folder.glob("*.log")))

    def stop(self) -> None:
        """Stop every process started here and its children (their sessions), also after a failure."""
        for process in self.processes:
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGTERM)
        for process in self.processes:
            try:
                process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()
        for process in self.processes:  # children left in a session whose leader has exited
            try:
                os.killpg(process.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


@pytest.fixture(scope="module")
def deployment(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalDeployment]:
    here = LocalDeployment(tmp_path_factory.mktemp("deployment"))
    try:
        here.wait_for_nodes()
        yield here
    finally:
        here.stop()


def final_state(root: Path) -> dict[str, torch.Tensor]:
    return load_checkpoint(root / "lightning_logs" / "version_0" / "checkpoints" / "last.ckpt")["state_dict"]


def test_scaffold_on_a_superlink_and_two_supernodes_gives_the_simulation_s_bits(deployment, tmp_path):
    simulated, deployed = tmp_path / "simulated", tmp_path / "deployed"
    main(["fit", "--config", str(APP / "scaffold.yaml"), f"--trainer.default_root_dir={simulated}"])
    result, ends = deployment.run(deployed, "timeout=0")
    assert result.returncode == 0, f"{result.stdout}\n{result.stderr}\n{deployment.logs()}"
    history = (deployed / "lightning_logs" / "version_0" / "history.csv").read_text().splitlines()
    assert len(history) == 1 + 3, f"{history}\n{result.stdout}\n{deployment.logs()}"
    expected, got = final_state(simulated), final_state(deployed)
    assert expected.keys() == got.keys() and expected
    for key, value in expected.items():
        assert torch.equal(got[key], value), key
    rounds = [later - earlier for earlier, later in zip(ends, ends[1:])]
    print(f"\nflwr run: {ends[-1]:.1f} s in all; first round's checkpoint at {ends[0]:.1f} s; rounds after it "
          f"{', '.join(f'{r:.1f}' for r in rounds)} s (load average {os.getloadavg()[0]:.1f})")
