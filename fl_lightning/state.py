"""The client state store: per-client tensors that persist across rounds.

SCAFFOLD's control variates and FedDeper's personal models live here. An algorithm declares
each entry with its default (:meth:`FederatedModule.add_client_state
<fl_lightning.module.FederatedModule.add_client_state>`); entries are created lazily (a client
that never ran has none and starts from the default), kept off the accelerator, moved to the
device only for the clients in flight, and written only for updates the round keeps.

Memory is bounded: the store keeps at most ``memory_budget`` bytes of entries in RAM, the
clients used most recently; older ones are spilled to files in ``directory`` (one immutable file
per entry and version, named by the round that wrote it) and read back when their client takes
part again. A checkpoint holds the entries in RAM and a manifest of the spilled ones (their
versions), so its size is bounded too, and the files a checkpoint names are kept until
``keep_checkpoints`` newer checkpoints no longer name them. The entries in RAM are the same on
every process (``sync`` exchanges the round's new entries); with several processes the spill
directory must be on a file system they share (one node, or a shared file system).
"""

from __future__ import annotations

import os
from collections import OrderedDict, deque
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Optional, Union

import torch
import torch.distributed as dist
from torch import Tensor

from fl_lightning.validation import check_int

#: a state entry's value before the client's first round: a tensor (copied), a function giving
#: one (read when needed, e.g. the global model of round 0), or None (no value: the algorithm
#: creates the entry itself)
StateDefault = Union[Tensor, Callable[[], Tensor], None]


@dataclass(frozen=True)
class StateSpec:
    """One declared per-client state entry and its default."""

    default: StateDefault = None

    def initial(self) -> Optional[Tensor]:
        """A fresh copy of the default value, or None."""
        if self.default is None:
            return None
        value = self.default if isinstance(self.default, Tensor) else self.default()
        return value.detach().clone()


class ClientStateStore:
    """A mapping ``client_id -> {name: tensor}`` with at most ``memory_budget`` bytes in RAM.

    Args:
        memory_budget: bytes of entries kept in RAM (the clients written most recently); the
            rest is spilled to ``directory``.
        directory: where spilled entries go (set by the engine to the run's folder when None;
            needed only once the budget is exceeded).
        keep_checkpoints: how many of the latest checkpoints keep the spilled files they name.
    """

    def __init__(self, memory_budget: int = 2**30, directory: Optional[str] = None, keep_checkpoints: int = 2) -> None:
        self.memory_budget = check_int("memory_budget", memory_budget, 0)
        self.keep_checkpoints = check_int("keep_checkpoints", keep_checkpoints, 1)
        self.directory = directory
        self._ram: OrderedDict[int, dict[str, Tensor]] = OrderedDict()  # least recently used first
        self._ram_bytes = 0
        self._spilled: dict[int, dict[str, int]] = {}  # client -> name -> version on disk (not in RAM)
        self._versions: dict[int, dict[str, int]] = {}  # client -> name -> version of its current value
        self._written: dict[int, dict[str, Tensor]] = {}  # this process's entries of the round (for sync)
        self._named: deque[set[str]] = deque(maxlen=keep_checkpoints)  # files the latest checkpoints name
        self._on_disk: set[str] = set()  # files this store wrote or was given

    # ------------------------------------------------------------ access
    def get(self, client_id: int, name: str, device: Union[str, torch.device, None] = None) -> Optional[Tensor]:
        """The stored tensor (moved to ``device``), or None if the client has no such entry."""
        entry = self._ram.get(client_id)
        if entry is not None and name in entry:  # (reading does not reorder: the order is the writes', the same on every process)
            value = entry[name]
        else:
            version = self._spilled.get(client_id, {}).get(name)
            if version is None:
                return None
            value = self._read(client_id, name, version)
        return value.to(device) if device is not None else value

    def set(self, client_id: int, name: str, value: Tensor, version: int = 0) -> None:
        """Store a CPU copy of ``value`` for ``client_id`` (``version``: the round that wrote it)."""
        client_id = int(client_id)
        value = value.detach().to("cpu", copy=True)
        self._put(client_id, name, value)
        self._versions.setdefault(client_id, {})[name] = version
        self._written.setdefault(client_id, {})[name] = value

    def __contains__(self, client_id: int) -> bool:
        return client_id in self._ram or client_id in self._spilled

    def __len__(self) -> int:
        return len(set(self._ram) | set(self._spilled))

    def clients(self) -> Iterator[int]:
        """Ids of the clients with stored state."""
        return iter(sorted(set(self._ram) | set(self._spilled)))

    def nbytes(self) -> int:
        """Bytes held in RAM."""
        return self._ram_bytes

    # ------------------------------------------------------------ the round's end
    def sync(self) -> None:
        """Make every process hold the entries any process wrote this round, and spill the least
        recently used clients beyond the memory budget (rank 0 writes their files).

        Each client runs on exactly one process per round, so the written entries never
        conflict. Without an initialized process group only the spilling is done.
        """
        written, self._written = self._written, {}
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            versions = {cid: {n: self._versions[cid][n] for n in entry} for cid, entry in written.items()}
            gathered: list = [None] * dist.get_world_size()
            dist.all_gather_object(gathered, (written, versions))
            for part, part_versions in gathered:
                for cid, entry in part.items():
                    for name, value in entry.items():
                        self._put(cid, name, value.cpu())
                        self._versions.setdefault(cid, {})[name] = part_versions[cid][name]
        self._spill()

    def _put(self, client_id: int, name: str, value: Tensor) -> None:
        entry = self._ram.setdefault(client_id, {})
        old = entry.get(name)
        self._ram_bytes += _nbytes(value) - (_nbytes(old) if old is not None else 0)
        entry[name] = value
        self._ram.move_to_end(client_id)
        spilled = self._spilled.get(client_id)
        if spilled is not None:
            spilled.pop(name, None)
            if not spilled:
                del self._spilled[client_id]

    def _spill(self) -> None:
        """Move the least recently used clients to disk until the RAM part fits the budget."""
        rank0 = not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0
        spilled_any = False
        while self._ram_bytes > self.memory_budget and len(self._ram) > 1:
            cid, entry = self._ram.popitem(last=False)
            for name, value in entry.items():
                version = self._versions[cid][name]
                path = self._path(cid, name, version)
                if rank0 and not os.path.exists(path):
                    _atomic_save(value, path)
                self._on_disk.add(path)
                self._spilled.setdefault(cid, {})[name] = version
                self._ram_bytes -= _nbytes(value)
            spilled_any = True
        if spilled_any and dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            dist.barrier()  # the files exist before any process reads them

    def _path(self, client_id: int, name: str, version: int) -> str:
        if self.directory is None:
            raise RuntimeError("the client state store needs a directory to spill to (FederatedModule sets the run's)")
        os.makedirs(self.directory, exist_ok=True)
        return os.path.join(self.directory, f"{client_id}.{name}.{version}.pt")

    def _read(self, client_id: int, name: str, version: int) -> Tensor:
        path = self._path(client_id, name, version)
        if not os.path.exists(path):
            raise FileNotFoundError(f"the stored entry {name!r} of client {client_id} ({path}) is missing: the "
                                    "checkpoint refers to client state that was removed (keep_checkpoints) or moved")
        return torch.load(path, map_location="cpu", weights_only=True)

    # ------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:
        """The entries in RAM and the manifest of the spilled ones (their files are kept until
        ``keep_checkpoints`` newer checkpoints no longer name them)."""
        named = {self._path(cid, n, v) for cid, entry in self._spilled.items() for n, v in entry.items()} \
            if self._spilled else set()
        self._named.append(named)
        self._prune()
        return {
            "memory": {cid: dict(entry) for cid, entry in self._ram.items()},
            "versions": {cid: dict(v) for cid, v in self._versions.items()},
            "spilled": {cid: dict(entry) for cid, entry in self._spilled.items()},
            "directory": self.directory,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Replace all entries with those of a checkpoint."""
        if "memory" not in state:  # the format of checkpoints before the store was bounded: all in RAM
            state = {"memory": state, "versions": {}, "spilled": {}, "directory": self.directory}
        self._ram, self._ram_bytes, self._written = OrderedDict(), 0, {}
        self._versions = {int(cid): dict(v) for cid, v in state["versions"].items()}
        self._spilled = {int(cid): dict(entry) for cid, entry in state["spilled"].items()}
        if state.get("directory") is not None:
            self.directory = state["directory"]
        for cid, entry in state["memory"].items():
            for name, value in entry.items():
                self._put(int(cid), name, value.cpu())
                self._versions.setdefault(int(cid), {}).setdefault(name, 0)
        self._on_disk |= {self._path(cid, n, v) for cid, entry in self._spilled.items() for n, v in entry.items()}

    def memory_entries(self) -> Iterator[tuple[int, str, Tensor]]:
        """The entries held in RAM, as ``(client, name, tensor)``."""
        for cid, entry in self._ram.items():
            for name, value in entry.items():
                yield cid, name, value

    def _prune(self) -> None:
        """Remove spilled files no recent checkpoint and no current entry names (rank 0)."""
        if dist.is_available() and dist.is_initialized() and dist.get_rank() != 0:
            return
        keep = set().union(*self._named) if self._named else set()
        keep |= {self._path(cid, n, v) for cid, entry in self._spilled.items() for n, v in entry.items()}
        for path in sorted(self._on_disk - keep):
            if os.path.exists(path):
                os.remove(path)
            self._on_disk.discard(path)


def _nbytes(t: Tensor) -> int:
    return t.numel() * t.element_size()


def _atomic_save(value: Tensor, path: str) -> None:
    temporary = path + ".tmp"
    torch.save(value, temporary)
    os.replace(temporary, path)
