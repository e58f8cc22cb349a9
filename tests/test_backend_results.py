"""A backend returns each work item's results (the clients it finished) and never hands an update on
itself: the engine's round takes them from the backend's ``round`` and passes them through the callbacks."""

from __future__ import annotations

import itertools
from typing import Any, Iterator

import pytest
import torch

from fl_lightning.algorithms import SCAFFOLD, FedAvg, FedDRO
from fl_lightning.callbacks import FederatedCallback, GaussianAttack
from fl_lightning.functional.dro import KLDRO
from fl_lightning.module import FederatedModule
from tests.helpers import synthetic, tiny_client, trainer


class NoUpdateWhileRunning(FederatedCallback):
    """Fails if an update reaches the callbacks while the backend runs a work item (``running``)."""

    running = False

    def on_client_update(self, trainer: Any, module: Any, update: Any) -> Any:
        if self.running:
            raise AssertionError("the backend handed an update on while it ran a work item")
        return update


def record_work_items(module: FederatedModule) -> tuple[list[tuple[Any, Any]], NoUpdateWhileRunning]:
    """Every work item ``module``'s backend runs (its clients, or in a lock-step round its step), with what
    it returned, and a callback (for the Trainer) that fails if an update reaches the callbacks while the
    backend runs one."""
    items: list[tuple[Any, Any]] = []
    round_ = module.engine.backend.round
    guard = NoUpdateWhileRunning()

    def recording(context: Any, clients: list[int]) -> Iterator[Any]:
        work, size = round_(context, clients), module.engine.backend.clients_per_block
        for index in itertools.count():
            guard.running = True
            try:
                results = next(work, None)
            finally:
                guard.running = False
            if results is None:
                return
            items.append((index if context.lockstep else clients[index * size:(index + 1) * size], results))
            yield results

    module.engine.backend.round = recording
    return items, guard


@pytest.mark.parametrize("backend", ["sequential", "batched"])
@pytest.mark.parametrize("per_block", [None, 2])
def test_a_work_item_returns_its_clients_results(backend, per_block):
    torch.manual_seed(0)
    module = SCAFFOLD(tiny_client(), clients_per_round=4, local_steps=2, client_backend=backend,
                      clients_per_block=per_block)
    items, guard = record_work_items(module)
    trainer(2, callbacks=[GaussianAttack(count=1, std=0.1), guard]).fit(module, synthetic(6))  # a forged client too
    assert len(items) == 2 * module.engine.num_work_items()
    for clients, results in items:
        assert sorted(r.update.client_id for r in results) == sorted(clients)  # forged ones may come first
        for r in results:
            assert set(r.uploads) == {"delta", "control"}
            assert set(r.state) <= {"control"}


def test_a_lockstep_round_returns_its_results_at_its_last_step():
    torch.manual_seed(0)
    module = FedDRO(tiny_client(), KLDRO(lam=2.0), local_steps=3, clients_per_round=6)
    items, guard = record_work_items(module)
    trainer(1, callbacks=[guard]).fit(module, synthetic(6))
    assert [item for item, _ in items] == [0, 1, 2]
    assert [len(results) for _, results in items] == [0, 0, 6]
    assert sorted(r.update.client_id for r in items[-1][1]) == sorted(module.engine.round_clients)


def test_the_results_reach_the_callbacks():
    torch.manual_seed(0)
    module = FedAvg(tiny_client(), clients_per_round=3, local_steps=2)
    items, guard = record_work_items(module)
    seen: list[int] = []

    class Seen(FederatedCallback):
        def on_client_update(self, trainer: Any, module: Any, update: Any) -> Any:
            seen.append(update.client_id)
            return update

    trainer(1, callbacks=[Seen(), guard]).fit(module, synthetic(6))
    assert seen == [r.update.client_id for _, results in items for r in results]
