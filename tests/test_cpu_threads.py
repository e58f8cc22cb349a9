"""The CPU's intra-op threads during a fit (``fl_lightning.cpu_threads``): one for a small client unless
the user chose, torch's count kept for a large one, and put back when the fit ends or fails."""

from __future__ import annotations

import logging

import pytest
import pytorch_lightning as pl
import torch

from fl_lightning import cpu_threads
from fl_lightning.algorithms import FedAvg
from tests.helpers import synthetic, tiny_client, trainer


class ThreadsInRounds(pl.Callback):
    """torch's intra-op threads in every round; ``fail`` raises in the first."""

    def __init__(self, fail: bool = False) -> None:
        self.threads: list[int] = []
        self.fail = fail

    def on_train_epoch_start(self, trainer, pl_module) -> None:
        self.threads.append(torch.get_num_threads())
        if self.fail:
            raise RuntimeError("stop")


@pytest.fixture
def two_threads(monkeypatch):
    """torch at 2 threads as it started, no thread count in the environment; 1 thread back after the test."""
    for name in cpu_threads.THREAD_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(cpu_threads, "THREADS_AT_IMPORT", 2)
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(1)


def fit(callback: ThreadsInRounds) -> None:
    module = FedAvg(tiny_client(), clients_per_round=2, local_steps=2, seed=0)
    trainer(2, callbacks=[callback], limit_val_batches=0).fit(module, synthetic(4))


def test_a_small_client_fits_with_one_thread_and_torchs_count_comes_back(two_threads, caplog):
    rounds = ThreadsInRounds()
    with caplog.at_level(logging.INFO, logger="pytorch_lightning.utilities.rank_zero"):
        fit(rounds)
    assert rounds.threads == [1, 1] and torch.get_num_threads() == 2
    notices = [r.getMessage() for r in caplog.records if "intra-op" in r.getMessage()]
    assert len(notices) == 1 and notices[0].startswith("fl_lightning: a small client (0.0064 MFLOP a step): the fit "
                                                       "runs 1 intra-op thread on the CPU, not torch's 2")
    assert notices[0].endswith("set OMP_NUM_THREADS (or call torch.set_num_threads) to choose")


def test_torchs_count_comes_back_when_the_fit_fails(two_threads):
    rounds = ThreadsInRounds(fail=True)
    with pytest.raises(RuntimeError, match="stop"):
        fit(rounds)
    assert rounds.threads == [1] and torch.get_num_threads() == 2


@pytest.mark.parametrize("chosen", ["environment", "set_num_threads", "large client"])
def test_a_chosen_count_or_a_large_client_keeps_torchs_threads(two_threads, monkeypatch, caplog, chosen):
    """The environment's ``OMP_NUM_THREADS``, a count set since fl_lightning's import, or a client above
    the small step's operations: the fit keeps torch's threads (a large client with one line saying
    what one thread can gain and how to choose)."""
    if chosen == "environment":
        monkeypatch.setenv("OMP_NUM_THREADS", "2")
    elif chosen == "set_num_threads":
        monkeypatch.setattr(cpu_threads, "THREADS_AT_IMPORT", 4)
    else:
        monkeypatch.setattr(cpu_threads, "SMALL_STEP_FLOPS", 1000)
    rounds = ThreadsInRounds()
    with caplog.at_level(logging.INFO, logger="pytorch_lightning.utilities.rank_zero"):
        fit(rounds)
    assert rounds.threads == [2, 2] and torch.get_num_threads() == 2
    notices = [r.getMessage() for r in caplog.records if "intra-op" in r.getMessage()]
    if chosen == "large client":
        assert notices == ["fl_lightning: the fit runs torch's 2 intra-op threads on the CPU for a client of 0.0064 "
                           "MFLOP a step; on busy cores one thread can be several times faster (a 970 MFLOP CNN: 5x "
                           "on 2 busy cores; docs/performance.md); set OMP_NUM_THREADS (or call "
                           "torch.set_num_threads) to choose"]
    else:
        assert notices == []
