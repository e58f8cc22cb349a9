"""A backend returns each work item's results (the clients it finished) as a block in columns and never
hands an update on itself: the engine's round takes them from the backend's ``round`` and passes them
through the callbacks."""

from __future__ import annotations

import itertools
from typing import Any, Iterator

import pytest
import torch

from fl_lightning.algorithms import SCAFFOLD, FedAvg, FedDRO
from fl_lightning.backends import block as block_module
from fl_lightning.backends.block import ClientBlock
from fl_lightning.backends.client_round import ClientRoundResult
from fl_lightning.callbacks import FederatedCallback, GaussianAttack
from fl_lightning.functional.dro import KLDRO
from fl_lightning.module import FederatedModule
from fl_lightning.update import ClientUpdate
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
    size = module.global_model.num_params
    for clients, block in items:
        assert isinstance(block, ClientBlock)
        assert sorted(block.client_ids) == sorted(clients)  # forged ones may come first
        assert {name: tuple(column.shape) for name, column in block.uploads.items()} == {
            "delta": (len(clients), size), "control": (len(clients), size)}
        forged = [i for i, value in enumerate(block.metrics.get("loss", [None] * len(block))) if value is None]
        assert block.state_rows.get("control", []) == [i for i in range(len(clients)) if i not in forged]
        for r in block.rows():
            assert set(r.uploads) == {"delta", "control"}
            assert set(r.state) <= {"control"}


def test_a_lockstep_round_returns_its_results_at_its_last_step():
    torch.manual_seed(0)
    module = FedDRO(tiny_client(), KLDRO(lam=2.0), local_steps=3, clients_per_round=6)
    items, guard = record_work_items(module)
    trainer(1, callbacks=[guard]).fit(module, synthetic(6))
    assert [item for item, _ in items] == [0, 1, 2]
    assert [len(block) for _, block in items] == [0, 0, 6]
    assert sorted(items[-1][1].client_ids) == sorted(module.engine.round_clients)


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
    assert seen == [client for _, block in items for client in block.client_ids]


def result(client: int, delta: torch.Tensor, state: dict[str, torch.Tensor], **metrics: Any) -> ClientRoundResult:
    return ClientRoundResult(ClientUpdate(client, 10 + client, {"delta": delta}, dict(metrics)), state)


def test_a_block_takes_a_vectorized_steps_rows_as_its_columns_without_a_copy():
    stacked = torch.randn(3, 4)
    block = ClientBlock.of([result(c, stacked[i].reshape(-1), {}) for i, c in enumerate([5, 1, 3])])
    assert block.uploads["delta"] is stacked
    assert block.client_ids == [5, 1, 3] and block.num_samples == [15, 11, 13]
    shuffled = ClientBlock.of([result(c, stacked[i], {}) for i, c in ((1, 5), (0, 1), (2, 3))])
    assert shuffled.uploads["delta"] is not stacked  # rows out of order: stacked anew, in the block's order
    assert torch.equal(shuffled.uploads["delta"], stacked[[1, 0, 2]])
    one = torch.randn(4)
    single = ClientBlock.of([result(0, one, {})])
    assert single.uploads["delta"].shape == (1, 4) and single.uploads["delta"].data_ptr() == one.data_ptr()


def test_a_blocks_rows_give_back_each_clients_result_with_missing_state_and_metrics_left_out():
    deltas = [torch.full((2,), float(c)) for c in range(3)]
    results = [result(0, deltas[0], {"s": torch.ones(3)}, loss=0.5, steps=2.0),
               result(1, deltas[1], {}),  # a forged upload: no metrics, no state
               result(2, deltas[2], {"s": 2 * torch.ones(3)}, loss=torch.tensor(0.25), steps=2.0)]
    block = ClientBlock.of(results)
    assert block.state_rows == {"s": [0, 2]} and block.state["s"].shape == (2, 3)
    assert block.metrics == {"loss": [0.5, None, torch.tensor(0.25)], "steps": [2.0, None, 2.0]}
    rows = list(block.rows())
    for got, want in zip(rows, results):
        assert got.update.client_id == want.update.client_id and got.update.num_samples == want.update.num_samples
        assert torch.equal(got.uploads["delta"], want.uploads["delta"])
        assert got.metrics == want.metrics
        assert set(got.state) == set(want.state) and all(torch.equal(got.state[k], want.state[k]) for k in got.state)
    joined = ClientBlock.join([ClientBlock.of(results[:1]), ClientBlock.of(results[1:])])
    assert joined.client_ids == [0, 1, 2] and joined.state_rows == {"s": [0, 2]}
    assert torch.equal(joined.uploads["delta"], torch.stack(deltas))
    ragged = ClientBlock.of([result(0, deltas[0], {"table": torch.ones(4, 2)}), result(1, deltas[1], {"table": torch.ones(6, 2)})])
    assert [t.shape for t in ragged.state["table"]] == [(4, 2), (6, 2)]  # one row per sample: a list
    assert [r.state["table"].shape for r in ragged.rows()] == [(4, 2), (6, 2)]
    assert len(ClientBlock.of([])) == 0 and list(ClientBlock.of([]).rows()) == []


def test_the_batched_backend_hands_its_vectorized_uploads_over_as_they_are(monkeypatch):
    found = []
    base_of = block_module._base_of
    monkeypatch.setattr(block_module, "_base_of", lambda rows: found.append(base_of(rows)) or found[-1])
    torch.manual_seed(0)
    module = FedAvg(tiny_client(), clients_per_round=4, local_steps=2, client_backend="batched", clients_per_block=4)
    items, guard = record_work_items(module)
    trainer(2, callbacks=[guard]).fit(module, synthetic(6))
    assert [len(block) for _, block in items] == [4, 4]
    assert len(found) == 2 and all(base is block.uploads["delta"] for base, (_, block) in zip(found, items))
