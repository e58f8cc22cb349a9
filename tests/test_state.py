"""Client state store, state vectors and keyed randomness."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from fl_lightning.seeding import derive_seed, generator, sample_clients
from fl_lightning.state import ClientStateStore, StateSpec
from fl_lightning.vectors import StateVector


def test_store_is_lazy_on_cpu_and_round_trips():
    store = ClientStateStore()
    assert store.get(3, "c") is None
    assert 3 not in store


def test_state_defaults_are_fresh_copies():
    value = torch.ones(2)
    for spec in (StateSpec(value), StateSpec(lambda: value)):
        first = spec.initial()
        first += 1
        assert torch.equal(spec.initial(), torch.ones(2))  # never the default itself
    assert StateSpec().initial() is None


def test_store_round_trips(tmp_path):
    store = ClientStateStore()  # no directory: the entries go into the checkpoint
    store.set(3, "c", torch.full((2,), 2.0))
    assert store.get(3, "c").device.type == "cpu" and store.nbytes() == 8
    copy = ClientStateStore()
    copy.load_state_dict(store.state_dict())
    assert list(copy.clients()) == [3] and torch.equal(copy.get(3, "c"), store.get(3, "c"))


def test_checkpoints_are_incremental(tmp_path):
    """A checkpoint writes the files of the entries new since the last one and holds only their versions."""
    store = ClientStateStore(directory=str(tmp_path))
    store.set(1, "c", torch.ones(2), version=0)
    store.set(2, "c", torch.ones(2), version=0)
    assert store.state_dict() == {"entries": {1: {"c": 0}, 2: {"c": 0}}, "directory": str(tmp_path), "elsewhere": {}}
    written = {p.name: p.stat().st_mtime_ns for p in tmp_path.glob("*.pt")}
    assert sorted(written) == ["1.c.0.pt", "2.c.0.pt"]
    store.set(2, "c", torch.full((2,), 3.0), version=1)  # the next round changes client 2 only
    state = store.state_dict()
    assert state["entries"] == {1: {"c": 0}, 2: {"c": 1}}
    assert {p.name: p.stat().st_mtime_ns for p in tmp_path.glob("*.pt") if p.name != "2.c.1.pt"} == written
    copy = ClientStateStore(directory=str(tmp_path / "mine"))
    copy.load_state_dict(state)  # another run's checkpoint: its files are read where they are
    assert torch.equal(copy.get(2, "c"), torch.full((2,), 3.0)) and torch.equal(copy.get(1, "c"), torch.ones(2))
    assert copy.nbytes() == 16  # read back into RAM (within the budget)
    copy.set(1, "c", torch.zeros(2), version=2)
    again = copy.state_dict()  # names the other run's file of client 2, writes only its own new entry
    assert again["elsewhere"] == {2: {"c": str(tmp_path)}}
    assert sorted(p.name for p in (tmp_path / "mine").glob("*.pt")) == ["1.c.2.pt"]
    for _ in range(3):
        copy.state_dict()  # pruning never removes another run's files
    assert (tmp_path / "2.c.1.pt").exists() and (tmp_path / "1.c.0.pt").exists()


def test_store_keeps_a_copy():
    store, value = ClientStateStore(), torch.zeros(2)
    store.set(0, "v", value)
    value += 1
    assert torch.equal(store.get(0, "v"), torch.zeros(2))


def test_state_vector_round_trip_with_buffers():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(3, 2), nn.BatchNorm1d(2))
    sv = StateVector(net)
    assert sv.num_params == 3 * 2 + 2 + 2 + 2 and sv.dim == sv.num_params + 4  # + running mean/var
    vec = torch.arange(sv.dim, dtype=torch.float32)
    sv.load(vec)
    assert torch.equal(sv.flatten(), vec)
    assert torch.equal(net[1].running_var, vec[-2:])
    with pytest.raises(ValueError, match="entries"):
        sv.load(torch.zeros(3))


def test_keyed_generators():
    assert derive_seed(0, "a", 1) == derive_seed(0, "a", 1) != derive_seed(0, "a", 2) != derive_seed(0, "b", 1)
    a = torch.rand(3, generator=generator(1, "x", 2))
    assert torch.equal(a, torch.rand(3, generator=generator(1, "x", 2)))


def test_sample_clients():
    picked = sample_clients(0, 5, list(range(100)), 10)
    assert picked == sorted(set(picked)) and len(picked) == 10
    assert picked == sample_clients(0, 5, list(range(100)), 10) != sample_clients(0, 6, list(range(100)), 10)
    assert sample_clients(0, 0, [4, 7], 2) == [4, 7]
    with pytest.raises(ValueError, match="clients_per_round"):
        sample_clients(0, 0, [1, 2], 3)


# ------------------------------------------------------------------ a bounded store: RAM budget, spilled to disk
from pytorch_lightning.callbacks import ModelCheckpoint  # noqa: E402

from fl_lightning.algorithms import SCAFFOLD  # noqa: E402
from fl_lightning.checkpoints import load_checkpoint  # noqa: E402
from tests.helpers import global_vector, synthetic, tiny_client, trainer  # noqa: E402

ENTRY = 210 * 4  # bytes of one SCAFFOLD control of the tiny client


def scaffold(tmp_path, budget: int) -> SCAFFOLD:
    return SCAFFOLD(tiny_client(), clients_per_round=2, local_steps=2, seed=4, client_state_memory=budget,
                    client_state_dir=str(tmp_path / "state"))


def outcome(module) -> dict:
    return {cid: module.store.get(cid, "control").clone() for cid in module.store.clients()}


def test_a_small_budget_spills_to_disk_and_changes_nothing(tmp_path):
    straight = scaffold(tmp_path / "a", 2**30)
    trainer(6).fit(straight, synthetic(8))
    bounded = scaffold(tmp_path / "b", 3 * ENTRY)
    trainer(6).fit(bounded, synthetic(8))
    assert bounded.store.nbytes() <= 3 * ENTRY < 8 * ENTRY
    assert len(list((tmp_path / "b" / "state").glob("*.pt"))) >= 2  # spilled entries live in files
    assert torch.equal(global_vector(straight), global_vector(bounded))
    a, b = outcome(straight), outcome(bounded)
    assert a.keys() == b.keys() and all(torch.equal(a[c], b[c]) for c in a)


def test_a_checkpoint_names_the_files_and_resumes_exactly(tmp_path):
    straight = scaffold(tmp_path / "straight", 3 * ENTRY)
    trainer(6).fit(straight, synthetic(8))
    first = scaffold(tmp_path / "run", 3 * ENTRY)
    ckpt = ModelCheckpoint(dirpath=tmp_path / "ckpt", save_last=True, save_top_k=0)
    trainer(3, callbacks=[ckpt], enable_checkpointing=True).fit(first, synthetic(8))
    store = load_checkpoint(tmp_path / "ckpt" / "last.ckpt")["federated"]["store"]
    assert set(store) == {"entries", "directory", "elsewhere"} and sorted(store["entries"]) == list(first.store.clients())
    assert not any(isinstance(v, torch.Tensor) for e in store["entries"].values() for v in e.values())  # names only
    resumed = scaffold(tmp_path / "other", 3 * ENTRY)  # the checkpoint says where the files are
    trainer(6).fit(resumed, synthetic(8), ckpt_path=str(tmp_path / "ckpt" / "last.ckpt"))
    assert torch.equal(global_vector(straight), global_vector(resumed))
    a, b = outcome(straight), outcome(resumed)
    assert a.keys() == b.keys() and all(torch.equal(a[c], b[c]) for c in a)


def test_files_no_recent_checkpoint_names_are_removed(tmp_path):
    store = ClientStateStore(memory_budget=8, directory=str(tmp_path), keep_checkpoints=1)
    for version in range(3):
        store.set(0, "v", torch.full((2,), float(version)), version=version)
        store.set(1, "v", torch.zeros(2), version=version)  # client 0 is now the least recently written
        store.sync()
        store.state_dict()  # a checkpoint
    files = sorted(p.name for p in tmp_path.glob("*.pt"))
    assert files == ["0.v.2.pt", "1.v.2.pt"]  # the latest checkpoint's; versions 0 and 1, superseded, are gone
    assert torch.equal(store.get(0, "v"), torch.full((2,), 2.0))
    with pytest.raises(ValueError, match="memory_budget must be >= 0 and an integer, got -1"):
        ClientStateStore(memory_budget=-1)


@pytest.mark.slow
def test_two_processes_spill_the_same_entries_as_one(tmp_path):
    from tests.test_contract import Snapshot, assert_same

    results = []
    for devices in (1, 2):
        path = str(tmp_path / f"{devices}.pt")
        module = scaffold(tmp_path / str(devices), 3 * ENTRY)
        strategy = "fl_ddp_spawn" if devices > 1 else "auto"
        trainer(5, devices=devices, strategy=strategy, callbacks=[Snapshot(path)]).fit(module, synthetic(8))
        results.append(torch.load(path))
    assert_same(*results, atol=1e-5)
    assert len(list((tmp_path / "2" / "state").glob("*.pt"))) >= 2


def test_a_checkpoint_of_the_inline_format_resumes_and_is_written_incrementally(tmp_path):
    """Checkpoints written before they were incremental held the RAM part inline; such a store
    loads, and its next checkpoint writes those entries' files and names them."""
    old = {"memory": {4: {"c": torch.full((2,), 4.0)}}, "versions": {4: {"c": 3}}, "spilled": {}}
    store = ClientStateStore(directory=str(tmp_path))
    store.load_state_dict(old)
    assert store.state_dict()["entries"] == {4: {"c": 3}}
    assert torch.equal(torch.load(tmp_path / "4.c.3.pt"), torch.full((2,), 4.0))
