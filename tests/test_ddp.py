"""DDP on CPU (gloo): 2 processes give the global model of 1 process, with no client run twice;
the launchers (spawn, subprocess) and the tests' kept rank processes."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import pytorch_lightning as pl
from torch.nn.parallel import DistributedDataParallel

from fl_lightning.algorithms import SCAFFOLD, FedAvg
from fl_lightning.callbacks import FederatedCallback
from fl_lightning.distributed import all_gather_object
from tests import two_processes
from tests.helpers import TWO_PROCESSES, global_vector, synthetic, tiny_client, trainer

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[1]


class CheckRoundWork(FederatedCallback):
    """Fails the run if a client runs twice in a round, a sampled client is skipped, or DDP wraps the model."""

    def on_round_start(self, trainer, module, round_idx, clients):
        self.seen = []
        if isinstance(trainer.strategy.model, DistributedDataParallel):
            raise AssertionError("the model is wrapped in DistributedDataParallel: local steps would be all-reduced")

    def on_client_update(self, trainer, module, update):
        self.seen.append(update.client_id)
        return update

    def on_round_end(self, trainer, module, round_idx, aggregate):
        everyone = [c for part in all_gather_object(self.seen) for c in part]
        if sorted(everyone) != sorted(module.engine.round_clients) or len(set(everyone)) != len(everyone):
            raise AssertionError(f"round {round_idx}: ran {sorted(everyone)}, sampled {module.engine.round_clients}")


class FailOnRank(pl.Callback):
    """Raises on one rank as its first round starts."""

    def __init__(self, rank: int) -> None:
        self.rank = rank

    def on_train_epoch_start(self, trainer, module):
        if trainer.global_rank == self.rank:
            raise RuntimeError("a planned failure")


def run(algorithm: type, devices: int, strategy: str = "auto") -> pl.LightningModule:
    pl.seed_everything(0)
    module = algorithm(tiny_client(hidden=(8,)), clients_per_round=5, local_steps=4, seed=3)
    trainer(3, callbacks=[CheckRoundWork()], devices=devices, strategy=strategy).fit(module, synthetic(8))
    return module


@pytest.mark.parametrize("strategy", ["fl_ddp_spawn", TWO_PROCESSES])
def test_two_processes_equal_one(strategy):
    """On the spawn launcher (two new processes) and on the tests' kept processes, which the other
    two-process tests use (every algorithm: ``tests/test_contract.py``)."""
    one = global_vector(run(SCAFFOLD, 1))
    two = global_vector(run(SCAFFOLD, 2, strategy))
    assert (one - two).abs().max() <= 1e-5
    assert (one - global_vector(SCAFFOLD(tiny_client(hidden=(8,))))).abs().max() > 1e-3  # it trained


def test_the_tests_rank_pool_reports_a_failed_rank_and_replaces_the_waiting_one():
    """The other tests' two-process fits run on kept processes (``tests/two_processes.py``): a rank
    that raises is reported with its traceback, the rank left waiting for it in a collective is
    not waited for, and the next fit gets new processes."""
    with pytest.raises(RuntimeError, match="(?s)rank 1:.*a planned failure.*rank 0 gave no answer"):
        trainer(2, callbacks=[FailOnRank(1)], devices=2, strategy=TWO_PROCESSES).fit(
            FedAvg(tiny_client(), clients_per_round=4, local_steps=1), synthetic(4))
    assert two_processes._pool is None
    module = FedAvg(tiny_client(), clients_per_round=4, local_steps=1)
    trainer(1, devices=2, strategy=TWO_PROCESSES).fit(module, synthetic(4))
    assert (global_vector(module) - global_vector(FedAvg(tiny_client()))).abs().max() > 1e-4


def test_lightning_ddp_is_refused():
    module = FedAvg(tiny_client(), clients_per_round=2, local_steps=1)
    with pytest.raises(ValueError, match="fl_ddp"):
        trainer(1, strategy="ddp", devices=1).fit(module, synthetic(4))


def test_the_process_group_is_closed_at_exit():
    """Left to C++ static destructors, a gloo group sometimes aborts a process after a good run."""
    script = (
        "import atexit, torch.distributed as dist\n"
        "from fl_lightning.algorithms import FedAvg\n"
        "from tests.helpers import synthetic, tiny_client, trainer\n"
        "trainer(1, strategy='fl_ddp', devices=1).fit(FedAvg(tiny_client(), clients_per_round=2, local_steps=1),"
        " synthetic(4))\n"
        "assert dist.is_initialized()\n"
        "atexit._run_exitfuncs()\n"
        "print('open after exit handlers:', dist.is_initialized())\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                          cwd=Path(__file__).parent.parent)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "open after exit handlers: False" in done.stdout


def test_the_cli_fits_on_two_processes(tmp_path):
    """The CLI adds RoundHistory and RoundCheckpoint: their folders (``trainer.log_dir``, a
    broadcast) are read on every process, so ``fl_ddp`` with 2 processes does not deadlock; and
    Lightning does not advise ``sync_dist=True`` for the values the engine merged itself."""
    command = [sys.executable, "-m", "fl_lightning.cli", "fit", "--config", str(ROOT / "configs" / "quickstart.yaml"),
               "--trainer.accelerator", "cpu", "--trainer.devices", "2", "--trainer.strategy", "fl_ddp",
               "--trainer.max_epochs", "2", "--trainer.check_val_every_n_epoch", "1",
               "--trainer.enable_progress_bar", "false", "--data.init_args.print_summary", "false",
               "--trainer.default_root_dir", str(tmp_path)]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
                               start_new_session=True)  # its own process group: both ranks are ended on a hang
    try:
        stdout, stderr = process.communicate(timeout=240)  # ~30 s on 2 busy cores
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        raise AssertionError(f"fl_ddp with 2 processes hung:\n{process.communicate()[1][-2000:]}") from None
    assert process.returncode == 0, stderr[-3000:]
    [history] = tmp_path.glob("**/history.json")
    assert [row["round"] for row in json.loads(history.read_text())] == [1, 2]
    assert (history.parent / "partition.json").is_file()
    assert len(list(tmp_path.glob("**/checkpoints/last.ckpt"))) == 1
    assert "fl_lightning: 2 rounds" in stdout
    # the engine logs values it merged across processes itself: no advice to add sync_dist
    assert "sync_dist=True" not in stderr, [line for line in stderr.splitlines() if "sync_dist" in line]
