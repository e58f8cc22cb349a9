"""Small federations for tests: tiny models, generated data, fixed seeds."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any, Callable, Optional

import pytorch_lightning as pl
import torch
from pytorch_lightning.callbacks import ModelCheckpoint
from torch import nn
from torch.utils.data import TensorDataset

from fl_lightning.datamodules import FederatedDataModule, SyntheticFederated
from fl_lightning.models import LogisticRegression, MLP
from tests import two_processes

#: the strategy of the tests' two-process runs: ``fl_ddp_spawn`` on two rank processes spawned once
#: per test process (:mod:`tests.two_processes`). Forking (``fl_ddp_notebook``) is not safe in a
#: pytest-xdist worker: a lock held by one of its threads at the fork (its channel's I/O) stays
#: locked in the child, which then hangs (seen in CI). The spawn and subprocess launchers run in
#: ``tests/test_ddp.py``.
TWO_PROCESSES = two_processes.NAME

_roots: Optional[tempfile.TemporaryDirectory] = None
#: the environment variable that hands a test process's folder to the processes it starts
_ROOT_VARIABLE = "FL_LIGHTNING_TESTS_ROOT"


def scratch_folder() -> str:
    """A new empty folder for a test trainer's files (client state, checkpoints), inside one folder
    per test process that is removed, with everything in it, when the process exits. The processes
    a test starts (DDP ranks, which leave by ``os._exit`` and so never clean up) make theirs inside
    their parent's folder, which the environment hands them."""
    global _roots
    root = os.environ.get(_ROOT_VARIABLE)
    if root is None or not os.path.isdir(root):
        if _roots is None:
            _roots = tempfile.TemporaryDirectory(prefix="fl-tests-")
        root = os.environ[_ROOT_VARIABLE] = _roots.name
    return tempfile.mkdtemp(prefix="fl-test-", dir=root)


def synthetic(num_clients: int = 8, **kwargs: Any) -> SyntheticFederated:
    """Synthetic(1, 1) with small clients (fast)."""
    kwargs.setdefault("batch_size", 16)
    kwargs.setdefault("max_samples", 120)
    kwargs.setdefault("min_samples", 20)
    return SyntheticFederated(num_clients=num_clients, dim=20, **kwargs)


def tiny_client(seed: int = 0, hidden: tuple[int, ...] = (), lr: float = 0.1) -> pl.LightningModule:
    """A logistic regression (or small MLP) client with a fixed initialization."""
    torch.manual_seed(seed)
    if hidden:
        return MLP(in_features=20, hidden=hidden, num_classes=10, lr=lr)
    return LogisticRegression(in_features=20, num_classes=10, lr=lr)


class RegressionData(FederatedDataModule):
    """``n`` generated samples of 5 features and a float target ``x @ w + noise``: one number per
    sample, or a vector of ``outputs`` numbers; 4 clients unless told."""

    def __init__(self, n: int = 120, outputs: Optional[int] = None, **kwargs: Any) -> None:
        kwargs.setdefault("num_clients", 4)
        super().__init__(**kwargs)
        self.n, self.outputs = n, outputs

    def build_datasets(self) -> tuple[TensorDataset, None]:
        g = torch.Generator().manual_seed(0)
        x = torch.randn(self.n, 5, generator=g)
        k = self.outputs or 1
        y = x @ torch.randn(5, k, generator=g) + 0.1 * torch.randn(self.n, k, generator=g)
        return TensorDataset(x, y if self.outputs else y.squeeze(-1)), None


class Regressor(pl.LightningModule):
    """A linear regression of ``RegressionData``'s targets: MSE loss, ``val/mse`` and ``val/mae`` logged."""

    def __init__(self, outputs: Optional[int] = None, lr: float = 0.05) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Linear(5, outputs or 1)
        self.outputs, self.lr = outputs, lr

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.net(x)
        return y if self.outputs else y.squeeze(-1)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.mse_loss(self(x), y)
        self.log("train/mse", loss)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.log("val/mse", nn.functional.mse_loss(self(x), y))
        self.log("val/mae", (self(x) - y).abs().mean())

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=self.lr)


def trainer(max_epochs: int = 3, callbacks: Optional[list] = None, **kwargs: Any) -> pl.Trainer:
    """A quiet CPU Trainer."""
    kwargs.setdefault("logger", False)
    kwargs.setdefault("default_root_dir", scratch_folder())
    kwargs.setdefault("enable_checkpointing", False)
    kwargs.setdefault("accelerator", "cpu")
    kwargs.setdefault("devices", 1)
    return pl.Trainer(
        max_epochs=max_epochs,
        callbacks=callbacks or [],
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        **kwargs,
    )


def straight_and_resumed(build: Callable[[], Any], data: Callable[[], Any], rounds: int, stop: int, folder: Path,
                         before_resume: Callable[[], None] = lambda: None) -> tuple[Any, Any]:
    """The same federation fitted ``rounds`` rounds straight, and fitted ``stop`` rounds (writing
    ``last.ckpt`` in ``folder``) then resumed from that checkpoint to ``rounds``: (straight, resumed).
    ``before_resume`` runs just before the resumed fit (to disturb the global RNG, say)."""
    straight = build()
    trainer(rounds).fit(straight, data())
    checkpoint = ModelCheckpoint(dirpath=folder, save_last=True, save_top_k=0)
    trainer(stop, callbacks=[checkpoint], enable_checkpointing=True).fit(build(), data())
    resumed = build()
    before_resume()
    trainer(rounds).fit(resumed, data(), ckpt_path=str(Path(folder) / "last.ckpt"))
    return straight, resumed


def global_vector(module: Any) -> torch.Tensor:
    """The global model of a FederatedModule as one flat CPU vector."""
    return module.global_model.flatten().cpu()


def checkpoint_client_state(checkpoint: dict) -> dict[int, dict[str, torch.Tensor]]:
    """Every client's stored entries of a checkpoint (read from the files it names)."""
    from fl_lightning.client_store import ClientStateStore

    store = ClientStateStore()
    store.load_state_dict(checkpoint["federated"]["store"])
    out: dict[int, dict[str, torch.Tensor]] = {}
    for cid, name in store.entries():
        out.setdefault(cid, {})[name] = store.get(cid, name)
    return out
