"""Deployment on Flower's engine, in process (fl_lightning.deployment): the server's Trainer sends each client's
round as a Flower message to the ``ClientApp`` of the node holding it (a :class:`LocalGrid` delivers them,
as Flower's own tests call a ``ClientApp`` directly), and gets the simulation's bits; what cannot be
deployed is refused before a round; replies that are malformed, from another node or for another round
are never aggregated; an update the server drops does not advance the client's state on its node."""

from __future__ import annotations

import csv
import json
import os
import re
import runpy
import warnings
from pathlib import Path
from typing import Any, Callable, Optional

import pytest
import pytorch_lightning as pl
import torch
from torch.utils.data import TensorDataset

pytest.importorskip("flwr")

from flwr.app import ConfigRecord, Context, Message, RecordDict  # noqa: E402

from fl_lightning.algorithms import (RAGA, RFA, SCAFFOLD, ByrdSAGA, FastDRO, FedAvg, FedDeper, FedDRO,  # noqa: E402
                                     FedProx, FedProxVR, LocalOnly, PeFLL)
from fl_lightning.broadcast import broadcast_state  # noqa: E402
from fl_lightning.callbacks import DifferentialPrivacy, FederatedCallback, LabelFlipAttack, Stragglers  # noqa: E402
from fl_lightning.checkpoints import load_checkpoint  # noqa: E402
from fl_lightning.cli import main  # noqa: E402
from fl_lightning.datamodules import ClientFilesFederated, SyntheticFederated, write_client_files  # noqa: E402
from fl_lightning.datamodules.client_index import ClientIndex  # noqa: E402
from fl_lightning.deployment import (LEFT_OUT, STATE_VERSION, ClientNode, LocalGrid, client_app, deploy,  # noqa: E402
                                     node_clients)
from fl_lightning.deployment.app import build_node, cli_args, round_timeout  # noqa: E402
from fl_lightning.functional.dro import KLDRO  # noqa: E402
from fl_lightning.models.hypernetwork import MLPEmbedding  # noqa: E402
from fl_lightning.module import FederatedModule  # noqa: E402
from fl_lightning.update import ClientUpdate  # noqa: E402
from tests.helpers import global_vector, scratch_folder, synthetic, tiny_client, trainer  # noqa: E402

CLIENTS, PER_ROUND, ROUNDS = 6, 2, 3
#: the seed whose sampling brings client 1 back in round 2 after a round away
SEED = 5
#: two nodes and the clients each holds (its node config)
NODES = {11: {"clients": "0,2,4"}, 22: {"clients": "1,3,5"}}

#: every algorithm of the package that can be deployed (not lock-step, no server network trained on client
#: data, not PDSGD's one-client federation): the stateless, the stateful (SCAFFOLD, FedDeper, ByrdSAGA,
#: LocalOnly), the robust (RAGA, RFA) and those whose clients read their whole split (FedProxVR, FastDRO)
ALGORITHMS: dict[str, Callable[[], FederatedModule]] = {
    name: (lambda cls=cls, kwargs=kwargs: cls(tiny_client(hidden=(8,)), clients_per_round=PER_ROUND, seed=SEED,
                                              **kwargs))
    for name, (cls, kwargs) in {
        "FedAvg": (FedAvg, {"local_steps": 2}),
        "SCAFFOLD": (SCAFFOLD, {"local_steps": 2}),
        "FedProx": (FedProx, {"local_steps": 2, "mu": 0.1}),
        "FedDeper": (FedDeper, {"local_steps": 2}),
        "ByrdSAGA": (ByrdSAGA, {}),
        "LocalOnly": (LocalOnly, {"local_steps": 2}),
        "RAGA": (RAGA, {"local_steps": 2}),
        "RFA": (RFA, {"local_steps": 2}),
        "FedProxVR": (FedProxVR, {"local_steps": 2, "log_local_accuracy": True}),
        "FastDRO": (FastDRO, {"local_steps": 2}),
    }.items()
}


def build(name: str) -> FederatedModule:
    torch.manual_seed(0)
    return ALGORITHMS[name]()


def deployment(name: str, grid_class: type[LocalGrid] = LocalGrid) -> tuple[LocalGrid, dict[int, ClientNode]]:
    """Two nodes, each with its own copy of the algorithm and its own clients' data, on a grid."""
    folder = scratch_folder()

    def node(context: Any) -> ClientNode:
        data = synthetic(CLIENTS)
        return ClientNode(build(name), data, node_clients(context.node_config["clients"]),
                          f"{folder}/node_{context.node_id}")

    nodes: dict[int, ClientNode] = {}
    return grid_class({n: client_app(node, nodes) for n in NODES}, NODES), nodes


def fit(module: FederatedModule, rounds: int = ROUNDS, callbacks: Optional[list] = None) -> FederatedModule:
    trainer(rounds, callbacks=callbacks).fit(module, synthetic(CLIENTS))
    return module


class AtRoundEnd(FederatedCallback):
    """Calls ``function(module, round_idx)`` at the end of every round (its server update and stored state done)."""

    def __init__(self, function: Callable[[Any, int], None]) -> None:
        self.function = function

    def on_round_end(self, trainer: Any, module: Any, round_idx: int, aggregate: Any) -> None:
        self.function(module, round_idx)


def test_stateful_clients_are_sampled_in_rounds_that_are_not_consecutive():
    module = fit(build("FedAvg"), 1)
    rounds = [set(module.engine.sample_round(r)) for r in range(ROUNDS)]
    assert rounds[0] & rounds[2] - rounds[1], "no client comes back after a round away: the test would not see it"


@pytest.mark.parametrize("name", list(ALGORITHMS))
def test_a_deployment_gives_the_simulation_s_bits(name):
    simulation = fit(build(name))
    grid, nodes = deployment(name)
    deployed = fit(deploy(build(name), grid))
    assert torch.equal(global_vector(deployed), global_vector(simulation))
    for key, value in broadcast_state(simulation).items():  # SCAFFOLD's server control variate
        assert torch.equal(broadcast_state(deployed)[key], value), key
    if not simulation.engine.state_specs:
        return
    held = {c: node for node in nodes.values() for c in node.clients}
    checked = 0
    for client_id in range(CLIENTS):
        version = deployed.engine.store.get(client_id, STATE_VERSION)
        for entry in simulation.engine.state_specs:
            expected = simulation.engine.store.get(client_id, entry)
            if expected is None:
                assert version is None
                continue
            stored = held[client_id].store.load(client_id, int(version))
            assert torch.equal(stored[entry], expected), (client_id, entry)
            checked += 1
    assert checked, "no client state compared"


def test_the_server_sends_no_client_data_and_keeps_no_client_state():
    grid, _ = deployment("SCAFFOLD")
    deployed = fit(deploy(build("SCAFFOLD"), grid))
    assert {name for _, name in deployed.engine.store.entries()} == {STATE_VERSION}


@pytest.mark.parametrize("make, reason", [
    (lambda: FedDRO(tiny_client(), KLDRO(lam=2.0), local_steps=2, clients_per_round=2), "lock-step"),
    (lambda: PeFLL(tiny_client(), MLPEmbedding(20, 10, 4, hidden=(8,)), hypernetwork_width=8, clients_per_round=2,
                   local_steps=2), "server networks train on the clients' data"),
])
def test_what_cannot_be_deployed_is_refused_before_anything_starts(make, reason):
    grid, _ = deployment("FedAvg")
    with pytest.raises(ValueError, match=reason):
        deploy(make(), grid)


def test_a_callback_that_changes_local_batches_is_refused_at_setup():
    grid, _ = deployment("FedAvg")
    module = deploy(build("FedAvg"), grid)
    with pytest.raises(ValueError, match="LabelFlipAttack changes the clients' local batches"):
        trainer(ROUNDS, callbacks=[LabelFlipAttack(count=1)]).fit(module, synthetic(CLIENTS))
    assert module.current_epoch == 0


def test_a_callback_that_configures_clients_rounds_is_refused_at_setup():
    grid, _ = deployment("FedAvg")
    module = deploy(build("FedAvg"), grid)
    with pytest.raises(ValueError, match=r"Stragglers configures each client's round \(configure_client"):
        trainer(ROUNDS, callbacks=[Stragglers(0.5, mode="drop")]).fit(module, synthetic(CLIENTS))
    assert module.current_epoch == 0


class TamperingGrid(LocalGrid):
    """Replies of round ``ROUND`` changed by ``tamper(reply)`` (None: as they came)."""

    ROUND = 1
    tamper: Callable[[Message], Any] = staticmethod(lambda reply: None)

    def send_and_receive(self, messages: Any, *, timeout: Any = None) -> Any:
        messages = list(messages)
        replies = list(super().send_and_receive(messages, timeout=timeout))
        if messages and messages[0].metadata.group_id == str(self.ROUND):
            for reply in replies:
                type(self).tamper(reply)
        return replies


def _config(reply: Message) -> ConfigRecord:
    return reply.content.config_records["reply"]


def _drop_uploads(reply: Message) -> None:
    del reply.content.array_records["uploads"]


def _mismatched_logs(reply: Message) -> None:
    del reply.content.array_records["log_weights"]["train_loss"]


def _older_round(reply: Message) -> None:
    _config(reply)["round"] = TamperingGrid.ROUND - 1


def _other_node(reply: Message) -> None:
    reply.metadata.__dict__["_src_node_id"] = 11 if reply.metadata.src_node_id == 22 else 22


@pytest.mark.parametrize("tamper, message", [
    (_drop_uploads, "malformed reply"),
    (_mismatched_logs, "malformed reply .* the same names in the logs"),
    (_older_round, "in round 0 came for the job"),
    (_other_node, "which was sent no job for it"),
])
def test_a_bad_reply_is_refused_and_never_aggregated(tamper, message):
    class Grid(TamperingGrid):
        pass

    Grid.tamper = staticmethod(tamper)
    grid, _ = deployment("FedAvg", Grid)
    counts = []

    module = deploy(build("FedAvg"), grid)
    with pytest.warns(RuntimeWarning, match=message):
        fit(module, callbacks=[AtRoundEnd(lambda m, r: counts.append(m.engine.round_num_updates))])
    assert counts == [PER_ROUND, 0, PER_ROUND]  # round 1 kept no reply; the run went on


def test_a_node_that_does_not_answer_has_its_clients_left_out_and_the_run_goes_on():
    grid, _ = deployment("SCAFFOLD")
    module = deploy(build("SCAFFOLD"), grid)
    versions: list[dict[int, Any]] = []

    def down_in_round_one(module: Any, round_idx: int) -> None:
        versions.append({c: module.engine.store.get(c, STATE_VERSION) for c in range(CLIENTS)})
        grid.down = {22} if round_idx == 0 else set()

    counted: list[float] = []

    class Count(pl.Callback):
        def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: Any) -> None:
            counted.append(float(trainer.callback_metrics[LEFT_OUT]))

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer(ROUNDS, callbacks=[AtRoundEnd(down_in_round_one), Count()]).fit(module, synthetic(CLIENTS))
    left = [str(w.message) for w in caught if "left out" in str(w.message)]
    round_one = module.engine.sample_round(1)
    assert left == [f"round 1: client {c} is left out of the round: no node holds it now" for c in round_one
                    if c % 2 == 1]
    assert counted == [0.0, float(len(left)), 0.0] and left
    for c in round_one:
        if c % 2 == 1:  # its state did not advance in round 1
            assert versions[1][c] is None or versions[1][c] == versions[0][c]


def test_a_node_that_does_not_answer_which_clients_it_holds_is_asked_again_at_the_next_round():
    """Node 22 down in round 1, back in round 2 but too slow to answer the server's question (its answer lost):
    its clients are left out of round 2 too, and it is asked again in round 3, which includes them."""
    class Grid(LocalGrid):
        mute: set[int] = set()

        def send_and_receive(self, messages: Any, *, timeout: Any = None) -> Any:
            replies = list(super().send_and_receive(messages, timeout=timeout))
            muted = [r for r in replies if r.metadata.src_node_id in self.mute
                     and r.metadata.message_type == "query.clients"]
            self.mute = self.mute - {r.metadata.src_node_id for r in muted}
            return [r for r in replies if r not in muted]

    grid, _ = deployment("SCAFFOLD", Grid)
    module = deploy(build("SCAFFOLD"), grid)
    rounds = 4

    def down_in_round_one(module: Any, round_idx: int) -> None:
        grid.down = {22} if round_idx == 0 else set()
        grid.mute = {22} if round_idx == 1 else grid.mute

    counted: list[float] = []

    class Count(pl.Callback):
        def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: Any) -> None:
            counted.append(float(trainer.callback_metrics[LEFT_OUT]))

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer(rounds, callbacks=[AtRoundEnd(down_in_round_one), Count()]).fit(module, synthetic(CLIENTS))
    odd = [sum(c % 2 for c in module.engine.sample_round(r)) for r in range(rounds)]  # node 22's clients a round
    assert odd[1] and odd[2] and odd[3], odd
    assert counted == [0.0, odd[1], odd[2], 0.0]


def test_an_update_the_server_drops_does_not_advance_the_client_s_state():
    class Grid(TamperingGrid):
        tamper = staticmethod(lambda reply: _config(reply).__setitem__("state_finite", False))

    grid, nodes = deployment("SCAFFOLD", Grid)
    module = deploy(build("SCAFFOLD"), grid)
    before: dict[int, Any] = {}

    def record(module: Any, round_idx: int) -> None:  # the versions before the round (after the one before it)
        if round_idx == Grid.ROUND - 1:
            before.update({c: module.engine.store.get(c, STATE_VERSION) for c in range(CLIENTS)})

    with pytest.warns(RuntimeWarning, match="contains NaN or Inf"):
        fit(module, Grid.ROUND + 1, callbacks=[AtRoundEnd(record)])
    for c in module.engine.sample_round(Grid.ROUND):
        after = module.engine.store.get(c, STATE_VERSION)
        assert (after is None and before[c] is None) or torch.equal(after, before[c])


def test_a_node_keeps_only_the_two_latest_versions_of_a_client_s_state():
    """After every round each client's folder holds the version the server names and at most one more (the
    one a job named when the server dropped the round that wrote the newer one), not a file per round."""
    class Grid(TamperingGrid):  # round 3's updates dropped (clients 1 and 3, both trained before): never named
        ROUND = 3
        tamper = staticmethod(lambda reply: _config(reply).__setitem__("state_finite", False))

    grid, nodes = deployment("SCAFFOLD", Grid)
    module = deploy(build("SCAFFOLD"), grid)
    rounds = 6
    on_disk: list[dict[int, tuple[Any, list[int]]]] = []

    def record(module: Any, round_idx: int) -> None:
        held = {c: node for node in nodes.values() for c in node.clients}  # the nodes are built at their first message
        named = {c: module.engine.store.get(c, STATE_VERSION) for c in range(CLIENTS)}
        on_disk.append({c: (None if v is None else int(v), held[c].store.versions(c)) for c, v in named.items()})

    with pytest.warns(RuntimeWarning, match="contains NaN or Inf"):
        fit(module, rounds, callbacks=[AtRoundEnd(record)])
    trained = [sum(c in module.engine.sample_round(r) for r in range(rounds)) for c in range(CLIENTS)]
    assert max(trained) >= 3, "no client trained three times: every round's file would still be two"
    dropped_kept = False
    for r, clients in enumerate(on_disk):
        for c, (named, versions) in clients.items():
            assert len(versions) <= 2, (r, c, versions)
            if named is not None:
                assert named in versions, (r, c, named, versions)
            dropped_kept |= named is not None and Grid.ROUND in versions and named != Grid.ROUND
    assert dropped_kept, "no dropped round's state was kept beside the named one"


def test_a_node_refuses_a_client_it_does_not_hold():
    grid, nodes = deployment("FedAvg")
    module = deploy(build("FedAvg"), grid)
    fit(module, 1)
    node = nodes[11]
    from fl_lightning.deployment.messages import TRAIN, Job, job_content
    job = Job(1, 0, module.global_model.flatten(), {}, 2, None, [0.1], "32-true", -1)
    reply = node.handle(Message(job_content(job), 11, TRAIN))
    assert reply.has_error() and "client 1 is not held by this node" in reply.error.reason


APP = Path(__file__).resolve().parents[1] / "configs" / "deployment"


def final_state(root: str) -> dict[str, torch.Tensor]:
    """The model's state in the last round checkpoint of the run under ``root``."""
    (path,) = Path(root).glob("lightning_logs/version_*/checkpoints/last.ckpt")
    return load_checkpoint(path)["state_dict"]


def history(root: str) -> list[dict[str, str]]:
    """The rows of the history of the run under ``root``."""
    (path,) = Path(root).glob("lightning_logs/version_*/history.csv")
    with open(path) as file:
        return list(csv.DictReader(file))


def test_the_flower_app_runs_the_fit_yaml_with_the_simulation_s_bits(capsys, monkeypatch):
    simulated, deployed = scratch_folder(), scratch_folder()
    main(["fit", "--config", str(APP / "scaffold.yaml"), f"--trainer.default_root_dir={simulated}"])
    app = runpy.run_path(str(APP / "app.py"))
    state = scratch_folder()
    nodes = {11: {"clients": "0,2", "state-dir": f"{state}/a"}, 22: {"clients": "1,3", "state-dir": f"{state}/b"}}
    monkeypatch.chdir(deployed)  # the ServerApp's folder: a relative root is resolved against it
    run_config = {"config": "scaffold.yaml", "args": "--trainer.default_root_dir=run", "timeout": 0}
    grid = LocalGrid({n: app["client"] for n in nodes}, nodes, run_config)
    capsys.readouterr()
    app["server"](grid, Context(run_id=1, node_id=0, node_config={}, state=RecordDict(), run_config=run_config))
    deployed = f"{deployed}/run"
    assert (f"fl-lightning fit (deployed, in Flower's ServerApp): writing into {deployed}/lightning_logs/version_0"
            in capsys.readouterr().out)
    expected, got = final_state(simulated), final_state(deployed)
    assert expected.keys() == got.keys() and expected
    for key, value in expected.items():
        assert torch.equal(got[key], value), key
    # the history as a simulation's (train_loss too: the client module's self.log calls come back from the nodes),
    # and the deployment's round/left_out
    rows, deployed_rows = history(simulated), history(deployed)
    assert "train_loss" in rows[0] and len(rows) == 3
    assert [{k: v for k, v in row.items() if k != LEFT_OUT} for row in deployed_rows] == rows
    assert [row[LEFT_OUT] for row in deployed_rows] == ["0.0"] * 3


def test_a_node_without_its_node_config_says_what_it_lacks():
    with pytest.raises(ValueError, match=r"--node-config lacks \['state-dir'\]"):
        build_node(str(APP), Context(run_id=1, node_id=3, node_config={"clients": "0"}, state=RecordDict(),
                                     run_config={"config": "scaffold.yaml"}))


def test_the_run_config_needs_the_yaml_and_a_timeout_in_seconds():
    with pytest.raises(ValueError, match="the run config needs 'config'"):
        cli_args(str(APP), {"args": "--trainer.max_epochs=1"})
    with pytest.raises(ValueError, match="'timeout' must be seconds >= 0"):
        round_timeout({"timeout": -1})
    assert round_timeout({"timeout": 0}) is None and round_timeout({"timeout": 2.5}) == 2.5


def test_a_node_runs_the_round_on_the_server_fit_s_cpu_threads(monkeypatch):
    """The simulation's bits on a node whose torch starts with more threads than the fit runs."""
    grid, nodes = deployment("FedAvg")
    module = deploy(build("FedAvg"), grid)
    seen: list[tuple[int, int]] = []
    import fl_lightning.deployment.node as node_module
    run = node_module.run_client

    def recording(*args: Any, **kwargs: Any) -> Any:
        seen.append((torch.get_num_threads(), job_threads[-1]))
        return run(*args, **kwargs)

    job_threads: list[int] = []
    read = node_module.read_job

    def reading(content: Any) -> Any:
        job = read(content)
        job_threads.append(job.threads)
        torch.set_num_threads(job.threads + 1)  # the node's own count differs from the server fit's
        return job

    monkeypatch.setattr(node_module, "run_client", recording)
    monkeypatch.setattr(node_module, "read_job", reading)
    threads = torch.get_num_threads()
    try:
        fit(module, 1)
    finally:
        torch.set_num_threads(threads)
    assert seen and all(running == sent for running, sent in seen), seen


def wire(content: RecordDict) -> RecordDict:
    """``content`` after Flower's wire form (each object deflated to bytes, the whole inflated back)."""
    from flwr.supercore.inflatable.inflatable_object import get_all_nested_objects
    from flwr.supercore.inflatable.inflatable_utils import inflate_object_from_contents
    contents = {object_id: obj.deflate() for object_id, obj in get_all_nested_objects(content).items()}
    inflated = inflate_object_from_contents(content.object_id, contents)
    assert isinstance(inflated, RecordDict)
    return inflated


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn, torch.float16, torch.float64])
def test_a_job_s_tensors_of_any_dtype_come_back_bitwise(dtype):
    """The start model, broadcast state and default entries keep their dtype and bits, also those NumPy lacks
    (bfloat16, float8: sent as their raw bits), NaN and -0.0 included."""
    from fl_lightning.deployment.messages import Job, job_content, read_job
    values = torch.tensor([1.0, -0.0, float("nan"), 3.140625, -1e-3, 448.0])
    start, control, default = values.to(dtype), values.reshape(2, 3).to(dtype), values[:2].to(dtype)
    job = Job(3, 2, start, {"control": control}, 4, None, [0.1], "bf16-mixed", 1, {"c_i": default})
    got = read_job(wire(job_content(job)))
    width = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[start.element_size()]
    for sent, came in ((start, got.start), (control, got.broadcast["control"]), (default, got.defaults["c_i"])):
        assert came.dtype == dtype and came.shape == sent.shape
        assert torch.equal(came.view(width), sent.view(width))


def test_an_array_that_names_no_torch_dtype_is_refused():
    from flwr.app import Array, ArrayRecord

    from fl_lightning.deployment.messages import tensors_of
    bits = Array(torch.zeros(2, dtype=torch.int16).numpy())
    for dtype in ("torch.no_such_dtype", "torch.float32"):  # not a dtype; a dtype of another width than the data
        with pytest.raises(ValueError, match="must be a torch dtype and the data its raw bits"):
            tensors_of(ArrayRecord({"x": Array(dtype, bits.shape, bits.stype, bits.data)}))


#: a fresh interpreter where torchvision is not installed (not importable, no distribution), importing the node
NO_TORCHVISION = """
import importlib.abc
import importlib.metadata
import sys


class NotInstalled(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] == "torchvision":
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None


installed = importlib.metadata.version


def version(name):
    if name == "torchvision":
        raise importlib.metadata.PackageNotFoundError(name)
    return installed(name)


sys.meta_path.insert(0, NotInstalled())
importlib.metadata.version = version
import fl_lightning.deployment.node

assert "torchvision" not in sys.modules, sorted(m for m in sys.modules if m.startswith("torchvision"))
print("imported")
"""


def test_a_node_s_process_needs_no_torchvision():
    """fl_lightning imports torchvision only where a vision dataset is used: a node's process imports without it
    (where it is installed, torchmetrics imports it: Lightning imports torchmetrics, docs/deployment.md). A real
    interpreter: the tests' fresh processes (tests.fresh_python) are forked from one that imported torchvision."""
    import subprocess
    import sys
    root = Path(__file__).resolve().parents[1]
    done = subprocess.run([sys.executable, "-c", NO_TORCHVISION], capture_output=True, text=True, cwd=root,
                          env={**os.environ, "PYTHONPATH": str(root)}, timeout=600)
    assert done.returncode == 0 and done.stdout.strip() == "imported", done.stderr[-3000:]


class Uploads(FederatedCallback):
    """Records each update the round keeps, as the callbacks before it left it: ``{(round, client): uploads}``."""

    def __init__(self) -> None:
        self.seen: dict[tuple[int, int], dict[str, torch.Tensor]] = {}

    def on_client_update(self, trainer: pl.Trainer, module: Any, update: ClientUpdate) -> ClientUpdate:
        self.seen[module.current_epoch, update.client_id] = dict(update.tensors)
        return update


class ReplyUploads(LocalGrid):
    """Records the uploads of each reply as it left its node: ``{(round, client): uploads}``."""

    sent: dict[tuple[int, int], dict[str, torch.Tensor]]

    def send_and_receive(self, messages: Any, *, timeout: Any = None) -> Any:
        replies = list(super().send_and_receive(messages, timeout=timeout))
        for reply in replies:
            if not reply.has_error() and "uploads" in reply.content.array_records:
                config = _config(reply)
                uploads = reply.content.array_records["uploads"]
                self.sent[int(config["round"]), int(config["client"])] = {
                    name: torch.from_numpy(array.numpy().copy()) for name, array in uploads.items()}
        return replies


def private(mode: str) -> DifferentialPrivacy:
    return DifferentialPrivacy(clip_norm=0.1, noise_multiplier=1.0, mode=mode)  # below the updates' norms


def uniform_fedavg() -> FederatedModule:
    torch.manual_seed(0)
    return FedAvg(tiny_client(hidden=(8,)), clients_per_round=PER_ROUND, local_steps=2, seed=SEED, weighting="uniform")


def private_deployment(node_mode: Optional[str]) -> tuple[ReplyUploads, dict[int, ClientNode]]:
    """:func:`deployment` of uniform FedAvg, each node built with a ``DifferentialPrivacy`` of ``node_mode``
    (None: none)."""
    folder = scratch_folder()

    def node(context: Any) -> ClientNode:
        callbacks = [] if node_mode is None else [private(node_mode)]
        return ClientNode(uniform_fedavg(), synthetic(CLIENTS), node_clients(context.node_config["clients"]),
                          f"{folder}/node_{context.node_id}", callbacks=callbacks)

    nodes: dict[int, ClientNode] = {}
    grid = ReplyUploads({n: client_app(node, nodes) for n in NODES}, NODES)
    grid.sent = {}
    return grid, nodes


@pytest.mark.parametrize("mode", ["local", "central"])
def test_differential_privacy_gives_the_simulation_s_bits_its_local_mode_on_the_nodes(mode):
    """Local mode: each node clips and noises its update before it leaves (the reply carries the simulation's
    privatized update, bit for bit) and the server passes it on; central mode: the server clips and noises,
    as in a simulation. Either way the simulation's global model, bit for bit."""
    simulated, deployed = Uploads(), Uploads()
    simulation = uniform_fedavg()
    trainer(ROUNDS, callbacks=[private(mode), simulated]).fit(simulation, synthetic(CLIENTS))
    grid, nodes = private_deployment(mode)
    module = deploy(uniform_fedavg(), grid)
    trainer(ROUNDS, callbacks=[private(mode), deployed]).fit(module, synthetic(CLIENTS))
    assert torch.equal(global_vector(module), global_vector(simulation))
    assert simulated.seen.keys() == deployed.seen.keys() == grid.sent.keys() and len(grid.sent) == ROUNDS * PER_ROUND
    for key, uploads in simulated.seen.items():
        for name, value in uploads.items():
            assert torch.equal(deployed.seen[key][name], value), key
            # local: what left the node is the privatized update; central: the node's raw update, clipped after
            assert torch.equal(grid.sent[key][name], value) == (mode == "local"), key
    assert all(node.privacy for node in nodes.values()) == (mode == "local")


def test_an_update_from_a_node_without_the_run_s_local_privacy_is_refused():
    grid, _ = private_deployment(None)
    module = deploy(uniform_fedavg(), grid)
    counts: list[int] = []
    with pytest.warns(RuntimeWarning, match=r"applied local differential privacy \(clip norm, noise multiplier\) "
                                            r"none, the run's is \[0.1, 1.0\]"):
        trainer(1, callbacks=[private("local"), AtRoundEnd(lambda m, r: counts.append(m.engine.round_num_updates))]
                ).fit(module, synthetic(CLIENTS))
    assert counts == [0] and grid.sent  # the nodes answered; nothing was aggregated


def test_a_node_built_from_the_yaml_applies_its_local_privacy():
    extra = Path(scratch_folder()) / "private.yaml"
    extra.write_text("trainer:\n  callbacks:\n  - class_path: fl_lightning.callbacks.DifferentialPrivacy\n"
                     "    init_args: {clip_norm: 0.1, noise_multiplier: 1.0, mode: local}\n")
    config = {"clients": "0", "state-dir": scratch_folder()}
    node = build_node(str(APP), Context(run_id=1, node_id=3, node_config=config, state=RecordDict(),
                                        run_config={"config": f"scaffold.yaml,{extra}"}))
    assert [(cb.clip_norm, cb.noise_multiplier, cb.mode) for cb in node.privacy] == [(0.1, 1.0, "local")]


def client_folders(data: Any, nodes: dict[int, dict[str, str]]) -> dict[Any, str]:
    """``data``'s client files: every client's (``"all"``, a simulation's), the index alone (``"server"``) and each
    node's own clients' (by node id)."""
    folders = {"all": scratch_folder(), "server": scratch_folder()}
    write_client_files(data, folders["all"])
    write_client_files(data, folders["server"], [])
    for node, config in nodes.items():
        folders[node] = scratch_folder()
        write_client_files(data, folders[node], node_clients(config["clients"]))
    return folders


@pytest.mark.parametrize("name", list(ALGORITHMS))
def test_the_server_reads_only_the_index_each_node_its_own_files_the_simulation_s_bits(name):
    """The clients' files of a partition (write_client_files, with unseen clients): the server's folder holds only
    the index, each node's the index and its own clients' files; sampling, weighting and the partition's record are
    the index's, and the run gives the simulation's bits. Without read_index_only the server would open a client's
    file, which its folder does not have."""
    folders = client_folders(synthetic(CLIENTS, unseen_fraction=0.2, val_fraction=0.2), NODES)
    assert sorted(os.listdir(folders["server"])) == ["index.json"]
    simulation = build(name)
    simulated = ClientFilesFederated(folders["all"], batch_size=16)
    trainer(ROUNDS).fit(simulation, simulated)
    state = scratch_folder()

    def node(context: Any) -> ClientNode:
        return ClientNode(build(name), ClientFilesFederated(folders[context.node_id], batch_size=16),
                          node_clients(context.node_config["clients"]), f"{state}/node_{context.node_id}")

    nodes: dict[int, ClientNode] = {}
    grid = LocalGrid({n: client_app(node, nodes) for n in NODES}, NODES)
    with pytest.raises(FileNotFoundError, match="client_"):  # the test would see a server that opens a client's file
        trainer(ROUNDS).fit(deploy(build(name), grid), ClientFilesFederated(folders["server"], batch_size=16))
    server = ClientFilesFederated(folders["server"], batch_size=16)
    module = deploy(build(name), grid, datamodule=server)
    with pytest.warns(UserWarning, match="reads only the index .* the server's validation is skipped"):
        trainer(ROUNDS).fit(module, server)
    assert torch.equal(global_vector(module), global_vector(simulation))
    for key, value in broadcast_state(simulation).items():  # SCAFFOLD's server control variate
        assert torch.equal(broadcast_state(module)[key], value), key
    assert server.index_only and server.pool is None
    assert server.train_clients == simulated.train_clients and len(server.train_clients) < CLIENTS
    assert [server.num_samples(c) for c in range(CLIENTS)] == [simulated.num_samples(c) for c in range(CLIENTS)]
    assert server.partition_hash() == simulated.partition_hash()
    assert server.partition_record() == simulated.partition_record()
    for node_id, built in nodes.items():
        held = node_clients(NODES[node_id]["clients"])
        data = built.datamodule
        assert sorted(os.listdir(folders[node_id])) == sorted(["index.json", *(f"client_{c}.pt" for c in held)])
        assert [c for c in range(CLIENTS) if len(data.splits["train"][c])] == held  # only its own clients' data
        assert data.partition_hash() == simulated.partition_hash()


def test_client_files_read_back_the_datamodule_s_splits():
    source = synthetic(CLIENTS, unseen_fraction=0.4, val_fraction=0.2, test_fraction=0.1)
    folder = scratch_folder()
    index = write_client_files(source, folder)
    assert index == ClientIndex.read(folder)
    read = ClientFilesFederated(folder, batch_size=16)
    read.setup("fit")
    for split in ("train", "val", "test"):
        for c in range(CLIENTS):
            expected, got = source.client_data(c, split), read.client_data(c, split)
            assert len(got) == len(expected) == read.split_size(c, split)
            for mine, theirs in zip(got.dataset.tensors, expected.dataset.tensors):
                assert torch.equal(mine[got.indices], theirs[expected.indices]), (split, c)
    assert (read.train_clients, read.unseen_clients) == (source.train_clients, source.unseen_clients)
    assert [read.label_histogram(c).tolist() for c in range(CLIENTS)] == \
        [source.label_histogram(c).tolist() for c in range(CLIENTS)]
    assert read.describe_targets() == source.describe_targets()
    some = ClientFilesFederated(folder)
    with pytest.raises(ValueError, match=r"clients must be one or more of the client ids of .*index.json, \[0, 6\), "
                                         r"got \[0, 6\] \(\[6\] not in it\)"):
        some.select_clients([0, 6])
    with pytest.raises(ValueError, match="has no index.json"):
        ClientFilesFederated(scratch_folder())


def test_a_datamodule_that_reads_only_the_index_holds_no_client_data_and_says_so():
    source = synthetic(CLIENTS)
    folder = scratch_folder()
    write_client_files(source, folder, [])
    data = ClientFilesFederated(folder, batch_size=16)
    data.read_index_only()
    data.setup("fit")
    assert data.pool is None and not any(data.holds_data(c) for c in range(CLIENTS))
    assert [data.label_histogram(c).tolist() for c in range(CLIENTS)] == \
        [source.label_histogram(c).tolist() for c in range(CLIENTS)]
    assert "6 clients, 6 training / 0 unseen, the index of" in data.summary()
    with pytest.raises(ValueError, match=r"client_id must be a client whose file is read here: .* reads only the "
                                         r"index, got 2 \(its data are on the node that holds it\)"):
        data.client_data(2)
    with pytest.raises(ValueError, match="has no global test set .* reads only the index"):
        data.global_test_set()
    with pytest.warns(UserWarning, match="the server's validation is skipped"):
        assert len(data.validation_set()) == 0
    with pytest.raises(ValueError, match="read_index_only must come before setup"):
        data.read_index_only()


class WithTestSet(SyntheticFederated):
    """Generated clients and a global test set of 30 samples."""

    def build_datasets(self) -> tuple[Any, Any]:
        pool, _ = super().build_datasets()
        return pool, TensorDataset(torch.randn(30, 20, generator=torch.Generator().manual_seed(1)),
                                   torch.arange(30) % 10)


def test_the_global_test_set_is_written_beside_the_index_and_a_server_that_reads_only_the_index_tests_on_it():
    source = WithTestSet(num_clients=3, dim=20, min_samples=20, max_samples=40, batch_size=16)
    folder, everything = scratch_folder(), scratch_folder()
    write_client_files(source, folder, [])
    write_client_files(source, everything)
    assert sorted(os.listdir(folder)) == ["index.json", "test_set.pt"]
    data = ClientFilesFederated(folder)
    data.read_index_only()
    module = build("FedAvg")
    tested = trainer(1).test(module, data)
    for mine, theirs in zip(data.global_test_set().tensors, source.test_set.tensors):
        assert torch.equal(mine, theirs)
    assert tested[0] and tested == trainer(1).test(module, ClientFilesFederated(everything))
    assert tested == trainer(1).test(module, source)
    os.remove(f"{folder}/test_set.pt")
    data = ClientFilesFederated(folder)
    with pytest.raises(ValueError, match="must hold the global test set that its index.json names, test_set.pt"):
        data.global_test_set()


def rewrite_index(folder: str, change: Callable[[dict], Any]) -> None:
    with open(f"{folder}/index.json") as file:
        index = json.load(file)
    change(index)
    with open(f"{folder}/index.json", "w") as file:
        json.dump(index, file)


@pytest.mark.parametrize("change, message", [
    (lambda index: index.pop("version"), r"'version' must be 1, got '<missing>'"),
    (lambda index: index.update(num_clients=0), r"'num_clients' must be an integer >= 1, got 0"),
    (lambda index: index["samples"]["val"].pop(), r"'samples' must be .*each 6 sample counts \(integers >= 0\)"),
    (lambda index: index["samples"]["train"].__setitem__(0, -1), r"'samples' must be"),
    (lambda index: index.update(unseen_clients=[7]), r"'unseen_clients' must be a list of client ids in \[0, 6\)"),
    (lambda index: index.update(checksums=["crc32:0"]), r"'checksums' must be 6 strings"),
    (lambda index: index.update(label_counts=[[1, 2]]), r"'label_counts' must be null or 6 lists"),
    (lambda index: index.update(test_set="test_set.pt"), r"'test_set' must be true or false, got 'test_set.pt'"),
])
def test_a_malformed_index_is_refused_naming_the_field_its_value_and_what_it_must_be(change, message):
    folder = scratch_folder()
    write_client_files(synthetic(CLIENTS), folder)
    rewrite_index(folder, change)
    with pytest.raises(ValueError, match=rf"index.json: {message}"):
        ClientFilesFederated(folder)


def test_an_index_that_is_not_json_is_refused():
    folder = scratch_folder()
    Path(folder, "index.json").write_text("{'num_clients': 2")
    with pytest.raises(ValueError, match="index.json must be the JSON index that write_client_files writes"):
        ClientFilesFederated(folder)


def test_a_client_file_that_is_not_the_index_s_is_refused():
    folder = scratch_folder()
    write_client_files(synthetic(CLIENTS), folder)
    path = f"{folder}/client_1.pt"
    written = torch.load(path, weights_only=True)
    torch.save({**written, "train": [t[1:] for t in written["train"]]}, path)  # a sample fewer than the index's
    with pytest.raises(ValueError, match=r"client_1.pt must hold client 1's splits as \{split: \[tensor, ...\]\} of "
                                         r"\{'train': \d+, 'val': \d+, 'test': \d+\} samples \(the index's\), got"):
        ClientFilesFederated(folder).setup("fit")
    torch.save({**written, "train": [written["train"][0] + 1, written["train"][1]]}, path)  # the counts, other data
    with pytest.raises(ValueError, match=r"client_1.pt must be the file of client 1 that index.json names "
                                         r"\(checksum crc32:\w+\), got one whose checksum is crc32:\w+"):
        ClientFilesFederated(folder).setup("fit")


def test_a_node_config_naming_a_client_the_index_does_not_have_is_refused():
    folder = scratch_folder()
    write_client_files(synthetic(CLIENTS), folder, [0])
    with pytest.raises(ValueError, match=r"clients must be one or more of the client ids of .*index.json, \[0, 6\), "
                                         r"got \[0, 9\] \(\[9\] not in it\)"):
        ClientNode(build("FedAvg"), ClientFilesFederated(folder), [0, 9], scratch_folder())


def test_the_flower_app_s_server_reads_the_index_and_its_nodes_their_own_client_files():
    """The app's YAML with ClientFilesFederated: the server's folder holds only the index, each node's the index and
    its own clients' files (the folder its node config's ``args`` names); the simulation's bits."""
    simulated, deployed = scratch_folder(), scratch_folder()
    main(["fit", "--config", str(APP / "scaffold.yaml"), f"--trainer.default_root_dir={simulated}"])
    data = SyntheticFederated(num_clients=4, dim=20, min_samples=20, max_samples=60, batch_size=16, seed=0)  # YAML's
    nodes = {11: {"clients": "0,2"}, 22: {"clients": "1,3"}}
    folders = client_folders(data, nodes)
    for node, config in nodes.items():
        config.update({"state-dir": f"{folders[node]}/state", "args": f"--data.init_args.root={folders[node]}"})
    server = runpy.run_path(str(APP / "app.py"))["server"]
    run_config = {"config": "scaffold.yaml", "timeout": 0,
                  "args": f"--trainer.default_root_dir={deployed} --data=fl_lightning.datamodules.ClientFilesFederated "
                          f"--data.root={folders['server']} --data.batch_size=16"}
    built: dict[int, ClientNode] = {}
    grid = LocalGrid({n: client_app(lambda context: build_node(str(APP), context), built) for n in nodes}, nodes,
                     run_config)  # the app's ClientApp, its nodes kept to look at
    server(grid, Context(run_id=1, node_id=0, node_config={}, state=RecordDict(), run_config=run_config))
    assert sorted(os.listdir(folders["server"])) == ["index.json"]
    expected, got = final_state(simulated), final_state(deployed)
    assert expected.keys() == got.keys() and expected
    for key, value in expected.items():
        assert torch.equal(got[key], value), key
    assert {n: node.datamodule.root for n, node in built.items()} == {n: folders[n] for n in nodes}
    with open(next(Path(deployed).glob("lightning_logs/version_*/partition.json"))) as file:
        assert json.load(file) == ClientFilesFederated(folders["all"]).partition_record()


def test_the_index_the_how_to_shows_is_the_one_written():
    page = (Path(__file__).resolve().parents[1] / "docs" / "deployment.md").read_text()
    (shown,) = re.findall(r"```json\n(.*?)```", page, re.S)
    folder = scratch_folder()
    write_client_files(SyntheticFederated(num_clients=2, dim=20, min_samples=20, max_samples=60, seed=0), folder)
    assert json.loads(Path(folder, "index.json").read_text()) == json.loads(shown)
