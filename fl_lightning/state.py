"""The client state store: per-client tensors that persist across rounds.

SCAFFOLD's control variates and FedDeper's personal models live here. An algorithm declares
each entry with its default (:meth:`FederatedModule.add_client_state
<fl_lightning.module.FederatedModule.add_client_state>`); entries are created lazily (a client
that never ran has none and starts from the default), kept in CPU memory off the accelerator,
moved to the device only for the clients in flight, written only for updates the round keeps,
saved in checkpoints, and kept identical on every process by ``sync`` at the end of each round.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterator, Optional, Union

import torch
import torch.distributed as dist
from torch import Tensor

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
    """A mapping ``client_id -> {name: tensor}`` held on the CPU."""

    def __init__(self) -> None:
        self._data: dict[int, dict[str, Tensor]] = {}
        self._dirty: set[int] = set()

    def get(self, client_id: int, name: str, device: Union[str, torch.device, None] = None) -> Optional[Tensor]:
        """The stored tensor (moved to ``device``), or None if the client has no such entry."""
        value = self._data.get(client_id, {}).get(name)
        if value is None:
            return None
        return value.to(device) if device is not None else value

    def set(self, client_id: int, name: str, value: Tensor) -> None:
        """Store a CPU copy of ``value`` for ``client_id``."""
        self._data.setdefault(int(client_id), {})[name] = value.detach().to("cpu", copy=True)
        self._dirty.add(int(client_id))

    def __contains__(self, client_id: int) -> bool:
        return client_id in self._data

    def __len__(self) -> int:
        return len(self._data)

    def clients(self) -> Iterator[int]:
        """Ids of the clients with stored state."""
        return iter(sorted(self._data))

    def nbytes(self) -> int:
        """Bytes held by all stored tensors."""
        return sum(t.numel() * t.element_size() for entry in self._data.values() for t in entry.values())

    def sync(self) -> None:
        """Make every process hold the entries any process wrote since the last sync.

        Each client runs on exactly one process per round, so the written entries never
        conflict. A no-op without an initialized process group.
        """
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            written = {cid: self._data[cid] for cid in self._dirty}
            gathered: list = [None] * dist.get_world_size()
            dist.all_gather_object(gathered, written)
            for part in gathered:
                for cid, entry in part.items():
                    self._data[cid] = {k: v.cpu() for k, v in entry.items()}
        self._dirty.clear()

    def state_dict(self) -> dict[int, dict[str, Tensor]]:
        """All entries, for a checkpoint."""
        return {cid: dict(entry) for cid, entry in self._data.items()}

    def load_state_dict(self, state: dict[int, dict[str, Tensor]]) -> None:
        """Replace all entries with those of a checkpoint."""
        self._data = {int(cid): {k: v.cpu() for k, v in entry.items()} for cid, entry in state.items()}
        self._dirty.clear()
