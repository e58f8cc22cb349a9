"""The private Lightning APIs fl_lightning relies on (``fl_lightning.lightning_compat``), each
exercised against the installed Lightning: an upgrade that changes one fails here."""

from __future__ import annotations

import importlib
import warnings

import pytorch_lightning as pl
import pytest
import torch
from packaging.specifiers import SpecifierSet
from packaging.version import Version
from pytorch_lightning.trainer.connectors.logger_connector import result as lightning_results
from pytorch_lightning.utilities import rank_zero_warn
from pytorch_lightning.utilities.warnings import PossibleUserWarning
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from fl_lightning.algorithms import FedAvg
from fl_lightning.checkpoints import load_checkpoint
from fl_lightning.distributed import all_gather_object
from fl_lightning.lightning_compat import (
    OVERRIDDEN_PRIVATE_METHODS,
    TESTED_LIGHTNING,
    attached_trainer,
    batch_norm_layers,
    build_from_checkpoint,
    compile_started,
    current_hook,
    dataloader_suffix,
    default_map_location,
    dump_checkpoint,
    dynamic_int_arguments,
    is_unpadded,
    light_result_moves,
    lightning_log,
    log_agreed,
    lightning_module_attributes,
    quiet_padding_notice,
    raw_optimizer,
    results_batch,
    routed_log,
    set_current_hook,
    set_logger_version,
    sync_module_states,
    tree_flatten,
    tree_unflatten,
    unlogged_training_metrics,
    unpadded_shards,
)
from fl_lightning.models import LogisticRegression
from tests import two_processes
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


class _LogsInTheFirstRoundOnly(pl.Callback):
    """Logs one name every round and one (on step and epoch) in the first round only; notes, as each
    round ends, which training metrics were not logged in it."""

    def __init__(self) -> None:
        self.unlogged: list[set[str]] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        pl_module.log("every_round", 1.0, on_step=False, on_epoch=True, batch_size=1)
        if trainer.current_epoch == 0:
            pl_module.log("first_round", 2.0, on_step=True, on_epoch=True, batch_size=1)

    def on_train_epoch_end(self, trainer, pl_module):
        self.unlogged.append(unlogged_training_metrics(trainer))


def test_unlogged_training_metrics_are_those_logged_in_an_earlier_round_only():
    probe = _LogsInTheFirstRoundOnly()
    t = trainer(2, callbacks=[probe])
    t.fit(FedAvg(tiny_client(), clients_per_round=2, local_steps=1), synthetic(4))
    assert probe.unlogged == [set(), {"first_round", "first_round_step", "first_round_epoch"}]
    assert "first_round" in t.callback_metrics  # the value Lightning keeps from the first round


class _LogsTwo(pl.Callback):
    """Logs one value as a process's own and one as agreed by every process, at the round's end."""

    def on_train_epoch_end(self, trainer, pl_module):
        pl_module.log("own_value", 1.0, batch_size=1)
        log_agreed(pl_module, "agreed_value", 2.0, batch_size=1)


def test_log_agreed_drops_lightnings_sync_dist_advice_for_its_name_only(monkeypatch):
    """Under DDP Lightning advises ``sync_dist=True`` for a value logged per epoch without it (once
    per name, on rank 0): kept for a process's own value, dropped for one the engine merged. The
    advice's wording is Lightning's; this fails if a release changes it (the process group is
    faked, so the advice is given on one process)."""
    monkeypatch.setattr(lightning_results, "_distributed_is_initialized", lambda: True)
    monkeypatch.setattr(lightning_results, "warning_cache", type(lightning_results.warning_cache)())
    t = trainer(1, callbacks=[_LogsTwo()])
    with pytest.warns(PossibleUserWarning) as caught:
        t.fit(FedAvg(tiny_client(), clients_per_round=2, local_steps=1), synthetic(4))
    advice = [str(w.message) for w in caught if "sync_dist=True" in str(w.message)]
    assert any("'own_value'" in message for message in advice), advice
    assert not any("'agreed_value'" in message for message in advice), advice
    assert float(t.callback_metrics["agreed_value"]) == 2.0


def _sync_on_rank(rank: int) -> list[list[torch.Tensor]]:
    torch.manual_seed(rank)  # each process builds another model
    module = nn.Linear(3, 2)
    sync_module_states(module)
    return all_gather_object([p.detach() for p in module.parameters()])


def test_light_result_moves_skip_only_a_move_that_moves_nothing():
    """Inside the block a logged value accumulates as Lightning's own move gives it, without that
    move's copies where no tensor moves; a tensor that moves takes Lightning's move; after the block
    Lightning's move is back, also when the block raised."""
    from pytorch_lightning.trainer.connectors.logger_connector.result import _ResultCollection, _ResultMetric

    original = _ResultMetric.to

    def logged(values, light):
        results = _ResultCollection(training=True)
        for value in values:
            if light:
                with light_result_moves():
                    results.log("training_step", "x", torch.tensor(value), on_step=False, on_epoch=True, batch_size=2)
            else:
                results.log("training_step", "x", torch.tensor(value), on_step=False, on_epoch=True, batch_size=2)
        return results["training_step.x"]

    metric = logged([1.0, 3.0, 8.0], light=True)
    assert metric.compute() == logged([1.0, 3.0, 8.0], light=False).compute() == 4.0
    meta = metric.meta
    with light_result_moves():
        assert metric.to(torch.device("cpu")) is metric and metric.meta is meta  # Lightning's move deep-copies it
        metric.to(torch.device("meta"))
        assert metric.value.device.type == "meta" and metric.meta is not meta
    assert _ResultMetric.to is original
    try:
        with light_result_moves():
            raise KeyError("a failing log")
    except KeyError:
        pass
    assert _ResultMetric.to is original


def test_sync_module_states_gives_every_process_rank_0s_model():
    zero, one = two_processes.pool(2).run(_sync_on_rank, [])
    torch.manual_seed(0)
    expected = list(nn.Linear(3, 2).parameters())
    assert all(torch.equal(a, b) and torch.equal(a, e) for a, b, e in zip(zero, one, expected))


def test_set_current_hook_and_attached_trainer():
    client = tiny_client()
    assert attached_trainer(client) is None
    set_current_hook(client, "test_step")
    assert client._current_fx_name == "test_step"
    t = trainer(1)
    module = FedAvg(client, clients_per_round=2, local_steps=1)
    t.fit(module, synthetic(4))
    assert attached_trainer(module) is t


def test_dataloader_suffix_names_the_evaluation_loader_of_several():
    """What Lightning appends to a logged name: ``/dataloader_idx_N`` with several evaluation loaders only."""
    seen: dict[int, set[str]] = {}

    class Probe(pl.Callback):
        def on_validation_batch_start(self, trainer, module, batch, batch_idx, dataloader_idx=0):
            seen.setdefault(len(trainer.num_val_batches), set()).add(dataloader_suffix(trainer))

    class Evaluated(LogisticRegression):
        def validation_step(self, batch, batch_idx, dataloader_idx=0):
            return super().validation_step(batch, batch_idx)

    data = DataLoader(TensorDataset(torch.randn(4, 20), torch.randint(0, 10, (4,))), batch_size=2)
    for loaders in ([data], [data, data]):
        trainer(1, callbacks=[Probe()]).validate(Evaluated(in_features=20, num_classes=10), dataloaders=loaders,
                                                 verbose=False)
    assert seen == {1: {""}, 2: {"/dataloader_idx_0", "/dataloader_idx_1"}}


def test_unpadded_shards_hold_each_sample_once_and_the_padding_notice_is_dropped():
    dataset = TensorDataset(torch.arange(5))
    shards = []
    for rank in (0, 1):
        sampler = DistributedSampler(dataset, num_replicas=2, rank=rank, shuffle=False)
        assert len(sampler) == 3 and not is_unpadded(sampler)  # Lightning's: 3 + 3 samples, one of them twice
        loader = unpadded_shards(DataLoader(dataset, batch_size=2, sampler=sampler), sampler)
        assert is_unpadded(loader.sampler) and loader.batch_size == 2
        shards.append([int(i) for (batch,) in loader for i in batch])
    assert shards == [[0, 2, 4], [1, 3]]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        quiet_padding_notice()
        rank_zero_warn("Using `DistributedSampler` with the dataloaders. During `trainer.validate()`, ...",
                       category=PossibleUserWarning)
        rank_zero_warn("another notice", category=PossibleUserWarning)
    assert [str(w.message) for w in caught] == ["another notice"]


@pytest.mark.parametrize("kind", ["TensorBoardLogger", "CSVLogger"])
def test_set_logger_version_chooses_the_folder_a_logger_writes_into(tmp_path, kind):
    """The folder of an earlier run (a resumed run's), or one inside it (an evaluation's), as ``version=`` would."""
    from pytorch_lightning import loggers

    (tmp_path / "lightning_logs" / "version_0").mkdir(parents=True)
    logger = getattr(loggers, kind)(str(tmp_path))
    assert logger.version == 1  # Lightning's choice: the next version
    assert set_logger_version(logger, "version_0/validate")
    t = trainer(1, logger=logger)
    t.fit(FedAvg(tiny_client(), clients_per_round=2, local_steps=1), synthetic(4))
    assert t.log_dir == logger.log_dir == str(tmp_path / "lightning_logs" / "version_0" / "validate")
    assert any((tmp_path / "lightning_logs" / "version_0" / "validate").iterdir())
    assert not (tmp_path / "lightning_logs" / "version_1").exists()
    with pytest.raises(RuntimeError, match="writes into .*version_0/validate already"):
        set_logger_version(logger, "version_2")
    assert not set_logger_version(pl.loggers.logger.DummyLogger(), "version_0")


def test_the_overridden_private_methods_exist():
    """fl_ddp and the Rich round bar override these; a release that renames one fails here, not silently."""
    for path, methods in OVERRIDDEN_PRIVATE_METHODS.items():
        module_name, _, name = path.rpartition(".")
        cls = getattr(importlib.import_module(module_name), name)
        for method in methods:
            assert callable(getattr(cls, method, None)), f"{path}.{method}"


def test_build_from_checkpoint_dump_checkpoint_and_default_map_location(tmp_path):
    """What ``load_from_checkpoint`` does after the file is read: the module from its hyperparameters and state;
    the checkpoint ``save_checkpoint`` writes, as a dict."""
    t = trainer(1)
    module = FedAvg(tiny_client(), clients_per_round=2, local_steps=3)
    t.fit(module, synthetic(4))
    t.save_checkpoint(tmp_path / "x.ckpt")
    checkpoint = load_checkpoint(tmp_path / "x.ckpt")
    dumped = dump_checkpoint(t)
    assert dumped.keys() == checkpoint.keys() - {"checksum"}
    assert dumped["state_dict"].keys() == checkpoint["state_dict"].keys()
    assert all(torch.equal(value, checkpoint["state_dict"][key]) for key, value in dumped["state_dict"].items())
    built = build_from_checkpoint(FedAvg, checkpoint, client=tiny_client(seed=1))
    assert built.local_steps == 3 and all(torch.equal(a, b) for a, b in zip(built.parameters(), module.parameters()))
    assert default_map_location("cpu") == "cpu" and callable(default_map_location(None))


def test_the_private_torch_names_still_work():
    """The BatchNorm base class, torch's pytree helpers and a bare LightningModule's attributes."""
    model = nn.Sequential(nn.Linear(2, 4), nn.BatchNorm1d(4), nn.Sequential(nn.BatchNorm2d(3)), nn.LayerNorm(4))
    assert [name for name, _ in batch_norm_layers(model)] == ["1", "2.0"]
    leaves, spec = tree_flatten({"a": torch.zeros(1), "b": (torch.ones(2), 3)})
    assert len(leaves) == 3 and tree_unflatten(leaves, spec)["b"][1] == 3
    attributes = lightning_module_attributes()
    assert {"_modules", "_parameters", "_trainer"} <= attributes and "weight" not in attributes


def test_dynamic_int_arguments_and_compile_started():
    """An integer argument marked dynamic is a symbol from the first compile: one graph for every value
    (unmarked: a constant at the first compile, a symbol from the first recompile on, two graphs); and
    ``compile_started`` calls back once per graph compiled inside its block."""

    def scaled(x: torch.Tensor, k: int) -> torch.Tensor:
        return x * k

    graphs = {}
    for marked in (True, False):
        function = type(scaled)(scaled.__code__.replace(), globals())  # a code object (a compile cache) of its own
        if marked:
            dynamic_int_arguments(function, ("k",))
        compiled = torch.compile(function, backend="eager")
        started = []
        with compile_started(lambda: started.append(1)):
            for k in range(4):
                assert torch.equal(compiled(torch.ones(2), k), torch.full((2,), float(k)))
        graphs[marked] = len(started)
    assert graphs == {True: 1, False: 2}
