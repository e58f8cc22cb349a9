"""Flower apps for ``benchmarks/frameworks.py``: the same FedAvg work in Flower's simulation engine.

Two clients, as Flower's examples write them: a plain-torch ``NumPyClient`` (the local loop of
the hand-written benchmark: the same keyed mini-batches) and a Lightning client (a new
``Trainer`` per ``fit``, as Flower's PyTorch Lightning example). The server is Flower's ``FedAvg``
with ``fraction_fit`` giving the workload's clients per round; a round's time is read from the
server-side evaluation hook, which Flower calls after every round. Importable by Ray's workers
(the benchmarks folder goes on ``PYTHONPATH``).
"""

from __future__ import annotations

import os
import statistics
import time
from typing import Any

import numpy as np
import pytorch_lightning as pl
import torch
import torch.nn.functional as F
from flwr.client import ClientApp, NumPyClient
from flwr.common import Context, ndarrays_to_parameters
from flwr.server import ServerApp, ServerAppComponents, ServerConfig
from flwr.server.strategy import FedAvg
from flwr.simulation import run_simulation
from torch.utils.data import DataLoader, Subset

from fl_lightning.seeding import generator

_CACHE: dict[str, Any] = {}


def workload(name: str) -> Any:
    """The workload and its datamodule, built once per process."""
    if name not in _CACHE:
        from frameworks import WORKLOADS

        w = WORKLOADS[name]
        _CACHE[name] = (w, w.datamodule())
    return _CACHE[name]


def get_weights(model: torch.nn.Module) -> list[np.ndarray]:
    return [v.detach().cpu().numpy() for v in model.state_dict().values()]


def set_weights(model: torch.nn.Module, weights: list[np.ndarray]) -> None:
    model.load_state_dict({k: torch.from_numpy(np.asarray(v)) for k, v in zip(model.state_dict(), weights)})


class TorchClient(NumPyClient):
    """``local_steps`` plain SGD steps on the client's keyed mini-batches."""

    def __init__(self, name: str, cid: int, threads: int) -> None:
        self.name, self.cid, self.threads = name, cid, threads

    def fit(self, parameters: list[np.ndarray], config: dict[str, Any]) -> tuple[list[np.ndarray], int, dict]:
        torch.set_num_threads(self.threads)
        w, dm = workload(self.name)
        model = w.client()
        set_weights(model, parameters)
        data = dm.client_data(self.cid, "train")
        opt = torch.optim.SGD(model.parameters(), lr=model.lr)
        for x, y in data.step_batches(w.local_steps, generator(0, "batches", int(config.get("round", 0)), self.cid)):
            opt.zero_grad()
            F.cross_entropy(model(x), y).backward()
            opt.step()
        return get_weights(model), len(data), {}


class LightningClient(NumPyClient):
    """A new ``Trainer`` per ``fit`` for ``local_steps`` steps (Flower's Lightning example)."""

    def __init__(self, name: str, cid: int, threads: int) -> None:
        self.name, self.cid, self.threads = name, cid, threads

    def fit(self, parameters: list[np.ndarray], config: dict[str, Any]) -> tuple[list[np.ndarray], int, dict]:
        torch.set_num_threads(self.threads)
        w, dm = workload(self.name)
        model = w.client()
        set_weights(model, parameters)
        data = Subset(dm.pool, dm.splits["train"][self.cid].tolist())
        loader = DataLoader(data, batch_size=dm.batch_size, shuffle=True,
                            generator=generator(0, "batches", int(config.get("round", 0)), self.cid))
        trainer = pl.Trainer(max_steps=w.local_steps, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                             enable_model_summary=False, accelerator="cpu", num_sanity_val_steps=0)
        trainer.fit(model, loader)
        return get_weights(model), len(data), {}


def run(name: str, rounds: int, lightning: bool, threads: int) -> float:
    """Seconds per round of ``rounds`` rounds (after a warm-up round) of the workload in Flower's
    simulation, one Ray actor per core."""
    w, dm = workload(name)
    cores = os.cpu_count() or 1
    per_actor = max(1, threads // cores)
    os.environ["PYTHONPATH"] = os.pathsep.join(
        [os.path.dirname(os.path.abspath(__file__)), os.environ.get("PYTHONPATH", "")])
    stamps: list[float] = []

    def evaluate(server_round: int, parameters: Any, config: dict) -> None:
        stamps.append(time.perf_counter())
        return None

    torch.manual_seed(0)
    strategy = FedAvg(
        fraction_fit=w.clients_per_round / dm.num_clients, min_fit_clients=w.clients_per_round,
        min_available_clients=dm.num_clients, fraction_evaluate=0.0, min_evaluate_clients=0, evaluate_fn=evaluate,
        on_fit_config_fn=lambda r: {"round": r - 1}, initial_parameters=ndarrays_to_parameters(get_weights(w.client())),
    )
    client = LightningClient if lightning else TorchClient

    def client_fn(context: Context) -> Any:
        return client(name, int(context.node_config["partition-id"]), per_actor).to_client()

    def server_fn(context: Context) -> ServerAppComponents:
        return ServerAppComponents(strategy=strategy, config=ServerConfig(num_rounds=rounds + 1))

    run_simulation(ServerApp(server_fn=server_fn), ClientApp(client_fn=client_fn), num_supernodes=dm.num_clients,
                   backend_config={"client_resources": {"num_cpus": 1, "num_gpus": 0.0},
                                   "init_args": {"num_cpus": cores, "include_dashboard": False}})
    # stamps: after round 0 (the initial model), then after each round; the first round warms up
    per_round = [b - a for a, b in zip(stamps[1:], stamps[2:])]
    return statistics.mean(per_round)
