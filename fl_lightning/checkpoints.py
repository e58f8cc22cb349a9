"""Reading checkpoints safely: no code runs, and a bad file fails with a clear error.

Every checkpoint of the project holds tensors and plain data only (hyperparameters that are
objects, such as the client module or an embedding network, are left out), so it is read with
``torch.load(weights_only=True)``: a file with a crafted pickle is refused instead of executed.
:func:`load_checkpoint` is the one function the project reads checkpoints with, and
:class:`SafeCheckpointIO` makes the Trainer's own reads (``fit``/``validate``/``test`` with
``ckpt_path``) go through it; ``FederatedModule`` installs it in ``setup``.
"""

from __future__ import annotations

import pickle
from pathlib import Path
from typing import Any, Callable, Optional, Union

import torch
from lightning_fabric.plugins import CheckpointIO

PathLike = Union[str, Path]


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
    """A checkpoint file that cannot be used: missing, empty, truncated, or holding objects."""


def load_checkpoint(path: PathLike, map_location: Any = "cpu", name: str = "ckpt_path") -> dict[str, Any]:
    """The checkpoint at ``path``, read with ``weights_only=True``.

    Args:
        path: the file.
        map_location: where tensors are loaded.
        name: the caller's name of the path, for error messages.

    Raises:
        CheckpointError: the file is missing, empty, not a complete checkpoint, or holds
            pickled objects (which could run code when loaded).
    """
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"{name} {str(path)!r} is not a file")
    if path.stat().st_size == 0:
        raise CheckpointError(f"{name} {str(path)!r} is empty (0 bytes): it was not written completely; "
                              "use an earlier checkpoint (RoundCheckpoint writes atomically)")
    try:
        return torch.load(path, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as error:
        raise CheckpointError(
            f"{name} {str(path)!r} holds objects that are not tensors or plain data; loading it could run code, "
            f"so it is refused ({str(error).splitlines()[0]})"
        ) from error
    except (EOFError, RuntimeError) as error:
        raise CheckpointError(f"{name} {str(path)!r} is not a complete checkpoint ({error})") from error


class SafeCheckpointIO(CheckpointIO):
    """The Trainer's checkpoint IO, reading through :func:`load_checkpoint` (local files) and
    otherwise with ``weights_only=True``; writing is the wrapped IO's.

    Args:
        inner: the IO it wraps (the strategy's).
    """

    def __init__(self, inner: CheckpointIO) -> None:
        self.inner = inner

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Optional[Any] = None) -> None:
        self.inner.save_checkpoint(checkpoint, path, storage_options)

    def load_checkpoint(self, path: Any, map_location: Optional[Callable] = None, weights_only: Optional[bool] = None) -> dict[str, Any]:
        if isinstance(path, (str, Path)) and "://" not in str(path):
            return load_checkpoint(path, map_location)
        return self.inner.load_checkpoint(path, map_location=map_location, weights_only=True)

    def remove_checkpoint(self, path: Any) -> None:
        self.inner.remove_checkpoint(path)

    def teardown(self) -> None:
        self.inner.teardown()


def install_safe_io(strategy: Any) -> None:
    """Wrap ``strategy``'s checkpoint IO in :class:`SafeCheckpointIO` (once)."""
    if not isinstance(strategy.checkpoint_io, SafeCheckpointIO):
        strategy.checkpoint_io = SafeCheckpointIO(strategy.checkpoint_io)

