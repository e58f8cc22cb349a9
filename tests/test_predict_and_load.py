"""Predict and loading: the datamodule's predict loader, predict / validate / test with plain
dataloaders (the global model, no federation), ``load_from_checkpoint`` without ``client=``, and
the errors when a checkpoint cannot rebuild its client."""

from __future__ import annotations

import subprocess
import sys

import pytest
import pytorch_lightning as pl
import torch
import torch.nn.functional as F
from pytorch_lightning.callbacks import ModelCheckpoint
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from fl_lightning.algorithms import SCAFFOLD, FedAvg
from fl_lightning.checkpoints import CheckpointError
from fl_lightning.models import LogisticRegression
from tests.helpers import global_vector, synthetic, tiny_client, trainer


def fitted(tmp_path, module=None, rounds: int = 2):
    module = module or FedAvg(tiny_client(), clients_per_round=3, local_steps=2)
    checkpoint = ModelCheckpoint(dirpath=tmp_path, save_last=True, save_top_k=0)
    dm = synthetic(6)
    trainer(rounds, callbacks=[checkpoint], enable_checkpointing=True).fit(module, dm)
    return module, dm, str(tmp_path / "last.ckpt")


def test_predict_with_the_datamodule_gives_the_global_models_outputs_on_the_test_set(tmp_path):
    module, dm, _ = fitted(tmp_path)
    outputs = trainer(1).predict(module, datamodule=dm)
    logits = torch.cat(outputs)
    x, _ = next(iter(DataLoader(dm.global_test_set(), batch_size=len(dm.global_test_set()))))
    assert logits.shape == (len(dm.global_test_set()), 10)
    torch.testing.assert_close(logits, module.client(x))


def test_plain_dataloaders_use_the_global_model_without_a_federated_datamodule(tmp_path):
    module, dm, _ = fitted(tmp_path)
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(40, 20, generator=g), torch.randint(0, 10, (40,), generator=g)
    loader = DataLoader(TensorDataset(x, y), batch_size=16)
    expected = (module.client(x).argmax(-1) == y).float().mean()
    t = trainer(1)
    (validated,) = t.validate(module, loader, verbose=False)
    (tested,) = t.test(module, loader, verbose=False)
    assert validated["val_acc"] == pytest.approx(float(expected)) == tested["test_acc"]
    predicted = torch.cat(t.predict(module, DataLoader(TensorDataset(x), batch_size=16)))  # x-only batches
    torch.testing.assert_close(predicted, module.client(x))


def test_load_from_checkpoint_rebuilds_the_client_alone(tmp_path):
    module, _, path = fitted(tmp_path, SCAFFOLD(tiny_client(hidden=(8,)), clients_per_round=3, local_steps=2))
    loaded = SCAFFOLD.load_from_checkpoint(path)
    assert type(loaded.client).__name__ == "MLP" and loaded.client.hparams["hidden"] == (8,)
    assert torch.equal(global_vector(loaded), global_vector(module))
    assert torch.equal(loaded.server_control, module.server_control)
    assert loaded.clients_per_round == 3 and loaded.local_steps == 2


class NoHyperparameters(pl.LightningModule):
    """A client that does not save its hyperparameters: the checkpoint cannot rebuild it."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.layer = nn.Linear(20, width)

    def training_step(self, batch, batch_idx):
        return F.cross_entropy(self.layer(batch[0]), batch[1])

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_a_client_without_saved_hyperparameters_needs_client_given(tmp_path):
    torch.manual_seed(0)
    module, _, path = fitted(tmp_path, FedAvg(NoHyperparameters(10), clients_per_round=3, local_steps=1))
    with pytest.raises(CheckpointError, match=r"NoHyperparameters cannot be rebuilt from the hyperparameters the "
                                              r"checkpoint holds \(\{\}\).*save_hyperparameters\(\).*client="):
        FedAvg.load_from_checkpoint(path)
    loaded = FedAvg.load_from_checkpoint(path, client=NoHyperparameters(10))
    assert torch.equal(global_vector(loaded), global_vector(module))


def test_loading_imports_no_package_the_checkpoint_names(tmp_path):
    """A checkpoint whose client class names a package not imported yet is refused, and the package's
    code does not run (loading a file never executes code)."""
    _, _, path = fitted(tmp_path)
    checkpoint = torch.load(path, weights_only=True)
    checkpoint["federated"]["client"]["class_path"] = "antigravity.Client"  # importing it opens a web browser
    crafted = tmp_path / "crafted.ckpt"
    torch.save(checkpoint, crafted)
    script = (
        "import sys\nfrom fl_lightning.algorithms import FedAvg\nfrom fl_lightning.checkpoints import CheckpointError\n"
        f"try:\n    FedAvg.load_from_checkpoint({str(crafted)!r})\nexcept CheckpointError as e:\n    print('refused:', e)\n"
        "print('imported:', 'antigravity' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120).stdout
    assert "refused: the checkpoint's client class antigravity.Client is in package 'antigravity'" in out
    assert "imported: False" in out


def test_local_epochs_alone_and_fl_lightning_help_lists_every_subcommand():
    module = FedAvg(LogisticRegression(in_features=20, num_classes=10, lr=0.1), clients_per_round=2, local_epochs=1)
    assert module.local_epochs == 1 and module.local_steps is None
    trainer(1).fit(module, synthetic(4))
    out = subprocess.run([sys.executable, "-m", "fl_lightning.cli", "--help"], capture_output=True, text=True,
                         timeout=120).stdout
    for subcommand in ("fit", "validate", "test", "predict", "pefll-predict", "plot"):
        assert subcommand in out
