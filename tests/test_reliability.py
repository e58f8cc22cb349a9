"""Reliability and security: a run killed mid-round (or mid-write) resumes bitwise from
``last.ckpt``; no load path runs code from a file; the CLI's ``--ckpt_path`` never changes what
the user configured; non-finite updates and state never persist; bad input fails clearly."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import time
from functools import partial
from pathlib import Path
from typing import Any

import pytest
import pytorch_lightning as pl
import torch
import torch.nn.functional as F
from torch import nn
from torchmetrics.classification import MulticlassAccuracy
from torch.utils.data import TensorDataset

from fl_lightning import NonFiniteUpdateError
from fl_lightning.algorithms import SCAFFOLD, FedAvg, FedDRO, PeFLL
from fl_lightning.callbacks import (CenteredClipping, ClassAccuracy, DifferentialPrivacy, FederatedCallback,
                                    LocalFinetuning, PersonalizedAccuracy, RoundCheckpoint, RoundHistory, SignFlipAttack)
from fl_lightning.checkpoints import CheckpointError, add_checksum, load_checkpoint, with_checksum
from fl_lightning.cli import FederatedCLI, main
from fl_lightning.datamodules import FederatedDataModule, SyntheticFederated
from fl_lightning.functional.dro import KLDRO
from fl_lightning.models import CNN, MLP, LeNet, LogisticRegression, ResNet20
from fl_lightning.client_store import read_manifest, read_state_file, state_file
from fl_lightning.distributed import rank_and_world
from fl_lightning.models import LogisticRegression
from fl_lightning.models.hypernetwork import MLPEmbedding
from fl_lightning.optim import FedAdam
from tests.helpers import TWO_PROCESSES, global_vector, synthetic, tiny_client, trainer
from tests.fresh_python import FreshPython

ROOT = Path(__file__).resolve().parent.parent
QUICK = str(ROOT / "configs" / "quickstart.yaml")


def build(name: str) -> pl.LightningModule:
    """The federations killed in tests/crash_child.py (also built here, to compare)."""
    torch.manual_seed(0)
    if name == "FedAvg":
        return FedAvg(tiny_client(hidden=(8,)), clients_per_round=3, local_steps=3, seed=1, server_momentum=0.5)
    if name == "SCAFFOLD":
        return SCAFFOLD(tiny_client(hidden=(8,)), clients_per_round=3, local_steps=3, seed=1)
    return FedDRO(tiny_client(hidden=(8,)), KLDRO(lam=2.0), beta=0.5, local_steps=2, clients_per_round=6, seed=1)


def data() -> SyntheticFederated:
    return synthetic(6)


def killed_run(name: str, folder: Path, mode: str) -> None:
    """Run tests/crash_child.py until it hangs in round 3, then SIGKILL it."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    child = FreshPython(["-m", "tests.crash_child", name, str(folder), mode], cwd=ROOT, env=env)
    deadline = time.time() + 120
    while not (folder / "ready").exists():
        if child.poll() is not None:
            raise AssertionError(f"the child ended before hanging: {child.stderr[-2000:]}")
        if time.time() > deadline:
            child.kill()
            raise AssertionError("the child did not reach round 3")
        time.sleep(0.1)
    child.kill()
    assert child.wait(60) == -signal.SIGKILL


@pytest.mark.slow
@pytest.mark.parametrize("name", ["FedAvg", "SCAFFOLD", "FedDRO"])
@pytest.mark.parametrize("mode", ["round", "write"])
def test_a_killed_run_resumes_bitwise_from_last_ckpt(name, mode, tmp_path):
    killed_run(name, tmp_path, mode)
    last = tmp_path / "last.ckpt"
    assert load_checkpoint(last)["global_step"] == 3  # rounds 0-2 kept; round 3 (and its partial write) lost
    straight = build(name)
    trainer(5).fit(straight, data())
    resumed = build(name)
    trainer(5).fit(resumed, data(), ckpt_path=str(last))
    assert torch.equal(global_vector(straight), global_vector(resumed))
    for cid in straight.engine.store.clients():
        for entry in straight.engine.state_specs:
            assert torch.equal(straight.engine.store.get(cid, entry), resumed.engine.store.get(cid, entry))


@pytest.mark.parametrize("asynchronous", [True, False])
def test_round_checkpoint_writes_every_n_rounds_and_the_last(tmp_path, asynchronous):
    steps = []
    checkpoint = RoundCheckpoint(dirpath=str(tmp_path), every_n_rounds=2, asynchronous=asynchronous)

    class Spy(pl.Callback):  # what is on disk when each round starts (once a pending write is done), and at the end
        def on_train_epoch_start(self, trainer, module):
            checkpoint.wait()
            path = tmp_path / "last.ckpt"
            steps.append(load_checkpoint(path)["global_step"] if path.exists() else None)

        on_train_end = on_train_epoch_start

    trainer(5, callbacks=[checkpoint, Spy()], enable_checkpointing=True).fit(
        FedAvg(tiny_client(), clients_per_round=2, local_steps=1), synthetic(4))
    assert steps == [None, None, 2, 2, 4, 5]  # written after rounds 2 and 4, and the last one
    assert not list(tmp_path.glob("*.tmp"))
    with pytest.raises(ValueError, match="every_n_rounds must be >= 1 and an integer, got 0"):
        RoundCheckpoint(every_n_rounds=0)


def test_a_temporary_file_left_by_a_killed_write_is_removed_when_the_next_run_starts(tmp_path):
    """A kill during the write leaves ``last.ckpt.tmp`` (tests/crash_child.py's ``write`` mode); the
    run that resumes from ``last.ckpt`` removes it before its first round, and ``ckpt_path="last"``
    never takes it for a checkpoint, however recent."""
    last, _ = checkpointed(tmp_path, "FedAvg")
    stale = tmp_path / "last.ckpt.tmp"
    stale.write_bytes(b"PK\x03\x04 a checkpoint cut short")
    found = []

    class Spy(pl.Callback):
        def on_train_epoch_start(self, trainer, module):
            found.append(stale.exists())

    checkpoint = RoundCheckpoint(dirpath=str(tmp_path), asynchronous=False)
    trainer(3, callbacks=[checkpoint, Spy()], enable_checkpointing=True).fit(build("FedAvg"), data(), ckpt_path="last")
    assert found == [False] and load_checkpoint(last)["global_step"] == 3  # resumed after round 2


def test_a_folder_holds_the_checkpoint_of_one_run(tmp_path):
    """A second run with the same dirpath is refused before training, leaving the first run's
    ``last.ckpt`` as it was; resuming that run from its ``last.ckpt`` makes it the owner."""
    last, _ = checkpointed(tmp_path, "FedAvg")
    first = last.read_bytes()
    owner = json.loads((tmp_path / "owner.json").read_text())
    refused = (rf"RoundCheckpoint's dirpath '{tmp_path}' belongs to another run \(run {owner['run']}, started .* by "
               rf"process {os.getpid()}\), and holds its last.ckpt: this run would overwrite it. Pass another dirpath, "
               rf"or resume that run \(ckpt_path='{last}'\); if its checkpoint may be overwritten, remove "
               rf"{tmp_path / 'owner.json'}")
    with pytest.raises(ValueError, match=refused):
        trainer(2, callbacks=[RoundCheckpoint(dirpath=str(tmp_path))], enable_checkpointing=True).fit(
            build("FedAvg"), data())
    assert last.read_bytes() == first
    with pytest.raises(ValueError, match="belongs to another run .* may be writing its first last.ckpt"):
        shutil.move(last, tmp_path / "kept.ckpt")  # a run that claimed the folder and has not written yet
        trainer(2, callbacks=[RoundCheckpoint(dirpath=str(tmp_path))], enable_checkpointing=True).fit(
            build("FedAvg"), data())
    shutil.move(tmp_path / "kept.ckpt", last)
    (tmp_path / "owner.json").unlink()  # a folder of an earlier fl_lightning: last.ckpt without owner.json
    with pytest.raises(ValueError, match="holds a last.ckpt that this run does not resume"):
        trainer(2, callbacks=[RoundCheckpoint(dirpath=str(tmp_path))], enable_checkpointing=True).fit(
            build("FedAvg"), data())
    resumed = RoundCheckpoint(dirpath=str(tmp_path))
    trainer(3, callbacks=[resumed], enable_checkpointing=True).fit(build("FedAvg"), data(), ckpt_path=str(last))
    assert load_checkpoint(last)["global_step"] == 3
    assert json.loads((tmp_path / "owner.json").read_text())["run"] == resumed.run


def test_round_checkpoint_takes_no_argument_that_would_break_its_one_atomic_file():
    for argument in ("save_top_k", "monitor", "save_last", "filename", "save_weights_only", "every_n_epochs"):
        with pytest.raises(TypeError, match=argument):
            RoundCheckpoint(**{argument: 1})


# ------------------------------------------------------------------ checkpoints without a checksum
def test_a_checkpoint_without_a_checksum_is_refused_unless_the_user_vouches_for_it(tmp_path, capsys):
    """A hand-edited file whose checksum was dropped does not resume silently: it is refused, naming
    the file and the two ways on (the command that adds its checksum, ``allow_unverified=True``)."""
    last, _ = checkpointed(tmp_path, "FedAvg")
    edited = load_checkpoint(last)
    key = next(iter(edited["state_dict"]))
    edited["state_dict"][key] = edited["state_dict"][key] + 1.0
    legacy = tmp_path / "legacy.ckpt"
    torch.save(edited, legacy)
    refused = (rf"'{legacy}' has no checksum .* it is refused. If you trust the file, add its checksum with "
               rf"`fl-lightning checkpoint --add-checksum {legacy}` and use it as before, or pass "
               r"allow_unverified=True")
    loads = [
        lambda: load_checkpoint(legacy),
        lambda: resume(legacy, "FedAvg"),
        lambda: trainer(1).validate(build("FedAvg"), data(), ckpt_path=str(legacy)),
        lambda: FedAvg.load_from_checkpoint(legacy),
        lambda: SyntheticFederated.load_from_checkpoint(legacy),
    ]
    for load in loads:
        with pytest.raises(CheckpointError, match=refused):
            load()
    loaded = FedAvg.load_from_checkpoint(legacy, allow_unverified=True)
    assert torch.equal(loaded.state_dict()[key], edited["state_dict"][key])
    assert SyntheticFederated.load_from_checkpoint(legacy, allow_unverified=True).num_clients == 6
    main(["checkpoint", "--add-checksum", str(legacy)])
    main(["checkpoint", "--add-checksum", str(legacy)])
    assert capsys.readouterr().out.splitlines() == [f"{legacy}: checksum added",
                                                    f"{legacy}: has a matching checksum already"]
    assert torch.equal(load_checkpoint(legacy)["state_dict"][key], edited["state_dict"][key])
    resume(legacy, "FedAvg")
    flip_a_bit_of(last, next(iter(load_checkpoint(last)["state_dict"].values())))
    with pytest.raises(CheckpointError, match="is damaged"):  # a damaged file is not given a new checksum
        add_checksum(last)


# ------------------------------------------------------------------ no code runs from a file
class Exploit:
    """Pickles to a call of ``os.system``: what a crafted checkpoint would carry."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def crafted(tmp_path: Path) -> tuple[Path, Path]:
    marker, path = tmp_path / "pwned", tmp_path / "crafted.ckpt"
    torch.save({"state_dict": {}, "hyper_parameters": {"x": Exploit(marker)}, "federated": Exploit(marker)}, path)
    return path, marker


def test_no_load_path_runs_code_from_a_crafted_checkpoint(tmp_path, monkeypatch, capsys):
    path, marker = crafted(tmp_path)
    from fl_lightning.predict import load_pefll

    loads = [
        lambda: load_checkpoint(path),
        lambda: trainer(1).fit(FedAvg(tiny_client(), clients_per_round=2, local_steps=1), synthetic(4), ckpt_path=str(path)),
        lambda: trainer(1).validate(FedAvg(tiny_client(), clients_per_round=2, local_steps=1), synthetic(4),
                                    ckpt_path=str(path)),
        lambda: load_pefll(path),
        lambda: main(["pefll-predict", "--config", str(ROOT / "configs" / "pefll" / "cifar10.yaml"),
                      "--predict.ckpt_path", str(path)]),
        lambda: main(["fit", "--config", QUICK, "--trainer.max_epochs", "1", "--ckpt_path", str(path)]),
    ]
    monkeypatch.chdir(tmp_path)
    for load in loads:
        with pytest.raises((CheckpointError, SystemExit)) as info:
            load()
        said = capsys.readouterr().err if info.type is SystemExit else str(info.value)  # the CLI's: a line on stderr
        assert re.search("could run code|objects", said), said
        assert not marker.exists(), info
    with pytest.raises(CheckpointError, match="empty \\(0 bytes\\)"):
        (tmp_path / "empty.ckpt").write_bytes(b"")
        trainer(1).fit(FedAvg(tiny_client(), clients_per_round=2, local_steps=1), synthetic(4),
                       ckpt_path=str(tmp_path / "empty.ckpt"))


# ------------------------------------------------------------------ the CLI's --ckpt_path
def quick_args(tmp_path: Path, *extra: str) -> list[str]:
    return ["fit", "--config", QUICK, "--trainer.default_root_dir", str(tmp_path), "--trainer.enable_progress_bar",
            "false", "--trainer.logger", "false", "--data.init_args.print_summary", "false",
            "--trainer.callbacks", "[]", *extra]


def test_cli_resume_never_replaces_what_the_user_configured(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    FederatedCLI(args=quick_args(tmp_path, "--trainer.max_epochs", "2"))
    last = next(tmp_path.rglob("last.ckpt"))  # written by the CLI's default RoundCheckpoint
    with pytest.raises(SystemExit):  # an error of the command line's: a line on stderr
        FederatedCLI(args=quick_args(tmp_path, "--model.class_path", "fl_lightning.algorithms.SCAFFOLD",
                                     "--trainer.max_epochs", "3", "--ckpt_path", str(last)))
    assert re.search(r"^error: --ckpt_path .* written by fl_lightning\.algorithms\.FedAvg, but the configured model "
                     r"is fl_lightning\.algorithms\.SCAFFOLD.*--model\.class_path", capsys.readouterr().err)
    with pytest.warns(UserWarning, match="changed settings; the run uses the new values: model.local_steps: "
                                         "checkpoint 20, now 5"):
        cli = FederatedCLI(args=quick_args(tmp_path, "--model.init_args.local_steps", "5", "--trainer.max_epochs", "3",
                                           "--ckpt_path", str(last)))
    assert cli.model.local_steps == 5 and cli.trainer.current_epoch == 3


# ------------------------------------------------------------------ non-finite updates and state
class PoisonState(FederatedCallback):
    """Turns the update of the round's first client into NaN."""

    def on_client_update(self, trainer, module, update):
        if update.client_id == module.engine.round_clients[0]:
            update.tensors["delta"] = update.tensors["delta"] * float("nan")
        return update


def test_a_poisoned_round_does_not_poison_client_state():
    module = SCAFFOLD(tiny_client(hidden=(8,)), clients_per_round=3, local_steps=2, seed=1)
    with pytest.warns(RuntimeWarning, match="NaN or Inf"):
        trainer(3, callbacks=[PoisonState()]).fit(module, synthetic(6))
    for cid in module.engine.store.clients():
        assert torch.isfinite(module.engine.store.get(cid, "control")).all()
    poisoned = {module.engine.sample_round(r)[0] for r in range(3)}
    kept_elsewhere = {c for r in range(3) for c in module.engine.sample_round(r)[1:]}
    assert poisoned - kept_elsewhere <= set(range(6)) - set(module.engine.store.clients())  # never stored from a NaN round


def test_an_attack_that_overflows_is_caught_after_the_round_transforms():
    module = FedAvg(tiny_client(), clients_per_round=6, local_steps=1, seed=1)
    with pytest.warns(RuntimeWarning, match="NaN or Inf"):
        t = trainer(2, callbacks=[SignFlipAttack(scale=1e39, count=1)])
        t.fit(module, synthetic(6))
    assert torch.isfinite(global_vector(module)).all()
    assert float(t.callback_metrics["round/excluded"]) >= 1


def test_a_checkpoint_with_non_finite_client_state_is_refused(tmp_path):
    """The checkpoint names the client state's files; one holding Inf is refused when the checkpoint loads."""
    checkpoint = RoundCheckpoint(dirpath=str(tmp_path))
    module = build("SCAFFOLD")
    trainer(1, callbacks=[checkpoint], enable_checkpointing=True).fit(module, data())
    store = load_checkpoint(tmp_path / "last.ckpt")["federated"]["store"]
    versions = read_manifest(store).versions
    cid = sorted(versions)[0]
    path = Path(store["directory"]) / f"{cid}.control.{versions[cid]['control']}.pt"
    value = read_state_file(str(path))
    value[0] = float("inf")
    torch.save(state_file(value, str(path)), path)
    with pytest.raises(CheckpointError, match=f"client state cannot be resumed: 1 of the {len(versions)} client-state "
                                              f"files it names are missing or damaged: the stored entry 'control' of "
                                              f"client {cid} \\({path}\\) holds NaN or Inf"):
        trainer(2).fit(build("SCAFFOLD"), data(), ckpt_path=str(tmp_path / "last.ckpt"))
    old_format = load_checkpoint(tmp_path / "last.ckpt")  # a checkpoint with the entries inside (before v2)
    old_format["federated"]["store"] = {"memory": {cid: {"control": value}}, "versions": {cid: {"control": 0}},
                                        "spilled": {}}
    torch.save(with_checksum(old_format), tmp_path / "inline.ckpt")
    with pytest.raises(CheckpointError, match=f"the stored entry 'control' of client {cid} holds NaN or Inf"):
        trainer(2).fit(build("SCAFFOLD"), data(), ckpt_path=str(tmp_path / "inline.ckpt"))


# ------------------------------------------------------------------ a round whose result is not finite
#: finite in fp32; the sum of two, or one weighted by a sample count above 1, overflows
HUGE = 3e38


class Overflow(FederatedCallback):
    """In round ``round_idx``, every entry of the uploads of the round's first ``count`` clients is
    ``HUGE``: finite, so each update passes the per-update check."""

    def __init__(self, round_idx: int = 1, count: int = 1) -> None:
        self.round_idx, self.count = round_idx, count

    def on_client_update(self, trainer, module, update):
        if module.current_epoch == self.round_idx and update.client_id in module.engine.round_clients[: self.count]:
            update.tensors = {name: torch.full_like(t, HUGE) for name, t in update.tensors.items()}
        return update


class ServerStates(FederatedCallback):
    """The server's whole state after each round: the module's tensors (the global model, server
    networks and buffers), the lock-step shared value, the server optimizer's state, the aggregator
    callback's state and every stored client entry."""

    def __init__(self) -> None:
        self.after: list[dict[str, Any]] = []

    def on_round_end(self, trainer, module, round_idx, aggregate):
        state: dict[str, Any] = {f"module/{k}": v.detach().clone() for k, v in module.state_dict().items()}
        state["shared"] = getattr(module, "shared", None)
        for i, entries in module.engine.server_optimizer.state_dict()["state"].items():
            state.update({f"optimizer/{i}/{k}": v.clone() if isinstance(v, torch.Tensor) else v
                          for k, v in entries.items()})
        state.update({f"aggregator/{k}": v for k, v in getattr(module.engine.aggregator, "state_dict", dict)().items()})
        state.update({f"store/{c}/{n}": module.engine.store.get(c, n) for c, n in module.engine.store.entries()})
        self.after.append(state)


def same(a: Any, b: Any) -> bool:
    """Whether ``a`` and ``b`` hold the same values (tensors: dtype, shape and every value)."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dtype == b.dtype
                and torch.equal(a, b))
    return a == b


def tiny_pefll() -> PeFLL:
    torch.manual_seed(0)
    embedding = MLPEmbedding(20, 10, 4, hidden=(8,))
    client = LogisticRegression(in_features=20, num_classes=10, lr=0.1)
    return PeFLL(client, embedding, hypernetwork_width=8, clients_per_round=3, local_steps=2, descriptor_batch_size=8,
                 seed=1)


#: name -> (the federation, how many huge uploads in round 1, what is not finite): every kind of server state
REFUSED = {
    # the sample-weighted sum overflows: the aggregate is Inf
    "FedAvg": (lambda: FedAvg(tiny_client(hidden=(8,)), clients_per_round=3, local_steps=2, seed=1), 1,
               "the aggregate's 'delta'"),
    "FedAvgM": (lambda: FedAvg(tiny_client(hidden=(8,)), clients_per_round=3, local_steps=2, seed=1,
                               server_momentum=0.9), 1, "the aggregate's 'delta'"),
    # the uniform means of two huge uploads overflow: the server control variate and the clients' are not advanced
    "SCAFFOLD": (lambda: SCAFFOLD(tiny_client(hidden=(8,)), clients_per_round=3, local_steps=2, seed=1), 2,
                 "the aggregate's 'delta'"),
    # a finite aggregate (the uniform mean) whose square overflows FedAdam's second moment
    "FedAdam": (lambda: FedAvg(tiny_client(hidden=(8,)), clients_per_round=3, local_steps=2, seed=1,
                               server_optimizer=partial(FedAdam, lr=0.01)), 1, "the server optimizer's state"),
    # a finite aggregate that the server's step takes out of range: the new global model is Inf
    "FedAvg-server_lr": (lambda: FedAvg(tiny_client(hidden=(8,)), clients_per_round=3, local_steps=2, seed=1,
                                        weighting="uniform", server_lr=4.0), 1, "the new global model"),
    # the lock-step shared estimate of the round is not kept
    "FedDRO": (lambda: FedDRO(tiny_client(hidden=(8,)), KLDRO(lam=2.0), beta=0.5, local_steps=2, clients_per_round=6,
                              seed=1), 1, "the aggregate's 'delta'"),
    # server networks and Adam's moments
    "PeFLL": (tiny_pefll, 2, "the aggregate.s"),
}


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_a_round_whose_result_is_not_finite_is_refused_as_a_whole(name, tmp_path):
    build, count, what = REFUSED[name]
    module, states = build(), ServerStates()
    history = RoundHistory(dirpath=str(tmp_path), summary=False)
    t = trainer(3, callbacks=[Overflow(1, count), states, history])
    with pytest.warns(RuntimeWarning, match=rf"round 1: {what}.* not finite; the round is refused"):
        t.fit(module, synthetic(6))
    before, refused, after = states.after
    assert before.keys() == refused.keys()
    assert [key for key in before if not same(before[key], refused[key])] == []  # the server state of round 0, bitwise
    assert [row["round/refused"] for row in history.rows] == [0.0, 1.0, 0.0]
    assert float(t.callback_metrics["round/refused"]) == 0.0  # logged in the rounds after a refused one
    # the run goes on: round 2 is taken, and moves the server's state
    assert [key for key in before if key.startswith("module/") and not same(refused[key], after[key])]
    assert all(torch.isfinite(v).all() for v in after.values() if isinstance(v, torch.Tensor) and v.is_floating_point())


def test_a_round_refused_by_a_stateful_aggregator_keeps_its_state(tmp_path):
    """CenteredClipping's center (the last aggregate) is server state: a refused round leaves it."""
    module, states = FedAvg(tiny_client(hidden=(8,)), clients_per_round=3, local_steps=2, seed=1, server_lr=4.0), \
        ServerStates()
    with pytest.warns(RuntimeWarning, match="round 1: the new global model.* not finite; the round is refused"):
        trainer(3, callbacks=[Overflow(1, 1), states, CenteredClipping(tau=1e42)]).fit(module, synthetic(6))
    before, refused, _ = states.after
    assert "aggregator/center" in before
    assert [key for key in before if not same(before[key], refused[key])] == []


def test_raise_stops_the_run_in_the_round_whose_result_is_not_finite():
    module, states = FedAvg(tiny_client(hidden=(8,)), clients_per_round=3, local_steps=2, seed=1,
                            server_momentum=0.9, nonfinite_updates="raise"), ServerStates()
    t = trainer(3, callbacks=[Overflow(1, 1), states])
    with pytest.raises(NonFiniteUpdateError, match="round 1: the aggregate's 'delta'.* not finite; the round is"):
        t.fit(module, synthetic(6))
    assert t.current_epoch == 1 and len(states.after) == 1
    assert torch.equal(global_vector(module), torch.cat([states.after[0][f"module/client.{k}"].reshape(-1)
                                                         for k, _ in module.client.named_parameters()]))


class OverflowOnRank1(FederatedCallback):
    """Makes the aggregate Inf on rank 1 only (an ``on_aggregate`` that breaks its contract, as a
    reduction that differs between processes would): the ranks must still decide alike."""

    def on_aggregate(self, trainer, module, aggregate):
        if module.current_epoch == 1 and rank_and_world()[0] == 1:
            return {name: t * float("inf") for name, t in aggregate.items()}
        return aggregate


def test_every_process_refuses_a_round_that_one_process_finds_not_finite():
    module = FedAvg(tiny_client(), clients_per_round=4, local_steps=2, seed=1)
    t = trainer(2, callbacks=[OverflowOnRank1()], devices=2, strategy=TWO_PROCESSES)
    t.fit(module, synthetic(8))
    assert float(t.callback_metrics["round/refused"]) == 1.0  # rank 0's, whose own aggregate was finite


# ------------------------------------------------------------------ damaged files
def checkpointed(tmp_path: Path, name: str = "SCAFFOLD") -> tuple[Path, dict]:
    """A 2-round run's ``last.ckpt`` and its client-state manifest."""
    trainer(2, callbacks=[RoundCheckpoint(dirpath=str(tmp_path))], enable_checkpointing=True).fit(build(name), data())
    last = tmp_path / "last.ckpt"
    return last, load_checkpoint(last)["federated"]["store"]


def resume(last: Path, name: str = "SCAFFOLD") -> None:
    trainer(3).fit(build(name), data(), ckpt_path=str(last))


def flip_a_bit_of(path: Path, tensor: torch.Tensor) -> None:
    """Flip one bit inside the bytes of ``tensor`` where ``path`` stores them."""
    content = bytearray(path.read_bytes())
    at = content.find(tensor.numpy().tobytes())
    assert at >= 0
    content[at + 5] ^= 0x10
    path.write_bytes(bytes(content))


def test_a_flipped_bit_in_a_checkpoint_is_refused_naming_the_file(tmp_path):
    last, _ = checkpointed(tmp_path, "FedAvg")
    flip_a_bit_of(last, next(iter(load_checkpoint(last)["state_dict"].values())))
    with pytest.raises(CheckpointError, match=f"ckpt_path '{last}' is damaged: its contents do not match the checksum"):
        resume(last, "FedAvg")


@pytest.mark.parametrize("fraction", [0.3, 0.6, 0.95])
def test_a_truncated_checkpoint_is_refused_naming_the_file(tmp_path, fraction):
    last, _ = checkpointed(tmp_path, "FedAvg")
    content = last.read_bytes()
    last.write_bytes(content[: int(len(content) * fraction)])
    with pytest.raises(CheckpointError, match=f"ckpt_path '{last}' is not a complete checkpoint"):
        resume(last, "FedAvg")


def test_a_yaml_file_as_ckpt_path_is_not_a_checkpoint(tmp_path):
    with pytest.raises(CheckpointError, match=r"quickstart.yaml' is not a checkpoint.*pass it as --config"):
        load_checkpoint(QUICK)


def state_path(tmp_path: Path, store: dict, rank: int = 0) -> Path:
    versions = read_manifest(store).versions
    cid = sorted(versions)[rank]
    return Path(store["directory"]) / f"{cid}.control.{versions[cid]['control']}.pt"


def damage(path: Path, how: str, tmp_path: Path) -> None:
    if how == "bit flip":
        flip_a_bit_of(path, read_state_file(str(path)))
    elif how == "truncated":
        path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    elif how == "pickled":
        torch.save({"entry": path.name, "value": Exploit(tmp_path / "pwned"), "checksum": ""}, path)
    elif how == "a bare tensor":
        torch.save(torch.zeros(3), path)
    elif how == "another entry's file":
        other = next(p for p in path.parent.glob("*.pt") if p != path)
        path.write_bytes(other.read_bytes())
    elif how == "another shape":  # a whole file of its entry (checksum and all), from a run of another model
        torch.save(state_file(torch.zeros(3), str(path)), path)


#: the ways a client-state file is damaged (:func:`damage`), and what the refusal says
DAMAGES = [
    ("bit flip", "is damaged: its contents do not match the checksum"),
    ("truncated", "is truncated or damaged"),
    ("pickled", r"holds objects that are not tensors \(loading it could run code\)"),
    ("a bare tensor", "is not a client-state file written by fl_lightning"),
    ("another entry's file", "holds the entry of file"),
    ("another shape", r"holds a tensor of shape \(3,\), but client \d+'s entry 'control' has shape \(\d+,\)"),
]


@pytest.mark.parametrize("how, problem", DAMAGES)
def test_a_damaged_client_state_file_is_refused_naming_the_file(tmp_path, how, problem):
    last, store = checkpointed(tmp_path)
    path = state_path(tmp_path, store)
    damage(path, how, tmp_path)
    files = len(read_manifest(store).versions)
    with pytest.raises(CheckpointError, match=f"client state cannot be resumed: 1 of the {files} client-state files it "
                                              f"names are missing or damaged: the client-state file {path} {problem}"):
        resume(last)
    assert not (tmp_path / "pwned").exists()


class Started(pl.Callback):
    """Records whether training started."""

    started = False

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.started = True


@pytest.mark.parametrize("how, problem", DAMAGES)
def test_a_damaged_file_beyond_the_ram_budget_is_refused_before_training_starts(tmp_path, how, problem):
    """Entries beyond the RAM budget are read only when their client is next sampled, perhaps
    never in the resumed run, whose checkpoints would then name the damaged file: the resume checks
    every file the checkpoint names first."""
    def bounded() -> SCAFFOLD:
        torch.manual_seed(0)
        return SCAFFOLD(tiny_client(hidden=(8,)), clients_per_round=3, local_steps=3, seed=1, client_state_memory=0)

    trainer(2, callbacks=[RoundCheckpoint(dirpath=str(tmp_path))], enable_checkpointing=True).fit(bounded(), data())
    last = tmp_path / "last.ckpt"
    store = load_checkpoint(last)["federated"]["store"]
    versions = read_manifest(store).versions
    oldest = min(versions, key=lambda cid: (versions[cid]["control"], cid))  # (a resume reads back the latest two)
    path = Path(store["directory"]) / f"{oldest}.control.{versions[oldest]['control']}.pt"
    damage(path, how, tmp_path)
    started = Started()
    with pytest.raises(CheckpointError, match=f"client state cannot be resumed: 1 of the {len(versions)} client-state "
                                              f"files it names are missing or damaged: the client-state file {path} "
                                              f"{problem}"):
        trainer(3, callbacks=[started]).fit(bounded(), data(), ckpt_path=str(last))
    assert not started.started and not (tmp_path / "pwned").exists()


def test_a_missing_client_state_file_is_refused_at_resume_naming_it(tmp_path):
    """Entries beyond the RAM budget are read only when their client is next sampled: the resume
    checks every file is there, instead of failing rounds later."""
    last, store = checkpointed(tmp_path)
    gone = [state_path(tmp_path, store, rank) for rank in (0, 1)]
    for path in gone:
        path.unlink()
    with pytest.raises(CheckpointError, match=f"2 of the 4 client-state files it names are missing or damaged: "
                                              f"the client-state file {gone[0]} is missing; the client-state file "
                                              f"{gone[1]} is missing. A file is removed once client_state_checkpoints"):
        resume(last)


# ------------------------------------------------------------------ clear errors
class HundredSamples(FederatedDataModule):
    def build_datasets(self):
        return TensorDataset(torch.randn(100, 20), torch.randint(0, 10, (100,))), None


class DictWithoutLoss(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.layer = nn.Linear(20, 10)

    def training_step(self, batch, batch_idx):
        return {"value": F.cross_entropy(self.layer(batch[0]), batch[1])}

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


@pytest.mark.parametrize(
    "make, error, match",
    [
        (lambda: trainer(1).fit(FedAvg(DictWithoutLoss(), clients_per_round=2, local_steps=1), synthetic(4)),
         TypeError, r"training_step must return a loss tensor or a dict with a 'loss' tensor, got a dict with keys \['value'\]"),
        (lambda: SyntheticFederated(num_clients="20"), ValueError, "num_clients must be >= 1 and an integer, got '20'"),
        (lambda: SyntheticFederated(batch_size=None), ValueError, "batch_size must be >= 1 and an integer, got None"),
        (lambda: SyntheticFederated(seed=-1), ValueError, "seed must be >= 0 and an integer, got -1"),
        (lambda: synthetic(10, unseen_fraction=0.99).setup(), ValueError,
         r"unseen_fraction=0.99 holds out 10 of 10 clients, leaving none to train"),
        (lambda: SyntheticFederated(dim=0), ValueError, "dim must be >= 1 and an integer, got 0"),
        (lambda: SyntheticFederated(num_classes=0), ValueError, "num_classes must be >= 2 and an integer, got 0"),
        (lambda: SyntheticFederated(min_samples=100, max_samples=60), ValueError,
         "max_samples must be >= min_samples, got min_samples=100, max_samples=60"),
        (lambda: SyntheticFederated(min_samples=-5), ValueError, "min_samples must be >= 1 and an integer, got -5"),
        (lambda: synthetic(10 ** 9), ValueError, r"num_clients=1000000000 needs at least 1639\.1 GiB of data"),
        (lambda: HundredSamples(num_clients=10 ** 9).setup(), ValueError,
         "num_clients=1000000000 is more than the 100 samples of the data"),
    ],
)
def test_bad_input_fails_naming_the_parameter(make, error, match):
    with pytest.raises(error, match=match):
        make()


NAN, INF = float("nan"), float("inf")


@pytest.mark.parametrize("make, message", [
    (lambda: MLP(lr=NAN), "lr must be > 0 and finite, got nan"),
    (lambda: LogisticRegression(lr=INF), "lr must be > 0 and finite, got inf"),
    (lambda: CNN(lr=0.0), "lr must be > 0 and finite, got 0.0"),
    (lambda: LeNet(momentum=NAN), "momentum must be >= 0 and finite, got nan"),
    (lambda: ResNet20(weight_decay=-INF), "weight_decay must be >= 0 and finite, got -inf"),
    (lambda: DifferentialPrivacy(1.0, 1.0, seed=0.5), "seed must be >= 0 and an integer, got 0.5"),
    (lambda: PersonalizedAccuracy(extra_classes=NAN), "extra_classes must be >= 0 and an integer, got nan"),
    (lambda: LocalFinetuning(steps=INF), "steps must be >= 1 and an integer, got inf"),
    (lambda: ClassAccuracy(num_classes=NAN), "num_classes must be >= 2 and an integer, got nan"),
])
def test_a_non_finite_number_is_refused_at_construction(make, message):
    """``lr=nan`` would make every client's update NaN, excluded from its round: the model would never move."""
    with pytest.raises(ValueError, match=message):
        make()


class Tensors(FederatedDataModule):
    """Four clients over given inputs and labels; the number of classes unknown unless given."""

    def __init__(self, x, y, num_classes=None):
        super().__init__(num_clients=4)
        self.x, self.y, self.num_classes = x, y, num_classes

    def build_datasets(self):
        return TensorDataset(self.x, self.y), None


INPUTS, LABELS = torch.randn(200, 20, generator=torch.Generator().manual_seed(0)), torch.arange(200) % 10
#: what the check names: the batch, the model's layers and the way out
TAKES = (r"the client module LogisticRegression cannot take the data of Tensors: its training_step fails on a batch of "
         r"client \d's first samples and the samples of the smallest and largest label, holding inputs of shape "
         r"\[16, 20\] \(float32\), targets of shape \[16\] \({labels}\); its one layer \(net.1\) is "
         r"Linear\(in_features={inputs}, out_features={outputs}, bias=True\)\. Make the model's input size fit the "
         r"inputs and its outputs the targets \(a classifier's labels are integer class indices in \[0, number of "
         r"outputs\)\), or fix the data\. The step raised {raised}")


@pytest.mark.parametrize("backend", ["sequential", "batched"])
@pytest.mark.parametrize("client, data, message", [
    (lambda: LogisticRegression(20, 10), lambda: Tensors(INPUTS, LABELS + 3),
     TAKES.format(labels=r"int64, values in \[3, 12\]", inputs=20, outputs=10,
                  raised="IndexError: Target 1[0-2] is out")),
    (lambda: LogisticRegression(20, 10), lambda: Tensors(INPUTS, LABELS - 1),
     TAKES.format(labels=r"int64, values in \[-1, 8\]", inputs=20, outputs=10, raised="IndexError: Target -1 is out")),
    (lambda: LogisticRegression(20, 10), lambda: Tensors(INPUTS, LABELS.float()),
     TAKES.format(labels=r"float32, values in \[0, 9\]", inputs=20, outputs=10,
                  raised="RuntimeError: expected target")),
    (lambda: LogisticRegression(20, 5), lambda: Tensors(INPUTS, LABELS),
     TAKES.format(labels=r"int64, values in \[0, 9\]", inputs=20, outputs=5, raised="IndexError: Target [5-9] is out")),
    (lambda: LogisticRegression(30, 10), lambda: Tensors(INPUTS, LABELS),
     TAKES.format(labels=r"int64, values in \[0, 9\]", inputs=30, outputs=10, raised="RuntimeError: mat1 and mat2")),
    (lambda: LogisticRegression(20, 12), lambda: Tensors(INPUTS, LABELS, num_classes=10),
     "the client LogisticRegression scores num_classes=12 classes, but Tensors has num_classes=10: give the model "
     "num_classes=10"),
])
def test_data_the_client_cannot_take_is_refused_at_setup_naming_both(client, data, message, backend):
    """Before any round (max_epochs=0 runs none), on one batch: the largest client's first samples
    with the pool's smallest and largest label, wherever they are (one sample of label 12 is enough)."""
    module = FedAvg(client(), clients_per_round=2, local_steps=1, client_backend=backend)
    dm = data()
    dm.batch_size = 16
    with pytest.raises(ValueError, match=message):
        trainer(0).fit(module, dm)


def test_one_bad_label_anywhere_in_the_pool_is_met_by_the_check():
    labels = LABELS.clone()
    labels[137] = 10  # a sample of a client other than the largest, past any first batch
    with pytest.raises(ValueError, match=r"values in \[0, 10\]\).* IndexError: Target 10 is out of bounds"):
        trainer(0).fit(FedAvg(LogisticRegression(20, 10), clients_per_round=2), Tensors(INPUTS, labels))


class Regression(pl.LightningModule):
    """A linear regression on float targets: setup's check must take its data as its loss does."""

    def __init__(self):
        super().__init__()
        self.layer = nn.Linear(20, 1)

    def training_step(self, batch, batch_idx):
        return F.mse_loss(self.layer(batch[0]).squeeze(-1), batch[1])

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_a_regression_client_with_float_targets_passes_the_check():
    targets = INPUTS.sum(dim=1) - 3.0  # negative and positive floats
    module = FedAvg(Regression(), clients_per_round=2, local_steps=2)
    trainer(1).fit(module, Tensors(INPUTS, targets))
    assert module.current_epoch == 1


class Stateful(pl.LightningModule):
    """Dropout, BatchNorm statistics, a torchmetrics Metric and Python state, all touched by its training_step."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(20, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Dropout(0.3), nn.Linear(16, 10))
        self.accuracy = MulticlassAccuracy(num_classes=10)
        self.steps, self.sizes = 0, []

    def training_step(self, batch, batch_idx):
        x, y = batch
        logits = self.net(x)
        self.accuracy.update(logits, y)
        self.steps += 1
        self.sizes.append(len(y))
        return F.cross_entropy(logits, y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_the_setup_check_leaves_no_trace(monkeypatch):
    """The run is bitwise the one without the check: the model (BatchNorm statistics included), the
    Metric's state, the module's Python state and the global RNG after the run."""

    def run():
        module = FedAvg(Stateful(), clients_per_round=3, local_steps=2)
        torch.manual_seed(1)
        trainer(2).fit(module, synthetic(4))
        client = module.client
        return global_vector(module), client.accuracy.metric_state, (client.steps, client.sizes), torch.get_rng_state()

    checked = run()
    monkeypatch.setattr("fl_lightning.engine.check_client_takes_data", lambda context: None)
    unchecked = run()
    assert torch.equal(checked[0], unchecked[0])
    assert all(torch.equal(checked[1][k], unchecked[1][k]) for k in unchecked[1])
    assert checked[2] == unchecked[2] and checked[2][0] == 2 * 3 * 2
    assert torch.equal(checked[3], unchecked[3])
