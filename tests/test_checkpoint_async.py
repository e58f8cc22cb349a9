"""``RoundCheckpoint`` writes on a background thread: the same file as a write on the training
thread, a copy of the state taken when the round ends, its errors raised by ``fit``, and a
checkpoint written while the next rounds train resumes bitwise."""

from __future__ import annotations

import shutil
import threading
from collections import OrderedDict
from pathlib import Path
from typing import Any

import pytest
import torch

from fl_lightning.algorithms import SCAFFOLD
from fl_lightning.callbacks import RoundCheckpoint
from fl_lightning.checkpoints import load_checkpoint
from tests.helpers import checkpoint_client_state, global_vector, synthetic, tiny_client, trainer


def make() -> SCAFFOLD:
    """A federation with server state, optimizer state and client state in its checkpoint."""
    return SCAFFOLD(tiny_client(hidden=(8,)), clients_per_round=3, local_steps=3, seed=1)


def fit(rounds: int, checkpoint: RoundCheckpoint, root: Path, **kwargs: Any) -> SCAFFOLD:
    module = make()
    trainer(rounds, callbacks=[checkpoint], enable_checkpointing=True, default_root_dir=str(root)).fit(
        module, synthetic(6), **kwargs)
    return module


def assert_identical(a: Any, b: Any, where: str = "checkpoint") -> None:
    """``a`` and ``b`` hold the same keys, data and tensors (dtype, shape, device and bits)."""
    assert type(a) is type(b), where
    if isinstance(a, torch.Tensor):
        assert (a.dtype, a.shape, a.device) == (b.dtype, b.shape, b.device) and torch.equal(a, b), where
    elif isinstance(a, dict):
        assert list(a) == list(b), where
        for key in a:
            assert_identical(a[key], b[key], f"{where}[{key!r}]")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            assert_identical(x, y, f"{where}[{i}]")
    else:
        assert a == b, where


def test_a_file_written_in_the_background_equals_one_written_on_the_training_thread(tmp_path):
    written = {}
    for asynchronous in (False, True):
        fit(2, RoundCheckpoint(dirpath=str(tmp_path / "ckpt"), asynchronous=asynchronous), tmp_path)
        kept = shutil.move(tmp_path / "ckpt" / "last.ckpt", tmp_path / f"{asynchronous}.ckpt")
        (tmp_path / "ckpt" / "owner.json").unlink()  # the folder is handed to the next run (same callback state)
        written[asynchronous] = load_checkpoint(kept)
    clients = {a: checkpoint_client_state(c) for a, c in written.items()}
    assert clients[True] and clients[True].keys() == clients[False].keys()
    assert_identical(clients[True], clients[False], "client state")
    for checkpoint in written.values():
        del checkpoint["federated"]["store"]["directory"]  # each run's own client-state folder
    assert_identical(written[True], written[False])


class FailingWrite(RoundCheckpoint):
    """Fails to write the checkpoint of round ``fail_round`` (0-based), recording the thread it wrote on."""

    def __init__(self, fail_round: int, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.fail_round = fail_round
        self.threads: set[str] = set()

    def write(self, strategy, checkpoint, path):
        self.threads.add(threading.current_thread().name)
        if checkpoint["epoch"] == self.fail_round:
            raise OSError("No space left on device")
        super().write(strategy, checkpoint, path)


@pytest.mark.parametrize("fail_round", [0, 2])  # raised at the next checkpoint; at the end of fit
def test_an_error_of_the_background_write_is_raised_by_fit(tmp_path, fail_round):
    checkpoint = FailingWrite(fail_round, dirpath=str(tmp_path / "ckpt"))
    with pytest.raises(OSError, match="No space left on device"):
        fit(3, checkpoint, tmp_path)
    assert checkpoint.threads and all(name.startswith("RoundCheckpoint") for name in checkpoint.threads)
    assert checkpoint._writer is None  # the thread is ended


class ChangedAfterSave(RoundCheckpoint):
    """Changes the parameters in place right after the round's checkpoint is taken, before the
    background write starts; keeps the state the checkpoint was taken from."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.taken: OrderedDict[str, torch.Tensor] = OrderedDict()
        self.changed = threading.Event()

    def save_round(self, trainer):
        module = trainer.lightning_module
        self.taken = OrderedDict((k, v.clone()) for k, v in module.state_dict().items())
        super().save_round(trainer)
        with torch.no_grad():
            for value in module.state_dict().values():
                value.add_(1.0)
        self.changed.set()

    def write(self, strategy, checkpoint, path):
        assert self.changed.wait(timeout=60)
        super().write(strategy, checkpoint, path)


def test_the_checkpoint_is_the_state_when_the_round_ended(tmp_path):
    checkpoint = ChangedAfterSave(dirpath=str(tmp_path / "ckpt"))
    module = fit(1, checkpoint, tmp_path)
    state = load_checkpoint(tmp_path / "ckpt" / "last.ckpt")["state_dict"]
    assert_identical(state, checkpoint.taken, "state_dict")
    assert not torch.equal(next(iter(module.state_dict().values())), next(iter(state.values())))  # it did change


class KeepsRoundTwo(RoundCheckpoint):
    """Copies ``last.ckpt`` to ``round2.ckpt`` once round 2's write is done (on the writer thread)."""

    def write(self, strategy, checkpoint, path):
        super().write(strategy, checkpoint, path)
        if checkpoint["epoch"] == 1:
            shutil.copy(path, Path(path).with_name("round2.ckpt"))


def test_a_checkpoint_written_while_training_went_on_resumes_bitwise(tmp_path):
    straight = fit(4, KeepsRoundTwo(dirpath=str(tmp_path / "ckpt")), tmp_path)  # checkpointing leaves the run as is
    resumed = make()
    round2 = str(tmp_path / "ckpt" / "round2.ckpt")
    trainer(4, default_root_dir=str(tmp_path)).fit(resumed, synthetic(6), ckpt_path=round2)
    assert torch.equal(global_vector(straight), global_vector(resumed))
    assert torch.equal(straight.server_control, resumed.server_control)
    assert sorted(straight.engine.store.clients()) == sorted(resumed.engine.store.clients())
    for cid in straight.engine.store.clients():
        assert torch.equal(straight.engine.store.get(cid, "control"), resumed.engine.store.get(cid, "control"))


def test_asynchronous_must_be_a_bool():
    with pytest.raises(ValueError, match="asynchronous must be True or False, got 'yes'"):
        RoundCheckpoint(asynchronous="yes")


def test_the_snapshot_copies_every_tensor_and_rebuilds_every_container():
    """What the training thread hands the writer: no tensor or container shared with the state it
    copies (training goes on changing that in place), the same values and container types."""
    from collections import namedtuple

    from lightning_utilities.core.apply_func import apply_to_collection

    from fl_lightning.callbacks.checkpoint import snapshot

    Pair = namedtuple("Pair", "a b")
    rows = [1, 2.5, "x", None, True, b"y"]
    state = {"model": OrderedDict(w=torch.ones(2), b=torch.zeros(1)), "rows": rows, "pair": Pair(torch.ones(1), 3),
             "nested": {"t": (torch.arange(3), [torch.eye(2)])}}
    copy = snapshot(state)
    expected = apply_to_collection(state, torch.Tensor, lambda t: t.detach().clone())
    assert type(copy["model"]) is OrderedDict and type(copy["pair"]) is Pair and type(copy["nested"]["t"]) is tuple
    assert copy["rows"] == rows and copy["rows"] is not rows and copy["nested"] is not state["nested"]
    originals = [state["model"]["w"], state["model"]["b"], state["pair"].a, state["nested"]["t"][0],
                 state["nested"]["t"][1][0]]
    copies = [copy["model"]["w"], copy["model"]["b"], copy["pair"].a, copy["nested"]["t"][0], copy["nested"]["t"][1][0]]
    wanted = [expected["model"]["w"], expected["model"]["b"], expected["pair"].a, expected["nested"]["t"][0],
              expected["nested"]["t"][1][0]]
    for original, copied, value in zip(originals, copies, wanted):
        assert torch.equal(copied, value) and copied.data_ptr() != original.data_ptr()
    state["model"]["w"].add_(1.0)
    rows.append(7)
    assert torch.equal(copy["model"]["w"], torch.ones(2)) and copy["rows"] == [1, 2.5, "x", None, True, b"y"]
