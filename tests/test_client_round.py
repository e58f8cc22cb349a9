"""A client's round without a Trainer (``fl_lightning.backends.run_client``): the same bits as the client's
round in a fit, from the start model, state entries and broadcast state the fit gave it."""

from __future__ import annotations

from typing import Any, Callable

import pytest
import torch

from fl_lightning.algorithms import RAGA, SCAFFOLD, FedAvg, FedDRO, FedProx
from fl_lightning.backends import LocalSettings, run_client
from fl_lightning.functional.dro import KLDRO
from fl_lightning.lightning_compat import attached_trainer
from fl_lightning.module import FederatedModule
from fl_lightning.testing.properties import RoundRecorder
from tests.helpers import synthetic, tiny_client, trainer

CLIENTS, ROUNDS, ROUND = 6, 2, 1

#: algorithms whose client hooks read nothing of a Trainer, with their local settings (RAGA: a learning rate
#: scheduled over rounds)
CASES: dict[str, tuple[Callable[[], FederatedModule], dict[str, Any]]] = {
    "FedAvg": (lambda: FedAvg(tiny_client(hidden=(8,)), clients_per_round=3, local_steps=3), {"steps": 3}),
    "FedAvg-epochs": (lambda: FedAvg(tiny_client(hidden=(8,)), clients_per_round=3, local_epochs=1), {"epochs": 1}),
    "FedProx": (lambda: FedProx(tiny_client(hidden=(8,)), mu=0.1, clients_per_round=3, local_steps=2), {"steps": 2}),
    "SCAFFOLD": (lambda: SCAFFOLD(tiny_client(hidden=(8,)), clients_per_round=4, local_steps=2), {"steps": 2}),
    "RAGA": (lambda: RAGA(tiny_client(hidden=(8,)), clients_per_round=3, local_steps=2), {"steps": 2}),
}


def build(name: str) -> FederatedModule:
    torch.manual_seed(0)
    return CASES[name][0]()


@pytest.mark.parametrize("name", list(CASES))
def test_a_client_round_without_a_trainer_is_the_fit_s(name):
    recorder = RoundRecorder(ROUND)
    trainer(ROUNDS, callbacks=[recorder]).fit(build(name), synthetic(CLIENTS))
    assert recorder.results, "the fit ran no client in the recorded round"
    node, data = build(name), synthetic(CLIENTS)  # a node's own copy of the algorithm and its data
    data.setup("fit")
    settings = LocalSettings(**CASES[name][1], lrs=recorder.lrs)
    for client_id, (update, state) in sorted(recorder.results.items()):
        result = run_client(node, client_id, ROUND, recorder.start, recorder.states[client_id], settings,
                            data.client_data(client_id, "train"), broadcast=recorder.broadcast)
        assert attached_trainer(node) is None
        assert result.uploads.keys() == update.tensors.keys()
        for key, value in update.tensors.items():
            assert torch.equal(result.uploads[key], value), (client_id, key)
        assert result.state.keys() == state.keys()
        for key, value in state.items():
            assert torch.equal(result.state[key], value), (client_id, key)
        assert torch.equal(torch.as_tensor(result.metrics["loss"]), torch.as_tensor(update.metrics["loss"]))
        assert result.metrics["steps"] == update.metrics["steps"]
        assert result.update.num_samples == update.num_samples


def test_mixed_precision_is_the_fit_s():
    recorder = RoundRecorder(ROUND)
    trainer(ROUNDS, callbacks=[recorder], precision="bf16-mixed").fit(build("FedAvg"), synthetic(CLIENTS))
    node, data = build("FedAvg"), synthetic(CLIENTS)
    data.setup("fit")
    for client_id, (update, _) in recorder.results.items():
        result = run_client(node, client_id, ROUND, recorder.start, {}, LocalSettings(steps=3, precision="bf16-mixed"),
                            data.client_data(client_id, "train"))
        assert torch.equal(result.uploads["delta"], update.tensors["delta"])
        fp32 = run_client(node, client_id, ROUND, recorder.start, {}, LocalSettings(steps=3),
                          data.client_data(client_id, "train"))
        assert not torch.equal(fp32.uploads["delta"], update.tensors["delta"])  # the precision is applied


def test_the_learning_rates_are_the_settings():
    node, data = build("FedAvg"), synthetic(CLIENTS)
    data.setup("fit")
    start = node.global_model.flatten()
    split = data.client_data(0, "train")
    own = run_client(node, 0, 0, start, {}, LocalSettings(steps=2), split)
    same = run_client(node, 0, 0, start, {}, LocalSettings(steps=2, lrs=[0.1]), split)  # tiny_client's own rate
    half = run_client(node, 0, 0, start, {}, LocalSettings(steps=2, lrs=[0.05]), split)
    assert torch.equal(own.uploads["delta"], same.uploads["delta"])
    assert not torch.equal(own.uploads["delta"], half.uploads["delta"])
    with pytest.raises(ValueError, match="parameter groups"):
        run_client(node, 0, 0, start, {}, LocalSettings(steps=2, lrs=[0.1, 0.1]), split)


@pytest.mark.parametrize("kwargs, message", [
    ({}, "give one of steps and epochs"),
    ({"steps": 2, "epochs": 1}, "give one of steps and epochs"),
    ({"steps": -1}, "steps"),
    ({"epochs": 0}, "epochs"),
    ({"steps": 2, "precision": "64-true"}, "precision must be one of"),
])
def test_bad_settings_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        LocalSettings(**kwargs)


def test_a_lockstep_algorithm_is_refused():
    torch.manual_seed(0)
    module = FedDRO(tiny_client(), KLDRO(lam=2.0), local_steps=2, clients_per_round=2)
    data = synthetic(CLIENTS)
    data.setup("fit")
    with pytest.raises(ValueError, match="lock-step"):
        run_client(module, 0, 0, module.global_model.flatten(), {}, LocalSettings(steps=2), data.client_data(0))
