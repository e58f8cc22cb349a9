"""No file builds an object of the file's choosing (:mod:`fl_lightning.file_arguments`): the gadgets a
hostile probe found, through every documented loader, and a scan of every argument of every public
class with classes a file must not build."""

from __future__ import annotations

import functools
import inspect
import logging
import sys
from pathlib import Path

import pytest
import pytorch_lightning as pl
import torch
import yaml
from pytorch_lightning.callbacks import ModelCheckpoint
from torch import nn

import fl_lightning.algorithms as algorithms
import fl_lightning.datamodules as datamodules
import fl_lightning.models as models
import fl_lightning.optim as optim
from fl_lightning.algorithms import SCAFFOLD, FedAvg, PeFLL
from fl_lightning.checkpoints import CheckpointError, load_checkpoint, with_checksum
from fl_lightning.datamodules import FederatedDataModule, SyntheticFederated
from fl_lightning.file_arguments import Kind, argument_kinds, build_arguments, kind_of
from fl_lightning.models.hypernetwork import MLPEmbedding
from fl_lightning.predict import load_pefll
from tests.helpers import synthetic, tiny_client, trainer

#: what the classes below were asked to build (none may be)
BUILT: list[str] = []


def _record(self, *args, **kwargs):
    BUILT.append(type(self).__name__)
    raise AssertionError(f"{type(self).__name__} was built from a file")


class Canary:
    """An imported class of no kind: a file must never build it."""

    __init__ = _record


class UntypedModule(nn.Module):
    """An imported module with an untyped argument (275 such classes are imported in a run)."""

    def __init__(self, anything=None):
        super().__init__()
        BUILT.append("UntypedModule")


def canary_instantiator(cls, kwargs):
    BUILT.append("canary_instantiator")
    return cls(**kwargs)


def canary_of(base: type) -> type:
    """An imported subclass of ``base`` (the kind an argument takes) that records being built."""
    name = f"Canary_{base.__module__.replace('.', '_')}_{base.__qualname__.replace('.', '_')}"
    if name not in globals():
        try:
            globals()[name] = type(name, (base,), {"__init__": _record, "__module__": __name__, "__qualname__": name})
        except TypeError:  # a class that cannot be subclassed
            return Canary
    return globals()[name]


def path_of(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


@pytest.fixture(autouse=True)
def nothing_built():
    BUILT.clear()
    yield
    assert not BUILT, f"built from a file: {BUILT}"


def popen(marker: Path) -> dict:
    return {"class_path": "subprocess.Popen", "init_args": {"args": f"touch {marker}", "shell": True}}


def truncate(victim: Path) -> dict:
    return {"class_path": "logging.FileHandler", "init_args": {"filename": str(victim), "mode": "w"}}


@functools.cache
def fitted_checkpoint(kind: str, folder: str) -> str:
    """A checkpoint of one round: FedAvg, SCAFFOLD or PeFLL (as ``fl-lightning fit`` writes its
    hyperparameters: through LightningCLI's instantiator, the embedding's ``class_path``)."""
    torch.manual_seed(0)
    client = tiny_client(hidden=(8,))
    if kind == "pefll":
        module = PeFLL(client, MLPEmbedding(20, 10, 4, hidden=(8,)), clients_per_round=3, local_steps=1,
                       hypernetwork_width=16)
    else:
        module = {"fedavg": FedAvg, "scaffold": SCAFFOLD}[kind](client, clients_per_round=3, local_steps=1)
    checkpoint = ModelCheckpoint(dirpath=folder, save_last=True, save_top_k=0)
    trainer(1, callbacks=[checkpoint], enable_checkpointing=True).fit(module, synthetic(6, test_fraction=0.3))
    path = Path(folder) / "last.ckpt"
    saved = load_checkpoint(path)
    saved["hyper_parameters"]["_instantiator"] = "pytorch_lightning.cli.instantiate_module"
    if kind == "pefll":
        saved["hyper_parameters"]["embedding"] = {"class_path": path_of(MLPEmbedding), "init_args": {
            "in_features": 20, "num_classes": 10, "descriptor_dim": 4, "hidden": [8]}}
    torch.save(with_checksum(saved), path)
    return str(path)


def crafted(tmp_path: Path, kind: str, key: str, change: dict) -> str:
    """A copy of ``kind``'s checkpoint with ``change`` in its ``key`` hyperparameters (checksum recomputed:
    a checksum is no defence against a file made to be loaded)."""
    saved = load_checkpoint(fitted_checkpoint(kind, str(tmp_path.parent / f"base-{kind}")))
    saved[key].update(change)
    path = tmp_path / f"crafted-{len(list(tmp_path.iterdir()))}.ckpt"
    torch.save(with_checksum(saved), path)
    return str(path)


# ---------------------------------------------------------------- the probe's gadgets
LOADERS = {
    "fedavg": [FedAvg.load_from_checkpoint],
    "scaffold": [SCAFFOLD.load_from_checkpoint],
    "pefll": [PeFLL.load_from_checkpoint, load_pefll],
}


@pytest.mark.parametrize("kind", ["fedavg", "scaffold"])
def test_a_server_optimizer_gadget_runs_nothing(tmp_path, kind):
    """``torch.optim.Optimizer(defaults={lr: <Popen>})``: the optimizer is the project's kind, but what
    its ``init_args`` name is not built; nor a ``FileHandler`` that truncates a file."""
    marker, victim = tmp_path / "ran", tmp_path / "victim.txt"
    victim.write_text("keep me")
    gadgets = [
        {"class_path": "torch.optim.Optimizer", "init_args": {"defaults": {"lr": popen(marker)}}},
        truncate(victim),
        popen(marker),
        {"class_path": path_of(canary_of(torch.optim.SGD)), "init_args": {"lr": 0.1}},
    ]
    for gadget in gadgets:
        path = crafted(tmp_path, kind, "hyper_parameters", {"server_optimizer": gadget})
        for load in LOADERS[kind]:
            with pytest.raises(CheckpointError, match=r"server_optimizer.* names the class .*which loading does not "
                                                      r"build.*allowed_classes="):
                load(path)
    assert not marker.exists() and victim.read_text() == "keep me"


def test_an_embedding_gadget_runs_nothing_through_pefll_loaders(tmp_path):
    marker, victim = tmp_path / "ran", tmp_path / "victim.txt"
    victim.write_text("keep me")
    gadgets = [
        {"class_path": path_of(UntypedModule), "init_args": {"anything": popen(marker)}},
        {"class_path": "torch.nn.Sequential"},
        {"class_path": path_of(MLPEmbedding), "init_args": {"in_features": 20, "num_classes": 10, "descriptor_dim": 4,
                                                            "hidden": [8], "use_labels": popen(marker)}},
        truncate(victim),
    ]
    for gadget in gadgets:
        path = crafted(tmp_path, "pefll", "hyper_parameters", {"embedding": gadget})
        for load in LOADERS["pefll"]:
            with pytest.raises(CheckpointError, match=r"embedding.* names the class .*which loading does not build"):
                load(path)
    assert not marker.exists() and victim.read_text() == "keep me"
    # the embedding fl-lightning fit records is fl_lightning's own: it is built
    assert isinstance(load_pefll(fitted_checkpoint("pefll", str(tmp_path.parent / "base-pefll"))).embedding,
                      MLPEmbedding)


def test_a_datamodule_gadget_runs_nothing_from_a_checkpoint_or_an_hparams_file(tmp_path):
    marker, victim = tmp_path / "ran", tmp_path / "victim.txt"
    victim.write_text("keep me")
    flower = "fl_lightning.datamodules.partitioners.FlowerPartitioner"
    gadgets = [
        {"partitioner": {"class_path": flower, "init_args": {"partitioner": popen(marker)}}},
        {"partitioner": truncate(victim)},
        {"subsample": popen(marker)},
        {"partition": popen(marker)},
        {"_class_path": "subprocess.Popen"},
        {"_class_path": path_of(canary_of(SyntheticFederated))},
    ]
    for gadget in gadgets:
        path = crafted(tmp_path, "fedavg", "datamodule_hyper_parameters", gadget)
        for cls in (FederatedDataModule, SyntheticFederated):
            with pytest.raises(CheckpointError, match="which loading does not build"):
                cls.load_from_checkpoint(path)
        hparams = tmp_path / "hparams.yaml"
        hparams.write_text(yaml.safe_dump({**load_checkpoint(path)["datamodule_hyper_parameters"], **gadget}))
        with pytest.raises(CheckpointError, match=r"hparams_file .*which loading does not build"):
            SyntheticFederated.load_from_checkpoint(path, hparams_file=hparams)
    assert not marker.exists() and victim.read_text() == "keep me"
    # a partitioner as the CLI records it is fl_lightning's own: it is built
    dirichlet = {"partitioner": {"class_path": "fl_lightning.datamodules.DirichletPartitioner",
                                 "init_args": {"alpha": 0.3}}, "_class_path": "fl_lightning.datamodules.SyntheticFederated"}
    loaded = FederatedDataModule.load_from_checkpoint(crafted(tmp_path, "fedavg", "datamodule_hyper_parameters",
                                                              dirichlet))
    assert type(loaded) is SyntheticFederated and loaded.partitioner.alpha == 0.3


def test_the_instantiator_and_class_path_a_file_names_do_not_run(tmp_path):
    """Lightning's ``load_from_checkpoint`` calls the ``_instantiator`` a file names (with the module's
    arguments): here none runs, the arguments are built by the project's rules; ``_class_path`` builds
    only the class loaded or fl_lightning's subclass of it; the client's class only fl_lightning's or an
    allowed one."""
    path = crafted(tmp_path, "fedavg", "hyper_parameters", {"_instantiator": f"{__name__}.canary_instantiator"})
    assert isinstance(FedAvg.load_from_checkpoint(path), FedAvg)
    for class_path in ("subprocess.Popen", path_of(canary_of(FedAvg))):
        path = crafted(tmp_path, "fedavg", "hyper_parameters", {"_class_path": class_path})
        with pytest.raises(CheckpointError, match=rf"_class_path names the class {class_path}, which loading does not"):
            FedAvg.load_from_checkpoint(path)
    saved = load_checkpoint(fitted_checkpoint("fedavg", str(tmp_path.parent / "base-fedavg")))
    saved["federated"]["client"]["class_path"] = path_of(canary_of(pl.LightningModule))
    torch.save(with_checksum(saved), tmp_path / "client.ckpt")
    with pytest.raises(CheckpointError, match=r"the client module names the class .*Canary.*which loading does not "
                                              r"build.*or pass client="):
        FedAvg.load_from_checkpoint(tmp_path / "client.ckpt")
    # the server optimizer as the CLI records it: fl_lightning's or torch's, built with its arguments
    adam = {"class_path": "fl_lightning.optim.FedAdam", "init_args": {"lr": 0.05}}
    loaded = FedAvg.load_from_checkpoint(crafted(tmp_path, "fedavg", "hyper_parameters", {"server_optimizer": adam}))
    made = loaded.configure_server_optimizer()
    assert type(made) is optim.FedAdam and made.defaults["lr"] == 0.05


# ---------------------------------------------------------------- the scan
def public_classes() -> list[type]:
    """Every public class a file's hyperparameters could reach: the algorithms and datamodules (their
    ``load_from_checkpoint``), the models (client modules, embedding networks), partitioners,
    subsamples and optimizers (arguments' kinds)."""
    found = {}
    for package in (algorithms, datamodules, models, optim):
        for name in getattr(package, "__all__", dir(package)):
            value = getattr(package, name)
            if inspect.isclass(value) and value.__module__.startswith("fl_lightning"):
                found[path_of(value)] = value
    return sorted(found.values(), key=path_of)


def owned_example(kind: Kind) -> list[type]:
    """fl_lightning's own classes of ``kind`` (what a file may name for it)."""
    return [c for c in public_classes() if issubclass(c, kind.base)] or \
        ([torch.optim.SGD] if issubclass(torch.optim.SGD, kind.base) else [])


def gadgets(kind):
    """What a file must not get built for an argument of ``kind``: an imported class of its kind (and of
    none), ``subprocess.Popen``, and a class of its own kind whose every argument names one."""
    made = [{"class_path": path_of(Canary)}, {"class_path": "subprocess.Popen", "init_args": {"args": "true"}}]
    if kind is not None:
        made.append({"class_path": path_of(canary_of(kind.base))})
        for cls in owned_example(kind)[:3]:
            for name in argument_kinds(cls):
                made.append({"class_path": path_of(cls), "init_args": {name: {"class_path": path_of(Canary)}}})
    return made


def test_every_argument_of_every_public_class_builds_nothing_a_file_chooses():
    """The probe's approach: every argument of every public class, given classes a file must not get
    built (nested in a list and a dict as well), is refused, and nothing is built."""
    classes = public_classes()
    assert len(classes) > 40 and {FedAvg, PeFLL, SyntheticFederated, MLPEmbedding} <= set(classes)
    refused = 0
    for cls in classes:
        for name, kind in argument_kinds(cls).items():
            for gadget in gadgets(kind):
                for value in (gadget, [gadget], {"inner": gadget}):
                    with pytest.raises(CheckpointError, match="which loading does not build"):
                        build_arguments(cls, {name: value}, (), f"{path_of(cls)}: hyperparameter")
                    refused += 1
    assert refused > 1000


def test_kinds_of_arguments():
    """What an annotation lets a file build: objects of a class (or a maker of one, as
    ``OptimizerCallable``); plain values, ``Any`` and containers take none."""
    from typing import Any, Callable, Optional, Sequence, Union

    from pytorch_lightning.cli import OptimizerCallable

    assert kind_of(Optional[OptimizerCallable]) == Kind(torch.optim.Optimizer, factory=True)
    assert kind_of(nn.Module) == Kind(nn.Module) and kind_of(Optional[nn.Module]) == Kind(nn.Module)
    for loose in (Any, None, int, Optional[float], Union[str, list[str]], Sequence[float], dict, Callable[..., Any]):
        assert kind_of(loose) is None
    kinds = argument_kinds(PeFLL)  # through **kwargs to FederatedModule's
    assert kinds["embedding"] == Kind(nn.Module) and kinds["seed"] is None and kinds["server_optimizer"] is None  # its own
    assert argument_kinds(SCAFFOLD)["server_optimizer"] == Kind(torch.optim.Optimizer, factory=True)


def test_allowed_classes_are_built_with_their_arguments(tmp_path, monkeypatch):
    """What the caller allows by name (or as the class) is built anywhere, imported if it must be."""
    (tmp_path / "trusted_parts.py").write_text(
        "import torch\n\nclass Net(torch.nn.Module):\n    def __init__(self, width=1):\n"
        "        super().__init__()\n        self.width = width\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    entry = {"class_path": "trusted_parts.Net", "init_args": {"width": 3}}
    with pytest.raises(CheckpointError, match="trusted_parts.Net, which loading does not build"):
        build_arguments(PeFLL, {"embedding": entry}, (), "x")
    assert "trusted_parts" not in sys.modules
    built = build_arguments(PeFLL, {"embedding": entry}, ["trusted_parts.Net"], "x")["embedding"]
    assert type(built).__name__ == "Net" and built.width == 3
    logger = build_arguments(FedAvg, {"seed": {"class_path": "logging.Logger", "init_args": {"name": "n"}}},
                             [logging.Logger], "x")["seed"]
    assert isinstance(logger, logging.Logger)
