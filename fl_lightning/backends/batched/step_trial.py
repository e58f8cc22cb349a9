"""The client's ``training_step``, and the algorithm's own first step of a client's round, tried once at
the setup of a fit as the batched backend runs them, so that what the backend cannot run is refused
before the first round, with the reason and the way out: the algorithm declares nothing of it."""

from __future__ import annotations

from contextlib import contextmanager, nullcontext
from typing import Any, Callable, Iterator, Optional

import torch
from torch import Tensor
from torch.func import vmap

from fl_lightning.backends.batched.metrics import MetricCalls, MetricMisuse
from fl_lightning.backends.batched.python_state import PythonState
from fl_lightning.backends.context import ClientContext
from fl_lightning.backends.stateless import training_loss
from fl_lightning.backends.trial import client_state_kept, largest_client, trial_setting
from fl_lightning.lightning_compat import tree_flatten, tree_unflatten
from fl_lightning.local_logging import LocalLogBuffer

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
    data = context.engine.datamodule
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


def trial_algorithm_step(context: ClientContext, start_runs: Callable[[list[int]], list[Any]],
                         first_step: Callable[[list[Any]], None]) -> None:
    """The algorithm's own ``client_init`` and first ``client_step`` tried once at setup as the batched
    backend runs them: ``start_runs(clients)`` (the runs of the two largest training clients after their
    ``client_init``), then ``first_step(runs)`` (their block's first step, vectorized), in a setting that
    leaves no trace (:func:`algorithm_trial`). The backend finds out itself what it cannot run, which the
    algorithm need not declare: a torch optimizer of its own, clients with different Python values in
    their runs (ByrdSAGA's minibatch index), a step that reads a client's own field (PDSGD's
    ``run.data.num_samples``) or a tensor's value in Python.

    Raises:
        ValueError: the backend's refusal, with the reason and the way out. Where ``client_init`` fails at
            setup otherwise, or the step fails in the client's own, eager run too, nothing is refused here:
            the first round raises the hook's own error.
    """
    data = context.engine.datamodule
    clients = sorted(data.train_clients, key=data.num_samples, reverse=True)[:2]
    name = type(context.algorithm).__name__
    tried = f"{name}'s first step of a round, tried at setup as the batched backend runs it"
    with algorithm_trial(context):
        try:
            runs = start_runs(clients)
        except ValueError as error:
            raise ValueError(f"{tried}: {error}") from error
        except Exception:  # noqa: BLE001 (not the backend's to judge: the round raises it)
            return
        if not runs:
            return
        try:
            first_step(runs)
        except ValueError as error:
            raise ValueError(f"{tried}: {error}") from error
        except Exception as error:  # noqa: BLE001
            if not steps_eagerly(context, start_runs, clients[0]):
                return
            raise ValueError(f"{name}.client_step cannot be vectorized over clients ({type(error).__name__}: "
                             f"{error}): a block's step has no client id or sample count (run.client_id, "
                             "run.data.num_samples are None there) and reads tensors only; use "
                             "client_backend='sequential'") from error


def steps_eagerly(context: ClientContext, start_runs: Callable[[list[int]], list[Any]], client_id: int) -> bool:
    """Whether the algorithm's ``client_step`` runs on the first batch of ``client_id``'s run, one client on
    its own."""
    try:
        run, = start_runs([client_id])
        batch, extras = next(iter(context.step_batches(run)))
        run.data.extra = extras
        with context.local_work(client_id, "trial"), torch.no_grad():
            context.algorithm.client_step(run, batch)
    except Exception:  # noqa: BLE001
        return False
    return True


@contextmanager
def algorithm_trial(context: ClientContext) -> Iterator[None]:
    """The setting of :func:`trial_algorithm_step`: the global RNG forked, the algorithm's Python state
    (its client module's included) put back on exit, the client's logs taken by a buffer of their own, and
    the round's start model the global model where no round has started (a state entry's default)."""
    algorithm, logs = context.algorithm, context.logs
    engine = algorithm.engine
    round_start = engine.round_start
    devices = [context.device] if context.device.type == "cuda" else []
    with client_state_kept(algorithm), torch.random.fork_rng(devices=devices):
        if round_start is None:
            engine.round_start = context.global_model.flatten().to(context.device)
        context.logs = LocalLogBuffer()
        try:
            yield
        finally:
            context.logs, engine.round_start = logs, round_start
