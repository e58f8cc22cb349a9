"""Declared broadcast state (``FederatedModule.add_broadcast``): every algorithm's clients read no server
tensor but the declared ones, and the declared state moves from one copy of an algorithm to another."""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Callable, Iterator

import pytest
import torch
from torch import Tensor

from fl_lightning.algorithms import SCAFFOLD
from fl_lightning.broadcast import broadcast_state, load_broadcast
from fl_lightning.module import FederatedModule
from fl_lightning.server_state import own_tensors
from tests.helpers import global_vector, tiny_client, trainer
from tests.test_contract import NAMES, assert_same, build, data, outcome

HOOKS = ("client_init", "client_step", "client_final", "client_share")


def undeclared_server_tensors(module: FederatedModule) -> list[Tensor]:
    """The module's own tensors (not the client module's) that no broadcast declaration covers."""
    declared = {id(t) for t in broadcast_state(module).values()}
    return [t for _, t in own_tensors(module, module.client) if id(t) not in declared]


@contextmanager
def withheld(tensors: list[Tensor]) -> Iterator[None]:
    """``tensors`` spoilt (floating ones NaN, others changed) for the block, then put back as they were."""
    saved = [t.detach().clone() for t in tensors]
    with torch.no_grad():
        for t in tensors:
            if t.is_floating_point():
                t.fill_(float("nan"))
            elif t.dtype == torch.bool:
                t.logical_not_()
            else:
                t.add_(12345)
    try:
        yield
    finally:
        with torch.no_grad():
            for t, value in zip(tensors, saved):
                t.copy_(value)


def hide_undeclared_state(module: FederatedModule) -> None:
    """Make ``module``'s client hooks run with its undeclared server tensors spoilt."""

    def hidden(hook: Callable[..., Any]) -> Callable[..., Any]:
        def run(*args: Any) -> Any:
            with withheld(undeclared_server_tensors(module)):
                return hook(*args)
        return run

    for name in HOOKS:
        if hasattr(module, name):
            setattr(module, name, hidden(getattr(module, name)))


@pytest.mark.parametrize("name", NAMES)
def test_clients_read_no_undeclared_server_state(name):
    plain = build(name)
    trainer(2).fit(plain, data())
    hiding = build(name)
    hide_undeclared_state(hiding)
    trainer(2).fit(hiding, data())
    assert_same(outcome(plain), outcome(hiding))


class UndeclaredSCAFFOLD(SCAFFOLD):
    """SCAFFOLD whose control variate ``c`` is a plain buffer: its clients read undeclared server state."""

    def __init__(self, client: Any, **kwargs: Any) -> None:
        super().__init__(client, **kwargs)
        self._broadcast.remove("server_control")


def test_an_undeclared_read_is_caught():
    """The check above can fail: SCAFFOLD's clients read ``c``."""
    torch.manual_seed(0)
    plain = SCAFFOLD(tiny_client(hidden=(8,)), clients_per_round=3, local_steps=2)
    trainer(3).fit(plain, data())
    torch.manual_seed(0)
    hiding = UndeclaredSCAFFOLD(tiny_client(hidden=(8,)), clients_per_round=3, local_steps=2)
    hide_undeclared_state(hiding)
    with pytest.warns(RuntimeWarning, match="NaN or Inf"):
        trainer(3).fit(hiding, data())
    assert not torch.equal(global_vector(plain), global_vector(hiding))


def test_broadcast_state_moves_between_copies():
    """What a deployment node does: load the server's broadcast state into its own copy of the algorithm."""
    server, node = SCAFFOLD(tiny_client()), SCAFFOLD(tiny_client())
    server.server_control.normal_()
    sent = {name: t.clone() for name, t in broadcast_state(server).items()}
    assert list(sent) == ["server_control"]
    load_broadcast(node, sent)
    assert torch.equal(node.server_control, server.server_control)


def test_a_submodule_is_sent_by_its_tensors():
    module = FederatedModule(tiny_client())
    module.add_broadcast("table", torch.nn.Embedding(3, 2))
    assert sorted(broadcast_state(module)) == ["table.weight"]


@pytest.mark.parametrize("name, value, message", [
    ("client", None, "is the client module"),
    ("not a name", None, "must be an attribute name"),
    ("h", torch.zeros(2), "declared already"),
])
def test_bad_declarations_are_refused(name, value, message):
    module = FederatedModule(tiny_client())
    if message == "declared already":
        module.add_broadcast("h", torch.zeros(2))
    with pytest.raises(ValueError, match=message):
        module.add_broadcast(name, value)


def test_a_declaration_that_names_nothing_is_refused_at_setup():
    module = FederatedModule(tiny_client())
    module.add_broadcast("missing")
    with pytest.raises(ValueError, match=r"add_broadcast\('missing'\): FederatedModule.missing is missing"):
        trainer(1).fit(module, data())


def test_loading_other_names_or_shapes_is_refused():
    module = SCAFFOLD(tiny_client())
    with pytest.raises(ValueError, match=r"missing \['server_control'\], unexpected \['c'\]"):
        load_broadcast(module, {"c": torch.zeros(1)})
    with pytest.raises(ValueError, match="has shape"):
        load_broadcast(module, {"server_control": torch.zeros(1)})
