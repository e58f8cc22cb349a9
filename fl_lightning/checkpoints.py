"""Reading checkpoints safely: no code runs, and a bad file fails with a clear error.

Every checkpoint of the project holds tensors and plain data only (hyperparameters that are
objects, such as the client module or an embedding network, are left out), so it is read with
``torch.load(weights_only=True)``: a file with a crafted pickle is refused instead of executed.
:func:`load_checkpoint` is the one function the project reads checkpoints with, and
:class:`SafeCheckpointIO` makes the Trainer's own reads (``fit``/``validate``/``test`` with
``ckpt_path``) go through it; ``FederatedModule`` installs it in ``setup``.

A checkpoint written through :class:`SafeCheckpointIO` carries a checksum of its contents
(:func:`checksum`, a CRC-32 over every tensor's bytes and the plain data); a file whose contents
no longer match it (a flipped bit, a damaged disk, a hand-edited tensor) is refused, naming the file.
A file without a checksum (written by another program, or by fl_lightning before checkpoints
carried one) is refused as well, since a change to it could not be seen: one you trust gets its
checksum from :func:`add_checksum` (``fl-lightning checkpoint --add-checksum PATH``), or is read
with ``allow_unverified=True`` (:func:`load_checkpoint`, ``load_from_checkpoint``, ``load_pefll``).

What a checkpoint's hyperparameters may build when a module is loaded from one:
:mod:`fl_lightning.file_arguments`.
"""

from __future__ import annotations

import os
import pickle
import zlib
from pathlib import Path
from typing import Any, Callable, Optional, Union

import torch
from torch import Tensor

from fl_lightning.lightning_package import CheckpointIO


PathLike = Union[str, Path]

#: the key of a checkpoint's checksum (``"crc32:<8 hex digits>"``)
CHECKSUM_KEY = "checksum"


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


def _read(path: Path, map_location: Any, where: str) -> dict[str, Any]:
    """The dict ``torch.save`` wrote to ``path`` (its checksum still in it), read with ``weights_only=True``.

    Raises:
        CheckpointError: as :func:`load_checkpoint`, except for the checksum.
    """
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
    return checkpoint


def load_checkpoint(path: PathLike, map_location: Any = "cpu", name: str = "ckpt_path",
                    allow_unverified: bool = False) -> dict[str, Any]:
    """The checkpoint at ``path``, read with ``weights_only=True`` and its checksum checked.

    Args:
        path: the file.
        map_location: where tensors are loaded.
        name: the caller's name of the path, for error messages.
        allow_unverified: accept a file without a checksum (one you trust: its contents cannot be
            checked); a file whose checksum does not match is refused all the same.

    Raises:
        CheckpointError: the file is missing, empty, not a checkpoint (a YAML file...), not a
            complete checkpoint, damaged (its contents do not match its checksum), without a
            checksum (unless ``allow_unverified``), or holds pickled objects (which could run code
            when loaded).
    """
    path = Path(path)
    return verified(_read(path, map_location, f"{name} {str(path)!r}"), path, name, allow_unverified)


def verified(checkpoint: dict[str, Any], path: Any, name: str = "ckpt_path",
             allow_unverified: bool = False) -> dict[str, Any]:
    """``checkpoint``, read from ``path`` (the caller's ``name`` of it), without its checksum, after
    checking it.

    Raises:
        CheckpointError: the contents do not match the checksum, or there is none and
            ``allow_unverified`` is False; naming the file and what to do.
    """
    where = f"{name} {str(path)!r}"
    saved = checkpoint.pop(CHECKSUM_KEY, None)
    if saved is None and not allow_unverified:
        raise CheckpointError(
            f"{where} has no checksum (written by another program, or by fl_lightning before checkpoints carried "
            "one), so a change to its contents could not be detected: it is refused. If you trust the file, add its "
            f"checksum with `fl-lightning checkpoint --add-checksum {path}` and use it as before, or pass "
            "allow_unverified=True (load_from_checkpoint, load_pefll, load_checkpoint)")
    if saved is not None and saved != checksum(checkpoint):
        raise CheckpointError(f"{where} is damaged: its contents do not match the checksum written with it ({saved}); "
                              "use an earlier checkpoint")
    return checkpoint


def add_checksum(path: PathLike) -> bool:
    """Add its :func:`checksum` to the checkpoint at ``path``, which has none: for a file you trust
    (one written before fl_lightning's checkpoints carried a checksum), which is then loaded,
    resumed and evaluated as any other. The file is rewritten atomically, its tensors on the
    devices they were saved from.

    Returns:
        True if the checksum was added; False if the file had a matching one already.

    Raises:
        CheckpointError: the file cannot be read (see :func:`load_checkpoint`), or its checksum does
            not match its contents (a damaged file is not given a new one).
    """
    path = Path(path)
    checkpoint = _read(path, None, f"checkpoint {str(path)!r}")
    if CHECKSUM_KEY in checkpoint:
        verified(checkpoint, path, "checkpoint")
        return False
    temporary = str(path) + ".tmp"
    torch.save(with_checksum(checkpoint), temporary)
    replace_durably(temporary, str(path))
    return True


def replace_durably(temporary: str, path: str) -> None:
    """Rename the file ``temporary`` over ``path`` once its data is on disk: ``path`` then holds
    the previous file or the new one, never part of one (a rename is atomic on POSIX file systems)."""
    descriptor = os.open(temporary, os.O_RDONLY)
    try:
        os.fsync(descriptor)  # the data reaches the disk before the rename does
    finally:
        os.close(descriptor)
    os.replace(temporary, path)


# ---------------------------------------------------------------- what a load checks
def class_path_of(cls: type) -> str:
    """``cls``'s class path (``module.QualName``), as checkpoints record it."""
    return f"{cls.__module__}.{cls.__qualname__}"


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
        self._handed: Optional[tuple[str, dict[str, Any]]] = None

    def hand_over(self, path: PathLike, checkpoint: dict[str, Any]) -> None:
        """Make the next read of ``path`` return ``checkpoint``, which the caller read from it (by
        :func:`load_checkpoint`) and checked, instead of reading the file again: the Trainer then
        loads what was checked, whatever happened to the file since (``fl-lightning``'s ``--ckpt_path``)."""
        self._handed = (os.fspath(path), checkpoint)

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Optional[Any] = None) -> None:
        self.inner.save_checkpoint(with_checksum(checkpoint), path, storage_options)

    def load_checkpoint(self, path: Any, map_location: Optional[Callable] = None, weights_only: Optional[bool] = None) -> dict[str, Any]:
        handed, self._handed = self._handed, None
        if handed is not None and isinstance(path, (str, Path)) and os.fspath(path) == handed[0]:
            return handed[1]
        if isinstance(path, (str, Path)) and "://" not in str(path):
            return load_checkpoint(path, map_location)
        return verified(self.inner.load_checkpoint(path, map_location=map_location, weights_only=True), path)

    def remove_checkpoint(self, path: Any) -> None:
        self.inner.remove_checkpoint(path)

    def teardown(self) -> None:
        self.inner.teardown()


def install_safe_io(strategy: Any) -> SafeCheckpointIO:
    """Wrap ``strategy``'s checkpoint IO in :class:`SafeCheckpointIO` (once); returns it."""
    if not isinstance(strategy.checkpoint_io, SafeCheckpointIO):
        strategy.checkpoint_io = SafeCheckpointIO(strategy.checkpoint_io)
    return strategy.checkpoint_io
