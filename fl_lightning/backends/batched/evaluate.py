"""Clients evaluated a block at a time: the client module's ``validation_step`` / ``test_step``
under ``torch.func.vmap`` over the block's stacked models.

A block of ``clients_per_block`` clients (those with a non-empty split) is evaluated together:
their models (``client_eval_state`` or the global model) are stacked along a new client
dimension, and batch ``k`` of every client that has one runs in one vectorized call per batch
shape (clients' splits differ in size, so their last batches do). The hook's ``self.log`` calls
are collected as tensors inside ``vmap`` and reduced over each client's batches as in the
sequential evaluation (:mod:`fl_lightning.backends.evaluate`), whose results these equal to
float tolerance.

Where ``vmap`` cannot evaluate the hook, :func:`evaluate_vectorized` raises
:class:`NotVectorizable` with the reason, and the backend evaluates one client after another: a
torchmetrics ``Metric`` logged (it accumulates state across calls), Python state of the client
module changed by the hook, a tensor's value read in Python (``.item()``, an ``if`` on a tensor).
"""

from __future__ import annotations

from typing import Any, Sequence

import torch
from torch import Tensor
from torch.func import vmap
from torchmetrics import Metric

from fl_lightning.backends.batched.batches import index_groups
from fl_lightning.backends.batched.python_state import PythonState
from fl_lightning.backends.context import ClientContext
from fl_lightning.backends.evaluate import ClientLogs, StateOf, evaluated_splits, evaluation_setting, logged_scalar
from fl_lightning.datamodules.client_data import ClientData
from fl_lightning.lightning_compat import routed_log
from fl_lightning.update import ClientResult
from fl_lightning.vectors import Layout


class NotVectorizable(Exception):
    """The client module's evaluation hook cannot run under ``vmap``; the message says why."""


def evaluate_vectorized(context: ClientContext, client_ids: Sequence[int], state_of: StateOf, split: str,
                        hook: str, clients_per_block: int) -> list[ClientResult]:
    """``client_ids``' evaluation (in that order, empty splits left out) in blocks of
    ``clients_per_block`` clients, each block's batches vectorized over its clients' models
    ``state_of(client)`` (None: the global model). Raises :class:`NotVectorizable` where the hook
    cannot be vectorized (the client module is then left as it was)."""
    splits = evaluated_splits(context, client_ids, split)
    results: list[ClientResult] = []
    with evaluation_setting(context) as (global_state, _):
        for start in range(0, len(splits), clients_per_block):
            block = splits[start : start + clients_per_block]
            states = [state_of(cid) for cid, _ in block]
            models = [global_state if s is None else s.to(global_state.device) for s in states]
            results += _evaluate_block(context, block, torch.stack(models), hook)
    return results


def _evaluate_block(context: ClientContext, block: list[tuple[int, ClientData]], models: Tensor, hook: str
                    ) -> list[ClientResult]:
    """The evaluation of a block's clients at their stacked state vectors ``models`` ``[clients, dim]``."""
    model = context.global_model
    stacked = [part.to(t.dtype) for part, t in zip(_split_stacked(model.layout, models), model.tensors)]
    batch_size = context.engine.datamodule.eval_batch_size
    chunks = [list(data.epoch_indices(1, batch_size=batch_size)) for _, data in block]
    logs = [ClientLogs(hook) for _ in block]
    guard = PythonState(context.client)  # the client module's Python state, which a vectorized hook must not change
    for k in range(max(len(c) for c in chunks)):
        for group in index_groups([{"batches": c} for c in chunks], k):
            if len(group.members) == len(block):
                tensors = stacked
            else:
                index = torch.tensor(group.members, device=models.device)
                tensors = [t.index_select(0, index) for t in stacked]
            batch = context.gather(group.indices["batches"])
            for name, (values, size, reduce) in _call(context, guard, tensors, batch, k, hook).items():
                for j, i in enumerate(group.members):
                    logs[i].add(name, values[j], size, reduce)
    return [client_logs.result(cid, len(data)) for client_logs, (cid, data) in zip(logs, block)]


def _split_stacked(layout: Layout, models: Tensor) -> list[Tensor]:
    """Stacked state vectors ``[clients, dim]`` as ``layout``'s tensors, each ``[clients, *shape]``."""
    return [part.reshape(len(models), *shape) for part, shape in zip(models.split(layout.numels, dim=1), layout.shapes)]


def _call(context: ClientContext, guard: PythonState, tensors: list[Tensor], batch: Any, index: int, hook: str
          ) -> dict[str, tuple[Tensor, int, str]]:
    """One ``vmap`` of ``hook`` over the stacked models ``tensors`` and the stacked batches ``batch``:
    each logged name's values ``[clients]``, batch size and reduction. Raises :class:`NotVectorizable`
    where the call changed the client module's Python state (``guard``) or ``vmap`` cannot run it."""
    side: dict[str, tuple[int, str]] = {}

    def one_client(tensors: list[Tensor], batch: Any) -> dict[str, Tensor]:
        values: dict[str, Tensor] = {}

        def log(name: str, value: Any, *args: Any, **kwargs: Any) -> None:
            if isinstance(value, Metric):
                raise NotVectorizable(f"the client's {hook} logs {name!r} as a torchmetrics Metric, which accumulates "
                                      "state over calls")
            values[name], size, reduce = logged_scalar(hook, name, value, args, kwargs, batch)
            side[name] = (size, reduce)

        with routed_log(context.client, log):
            context.stateless.step(hook, tensors, batch, index)
        return values

    try:
        with context.forward_context():
            values = vmap(one_client, randomness="different")(tensors, batch)
    except NotVectorizable:
        raise
    except Exception as error:
        if guard.changed():
            raise NotVectorizable(_changed_state(hook, guard.changed())) from error
        if not isinstance(error, RuntimeError) or "vmap" not in str(error):
            raise
        first_line = str(error).strip().splitlines()[0]
        raise NotVectorizable(f"torch.func.vmap cannot run the client's {hook} ({first_line})") from error
    changed = guard.changed()
    if changed:
        raise NotVectorizable(_changed_state(hook, changed))
    return {name: (values[name], *side[name]) for name in values}


def _changed_state(hook: str, changed: list[str]) -> str:
    """The reason a hook that changes the client module's Python state (``changed``) is not vectorized."""
    return (f"the client's {hook} changes Python state of the client module ({', '.join(changed)}), which under "
            "vmap changes once per block, not once per client")
