"""What a file may build: a module's constructor arguments from a checkpoint's (or an
``hparams_file``'s) hyperparameters, with nothing of the file's choosing run.

A checkpoint records a module's constructor arguments as plain data, and an argument that is an
object as a ``class_path`` + ``init_args`` entry (how ``LightningCLI`` writes them). Loading builds
exactly these, and refuses everything else before anything is built:

* the class being loaded (the one whose ``load_from_checkpoint`` is called), or the subclass of it
  the hyperparameters' ``_class_path`` names where fl_lightning defines it;
* for an argument whose annotation takes objects of a class (a server optimizer, an embedding
  network, a partitioner, a subsample; :func:`argument_kinds`), a class of that kind that
  fl_lightning defines (and, for optimizers, ``torch.optim``'s own), called with its ``init_args``
  as keyword arguments, built by these same rules;
* anywhere, a class the caller names in ``allowed_classes`` (by class path or as the class).

No instantiator a file names runs (Lightning's generic one would build a nested ``class_path`` for
any argument typed ``Any``), no module a file names is imported (importing runs its code), and an
argument typed ``Any``, untyped, or a container builds nothing the caller has not allowed. What a
file can cause is therefore: the constructors of fl_lightning's own classes and ``torch.optim``'s
optimizers called with plain values it chooses, and of the classes the caller allows.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import sys
import typing
from collections.abc import Callable as AbcCallable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Optional, Union

import torch

from fl_lightning.checkpoints import CheckpointError, class_path_of, load_checkpoint
from fl_lightning.lightning_compat import build_from_checkpoint, default_map_location

PathLike = Union[str, Path]
#: classes a caller allows a file to name: class paths (``"package.module.Class"``, imported when
#: named: the caller trusts them) or the classes themselves
AllowedClasses = Iterable[Union[str, type]]

#: the package whose classes a file may name for an argument of their kind
PROJECT = "fl_lightning"
#: further packages whose classes of a kind count as the project's own: torch's optimizers
BUILT_IN = {torch.optim.Optimizer: ("torch.optim",)}
#: the keys of a ``class_path`` entry (jsonargparse's ``dict_kwargs`` only when empty)
ENTRY_KEYS = frozenset({"class_path", "init_args", "dict_kwargs"})


@dataclass(frozen=True)
class Kind:
    """What a constructor argument takes: instances of ``base``, or (``factory``) a callable that
    makes one (``OptimizerCallable``: the optimizer class with its arguments bound)."""

    base: type
    factory: bool = False

    def describe(self) -> str:
        return f"{'a maker of ' if self.factory else ''}{self.base.__module__}.{self.base.__qualname__}"


# ---------------------------------------------------------------- kinds of arguments
#: modules whose classes are plain values or markers (``typing.Any`` is a class since Python 3.11)
_PLAIN_MODULES = ("builtins", "typing", "pathlib", "collections.abc")


def _takes_objects(annotation: Any) -> bool:
    """Whether ``annotation`` is a class whose instances are objects a file could choose."""
    return isinstance(annotation, type) and annotation.__module__ not in _PLAIN_MODULES


def kind_of(annotation: Any) -> Optional[Kind]:
    """The :class:`Kind` of an argument annotated ``annotation`` (None: it takes no objects a file
    may choose: plain values, ``Any``, containers, no annotation)."""
    if typing.get_origin(annotation) is Union:
        kinds = [k for k in map(kind_of, typing.get_args(annotation)) if k is not None]
        return kinds[0] if len(kinds) == 1 else None
    if typing.get_origin(annotation) is AbcCallable:
        args = typing.get_args(annotation)
        made = args[-1] if args else None
        return Kind(made, factory=True) if _takes_objects(made) else None
    if _takes_objects(annotation):
        return Kind(annotation)
    return None


def argument_kinds(cls: type) -> dict[str, Optional[Kind]]:
    """The :class:`Kind` of each constructor argument of ``cls``, following ``**kwargs`` to the
    constructors of its bases (an algorithm's ``**kwargs`` are ``FederatedModule``'s)."""
    kinds: dict[str, Optional[Kind]] = {}
    for klass in cls.__mro__:
        init = vars(klass).get("__init__")
        if init is None or klass is object:
            continue
        try:
            hints = typing.get_type_hints(init)
        except Exception:  # an annotation that does not resolve: the argument takes no objects
            hints = {}
        parameters = inspect.signature(init).parameters
        for name, parameter in list(parameters.items())[1:]:
            if parameter.kind not in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD):
                kinds.setdefault(name, kind_of(hints.get(name)))
        if not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values()):
            break
    return kinds


# ---------------------------------------------------------------- classes a file names
def _named_class(path: str) -> Optional[type]:
    """The class ``path`` names, looked up without importing any module, except fl_lightning's own
    (the project's code, which runs nothing when imported; never a ``__main__``)."""
    parts = path.split(".")
    if parts[0] == PROJECT and "__main__" not in parts:
        for cut in range(len(parts) - 1, 0, -1):
            try:
                importlib.import_module(".".join(parts[:cut]))
                break
            except ImportError:
                continue
    for cut in range(len(parts) - 1, 0, -1):
        target: Any = sys.modules.get(".".join(parts[:cut]))
        if target is None:
            continue
        for attribute in parts[cut:]:
            target = vars(target).get(attribute) if hasattr(target, "__dict__") else None
        if isinstance(target, type):
            return target
    return None


def _owned(cls: type, base: type) -> bool:
    """Whether ``cls``, a ``base``, is defined by fl_lightning (or is one of ``base``'s built-in kinds)."""
    packages = (PROJECT, *next((p for b, p in BUILT_IN.items() if issubclass(base, b)), ()))
    return any(cls.__module__ == p or cls.__module__.startswith(p + ".") for p in packages)


def allowed_class(path: Any, kind: Optional[Kind], allowed: AllowedClasses, where: str,
                  instead: str = "give the argument yourself") -> type:
    """The class a file names by ``path`` at ``where``, if it may be built there: one the caller
    allows, or one fl_lightning defines of the argument's ``kind``.

    Raises:
        CheckpointError: any other class, naming ``where``, the class and how to allow it (or what
            to do ``instead``).
    """
    if not isinstance(path, str) or "." not in path or not all(p.isidentifier() for p in path.split(".")):
        raise CheckpointError(f"{where}: {path!r} is not a class path (package.module.Class)")
    for entry in allowed:
        if isinstance(entry, type) and path == class_path_of(entry):
            return entry
        if entry == path:
            try:  # the caller trusts it: its module may be imported
                importlib.import_module(path.rpartition(".")[0])
            except ImportError as error:
                raise CheckpointError(f"the allowed class {path} cannot be imported: {error}") from error
            cls = _named_class(path)
            if cls is None:
                raise CheckpointError(f"the allowed class {path} is not a class")
            return cls
    cls = _named_class(path)
    if kind is not None and cls is not None and issubclass(cls, kind.base) and _owned(cls, kind.base):
        return cls
    takes = f"it takes {kind.describe()}" if kind is not None else "it takes no object a file may choose"
    raise CheckpointError(
        f"{where} names the class {path}, which loading does not build ({takes}): a file builds only "
        f"fl_lightning's own classes of an argument's kind and the classes the caller allows; pass "
        f"allowed_classes=[{path!r}] (or the class) if you trust the file, or {instead}")


# ---------------------------------------------------------------- building
def _has_class_path(value: Any) -> bool:
    if isinstance(value, dict):
        return "class_path" in value or any(_has_class_path(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return any(_has_class_path(v) for v in value)
    return False


def build_value(value: Any, kind: Optional[Kind], allowed: AllowedClasses, where: str) -> Any:
    """An argument's value from a file: plain data as it is; a ``class_path`` entry built by
    :func:`allowed_class`'s rules, its ``init_args`` by these (an argument of a ``factory`` kind gets
    the class with its arguments bound)."""
    if not _has_class_path(value):
        return value
    if isinstance(value, (list, tuple)):
        return type(value)(build_value(v, None, allowed, f"{where}[{i}]") for i, v in enumerate(value))
    if "class_path" not in value:
        return {k: build_value(v, None, allowed, f"{where}.{k}") for k, v in value.items()}
    extra = set(value) - ENTRY_KEYS
    if extra or value.get("dict_kwargs"):
        raise CheckpointError(f"{where}: a class_path entry holds class_path and init_args only, got "
                              f"{sorted(set(value) - {'class_path', 'init_args'})}")
    cls = allowed_class(value["class_path"], kind, allowed, where)
    init_args = value.get("init_args") or {}
    if not isinstance(init_args, dict):
        raise CheckpointError(f"{where}.init_args must be a mapping of keyword arguments, got {init_args!r}")
    arguments = build_arguments(cls, init_args, allowed, f"{where}.init_args")
    if kind is not None and kind.factory:
        return functools.partial(cls, **arguments)
    try:
        return cls(**arguments)
    except (TypeError, ValueError) as error:
        raise CheckpointError(f"{where}: {class_path_of(cls)}(**{arguments}) failed: {error}") from error


def build_arguments(cls: type, values: dict[str, Any], allowed: AllowedClasses, where: str) -> dict[str, Any]:
    """``cls``'s constructor arguments from a file's ``values`` (:func:`build_value` each, by the kind
    of the argument it is)."""
    allowed = list(allowed)
    kinds = argument_kinds(cls)
    return {name: build_value(value, kinds.get(name), allowed, f"{where}.{name}") for name, value in values.items()}


def loaded_class(cls: type, class_path: Any, allowed: AllowedClasses, where: str) -> type:
    """The class a checkpoint of ``cls`` builds: ``cls``, or the subclass its hyperparameters'
    ``_class_path`` names (``LightningCLI`` records it) where fl_lightning defines it or the caller
    allows it."""
    if class_path is None or class_path == class_path_of(cls) or _named_class(str(class_path)) is cls:
        return cls
    return allowed_class(class_path, Kind(cls), allowed, f"{where}: _class_path")


def load_hparams_file(path: PathLike) -> dict[str, Any]:
    """The hyperparameters of a YAML file (``load_from_checkpoint(hparams_file=...)``), read with
    ``yaml.safe_load``: YAML tags that build Python objects are refused.

    Raises:
        CheckpointError: the file is missing, not plain YAML, or not a mapping.
    """
    import yaml

    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"hparams_file {str(path)!r} is not a file")
    try:
        hparams = yaml.safe_load(path.read_text())
    except yaml.YAMLError as error:
        raise CheckpointError(f"hparams_file {str(path)!r} is not plain YAML (tags that build Python objects are "
                              f"refused): {str(error).splitlines()[0]}") from error
    if not isinstance(hparams, dict):
        raise CheckpointError(f"hparams_file {str(path)!r} must hold a mapping of hyperparameters, "
                              f"got {type(hparams).__name__}")
    return hparams


def build_checked(
    cls: type, checkpoint: dict[str, Any], hparams_file: Optional[PathLike] = None, strict: Optional[bool] = None,
    allowed_classes: AllowedClasses = (), where: str = "checkpoint", **kwargs: Any,
) -> Any:
    """``cls`` (a ``LightningModule`` or ``LightningDataModule``) built from a checkpoint already read:
    its hyperparameters (or ``hparams_file``'s) by :func:`build_arguments`, ``kwargs`` (the caller's,
    taken as given) in place of theirs; then its state loaded, as Lightning's ``load_from_checkpoint``."""
    key, allowed_classes = cls.CHECKPOINT_HYPER_PARAMS_KEY, list(allowed_classes)
    if hparams_file is not None:
        checkpoint[key] = load_hparams_file(hparams_file)
        where = f"hparams_file {str(hparams_file)!r}"
    hparams = checkpoint.setdefault(key, {})
    hparams.pop("_instantiator", None)  # no function a file names runs: the arguments are built here
    target = loaded_class(cls, hparams.pop("_class_path", None), allowed_classes, where)
    mine = {k: v for k, v in hparams.items() if k not in kwargs}
    arguments = build_arguments(target, mine, allowed_classes, f"{where}: hyperparameter")
    return build_from_checkpoint(target, checkpoint, strict, **arguments, **kwargs)


def load_from_checkpoint(
    cls: type, checkpoint_path: PathLike, map_location: Any = None, hparams_file: Optional[PathLike] = None,
    strict: Optional[bool] = None, allowed_classes: AllowedClasses = (), allow_unverified: bool = False, **kwargs: Any,
) -> Any:
    """Lightning's ``cls.load_from_checkpoint``, safely: the file is read by
    :func:`~fl_lightning.checkpoints.load_checkpoint` (weights only, checksum checked),
    ``hparams_file`` by :func:`load_hparams_file`, and the module built by :func:`build_checked`.

    Args:
        cls: a ``LightningModule`` or ``LightningDataModule`` class.
        checkpoint_path, map_location, hparams_file, strict, kwargs: as Lightning's.
        allowed_classes: classes the file may name besides fl_lightning's own (see the module's docstring).
        allow_unverified: accept a checkpoint without a checksum (one you trust).
    """
    checkpoint = load_checkpoint(checkpoint_path, default_map_location(map_location), name="checkpoint_path",
                                 allow_unverified=allow_unverified)
    return build_checked(cls, checkpoint, hparams_file, strict, allowed_classes,
                         where=f"checkpoint_path {str(checkpoint_path)!r}", **kwargs)
