"""Two-process fits for tests, without starting two processes per fit.

A test that compares a federation on two processes with the same federation on one used to
launch ``fl_ddp_spawn``: two fresh interpreters per fit, each importing torch, Lightning and the
package (about 20 s a test on two busy cores, half the suite's time for some thirty tests).
``fl_ddp_pooled`` is ``fl_ddp_spawn`` with its processes kept: two rank processes are spawned once
per test process, join one gloo group, and run each fit's launch as a spawned rank would (the
same pickled trainer, the same wrapping function, the global state snapshot restored, rank 0's
results returned to the launcher). Only the process start is skipped; the rank processes
themselves are forked from the preloaded interpreter of :mod:`tests.fresh_python` (fresh ones, as
spawn's are, without importing torch and Lightning again).

The launchers themselves stay covered where they are the subject: ``tests/test_ddp.py`` launches
``fl_ddp_spawn`` and the CLI's ``fl_ddp`` (subprocess script launcher) for real. A test with
collectives of its own runs them as ``pool(2).run(function, args)``.
"""

from __future__ import annotations

import atexit
import os
import pickle
import shutil
import tempfile
import time
import traceback
from multiprocessing.connection import wait
from types import SimpleNamespace
from typing import Any, Callable, Optional
from unittest import mock

import torch.distributed
import torch.multiprocessing
from pytorch_lightning.strategies import StrategyRegistry
from pytorch_lightning.strategies.launchers import multiprocessing as lightning_launchers

from fl_lightning.strategy import FederatedDDPStrategy
from tests.fresh_python import CONTEXT

NAME = "fl_ddp_pooled"
#: seconds a fit may take on the ranks before they are taken for hung and replaced
TIMEOUT_S = 300
#: seconds the other ranks get to answer once one has failed
FAILED_GRACE_S = 5


def serve(rank: int, world_size: int, folder: str, connection: Any) -> None:
    """A rank process: join the pool's gloo group, then run each pickled ``(function, args)`` as
    ``function(rank, *args)`` and answer ``("ok", its result)`` or ``("error", traceback)``.

    Its temporary files go inside the pool's ``folder``: the process is killed, not ended, so
    its own clean-up never runs, and the pool removes that folder."""
    tempfile.tempdir = tempfile.mkdtemp(prefix=f"rank{rank}-", dir=folder)
    init_file = os.path.join(folder, "group")
    torch.distributed.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size)
    while True:
        try:
            payload = connection.recv_bytes()
        except EOFError:
            return
        try:
            function, args = pickle.loads(payload)
            answer = ("ok", function(rank, *args))
        except BaseException:  # noqa: BLE001: every failure goes back to the test
            answer = ("error", traceback.format_exc())
        connection.send(answer)


class RankPool:
    """``nprocs`` rank processes (fresh, forked from the preloaded server of :mod:`tests.fresh_python`)
    in one gloo group, that run functions one after the other (Lightning finds the group made and uses it)."""

    def __init__(self, nprocs: int) -> None:
        self.folder = tempfile.mkdtemp(prefix=NAME)
        self.connections, self.processes = [], []
        for rank in range(nprocs):
            ours, theirs = CONTEXT.Pipe()
            process = CONTEXT.Process(target=serve, args=(rank, nprocs, self.folder, theirs),
                                      daemon=True, name=f"{NAME}-rank{rank}")
            process.start()
            theirs.close()
            self.connections.append(ours)
            self.processes.append(process)

    def run(self, function: Callable, args: list) -> Any:
        """Run ``function(rank, *args)`` on every rank (a module-level function, pickled); rank 0's result."""
        payload = pickle.dumps((function, args))
        for connection in self.connections:
            connection.send_bytes(payload)
        pending = dict(enumerate(self.connections))
        answers, failures = {}, []
        deadline = time.monotonic() + TIMEOUT_S
        while pending:
            ready = wait(list(pending.values()), timeout=max(deadline - time.monotonic(), 0))
            if not ready:
                break
            for rank, connection in list(pending.items()):
                if connection in ready:
                    del pending[rank]
                    status, value = connection.recv()
                    if status == "ok":
                        answers[rank] = value
                    else:
                        failures.append(f"rank {rank}:\n{value}")
                        # the others may wait for the failed rank in a collective forever
                        deadline = min(deadline, time.monotonic() + FAILED_GRACE_S)
        failures += [f"rank {rank} gave no answer (hung, or waiting for a failed rank)" for rank in pending]
        if failures:
            close_pool()  # a rank may be stuck in a collective: the next fit gets new processes
            raise RuntimeError(f"{NAME}: the fit failed on the rank processes\n" + "\n".join(failures))
        return answers[0]

    def close(self) -> None:
        for process in self.processes:
            process.kill()
            process.join()
        shutil.rmtree(self.folder, ignore_errors=True)


_pool: Optional[RankPool] = None


def pool(nprocs: int) -> RankPool:
    """This process's rank pool of ``nprocs`` processes (made on first use)."""
    global _pool
    if _pool is not None and len(_pool.processes) != nprocs:
        close_pool()
    if _pool is None:
        _pool = RankPool(nprocs)
    return _pool


def close_pool() -> None:
    global _pool
    if _pool is not None:
        _pool.close()
        _pool = None


atexit.register(close_pool)


class _Processes:
    """What ``torch.multiprocessing.start_processes(join=False)`` returns, for processes already done."""

    processes: list = []

    @staticmethod
    def join() -> bool:
        return True


def _launched(rank: int, wrapping_function: Callable, args: list) -> list:
    """The launcher's ``wrapping_function`` as on a spawned rank; what rank 0 puts in the return
    queue (a ``SimpleQueue`` can only be handed to a process at its start: a list stands in)."""
    returned: list = []
    wrapping_function(rank, *args[:4], SimpleNamespace(put=returned.append), *args[5:])
    return returned


class _PooledMultiprocessing:
    """``torch.multiprocessing`` as the launcher sees it: ``start_processes`` runs on the pool."""

    def __getattr__(self, name: str) -> Any:
        return getattr(torch.multiprocessing, name)

    @staticmethod
    def start_processes(fn: Callable, args: tuple, nprocs: int, start_method: str, join: bool) -> _Processes:
        return_queue = args[4]
        for item in pool(nprocs).run(_launched, [fn, [*args[:4], None, *args[5:]]]):
            return_queue.put(item)
        return _Processes()


class PooledLauncher(lightning_launchers._MultiProcessingLauncher):
    """Lightning's spawn launcher whose processes are the pool's."""

    def launch(self, function: Callable, *args: Any, trainer: Any = None, **kwargs: Any) -> Any:
        with mock.patch.object(lightning_launchers, "mp", _PooledMultiprocessing()):
            return super().launch(function, *args, trainer=trainer, **kwargs)


class PooledDDPStrategy(FederatedDDPStrategy):
    """``fl_ddp_spawn`` on the pooled rank processes."""

    def _configure_launcher(self) -> None:
        self._launcher = PooledLauncher(self, start_method="spawn")


if NAME not in StrategyRegistry:
    StrategyRegistry.register(NAME, PooledDDPStrategy, description="fl_ddp_spawn on kept processes (tests)",
                              start_method="spawn")
