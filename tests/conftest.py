"""Test session settings: one intra-op thread per test process (tiny models; pytest-xdist
runs several processes), quiet Lightning info logs, and a distinct DDP port per test."""

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


@pytest.fixture(autouse=True)
def _master_port(monkeypatch):
    """DDP tests of parallel pytest-xdist workers (and successive tests of one worker) must
    not share a rendezvous port."""
    monkeypatch.setenv("MASTER_PORT", str(next(_ports)))
