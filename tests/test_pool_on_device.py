"""The data pool on the device: the placement decision (``pool_on_device``), the unchanged CPU
runs, map-style datasets, batches prefetched one step ahead; on a CUDA device (skipped without
one), the pool and the index tables there and the same rounds with the pool on and off it."""

from __future__ import annotations

from typing import Any, Optional

import pytest
import pytorch_lightning as pl
import torch
from torch.utils.data import Dataset, TensorDataset

from fl_lightning.algorithms import FedAvg
from fl_lightning.datamodules.base import decide_pool_on_device, labels_of
from fl_lightning.datamodules.client_data import prefetched, to_device
from fl_lightning.datamodules.synthetic import SyntheticFederated
from fl_lightning.models import MLP
from tests.helpers import global_vector, trainer

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
MiB = 2**20


# ---------------------------------------------------------------- the decision
@pytest.mark.parametrize("pool_bytes, free_bytes, option, device_type, expected", [
    (100, None, None, "cpu", False),     # the host is the device: nothing moves, whatever the option
    (100, None, True, "cpu", False),
    (None, None, True, "cpu", False),    # not even for a map-style pool
    (100, 1000, False, "cuda", False),   # False keeps it on the host
    (None, 1000, None, "cuda", False),   # automatic: a map-style pool stays on the host
    (100, 1000, None, "cuda", True),     # automatic: under a quarter of the free memory
    (250, 1000, None, "cuda", False),    # ... a quarter or more stays on the host
    (900, 1000, True, "cuda", True),     # required: anything that fits
    (100, None, None, "mps", False),     # free memory unknown: only where asked
    (100, None, True, "mps", True),
])
def test_decision(pool_bytes, free_bytes, option, device_type, expected):
    assert decide_pool_on_device(pool_bytes, free_bytes, option, device_type) is expected


def test_required_but_too_large_names_the_sizes():
    with pytest.raises(ValueError, match=r"pool_on_device=True.*3\.0 MiB.*2\.0 MiB free on the cuda device"):
        decide_pool_on_device(3 * MiB, 2 * MiB, True, "cuda")


def test_required_but_not_tensors_is_refused():
    with pytest.raises(ValueError, match="pool_on_device=True, but the pool is not tensor-backed"):
        decide_pool_on_device(None, 2 * MiB, True, "cuda")


@pytest.mark.parametrize("value", ["yes", 1, 0.0])
def test_bad_option_is_refused(value):
    with pytest.raises(ValueError, match=r"pool_on_device must be None \(automatic\), True or False"):
        decide_pool_on_device(100, 1000, value, "cuda")
    with pytest.raises(ValueError, match="pool_on_device must be"):
        data(pool_on_device=value)


@pytest.mark.parametrize("option, moved", [(True, True), (None, False)])
def test_placement_moves_the_pool_and_every_split(option, moved):
    """The ``meta`` device stands in for an accelerator here (its free memory is unknown: the pool
    moves only where asked); the batch streams then come from the device's index tables."""
    dm = data(pool_on_device=option)
    dm.setup("fit")
    dm.place_pool(torch.device("meta"))
    where = "meta" if moved else "cpu"
    split = dm.client_data(1)
    assert {t.device.type for t in dm.pool.tensors} == {where}
    assert {dm.client_data(c, s).indices.device.type for c in range(6) for s in ("train", "val", "test")} == {where}
    steps, epoch = split.step_indices(5, torch.Generator()), next(split.epoch_indices(1, torch.Generator()))
    assert steps.device.type == epoch.device.type == where and steps.shape == (5, 16)
    assert {t.device.type for t in (*split.fetch(torch.arange(3)), *next(split.step_batches(2, torch.Generator())))
            } == {where}


# ---------------------------------------------------------------- prefetching
def test_prefetched_yields_the_same_items_moving_each_one_step_ahead():
    events: list[tuple[str, int]] = []

    def move(item: int) -> int:
        events.append(("move", item))
        return 10 * item

    for value in prefetched(iter(range(3)), move):
        events.append(("use", value // 10))
    assert events == [("move", 0), ("move", 1), ("use", 0), ("move", 2), ("use", 1), ("use", 2)]
    assert list(prefetched([], move)) == [] and list(prefetched([4], move)) == [40]


# ---------------------------------------------------------------- runs
class MapStyle(Dataset):
    """A map-style dataset (not a ``TensorDataset``): its batches go through ``default_collate``."""

    def __init__(self, tensors: TensorDataset) -> None:
        self.x, self.targets = tensors.tensors

    def __len__(self) -> int:
        return len(self.targets)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.x[i], self.targets[i]


class MapStyleSynthetic(SyntheticFederated):
    """``SyntheticFederated``'s samples as a map-style dataset."""

    def build_datasets(self) -> tuple[Dataset, Optional[Dataset]]:
        pool, test = super().build_datasets()
        assert isinstance(pool, TensorDataset)
        return MapStyle(pool), test


def data(map_style: bool = False, **kwargs: Any) -> SyntheticFederated:
    cls = MapStyleSynthetic if map_style else SyntheticFederated
    return cls(num_clients=6, dim=20, batch_size=16, max_samples=80, min_samples=20, **kwargs)


def fit(backend: str, accelerator: str = "cpu", local_epochs: Optional[int] = None, **data_kwargs: Any) -> FedAvg:
    torch.manual_seed(0)
    client = MLP(in_features=20, hidden=(8,), num_classes=10, lr=0.1)
    steps = {"local_steps": None, "local_epochs": local_epochs} if local_epochs else {"local_steps": 3}
    module = FedAvg(client, clients_per_round=4, client_backend=backend, seed=1, **steps)
    trainer(2, accelerator=accelerator).fit(module, data(**data_kwargs))
    return module


@pytest.mark.parametrize("backend", ["sequential", "batched"])
def test_cpu_runs_are_the_same_whatever_the_option(backend):
    reference = fit(backend, pool_on_device=False)
    pool = reference.trainer.datamodule.pool
    assert all(t.device.type == "cpu" for t in pool.tensors)
    for option in (None, True):
        assert torch.equal(global_vector(fit(backend, pool_on_device=option)), global_vector(reference))


@pytest.mark.parametrize("backend, local_epochs", [("sequential", None), ("sequential", 1), ("batched", None)])
def test_map_style_dataset_trains_as_the_tensor_pool(backend, local_epochs):
    tensors = fit(backend, local_epochs=local_epochs)
    mapped = fit(backend, local_epochs=local_epochs, map_style=True, pool_on_device=None)
    assert isinstance(mapped.trainer.datamodule.pool, MapStyle)
    assert torch.equal(global_vector(mapped), global_vector(tensors))


# ---------------------------------------------------------------- on a CUDA device
class _Devices(pl.Callback):
    """The devices of the pool, a client's index tables and its gathered batch during a round."""

    def on_train_epoch_end(self, trainer: pl.Trainer, module: Any) -> None:
        dm, context = trainer.datamodule, module.engine.context
        table = context.index_table(0, 3)
        self.seen = {
            "pool": {t.device.type for t in dm.pool.tensors},
            "splits": {dm.client_data(0, split).indices.device.type for split in ("train", "val", "test")},
            "table": {table.device.type},
            "batch": {t.device.type for t in context.gather(table)},
        }


@needs_cuda
def test_pool_and_index_tables_on_the_device_after_setup():
    module = FedAvg(MLP(in_features=20, hidden=(8,), num_classes=10), clients_per_round=4, local_steps=3)
    dm, devices = data(), _Devices()
    trainer(1, callbacks=[devices], accelerator="gpu").fit(module, dm)
    assert devices.seen == {"pool": {"cuda"}, "splits": {"cuda"}, "table": {"cuda"}, "batch": {"cuda"}}
    on_host = data()
    on_host.setup("fit")
    assert dm.partition_hash() == on_host.partition_hash()  # the fingerprint reads the device pool
    assert (labels_of(dm.pool) == labels_of(on_host.pool)).all()


@needs_cuda
@pytest.mark.parametrize("local_epochs", [None, 1])
def test_rounds_on_the_device_equal_rounds_off_it(local_epochs):
    reference = global_vector(fit("sequential", "gpu", local_epochs, pool_on_device=False))
    for backend in ("sequential", "batched"):
        for kwargs in ({"pool_on_device": True}, {"pool_on_device": None}, {"map_style": True}):
            result = global_vector(fit(backend, "gpu", local_epochs, **kwargs))
            assert torch.allclose(result, reference, atol=1e-5, rtol=0), (backend, kwargs)


@needs_cuda
def test_pinned_copy_gives_the_batch_on_the_device():
    batch = (torch.arange(6.0).view(3, 2), {"y": torch.arange(3)})
    moved = to_device(batch, torch.device("cuda", 0), pinned=True)
    assert moved[0].is_cuda and moved[1]["y"].is_cuda
    assert torch.equal(moved[0].cpu(), batch[0]) and torch.equal(moved[1]["y"].cpu(), batch[1]["y"])
