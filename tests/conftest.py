"""Test session settings: one intra-op thread per test process (tiny models; pytest-xdist
runs several processes), quiet Lightning info logs, a distinct DDP port per test, and no process
group left to the next test."""

import itertools
import logging
import os

import pytest
import torch

torch.set_num_threads(1)
logging.getLogger("pytorch_lightning").setLevel(logging.WARNING)
logging.getLogger("lightning.pytorch").setLevel(logging.WARNING)

_worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0")
_ports = itertools.count(29500 + 200 * int(_worker[2:] or 0) + 1)


#: what a DDP launcher leaves in ``os.environ``: a process that inherits ``LOCAL_RANK`` believes it
#: was launched by another and waits for ranks nobody starts
_LAUNCHER_VARIABLES = ("LOCAL_RANK", "NODE_RANK", "GLOBAL_RANK", "RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE",
                       "MASTER_ADDR")


@pytest.fixture(autouse=True)
def _master_port(monkeypatch):
    """DDP tests of parallel pytest-xdist workers (and successive tests of one worker) must
    not share a rendezvous port, nor see the variables an earlier test's launcher set."""
    monkeypatch.setenv("MASTER_PORT", str(next(_ports)))
    for name in _LAUNCHER_VARIABLES:
        monkeypatch.delenv(name, raising=False)


@pytest.fixture(autouse=True)
def _no_process_group_left():
    """A fit on Lightning's own DDP strategy (refused by the engine after Lightning has joined a
    one-process group) leaves that group to the process, as it would in a user's session. The next
    tests of the worker would run beside it: Lightning then takes every single-device fit for a
    distributed one when it advises ``sync_dist=True``."""
    yield
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
