"""The engine's promises to an algorithm, one check each: a function of an
:class:`~fl_lightning.testing.federation.AlgorithmCheck` that returns ``"passed"`` or ``"skipped: <reason>"``
and raises ``AssertionError`` naming the property, what differed and the likely fix."""

from __future__ import annotations

import dataclasses
import math
import os
import pickle
import tempfile
from typing import Any, Callable, Iterator, Optional

import torch
from torch import Tensor

from fl_lightning.algorithms.pefll import HypernetworkFederation
from fl_lightning.backends import LocalSettings, run_client
from fl_lightning.broadcast import broadcast_state
from fl_lightning.callbacks import FederatedCallback, RoundCheckpoint
from fl_lightning.lightning_package import pl
from fl_lightning.testing.federation import TOLERANCE, AlgorithmCheck, first_difference, quiet
from fl_lightning.testing.state_probe import few, same
from fl_lightning.update import ClientUpdate

#: the report's value of a property that held
PASSED = "passed"


def check_client_state(check: AlgorithmCheck) -> str:
    """No per-client state outside the declared entries: the client protocol's hooks change nothing on the
    module (its tensors, its Python attributes, its submodules', its classes' containers) for two or more
    clients of a round, and nothing of it grows from the first round's end to the last's (a dict keyed by
    client, a list appended to). Such state runs, and may even give the same results on both backends, but a
    checkpoint does not hold it (a resume loses it) and each process sees only its own clients'.

    Raises:
        AssertionError: naming the attribute, the hooks, rounds and clients that changed it, and the fix.
        RuntimeError: the reference run called none of the module's hooks, so nothing could be watched.
    """
    probe = check.reference.probe
    if probe.calls == 0:
        raise RuntimeError(f"check_algorithm({check.name}) [client_state]: the run called none of the module's "
                           "client hooks (client_init, client_step, client_final) through the module, so their "
                           "changes to it could not be watched")
    fix = (f"per-client values must live in the run: declare each with self.add_client_state(name, default) in "
           f"{check.name}.__init__ and read and write it as run.state[name] (stored per client, checkpointed, shared "
           "between processes); a value a client needs only during its round goes in run.scratch")
    changed = probe.per_client_changes()
    if changed:
        name, changes = next(iter(changed.items()))
        clients = sorted({client for _, client, _, _ in changes})
        seen = "; ".join(f"{hook} of client {client} in round {round_idx}: {what}"
                         for round_idx, client, hook, what in first_changes(changes)[:3])
        raise AssertionError(
            f"check_algorithm({check.name}) [client_state]: {name} is changed by the client hooks of clients "
            f"{few(clients)} ({seen}{'; ...' if len(clients) > 3 else ''})"
            f"{f'; so are {few(list(changed)[1:])}' if len(changed) > 1 else ''}: per-client state kept on the "
            f"module, which a checkpoint does not hold and another process does not see. Fix: {fix}")
    grown = probe.growth()
    if grown:
        name, (first, last) = next(iter(grown.items()))
        rounds = sorted(probe.sizes)
        raise AssertionError(
            f"check_algorithm({check.name}) [client_state]: {name} grows during the run, from {first} entries "
            f"after round {rounds[0]} to {last} after round {rounds[-1]}"
            f"{f' (so do {few(list(grown)[1:])})' if len(grown) > 1 else ''}: state on the module that grows with "
            f"the clients seen is per-client state outside the declared entries. Fix: {fix}; the server's state "
            "keeps its size (a registered buffer, in the checkpoint)")
    return PASSED


def first_changes(changes: list[tuple[int, int, str, str]]) -> list[tuple[int, int, str, str]]:
    """The first of ``changes`` (``(round, client, hook, what)``) of each client, in order."""
    firsts: dict[int, tuple[int, int, str, str]] = {}
    for change in changes:
        firsts.setdefault(change[1], change)
    return list(firsts.values())


class FitStarted(pl.Callback):
    """Records whether a fit got past its setup (where the engine refuses what it cannot run)."""

    def __init__(self) -> None:
        self.started = False

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.started = True


def check_batched(check: AlgorithmCheck) -> str:
    """The batched backend, in blocks of 2 clients (a block and a remainder of the round's 3) unless
    ``clients_per_block`` is given (and compiled where ``compile_step=True`` is), gives the sequential backend's results to
    :data:`~fl_lightning.testing.federation.TOLERANCE`. Skipped, with the reason, where the batched backend
    refuses the algorithm at setup (its ``check``: ``batchable = False``, say, or the trial of its steps).

    Raises:
        AssertionError: naming the first round and tensor that differ, and the likely cause.
    """
    module = check.build(client_backend="batched", **{"clients_per_block": 2, **check.batched_kwargs})
    started = FitStarted()
    try:
        batched = check.fit(module, callbacks=[started])
    except ValueError as error:
        if started.started:
            raise
        return f"skipped: the batched backend refuses {check.name} at setup: {error}"
    difference = first_difference(check.reference.outcomes, batched, TOLERANCE)
    if difference is not None:
        raise AssertionError(
            f"check_algorithm({check.name}) [batched]: the batched backend's run differs from the sequential "
            f"backend's by more than {TOLERANCE:g}: {difference}. Likely cause: a local rule that is not a function "
            "of the run's tensors: it reads or writes Python state per client or per step, or draws random numbers "
            "in its steps (the batched backend draws them per block of clients). Keep the steps' values in "
            "run.scratch and run.state, draw from fl_lightning.seeding.generator(self.seed, ..., run.round, "
            f"run.client_id) in client_init, or declare batchable = False in {check.name} so that the batched "
            "backend refuses it")
    return PASSED


class Interrupted(Exception):
    """Raised by :class:`InterruptAt` to stop a run as a crash would."""


class InterruptAt(pl.Callback):
    """Raises :class:`Interrupted` when round ``round_idx`` starts: the run stops, as a crash in that round
    would, after the checkpoint of the round before was written."""

    def __init__(self, round_idx: int) -> None:
        self.round_idx = round_idx

    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.current_epoch == self.round_idx:
            raise Interrupted(f"stopped when round {self.round_idx} started")


def check_resume(check: AlgorithmCheck) -> str:
    """A run stopped after its first ``rounds // 2`` rounds and resumed from the ``last.ckpt`` of a
    :class:`~fl_lightning.callbacks.RoundCheckpoint`, by a module built afresh, gives the uninterrupted run's
    results in every later round, bitwise.

    The run is stopped by an exception when the next round starts, not killed: the resumed module knows only
    what the checkpoint (and the client-state files it names) holds, so what the algorithm keeps outside it is
    lost as after a kill. What a kill adds, a write cut short or a round lost half-way, is the engine's
    matter, not the algorithm's (``tests/test_reliability.py`` kills runs with SIGKILL there).

    Raises:
        AssertionError: naming the first round and tensor that differ, and the likely cause.
    """
    stop = check.rounds // 2
    folder = tempfile.mkdtemp(prefix="checkpoint-", dir=check.folder)
    try:
        check.fit(check.build(), callbacks=[RoundCheckpoint(dirpath=folder, asynchronous=False), InterruptAt(stop)],
                  enable_checkpointing=True)
    except Interrupted:
        pass
    else:
        raise RuntimeError(f"the run of {check.name} was to stop when round {stop} started, and did not")
    resumed = check.fit(check.build(), ckpt_path=os.path.join(folder, "last.ckpt"))
    expected = {r: found for r, found in check.reference.outcomes.items() if r >= stop}
    difference = first_difference(expected, resumed)
    if difference is not None:
        outside = sorted(check.reference.probe.changed_between_rounds)
        suspects = (f" ({few(outside)} changed from round to round and are not parameters or buffers: a checkpoint "
                    "holds them only if on_save_checkpoint saves them)" if outside else "")
        raise AssertionError(
            f"check_algorithm({check.name}) [resume]: a run stopped after round {stop - 1} and resumed from its "
            f"checkpoint differs from the uninterrupted run: {difference}. Likely cause: state the checkpoint does "
            f"not hold{suspects}: a server tensor kept as a plain attribute (register it: "
            "self.register_buffer(name, tensor)), "
            "per-client values on the module (declare them: self.add_client_state(name, default)), a Python value "
            "of the server (save it in on_save_checkpoint and restore it in on_load_checkpoint), or random draws "
            "from the global RNG on the server (draw from fl_lightning.seeding.generator(self.seed, ...))")
    return PASSED


class PoisonUpdate(FederatedCallback):
    """In round ``round_idx``, puts NaN in every tensor of one client's update (``drop=False``) or leaves that
    update out of the round (``drop=True``), and records that client's stored entries before and after the
    round. The client is the first of the round's clients that has stored state (else the first): the same in
    two runs that agree until that round.

    Args:
        round_idx: the round.
        drop: leave the update out instead of poisoning it.
    """

    def __init__(self, round_idx: int, drop: bool = False) -> None:
        self.round_idx = round_idx
        self.drop = drop
        self.client: Optional[int] = None
        #: whether an update was poisoned (or left out): False where the client uploads nothing
        self.done = False
        self.stored_before: dict[str, Tensor] = {}
        self.stored_after: dict[str, Tensor] = {}
        self.refused = False

    def _stored(self, module: Any) -> dict[str, Tensor]:
        found = {name: module.engine.store.get(self.client, name) for name in module.engine.state_specs}
        return {name: value.clone() for name, value in found.items() if value is not None}

    def on_round_start(self, trainer: pl.Trainer, module: Any, round_idx: int, clients: list[int]) -> None:
        if round_idx == self.round_idx:
            self.client = next((c for c in clients if c in module.engine.store), clients[0])
            self.stored_before = self._stored(module)

    def on_client_update(self, trainer: pl.Trainer, module: Any, update: ClientUpdate) -> ClientUpdate:
        if module.current_epoch != self.round_idx or update.client_id != self.client or not update.tensors:
            return update
        self.done = True
        if self.drop:
            return update
        return dataclasses.replace(update, tensors={k: torch.full_like(v, math.nan) for k, v in update.tensors.items()})

    def on_round_updates(self, trainer: pl.Trainer, module: Any, updates: list[ClientUpdate]) -> list[ClientUpdate]:
        if self.drop and module.current_epoch == self.round_idx:
            return [u for u in updates if u.client_id != self.client]
        return updates

    def on_round_end(self, trainer: pl.Trainer, module: Any, round_idx: int,
                     aggregate: Optional[dict[str, Tensor]]) -> None:
        if round_idx == self.round_idx:
            self.stored_after = self._stored(module)
            self.refused = aggregate is None


def check_nonfinite_update(check: AlgorithmCheck) -> str:
    """A client whose update holds NaN (every upload of one client in the second round, put there by a
    callback's ``on_client_update``, as an attack or an overflow would) is left out: the round goes on with the
    other clients (it is not refused), that client's stored state is not advanced, and the run equals,
    bitwise, the run from which that update was removed. Skipped where the algorithm uploads nothing.

    Raises:
        AssertionError: naming what the NaN reached, and the likely cause.
    """
    poison = PoisonUpdate(1)
    poisoned = check.fit(check.build(nonfinite_updates="skip"), callbacks=[poison])
    if not poison.done:
        return f"skipped: {check.name}'s clients upload nothing (no add_update), so no update can hold NaN"
    where = f"client {poison.client}'s update of round 1, all NaN,"
    cause = ("Likely cause: the algorithm reads the round's updates itself (a callback of its own, a Lightning hook "
             "of its own around the round) or writes client state outside run.state: let the engine's aggregate and "
             "client state store take the round's updates")
    if poison.refused:
        raise AssertionError(
            f"check_algorithm({check.name}) [nonfinite_update]: {where} made the round's result non-finite, so the "
            f"round was refused instead of going on with the other clients' updates. {cause}")
    if poison.stored_after.keys() != poison.stored_before.keys() or any(
            not same(poison.stored_before[k], poison.stored_after[k]) for k in poison.stored_before):
        raise AssertionError(
            f"check_algorithm({check.name}) [nonfinite_update]: {where} advanced that client's stored state "
            f"(entries {few(sorted(poison.stored_before))} before the round, {few(sorted(poison.stored_after))} "
            f"after, not all the same). {cause}")
    dropped = check.fit(check.build(nonfinite_updates="skip"), callbacks=[PoisonUpdate(1, drop=True)])
    difference = first_difference(dropped, poisoned)
    if difference is not None:
        raise AssertionError(
            f"check_algorithm({check.name}) [nonfinite_update]: the run in which {where} differs from the run "
            f"without that update: {difference}. {cause}")
    return PASSED


def check_two_processes(check: AlgorithmCheck) -> str:
    """Two CPU processes (``check.two_process_strategy``, gloo) give one process's results to
    :data:`~fl_lightning.testing.federation.TOLERANCE`: the global model, the server's state and every
    client's stored entries (the first process's, which holds every client's), after every round.

    Raises:
        AssertionError: the module does not pickle (as the spawning strategies need), or naming the first round
            and tensor that differ, and the likely cause.
    """
    module = check.build()
    try:
        pickle.dumps(module)
    except Exception as error:  # noqa: BLE001: whatever stops pickling stops fl_ddp_spawn
        raise AssertionError(
            f"check_algorithm({check.name}) [two_processes]: the module does not pickle ({error!r}), and fl_ddp_spawn "
            f"sends it to its processes pickled. Fix: define {check.name} at the top level of an importable module "
            "and keep what does not pickle (lambdas, open files, generators) off the module") from error
    two = check.fit(module, devices=2, strategy=check.two_process_strategy)
    difference = first_difference(check.reference.outcomes, two, TOLERANCE)
    if difference is not None:
        raise AssertionError(
            f"check_algorithm({check.name}) [two_processes]: two processes differ from one by more than "
            f"{TOLERANCE:g}: {difference}. Likely cause: the server update reads something of this process's "
            "clients only (their updates, values kept per client on the module) instead of the aggregate, which is "
            "the same on every process; per-client values belong in declared client state "
            "(self.add_client_state), which the engine shares between processes")
    return PASSED


class RoundRecorder(FederatedCallback):
    """What round ``round_idx`` of a fit gave its clients (the start model, the scheduled learning rates, the
    declared broadcast state, each client's state entries) and what each client's round returned (its update and
    new state, by client), taken from the backend's results as the round runs."""

    def __init__(self, round_idx: int) -> None:
        self.round_idx = round_idx
        self.start: Optional[Tensor] = None
        self.lrs: list[float] = []
        self.broadcast: dict[str, Tensor] = {}
        self.states: dict[int, dict[str, Tensor]] = {}
        self.results: dict[int, tuple[ClientUpdate, dict[str, Tensor]]] = {}

    def on_round_start(self, trainer: pl.Trainer, module: Any, round_idx: int, clients: list[int]) -> None:
        if round_idx != self.round_idx:
            return
        engine = module.engine
        self.start = engine.round_start.clone()
        self.lrs = [group["lr"] for group in engine.local_optimizer().param_groups]  # the round's scheduled rates
        self.broadcast = {name: t.clone() for name, t in broadcast_state(module).items()}
        self.states = {c: {k: v.clone() for k, v in engine.context.load_client_state(c).items()} for c in clients}
        backend_round = engine.backend.round

        def recording(context: Any, round_clients: list[int]) -> Iterator[Any]:
            for block in backend_round(context, round_clients):
                for result in block.rows():
                    self.results[result.update.client_id] = (
                        result.update, {k: v.clone() for k, v in (result.state or {}).items()})
                yield block

        engine.backend.round = recording

    def on_round_end(self, trainer: pl.Trainer, module: Any, round_idx: int,
                     aggregate: Optional[dict[str, Tensor]]) -> None:
        if round_idx == self.round_idx:
            del module.engine.backend.round  # the class's method again


def check_without_trainer(check: AlgorithmCheck) -> str:
    """A client's round without a Trainer (:func:`~fl_lightning.backends.run_client`, what a deployment node
    runs), given what the last round of a fit gave the client (start model, state entries, broadcast state,
    learning rates) and the client's training split, on a fresh copy of the algorithm, returns the fit's
    uploads, new state entries and sample count, bitwise. Skipped for lock-step algorithms (their clients need
    the server at every step) and for server networks that train on the clients' data (PeFLL, pFedHN: the
    client's round is part of the server's).

    Raises:
        AssertionError: naming the client and what differed or failed, and the likely cause.
    """
    module = check.build()
    if getattr(module, "lockstep", False):
        return "skipped: a lock-step algorithm's clients need the server's reply at every step"
    if isinstance(module, HypernetworkFederation):
        return "skipped: its server networks train on the clients' data (the client's round is part of the server's)"
    recorder = RoundRecorder(check.rounds - 1)
    check.fit(module, callbacks=[recorder])
    if not recorder.results:
        raise RuntimeError(f"check_algorithm({check.name}) [without_trainer]: the fit's last round ran no client")
    node, data = check.build(), check.data()  # a node's own copy of the algorithm and of its data
    data.setup("fit")
    steps, epochs = node.local_steps, node.local_epochs
    settings = LocalSettings(steps=steps if epochs is None else None, epochs=epochs, lrs=recorder.lrs)
    fix = ("its client hooks (client_init, client_step, client_final) read what a node does not have: the Trainer, "
           "the engine (self.engine...), or server state that is not declared. Read the client's data through "
           "run.data, its local work through run.local, and declare the server state the clients read with "
           "self.add_broadcast(name)")
    assert recorder.start is not None
    for client_id, (update, state) in sorted(recorder.results.items()):
        try:
            with quiet():
                result = run_client(node, client_id, recorder.round_idx, recorder.start, recorder.states[client_id],
                                    settings, data.client_data(client_id, "train"), broadcast=recorder.broadcast)
        except Exception as error:  # noqa: BLE001: whatever stops a client's round on a node is the finding
            raise AssertionError(
                f"check_algorithm({check.name}) [without_trainer]: client {client_id}'s round of round "
                f"{recorder.round_idx} without a Trainer fails ({type(error).__name__}: {error}). Likely cause: "
                f"{fix}") from error
        got = named_tensors(result.uploads, result.state)
        expected = named_tensors(update.tensors, state)
        differing = sorted(k for k in expected.keys() | got.keys()
                           if k not in got or k not in expected or not torch.equal(got[k], expected[k]))
        if differing or result.update.num_samples != update.num_samples:
            what = (", ".join(differing) if differing else
                    f"the sample count ({result.update.num_samples}, the fit's {update.num_samples})")
            raise AssertionError(
                f"check_algorithm({check.name}) [without_trainer]: client {client_id}'s round of round "
                f"{recorder.round_idx} without a Trainer differs from the fit's in {what}. Likely cause: {fix}")
    return PASSED


def named_tensors(uploads: dict[str, Tensor], state: dict[str, Tensor]) -> dict[str, Tensor]:
    """A client round's uploads and state entries by one name each (``"upload delta"``, ``"state control"``)."""
    return {**{f"upload {k}": v for k, v in uploads.items()}, **{f"state {k}": v for k, v in state.items()}}


#: each property's check, in the order :func:`~fl_lightning.testing.check_algorithm` runs them (the
#: two-process run last: it costs the most)
CHECKS: dict[str, Callable[[AlgorithmCheck], str]] = {
    "client_state": check_client_state,
    "batched": check_batched,
    "resume": check_resume,
    "nonfinite_update": check_nonfinite_update,
    "without_trainer": check_without_trainer,
    "two_processes": check_two_processes,
}
#: every property, in the order they are checked
PROPERTIES: tuple[str, ...] = tuple(CHECKS)
