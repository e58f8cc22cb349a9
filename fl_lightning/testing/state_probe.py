"""The watch on an algorithm's module for per-client state kept outside its declared entries.

:class:`StateProbe` compares the algorithm's state on the module before and after each call of the client
protocol's hooks, and measures it at every round's end; :func:`frozen` copies that state so that later
changes leave the copy alone, and :func:`describe_change` says in words what changed.
"""

from __future__ import annotations

import collections
import copy
import functools
import math
from typing import Any, Callable, Mapping, Optional, Sequence

import torch
from torch import Tensor, nn

from fl_lightning.callbacks import FederatedCallback
from fl_lightning.lightning_package import pl
from fl_lightning.lockstep import LockstepModule
from fl_lightning.module import FederatedModule
from fl_lightning.server_state import own_tensors

#: the client protocol's hooks, during which the module must not change per client
CLIENT_HOOKS: tuple[str, ...] = ("client_init", "client_step", "client_final", "client_share")
#: the engine's classes: their attributes (and their class attributes) are the engine's, not the algorithm's
ENGINE_CLASSES = frozenset(LockstepModule.__mro__) | frozenset(FederatedModule.__mro__)
#: the frozen value of an attribute that does not exist
ABSENT = ("absent",)
#: how deep :func:`frozen` goes into containers and objects
DEPTH = 4


class StateProbe(FederatedCallback):
    """Watches a module for per-client state kept outside its declared entries: what the client protocol's
    hooks (:data:`CLIENT_HOOKS`) change on the module, and what of it grows from round to round.

    The state watched is the algorithm's, not the engine's: the module's own parameters and buffers and those
    of its submodules (not the client module's, which hold the global model and train in place), its Python
    attributes and its submodules' (those a plain ``FederatedModule`` has are the engine's and left out), and
    the lists, dicts, sets and tensors its own classes hold as class attributes. Each hook of the module is
    wrapped, on the instance, to compare that state before and after each call (so the module no longer
    pickles: the probe is for a run in this process).

    Args:
        module: the module to watch, before it is fitted.
    """

    def __init__(self, module: FederatedModule) -> None:
        bare = FederatedModule(copy.deepcopy(module.client))
        self.engine_names = set(vars(bare)) | {name for klass in ENGINE_CLASSES for name in dir(klass)}
        self.module_names = set(vars(nn.Module()))
        #: attribute -> the (round, client, hook, what changed) of each hook call that changed it
        self.changes: dict[str, list[tuple[int, int, str, str]]] = {}
        #: round -> attribute -> its size (entries) at the round's end
        self.sizes: dict[int, dict[str, int]] = {}
        #: the attributes other than parameters and buffers that changed from one round's end to the next's
        self.changed_between_rounds: set[str] = set()
        self._last_round: Optional[dict[str, Any]] = None
        #: the hook calls watched
        self.calls = 0
        self.module = module
        for hook in CLIENT_HOOKS:
            if callable(getattr(module, hook, None)):
                setattr(module, hook, self._watched(hook, getattr(module, hook)))

    def _watched(self, hook: str, method: Callable[..., Any]) -> Callable[..., Any]:
        """``method`` with the module's state compared before and after each call."""

        @functools.wraps(method)
        def watched(run: Any, *args: Any, **kwargs: Any) -> Any:
            before = self.state()
            result = method(run, *args, **kwargs)
            after = self.state()
            self.calls += 1
            for name in before.keys() | after.keys():
                change = describe_change(before.get(name, ABSENT), after.get(name, ABSENT))
                if change is not None:
                    self.changes.setdefault(name, []).append((run.round, run.client_id, hook, change))
            return result

        return watched

    def state(self) -> dict[str, Any]:
        """The algorithm's state on the module, by attribute, as :func:`frozen` copies: its parameters and
        buffers (:meth:`tensors`), then its other attributes."""
        module = self.module
        state = self.tensors()
        for prefix, sub in module.named_modules(prefix="self"):
            if sub is module.client or prefix.startswith("self.client."):
                continue
            for name, value in vars(sub).items():
                if name in self.module_names or (sub is module and name in self.engine_names) \
                        or isinstance(value, nn.Module):
                    continue
                state[f"{prefix}.{name}"] = frozen(value)
        for klass in type(module).__mro__:
            if klass in ENGINE_CLASSES:
                continue
            for name, value in vars(klass).items():
                if isinstance(value, (dict, list, set, collections.deque, Tensor)) and not name.startswith("__"):
                    state[f"{klass.__name__}.{name}"] = frozen(value)
        return state

    def tensors(self) -> dict[str, Any]:
        """The algorithm's parameters and buffers, those of the module and of its submodules but the client
        module's, by name (``self.<name>``), as :func:`frozen` copies: what the checkpoint holds of it."""
        return {f"self.{name}": frozen(t) for name, t in own_tensors(self.module, self.module.client)}

    def on_round_end(self, trainer: pl.Trainer, module: Any, round_idx: int,
                     aggregate: Optional[dict[str, Tensor]]) -> None:
        state = self.state()
        self.sizes[round_idx] = {name: size(value) for name, value in state.items()}
        if self._last_round is not None:
            tensors = self.tensors()
            self.changed_between_rounds |= {name for name in state.keys() - tensors.keys() if describe_change(
                self._last_round.get(name, ABSENT), state[name]) is not None}
        self._last_round = state

    def per_client_changes(self) -> dict[str, list[tuple[int, int, str, str]]]:
        """The attributes that the hooks of two or more clients of one round changed, with each change (a value
        that only one client a round sets, such as a cache of the round, is not per-client state)."""
        per_client = {}
        for name, changes in self.changes.items():
            clients_by_round: dict[int, set[int]] = {}
            for round_idx, client, _, _ in changes:
                clients_by_round.setdefault(round_idx, set()).add(client)
            if any(len(clients) > 1 for clients in clients_by_round.values()):
                per_client[name] = changes
        return per_client

    def growth(self) -> dict[str, tuple[int, int]]:
        """The attributes larger at the last round's end than at the first's: ``(first size, last size)``."""
        if len(self.sizes) < 2:
            return {}
        first, last = self.sizes[min(self.sizes)], self.sizes[max(self.sizes)]
        return {name: (first.get(name, 0), n) for name, n in last.items() if n > first.get(name, 0)}


def frozen(value: Any, depth: int = 0) -> Any:
    """A copy of ``value`` that later changes to it leave alone, for :func:`describe_change`: tensors cloned,
    dicts, lists, tuples and sets copied (:data:`DEPTH` levels deep), plain objects by their attributes;
    modules, functions and deeper values by their type only."""
    if isinstance(value, Tensor):
        return value.detach().clone()
    if isinstance(value, (bool, int, float, complex, str, bytes, type(None))):
        return value
    if depth >= DEPTH or isinstance(value, nn.Module) or callable(value):
        return ("opaque", type(value).__qualname__)
    if isinstance(value, Mapping):
        return {key: frozen(item, depth + 1) for key, item in value.items()}
    if isinstance(value, (list, tuple, collections.deque)):
        return [frozen(item, depth + 1) for item in value]
    if isinstance(value, (set, frozenset)):
        return ("set", frozenset(value))
    if hasattr(value, "__dict__"):
        return ("object", type(value).__qualname__, frozen(vars(value), depth + 1))
    return ("opaque", type(value).__qualname__)


def size(value: Any) -> int:
    """The entries of a :func:`frozen` value: a tensor's elements, a container's items and theirs."""
    if isinstance(value, Tensor):
        return value.numel()
    if isinstance(value, Mapping):
        return sum(size(item) for item in value.values()) + len(value)
    if isinstance(value, list):
        return sum(size(item) for item in value) + len(value)
    if isinstance(value, tuple) and value[:1] == ("set",):
        return len(value[1])
    if isinstance(value, tuple) and value[:1] == ("object",):
        return size(value[2])
    return 1


def same(a: Any, b: Any) -> bool:
    """Whether two :func:`frozen` values are equal (tensors by shape, dtype and values, NaN equal to NaN)."""
    if isinstance(a, Tensor) or isinstance(b, Tensor):
        if not (isinstance(a, Tensor) and isinstance(b, Tensor)) or a.shape != b.shape or a.dtype != b.dtype:
            return False
        return bool(torch.equal(a, b) or (a.is_floating_point() and torch.equal(a.isnan(), b.isnan())
                                          and torch.equal(a.nan_to_num(0.0), b.nan_to_num(0.0))))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    return type(a) is type(b) and a == b


def describe_change(before: Any, after: Any) -> Optional[str]:
    """What changed from ``before`` to ``after`` (:func:`frozen` values), in words; None if nothing did."""
    if same(before, after):
        return None
    if before is ABSENT:
        return "created"
    if after is ABSENT:
        return "deleted"
    if isinstance(before, dict) and isinstance(after, dict):
        added, removed = sorted(after.keys() - before.keys(), key=repr), sorted(before.keys() - after.keys(), key=repr)
        changed = sorted((k for k in before.keys() & after.keys() if not same(before[k], after[k])), key=repr)
        return ", ".join(f"{what} keys {few(keys)}" for what, keys in
                         (("new", added), ("removed", removed), ("changed", changed)) if keys)
    if isinstance(before, list) and isinstance(after, list) and len(before) != len(after):
        return f"length {len(before)} -> {len(after)}"
    if isinstance(before, Tensor) and isinstance(after, Tensor):
        if before.shape != after.shape:
            return f"shape {tuple(before.shape)} -> {tuple(after.shape)}"
        if before.dim() >= 1:
            rows = (before != after).reshape(before.shape[0], -1).any(dim=1).nonzero().flatten().tolist()
            return f"entries {few(rows)} changed" if before.dim() == 1 else f"rows {few(rows)} changed"
        return "value changed"
    shown = repr(after) if isinstance(after, (bool, int, float, str, type(None))) else type(after).__name__
    return f"now {shown[:60]}"


def few(items: Sequence[Any], shown: int = 6) -> str:
    """``items`` as a short list: the first ``shown`` and how many more."""
    listed = ", ".join(map(str, items[:shown]))
    return f"[{listed}{f', ... ({len(items) - shown} more)' if len(items) > shown else ''}]"
