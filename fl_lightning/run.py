"""``ClientRun``: one client's local work in one round, passed explicitly through the client protocol.

The engine creates a run when a client's round starts and hands it to the algorithm's
``client_init(run)``, ``client_step(run, batch)`` (once per local step) and
``client_final(run)``: the FedJAX shape (``client_init -> client_step -> client_final``) with
the state passed explicitly. Nothing per-client is kept on the algorithm's ``self``.

A run holds:

* what the engine knows: ``client_id``, ``round``, the ``start`` state vector (the global model
  unless ``client_init`` sets another), the client's declared state entries in ``state`` (written
  back to the client state store when the round keeps the update);
* the client's training split as the run reads it, ``data`` (:class:`RunData`), and its local
  optimization, ``local`` (:class:`LocalWork`: the optimizer, its rate, the steps and where they are);
* the algorithm's per-run values in ``scratch`` and ``held``, and its extra ``metrics``;
* the operations of its backend, which is what makes the same ``client_step`` run one client
  at a time or many at once: :attr:`params` (the model being trained), :meth:`loss_and_grad`
  (the client module's loss and its gradient, at the trained model or at another one),
  :meth:`forward`, :meth:`step` (one step of the local optimizer along given directions),
  :meth:`end`.

Models other than the trained one (FedDeper's personal model, FedProxVR's reference point) are
lists of tensors in the :class:`~fl_lightning.vectors.Layout` order: the parameters, then the
floating buffers (``run.layout.copy(vector)`` makes one). A step's mathematics is written on such
lists, so that it is a function of tensors only: the batched backend runs the same ``client_step``
on many clients at once.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable, Iterator, Optional, Sequence, Union

import torch
from torch import Tensor

from fl_lightning.client_config import ClientConfig
from fl_lightning.vectors import Layout

#: a model given to :meth:`ClientRun.loss_and_grad` / :meth:`ClientRun.forward`: None (the trained
#: model) or a list of tensors in layout order (parameters, then floating buffers)
Model = Optional[Sequence[Tensor]]
#: what ``client_step`` returns: the step's loss, or named scalars (``"loss"`` among them)
StepOutput = Union[Tensor, dict[str, Tensor], None]


class RunData:
    """The client's training split as its run reads it (``run.data``).

    Attributes:
        num_samples: the size of the split (None inside a vectorized step: a step must not depend on it).
        batch_size: the federation's local batch size (the datamodule's ``batch_size``).
        eval_batch_size: the batch size of a pass over the split that trains nothing, a full gradient (the
            datamodule's ``eval_batch_size``).
        batches: None draws the steps' batches from the engine's keyed stream; ``client_init`` may
            give its own (from :meth:`fetch`).
        extra: the current step's batch of each of the algorithm's other streams
            (``FederatedModule.extra_batch_streams``).
    """

    __slots__ = ("num_samples", "batch_size", "eval_batch_size", "batches", "extra", "_fetch", "_epoch")

    def __init__(self, num_samples: Optional[int], batch_size: Optional[int], eval_batch_size: Optional[int] = None,
                 fetch: Optional[Callable[[Tensor], Any]] = None, epoch: Optional[Callable[[int], Iterator[Any]]] = None,
                 extra: Optional[dict[str, Any]] = None) -> None:
        self.num_samples = num_samples
        self.batch_size = batch_size
        self.eval_batch_size = eval_batch_size
        self.batches: Optional[Iterable[Any]] = None
        self.extra: dict[str, Any] = {} if extra is None else extra
        self._fetch, self._epoch = fetch, epoch  # the backend's reads of the client's split

    def fetch(self, positions: Tensor) -> Any:
        """The split's samples at ``positions`` as one batch, ready for a step (in ``client_init`` and
        ``client_final``)."""
        assert self._fetch is not None, "fetch is for client_init and client_final"
        return self._fetch(positions)

    def epoch(self, batch_size: Optional[int] = None) -> Iterator[Any]:
        """One pass over the split in index order, in batches of ``batch_size`` (default: the federation's)
        ready for a step (in ``client_init`` and ``client_final``)."""
        assert self._epoch is not None, "epoch is for client_init and client_final"
        size = self.batch_size if batch_size is None else batch_size
        assert size is not None, "epoch needs a batch size"
        return self._epoch(size)


class LocalWork:
    """A run's local optimization (``run.local``): its optimizer and rate, its steps and where they are.
    Subclassed by each backend, which says what the optimizer is.

    Attributes:
        num_steps: local steps to run; None runs ``epochs`` passes. ``client_init`` may change it
            (FedProxVR's random output iterate).
        epochs: the passes over the client's training split when ``num_steps`` is None (the
            client's configuration of the round: :class:`~fl_lightning.client_config.ClientConfig`).
        step_index: the index of the current local step.
        steps_taken: local steps run so far.
        shared: in a lock-step round, the server's latest per-step value (``server_share``).
        optimizer: the local optimizer ``run.step`` applies (the client's ``configure_optimizers``
            one, at the round's scheduled rate); an algorithm with an update rule of its own may
            replace it in ``client_init`` (FedProxVR's proximal SGD). Backends that run the
            optimizer as a function (the batched one) support the optimizers they name.
    """

    def __init__(self, num_steps: Optional[int], epochs: Optional[int] = None, shared: Optional[Tensor] = None,
                 optimizer: Optional[torch.optim.Optimizer] = None) -> None:
        self.num_steps = num_steps
        self.epochs = epochs
        self.step_index = 0
        self.steps_taken = 0
        self.shared = shared
        self.optimizer = optimizer

    @property
    def lr(self) -> float:
        """The one learning rate of the local optimizer's trainable parameters, this round
        (ValueError if they have several: see :func:`~fl_lightning.optim.param_groups.single_lr`)."""
        raise NotImplementedError

    @property
    def moves(self) -> list[bool]:
        """Which of the model's parameters a step of the local optimizer moves (it holds them and they require a
        gradient): another model a client steps by hand leaves the others as they are (FedDeper's personal model)."""
        raise NotImplementedError

    def _configure_lr(self, config: ClientConfig) -> None:
        """Set the local optimizer's learning rates as the client's ``config`` says
        (:meth:`~fl_lightning.client_config.ClientConfig.rates`), before ``client_init``."""
        raise NotImplementedError


class _StartModel:
    """``ClientRun.start``: read as a plain attribute (no call: algorithms read it at every step); set, it also
    loads the value into the trained model (the backend's ``_restart``)."""

    def __set__(self, run: "ClientRun", start: Tensor) -> None:
        run.__dict__["start"] = start
        run._restart(start)


class ClientRun:
    """One client's round. Subclassed by each backend, which supplies the model operations.

    Attributes:
        client_id: the client (None inside a vectorized step: a step must not depend on it).
        round: the round (the Trainer epoch).
        layout: the client model's layout (flat vector <-> tensors, named views of a vector).
        start: the state vector the client starts from (flat fp32, on the device); ``client_init``
            may set another, from which the trained model then starts.
        state: the client's declared state entries, on the device (absent entries have no
            default); what is here after ``client_final`` is stored if the round keeps the update.
        data: the client's training split (:class:`RunData`).
        local: the local optimization (:class:`LocalWork`).
        scratch: the algorithm's per-run values.
        held: values ``client_init`` leaves for ``client_final`` that no local step reads (a graph
            to back-propagate through at the round's end): the batched backend neither stacks
            nor carries them through its steps, where ``held`` is empty. Not ``scratch``, whose
            every value the batched backend stacks into the block's carry (a graph there would join
            the clients' graphs into one and go through every vectorized step); sorting graphs out
            of ``scratch`` at every block would be work per client.
        metrics: extra scalars reported with the client's update: floats, or 0-dim tensors that
            the round's end reads with the others at once (no device sync per client).
    """

    def __init__(self, client_id: int, round_idx: int, layout: Layout, start: Tensor, state: dict[str, Tensor],
                 data: RunData, local: LocalWork) -> None:
        self.client_id = client_id
        self.round = round_idx
        self.layout = layout
        self.__dict__["start"] = start  # not loaded into the model: the backend starts it (start's setter does)
        self.state = state
        self.data = data
        self.local = local
        self.scratch: dict[str, Any] = {}
        self.held: dict[str, Any] = {}
        self.metrics: dict[str, float | Tensor] = {}
        self._step_values: dict[str, list[Tensor]] = {}
        self._means: dict[str, Tensor] = {}

    start = _StartModel()

    # ------------------------------------------------------------ backend operations
    @property
    def params(self) -> list[Tensor]:
        """The parameters of the model being trained (do not modify them in place: use :meth:`step`)."""
        raise NotImplementedError

    def loss_and_grad(
        self,
        batch: Any,
        model: Model = None,
        loss_fn: Optional[Callable[[Any], Any]] = None,
        has_aux: bool = False,
    ) -> tuple[Any, list[Tensor]]:
        """The loss on ``batch`` and its gradient with respect to the model's parameters.

        Args:
            batch: the mini-batch (on the device).
            model: the model to differentiate at: None (the trained model) or a list of
                tensors in layout order (see :meth:`~fl_lightning.vectors.Layout.copy`). Its floating
                buffers are updated as the client's forward updates them (BatchNorm statistics).
            loss_fn: ``loss_fn(batch) -> loss`` instead of the client module's
                ``training_step``; it computes outputs with :meth:`forward`.
            has_aux: ``loss_fn`` returns ``(loss, aux)`` (as ``torch.func.grad_and_value``).

        Returns:
            ``(loss, grads)`` (``((loss, aux), grads)`` with ``has_aux``): the detached loss and
            the gradients shaped like the parameters (zeros for unused parameters).
        """
        raise NotImplementedError

    def forward(self, *args: Any, model: Model = None) -> Any:
        """The client module's forward on ``args`` at ``model`` (None: the trained model; inside
        :meth:`loss_and_grad`'s ``loss_fn``: the model being differentiated)."""
        raise NotImplementedError

    def step(self, grads: Sequence[Tensor]) -> None:
        """One step of the local optimizer along ``grads`` (shaped like the parameters)."""
        raise NotImplementedError

    def end(self) -> Tensor:
        """The trained model's current state vector (flat fp32: parameters, then floating buffers)."""
        raise NotImplementedError

    def _restart(self, start: Tensor) -> None:
        """Load ``start`` into the trained model (setting :attr:`start`)."""
        raise NotImplementedError

    # ------------------------------------------------------------ bookkeeping (the backends', not an algorithm's)
    def _record(self, output: StepOutput) -> None:
        """Keep a step's output (a loss, or named scalars) for the client's metrics."""
        if output is None:
            return
        values = output if isinstance(output, dict) else {"loss": output}
        for name, value in values.items():
            self._step_values.setdefault(name, []).append(value.detach())

    def _record_mean(self, name: str, value: Tensor) -> None:
        """Keep the mean of ``name`` over the round's steps (a 0-dim tensor, not read), computed by a
        backend that ran the steps of many clients together."""
        self._means[name] = value

    def _summary(self) -> dict[str, float | Tensor]:
        """The client's metrics: the mean of each recorded step value (a 0-dim tensor, not read
        here: the round's end reads all its clients' at once), the step count and ``metrics``."""
        out: dict[str, float | Tensor] = {name: step_mean(values) for name, values in self._step_values.items()}
        out.update(self._means)
        out["steps"] = float(self.local.steps_taken)
        out.update(self.metrics)
        return out


def step_mean(values: list[Tensor]) -> Tensor:
    """The mean of detached step values (scalars, or series of several steps) as a 0-dim fp32
    tensor on their device, without reading it (NaN for none)."""
    if not values:
        return torch.tensor(float("nan"))
    if all(v.dim() == 0 for v in values):
        return torch.stack(values).float().mean()
    return torch.cat([v.reshape(-1) for v in values]).float().mean()


def default_hook(hook: Callable[..., Any]) -> Callable[..., Any]:
    """Say that ``hook`` is the engine's default of a client hook: ``FederatedModule``'s ``client_init``
    (nothing), ``client_step`` (:func:`plain_step`) and ``client_final`` (:func:`default_final`) are. A backend
    reads the statement (:func:`is_default_hook`), never the class's methods, and may run a default its own
    way with the same result: no setting of local work around a ``client_init`` that does nothing, the plain
    step's gradient outside ``vmap``, the default upload of a whole block at once. An algorithm whose own
    hook is the default for some of its arguments says so by taking the default (FedProxVR without
    ``log_local_accuracy``: ``self.client_final = default_final``). ``functools.wraps`` keeps the statement."""
    hook.default_hook = True  # type: ignore[attr-defined]
    return hook


def is_default_hook(hook: Callable[..., Any]) -> bool:
    """Whether ``hook`` (a function, a bound method, a wrapper made with ``functools.wraps``) is a
    :func:`default_hook`."""
    return getattr(hook, "default_hook", False) is True


@default_hook
def default_final(run: ClientRun) -> dict[str, Tensor]:
    """The default ``client_final``, ``FederatedModule.client_final``'s upload ``{"delta": end - start}`` (no new
    state), for an algorithm that takes it in place of its own (the base class's method computes it itself:
    a call to this function there would add one per client and round)."""
    return {"delta": run.end() - run.start}


def plain_step(run: ClientRun, batch: Any) -> Tensor:
    """The plain local step: the client module's loss, its gradient, one step of its optimizer."""
    loss, grads = run.loss_and_grad(batch)
    run.step(grads)
    return loss
