"""Declared broadcast state: the server's tensors that the clients' hooks read.

Most algorithms' clients read nothing of the server but the round's start model. Those whose
``client_init`` / ``client_step`` / ``client_final`` read more (SCAFFOLD's control variate ``c``,
PeFLL's hypernetwork and embedding network) declare it with
:meth:`~fl_lightning.module.FederatedModule.add_broadcast`. A backend that runs clients elsewhere
(another process, a deployment node) then knows exactly what to send with the start model:
:func:`broadcast_state` there, loaded into the node's copy of the algorithm with
:func:`load_broadcast`. Server state that
only the server reads (an optimizer's moments, the defaults of client state entries, which the
server reads when it loads a client's entries) is not declared.

A declared name is an attribute of the federated module: a tensor (a buffer or a parameter) or a
submodule, whose tensors are then sent by their dotted names (its ``state_dict``'s). The module keeps
its declarations in ``_broadcast`` (engine machinery, not a name of the author's surface).
"""

from __future__ import annotations

from typing import Mapping, Sequence

import torch
from torch import Tensor, nn


def check_broadcast_name(owner: nn.Module, name: str, declared: Sequence[str]) -> None:
    """Refuse ``name`` as a broadcast declaration of ``owner`` (besides the ``declared`` ones) if it cannot be one.

    Raises:
        ValueError: ``name`` is not an identifier, is declared already, or names the client module.
    """
    if not isinstance(name, str) or not name.isidentifier():
        raise ValueError(f"add_broadcast: name must be an attribute name, got {name!r}")
    if name in declared:
        raise ValueError(f"add_broadcast: {name!r} is declared already")
    if getattr(owner, "client", None) is not None and getattr(owner, name, None) is owner.client:
        raise ValueError(f"add_broadcast: {name!r} is the client module, which every client receives as its start "
                         "model; declare the server's other tensors only")


def broadcast_state(algorithm: nn.Module) -> dict[str, Tensor]:
    """The declared broadcast state of ``algorithm`` (a ``FederatedModule``), by name: a tensor attribute
    under its name, a submodule's tensors under ``name.<its state_dict key>``: what its clients' hooks read
    of the server besides the start model. They are the live tensors (copy them before changing them).

    Raises:
        ValueError: a declared name is missing or neither a tensor nor a module.
    """
    out: dict[str, Tensor] = {}
    for name in _declared(algorithm):
        value = getattr(algorithm, name, None)
        if isinstance(value, Tensor):
            out[name] = value
        elif isinstance(value, nn.Module):
            out.update(value.state_dict(prefix=f"{name}.", keep_vars=True))
        else:
            raise ValueError(f"add_broadcast({name!r}): {type(algorithm).__name__}.{name} is "
                             f"{'missing' if value is None else type(value).__name__}; a declared broadcast is a "
                             "tensor (a buffer or a parameter) or a submodule of the federated module")
    return out


def load_broadcast(algorithm: nn.Module, values: Mapping[str, Tensor]) -> None:
    """Copy ``values`` (:func:`broadcast_state` of another copy of the algorithm, the server's) into
    ``algorithm``'s declared tensors, in place (their device and dtype are kept).

    Raises:
        ValueError: the names or shapes of ``values`` are not those of the declarations.
    """
    targets = broadcast_state(algorithm)
    if set(values) != set(targets):
        missing, unexpected = sorted(set(targets) - set(values)), sorted(set(values) - set(targets))
        raise ValueError(f"the broadcast state does not match {type(algorithm).__name__}'s declarations: missing "
                         f"{missing}, unexpected {unexpected}")
    with torch.no_grad():
        for name, target in targets.items():
            value = values[name]
            if value.shape != target.shape:
                raise ValueError(f"broadcast {name!r} has shape {tuple(value.shape)}, the declared tensor "
                                 f"{tuple(target.shape)}")
            target.copy_(value)


def _declared(algorithm: nn.Module) -> Sequence[str]:
    """The names ``algorithm`` declared with ``add_broadcast`` (none for a module that declares nothing)."""
    return getattr(algorithm, "_broadcast", ())
