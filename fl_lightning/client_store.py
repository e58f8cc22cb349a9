"""The client state store: per-client tensors that persist across rounds.

SCAFFOLD's control variates and FedDeper's personal models live here. An algorithm declares
each entry with its default (:meth:`FederatedModule.add_client_state
<fl_lightning.module.FederatedModule.add_client_state>`); entries are created lazily (a client
that never ran has none and starts from the default), kept off the accelerator, moved to the
device only for the clients in flight, and written only for updates the round keeps.

Memory is bounded: the store keeps at most ``memory_budget`` bytes of entries in RAM, the
clients used most recently; older ones are spilled to files in ``directory`` (one immutable file
per entry and version, named by the round that wrote it) and read back when their client takes
part again. The process's memory follows: at each round's end, once it has grown by more than the
budget since it last did, the memory it freed is given back to the system
(:class:`~fl_lightning.freed_memory.FreedMemory`). Checkpoints are incremental: a checkpoint
writes the files of the entries that are new since the last one (the round's clients) and holds
only the manifest (every entry's version, shape, and its file's size and checksum), as a few
integer columns per entry name (:class:`Manifest`), kept up to date as entries change: what a
checkpoint costs to gather, copy, checksum and write grows with the round's clients, not with all
the clients that hold state (only the columns' bytes do: 48 per entry). The files a checkpoint
names are kept while it is among the ``keep_checkpoints`` latest ones, and while the next one is
being written (a kill during that write leaves it whole); the files an entry's new version
supersedes are removed once no kept checkpoint names them, found from the entries that changed,
not by listing every entry (a version that no checkpoint named, at the end of the round that
superseded it). Loading one warms the RAM part from them (checking every value it reads is finite).

A run owns its folder: the engine gives every run a folder of its own, named by a run id, below
``client_state_dir``, and records it in checkpoints as an absolute path. A run that resumes a
checkpoint (its own run's, or another's, in the same ``client_state_dir`` or not) is a new run:
it never changes or removes the checkpoint's files. Before training starts it checks every one
against the size and checksum the checkpoint recorded, naming the missing and damaged ones, then
takes its own hard link of each in its own folder (a copy across file systems), so the run that
wrote them (still running, perhaps) can remove them without taking the resumed run's. So two runs
sharing a ``client_state_dir`` never touch each other's files.
A checkpoint whose folder was moved together with it is found at the same place relative to it.
Temporary files that a killed write left in the checkpoint's folders are removed on resume when
their writer (named in the file) is no longer running on this machine. The entries
in RAM are the same on every process (``sync`` exchanges the round's new entries); with several
processes the directory must be on a file system they share (one node, or a shared file system).
"""

from __future__ import annotations

import io
import os
import pickle
import shutil
import socket
import tempfile
import time
import uuid
import warnings
import zlib
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Optional, Union

import numpy as np
import torch
import torch.distributed as dist
from torch import Tensor

from fl_lightning.checkpoints import checksum
from fl_lightning.freed_memory import FreedMemory
from fl_lightning.validation import check_int

#: the least growth of the process's resident memory after which the store gives freed memory back (its
#: budget, when larger): see :class:`~fl_lightning.freed_memory.FreedMemory`
FREED_MEMORY_ALLOWANCE = 32 * 2**20

#: how many of the damaged or missing files a resume names (then how many more)
NAMED_FILES = 5

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


Key = tuple[int, str]  # (client, entry name)


#: an entry's file as a checkpoint records it: its size in bytes and the CRC-32 of its bytes (:func:`file_sum`)
FileSum = tuple[int, int]


@dataclass
class Manifest:
    """What a checkpoint's store state names: every entry's version (``client -> name ->
    version``) and shape, the folder its files were written in (``directory``), the folder of
    each entry whose file another run wrote (read where it is), and the size and checksum of each
    entry's file (``files``; not in checkpoints written before they were recorded)."""

    directory: Optional[str]
    versions: dict[int, dict[str, int]] = field(default_factory=dict)
    shapes: dict[Key, tuple[int, ...]] = field(default_factory=dict)
    elsewhere: dict[Key, str] = field(default_factory=dict)
    files: dict[Key, FileSum] = field(default_factory=dict)


def read_manifest(state: dict[str, Any]) -> Manifest:
    """The :class:`Manifest` of a store's checkpoint state: its columns (``"names"``; those written
    before the files' sizes and checksums were recorded have none), or the nested dicts of
    checkpoints written before (``"entries"``: ``client -> name -> version``, with ``"shapes"`` and
    ``"elsewhere"`` alike)."""
    manifest = Manifest(state.get("directory"))
    if "names" in state:
        shapes, folders = [tuple(shape) for shape in state["shapes"]], list(state["folders"])
        for name, columns in state["names"].items():
            recorded = _COLUMNS if _COLUMNS[-1] in columns else _COLUMNS[:-2]
            rows = zip(*(columns[c].tolist() for c in recorded))
            for client, version, shape, folder, *sums in rows:
                manifest.versions.setdefault(client, {})[name] = version
                manifest.shapes[(client, name)] = shapes[shape]
                if folder >= 0:
                    manifest.elsewhere[(client, name)] = folders[folder]
                if sums and sums[0] >= 0:
                    manifest.files[(client, name)] = (sums[0], sums[1])
        return manifest
    manifest.versions = {int(cid): dict(v) for cid, v in state["entries"].items()}
    manifest.shapes = {(int(cid), name): tuple(shape) for cid, entry in state.get("shapes", {}).items()
                       for name, shape in entry.items()}
    manifest.elsewhere = {(int(cid), name): folder for cid, entry in state.get("elsewhere", {}).items()
                          for name, folder in entry.items()}
    return manifest


#: the columns of one entry name in a checkpoint's manifest (the last two since they were recorded)
_COLUMNS = ("clients", "versions", "shapes", "folders", "sizes", "checksums")


class _Columns:
    """One entry name's part of the manifest as integer columns: each client's version, shape (an
    index into the store's shapes), folder (an index into the store's folders of other runs'
    files; -1: this store's own) and its file's size and CRC-32 (-1: not known), a row per
    client, updated in place as entries change."""

    def __init__(self) -> None:
        self._rows: dict[int, int] = {}
        self._table = np.zeros((len(_COLUMNS), 64), dtype=np.int64)

    def put(self, client: int, version: int, shape: int, folder: int, size: int, crc: int) -> None:
        row = self._rows.get(client)
        if row is None:
            row = self._rows[client] = len(self._rows)
            if row == self._table.shape[1]:
                self._table = np.concatenate([self._table, np.zeros_like(self._table)], axis=1)
        self._table[:, row] = (client, version, shape, folder, size, crc)

    def tensors(self) -> dict[str, Tensor]:
        """The columns as tensors of their own (the checkpoint's copy)."""
        table = torch.from_numpy(self._table[:, : len(self._rows)].copy())
        return dict(zip(_COLUMNS, table.unbind(0)))


class ClientStateStore:
    """A mapping ``client_id -> {name: tensor}`` with at most ``memory_budget`` bytes in RAM.

    Args:
        memory_budget: bytes of entries kept in RAM (the clients written most recently); the
            rest is spilled to ``directory``.
        directory: where spilled entries go (set by the engine to the run's folder when None;
            needed only once the budget is exceeded).
        keep_checkpoints: how many of the latest checkpoints keep the files they name (None: every
            checkpoint); the files of the one being written are kept too. The file of a version
            that no checkpoint named is removed (whatever ``keep_checkpoints``) at the end of the
            round that superseded it. An older checkpoint still loads (a resume refuses it, naming the files
            that are gone; a personalized evaluation fails when it reads one).

    At each round's end (:meth:`sync`), the process gives the memory it freed back to the system
    once its resident memory has grown by more than ``memory_budget`` (at least
    :data:`FREED_MEMORY_ALLOWANCE`) since it last did (:class:`~fl_lightning.freed_memory.FreedMemory`).
    """

    def __init__(
        self, memory_budget: int = 2**30, directory: Optional[str] = None, keep_checkpoints: Optional[int] = 2
    ) -> None:
        self.memory_budget = check_int("memory_budget", memory_budget, 0)
        self.keep_checkpoints = None if keep_checkpoints is None else check_int("keep_checkpoints", keep_checkpoints, 1)
        self.directory = None if directory is None else os.path.abspath(directory)
        self._ram: OrderedDict[int, dict[str, Tensor]] = OrderedDict()  # least recently used first
        self._ram_bytes = 0
        self._spilled: dict[int, dict[str, int]] = {}  # client -> name -> version on disk (not in RAM)
        self._versions: dict[int, dict[str, int]] = {}  # client -> name -> version of its current value
        self._written: dict[int, dict[str, Tensor]] = {}  # this process's entries of the round (for sync)
        self._on_disk: set[str] = set()  # files of this store's directory it wrote or was given
        #: the entries changed since the last checkpoint, with their version that checkpoint named
        #: (None: none, or another run's file, which is never removed)
        self._changed: dict[Key, Optional[int]] = {}
        #: files of versions no checkpoint named (superseded before the next checkpoint): removed at the round's end
        self._unnamed: set[str] = set()
        #: (checkpoint, the files its entries' new versions superseded), removed once no kept checkpoint names them
        self._retiring: deque[tuple[int, set[str]]] = deque()
        self._checkpoints = 0  # checkpoints taken by this store (the index of the next one)
        #: the manifest's columns by entry name, and the shapes and other runs' folders they index
        self._columns: dict[str, _Columns] = {}
        self._shape_index: dict[tuple[int, ...], int] = {}
        self._folder_index: dict[str, int] = {}
        #: the directory of an entry's file when another run wrote it (loaded from its checkpoint): read
        #: from there, never rewritten or removed
        self._elsewhere: dict[Key, str] = {}
        self._unsaved: set[Key] = set()  # entries whose current value has no file yet
        #: every entry's shape, kept in checkpoints: a file read back must hold a tensor of that shape
        self._shapes: dict[Key, tuple[int, ...]] = {}
        #: the size and checksum of the file of an entry's current version (where this process wrote it, or a
        #: checkpoint recorded it), kept in checkpoints: a resume checks every file against them
        self._sums: dict[Key, FileSum] = {}
        self._freed = FreedMemory()

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
        self._note_change(client_id, name, version)
        self._put(client_id, name, value)
        self._versions.setdefault(client_id, {})[name] = version
        self._elsewhere.pop((client_id, name), None)
        self._unsaved.add((client_id, name))
        self._written.setdefault(client_id, {})[name] = value

    def __contains__(self, client_id: int) -> bool:
        return client_id in self._ram or client_id in self._spilled

    def __len__(self) -> int:
        return len(set(self._ram) | set(self._spilled))

    def clients(self) -> Iterator[int]:
        """Ids of the clients with stored state."""
        return iter(sorted(set(self._ram) | set(self._spilled)))

    def entries(self) -> Iterator[tuple[int, str]]:
        """Every stored ``(client, name)``, in client order."""
        return iter(sorted((cid, name) for cid, names in self._versions.items() for name in names))

    def nbytes(self) -> int:
        """Bytes held in RAM."""
        return self._ram_bytes

    # ------------------------------------------------------------ the round's end
    def sync(self) -> None:
        """Make every process hold the entries any process wrote this round, remove the files of
        versions they superseded that no checkpoint named, spill the least recently used clients
        beyond the memory budget (rank 0 writes and removes files), and give freed memory back to
        the system if the process grew by more than the budget since it last did.

        Each client runs on exactly one process per round, so the written entries never
        conflict. Without an initialized process group there is nothing to exchange.
        """
        written, self._written = self._written, {}
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            versions = {cid: {n: self._versions[cid][n] for n in entry} for cid, entry in written.items()}
            gathered: list = [None] * dist.get_world_size()
            dist.all_gather_object(gathered, (written, versions))
            for part, part_versions in gathered:
                for cid, entry in part.items():
                    for name, value in entry.items():
                        if self._versions.get(cid, {}).get(name) != part_versions[cid][name]:  # another process's
                            self._note_change(cid, name, part_versions[cid][name])
                        self._put(cid, name, value.cpu())
                        self._versions.setdefault(cid, {})[name] = part_versions[cid][name]
                        self._elsewhere.pop((cid, name), None)
                        self._unsaved.add((cid, name))
        self._remove(self._unnamed)  # (every process has read what it needed of them: the round is over)
        self._unnamed = set()
        self._spill()
        self._freed.give_back(max(self.memory_budget, FREED_MEMORY_ALLOWANCE))

    def _put(self, client_id: int, name: str, value: Tensor) -> None:
        self._shapes[(client_id, name)] = tuple(value.shape)
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

    def _note_change(self, client_id: int, name: str, new_version: int) -> None:
        """Before an entry takes a new value (of version ``new_version``): remember the version the
        last checkpoint named (its file is removed once no kept checkpoint names it), or, for a
        version of its own written since that checkpoint and spilled, the file no checkpoint will
        name (removed at the round's end). A file of the same version no longer holds its value: it
        is written again when needed."""
        key = (client_id, name)
        version = self._versions.get(client_id, {}).get(name)
        own = version is not None and key not in self._elsewhere
        self._sums.pop(key, None)
        if key not in self._changed:
            self._changed[key] = version if own else None
        elif own and version != self._changed[key] and self.directory is not None:
            path = self._path(client_id, name, version)
            if version == new_version:
                self._on_disk.discard(path)
            elif path in self._on_disk:
                self._unnamed.add(path)

    def _spill(self) -> None:
        """Move the least recently used clients to disk until the RAM part fits the budget."""
        rank0 = _rank0()
        spilled_any = False
        while self._ram_bytes > self.memory_budget and len(self._ram) > 1:
            cid, entry = self._ram.popitem(last=False)
            for name, value in entry.items():
                version = self._versions[cid][name]
                if (cid, name) not in self._elsewhere:
                    path = self._path(cid, name, version)
                    if rank0 and path not in self._on_disk:  # (a file of another run with this name is replaced)
                        self._sums[(cid, name)] = _atomic_save(value, path)
                    self._on_disk.add(path)
                self._unsaved.discard((cid, name))
                self._spilled.setdefault(cid, {})[name] = version
                self._ram_bytes -= _nbytes(value)
            spilled_any = True
        if spilled_any and dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            dist.barrier()  # the files exist before any process reads them

    def _path(self, client_id: int, name: str, version: int) -> str:
        """The file of an entry's version in this store's directory."""
        if self.directory is None:
            raise RuntimeError("the client state store needs a directory to spill to (FederatedModule sets the run's)")
        return os.path.join(self.directory, f"{client_id}.{name}.{version}.pt")

    def _file(self, client_id: int, name: str, version: int) -> str:
        """The file an entry's version is read from (this store's directory, or another run's)."""
        elsewhere = self._elsewhere.get((client_id, name))
        return (os.path.join(elsewhere, f"{client_id}.{name}.{version}.pt") if elsewhere is not None
                else self._path(client_id, name, version))

    def _read(self, client_id: int, name: str, version: int) -> Tensor:
        path = self._file(client_id, name, version)
        if not os.path.exists(path):
            raise FileNotFoundError(f"the stored entry {name!r} of client {client_id} ({path}) is missing: the "
                                    "checkpoint refers to client state that was moved, or removed after newer "
                                    "checkpoints (client_state_checkpoints)")
        value = read_state_file(path)
        shape = self._shapes.get((client_id, name))
        if shape is not None and tuple(value.shape) != shape:
            raise ValueError(f"the client-state file {path} holds a tensor of shape {tuple(value.shape)}, but client "
                             f"{client_id}'s entry {name!r} has shape {shape} (a file of another run or model copied "
                             "over it?)")
        _check_finite(client_id, name, value, path)
        return value

    # ------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:
        """The manifest of every entry (``client -> name -> version``) and the directory of their
        files; the entries in RAM that have no file yet are written first (rank 0). A store with
        no directory (used outside a ``FederatedModule``) holds everything in RAM and puts it in
        the checkpoint."""
        if self.directory is None:
            self._changed = {}
            return {"memory": {cid: dict(entry) for cid, entry in self._ram.items()},
                    "versions": {cid: dict(v) for cid, v in self._versions.items()}, "spilled": {}}
        self._persist()
        retired = set()
        for (cid, name), named in self._changed.items():
            version = self._versions[cid][name]
            self._put_columns(cid, name)
            if named is not None and named != version:
                retired.add(self._path(cid, name, named))
        self._changed = {}
        self._prune(retired)
        self._checkpoints += 1
        return {"directory": self.directory, "names": {name: c.tensors() for name, c in self._columns.items()},
                "shapes": [list(shape) for shape in self._shape_index], "folders": list(self._folder_index)}

    def _put_columns(self, client_id: int, name: str) -> None:
        """Bring the manifest's row of an entry up to date with its version, shape and folder."""
        shape, folder = self._shapes[(client_id, name)], self._elsewhere.get((client_id, name))
        columns = self._columns.get(name)
        if columns is None:
            columns = self._columns[name] = _Columns()
        columns.put(client_id, self._versions[client_id][name], self._shape_index.setdefault(shape, len(self._shape_index)),
                    -1 if folder is None else self._folder_index.setdefault(folder, len(self._folder_index)),
                    *self._sums.get((client_id, name), (-1, -1)))

    def _rebuild_columns(self) -> None:
        """The manifest's columns of every entry (after a checkpoint was loaded)."""
        self._columns, self._shape_index, self._folder_index = {}, {}, {}
        for cid, entry in sorted(self._versions.items()):
            for name in entry:
                self._put_columns(cid, name)

    def load_state_dict(self, state: dict[str, Any], checkpoint_path: Optional[str] = None,
                        resuming: bool = False) -> None:
        """Replace all entries with those a checkpoint names, reading back into RAM the most recently
        written ones that fit the budget (the rest stays on disk until its client takes part).

        To resume (``resuming``), the store first checks every file the checkpoint names against
        the size and checksum it recorded (:meth:`_check_files`), then takes its own copy of every
        file another run wrote (:meth:`_take_files`: a hard link in its own folder, so that the run
        that wrote them, which may still be running, can remove them without taking this store's),
        before anything is read. Otherwise the files are read where they are,
        and one that is gone (removed after ``keep_checkpoints`` newer checkpoints) is warned about;
        reading its entry fails. Stale temporary files in the checkpoint's folders are removed
        (:func:`remove_stale_temporaries`).

        Args:
            state: a :meth:`state_dict`.
            checkpoint_path: the checkpoint's file: its folders are looked for beside it when they
                are no longer where they were written (:func:`locate_folder`).
            resuming: the store's run goes on from the checkpoint (owns and checks its files).

        Raises:
            FileNotFoundError: a folder that holds entries of the checkpoint is missing.
            ValueError: a value read holds NaN or Inf, or (``resuming``) files the checkpoint names
                are missing or damaged (naming the first :data:`NAMED_FILES` and how many there are).
        """
        self._ram, self._ram_bytes, self._written, self._elsewhere = OrderedDict(), 0, {}, {}
        self._unsaved = set()
        self._shapes, self._sums = {}, {}
        self._changed, self._unnamed, self._retiring = {}, set(), deque()
        located: dict[str, str] = {}

        def locate(directory: str) -> str:
            if directory not in located:
                located[directory] = locate_folder(directory, checkpoint_path)
            return located[directory]

        written_in = None if state.get("directory") is None else locate(state["directory"])
        if self.directory is None:
            self.directory = written_in
        inline = "entries" not in state and "names" not in state  # earlier checkpoints' formats: entries in the file
        if inline:
            self._load_inline(state, written_in)
        else:
            self._load_manifest(read_manifest(state), written_in, locate)
        if resuming:
            self._check_files()
            self._take_files()
        self._rebuild_columns()
        if inline:
            return
        by_recency = sorted(((v, cid, n) for cid, e in self._versions.items() for n, v in e.items()), reverse=True)
        missing = 0
        for version, cid, name in by_recency:
            try:
                value = self.get(cid, name)
            except FileNotFoundError:  # removed since (keep_checkpoints): an error only if it is read
                missing += 1
                continue
            assert value is not None
            if self._ram_bytes + _nbytes(value) > self.memory_budget and self._ram:
                break
            self._put(cid, name, value)
        if missing:
            warnings.warn(f"{missing} client-state entries this checkpoint names are no longer in {self.directory} "
                          "(removed after newer checkpoints: client_state_checkpoints); reading one fails", UserWarning)
        self._ram = OrderedDict(sorted(self._ram.items(), key=lambda item: max(self._versions[item[0]].values())))

    def _load_manifest(self, manifest: Manifest, written_in: Optional[str], locate: Callable[[str], str]) -> None:
        """Take every entry a checkpoint's manifest names as on disk (in ``written_in``, or where
        ``locate`` finds another run's folder); remove the stale temporary files there (rank 0)."""
        self._versions = manifest.versions
        self._spilled = {cid: dict(v) for cid, v in self._versions.items()}
        self._shapes, self._sums = manifest.shapes, manifest.files
        own: set[str] = set()  # (the loaded checkpoint names them: kept until entries' new versions supersede them)
        for cid, entry in self._versions.items():
            for name, version in entry.items():
                written_by = manifest.elsewhere.get((cid, name))
                directory = written_in if written_by is None else locate(written_by)
                if directory is not None and directory != self.directory:
                    self._elsewhere[(cid, name)] = directory  # another run's file: read only
                else:
                    own.add(self._path(cid, name, version))
        self._on_disk |= own
        folders = set(self._elsewhere.values()) | ({self.directory} if own else set())
        gone = sorted(folder for folder in folders if not os.path.isdir(folder))
        if gone:
            raise FileNotFoundError(f"the client state folder {gone[0]} that the checkpoint names is missing (moved or "
                                    "deleted; it is also looked for at the same place relative to the checkpoint): "
                                    "put it back there")
        if _rank0():
            for folder in sorted(folders):
                remove_stale_temporaries(folder)

    def _take_files(self) -> None:
        """Make every file the store names one of its own folder: another run's files are hard-linked
        into it (copied where the folders are on different file systems), so that the run that wrote
        them can remove its own (after newer checkpoints) without taking this store's. Rank 0 links;
        the others wait.

        Raises:
            ValueError: naming the files that were removed before they were linked (by their run,
                still running).
        """
        if not self._elsewhere:
            return
        gone = []
        if _rank0():
            os.makedirs(self.directory, exist_ok=True)  # (a run's folder is made when it first writes)
        for (cid, name), folder in sorted(self._elsewhere.items()):
            target = self._path(cid, name, self._versions[cid][name])
            source = os.path.join(folder, os.path.basename(target))
            if _rank0() and not _link_or_copy(source, target):
                gone.append(source)
            self._on_disk.add(target)
        self._elsewhere = {}
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            shared = [gone]
            dist.broadcast_object_list(shared, src=0)  # (the links exist before any process reads them)
            gone = shared[0]
        if gone:
            raise ValueError(f"{len(gone)} client-state files the checkpoint names were removed while the resume "
                             f"took its own links to them ({_first_few(gone)}): the run that wrote them is still "
                             "running and removed them after its newer checkpoints (client_state_checkpoints); resume "
                             "from its latest checkpoint")

    def _check_files(self) -> None:
        """Check every file the store names against the size and checksum the checkpoint recorded
        (:func:`file_sum`); one it recorded none for (an older checkpoint) is read and checked whole
        (:meth:`_read`), and its sums are recorded from then on. With several processes each checks a
        share of the files. Raises ValueError naming the files that are missing or damaged."""
        keys = sorted((cid, name) for cid, entry in self._spilled.items() for name in entry)
        distributed = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
        rank, world = (dist.get_rank(), dist.get_world_size()) if distributed else (0, 1)
        problems: list[tuple[str, str]] = []  # (the file, what is wrong with it)
        learned: dict[Key, FileSum] = {}
        for cid, name in keys[rank::world]:
            version, recorded = self._spilled[cid][name], self._sums.get((cid, name))
            path = self._file(cid, name, version)
            try:
                found = file_sum(path)
            except FileNotFoundError:
                problems.append((path, f"the client-state file {path} is missing"))
                continue
            if found == recorded:
                continue
            try:
                self._read(cid, name, version)  # what is wrong with it, in the words of its own checks
            except ValueError as error:
                problems.append((path, str(error)))
                continue
            if recorded is None:
                learned[(cid, name)] = found
            else:
                problems.append((path, f"the client-state file {path} is not the one written ({found[0]} bytes, "
                                       f"CRC-32 {found[1]:08x}; the checkpoint recorded {recorded[0]} bytes, "
                                       f"{recorded[1]:08x})"))
        if distributed:
            gathered: list = [None] * world
            dist.all_gather_object(gathered, (problems, learned))
            problems = [problem for part, _ in gathered for problem in part]
            learned = {key: found for _, part in gathered for key, found in part.items()}
        self._sums.update(learned)
        if problems:
            raise ValueError(f"{len(problems)} of the {len(keys)} client-state files it names are missing or damaged: "
                             f"{_first_few([why for _, why in sorted(problems)], '; ')}. A file is removed once "
                             "client_state_checkpoints newer checkpoints name newer versions: resume from a later "
                             "checkpoint, or put the files back")

    def _load_inline(self, state: dict[str, Any], written_in: Optional[str]) -> None:
        """Checkpoints written before they were incremental: the RAM part inside the file (and,
        before the store was bounded, all of it), the spilled entries in ``written_in``."""
        if "memory" not in state:
            state = {"memory": state, "versions": {}, "spilled": {}}
        self._versions = {int(cid): dict(v) for cid, v in state["versions"].items()}
        self._spilled = {int(cid): dict(entry) for cid, entry in state["spilled"].items()}
        for cid, entry in state["memory"].items():
            for name, value in entry.items():
                _check_finite(int(cid), name, value)
                self._put(int(cid), name, value.cpu())
                self._versions.setdefault(int(cid), {}).setdefault(name, 0)
                self._unsaved.add((int(cid), name))  # no file yet: the next checkpoint writes it
        for cid, entry in self._spilled.items():
            for name, version in entry.items():
                if written_in is not None and written_in != self.directory:
                    self._elsewhere[(cid, name)] = written_in
                else:
                    self._on_disk.add(self._path(cid, name, version))

    def _persist(self) -> None:
        """Write the file of every entry whose current value has none yet: the entries written
        since the last checkpoint and still in RAM (rank 0; the others wait)."""
        rank0 = _rank0()
        for cid, name in sorted(self._unsaved):
            path = self._path(cid, name, self._versions[cid][name])
            if rank0:  # (a file of another run with this name is replaced)
                self._sums[(cid, name)] = _atomic_save(self._ram[cid][name], path)
            self._on_disk.add(path)
        wrote, self._unsaved = bool(self._unsaved), set()
        if wrote and dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            dist.barrier()  # the files exist before any process relies on them

    def _prune(self, retired: set[str]) -> None:
        """At a checkpoint, whose entries' new versions superseded the files ``retired`` (named by
        the checkpoint before): remove the files no checkpoint named, and those that the latest
        ``keep_checkpoints`` checkpoints and the one being written no longer name (rank 0)."""
        due, self._unnamed = self._unnamed, set()
        if self.keep_checkpoints is not None:
            self._retiring.append((self._checkpoints, retired))
            while self._retiring[0][0] + self.keep_checkpoints <= self._checkpoints:
                due |= self._retiring.popleft()[1]
        self._remove(due)

    def _remove(self, paths: set[str]) -> None:
        """Remove the files ``paths`` of this store's folder (rank 0)."""
        rank0 = _rank0()
        for path in sorted(paths):
            if rank0 and os.path.exists(path):
                os.remove(path)
            self._on_disk.discard(path)


def _check_finite(client_id: int, name: str, value: Tensor, path: Optional[str] = None) -> None:
    """Refuse a stored value holding NaN or Inf (a checkpoint's, or the file ``path``'s)."""
    if value.is_floating_point() and not bool(torch.isfinite(value).all()):
        where = "" if path is None else f" ({path})"
        raise ValueError(f"the stored entry {name!r} of client {client_id}{where} holds NaN or Inf; a checkpoint "
                         "with non-finite client state cannot be resumed")


def _first_few(items: list[str], separator: str = ", ") -> str:
    """The first :data:`NAMED_FILES` of ``items``, and how many more there are."""
    more = f"{separator}and {len(items) - NAMED_FILES} more" if len(items) > NAMED_FILES else ""
    return separator.join(items[:NAMED_FILES]) + more


def _nbytes(t: Tensor) -> int:
    return t.numel() * t.element_size()


def _rank0() -> bool:
    """Whether this is the process that writes and removes files (rank 0, or the only one)."""
    return not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0


def _writer() -> str:
    """This process, as named in its temporary files: ``host-pid``."""
    return f"{socket.gethostname()}-{os.getpid()}"


def _atomic_save(value: Tensor, path: str) -> FileSum:
    """Write ``value`` to ``path`` through a temporary file named by its writer (the folder is made here,
    when a run first writes: a run with no client state has none); the file's size and checksum."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    buffer = io.BytesIO()
    torch.save(state_file(value, path), buffer)
    content = buffer.getbuffer()
    temporary = f"{path}.{_writer()}.tmp"
    with open(temporary, "wb") as f:
        f.write(content)
    os.replace(temporary, path)
    return len(content), zlib.crc32(content)


def file_sum(path: str, chunk: int = 2**20) -> FileSum:
    """The size in bytes and the CRC-32 of the bytes of the file ``path`` (FileNotFoundError if it is gone)."""
    size, crc = 0, 0
    with open(path, "rb") as f:
        while block := f.read(chunk):
            size, crc = size + len(block), zlib.crc32(block, crc)
    return size, crc


def _link_or_copy(source: str, target: str) -> bool:
    """Give ``target`` (in a folder that exists) the contents of ``source``: a hard link to it (made
    at once, whole), or a copy where the two are on different file systems or links cannot be made
    (through a temporary file named by its writer); a file that ``target`` names already is
    replaced. False (and nothing made) if ``source`` is gone."""
    try:
        os.link(source, target)
        return True
    except FileNotFoundError:
        return False
    except FileExistsError:
        copy: Callable[[str, str], Any] = os.link
    except OSError:  # another file system, or one without hard links
        copy = shutil.copyfile
    temporary = f"{target}.{_writer()}.tmp"
    try:
        copy(source, temporary)
    except FileNotFoundError:  # (removed meanwhile)
        return False
    os.replace(temporary, target)
    return True


def state_file(value: Tensor, path: str) -> dict[str, Any]:
    """What the client-state file ``path`` holds: the entry's tensor, the file's name (the client,
    entry and version it is for) and their checksum (:func:`~fl_lightning.checkpoints.checksum`)."""
    entry = os.path.basename(path)
    return {"entry": entry, "value": value, "checksum": checksum([entry, value])}


def read_state_file(path: str) -> Tensor:
    """The tensor of the client-state file ``path`` (read with ``weights_only=True``), after checking
    that the file is whole, is a client-state file, is the one of its entry, and matches its checksum.

    Raises:
        ValueError: naming the file and what is wrong with it.
    """
    where = f"the client-state file {path}"
    try:
        content = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as error:
        raise ValueError(f"{where} holds objects that are not tensors (loading it could run code), so it is refused "
                         f"({str(error).splitlines()[0]})") from error
    except (EOFError, RuntimeError, OSError) as error:
        raise ValueError(f"{where} is truncated or damaged ({error})") from error
    if not (isinstance(content, dict) and set(content) == {"entry", "value", "checksum"}
            and isinstance(content["value"], Tensor)):
        got = sorted(content) if isinstance(content, dict) else type(content).__name__
        raise ValueError(f"{where} is not a client-state file written by fl_lightning (a dict of 'entry', 'value' "
                         f"and 'checksum'): it holds {got}")
    entry = os.path.basename(path)
    if content["entry"] != entry:
        raise ValueError(f"{where} holds the entry of file {content['entry']!r}, not of {entry!r} (renamed or copied)")
    if content["checksum"] != checksum([entry, content["value"]]):
        raise ValueError(f"{where} is damaged: its contents do not match the checksum written with it "
                         f"({content['checksum']})")
    return content["value"]


def _alive(pid: int) -> bool:
    """Whether process ``pid`` of this machine is running (or cannot be told apart from running)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True
    return True


def remove_stale_temporaries(folder: str) -> list[str]:
    """Remove the temporary files a killed write left in ``folder``: those whose writer (``host-pid``,
    named in the file) ran on this machine and is no longer running. A live process's (another run
    writing now), another machine's and an unnamed writer's are left. Returns the removed names."""
    removed = []
    for name in sorted(os.listdir(folder)) if os.path.isdir(folder) else []:
        host, _, pid = name.removesuffix(".tmp").rpartition(".pt.")[2].rpartition("-")
        if name.endswith(".tmp") and host == socket.gethostname() and pid.isdigit() and not _alive(int(pid)):
            try:
                os.remove(os.path.join(folder, name))
                removed.append(name)
            except FileNotFoundError:  # removed by another process meanwhile
                pass
    return removed


def locate_folder(directory: str, checkpoint_path: Optional[str] = None, levels: int = 4) -> str:
    """Where a checkpoint's client-state folder is now: ``directory`` (absolute; a relative one, of an
    older checkpoint, is taken from the working directory) if it exists; else, when the run's folder
    was moved together with its checkpoint, the folder with the same last path components (the
    longest such suffix) below one of the checkpoint's ``levels`` nearest parent folders; else
    ``directory`` as it was."""
    directory = os.path.abspath(directory)
    if os.path.isdir(directory) or checkpoint_path is None:
        return directory
    parts = Path(directory).parts[1:]
    for parent in list(Path(os.path.abspath(checkpoint_path)).parents)[:levels]:
        for start in range(len(parts)):
            candidate = parent.joinpath(*parts[start:])
            if candidate.is_dir():
                return str(candidate)
    return directory


def check_folder(name: str, value: Any) -> Optional[str]:
    """``value`` as an absolute folder path (None stays None); a ValueError naming ``name`` unless it is
    a path (``str`` or ``os.PathLike``) of a folder this process can write in or create (checked
    without creating anything)."""
    if value is None:
        return None
    allowed = "a folder path (str or os.PathLike) that this process can write in"
    if isinstance(value, os.PathLike):
        value = os.fspath(value)
    if not isinstance(value, str) or not value:
        raise ValueError(f"{name} must be {allowed}, got {value!r}")
    path = existing = os.path.abspath(value)
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        raise ValueError(f"{name} must be {allowed}, got {value!r}: {existing} is a file")
    try:
        with tempfile.TemporaryFile(dir=existing):
            pass
    except OSError as error:
        raise ValueError(f"{name} must be {allowed}, got {value!r}: this process cannot write in {existing} "
                         f"({error.strerror})") from None
    return path


def run_folder(trainer: Any, base: Optional[str]) -> str:
    """The run's own folder for client-state files (absolute): a folder named by the run id below
    ``base``, by default ``client_state`` in the logger's version folder or, with no logger, in
    ``default_root_dir``. The id is rank 0's start time, process and a random part, the same on
    every process: two runs never share files. Nothing is created until a file is written."""
    if base is None:
        logged = trainer.loggers and trainer.log_dir is not None
        base = os.path.join(trainer.log_dir if logged else trainer.default_root_dir, "client_state")
    run = trainer.strategy.broadcast(f"{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    return os.path.abspath(os.path.join(base, run))
