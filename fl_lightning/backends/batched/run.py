"""``FunctionalRun``: a client's round as tensors, the batched backend's run."""

from __future__ import annotations

from typing import Any, Callable, Optional, Sequence

import torch
from torch import Tensor
from torch.func import grad as func_grad
from torchmetrics import Metric

from fl_lightning.backends.batched.metrics import Call, Logged, MetricCalls, is_recorded
from fl_lightning.backends.batched.stacking import split_leaves
from fl_lightning.backends.context import ClientContext
from fl_lightning.backends.stateless import training_loss
from fl_lightning.client_config import ClientConfig
from fl_lightning.lightning_compat import routed_log, tree_flatten
from fl_lightning.lightning_package import extract_batch_size
from fl_lightning.local_logging import call_options
from fl_lightning.optim.prox_sgd import FunctionalProxSGD, ProxSGD
from fl_lightning.optim.sgd_function import FunctionalSGD
from fl_lightning.run import ClientRun, LocalWork, Model, RunData


class FunctionalLocal(LocalWork):
    """The local optimization of a :class:`FunctionalRun`: the local optimizer as a function and its state.

    Args:
        function: the local optimizer as a function.
        frozen: which of the model's parameters are frozen (for an optimizer set in ``client_init`` that
            this backend runs as a function).
        opt_state: the optimizer's state (None: :meth:`~fl_lightning.optim.sgd_function.FunctionalSGD.
            initial_state`).
        **fields: the :class:`~fl_lightning.run.LocalWork` fields.
    """

    def __init__(self, function: FunctionalSGD | FunctionalProxSGD, frozen: Sequence[bool], num_steps: Optional[int],
                 epochs: Optional[int] = None, shared: Optional[Tensor] = None,
                 opt_state: Optional[list[Optional[Tensor]]] = None) -> None:
        self.function = function
        self.frozen = frozen
        self.opt_state: list[Optional[Tensor]] = (
            opt_state if opt_state is not None else function.initial_state() if isinstance(function, FunctionalSGD)
            else [])
        super().__init__(num_steps, epochs, shared)  # its optimizer None: the function

    @property
    def optimizer(self) -> Optional[torch.optim.Optimizer]:
        """An optimizer of its own that ``client_init`` set and this backend cannot run (None: the
        ``function``). One it runs as a function (:class:`~fl_lightning.optim.prox_sgd.ProxSGD`)
        becomes the ``function`` and optimizer state when it is set."""
        return self._optimizer

    @optimizer.setter
    def optimizer(self, optimizer: Optional[torch.optim.Optimizer]) -> None:
        self._optimizer = optimizer
        if isinstance(optimizer, ProxSGD):
            self.function, self.opt_state = optimizer.functional(self.frozen)  # type: ignore[assignment]
            self._optimizer = None

    @property
    def lr(self) -> float:
        return self.function.lr

    @property
    def moves(self) -> list[bool]:
        function = self.function
        if isinstance(function, FunctionalSGD):
            return [not h.frozen for h in function.groups]
        return [not frozen for frozen in function.frozen]

    def _configure_lr(self, config: ClientConfig) -> None:
        """The run's own local optimizer function at the configured rates (a block steps the runs of
        one function together: :meth:`~fl_lightning.backends.batched.BatchedBackend.run_clients`)."""
        assert isinstance(self.function, FunctionalSGD), "a run's rates are configured before client_init"
        self.function = self.function.with_rates(config.rates)


class FunctionalRun(ClientRun):
    """A client's round as tensors: the batched backend's run.

    In ``client_init`` and ``client_final`` it is one client's run, evaluated eagerly; in
    ``client_step`` and ``client_share`` (under ``vmap``) it is one client's view of the block
    (``client_id`` and ``data.num_samples`` are None there: a step must not depend on them).

    Args:
        context: the engine's services for local work.
        tensors: the trained model (parameters, then floating buffers).
        **fields: the :class:`~fl_lightning.run.ClientRun` fields (``local``: a :class:`FunctionalLocal`).
    """

    local: FunctionalLocal

    def __init__(self, context: ClientContext, tensors: list[Tensor], **fields: Any) -> None:
        super().__init__(**fields)
        self.context = context
        self.tensors = tensors
        #: ``self.log`` calls of the client during a vectorized step: name -> value * batch size
        self.logs: dict[str, Tensor] = {}
        #: their options and batch sizes (the same for every client of a vectorized step), by name
        self.log_options: dict[str, dict[str, Any]] = {}
        self.log_sizes: dict[str, int] = {}
        #: in a vectorized step, the recording of the client's metric objects (None: none, or eager work)
        self.recording: Optional[MetricCalls] = None
        #: the calls the step made of the client's metric objects, and their tensors (:mod:`~fl_lightning.
        #: backends.batched.metrics`: replayed on the real objects after the step)
        self.metric_calls: list[Call | Logged] = []
        self.metric_tensors: list[Tensor] = []
        self._active: Model = None

    @property
    def params(self) -> list[Tensor]:
        return self.tensors[: self.layout.num_param_tensors]

    def loss_and_grad(
        self,
        batch: Any,
        model: Model = None,
        loss_fn: Optional[Callable[[Any], Any]] = None,
        has_aux: bool = False,
    ) -> tuple[Any, list[Tensor]]:
        k = self.layout.num_param_tensors
        target = list(self.tensors if model is None else model)
        loss_of, _, sizes = self._loss_function(batch, loss_fn, has_aux)
        with self.context.forward_context():
            grads, carried = func_grad(loss_of, has_aux=True)(tuple(target[:k]), tuple(target[k:]))
        self._keep_logs(carried["logs"], sizes)  # the values as the transform returns them
        self.metric_tensors.extend(carried["metric_tensors"])
        loss, aux = carried["loss"], carried.get("aux")
        return ((loss, aux), list(grads)) if has_aux else (loss, list(grads))

    def training_loss(self, batch: Any) -> Tensor:
        """The trained model's loss on ``batch`` (the client module's ``training_step``), with its
        graph: the caller takes the gradient (the batched backend's plain step, outside ``vmap``) and
        checks that the loss requires it."""
        k = self.layout.num_param_tensors
        loss_of, logs, sizes = self._loss_function(batch, None, False, check_grad=False)
        with self.context.forward_context():
            loss, carried = loss_of(tuple(self.tensors[:k]), tuple(self.tensors[k:]))
        self._keep_logs(logs, sizes)
        self.metric_tensors.extend(carried["metric_tensors"])
        return loss

    def _loss_function(self, batch: Any, loss_fn: Optional[Callable[[Any], Any]], has_aux: bool,
                       check_grad: bool = True) -> tuple[Callable[..., tuple[Tensor, dict[str, Any]]], dict[str, Tensor], dict[str, int]]:
        """``loss_of(params, buffers) -> (loss, carried)`` on ``batch`` (``loss_fn``'s, or the client
        module's training loss), and the dicts it fills with the client's ``self.log`` values and
        batch sizes. ``carried`` holds the loss, the logged values and the tensors of the calls the
        loss made of the client's metric objects (:attr:`metric_calls` receives the calls), which leave
        a transform as its outputs. ``check_grad``: :func:`~fl_lightning.backends.stateless.training_loss`'s."""
        stateless = self.context.stateless
        logs: dict[str, Tensor] = {}
        sizes: dict[str, int] = {}

        def loss_of(params: tuple[Tensor, ...], buffers: tuple[Tensor, ...]) -> tuple[Tensor, dict[str, Any]]:
            tensors = [*params, *buffers]
            self._active = tensors
            if self.recording is not None:
                self.recording.begin()
            try:
                with routed_log(self.context.client, self._collector(logs, sizes, batch)):
                    if loss_fn is not None:
                        out = loss_fn(batch)
                    else:
                        out = training_loss(stateless.training_step(tensors, batch, self.local.step_index), check_grad)
            finally:
                self._active = None
                calls, metric_tensors = self.recording.end() if self.recording is not None else ([], [])
            self.metric_calls.extend(calls)
            loss, aux = out if has_aux else (out, None)
            carried = {"loss": loss.detach(), "logs": logs, "metric_tensors": metric_tensors}
            if has_aux:
                carried["aux"] = aux
            return loss, carried

        return loss_of, logs, sizes

    def _keep_logs(self, logs: dict[str, Tensor], sizes: dict[str, int]) -> None:
        """Add one loss's ``self.log`` values to the run's (a second model of the step that logs the
        same name: both count)."""
        for name, total in logs.items():
            self.logs[name] = total + self.logs[name] if name in self.logs else total
            self.log_sizes[name] = self.log_sizes.get(name, 0) + sizes[name]

    def flush_logs(self) -> None:
        """Hand the round the client's ``self.log`` values of this run's eager work (``client_init``,
        ``client_final``: a full-gradient pass, say), as the sequential backend counts them."""
        for name, total in self.logs.items():
            self.context.logs.add(name, total, self.log_sizes[name], self.log_options.get(name, {}), (self.client_id,))
        self.logs, self.log_sizes = {}, {}

    def _collector(self, logs: dict[str, Tensor], sizes: dict[str, int], batch: Any) -> Callable[..., None]:
        """The client's ``self.log`` inside a gradient: values times the call's batch size are
        returned with the loss, for the round's buffered mean (the batch sizes, Python numbers, are
        kept in :attr:`log_sizes`: reading them needs no device sync); a recorded metric object, or
        the value of its call, is recorded with its calls (:attr:`recording`)."""

        def log(name: str, value: Any, *args: Any, **kwargs: Any) -> None:
            options = call_options(args, kwargs)
            if self.recording is not None and is_recorded(value):
                size = options.pop("batch_size", None) or extract_batch_size(batch)
                self.recording.log(name, value, options, int(size))
                return
            if isinstance(value, Metric) or options.get("reduce_fx", "mean") not in ("mean", torch.mean):
                raise ValueError(
                    f"the client's training_step logs {name!r} as a torchmetrics Metric or with another reduce_fx "
                    "than the mean: the batched backend logs per-round means only; use client_backend='sequential'"
                )
            size = options.pop("batch_size", None) or extract_batch_size(batch)
            logs[name] = torch.as_tensor(value).detach().float().reshape(()) * size
            sizes[name] = int(size)
            self.log_options[name] = options

        return log

    def forward(self, *args: Any, model: Model = None) -> Any:
        tensors = model if model is not None else (self._active if self._active is not None else self.tensors)
        with self.context.forward_context():
            return self.context.stateless.forward(list(tensors), *args)

    def step(self, grads: Sequence[Tensor]) -> None:
        local = self.local
        local.opt_state = local.function.step_(self.tensors[: self.layout.num_param_tensors], grads, local.opt_state)

    def end(self) -> Tensor:
        return self.layout.flatten(self.tensors)

    def _restart(self, start: Tensor) -> None:
        self.tensors = self.layout.split(start.clone())  # one copy (views of it), not one per tensor

    # ------------------------------------------------------------ the carry: what a step reads and writes
    def carry(self) -> dict[str, Any]:
        """The run's per-client values (a pytree; its non-tensor leaves must agree over a block)."""
        return {"tensors": self.tensors, "opt": self.local.opt_state, "start": self.start, "state": self.state,
                "scratch": self.scratch}

    def load_carry(self, carry: dict[str, Any]) -> None:
        """Take the values of :meth:`carry` back."""
        self.tensors, self.local.opt_state = list(carry["tensors"]), list(carry["opt"])
        self.__dict__["start"] = carry["start"]  # the carry's tensors are the model: nothing to load
        self.state, self.scratch = dict(carry["state"]), dict(carry["scratch"])

    @classmethod
    def view(cls, template: "FunctionalRun", carry: dict[str, Any], step: int, round_idx: int, extras: Any
             ) -> "FunctionalRun":
        """One client's run inside a vectorized step at local step ``step`` of round ``round_idx``: the
        block's ``template`` run's fields and optimizer, with the client's carry (no client id, no sample
        count). The step and the round are given, not read from ``template``, so that a compiled step
        holds them as symbols (:class:`~fl_lightning.backends.batched.compiled.CompiledStep`)."""
        model = template.local
        local = FunctionalLocal(model.function, model.frozen, model.num_steps, shared=model.shared,
                                opt_state=list(carry["opt"]))
        local.step_index = local.steps_taken = step  # a client at step k took k steps
        run = cls(template.context, list(carry["tensors"]), client_id=None, round_idx=round_idx,  # type: ignore[arg-type]
                  layout=template.layout, start=carry["start"], state=dict(carry["state"]),
                  data=RunData(None, template.data.batch_size, template.data.eval_batch_size, extra=extras),
                  local=local)
        run.scratch = dict(carry["scratch"])
        return run


def carried_out(run: FunctionalRun, side: dict[str, Any]) -> list[Tensor]:
    """The tensors of ``run``'s carry after a vectorized hook; ``side`` receives its structure
    (``"spec"``, ``"static"``)."""
    new_leaves, side["spec"] = tree_flatten(run.carry())
    new_tensors, side["static"] = split_leaves(new_leaves)
    return new_tensors
