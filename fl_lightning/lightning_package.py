"""Which Lightning package fl_lightning is built on: ``pytorch_lightning`` or the unified ``lightning``.

Lightning is published twice, as ``pytorch_lightning`` (with ``lightning_fabric``) and inside the
unified ``lightning`` package (``lightning.pytorch``, ``lightning.fabric``): the same code under two
names, whose classes are distinct (a ``lightning.pytorch.Trainer`` refuses a ``pytorch_lightning``
module or callback). fl_lightning's own classes (``FederatedModule``, its datamodules, callbacks,
strategies, progress bars, the CLI) subclass Lightning's, so they are built on one of the two, chosen
once, when fl_lightning is first imported (:func:`choose_package`):

* the environment variable ``FL_LIGHTNING_PACKAGE`` when it is set: ``pytorch_lightning`` or ``lightning``;
* otherwise ``lightning`` where ``lightning.pytorch`` is imported already and ``pytorch_lightning`` is not
  (the user's ``import lightning as L`` came first), else ``pytorch_lightning``.

Every module of fl_lightning imports Lightning from here (``tests/test_lightning_package.py`` checks
it): :data:`pl` (``pytorch_lightning`` or ``lightning.pytorch``), :data:`fabric` (``lightning_fabric`` or
``lightning.fabric``) and the public names the package uses; :mod:`fl_lightning.lightning_compat` takes
the private ones from :func:`pl_module`.

The client module may be of either package, whichever fl_lightning is built on: the engine drives
it, not the Trainer (:func:`is_lightning_module`, :func:`attach_trainer`).
"""

from __future__ import annotations

import importlib
import os
import sys
from types import ModuleType
from typing import Any, Mapping, Optional

#: the environment variable that names the package fl_lightning is built on
VARIABLE = "FL_LIGHTNING_PACKAGE"
#: each package fl_lightning can be built on (the value of ``FL_LIGHTNING_PACKAGE``): its trainer
#: package and its fabric
PACKAGES: dict[str, tuple[str, str]] = {
    "pytorch_lightning": ("pytorch_lightning", "lightning_fabric"),
    "lightning": ("lightning.pytorch", "lightning.fabric"),
}
#: what installs each package
_INSTALL = {"pytorch_lightning": "pytorch-lightning", "lightning": "lightning"}


def choose_package(environ: Mapping[str, str], modules: Mapping[str, Any]) -> str:
    """The package fl_lightning is built on (a key of :data:`PACKAGES`), given the process's
    environment and its imported ``modules`` (``sys.modules``): ``FL_LIGHTNING_PACKAGE`` when set,
    else ``"lightning"`` where ``lightning.pytorch`` is imported and ``pytorch_lightning`` is not,
    else ``"pytorch_lightning"``.

    Raises:
        ValueError: ``FL_LIGHTNING_PACKAGE`` is set to anything else than a key of :data:`PACKAGES`.
    """
    chosen = environ.get(VARIABLE)
    if chosen is not None:
        if chosen not in PACKAGES:
            raise ValueError(f"{VARIABLE}={chosen!r}: fl_lightning is built on one of {sorted(PACKAGES)}; "
                             f"unset {VARIABLE} to take the one imported first")
        return chosen
    if "lightning.pytorch" in modules and "pytorch_lightning" not in modules:
        return "lightning"
    return "pytorch_lightning"


def _import(name: str, package: str) -> ModuleType:
    """Module ``name`` of ``package``, with what installs it where it is not installed."""
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as error:
        if error.name is None or name.split(".")[0] != error.name.split(".")[0]:
            raise
        raise ModuleNotFoundError(f"fl_lightning is to be built on {package}, which is not installed: "
                                  f"pip install {_INSTALL[package]}", name=error.name) from error


#: the package fl_lightning is built on in this process (a key of :data:`PACKAGES`)
PACKAGE = choose_package(os.environ, sys.modules)
#: Lightning's trainer package fl_lightning is built on: ``pytorch_lightning`` or ``lightning.pytorch``
pl = _import(PACKAGES[PACKAGE][0], PACKAGE)
#: its fabric: ``lightning_fabric`` or ``lightning.fabric``
fabric = _import(PACKAGES[PACKAGE][1], PACKAGE)


def pl_module(name: str) -> ModuleType:
    """The module ``name`` of :data:`pl` (``"core.saving"``: ``pytorch_lightning.core.saving`` or
    ``lightning.pytorch.core.saving``), imported."""
    return importlib.import_module(f"{pl.__name__}.{name}")


def fabric_module(name: str) -> ModuleType:
    """The module ``name`` of :data:`fabric`, imported."""
    return importlib.import_module(f"{fabric.__name__}.{name}")


# the public names fl_lightning uses, of the package it is built on
BasePredictionWriter = pl_module("callbacks").BasePredictionWriter
ModelCheckpoint = pl_module("callbacks").ModelCheckpoint
RichProgressBar = pl_module("callbacks").RichProgressBar
TQDMProgressBar = pl_module("callbacks").TQDMProgressBar
LightningArgumentParser = pl_module("cli").LightningArgumentParser
LightningCLI = pl_module("cli").LightningCLI
OptimizerCallable = pl_module("cli").OptimizerCallable
MixedPrecision = pl_module("plugins.precision").MixedPrecision
Precision = pl_module("plugins.precision").Precision
DDPStrategy = pl_module("strategies").DDPStrategy
Strategy = pl_module("strategies").Strategy
StrategyRegistry = pl_module("strategies").StrategyRegistry
rank_zero_info = pl_module("utilities.rank_zero").rank_zero_info
rank_zero_warn = pl_module("utilities.rank_zero").rank_zero_warn
extract_batch_size = pl_module("utilities.data").extract_batch_size
MisconfigurationException = pl_module("utilities.exceptions").MisconfigurationException
CheckpointIO = fabric_module("plugins").CheckpointIO
move_data_to_device = fabric_module("utilities.apply_func").move_data_to_device


def lightning_module_types() -> tuple[type, ...]:
    """``LightningModule`` of each Lightning package imported in this process."""
    found = (getattr(sys.modules.get(name), "LightningModule", None) for name, _ in PACKAGES.values())
    return tuple(t for t in found if isinstance(t, type))


def is_lightning_module(obj: Any) -> bool:
    """Whether ``obj`` is a ``LightningModule`` of either package (a client fl_lightning can federate)."""
    return isinstance(obj, lightning_module_types())


def attach_trainer(module: Any, trainer: Optional[Any]) -> None:
    """Attach ``trainer`` (or None: detach) to the ``LightningModule`` children of ``module`` that are
    of the other package, as Lightning's ``LightningModule.trainer`` setter attaches those of its own:
    a client module of the other package is driven by the engine, and its ``self.log`` and
    ``self.trainer`` need the run's Trainer."""
    for child in module.children():
        if is_lightning_module(child) and not isinstance(child, pl.LightningModule):
            child.trainer = trainer


def lightning_module_base(module: Any) -> type:
    """The ``LightningModule`` class of the package ``module`` (a ``LightningModule``) is of."""
    return next(t for t in lightning_module_types() if isinstance(module, t))


def overrides_hook(module: Any, hook: str) -> bool:
    """Whether the class of ``module`` (a ``LightningModule`` of either package) overrides Lightning's
    method ``hook`` (``"predict_step"``: whether it has a ``predict_step`` of its own)."""
    return getattr(type(module), hook) is not getattr(lightning_module_base(module), hook)


def package_of(cls: type) -> Optional[str]:
    """The package (a key of :data:`PACKAGES`) whose Lightning classes ``cls`` derives from, or None."""
    for klass in cls.__mro__:
        for package, names in PACKAGES.items():
            if any(klass.__module__ == name or klass.__module__.startswith(name + ".") for name in names):
                return package
    return None
