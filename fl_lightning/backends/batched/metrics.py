"""The client module's torchmetrics objects in the batched backend's vectorized steps.

A ``Metric`` keeps its states as Python attributes that its ``update`` changes in place, and most
updates read tensor values in Python (input checks, ``argmax``, ``bincount``): neither can run once
for a whole block of clients under ``vmap``. So while a block steps, each of the client module's
metric objects (a ``Metric`` or a ``MetricCollection``, the outermost where they nest) is replaced by
a :class:`MetricRecorder`, which records what the step does with it: ``update``, a call (``forward``)
and the step's ``self.log`` of the metric or of what its call returned. The calls' tensors leave the
step as its outputs, stacked over the block's clients; after the step, :meth:`MetricCalls.replay`
makes the same calls on the real objects, client after client, each with its own rows, and the same
``self.log`` calls. The metric then holds what the sequential backend's does (every client's updates,
in another order), and logs what it logs: a logged ``Metric``'s value over the round's updates of all
clients, a logged batch value (``self.log(name, self.metric(preds, target))``) as the batch-size-weighted
mean over the clients' steps. A step's ``self.log`` of a ``Metric`` object is made once per vectorized
call, after every client's replay: what Lightning keeps of repeated calls within one batch (the
metric object, its last batch value).

Anything else a step does with a recorded metric (``compute``, reading a state, using the value its
call returned in a computation) is refused with :class:`MetricMisuse`, at setup
(:func:`~fl_lightning.backends.batched.step_trial.trial_vectorized_step`).
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Iterator, Optional, Sequence, Union

from torch import Tensor, nn
from torchmetrics import Metric, MetricCollection

from fl_lightning.backends.batched.stacking import merge_leaves, split_leaves
from fl_lightning.lightning_compat import tree_flatten, tree_unflatten

if TYPE_CHECKING:
    from fl_lightning.backends.context import ClientContext

MetricObject = Union[Metric, MetricCollection]


class MetricMisuse(AttributeError):
    """A vectorized step used a client's metric object otherwise than the batched backend records
    (``update``, a call, ``self.log`` of it or of its call's value). An ``AttributeError``, so that
    ``hasattr`` probes of the stand-in answer False."""


def way_out(target: str) -> str:
    """What a step may do with the metric object ``target``, and the way out."""
    return (f"in the batched backend a training_step may update self.{target} (self.{target}.update(...) or "
            f"self.{target}(...)) and log it or the value its call returns with self.log; compute its value in "
            "on_train_epoch_end or a validation_step, or use client_backend='sequential'")


@dataclass
class Call:
    """A recorded ``update`` or call (``kind``: ``"update"``, ``"forward"``) of the metric object
    ``target`` (its dotted name in the client module): the structure of its ``(args, kwargs)`` and
    their non-tensor leaves, whose tensors are the step's outputs."""

    kind: str
    target: str
    spec: Any
    static: dict[int, Any]
    tensors: int


@dataclass
class Logged:
    """A step's ``self.log(name, value, **options)`` of a recorded metric object (``call`` None: the
    object ``target``, or its member ``key`` where it is a ``MetricCollection``) or of the value of
    the recorded call number ``call`` (its entry ``key`` where the call returned a dict); ``batch_size``
    is the step's batch size (the logged value's weight)."""

    name: str
    target: str
    key: Optional[str]
    call: Optional[int]
    options: dict[str, Any]
    batch_size: int


class MetricValue:
    """What a recorded metric's call returns inside a vectorized step: the batch's value, known only
    once the call is replayed for each client. It can be logged with ``self.log``; anything else
    raises :class:`MetricMisuse`."""

    def __init__(self, recorder: "MetricRecorder", call: int, key: Optional[str] = None) -> None:
        self.recorder, self.call, self.key = recorder, call, key

    def _refuse(self, *args: Any, **kwargs: Any) -> Any:
        raise MetricMisuse(f"the training_step uses the value self.{self.recorder.target}(...) returns in a "
                           f"computation; {way_out(self.recorder.target)}")

    # Python's conversions and operators (torch's functions go through __torch_function__)
    __bool__ = __float__ = __int__ = __index__ = __neg__ = __pos__ = __abs__ = _refuse
    __add__ = __radd__ = __sub__ = __rsub__ = __mul__ = __rmul__ = __truediv__ = __rtruediv__ = _refuse
    __floordiv__ = __rfloordiv__ = __mod__ = __rmod__ = __pow__ = __rpow__ = __matmul__ = __rmatmul__ = _refuse
    __lt__ = __le__ = __gt__ = __ge__ = _refuse

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        value = next(a for a in tree_flatten((args, kwargs or {}))[0] if isinstance(a, MetricValue))
        return value._refuse()

    def __getattr__(self, name: str) -> Any:
        return self._refuse()


class MetricMember:
    """A member of a recorded ``MetricCollection``, as ``self.log_dict(collection)`` logs it."""

    def __init__(self, recorder: "MetricRecorder", key: str) -> None:
        self.recorder, self.key = recorder, key


class MetricRecorder(nn.Module):
    """Stands in for the client's metric object ``target`` during a vectorized step and records its
    ``update`` and calls in ``calls`` (:class:`MetricCalls`).

    Args:
        calls: the recording the calls go to.
        target: the metric object's dotted name in the client module.
        names: a ``MetricCollection``'s output names (the keys of what its call returns, the names
            ``log_dict`` logs its members under); None for a ``Metric``.
    """

    def __init__(self, calls: "MetricCalls", target: str, names: Optional[tuple[str, ...]]) -> None:
        super().__init__()
        self.calls, self.target, self.names = calls, target, names

    def update(self, *args: Any, **kwargs: Any) -> None:
        self.calls.record("update", self.target, args, kwargs)

    def forward(self, *args: Any, **kwargs: Any) -> Union[MetricValue, dict[str, MetricValue]]:
        call = self.calls.record("forward", self.target, args, kwargs)
        if self.names is None:
            return MetricValue(self, call)
        return {key: MetricValue(self, call, key) for key in self.names}

    def items(self, *args: Any, **kwargs: Any) -> list[tuple[str, MetricMember]]:
        """A ``MetricCollection``'s members by output name (``self.log_dict(collection)``)."""
        if self.names is None:
            raise MetricMisuse(f"self.{self.target} is a Metric, not a MetricCollection; {way_out(self.target)}")
        return [(key, MetricMember(self, key)) for key in self.names]

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            raise MetricMisuse(f"the training_step reads self.{self.target}.{name}; {way_out(self.target)}") from None


def is_recorded(value: Any) -> bool:
    """Whether a logged ``value`` is a recorded metric object, a member of one or a value of its call."""
    return isinstance(value, (MetricRecorder, MetricMember, MetricValue))


def output_names(metric: MetricObject) -> Optional[tuple[str, ...]]:
    """A ``MetricCollection``'s output names (its members' names with its prefix and postfix); None for a ``Metric``."""
    return tuple(metric.keys(keep_base=False)) if isinstance(metric, MetricCollection) else None


def metric_objects(client: nn.Module) -> dict[str, MetricObject]:
    """The client module's ``Metric`` and ``MetricCollection`` submodules by dotted name, the
    outermost where they nest (a collection's members go with it)."""
    found: dict[str, MetricObject] = {}
    for name, module in client.named_modules():
        if isinstance(module, (Metric, MetricCollection)) and not any(name.startswith(f"{outer}.") for outer in found):
            found[name] = module
    return found


class MetricCalls:
    """The recording of a client module's metric objects' calls in vectorized steps, and their replay.

    Args:
        client: the client module (its metric objects are found once: :func:`metric_objects`).
    """

    def __init__(self, client: nn.Module) -> None:
        self.client = client
        self.targets = metric_objects(client)
        self.recorders = {name: MetricRecorder(self, name, output_names(m)) for name, m in self.targets.items()}
        #: the calls of the loss being evaluated now, each with its tensors (None: no loss is)
        self.segment: Optional[list[tuple[Union[Call, Logged], list[Tensor]]]] = None

    @contextmanager
    def installed(self) -> Iterator[None]:
        """The recorders in place of the client's metric objects for the block (a vectorized call)."""
        places = []
        for name, recorder in self.recorders.items():
            parent_name, _, leaf = name.rpartition(".")
            parent = self.client.get_submodule(parent_name)
            places.append((parent, leaf))
            parent._modules[leaf] = recorder
        try:
            yield
        finally:
            for (parent, leaf), name in zip(places, self.recorders):
                parent._modules[leaf] = self.targets[name]

    def begin(self) -> None:
        """Start recording the calls of one loss's evaluation (a ``training_step``)."""
        self.segment = []

    def end(self) -> tuple[list[Union[Call, Logged]], list[Tensor]]:
        """Stop recording: the calls of the loss's evaluation, and their tensors, detached (to leave
        the step as its outputs, stacked over the clients)."""
        segment, self.segment = self.segment or [], None
        return [call for call, _ in segment], [t.detach() for _, tensors in segment for t in tensors]

    def record(self, kind: str, target: str, args: tuple, kwargs: dict[str, Any]) -> int:
        """Record ``target``'s ``kind`` call with ``args`` and ``kwargs``; returns its number."""
        if self.segment is None:
            raise MetricMisuse(f"self.{target} is called outside the client's training_step; {way_out(target)}")
        leaves, spec = tree_flatten((args, kwargs))
        tensors, static = split_leaves(leaves)
        self.segment.append((Call(kind, target, spec, static, len(tensors)), tensors))
        return len(self.segment) - 1

    def log(self, name: str, value: Union[MetricRecorder, MetricMember, MetricValue], options: dict[str, Any],
            batch_size: int) -> None:
        """Record the step's ``self.log(name, value, **options)`` of a recorded metric object or value
        (:func:`is_recorded`)."""
        if self.segment is None:
            raise MetricMisuse(f"{name!r} is logged outside the client's training_step")
        if isinstance(value, MetricRecorder):
            logged = Logged(name, value.target, None, None, options, batch_size)
        else:
            call = value.call if isinstance(value, MetricValue) else None
            logged = Logged(name, value.recorder.target, value.key, call, options, batch_size)
        self.segment.append((logged, []))

    def replay(self, context: "ClientContext", calls: Sequence[Union[Call, Logged]], tensors: Sequence[Tensor],
               clients: Sequence[int]) -> None:
        """Make a vectorized call's recorded ``calls`` on the real metric objects: each client's (in
        ``clients``' order, ``tensors`` stacked over them, the calls' tensors one after another) with its
        rows, its logged values through the client's ``self.log`` as that client's; then each logged
        metric object once."""
        logs = context.logs
        logging_client = logs.client_id
        try:
            for i, client_id in enumerate(clients):
                logs.client_id = client_id
                rows = iter([t[i] for t in tensors])
                values: dict[int, Any] = {}
                for number, call in enumerate(calls):
                    if isinstance(call, Call):
                        args, kwargs = tree_unflatten(merge_leaves([next(rows) for _ in range(call.tensors)],
                                                                   call.static), call.spec)
                        target = self.targets[call.target]
                        values[number] = (target.update if call.kind == "update" else target)(*args, **kwargs)
                    elif call.call is not None:
                        value = values[call.call]
                        value = value if call.key is None else value[call.key]
                        self.client.log(call.name, value, **{**call.options, "batch_size": call.batch_size})
        finally:
            logs.client_id = logging_client
        for call in calls:
            if isinstance(call, Logged) and call.call is None:
                target = self.targets[call.target]
                value = target if call.key is None else dict(target.items(keep_base=False, copy_state=False))[call.key]
                self.client.log(call.name, value, **call.options)
