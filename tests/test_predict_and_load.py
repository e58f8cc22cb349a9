"""Predict and loading: the datamodule's predict loader, predict / validate / test with plain
dataloaders (the global model, no federation), ``load_from_checkpoint`` without ``client=``, and
the errors when a checkpoint cannot rebuild its client."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import pytorch_lightning as pl
import torch
import torch.nn.functional as F
from pytorch_lightning.callbacks import ModelCheckpoint
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from fl_lightning.algorithms import SCAFFOLD, FedAvg, FedProx
from fl_lightning.checkpoints import CheckpointError, load_checkpoint, with_checksum
from fl_lightning.datamodules import SyntheticFederated
from fl_lightning.models import LogisticRegression
from tests.helpers import global_vector, synthetic, tiny_client, trainer
from tests.fresh_python import run_python

ROOT = Path(__file__).resolve().parent.parent


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
        FedAvg.load_from_checkpoint(path, allowed_classes=[NoHyperparameters])
    loaded = FedAvg.load_from_checkpoint(path, client=NoHyperparameters(10))
    assert torch.equal(global_vector(loaded), global_vector(module))


def test_local_epochs_alone_and_fl_lightning_help_lists_every_subcommand():
    module = FedAvg(LogisticRegression(in_features=20, num_classes=10, lr=0.1), clients_per_round=2, local_epochs=1)
    assert module.local_epochs == 1 and module.local_steps is None
    trainer(1).fit(module, synthetic(4))
    out = run_python(["-m", "fl_lightning.cli", "--help"], timeout=120).stdout
    for subcommand in ("fit", "validate", "test", "predict", "pefll-predict", "plot", "checkpoint"):
        assert subcommand in out


class NoPredictStep(pl.LightningModule):
    """A client with no predict_step of its own (Lightning's default calls ``self(batch)``)."""

    def __init__(self) -> None:
        super().__init__()
        self.save_hyperparameters()
        torch.manual_seed(0)
        self.layer = nn.Linear(20, 10)

    def forward(self, x):
        return self.layer(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_predict_with_a_client_without_predict_step_gives_its_outputs_on_the_inputs():
    module, dm = FedAvg(NoPredictStep(), clients_per_round=2, local_steps=1), synthetic(4)
    trainer(1).fit(module, dm)
    logits = torch.cat(trainer(1).predict(module, datamodule=dm))  # (x, y) batches: the client's forward on x
    x, _ = next(iter(DataLoader(dm.global_test_set(), batch_size=len(dm.global_test_set()))))
    torch.testing.assert_close(logits, module.client(x))
    x_only = torch.cat(trainer(1).predict(module, DataLoader(TensorDataset(x), batch_size=16)))
    torch.testing.assert_close(x_only, module.client(x))


# ------------------------------------------------------------------ classes a checkpoint names
def crafted_checkpoint(tmp_path, change) -> str:
    """A checkpoint of ``fitted`` after ``change(checkpoint)``, saved with a valid checksum."""
    _, _, path = fitted(tmp_path)
    checkpoint = load_checkpoint(path)
    change(checkpoint)
    crafted = tmp_path / "crafted.ckpt"
    torch.save(with_checksum(checkpoint), crafted)
    return str(crafted)


def test_a_client_class_in_a_module_not_imported_is_refused_and_runs_nothing(tmp_path):
    """Importing ``unittest.__main__`` runs every test*.py of the working directory (and exits), importing
    ``numpy.f2py.__main__`` exits, ``antigravity`` opens a web browser: a checkpoint naming a class
    there is refused, saying how to allow it, and nothing runs."""
    _, _, path = fitted(tmp_path)
    modules = ["unittest.__main__", "numpy.f2py.__main__", "antigravity"]
    for module_name in modules:
        checkpoint = load_checkpoint(path)
        checkpoint["federated"]["client"]["class_path"] = f"{module_name}.MLP"
        torch.save(with_checksum(checkpoint), tmp_path / f"{module_name}.ckpt")
    work = tmp_path / "work"
    work.mkdir()
    (work / "test_marker.py").write_text(f"open({str(tmp_path / 'ran')!r}, 'w').close()\n")
    script = (
        "import sys\nfrom fl_lightning.algorithms import FedAvg\nfrom fl_lightning.checkpoints import CheckpointError\n"
        f"for name in {modules!r}:\n"
        f"    try:\n        FedAvg.load_from_checkpoint({str(tmp_path)!r} + f'/{{name}}.ckpt')\n"
        "    except CheckpointError as e:\n        print('refused:', e)\n"
        "    print('imported:', name in sys.modules)\n"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = run_python(["-c", script], cwd=work, env=env, timeout=120).stdout
    for module_name in modules:
        assert f"the client module names the class {module_name}.MLP, which loading does not build" in out
        assert f"allowed_classes=['{module_name}.MLP']" in out
    assert out.count("pass client=") == 3 and out.count("imported: False") == 3 and not (tmp_path / "ran").exists()


def test_a_client_class_of_the_users_loads_when_allowed(tmp_path, monkeypatch):
    """A client class of the user's own is built only when the caller allows it (imported or not: a
    file chooses it, and building a class runs its code)."""
    (tmp_path / "my_clients.py").write_text(
        "from fl_lightning.models import MLP\n\nclass Net(MLP):\n    pass\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    from my_clients import Net

    module, _, path = fitted(tmp_path, FedAvg(Net(in_features=20, hidden=(4,), num_classes=10), clients_per_round=3,
                                              local_steps=1))
    refused = r"names the class my_clients\.Net, which loading does not build.*allowed_classes=\['my_clients\.Net'\]"
    with pytest.raises(CheckpointError, match=refused):
        FedAvg.load_from_checkpoint(path)
    monkeypatch.delitem(sys.modules, "my_clients")  # a fresh process that has not imported it
    with pytest.raises(CheckpointError, match=refused):
        FedAvg.load_from_checkpoint(path)
    assert "my_clients" not in sys.modules
    loaded = FedAvg.load_from_checkpoint(path, allowed_classes=["my_clients.Net"])
    assert type(loaded.client).__name__ == "Net" and torch.equal(global_vector(loaded), global_vector(module))
    assert type(FedAvg.load_from_checkpoint(path, allowed_classes=[Net]).client) is Net


def set_hyperparameter(key, value):
    def change(checkpoint):
        checkpoint["hyper_parameters"].update({key: value, "_instantiator": "pytorch_lightning.cli.instantiate_module"})
    return change


@pytest.mark.parametrize("value, refused", [
    ({"class_path": "unittest.__main__.Optimizer"}, r"server_optimizer names the class unittest\.__main__\.Optimizer, "
                                                    r"which loading does not build \(it takes a maker of torch\.optim"),
    ("unittest.__main__.main", r"server_optimizer must be None or a callable.*got 'unittest\.__main__\.main'"),
])
def test_a_hyperparameter_naming_a_module_not_imported_is_refused(tmp_path, monkeypatch, value, refused):
    """A CLI run's checkpoint names classes in its hyperparameters (the server optimizer's ``class_path``,
    or an import path given as a string): none of their modules is imported, and Lightning's instantiator,
    which the file names, does not run."""
    monkeypatch.chdir(tmp_path)
    path = crafted_checkpoint(tmp_path, set_hyperparameter("server_optimizer", value))
    with pytest.raises((CheckpointError, ValueError), match=refused):
        FedAvg.load_from_checkpoint(path)
    assert "unittest.__main__" not in sys.modules


def test_a_datamodule_checkpoint_naming_a_module_not_imported_is_refused(tmp_path):
    path = crafted_checkpoint(tmp_path, lambda c: c["datamodule_hyper_parameters"].update(
        partitioner={"class_path": "unittest.__main__.Partitioner"},
        _instantiator="pytorch_lightning.cli.instantiate_module"))
    with pytest.raises(CheckpointError, match=r"partitioner names the class unittest\.__main__\.Partitioner, which "
                                              r"loading does not build.*allowed_classes"):
        SyntheticFederated.load_from_checkpoint(path)
    assert "unittest.__main__" not in sys.modules


def test_an_hparams_file_is_read_as_plain_yaml(tmp_path):
    _, _, path = fitted(tmp_path)
    (tmp_path / "hparams.yaml").write_text("clients_per_round: 2\nlocal_steps: 5\n")
    assert FedAvg.load_from_checkpoint(path, hparams_file=tmp_path / "hparams.yaml").local_steps == 5
    (tmp_path / "objects.yaml").write_text("clients_per_round: !!python/object:argparse.Namespace {a: 1}\n")
    with pytest.raises(CheckpointError, match="objects.yaml' is not plain YAML"):
        FedAvg.load_from_checkpoint(path, hparams_file=tmp_path / "objects.yaml")


def test_a_checkpoint_of_another_algorithm_is_refused_naming_both(tmp_path):
    _, _, path = fitted(tmp_path)
    with pytest.raises(CheckpointError, match=r"was written by FedAvg, not FedProx: load it with "
                                              r"FedAvg\.load_from_checkpoint"):
        FedProx.load_from_checkpoint(path)


def test_load_from_checkpoint_takes_weights_only_true_and_refuses_false(tmp_path):
    module, _, path = fitted(tmp_path)
    assert torch.equal(global_vector(FedAvg.load_from_checkpoint(path, weights_only=True)), global_vector(module))
    with pytest.raises(ValueError, match="weights_only must be True or None, got False"):
        FedAvg.load_from_checkpoint(path, weights_only=False)
