"""A real Flower deployment on this machine (marked ``deployment``: ``pytest -m deployment``): one SuperLink and
two SuperNodes started by the test on free localhost ports, as docs/deployment.md starts them, and always
stopped (also when the test fails); the Flower app of ``configs/deployment`` run on them with ``flwr run``
gives the bits of ``fl-lightning fit`` of the same YAML; a SuperNode killed during a round has its clients left
out of the round, the run going on, and once restarted (its disk kept) takes part again; the server killed
after a round resumes from its round checkpoint with the simulation's bits. The three share one deployment.

Every Flower message starts a fresh ClientApp process (it imports torch and Lightning): a run takes minutes
on a loaded machine, so the default run (``pytest``, ``pytest -n 2``) leaves these out (pyproject's
``addopts``) and ``pytest -m deployment`` runs them. Each round's end is seen as the round checkpoint's
change; the test prints the start-up and per-round latency.
"""

from __future__ import annotations

import csv
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Callable, Iterator, Optional

import pytest
import torch

pytest.importorskip("flwr")

from fl_lightning.checkpoints import load_checkpoint  # noqa: E402
from fl_lightning.cli import main  # noqa: E402
from fl_lightning.deployment import LEFT_OUT  # noqa: E402

pytestmark = pytest.mark.deployment

ROOT = Path(__file__).resolve().parents[1]
APP = ROOT / "configs" / "deployment"
BIN = Path(sys.executable).parent
#: seconds to wait for the SuperNodes to connect, and for a run
CONNECT_TIMEOUT, RUN_TIMEOUT = 300, 1500
NODES = {"a": "0,2", "b": "1,3"}
#: seconds a round waits for its replies in the runs where a process is killed: above a node's two ClientApp
#: processes one after the other on this loaded machine (about 30 s a round, 90 s for the first)
ROUND_TIMEOUT = 150
#: the rounds of those runs: with the YAML's seed, node b's client 3 is sampled in rounds 1 and 2, client 1 in 3
ROUNDS = 4


def descendants(pid: int) -> list[int]:
    """The processes started by ``pid``, their children and so on (from ``/proc``)."""
    parents = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:  # gone meanwhile
                continue
            parents[int(entry.name)] = int(stat.rsplit(")", 1)[1].split()[1])
    found, frontier = [], [pid]
    while frontier:
        children = [child for child, parent in parents.items() if parent in frontier]
        found += children
        frontier = children
    return found


def command_line(pid: int) -> str:
    """Process ``pid``'s command line ("" where it is gone)."""
    try:
        return (Path("/proc") / str(pid) / "cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


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
        #: each SuperNode's process (the latest, where one was restarted)
        self.nodes: dict[str, subprocess.Popen] = {}
        self.link = self.start("link", ["flower-superlink", "--insecure", "--disable-runtime-dependency-installation",
                                        "--host", "127.0.0.1", "--port", str(link)])
        for name, port in zip(NODES, nodes):
            self.start_node(name, port)

    def start(self, name: str, command: list[str]) -> subprocess.Popen:
        """Start ``command`` in a session of its own (stopped with its children by :meth:`stop`)."""
        with open(self.folder / f"{name}.log", "a") as log:
            process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=self.env, cwd=self.folder,
                                       start_new_session=True)
        self.processes.append(process)
        return process

    def start_node(self, name: str, port: Optional[int] = None) -> None:
        """Start SuperNode ``name`` (again: the same clients and state folder, a new port)."""
        port = port or free_ports(1)[0]
        self.nodes[name] = self.start(f"node_{name}", [
            "flower-supernode", "--insecure", "--superlink", self.address, "--port", str(port), "--node-config",
            f'clients="{NODES[name]}" state-dir="{self.folder / ("state_" + name)}"'])

    def kill_node(self, name: str) -> None:
        """SIGKILL SuperNode ``name`` and what its session runs (its ClientApp processes)."""
        process = self.nodes[name]
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()

    def kill_server(self) -> None:
        """SIGKILL the ``ServerApp`` process of the run in progress (the SuperLink's descendant ``flwr-serverapp``).

        Raises:
            AssertionError: none runs.
        """
        servers = [pid for pid in descendants(self.link.pid) if "flwr-serverapp" in command_line(pid)]
        assert servers, f"no flwr-serverapp process under the SuperLink\n{self.logs()}"
        for pid in servers:
            os.kill(pid, signal.SIGKILL)

    def log(self, name: str) -> str:
        return (self.folder / f"{name}.log").read_text()

    def wait_for_nodes(self) -> None:
        deadline = time.monotonic() + CONNECT_TIMEOUT
        while not all("SuperNode ID" in self.log(f"node_{name}") for name in NODES):
            assert all(p.poll() is None for p in self.processes), self.logs()
            assert time.monotonic() < deadline, f"the SuperNodes did not connect in {CONNECT_TIMEOUT} s\n{self.logs()}"
            time.sleep(1)

    def run(self, root: Path, run_config: str, args: str = "",
            on_round: Callable[[int], bool] = lambda index: False) -> tuple[subprocess.CompletedProcess, list[float]]:
        """``flwr run`` of the app with ``run_config`` and more ``fl-lightning fit`` options ``args``, writing
        into ``root``; its output and the times (from its start, seconds) at which each round's checkpoint was
        written. ``on_round(index)`` is called as the ``index``-th checkpoint of this run is seen; where it returns
        True, ``flwr run`` is stopped (its ServerApp was killed: nothing more will come)."""
        checkpoint = root / "lightning_logs" / "version_0" / "checkpoints" / "last.ckpt"
        ends: list[float] = []
        done = threading.Event()
        start = time.monotonic()
        command = ["flwr", "run", str(APP), "here", "--stream", "--run-config",
                   f'args="--trainer.default_root_dir={root} {args}" {run_config}']
        with open(self.folder / "flwr_run.log", "a+") as log:
            process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, text=True, env=self.env)

            def watch() -> None:
                seen = checkpoint.stat().st_mtime if checkpoint.exists() else None  # a resumed run's: not this run's
                while not done.wait(0.2):
                    stamp = checkpoint.stat().st_mtime if checkpoint.exists() else None
                    if stamp is not None and stamp != seen:
                        seen = stamp
                        ends.append(time.monotonic() - start)
                        if on_round(len(ends) - 1):
                            process.terminate()

            watcher = threading.Thread(target=watch)
            watcher.start()
            try:
                returncode = process.wait(timeout=RUN_TIMEOUT)
            finally:
                if process.poll() is None:
                    process.kill()
                done.set()
                watcher.join()
            log.seek(0)
            output = log.read()
            log.truncate(0)
        return subprocess.CompletedProcess(command, returncode, output, ""), ends

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


def history(root: Path) -> list[dict[str, str]]:
    with open(root / "lightning_logs" / "version_0" / "history.csv") as file:
        return list(csv.DictReader(file))


def simulate(root: Path, rounds: int) -> dict[str, torch.Tensor]:
    """The final state of ``fl-lightning fit`` of the app's YAML for ``rounds`` rounds."""
    main(["fit", "--config", str(APP / "scaffold.yaml"), f"--trainer.default_root_dir={root}",
          f"--trainer.max_epochs={rounds}"])
    return final_state(root)


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


def test_feddeper_s_personal_models_on_the_supernodes_give_the_simulation_s_bits(deployment, tmp_path):
    """A second, stateful algorithm through the same SuperLink and SuperNodes: FedDeper, whose clients' personal
    models stay on their nodes from round to round (the app's ``feddeper.yaml``)."""
    simulated, deployed = tmp_path / "simulated", tmp_path / "deployed"
    main(["fit", "--config", str(APP / "feddeper.yaml"), f"--trainer.default_root_dir={simulated}"])
    result, ends = deployment.run(deployed, 'timeout=0 config="feddeper.yaml"')
    assert result.returncode == 0, f"{result.stdout}\n{result.stderr}\n{deployment.logs()}"
    assert len(history(deployed)) == 3, f"{result.stdout}\n{deployment.logs()}"
    expected, got = final_state(simulated), final_state(deployed)
    assert expected.keys() == got.keys() and expected
    for key, value in expected.items():
        assert torch.equal(got[key], value), key
    assert [row["val_loss"] for row in history(deployed)] == [row["val_loss"] for row in history(simulated)]


def test_a_supernode_killed_during_a_round_has_its_clients_left_out_and_rejoins_when_restarted(deployment, tmp_path):
    root = tmp_path / "deployed"

    def on_round(index: int) -> bool:
        if index == 0:  # as round 1 starts: node b's client 3 is left out of round 1
            seen = len(deployment.log("node_a"))
            deployment.kill_node("b")
            # restarted (the same clients and disk, a new node id) once round 1's jobs went out (node a's client
            # 0 got its job): it is back for round 2, when the server asks the nodes again which clients they hold
            deadline = time.monotonic() + CONNECT_TIMEOUT
            while "ROUND 1]" not in deployment.log("node_a")[seen:]:
                assert time.monotonic() < deadline, f"round 1 did not start\n{deployment.logs()}"
                time.sleep(0.5)
            deployment.start_node("b")
        return False

    result, ends = deployment.run(root, f"timeout={ROUND_TIMEOUT}", f"--trainer.max_epochs={ROUNDS}", on_round)
    assert result.returncode == 0, f"{result.stdout}\n{deployment.logs()}"
    rows = history(root)
    sampled = [{int(c) for c in row["clients"].split()} for row in rows]
    assert [sorted(s & {1, 3}) for s in sampled] == [[3], [3], [3], [1]], sampled  # node b's clients, each round
    assert [float(row[LEFT_OUT]) for row in rows] == [0.0, 1.0, 0.0, 0.0], f"{rows}\n{deployment.logs()}"
    assert [int(row["updates"]) for row in rows] == [2, 1, 2, 2]
    print(f"\nnode b killed after round 0, restarted after round 1: checkpoints at "
          f"{', '.join(f'{t:.1f}' for t in ends)} s (load average {os.getloadavg()[0]:.1f})")


def test_the_server_killed_after_a_round_resumes_from_its_checkpoint_with_the_simulation_s_bits(deployment, tmp_path):
    expected = simulate(tmp_path / "simulated", ROUNDS)
    root = tmp_path / "deployed"

    def kill_after_round_one(index: int) -> bool:
        if index == 1:
            deployment.kill_server()
            return True
        return False

    killed, ends = deployment.run(root, f"timeout={ROUND_TIMEOUT}", f"--trainer.max_epochs={ROUNDS}",
                                  kill_after_round_one)
    assert len(ends) == 2, f"{killed.stdout}\n{deployment.logs()}"
    result, resumed = deployment.run(root, f'timeout={ROUND_TIMEOUT} ckpt-path="last"',
                                     f"--trainer.max_epochs={ROUNDS}")
    assert result.returncode == 0, f"{result.stdout}\n{deployment.logs()}"
    assert [row["round"] for row in history(root)] == [str(r) for r in range(1, ROUNDS + 1)]  # each round once
    got = final_state(root)
    assert expected.keys() == got.keys() and expected
    for key, value in expected.items():
        assert torch.equal(got[key], value), key
    print(f"\nthe server killed after round 1, resumed: its rounds' checkpoints at "
          f"{', '.join(f'{t:.1f}' for t in resumed)} s after flwr run (load average {os.getloadavg()[0]:.1f})")
