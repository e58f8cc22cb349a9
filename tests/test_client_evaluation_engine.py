"""The engine's client evaluation (``FederatedModule.evaluate_clients``): the client module's own
``validation_step`` / ``test_step`` per client, its logged scalars and torchmetrics ``Metric``
objects reduced per client, in both client backends."""

from __future__ import annotations

import warnings
from typing import Any

import numpy as np
import pytest
import pytorch_lightning as pl
import torch
from torch import nn
from torchmetrics.classification import MulticlassAccuracy

from fl_lightning.algorithms import FedAvg, FedDeper
from fl_lightning.lightning_compat import metric_snapshot, restore_metric, unsync_metric
from fl_lightning.update import ClientResult
from tests.helpers import synthetic, trainer


class Regression(pl.LightningModule):
    """A linear regression of the (float) label on the features; logs MSE and MAE per batch."""

    def __init__(self, lr: float = 0.05) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.linear = nn.Linear(20, 1)
        self.lr = lr

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x).squeeze(-1)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return ((self(x) - y.float()) ** 2).mean()

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        error = self(x) - y.float()
        self.log("val/mse", (error**2).mean(), batch_size=len(x))
        self.log("val/mae", error.abs().mean(), batch_size=len(x))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=self.lr)


class Classifier(pl.LightningModule):
    """A logistic regression that logs a torchmetrics accuracy (a Metric) and its loss in validation."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.linear = nn.Linear(20, 10)
        self.accuracy = MulticlassAccuracy(num_classes=10, average="micro")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.cross_entropy(self(x), y)

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        logits = self(x)
        self.accuracy.update(logits, y)
        self.log("val/acc", self.accuracy)
        self.log("val/loss", nn.functional.cross_entropy(logits, y))

    def on_validation_epoch_end(self) -> None:  # after the callbacks' (which evaluate clients)
        self.log("val/acc_at_end", self.accuracy.compute())

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def data(**kwargs: Any):
    kwargs.setdefault("val_fraction", 0.25)
    kwargs.setdefault("eval_batch_size", 7)  # several batches per client, the last one smaller
    return synthetic(num_clients=6, **kwargs)


def hand_regression(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> dict[str, float]:
    """MSE and MAE of ``model`` on one client's whole split (pooled: the batch-size-weighted mean)."""
    with torch.no_grad():
        error = model(x).double() - y.double()
    return {"val/mse": float((error**2).mean()), "val/mae": float(error.abs().mean())}


def check_results(results: list[ClientResult], expected: dict[int, dict[str, float]], dm) -> None:
    assert [r.client_id for r in results] == list(expected)
    for r in results:
        assert r.num_samples == len(dm.client_data(r.client_id, "val"))
        assert set(r.metrics) == set(expected[r.client_id])
        for name, value in expected[r.client_id].items():
            assert r.metrics[name] == pytest.approx(value, rel=1e-5, abs=1e-6), (r.client_id, name)


def test_a_regression_clients_figures_are_its_own_on_its_val_split():
    dm = data()
    module = FedAvg(Regression(), clients_per_round=3, local_steps=2, seed=1)
    trainer(1).fit(module, dm)
    clients = [4, 0, 2]
    results = module.engine.evaluate_clients(clients, "val")
    expected = {cid: hand_regression(module.client, *dm.client_data(cid, "val").full()) for cid in clients}
    check_results(results, expected, dm)
    assert all(r.higher_is_better == {} for r in results)


def test_a_logged_metric_is_computed_per_client_and_the_modules_metric_is_left_as_it_was():
    dm = data()
    module = FedAvg(Classifier(), clients_per_round=3, local_steps=2, seed=1)
    trainer(1).fit(module, dm)
    accuracy = module.client.accuracy
    accuracy.update(torch.randn(5, 10), torch.arange(5))  # the module's own accumulated state
    before = metric_snapshot(accuracy)
    results = module.engine.evaluate_clients(range(6), "val")
    after = metric_snapshot(accuracy)
    for name in ("tp", "fp", "tn", "fn"):
        torch.testing.assert_close(after["states"][name], before["states"][name])
    assert (after["_update_count"], after["_computed"]) == (before["_update_count"], before["_computed"])
    for r in results:
        x, y = dm.client_data(r.client_id, "val").full()
        with torch.no_grad():
            logits = module.client(x)
        assert r.metrics["val/acc"] == pytest.approx(float((logits.argmax(-1) == y).double().mean()), abs=1e-6)
        assert r.metrics["val/loss"] == pytest.approx(float(nn.functional.cross_entropy(logits, y)), rel=1e-5)
        assert r.higher_is_better == {"val/acc": True}


def test_personalized_clients_are_evaluated_with_their_own_models():
    dm = data()
    module = FedDeper(Regression(), clients_per_round=6, local_steps=2, seed=1)
    trainer(2).fit(module, dm)
    personal = {cid: module.client_eval_state(cid) for cid in range(6)}
    assert not torch.equal(personal[0], personal[1])
    results = module.engine.evaluate_clients(range(6), "val")
    expected = {}
    for cid in range(6):
        model = Regression()
        torch.nn.utils.vector_to_parameters(personal[cid], model.parameters())
        expected[cid] = hand_regression(model, *dm.client_data(cid, "val").full())
    check_results(results, expected, dm)
    global_results = module.engine.evaluate_clients(range(6), "val", personalized=False)
    expected = {cid: hand_regression(module.client, *dm.client_data(cid, "val").full()) for cid in range(6)}
    check_results(global_results, expected, dm)


def test_an_empty_split_is_left_out():
    dm = data()
    module = FedAvg(Regression(), clients_per_round=3, local_steps=1, seed=1)
    trainer(1).fit(module, dm)
    dm.splits["val"][2] = np.array([], dtype=np.int64)
    assert [r.client_id for r in module.engine.evaluate_clients([1, 2, 3], "val")] == [1, 3]


def test_a_split_or_hook_it_does_not_take_is_refused():
    dm = data()
    module = FedAvg(Regression(), clients_per_round=3, local_steps=1, seed=1)
    trainer(1).fit(module, dm)
    with pytest.raises(ValueError, match="split must be one of"):
        module.engine.evaluate_clients([0], "holdout")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="hook='test_step'.*does not implement test_step"):
        module.engine.evaluate_clients([0], "val", hook="test_step")


def batched_and_sequential(client: type, **kwargs: Any):
    """The same federation trained with each client backend (the batched one in blocks of 3)."""
    dm = data(**kwargs)
    modules = {}
    for backend in ("sequential", "batched"):
        module = FedAvg(client(), clients_per_round=6, local_steps=2, seed=1, client_backend=backend,
                        clients_per_block=3)
        trainer(1).fit(module, dm)
        modules[backend] = module
    return dm, modules


def test_batched_evaluation_equals_sequential():
    dm, modules = batched_and_sequential(Regression)
    sizes = {len(dm.client_data(cid, "val")) for cid in range(6)}
    assert len(sizes) > 1  # clients' splits differ in size (their last batches differ in shape)
    torch.testing.assert_close(modules["batched"].global_model.flatten(), modules["sequential"].global_model.flatten())
    clients = [5, 1, 3, 0, 2, 4]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no fallback
        batched = modules["batched"].engine.evaluate_clients(clients, "val")
    sequential = modules["sequential"].engine.evaluate_clients(clients, "val")
    assert [r.client_id for r in batched] == [r.client_id for r in sequential] == clients
    for b, s in zip(batched, sequential):
        assert (b.num_samples, b.higher_is_better) == (s.num_samples, s.higher_is_better)
        assert set(b.metrics) == set(s.metrics) == {"val/mse", "val/mae"}
        torch.testing.assert_close(torch.tensor([b.metrics[n] for n in sorted(b.metrics)]),
                                   torch.tensor([s.metrics[n] for n in sorted(s.metrics)]))


def test_a_default_evaluation_block_out_of_memory_evaluates_again_in_halves(monkeypatch):
    """``clients_per_block=None``: an evaluation block that runs out of device memory (simulated: any of
    more than 2 clients) makes the evaluation start again in blocks of half the size, and later ones
    no larger, with one warning; the figures are the sequential evaluation's. A block size the user
    chose raises the error."""
    from fl_lightning.backends.batched import backend as batched

    dm = data()
    evaluate = batched.evaluate_vectorized
    blocks = []

    def failing(context, client_ids, state_of, split, hook, clients_per_block):
        blocks.append(clients_per_block)
        if clients_per_block > 2:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory (simulated)")
        return evaluate(context, client_ids, state_of, split, hook, clients_per_block)

    modules = {}
    for backend, block in (("sequential", 3), ("batched", None)):
        modules[backend] = FedAvg(Regression(), clients_per_round=6, local_steps=2, seed=1, client_backend=backend,
                                  clients_per_block=block)
        trainer(1).fit(modules[backend], dm)
    monkeypatch.setattr(batched, "evaluate_vectorized", failing)
    clients = [5, 1, 3, 0, 2, 4]
    with pytest.warns(UserWarning, match="ran out of memory in evaluation, in a block of 6 clients") as warned:
        halved = modules["batched"].engine.evaluate_clients(clients, "val")
        again = modules["batched"].engine.evaluate_clients(clients, "val")
    assert sum("ran out of memory" in str(w.message) for w in warned) == 1
    assert blocks == [6, 3, 2, 2]
    sequential = modules["sequential"].engine.evaluate_clients(clients, "val")
    for results in (halved, again):
        assert [r.client_id for r in results] == clients
        for b, s in zip(results, sequential):
            torch.testing.assert_close(torch.tensor([b.metrics[n] for n in sorted(b.metrics)]),
                                       torch.tensor([s.metrics[n] for n in sorted(s.metrics)]))
    explicit = FedAvg(Regression(), clients_per_round=6, local_steps=2, seed=1, client_backend="batched",
                      clients_per_block=3)
    trainer(1).fit(explicit, dm)
    with pytest.raises(torch.cuda.OutOfMemoryError):
        explicit.engine.evaluate_clients(clients, "val")


def test_a_logged_metric_falls_back_to_sequential_evaluation_with_the_reason():
    dm, modules = batched_and_sequential(Classifier)
    before = metric_snapshot(modules["batched"].client.accuracy)
    with pytest.warns(UserWarning, match="one after another: the client's validation_step .*torchmetrics Metric"):
        batched = modules["batched"].engine.evaluate_clients(range(6), "val")
    sequential = modules["sequential"].engine.evaluate_clients(range(6), "val")
    identities = [[(r.client_id, r.higher_is_better) for r in results] for results in (batched, sequential)]
    assert identities[0] == identities[1]
    for b, s in zip(batched, sequential):
        assert b.metrics == pytest.approx(s.metrics, rel=1e-5)
    after = metric_snapshot(modules["batched"].client.accuracy)
    assert after["_update_count"] == before["_update_count"]
    torch.testing.assert_close(after["states"], before["states"])
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # warned once: the next evaluation goes straight to the sequential one
        modules["batched"].engine.evaluate_clients([0], "val")


class EvaluateClients(pl.Callback):
    """Evaluates every client at each validation, as a federated evaluation callback does."""

    def __init__(self) -> None:
        self.results: list[list[ClientResult]] = []

    def on_validation_epoch_end(self, trainer: pl.Trainer, pl_module: Any) -> None:
        self.results.append(pl_module.engine.evaluate_clients(range(6), "val"))


@pytest.mark.parametrize("backend, client", [("sequential", Classifier), ("batched", Classifier),
                                             ("batched", Regression)])
def test_evaluating_clients_during_validation_leaves_the_global_figures_unchanged(backend, client):
    dm = data()
    logged = {}
    for evaluate in (False, True):
        module = FedAvg(client(), clients_per_round=3, local_steps=2, seed=1, client_backend=backend,
                        clients_per_block=3)
        callback = EvaluateClients()
        fit = trainer(2, callbacks=[callback] if evaluate else [])
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", "the batched client backend evaluates clients one after another")
            fit.fit(module, dm)
        logged[evaluate] = {k: float(v) for k, v in fit.callback_metrics.items()}
    assert logged[True] == logged[False]
    if client is Classifier:
        assert "val/acc_at_end" in logged[True]
    assert len(callback.results) == 2 and [r.client_id for r in callback.results[-1]] == list(range(6))


def test_a_metric_snapshot_puts_the_metric_back():
    metric = MulticlassAccuracy(num_classes=3, average="micro")
    metric.update(torch.tensor([0, 1, 2]), torch.tensor([0, 1, 1]))
    expected = float(metric.compute())
    snapshot = metric_snapshot(metric)
    unsync_metric(metric)
    metric.reset()
    metric.update(torch.tensor([0]), torch.tensor([1]))
    assert float(metric.compute()) == 0.0
    restore_metric(metric, snapshot)
    assert (metric.update_count, metric._to_sync) == (1, True)
    assert float(metric.compute()) == pytest.approx(expected)
