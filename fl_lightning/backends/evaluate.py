"""Clients evaluated by the client module's own ``validation_step`` / ``test_step``, one client after
another: each client's ``self.log`` calls collected into its :class:`~fl_lightning.update.ClientResult`.

The client module's hook runs on each batch of the client's split (``eval_batch_size`` samples,
in index order), with the client's model (its ``client_eval_state`` or the global model), in
eval mode, without gradients, under the precision plugin's forward context. Its ``self.log``
calls are routed to a :class:`ClientLogs` and reduced over the client's batches as Lightning
reduces them over an epoch:

* a scalar: its batch-size-weighted mean (the call's ``batch_size=``, else the size Lightning
  infers from the batch), or the sum, maximum or minimum its ``reduce_fx`` asks for;
* a torchmetrics ``Metric``: reset before the client, updated by the module's own code, and
  ``compute()``-d after the client's last batch, on this process's states only.

Only the per-batch hook is called: epoch-level hooks (``on_validation_epoch_end``) are not, so a
figure the module computes only there is not a per-client one. The client module is left as it
was: its model, its mode, and every ``Metric`` it holds (the module's own
``on_validation_epoch_end``, which runs after the callbacks', may compute them). Python state that the hook itself
changes (outputs appended to a list on ``self``) is the module's affair.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Callable, Iterator, Optional, Sequence

import torch
from torch import Tensor
from torchmetrics import Metric

from fl_lightning.backends.context import ClientContext
from fl_lightning.datamodules.client_data import SPLITS, ClientData, to_device
from fl_lightning.lightning_compat import metric_snapshot, restore_metric, routed_log, unsync_metric
from fl_lightning.lightning_package import extract_batch_size, overrides_hook, pl
from fl_lightning.local_logging import call_options
from fl_lightning.update import ClientResult

#: the hooks a client evaluation takes
HOOKS: tuple[str, ...] = ("validation_step", "test_step")
#: the model a client is evaluated with: its state vector, or None for the global model
StateOf = Callable[[int], Optional[Tensor]]

#: Lightning's ``reduce_fx`` values, by the reduction over a client's batches they name
_REDUCTIONS: dict[Any, str] = {"mean": "mean", "avg": "mean", torch.mean: "mean", "sum": "sum", torch.sum: "sum",
                               "max": "max", torch.max: "max", "min": "min", torch.min: "min"}


class Reduction:
    """One logged name's values over a client's batches, reduced as Lightning reduces them over an
    epoch (``"mean"``: weighted by batch size; ``"sum"``, ``"max"``, ``"min"``), in float64."""

    def __init__(self, reduce: str) -> None:
        self.reduce = reduce
        self.total: Optional[Tensor] = None
        self.weight = 0

    def add(self, value: Tensor, size: int) -> None:
        value = value.double() * size if self.reduce == "mean" else value.double()
        self.weight += size
        if self.total is None:
            self.total = value
        elif self.reduce in ("mean", "sum"):
            self.total = self.total + value
        else:
            self.total = torch.maximum(self.total, value) if self.reduce == "max" else torch.minimum(self.total, value)

    def result(self) -> float:
        assert self.total is not None, "no value was added"
        return float(self.total / self.weight) if self.reduce == "mean" else float(self.total)


def logged_scalar(hook: str, name: str, value: Any, args: tuple, kwargs: dict[str, Any], batch: Any
                  ) -> tuple[Tensor, int, str]:
    """A ``self.log(name, value, *args, **kwargs)`` call of a scalar in ``hook`` on ``batch``: the
    value (detached, 0-dim), its batch size and the reduction its ``reduce_fx`` names."""
    options = call_options(args, kwargs)
    reduce_fx = options.get("reduce_fx", "mean")
    reduce = _REDUCTIONS.get(reduce_fx) if isinstance(reduce_fx, str) or callable(reduce_fx) else None
    if reduce is None:
        raise ValueError(f"the client's {hook} logs {name!r} with reduce_fx={reduce_fx!r}; a client evaluation "
                         "reduces a client's batches with 'mean', 'sum', 'max' or 'min'")
    value = torch.as_tensor(value)
    if value.numel() != 1:
        raise ValueError(f"the client's {hook} logs {name!r} as a value of shape {tuple(value.shape)}: a logged "
                         "value must be a scalar (one element)")
    size = options.get("batch_size") or extract_batch_size(batch)
    return value.detach().reshape(()), int(size), reduce


class ClientLogs:
    """One client's ``self.log`` calls in its evaluation, reduced over its batches.

    Args:
        hook: the hook evaluated (for error messages).
    """

    def __init__(self, hook: str) -> None:
        self.hook = hook
        #: the batch of the current call, for the batch size of calls that give none
        self.batch: Any = None
        self.values: dict[str, Reduction] = {}
        self.metrics: dict[str, Metric] = {}

    def log(self, name: str, value: Any, *args: Any, **kwargs: Any) -> None:
        """Stands in for the client's ``self.log``: a ``Metric`` is kept (computed at the end), a
        scalar added to its name's reduction."""
        if isinstance(value, Metric):
            self.metrics[name] = value
            return
        self.add(name, *logged_scalar(self.hook, name, value, args, kwargs, self.batch))

    def add(self, name: str, value: Tensor, size: int, reduce: str) -> None:
        """Add a batch's ``value`` of ``name`` (over ``size`` samples) to its ``reduce`` reduction."""
        self.values.setdefault(name, Reduction(reduce)).add(value, size)

    def result(self, client_id: int, num_samples: int) -> ClientResult:
        """The client's figures: each scalar's reduction, each ``Metric``'s ``compute()``."""
        metrics = {name: r.result() for name, r in self.values.items()}
        directions = {}
        for name, metric in self.metrics.items():
            value = torch.as_tensor(metric.compute())
            if value.numel() != 1:
                raise ValueError(f"the client's {self.hook} logs {name!r} as a Metric whose compute() has shape "
                                 f"{tuple(value.shape)}: a logged value must be a scalar (one element)")
            metrics[name] = float(value)
            if metric.higher_is_better is not None:
                directions[name] = bool(metric.higher_is_better)
        return ClientResult(client_id, num_samples, metrics, directions)


def check_evaluation(client: pl.LightningModule, split: str, hook: str) -> None:
    """Refuse a ``split`` or ``hook`` a client evaluation does not take, or a hook the client lacks."""
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    if hook not in HOOKS:
        raise ValueError(f"hook must be one of {HOOKS}, got {hook!r}")
    if not overrides_hook(client, hook):
        raise ValueError(f"hook={hook!r}: the client module {type(client).__name__} does not implement {hook}")


def evaluated_splits(context: ClientContext, client_ids: Sequence[int], split: str) -> list[tuple[int, ClientData]]:
    """Each client's ``split``, in ``client_ids`` order, the empty ones left out."""
    datamodule = context.engine.datamodule
    splits = [(cid, datamodule.client_data(cid, split)) for cid in client_ids]
    return [(cid, data) for cid, data in splits if len(data) > 0]


@contextmanager
def evaluation_setting(context: ClientContext) -> Iterator[tuple[Tensor, list[Metric]]]:
    """The setting of clients' evaluation: the client module in eval mode, no gradients, its
    ``Metric`` objects set aside and computing on this process's states only; yields the global
    model's state and those ``Metric`` objects. On exit the module's model, mode and ``Metric``
    objects are as they were."""
    client = context.client
    metrics = [m for m in client.modules() if isinstance(m, Metric)]
    snapshots = [metric_snapshot(m) for m in metrics]
    saved = context.global_model.flatten()
    was_training = client.training
    try:
        for metric in metrics:
            unsync_metric(metric)
        client.eval()
        with torch.no_grad():
            yield saved, metrics
    finally:
        client.train(was_training)
        context.global_model.load(saved)
        for metric, snapshot in zip(metrics, snapshots):
            restore_metric(metric, snapshot)


def evaluate_in_module(context: ClientContext, client_ids: Sequence[int], state_of: StateOf, split: str,
                       hook: str) -> list[ClientResult]:
    """``client_ids``' evaluation (in that order, empty splits left out), one client after another in
    the client module: each client's model (``state_of(client)``, None: the global model) loaded
    into it, its ``Metric`` objects reset, ``hook`` run on each batch of its ``split``."""
    client, device = context.client, context.device
    batch_size = context.engine.datamodule.eval_batch_size
    results = []
    with evaluation_setting(context) as (global_state, metrics):
        loaded: Optional[Tensor] = None  # the state in the module, if not the global model
        for cid, data in evaluated_splits(context, client_ids, split):
            state = state_of(cid)
            if state is not None or loaded is not None:
                context.global_model.load(global_state if state is None else state.to(device))
                loaded = state
            for metric in metrics:
                metric.reset()
            logs = ClientLogs(hook)
            step = getattr(client, hook)
            with routed_log(client, logs.log):
                for index, batch in enumerate(data.epoch_batches(1, batch_size=batch_size)):
                    logs.batch = to_device(batch, device)
                    with context.forward_context():
                        step(logs.batch, index)
            results.append(logs.result(cid, len(data)))
    return results
