"""Reading checkpoints safely: no code runs, and a bad file fails with a clear error.

Every checkpoint of the project holds tensors and plain data only (hyperparameters that are
objects, such as the client module or an embedding network, are left out), so it is read with
``torch.load(weights_only=True)``: a file with a crafted pickle is refused instead of executed.
:func:`load_checkpoint` is the one function the project reads checkpoints with, and
:class:`SafeCheckpointIO` makes the Trainer's own reads (``fit``/``validate``/``test`` with
``ckpt_path``) go through it; ``FederatedModule`` installs it in ``setup``.

A checkpoint written through :class:`SafeCheckpointIO` carries a checksum of its contents
(:func:`checksum`, a CRC-32 over every tensor's bytes and the plain data); a file whose contents
no longer match it (a flipped bit, a damaged disk) is refused, naming the file.

A checkpoint names classes (the client module's, the optimizer's of a run configured with the
CLI): loading one builds only classes that are already imported (their module is in
``sys.modules``), or that the caller allows (``allowed_classes``). A class path is never
imported because a file names it: importing a module runs its code (``unittest.__main__`` runs
the tests of the working directory).
"""

from __future__ import annotations

import importlib
import pickle
import sys
import zlib
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Optional, Union

import torch
from lightning_fabric.plugins import CheckpointIO
from torch import Tensor

from fl_lightning.lightning_compat import build_from_checkpoint, default_map_location

PathLike = Union[str, Path]
#: classes a caller allows a file to name although they are not imported yet: class paths
#: (``"package.module.Class"``, imported when named) or the classes themselves
AllowedClasses = Iterable[Union[str, type]]

#: the key of a checkpoint's checksum (``"crc32:<8 hex digits>"``)
CHECKSUM_KEY = "checksum"
#: Lightning's instantiators (``LightningCLI`` writes one into the hyperparameters): the only
#: functions a checkpoint may name to build its module
INSTANTIATORS = frozenset({"pytorch_lightning.cli.instantiate_module", "lightning.pytorch.cli.instantiate_module"})


def is_plain(value: Any) -> bool:
    """Whether ``value`` is plain data (numbers, strings, None, and lists/dicts of them): what a
    checkpoint may hold besides tensors."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return True
    if isinstance(value, (list, tuple)):
        return all(is_plain(v) for v in value)
    if isinstance(value, dict):
        return all(isinstance(k, str) and is_plain(v) for k, v in value.items())
    return False


class CheckpointError(ValueError):
    """A checkpoint file that cannot be used: missing, empty, truncated, damaged, holding
    objects, or naming a class that may not be built."""


# ---------------------------------------------------------------- checksums
def checksum(value: Any) -> str:
    """A CRC-32 of ``value``: every tensor's dtype, shape and bytes, and the plain data around them
    (dict keys in order, numbers, strings), as ``"crc32:<8 hex digits>"``.

    Equal for a value and its copy read back by ``torch.load``, whatever device it is mapped to;
    objects that are neither tensors nor plain data count by their type only.
    """
    return f"crc32:{_crc(value, 0):08x}"


def _crc(value: Any, crc: int) -> int:
    """``crc`` continued over ``value``'s bytes for :func:`checksum` (one call per node: a checkpoint
    naming thousands of clients' entries is checksummed every round)."""
    if isinstance(value, Tensor):
        t = value.detach()
        t = t.to_dense() if t.layout != torch.strided else t
        crc = zlib.crc32(f"T{t.dtype}{tuple(t.shape)}".encode(), crc)
        if t.numel():
            crc = zlib.crc32(memoryview(t.cpu().contiguous().reshape(-1).view(torch.uint8).numpy()), crc)
        return crc
    if isinstance(value, dict):
        crc = zlib.crc32(f"{{{len(value)}".encode(), crc)
        for key, item in value.items():
            crc = _crc(item, _crc(key, crc))
        return crc
    if isinstance(value, (list, tuple)):
        crc = zlib.crc32(f"[{len(value)}".encode(), crc)
        for item in value:
            crc = _crc(item, crc)
        return crc
    if value is None or isinstance(value, (bool, int, float, str, bytes)):
        return zlib.crc32(f"{type(value).__name__}:{value!r}".encode(), crc)
    return zlib.crc32(type(value).__qualname__.encode(), crc)


def with_checksum(checkpoint: dict[str, Any]) -> dict[str, Any]:
    """``checkpoint`` with its :func:`checksum` added (what :class:`SafeCheckpointIO` writes)."""
    body = {k: v for k, v in checkpoint.items() if k != CHECKSUM_KEY}
    return {**body, CHECKSUM_KEY: checksum(body)}


# ---------------------------------------------------------------- reading
def _looks_like_torch_file(path: Path) -> bool:
    """Whether ``path`` starts like a file of ``torch.save`` (a zip archive, or a pickle of the legacy format)."""
    with open(path, "rb") as file:
        head = file.read(4)
    return head.startswith(b"PK\x03\x04") or head[:1] == b"\x80"


def load_checkpoint(path: PathLike, map_location: Any = "cpu", name: str = "ckpt_path") -> dict[str, Any]:
    """The checkpoint at ``path``, read with ``weights_only=True`` and its checksum checked.

    Args:
        path: the file.
        map_location: where tensors are loaded.
        name: the caller's name of the path, for error messages.

    Raises:
        CheckpointError: the file is missing, empty, not a checkpoint (a YAML file...), not a
            complete checkpoint, damaged (its contents do not match its checksum), or holds
            pickled objects (which could run code when loaded).
    """
    path = Path(path)
    where = f"{name} {str(path)!r}"
    if not path.is_file():
        raise CheckpointError(f"{where} is not a file")
    if path.stat().st_size == 0:
        raise CheckpointError(f"{where} is empty (0 bytes): it was not written completely; "
                              "use an earlier checkpoint (RoundCheckpoint writes atomically)")
    if not _looks_like_torch_file(path):
        raise CheckpointError(f"{where} is not a checkpoint (a .ckpt file written by the Trainer): it does not start "
                              "like a file of torch.save" + (" (it is a YAML file: pass it as --config)"
                                                            if path.suffix in (".yaml", ".yml") else ""))
    try:
        checkpoint = torch.load(path, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as error:
        raise CheckpointError(
            f"{where} holds objects that are not tensors or plain data; loading it could run code, "
            f"so it is refused ({str(error).splitlines()[0]})"
        ) from error
    except (EOFError, RuntimeError, OSError) as error:
        raise CheckpointError(f"{where} is not a complete checkpoint (truncated or damaged: {error})") from error
    if not isinstance(checkpoint, dict):
        raise CheckpointError(f"{where} is not a checkpoint: it holds a {type(checkpoint).__name__}, not a dict")
    return verified(checkpoint, where)


def verified(checkpoint: dict[str, Any], where: str) -> dict[str, Any]:
    """``checkpoint`` without its checksum, after checking it (a checkpoint without one passes).

    Raises:
        CheckpointError: the contents do not match the checksum (``where`` names the file).
    """
    saved = checkpoint.pop(CHECKSUM_KEY, None)
    if saved is not None and saved != checksum(checkpoint):
        raise CheckpointError(f"{where} is damaged: its contents do not match the checksum written with it ({saved}); "
                              "use an earlier checkpoint")
    return checkpoint


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


# ---------------------------------------------------------------- classes a file names
def class_path_of(cls: type) -> str:
    """``cls``'s class path (``module.QualName``), as checkpoints record it."""
    return f"{cls.__module__}.{cls.__qualname__}"


def imported_class(path: str) -> Optional[type]:
    """The class ``path`` names when its module is already imported, else None.

    Reads ``sys.modules`` and the namespaces of modules and classes only: nothing is imported,
    no module ``__getattr__`` runs.
    """
    parts = path.split(".")
    for cut in range(len(parts) - 1, 0, -1):
        target: Any = sys.modules.get(".".join(parts[:cut]))
        if target is None:
            continue
        for attribute in parts[cut:]:
            target = vars(target).get(attribute) if hasattr(target, "__dict__") else None
        if isinstance(target, type):
            return target
    return None


def how_to_allow(path: str) -> str:
    """The ways to let a file name the class ``path``."""
    module = path.rpartition(".")[0]
    return (f"import its module first (import {module}), or pass allowed_classes=[{path!r}] "
            "(or the class itself) if you trust the file")


def resolve_class(path: Any, base: type, allowed: AllowedClasses = (), what: str = "class") -> type:
    """The class a file names by ``path``: an already imported subclass of ``base``, or one of
    ``allowed``.

    An ``allowed`` class path's module is imported here (the caller trusts it); any other
    module is not: importing runs its code.

    Raises:
        CheckpointError: ``path`` names no such class; the message says how to allow it.
    """
    if not isinstance(path, str) or not all(part.isidentifier() for part in path.split(".")) or "." not in path:
        raise CheckpointError(f"the {what} {path!r} is not a class path (package.module.Class)")
    cls = None
    for entry in allowed:
        if isinstance(entry, type) and path == class_path_of(entry):
            cls = entry
        elif entry == path:
            try:
                importlib.import_module(path.rpartition(".")[0])
            except ImportError as error:
                raise CheckpointError(f"the allowed class {path} cannot be imported: {error}") from error
    if cls is None:
        cls = imported_class(path)
    if cls is None:
        raise CheckpointError(f"the {what} {path} is not imported by this process, and loading imports no module "
                              f"a file names (importing runs its code): {how_to_allow(path)}")
    if not issubclass(cls, base):
        raise CheckpointError(f"the {what} {path} is not a {base.__name__}")
    return cls


def check_class_paths(hparams: Any, allowed: AllowedClasses = (), what: str = "hyperparameter") -> None:
    """Check every class a checkpoint's hyperparameters name (``class_path`` / ``_class_path``
    entries, at any depth) with :func:`resolve_class`, and their ``_instantiator`` (Lightning's
    only: :data:`INSTANTIATORS`).

    Raises:
        CheckpointError: one names a class that is not imported and not allowed, or another instantiator.
    """
    allowed = list(allowed)
    if isinstance(hparams, dict):
        for key, value in hparams.items():
            if key == "_instantiator" and value not in INSTANTIATORS:
                raise CheckpointError(f"the {what}s name the instantiator {value!r}; only Lightning's "
                                      f"({', '.join(sorted(INSTANTIATORS))}) may build a module from a file")
            if key in ("class_path", "_class_path"):
                resolve_class(value, object, allowed, f"{what} class")
            else:
                check_class_paths(value, allowed, what)
    elif isinstance(hparams, (list, tuple)):
        for value in hparams:
            check_class_paths(value, allowed, what)


def _dotted_names(value: Any) -> Iterator[str]:
    """Every string in ``value`` that could be an import path (``a.b.c``: a dot at least), and its prefixes."""
    if isinstance(value, str):
        parts = value.split(".")
        if len(parts) > 1 and all(part.isidentifier() for part in parts):
            for cut in range(1, len(parts) + 1):
                yield ".".join(parts[:cut])
    elif isinstance(value, dict):
        for key, item in value.items():
            yield from _dotted_names(key)
            yield from _dotted_names(item)
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _dotted_names(item)


class _RefuseImports:
    """A ``sys.meta_path`` finder refusing to import the modules it names."""

    def __init__(self, names: set[str]) -> None:
        self.names = names
        self.refused: list[str] = []

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> None:
        if fullname in self.names:
            self.refused.append(fullname)
            raise ImportError(f"module {fullname!r} is named by a file being loaded and is not imported: "
                              f"loading imports no module a file names ({how_to_allow(fullname + '.<Class>')})")
        return None


@contextmanager
def no_imports_named_by(value: Any) -> Iterator[list[str]]:
    """Refuse, inside the block, to import any module that a string of ``value`` (a file's
    contents) names and that is not imported yet; other imports (a constructor's own) proceed.
    Yields the list of the modules refused (filled as the block runs)."""
    finder = _RefuseImports({name for name in _dotted_names(value) if name not in sys.modules})
    sys.meta_path.insert(0, finder)
    try:
        yield finder.refused
    finally:
        sys.meta_path.remove(finder)


def load_from_checkpoint(
    cls: type, checkpoint_path: PathLike, map_location: Any = None, hparams_file: Optional[PathLike] = None,
    strict: Optional[bool] = None, allowed_classes: AllowedClasses = (), **kwargs: Any,
) -> Any:
    """Lightning's ``cls.load_from_checkpoint``, safely: the file is read by :func:`load_checkpoint`,
    ``hparams_file`` by :func:`load_hparams_file`, the classes the hyperparameters name are
    checked (:func:`check_class_paths`), and no module a string of the file names is imported
    while ``cls`` is built.

    Args:
        cls: a ``LightningModule`` or ``LightningDataModule`` class.
        checkpoint_path, map_location, hparams_file, strict, **kwargs: as Lightning's.
        allowed_classes: classes the file may name although they are not imported yet.
    """
    checkpoint = load_checkpoint(checkpoint_path, default_map_location(map_location), name="checkpoint_path")
    return build_checked(cls, checkpoint, hparams_file, strict, allowed_classes, **kwargs)


def build_checked(
    cls: type, checkpoint: dict[str, Any], hparams_file: Optional[PathLike] = None, strict: Optional[bool] = None,
    allowed_classes: AllowedClasses = (), **kwargs: Any,
) -> Any:
    """:func:`load_from_checkpoint` on a checkpoint already read."""
    key, allowed_classes = cls.CHECKPOINT_HYPER_PARAMS_KEY, list(allowed_classes)
    if hparams_file is not None:
        checkpoint[key] = load_hparams_file(hparams_file)
    hparams = checkpoint.setdefault(key, {})
    check_class_paths(hparams, allowed_classes)
    for entry in allowed_classes:  # trusted by the caller: importable while the file's classes are built
        if isinstance(entry, str):
            resolve_class(entry, object, [entry], "allowed class")
    try:
        with no_imports_named_by(hparams) as refused:
            return build_from_checkpoint(cls, checkpoint, strict, **kwargs)
    except Exception as error:
        if not refused:
            raise
        raise CheckpointError(f"the hyperparameters name module {refused[0]}, which is not imported by this process, "
                              "and loading imports no module a file names (importing runs its code): "
                              f"{how_to_allow(refused[0] + '.<name>')}") from error


def check_written_by(checkpoint: dict[str, Any], cls: type, path: Any) -> None:
    """Refuse a checkpoint that another algorithm than ``cls`` wrote (it records the class's name).

    Raises:
        CheckpointError: naming both classes.
    """
    written_by = checkpoint.get("federated", {}).get("fingerprint", {}).get("algorithm")
    if written_by is not None and written_by != cls.__qualname__:
        raise CheckpointError(f"checkpoint_path {str(path)!r} was written by {written_by}, not {cls.__qualname__}: "
                              f"load it with {written_by}.load_from_checkpoint")


def check_weights_only(weights_only: Optional[bool]) -> None:
    """Accept ``load_from_checkpoint``'s ``weights_only`` when it is what the project does (True, or None).

    Raises:
        ValueError: ``weights_only=False`` (reading pickled objects could run code).
    """
    if weights_only is not None and weights_only is not True:
        raise ValueError(f"weights_only must be True or None, got {weights_only!r}: checkpoints are always read with "
                         "weights_only=True (loading a file never runs code)")


# ---------------------------------------------------------------- the Trainer's IO
class SafeCheckpointIO(CheckpointIO):
    """The Trainer's checkpoint IO, reading through :func:`load_checkpoint` (local files) and
    otherwise with ``weights_only=True``; writing is the wrapped IO's, with a :func:`checksum` added.

    Args:
        inner: the IO it wraps (the strategy's).
    """

    def __init__(self, inner: CheckpointIO) -> None:
        self.inner = inner

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Optional[Any] = None) -> None:
        self.inner.save_checkpoint(with_checksum(checkpoint), path, storage_options)

    def load_checkpoint(self, path: Any, map_location: Optional[Callable] = None, weights_only: Optional[bool] = None) -> dict[str, Any]:
        if isinstance(path, (str, Path)) and "://" not in str(path):
            return load_checkpoint(path, map_location)
        return verified(self.inner.load_checkpoint(path, map_location=map_location, weights_only=True), str(path))

    def remove_checkpoint(self, path: Any) -> None:
        self.inner.remove_checkpoint(path)

    def teardown(self) -> None:
        self.inner.teardown()


def install_safe_io(strategy: Any) -> None:
    """Wrap ``strategy``'s checkpoint IO in :class:`SafeCheckpointIO` (once)."""
    if not isinstance(strategy.checkpoint_io, SafeCheckpointIO):
        strategy.checkpoint_io = SafeCheckpointIO(strategy.checkpoint_io)
