"""The private Lightning APIs fl_lightning relies on (``fl_lightning.lightning_compat``), each
exercised against the installed Lightning: an upgrade that changes one fails here."""

from __future__ import annotations

import pytorch_lightning as pl
import torch
import torch.distributed as dist
from packaging.specifiers import SpecifierSet
from packaging.version import Version
from torch import nn

from fl_lightning.algorithms import FedAvg
from fl_lightning.lightning_compat import (
    TESTED_LIGHTNING,
    current_hook,
    lightning_log,
    raw_optimizer,
    results_batch,
    routed_log,
    sync_module_states,
)
from tests.helpers import synthetic, tiny_client, trainer


def test_installed_lightning_is_a_tested_release():
    assert Version(pl.__version__) in SpecifierSet(",".join(TESTED_LIGHTNING))


def test_the_server_step_counts_as_one_optimizer_step_per_round():
    t = trainer(3)
    module = FedAvg(tiny_client(), clients_per_round=2, local_steps=2)
    t.fit(module, synthetic(4))
    assert t.global_step == 3
    assert isinstance(raw_optimizer(module.optimizers()[0]), torch.optim.SGD)


def test_current_hook_and_routed_log_restore_the_module():
    client = tiny_client()
    client._current_fx_name = "validation_step"
    with current_hook(client, "training_step"):
        assert client._current_fx_name == "training_step"
    assert client._current_fx_name == "validation_step"
    calls = []
    with routed_log(client, lambda *a, **k: calls.append(a)):
        client.log("x", 1.0)
    assert calls == [("x", 1.0)]
    assert "log" not in vars(client) and client.log.__func__ is pl.LightningModule.log


class _Probe(pl.Callback):
    """Inside a training step: ``results_batch`` sets the batch Lightning infers sizes from, and
    ``lightning_log`` reaches Lightning's own ``log`` while the client's is routed elsewhere."""

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        marker = (torch.zeros(7, 2),)
        saved = trainer._results.batch
        with results_batch(trainer, marker):
            assert trainer._results.batch is marker
        assert trainer._results.batch is saved
        client = pl_module.client
        with routed_log(client, lambda *a, **k: None), current_hook(client, "training_step"):
            lightning_log(client, "probe", 3.0, on_step=False, on_epoch=True, batch_size=1)
        self.ran = True


def test_results_batch_and_lightning_log_inside_a_training_step():
    probe = _Probe()
    t = trainer(1, callbacks=[probe])
    t.fit(FedAvg(tiny_client(), clients_per_round=2, local_steps=1), synthetic(4))
    assert probe.ran and float(t.callback_metrics["probe"]) == 3.0


def test_sync_module_states_in_a_one_process_group():
    """(Two processes: every DDP test starts from rank 0's model through it.)"""
    module = nn.Linear(2, 2)
    before = [p.detach().clone() for p in module.parameters()]
    created = not dist.is_initialized()  # a spawned DDP test may have left one in this worker
    if created:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        sync_module_states(module)
    finally:
        if created:
            dist.destroy_process_group()
    assert all(torch.equal(a, b) for a, b in zip(before, module.parameters()))
