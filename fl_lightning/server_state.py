"""The server's state besides the global model, copied before a round's aggregation and put back
when the round's result is refused (:meth:`FederationEngine.round
<fl_lightning.engine.FederationEngine.round>`), so that a refused round leaves the server
exactly as it was: the federated module's own tensors (server networks, buffers such as SCAFFOLD's
control variate), the server optimizer's state (momentum, Adam's moments, step counts) and an
aggregator callback's state (``CenteredClipping``'s centre).
"""

from __future__ import annotations

import copy
from typing import Any, Iterable

import torch
from torch import Tensor, nn


def own_tensors(module: nn.Module, inner: nn.Module) -> list[tuple[str, Tensor]]:
    """``module``'s parameters and buffers, by name, but for those of its child module ``inner`` (the
    client module, whose floating tensors are the global model)."""
    tensors = [*module.named_parameters(recurse=False), *module.named_buffers(recurse=False)]
    for name, child in module.named_children():
        if child is not inner:
            tensors += [*child.named_parameters(prefix=name), *child.named_buffers(prefix=name)]
    return tensors


def copied(value: Any) -> Any:
    """A copy of ``value`` that later changes to ``value`` leave alone (a tensor is cloned, detached)."""
    return value.detach().clone() if isinstance(value, Tensor) else copy.deepcopy(value)


def copy_tensors(named: Iterable[tuple[str, Tensor]]) -> dict[str, Tensor]:
    """A copy of each of ``named`` tensors, by name."""
    return {name: t.detach().clone() for name, t in named}


def load_tensors(named: Iterable[tuple[str, Tensor]], saved: dict[str, Tensor]) -> None:
    """Write the values of :func:`copy_tensors` back into the tensors of the same names, in place
    (into the tensor a name holds now, also where the module replaced it since)."""
    current = dict(named)
    with torch.no_grad():
        for name, value in saved.items():
            current[name].copy_(value)


def copy_optimizer_state(optimizer: torch.optim.Optimizer) -> dict[Tensor, dict[str, Any]]:
    """A copy of ``optimizer``'s per-parameter state (momentum buffers, moments, step counts)."""
    return {param: {key: copied(value) for key, value in entries.items()} for param, entries in optimizer.state.items()}


def load_optimizer_state(optimizer: torch.optim.Optimizer, saved: dict[Tensor, dict[str, Any]]) -> None:
    """Make :func:`copy_optimizer_state`'s copy ``optimizer``'s state again (entries created since, such
    as a first step's momentum buffers, are dropped). The copy's tensors become the state's own."""
    optimizer.state.clear()
    optimizer.state.update(saved)
