"""Client state store, state vectors and keyed randomness."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import pytorch_lightning as pl
import torch
from torch import nn

from fl_lightning.seeding import derive_seed, generator, sample_clients
from fl_lightning.client_store import ClientStateStore, Manifest, StateSpec, file_sum, read_manifest, read_state_file
from fl_lightning.freed_memory import malloc_trim, resident_bytes
from fl_lightning.vectors import ModelVector


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
    first = store.state_dict()
    sums = {(cid, "c"): file_sum(str(tmp_path / f"{cid}.c.0.pt")) for cid in (1, 2)}  # each file's size and CRC-32
    assert read_manifest(first) == Manifest(str(tmp_path), {1: {"c": 0}, 2: {"c": 0}}, {(1, "c"): (2,), (2, "c"): (2,)},
                                            {}, sums)
    assert set(first) == {"directory", "names", "shapes", "folders"}  # integer columns, whatever the clients
    assert all(t.dtype == torch.int64 and t.shape == (2,) for t in first["names"]["c"].values())
    written = {p.name: p.stat().st_mtime_ns for p in tmp_path.glob("*.pt")}
    assert sorted(written) == ["1.c.0.pt", "2.c.0.pt"]
    store.set(2, "c", torch.full((2,), 3.0), version=1)  # the next round changes client 2 only
    state = store.state_dict()
    assert read_manifest(state).versions == {1: {"c": 0}, 2: {"c": 1}}
    assert {p.name: p.stat().st_mtime_ns for p in tmp_path.glob("*.pt") if p.name != "2.c.1.pt"} == written
    copy = ClientStateStore(directory=str(tmp_path / "mine"))
    copy.load_state_dict(state)  # another run's checkpoint: its files are read where they are
    assert torch.equal(copy.get(2, "c"), torch.full((2,), 3.0)) and torch.equal(copy.get(1, "c"), torch.ones(2))
    assert copy.nbytes() == 16  # read back into RAM (within the budget)
    copy.set(1, "c", torch.zeros(2), version=2)
    again = copy.state_dict()  # names the other run's file of client 2, writes only its own new entry
    assert read_manifest(again).elsewhere == {(2, "c"): str(tmp_path)}
    assert sorted(p.name for p in (tmp_path / "mine").glob("*.pt")) == ["1.c.2.pt"]
    for _ in range(3):
        copy.state_dict()  # pruning never removes another run's files
    assert (tmp_path / "2.c.1.pt").exists() and (tmp_path / "1.c.0.pt").exists()


def test_a_checkpoint_touches_only_the_entries_changed_since_the_last(tmp_path, monkeypatch):
    """Gathering a checkpoint costs the round's entries, not all the stored ones: 40 clients hold
    state, a round changes 3, the next checkpoint updates 3 rows of its columns and hands over the
    same tensors' worth (a row per entry)."""
    store = ClientStateStore(memory_budget=0, directory=str(tmp_path), keep_checkpoints=1)
    for cid in range(40):
        store.set(cid, "c", torch.full((2,), float(cid)), version=0)
    store.sync()
    store.state_dict()
    updated = []
    original = ClientStateStore._put_columns
    monkeypatch.setattr(ClientStateStore, "_put_columns", lambda self, cid, name: (updated.append(cid), original(self, cid, name)))
    for cid in (3, 17, 29):
        store.set(cid, "c", torch.zeros(2), version=1)
    store.sync()
    state = store.state_dict()
    assert sorted(updated) == [3, 17, 29]
    manifest = read_manifest(state)
    assert manifest.versions == {cid: {"c": 1 if cid in (3, 17, 29) else 0} for cid in range(40)}
    assert state["names"]["c"]["clients"].tolist() == list(range(40)) and state["shapes"] == [[2]]
    store.state_dict()  # the files version 1 superseded go once no kept checkpoint names them
    assert not (tmp_path / "3.c.0.pt").exists() and (tmp_path / "4.c.0.pt").exists() and (tmp_path / "3.c.1.pt").exists()


def test_a_checkpoint_of_the_nested_manifest_resumes(tmp_path):
    """The manifest as nested dicts (checkpoints written before it was columns) loads the same."""
    store = ClientStateStore(memory_budget=0, directory=str(tmp_path))
    store.set(1, "c", torch.ones(2), version=0)
    store.set(2, "c", torch.full((2,), 2.0), version=3)
    store.state_dict()
    nested = {"entries": {1: {"c": 0}, 2: {"c": 3}}, "directory": str(tmp_path), "elsewhere": {},
              "shapes": {1: {"c": [2]}, 2: {"c": [2]}}}
    copy = ClientStateStore(directory=str(tmp_path / "next"))
    copy.load_state_dict(nested)
    assert torch.equal(copy.get(2, "c"), torch.full((2,), 2.0)) and torch.equal(copy.get(1, "c"), torch.ones(2))
    assert read_manifest(copy.state_dict()) == Manifest(str(tmp_path / "next"), {1: {"c": 0}, 2: {"c": 3}},
                                                        {(1, "c"): (2,), (2, "c"): (2,)},
                                                        {(1, "c"): str(tmp_path), (2, "c"): str(tmp_path)})


def test_store_keeps_a_copy():
    store, value = ClientStateStore(), torch.zeros(2)
    store.set(0, "v", value)
    value += 1
    assert torch.equal(store.get(0, "v"), torch.zeros(2))


def test_state_vector_round_trip_with_buffers():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(3, 2), nn.BatchNorm1d(2))
    sv = ModelVector(net)
    assert sv.num_params == 3 * 2 + 2 + 2 + 2 and sv.dim == sv.num_params + 4  # + running mean/var
    vec = torch.arange(sv.dim, dtype=torch.float32)
    sv.load(vec)
    assert torch.equal(sv.flatten(), vec)
    assert torch.equal(net[1].running_var, vec[-2:])
    with pytest.raises(ValueError, match="entries"):
        sv.load(torch.zeros(3))


def _folded_seed(seed: int, *keys) -> int:
    """derive_seed written out: splitmix64 of the seed, then of each key (crc32 for strings) mixed in."""
    import zlib

    mask = (1 << 64) - 1

    def splitmix64(x: int) -> int:
        x = (x + 0x9E3779B97F4A7C15) & mask
        x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & mask
        x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & mask
        return x ^ (x >> 31)

    h = splitmix64(seed & mask)
    for key in keys:
        h = splitmix64(h ^ ((zlib.crc32(key.encode()) if isinstance(key, str) else key) & mask))
    return h & ((1 << 63) - 1)


def test_keyed_generators():
    assert derive_seed(0, "a", 1) == derive_seed(0, "a", 1) != derive_seed(0, "a", 2) != derive_seed(0, "b", 1)
    # the shared prefix (seed, stream, round) is mixed once and cached: the same seeds as the fold itself
    for seed, keys in [(0, ()), (3, ("batches",)), (3, ("batches", 7, 0)), (3, ("batches", 7, 1)), (-1, (2**70, "x")),
                       (5, ("a", "b", 9, -1))]:
        assert derive_seed(seed, *keys) == _folded_seed(seed, *keys)
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
from tests.helpers import TWO_PROCESSES, global_vector, synthetic, tiny_client, trainer  # noqa: E402

ENTRY = 210 * 4  # bytes of one SCAFFOLD control of the tiny client


def scaffold(tmp_path, budget: int) -> SCAFFOLD:
    return SCAFFOLD(tiny_client(), clients_per_round=2, local_steps=2, seed=4, client_state_memory=budget,
                    client_state_dir=str(tmp_path / "state"))


def outcome(module) -> dict:
    return {cid: module.engine.store.get(cid, "control").clone() for cid in module.engine.store.clients()}


def test_a_small_budget_spills_to_disk_and_changes_nothing(tmp_path):
    straight = scaffold(tmp_path / "a", 2**30)
    trainer(6).fit(straight, synthetic(8))
    bounded = scaffold(tmp_path / "b", 3 * ENTRY)
    trainer(6).fit(bounded, synthetic(8))
    assert bounded.engine.store.nbytes() <= 3 * ENTRY < 8 * ENTRY
    assert len(list((tmp_path / "b" / "state").rglob("*.pt"))) >= 2  # spilled entries live in files (the run's folder)
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
    assert set(store) == {"directory", "names", "shapes", "folders"}
    assert sorted(read_manifest(store).versions) == list(first.engine.store.clients())
    assert all(t.dtype == torch.int64 for c in store["names"].values() for t in c.values())  # names only
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
    # the latest checkpoint's, and the one before (kept while the latest was written); version 0 is gone
    assert files == ["0.v.1.pt", "0.v.2.pt", "1.v.1.pt", "1.v.2.pt"]
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
        strategy = TWO_PROCESSES if devices > 1 else "auto"
        trainer(5, devices=devices, strategy=strategy, callbacks=[Snapshot(path)]).fit(module, synthetic(8))
        results.append(torch.load(path))
    assert_same(*results, atol=1e-5)
    assert len(list((tmp_path / "2" / "state").rglob("*.pt"))) >= 2


def test_a_checkpoint_of_the_inline_format_resumes_and_is_written_incrementally(tmp_path):
    """Checkpoints written before they were incremental held the RAM part inline; such a store
    loads, and its next checkpoint writes those entries' files and names them."""
    old = {"memory": {4: {"c": torch.full((2,), 4.0)}}, "versions": {4: {"c": 3}}, "spilled": {}}
    store = ClientStateStore(directory=str(tmp_path))
    store.load_state_dict(old)
    assert read_manifest(store.state_dict()).versions == {4: {"c": 3}}
    assert torch.equal(read_state_file(str(tmp_path / "4.c.3.pt")), torch.full((2,), 4.0))


# ------------------------------------------------------------------ a run owns its folder
from fl_lightning.callbacks import RoundCheckpoint  # noqa: E402
from fl_lightning.checkpoints import CheckpointError  # noqa: E402


def checkpointed(module, rounds: int, folder, **kwargs):
    """Train ``module`` for ``rounds`` rounds with a ``RoundCheckpoint`` in ``folder``."""
    trainer(rounds, callbacks=[RoundCheckpoint(dirpath=str(folder))], enable_checkpointing=True).fit(
        module, synthetic(8), **kwargs)
    return module


def assert_same_run(a, b) -> None:
    assert torch.equal(global_vector(a), global_vector(b))
    x, y = outcome(a), outcome(b)
    assert x.keys() == y.keys() and all(torch.equal(x[c], y[c]) for c in x)


class KilledInFirstWrite(RoundCheckpoint):
    """Dies while writing its first checkpoint: after the module's state is gathered, before the file is whole."""

    def save_round(self, trainer):
        trainer.save_checkpoint(self.path + ".tmp")
        raise RuntimeError("killed while writing the checkpoint")


def test_a_resumed_run_killed_in_its_first_checkpoint_write_leaves_the_checkpoint_resumable(tmp_path):
    straight = scaffold(tmp_path / "straight", 2**30)
    trainer(6).fit(straight, synthetic(8))
    checkpointed(scaffold(tmp_path, 3 * ENTRY), 3, tmp_path / "ckpt")
    last = str(tmp_path / "ckpt" / "last.ckpt")
    with pytest.raises(RuntimeError, match="killed"):  # resumed into the same client_state_dir, killed in its first write
        trainer(6, callbacks=[KilledInFirstWrite(dirpath=str(tmp_path / "ckpt"))], enable_checkpointing=True).fit(
            scaffold(tmp_path, 3 * ENTRY), synthetic(8), ckpt_path=last)
    resumed = scaffold(tmp_path, 3 * ENTRY)
    trainer(6).fit(resumed, synthetic(8), ckpt_path=last)
    assert_same_run(straight, resumed)


@pytest.mark.parametrize("keep", [2, None])
def test_two_runs_sharing_a_client_state_dir_keep_their_own_files(tmp_path, keep):
    def make(lr=0.1):
        return SCAFFOLD(tiny_client(lr=lr), clients_per_round=2, local_steps=2, seed=4, client_state_memory=3 * ENTRY,
                        client_state_dir=str(tmp_path / "state"), client_state_checkpoints=keep)

    straight = make()
    trainer(6).fit(straight, synthetic(8))
    checkpointed(make(), 3, tmp_path / "a")
    checkpointed(make(lr=0.05), 6, tmp_path / "b")  # another run in the same folder: the same clients, other values
    resumed = make()
    trainer(6).fit(resumed, synthetic(8), ckpt_path=str(tmp_path / "a" / "last.ckpt"))
    assert_same_run(straight, resumed)
    runs = [p for p in (tmp_path / "state").iterdir() if p.is_dir()]
    assert len(runs) == 4 and all(any(p.glob("*.pt")) for p in runs)  # one folder per run (all four share the dir)


def test_keeping_one_checkpoint_keeps_its_files_while_the_next_is_written(tmp_path):
    store = ClientStateStore(memory_budget=0, directory=str(tmp_path), keep_checkpoints=1)
    store.set(0, "v", torch.zeros(2), version=0)
    written = store.state_dict()  # the checkpoint on disk
    store.set(0, "v", torch.ones(2), version=1)
    store.state_dict()  # the next one, still being written when the process dies
    copy = ClientStateStore(directory=str(tmp_path / "next"))
    copy.load_state_dict(written)
    assert torch.equal(copy.get(0, "v"), torch.zeros(2))
    same = ClientStateStore(memory_budget=0, directory=str(tmp_path), keep_checkpoints=1)
    same.load_state_dict(written)  # a store resuming in its own folder knows which files the loaded checkpoint needs
    same.set(0, "v", torch.full((2,), 2.0), version=2)
    same.state_dict()  # killed while writing this one
    assert (tmp_path / "0.v.0.pt").exists()


def test_a_relative_client_state_dir_resumes_from_another_working_directory_and_after_a_move(tmp_path, monkeypatch):
    import shutil

    straight = scaffold(tmp_path / "straight", 3 * ENTRY)
    trainer(6).fit(straight, synthetic(8))
    (tmp_path / "a").mkdir()
    monkeypatch.chdir(tmp_path / "a")
    first = SCAFFOLD(tiny_client(), clients_per_round=2, local_steps=2, seed=4, client_state_memory=3 * ENTRY,
                     client_state_dir="run/state")  # as the shipped configs: a path relative to the working directory
    checkpointed(first, 3, "run/ckpt")
    (tmp_path / "b").mkdir()
    monkeypatch.chdir(tmp_path / "b")
    resumed = scaffold(tmp_path / "c", 3 * ENTRY)
    trainer(6).fit(resumed, synthetic(8), ckpt_path=str(tmp_path / "a" / "run" / "ckpt" / "last.ckpt"))
    assert_same_run(straight, resumed)
    shutil.move(tmp_path / "a" / "run", tmp_path / "moved")  # the run's folder, checkpoints and state together
    moved = scaffold(tmp_path / "d", 3 * ENTRY)
    trainer(6).fit(moved, synthetic(8), ckpt_path=str(tmp_path / "moved" / "ckpt" / "last.ckpt"))
    assert_same_run(straight, moved)
    shutil.move(tmp_path / "moved" / "state", tmp_path / "gone")
    with pytest.raises(CheckpointError, match="client state folder .* is missing"):  # at load, not mid-run
        trainer(6).fit(scaffold(tmp_path / "e", 3 * ENTRY), synthetic(8),
                       ckpt_path=str(tmp_path / "moved" / "ckpt" / "last.ckpt"))
    # loading the global model alone (inference, evaluation) needs no client state: a warning, not a refusal
    with pytest.warns(UserWarning, match="client state is not loaded"):
        loaded = SCAFFOLD.load_from_checkpoint(str(tmp_path / "moved" / "ckpt" / "last.ckpt"))
    assert torch.equal(global_vector(loaded), global_vector(first))  # the round-3 model that wrote it


def test_stale_temporary_files_of_a_dead_writer_are_removed_on_resume(tmp_path):
    import socket
    import subprocess
    import sys

    checkpointed(scaffold(tmp_path, 3 * ENTRY), 2, tmp_path / "ckpt")
    folder = Path(load_checkpoint(tmp_path / "ckpt" / "last.ckpt")["federated"]["store"]["directory"])
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        host = socket.gethostname()
        stale = folder / f"7.control.2.pt.{host}-{int(dead.stdout)}.tmp"  # a write the kill cut short
        busy = folder / f"7.control.3.pt.{host}-{live.pid}.tmp"  # another live run's write in progress
        for path in (stale, busy):
            path.write_bytes(b"PK cut short")
        trainer(3).fit(scaffold(tmp_path, 3 * ENTRY), synthetic(8), ckpt_path=str(tmp_path / "ckpt" / "last.ckpt"))
        assert not stale.exists() and busy.exists()
    finally:
        live.kill()
        live.wait()


def test_a_run_without_client_state_creates_no_folder(tmp_path):
    from fl_lightning.algorithms import FedAvg

    trainer(2, default_root_dir=str(tmp_path)).fit(FedAvg(tiny_client(), clients_per_round=2, local_steps=1),
                                                   synthetic(4))
    assert not (tmp_path / "client_state").exists()
    trainer(1, default_root_dir=str(tmp_path)).fit(scaffold(tmp_path / "s", 0), synthetic(4))  # written: created
    assert any((tmp_path / "s" / "state").rglob("*.pt"))


@pytest.mark.parametrize("kwargs, match", [
    ({"client_state_dir": 123}, "client_state_dir must be a folder path .*, got 123"),
    ({"client_state_dir": __file__}, "client_state_dir must be a folder path .*, got .*test_client_store.py.* a file"),
    ({"client_state_dir": "/proc/fl-lightning/state"}, "client_state_dir must be a folder path .*/proc.*cannot write"),
    ({"client_state_memory": -1}, "client_state_memory must be >= 0 and an integer, got -1"),
    ({"client_state_checkpoints": 0}, "client_state_checkpoints must be >= 1 and an integer, got 0"),
])
def test_bad_client_state_arguments_fail_at_construction(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SCAFFOLD(tiny_client(), **kwargs)


def test_a_store_without_a_folder_takes_new_versions_and_checkpoints_inline():
    store = ClientStateStore()
    for version in range(3):
        store.set(0, "c", torch.full((2,), float(version)), version=version)
    state = store.state_dict()
    copy = ClientStateStore()
    copy.load_state_dict(state)
    assert torch.equal(copy.get(0, "c"), torch.full((2,), 2.0))


# ------------------------------------------------------------------ superseded files, freed memory
@pytest.mark.parametrize("keep", [1, None])
def test_a_version_no_checkpoint_names_is_removed_at_the_round_end(tmp_path, keep):
    """Without checkpoints, files do not pile up: a version superseded before any checkpoint named it
    goes at the end of the round that superseded it; the versions kept checkpoints name stay."""
    store = ClientStateStore(memory_budget=0, directory=str(tmp_path), keep_checkpoints=keep)
    store.set(0, "v", torch.zeros(2), version=0)
    store.set(1, "v", torch.zeros(2), version=0)
    store.sync()
    store.state_dict()  # names version 0 of both
    for version in (1, 2, 3):
        store.set(0, "v", torch.full((2,), float(version)), version=version)
        store.set(1, "v", torch.zeros(2), version=version)  # client 0 is now the least recently written: spilled
        store.sync()
        assert sorted(p.name for p in tmp_path.glob("*.pt")) == ["0.v.0.pt", f"0.v.{version}.pt", "1.v.0.pt"]
    store.set(0, "v", torch.full((2,), 4.0), version=3)  # the same version again: its file is written anew
    store.set(1, "v", torch.zeros(2), version=3)
    store.sync()
    assert torch.equal(read_state_file(str(tmp_path / "0.v.3.pt")), torch.full((2,), 4.0))
    assert torch.equal(store.get(0, "v"), torch.full((2,), 4.0))


def test_a_run_without_checkpoints_keeps_a_file_per_entry_at_most(tmp_path):
    module = scaffold(tmp_path, 0)
    trainer(6).fit(module, synthetic(8))
    assert len(list((tmp_path / "state").rglob("*.pt"))) < len(module.engine.store)  # (the latest client's is in RAM)


glibc = pytest.mark.skipif(malloc_trim() is None or resident_bytes() is None,
                           reason="needs glibc's malloc_trim and /proc/self/statm")


@glibc
def test_the_store_gives_freed_memory_back_once_the_process_grew_past_its_budget(tmp_path):
    """Freed blocks below glibc's mmap threshold that longer-lived ones sit above stay resident, free
    (a 10,000-client run grew by hundreds of MiB of them): the store's round end gives them back once
    the process grew by more than the budget (here the least allowance, 32 MiB)."""
    import ctypes

    libc = ctypes.CDLL(None)
    libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
    store = ClientStateStore(memory_budget=0, directory=str(tmp_path))
    malloc_trim()(0)
    store.sync()  # the memory it starts from
    block = 64 * 1024  # below the mmap threshold: from the heap
    blocks = [libc.malloc(block) for _ in range(1536)]  # 96 MiB
    try:
        for address in blocks:
            ctypes.memset(address, 1, block)
        for address in blocks[::3] + blocks[1::3]:
            libc.free(address)  # 64 MiB freed, each block held in place by the next one
        before = resident_bytes()
        store.sync()
        assert before - resident_bytes() > 48 * 2**20
    finally:
        for address in blocks[2::3]:
            libc.free(address)


def test_without_glibc_the_store_gives_nothing_back_and_runs(tmp_path, monkeypatch):
    from fl_lightning import freed_memory

    for missing in ("malloc_trim", "resident_bytes"):
        with monkeypatch.context() as patch:
            patch.setattr(freed_memory, missing, lambda: None)
            memory = freed_memory.FreedMemory()
            assert not memory.give_back(0) and not memory.give_back(0)
            store = ClientStateStore(memory_budget=0, directory=str(tmp_path))
            store.set(0, "v", torch.ones(2))
            store.sync()
            assert torch.equal(store.get(0, "v"), torch.ones(2))


# ------------------------------------------------------------------ a resume checks and owns its files
def test_a_resume_names_the_first_damaged_files_and_how_many_more(tmp_path):
    store = ClientStateStore(memory_budget=0, directory=str(tmp_path / "a"))
    for cid in range(8):
        store.set(cid, "c", torch.full((4,), float(cid)), version=0)
    state = store.state_dict()
    copy = ClientStateStore(memory_budget=0, directory=str(tmp_path / "c"))
    copy.load_state_dict(state)  # not resuming (evaluation): read where they are, when needed
    files = [tmp_path / "a" / f"{cid}.c.0.pt" for cid in range(7)]
    for path in files:
        path.write_bytes(path.read_bytes()[:100])
    named = "; ".join(f"the client-state file {path} is truncated or damaged [^;]*" for path in files[:5])
    with pytest.raises(ValueError, match=f"7 of the 8 client-state files it names are missing or damaged: {named}; "
                                         "and 2 more. A file is removed once client_state_checkpoints"):
        ClientStateStore(directory=str(tmp_path / "b")).load_state_dict(state, resuming=True)
    files[0].unlink()
    with pytest.raises(FileNotFoundError, match=r"missing: .* after newer checkpoints \(client_state_checkpoints\)"):
        copy.get(0, "c")


def test_a_checkpoint_without_file_sums_is_checked_by_reading_every_file(tmp_path):
    """Checkpoints written before the files' sizes and checksums were recorded resume: each file is
    read and checked whole, and the resumed run's checkpoints record them."""
    store = ClientStateStore(memory_budget=0, directory=str(tmp_path / "a"))
    for cid in range(3):
        store.set(cid, "c", torch.full((4,), float(cid)), version=0)
    state = store.state_dict()
    for columns in state["names"].values():
        del columns["sizes"], columns["checksums"]
    assert read_manifest(state).files == {}
    resumed = ClientStateStore(memory_budget=0, directory=str(tmp_path / "b"))
    resumed.load_state_dict(state, resuming=True)
    assert read_manifest(resumed.state_dict()).files == {(cid, "c"): file_sum(str(tmp_path / "b" / f"{cid}.c.0.pt"))
                                                         for cid in range(3)}
    path = tmp_path / "a" / "1.c.0.pt"
    path.write_bytes((tmp_path / "a" / "2.c.0.pt").read_bytes())  # another entry's file
    with pytest.raises(ValueError, match=f"1 of the 3 .* client-state file {path} holds the entry of file '2.c.0.pt'"):
        ClientStateStore(directory=str(tmp_path / "c")).load_state_dict(state, resuming=True)


@pytest.mark.parametrize("links", [True, False])
def test_a_resumed_store_takes_its_own_link_of_every_file(tmp_path, monkeypatch, links):
    """A resume links (or, across file systems, copies) the checkpoint's files into its own folder:
    the run that wrote them may remove them and the resumed store still reads its own."""
    import errno
    import os

    original = ClientStateStore(memory_budget=0, directory=str(tmp_path / "original"))
    for cid in range(3):
        original.set(cid, "c", torch.full((4,), float(cid)), version=0)
    state = original.state_dict()
    if not links:
        def cross_device(source, target):
            raise OSError(errno.EXDEV, "Invalid cross-device link")
        monkeypatch.setattr(os, "link", cross_device)
    resumed = ClientStateStore(memory_budget=0, directory=str(tmp_path / "resumed"))
    resumed.load_state_dict(state, resuming=True)
    for cid in range(3):
        mine, theirs = tmp_path / "resumed" / f"{cid}.c.0.pt", tmp_path / "original" / f"{cid}.c.0.pt"
        assert (mine.stat().st_ino == theirs.stat().st_ino) == links and mine.read_bytes() == theirs.read_bytes()
    ClientStateStore(memory_budget=0, directory=str(tmp_path / "resumed")).load_state_dict(state, resuming=True)
    assert all((mine.stat().st_ino == theirs.stat().st_ino) == links for mine, theirs in (  # a file there: replaced
        (tmp_path / "resumed" / f"{cid}.c.0.pt", tmp_path / "original" / f"{cid}.c.0.pt") for cid in range(3)))
    for path in (tmp_path / "original").iterdir():
        path.unlink()  # the original prunes them
    assert [float(resumed.get(cid, "c")[0]) for cid in range(3)] == [0.0, 1.0, 2.0]
    again = ClientStateStore(directory=str(tmp_path / "again"))
    again.load_state_dict(resumed.state_dict(), resuming=True)  # names the resumed store's own files only
    assert [float(again.get(cid, "c")[0]) for cid in range(3)] == [0.0, 1.0, 2.0]


def test_a_file_removed_before_the_resume_linked_it_is_named(tmp_path, monkeypatch):
    original = ClientStateStore(memory_budget=0, directory=str(tmp_path / "original"))
    for cid in range(3):
        original.set(cid, "c", torch.full((4,), float(cid)), version=0)
    state = original.state_dict()
    check = ClientStateStore._check_files

    def checked_then_pruned(store):
        check(store)
        (tmp_path / "original" / "1.c.0.pt").unlink()  # by the original run, still running

    monkeypatch.setattr(ClientStateStore, "_check_files", checked_then_pruned)
    with pytest.raises(ValueError, match=f"1 client-state files the checkpoint names were removed while the resume took "
                                         f"its own links to them \\({tmp_path / 'original' / '1.c.0.pt'}\\): the run that "
                                         "wrote them is still running .* resume from its latest checkpoint"):
        ClientStateStore(directory=str(tmp_path / "resumed")).load_state_dict(state, resuming=True)


class PrunedByTheOriginal(pl.Callback):
    """Removes the original run's client-state folder once the resumed run has started: what the
    original, still running, does to the files its newer checkpoints no longer name."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder

    def on_train_start(self, trainer, pl_module) -> None:
        shutil.rmtree(self.folder)


def test_a_resume_keeps_going_when_the_original_run_prunes_the_files_it_read(tmp_path):
    straight = scaffold(tmp_path / "straight", 3 * ENTRY)
    trainer(8).fit(straight, synthetic(8))
    checkpointed(scaffold(tmp_path, 3 * ENTRY), 3, tmp_path / "original")
    folder = Path(load_checkpoint(tmp_path / "original" / "last.ckpt")["federated"]["store"]["directory"])
    resumed = scaffold(tmp_path, 3 * ENTRY)
    trainer(5, callbacks=[RoundCheckpoint(dirpath=str(tmp_path / "resumed")), PrunedByTheOriginal(folder)],
            enable_checkpointing=True).fit(resumed, synthetic(8), ckpt_path=str(tmp_path / "original" / "last.ckpt"))
    assert not folder.exists()
    again = scaffold(tmp_path, 3 * ENTRY)  # the resumed run's own checkpoint resumes
    trainer(8).fit(again, synthetic(8), ckpt_path=str(tmp_path / "resumed" / "last.ckpt"))
    assert_same_run(straight, again)


def resume_on_rank(rank: int, state: dict, folder: str):
    """A store of ``folder`` resuming ``state`` on one of the ranks: its entries' values, or its refusal."""
    store = ClientStateStore(memory_budget=0, directory=folder)
    try:
        store.load_state_dict(state, resuming=True)
    except ValueError as error:
        return str(error)
    return [float(store.get(cid, "c")[0]) for cid in range(4)]


def test_two_processes_resume_checking_a_share_of_the_files_each(tmp_path):
    """With several processes each checks a share of the files and all learn what is damaged (a file
    that only rank 1 checks is named on rank 0; neither waits for the other); rank 0 links the files,
    which every process then reads."""
    from tests import two_processes

    original = ClientStateStore(memory_budget=0, directory=str(tmp_path / "original"))
    for cid in range(4):
        original.set(cid, "c", torch.full((4,), float(cid)), version=0)
    state = original.state_dict()
    ranks = two_processes.pool(2)
    assert ranks.run(resume_on_rank, [state, str(tmp_path / "resumed")]) == [0.0, 1.0, 2.0, 3.0]
    assert sorted(p.name for p in (tmp_path / "resumed").iterdir()) == [f"{cid}.c.0.pt" for cid in range(4)]
    path = tmp_path / "original" / "1.c.0.pt"  # rank 1 checks clients 1 and 3
    path.write_bytes(path.read_bytes()[:-8])
    assert ranks.run(resume_on_rank, [state, str(tmp_path / "again")]).startswith(
        f"1 of the 4 client-state files it names are missing or damaged: the client-state file {path} is truncated")
