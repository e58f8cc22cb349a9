"""The client's ``training_step`` tried once at the setup of a fit as the batched backend runs it, so
that what the backend cannot run is refused before the first round, with the reason and the way out."""

from __future__ import annotations

from contextlib import nullcontext
from typing import Any, Optional

from torch import Tensor
from torch.func import vmap

from fl_lightning.backends.batched.metrics import MetricCalls, MetricMisuse
from fl_lightning.backends.batched.python_state import PythonState
from fl_lightning.backends.context import ClientContext
from fl_lightning.backends.stateless import training_loss
from fl_lightning.backends.trial import largest_client, trial_setting
from fl_lightning.lightning_compat import tree_flatten, tree_unflatten

#: why a step cannot be vectorized, where ``vmap`` refuses it
NOT_VECTORIZABLE = ("reads a tensor's value in Python (.item(), float(), bool(), an if on a tensor) or calls an "
                    "operation torch.func.vmap does not support; use client_backend='sequential' (torch's message "
                    "follows)")


def with_client_dimension(batch: Any) -> Any:
    """``batch`` as a block of one client's batches: every tensor with a leading dimension of 1."""
    leaves, spec = tree_flatten(batch)
    return tree_unflatten([x.unsqueeze(0) if isinstance(x, Tensor) else x for x in leaves], spec)


def trial_vectorized_step(context: ClientContext, recording: Optional[MetricCalls]) -> None:
    """Run the client's ``training_step`` once as a block's step runs it: under ``vmap`` (a block of
    one client, on the largest training client's first batch), its metric objects recorded by
    ``recording`` (:mod:`~fl_lightning.backends.batched.metrics`), in the setup's trial
    (:func:`~fl_lightning.backends.trial.trial_setting`: it leaves no trace in the run).

    Raises:
        ValueError: the step changes the client module's Python state (:class:`~fl_lightning.backends.
            batched.python_state.PythonState`, which names the attributes), uses a metric object otherwise
            than the backend records (:class:`~fl_lightning.backends.batched.metrics.MetricMisuse`), or
            cannot run under ``vmap`` (:data:`NOT_VECTORIZABLE`); each says the way out.
    """
    data = context.algorithm.engine.datamodule
    client_id = largest_client(data)
    if client_id is None:
        return
    split = data.client_data(client_id, "train")

    def loss(tensors: list[Tensor], batch: Any) -> Tensor:
        if recording is not None:
            recording.begin()
        try:
            return training_loss(context.stateless.training_step(tensors, batch, 0), check_grad=False)
        finally:
            if recording is not None:
                recording.end()

    with trial_setting(context) as tensors:
        batch = with_client_dimension(context.gather(split.indices[:split.step_batch_size]))
        guard = PythonState(context.client)
        try:
            with recording.installed() if recording is not None else nullcontext():
                vmap(loss, randomness="different")([t.unsqueeze(0) for t in tensors], batch)
        except MetricMisuse as error:
            raise ValueError(f"the client's training_step cannot run in the batched backend: {error}") from error
        except RuntimeError as error:
            if "vmap" not in str(error):
                raise
            guard.check()  # a counter, a list appended to: the clearer reason, where it is one
            raise ValueError(f"the client module {type(context.client).__name__}'s training_step cannot be "
                             f"vectorized over clients: it {NOT_VECTORIZABLE}") from error
        guard.check()
