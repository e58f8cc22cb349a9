"""The client's steps tried once at setup on a real batch, leaving no trace.

Before the first round the engine runs the client module's ``training_step`` on the first samples
of the largest training client: the module checks that the client takes the data
(:func:`fl_lightning.data_check.check_client_takes_data`), counts the arithmetic of a step
(:func:`step_flops`, which chooses the CPU's threads: :mod:`fl_lightning.cpu_threads`), and the batched
backend tries its vectorized step (:mod:`~fl_lightning.backends.batched.step_trial`) and measures the
activations of a step (:func:`~fl_lightning.backends.batched.sizing.activation_bytes`). All run in
:func:`trial_setting`: at copies of the global model's tensors on the device, under the precision
plugin's forward context, with the global RNG forked, the client's ``self.log`` calls dropped, and
its ``Metric`` states and Python attributes put back on exit, so that the run is, bit for bit, what
it would be without the trial.
"""

from __future__ import annotations

import copy
from contextlib import ExitStack, contextmanager
from typing import TYPE_CHECKING, Any, Iterator, Optional

import torch
from torch import Tensor, nn
from torch.utils.flop_counter import FlopCounterMode
from torchmetrics import Metric

from fl_lightning.backends.stateless import training_loss
from fl_lightning.lightning_compat import metric_snapshot, restore_metric, routed_log

if TYPE_CHECKING:
    from fl_lightning.backends.context import ClientContext
    from fl_lightning.datamodules.base import FederatedDataModule


def largest_client(data: "FederatedDataModule") -> Optional[int]:
    """The training client with the most training samples (the first of them), whose first samples
    the trial takes; None where there is no training client."""
    return max(data.train_clients, key=data.num_samples) if data.train_clients else None


@contextmanager
def client_state_kept(client: nn.Module) -> Iterator[None]:
    """Put the Python state of ``client`` and its submodules back as it was on exit: every attribute
    (rebound or added), the contents of those that are lists, dicts or sets, and every torchmetrics
    ``Metric``'s accumulated state (tensors that are not a ``Metric``'s state and are written in
    place are not copied: a module's tensors are its parameters and buffers, which a trial takes copies of)."""
    metrics = [(m, metric_snapshot(m)) for m in client.modules() if isinstance(m, Metric)]
    attributes = [(vars(m), dict(vars(m))) for m in client.modules()]
    contents = [(value, copy.copy(value)) for _, kept in attributes for value in kept.values()
                if isinstance(value, (list, dict, set))]
    try:
        yield
    finally:
        for value, kept_value in contents:
            if isinstance(value, list):
                value[:] = kept_value
            else:
                value.clear()
                value.update(kept_value)
        for now, kept in attributes:
            now.clear()
            now.update(kept)
        for metric, snapshot in metrics:
            restore_metric(metric, snapshot)


def _drop_log(*args: Any, **kwargs: Any) -> None:
    """Stands in for the client's ``self.log`` in a trial."""


@contextmanager
def trial_setting(context: "ClientContext") -> Iterator[list[Tensor]]:
    """The setting of a trial of the client's steps; yields copies of the global model's tensors on
    the engine's device, in layout order, the parameters requiring grad (at setup the module's
    tensors are still on the host while its device, and the batch, is the accelerator)."""
    model = context.global_model
    tensors = [t.detach().to(context.device, copy=True).requires_grad_(i < model.layout.num_param_tensors)
               for i, t in enumerate(model.tensors)]
    devices = [context.device] if context.device.type == "cuda" else []
    with ExitStack() as stack:
        stack.enter_context(client_state_kept(context.client))
        stack.enter_context(torch.random.fork_rng(devices=devices))
        stack.enter_context(routed_log(context.client, _drop_log))
        stack.enter_context(context.forward_context())
        yield tensors


def step_flops(context: "ClientContext") -> int:
    """The floating-point operations of the forward of one local step of one client (its
    ``training_step`` on a batch of the largest training client's first samples, in the trial's
    setting), as ``torch.utils.flop_counter`` counts them (matrix products and convolutions); 0 where
    there is no training client."""
    data = context.engine.datamodule
    client_id = largest_client(data)
    if client_id is None:
        return 0
    split = data.client_data(client_id, "train")
    with trial_setting(context) as tensors:
        batch = context.gather(split.indices[:split.step_batch_size])
        with FlopCounterMode(display=False) as counter:
            training_loss(context.stateless.training_step(tensors, batch, 0))
    return counter.get_total_flops()
