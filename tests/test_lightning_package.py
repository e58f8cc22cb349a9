"""fl_lightning on either Lightning package (``pytorch_lightning`` or the unified ``lightning``):

* the package it is built on is chosen once per process (:mod:`fl_lightning.lightning_package`), and
  nothing else in ``fl_lightning/`` imports Lightning;
* in this process (built on ``pytorch_lightning``), a client written with ``import lightning.pytorch as L``
  federates, resumes and loads as the same client written with ``pytorch_lightning``, bitwise;
* in a process built on ``lightning`` (``FL_LIGHTNING_PACKAGE=lightning``), an ``L.Trainer`` and the
  ``fl-lightning`` command run the federations of an ``L`` client, with the model of this process.
"""

from __future__ import annotations

import ast
import itertools
import json
import os
import re
import shlex
from pathlib import Path

import lightning.pytorch as L
import pytest
import pytorch_lightning
import torch
from packaging.specifiers import SpecifierSet
from packaging.version import Version
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import fl_lightning
from fl_lightning import SCAFFOLD, FedAvg
from fl_lightning.callbacks import FederatedEvaluation
from fl_lightning.checkpoints import load_checkpoint
from fl_lightning.cli import main
from fl_lightning.lightning_compat import TESTED_LIGHTNING
from fl_lightning.lightning_package import PACKAGE, VARIABLE, choose_package
from tests.fresh_python import run_python
from tests.helpers import global_vector, straight_and_resumed, synthetic, trainer
from tests.lightning_clients import LightningClient, LightningNoPredict, PytorchLightningClient

ROOT = Path(__file__).resolve().parents[1]
SOURCE = Path(fl_lightning.__file__).resolve().parent
GUIDE = ROOT / "docs" / "tutorials" / "federate_your_module.md"


def environment(**variables: str) -> dict[str, str]:
    """This process's environment, with ``ROOT`` on the path and ``variables``."""
    return {**os.environ, "PYTHONPATH": str(ROOT), **variables}


# ------------------------------------------------------------------ choosing the package
def test_only_lightning_package_imports_lightning():
    """Every module of fl_lightning imports Lightning through :mod:`fl_lightning.lightning_package`, so that
    all of fl_lightning's classes are of the one package chosen."""
    packages = {"pytorch_lightning", "lightning_fabric", "lightning"}
    found = []
    for path in sorted(SOURCE.rglob("*.py")):
        if path.name == "lightning_package.py" and path.parent == SOURCE:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module] if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module else [])
            found += [f"{path.relative_to(SOURCE)}: {n}" for n in names if n.split(".")[0] in packages]
    assert found == []


@pytest.mark.parametrize("environ, imported, chosen", [
    ({}, [], "pytorch_lightning"),
    ({}, ["pytorch_lightning"], "pytorch_lightning"),
    ({}, ["lightning", "lightning.pytorch"], "lightning"),
    ({}, ["lightning", "lightning.pytorch", "pytorch_lightning"], "pytorch_lightning"),
    ({}, ["lightning"], "pytorch_lightning"),  # the unified package without its trainer: nothing to match
    ({VARIABLE: "lightning"}, ["pytorch_lightning"], "lightning"),
    ({VARIABLE: "pytorch_lightning"}, ["lightning.pytorch"], "pytorch_lightning"),
])
def test_the_variable_else_the_package_imported_first(environ, imported, chosen):
    assert choose_package(environ, dict.fromkeys(imported)) == chosen


@pytest.mark.parametrize("value", ["", "Lightning", "lightning.pytorch", "pytorch-lightning"])
def test_a_bad_variable_is_refused_naming_it_and_the_packages(value):
    with pytest.raises(ValueError) as refused:
        choose_package({VARIABLE: value}, {})
    assert str(refused.value) == (f"FL_LIGHTNING_PACKAGE={value!r}: fl_lightning is built on one of ['lightning', "
                                  "'pytorch_lightning']; unset FL_LIGHTNING_PACKAGE to take the one imported first")


def test_a_bad_variable_stops_the_import():
    done = run_python(["-c", "import fl_lightning"], cwd=ROOT, env=environment(**{VARIABLE: "pytorch-lightning"}))
    assert done.returncode == 1
    assert "ValueError: FL_LIGHTNING_PACKAGE='pytorch-lightning': fl_lightning is built on one of" in done.stderr


def test_a_package_not_installed_is_named_with_what_installs_it():
    code = "import sys; sys.modules['lightning'] = None; import fl_lightning"  # None: as if not installed
    done = run_python(["-c", code], cwd=ROOT, env=environment(**{VARIABLE: "lightning"}))
    assert done.returncode == 1
    assert ("ModuleNotFoundError: fl_lightning is to be built on lightning, which is not installed: "
            "pip install lightning") in done.stderr


def test_this_process_is_built_on_pytorch_lightning():
    """The tests import both packages, ``pytorch_lightning`` first: fl_lightning is built on it."""
    assert PACKAGE == "pytorch_lightning"
    assert issubclass(FedAvg, pytorch_lightning.LightningModule) and not issubclass(FedAvg, L.LightningModule)


def guide_blocks(language: str) -> list[str]:
    """The ``language`` blocks of the guide's section "Lightning package: pytorch_lightning or lightning"."""
    section = GUIDE.read_text().split("## Lightning package: pytorch_lightning or lightning\n", 1)[1].split("\n## ")[0]
    return re.findall(rf"```{language}\n(.*?)```", section, flags=re.S)


def test_importing_lightning_first_builds_on_it(tmp_path):
    """The guide's example, which imports ``lightning`` before fl_lightning, runs: fl_lightning's classes
    are ``lightning``'s, and ``pytorch_lightning`` is never imported. The forked process has
    ``pytorch_lightning`` preloaded (:data:`tests.fresh_python.PRELOAD`): it is taken out of
    ``sys.modules`` first, as if never imported."""
    (example,) = guide_blocks("python")
    code = f"""if True:
        import sys
        for name in [m for m in sys.modules if m.split(".")[0] in ("pytorch_lightning", "lightning_fabric")]:
            del sys.modules[name]
        exec(compile({example!r}, "docs/tutorials/federate_your_module.md", "exec"))
        from fl_lightning.lightning_package import PACKAGE
        assert PACKAGE == "lightning", PACKAGE
        assert isinstance(model, L.LightningModule) and trainer.current_epoch == 3
        assert trainer.callback_metrics["train_loss"] > 0
        assert "pytorch_lightning" not in sys.modules
        """
    done = run_python(["-c", code], cwd=tmp_path, env=environment())
    assert done.returncode == 0, done.stderr


def test_the_tested_releases_of_lightning_are_installed():
    """The private APIs :mod:`fl_lightning.lightning_compat` uses are checked against both packages' releases."""
    import lightning

    assert Version(lightning.__version__) in SpecifierSet(",".join(TESTED_LIGHTNING))


# ------------------------------------------------------------------ a client of the other package
def test_anything_but_a_lightning_module_is_refused_naming_both_packages():
    with pytest.raises(TypeError, match=r"client must be a LightningModule of pytorch_lightning or lightning\.pytorch, "
                                        r"got torch\.nn\.modules\.linear\.Linear"):
        FedAvg(nn.Linear(2, 2))


def fitted(client_class: type, algorithm: type = FedAvg, backend: str = "sequential", rounds: int = 3) -> tuple:
    """A federation of ``client_class`` fitted ``rounds`` rounds (3 clients a round, 3 local steps, the
    client's scheduler halving its rate each round) and validated: (module, what fit logged, what
    validate gave)."""
    module = algorithm(client_class(), clients_per_round=3, local_steps=3, client_backend=backend)
    run = trainer(rounds, callbacks=[FederatedEvaluation(num_clients=4)])
    run.fit(module, synthetic())
    logged = {k: v.clone() for k, v in run.callback_metrics.items()}
    return module, logged, run.validate(module, synthetic(), verbose=False)


@pytest.mark.parametrize("algorithm", [FedAvg, SCAFFOLD])
@pytest.mark.parametrize("backend", ["sequential", "batched"])
def test_a_lightning_client_federates_as_the_same_pytorch_lightning_client(algorithm, backend):
    """Its ``self.log`` calls (local work, validation with a ``Metric``, federated evaluation), its scheduler
    and its steps on either backend give what the ``pytorch_lightning`` client gives, bitwise."""
    theirs, their_logs, their_validation = fitted(LightningClient, algorithm, backend)
    ours, our_logs, our_validation = fitted(PytorchLightningClient, algorithm, backend)
    assert isinstance(theirs.client, L.LightningModule) and theirs.client.trainer is theirs.trainer
    assert torch.equal(global_vector(theirs), global_vector(ours))
    assert {"train/loss", "val_acc", "val_loss", "clients_val/acc_mean"} <= set(their_logs)
    assert their_logs.keys() == our_logs.keys()
    assert all(torch.equal(their_logs[k], our_logs[k]) for k in our_logs), (their_logs, our_logs)
    assert their_validation == our_validation
    assert theirs.engine.local_lr == ours.engine.local_lr == 0.1 * 0.5 ** 3


def test_a_lightning_client_resumes_and_loads(tmp_path):
    """A run of a ``lightning.pytorch`` client resumed from its checkpoint ends where the straight run
    does; ``load_from_checkpoint`` rebuilds the client (its class allowed) with the model and its
    hyperparameters."""
    def build():
        return FedAvg(LightningClient(lr=0.2), clients_per_round=3, local_steps=3)

    straight, resumed = straight_and_resumed(build, synthetic, rounds=3, stop=2, folder=tmp_path)
    assert torch.equal(global_vector(straight), global_vector(resumed))
    loaded = FedAvg.load_from_checkpoint(tmp_path / "last.ckpt", allowed_classes=[LightningClient])
    assert type(loaded.client) is LightningClient and loaded.client.hparams.lr == 0.2
    checkpoint = load_checkpoint(tmp_path / "last.ckpt")
    assert torch.equal(loaded.client.net.weight, checkpoint["state_dict"]["client.net.weight"])


def test_predict_uses_a_lightning_clients_own_predict_step_or_its_outputs():
    """``trainer.predict`` runs the client's ``predict_step`` where it has one; without one (Lightning's
    default, of either package), the global model's outputs on the batches' inputs."""
    x = torch.randn(10, 20)
    loader = DataLoader(TensorDataset(x, torch.zeros(10, dtype=torch.long)), batch_size=5)
    own = FedAvg(LightningClient(), clients_per_round=2)
    assert torch.equal(torch.cat(trainer(1).predict(own, loader)), own.client(x).argmax(-1))
    plain = FedAvg(LightningNoPredict(), clients_per_round=2)
    torch.testing.assert_close(torch.cat(trainer(1).predict(plain, loader)), plain.client(x))


def test_federated_evaluation_refuses_a_hook_a_lightning_client_lacks():
    module = FedAvg(LightningNoPredict(), clients_per_round=2)
    with pytest.raises(ValueError, match="the client module LightningNoPredict does not implement validation_step"):
        trainer(1, callbacks=[FederatedEvaluation()]).fit(module, synthetic())


# ------------------------------------------------------------------ a process built on lightning
def test_a_process_built_on_lightning_fits_as_a_pytorch_lightning_one(tmp_path):
    """With ``FL_LIGHTNING_PACKAGE=lightning``, an ``L.Trainer`` fits the federation of an ``L`` client, and
    of a ``pytorch_lightning`` one: the model of a ``pytorch_lightning`` process's run of the same client (a
    fresh process too, so that nothing another test left in this one's torch can tell them apart);
    ``fl_ddp`` is a strategy of ``L.Trainer``."""
    code = f"""if True:
        import lightning.pytorch as L, torch
        torch.set_num_threads(1)  # as this process (tests/conftest.py): the same sums in the same order
        from fl_lightning import FedAvg
        from tests.helpers import synthetic
        from tests.lightning_clients import LightningClient, PytorchLightningClient
        models = []
        for client in (LightningClient(), PytorchLightningClient()):
            module = FedAvg(client, clients_per_round=3, local_steps=3)
            assert isinstance(module, L.LightningModule)
            trainer = L.Trainer(max_epochs=3, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                                enable_model_summary=False, num_sanity_val_steps=0, accelerator="cpu", devices=1,
                                default_root_dir={str(tmp_path)!r})
            trainer.fit(module, synthetic())
            assert trainer.callback_metrics["train/loss"] > 0
            models.append(module.global_model.flatten())
        torch.save(models, {str(tmp_path / "models.pt")!r})
        from fl_lightning.strategy import FederatedDDPStrategy
        ddp = L.Trainer(strategy="fl_ddp", accelerator="cpu", devices=2, logger=False)  # registered in L's registry
        assert type(ddp.strategy) is FederatedDDPStrategy
        """
    done = run_python(["-c", code], cwd=ROOT, env=environment(**{VARIABLE: "lightning"}))
    assert done.returncode == 0, done.stderr
    reference = f"""if True:
        import pytorch_lightning as pl, torch
        torch.set_num_threads(1)
        from fl_lightning import FedAvg
        from fl_lightning.lightning_package import PACKAGE
        from tests.helpers import global_vector, synthetic, trainer
        from tests.lightning_clients import PytorchLightningClient
        assert PACKAGE == "pytorch_lightning", PACKAGE
        ours = FedAvg(PytorchLightningClient(), clients_per_round=3, local_steps=3)
        trainer(3).fit(ours, synthetic())
        torch.save(global_vector(ours), {str(tmp_path / "ours.pt")!r})
        """
    done = run_python(["-c", reference], cwd=tmp_path, env=environment())
    assert done.returncode == 0, done.stderr
    theirs, ours = torch.load(tmp_path / "models.pt"), torch.load(tmp_path / "ours.pt")
    assert len(theirs) == 2 and all(torch.equal(model, ours) for model in theirs)


def guide_command(client: str, folder: Path) -> tuple[dict[str, str], list[str]]:
    """The guide's ``fl-lightning`` command (its environment assignments, its arguments), on fewer and
    smaller clients, with the client ``client`` of ``tests.lightning_clients``, writing into ``folder``."""
    (block,) = guide_blocks("bash")
    words = shlex.split(block)
    assignments = dict(w.split("=", 1) for w in itertools.takewhile(lambda w: re.match(r"\w+=", w), words))
    command = words[len(assignments):]
    assert command[:2] == ["fl-lightning", "fit"]
    return assignments, [*command[1:], "--model.init_args.client.class_path", f"tests.lightning_clients.{client}",
                         "--model.init_args.client.init_args.in_features", "60",
                         "--model.init_args.clients_per_round", "2", "--model.init_args.local_steps", "2",
                         "--data.init_args.num_clients", "6", "--data.init_args.print_summary", "false",
                         "--trainer.enable_progress_bar", "false", "--trainer.default_root_dir", str(folder)]


def test_the_command_runs_the_quickstart_of_a_lightning_client_as_a_pytorch_lightning_process(tmp_path):
    """The guide's ``FL_LIGHTNING_PACKAGE=lightning fl-lightning fit --config configs/quickstart.yaml``, with a
    client written with ``lightning.pytorch``: the run's checkpoint and history hold what the command gives in a
    process built on ``pytorch_lightning`` with the same client written for it."""
    theirs, ours = tmp_path / "lightning", tmp_path / "pytorch_lightning"
    assignments, command = guide_command("LightningClient", theirs)
    assert assignments == {VARIABLE: "lightning"}
    code = f"""if True:
        import lightning.pytorch as L, torch
        torch.set_num_threads(1)  # as this process (tests/conftest.py): the same sums in the same order
        from fl_lightning.cli import FederatedCLI
        from tests.lightning_clients import LightningClient
        cli = FederatedCLI(args={command!r})
        assert isinstance(cli.trainer, L.Trainer) and isinstance(cli.model.client, LightningClient)
        """
    done = run_python(["-c", code], cwd=ROOT, env=environment(**assignments))
    assert done.returncode == 0, done.stderr
    reference = f"""if True:
        import torch
        torch.set_num_threads(1)
        from fl_lightning.cli import FederatedCLI
        from fl_lightning.lightning_package import PACKAGE
        assert PACKAGE == "pytorch_lightning", PACKAGE
        FederatedCLI(args={guide_command("PytorchLightningClient", ours)[1]!r})
        """
    done = run_python(["-c", reference], cwd=ROOT, env=environment())
    assert done.returncode == 0, done.stderr
    their_model, our_model = (load_checkpoint(next(f.rglob("last.ckpt")))["state_dict"] for f in (theirs, ours))
    assert their_model.keys() == our_model.keys() and all(torch.equal(their_model[k], our_model[k]) for k in our_model)
    history = [json.loads(next(folder.rglob("history.json")).read_text()) for folder in (theirs, ours)]
    assert history[0] == history[1]


def test_the_command_advises_the_variable_for_a_client_of_the_other_package(capsys, monkeypatch):
    monkeypatch.setattr("sys.argv", ["fl-lightning"])
    with pytest.raises(SystemExit) as exited:
        main(["fit", "--config", str(ROOT / "configs" / "quickstart.yaml"), "--model.init_args.client.class_path",
              "tests.lightning_clients.LightningClient"])
    assert exited.value.code == 2
    assert capsys.readouterr().err.splitlines()[0] == (
        "error: --model.init_args.client: Import path tests.lightning_clients.LightningClient does not correspond to "
        "a subclass of LightningModule; tests.lightning_clients.LightningClient is written for the lightning package "
        "and fl_lightning runs on pytorch_lightning: set FL_LIGHTNING_PACKAGE=lightning")
