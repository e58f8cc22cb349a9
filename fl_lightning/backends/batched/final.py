"""``client_final`` once for a whole block of clients, ``vmap``-ped over their stacked runs, where that
gives every client its own result; no declaration asks for it.

The batched backend tries it for every algorithm with a ``client_final`` of its own, at the first block
whose clients took the same number of steps (``BatchedBackend._vectorized_finals``). Where the vectorized hook fails, the backend warns once, with the reason, and runs
every client's ``client_final`` on its own from then on, as the sequential backend does.

A vectorized ``client_final`` must be refused, not merely slower, where it would silently give other
results than each client's own call. ``vmap`` refuses a random draw (``randomness="error"``) and a
tensor's value read in Python; the rest is made to fail here, so that no such hook is vectorized:

* the run's per-client fields that the stacked carry does not hold: ``client_id``, ``held``, ``metrics``,
  ``data.num_samples``, ``data.batches`` and ``data.extra`` (read or written through the view of the block,
  :class:`BlockFinalRun`, each raises :class:`ClientSpecific`), and with them the client's data
  (``run.data.fetch``, ``run.data.epoch``) and every draw keyed by the client;
* ``self.log`` of the algorithm or of its client module (:func:`final_setting`; in the client's
  ``training_step``, through ``run.loss_and_grad``, :func:`vectorized_final`);
* Python state of the algorithm's module (an attribute, a list appended to, a counter) that the hook
  changes, found at the first try (:func:`final_setting`, ``first=True``), whose changes are undone.

What no check can see stays the author's: a hook with Python effects outside the module (Python's
``random``, a file written) runs once a block, not once a client. Such an algorithm declares
``batchable = False`` (the batched backend then refuses it).
"""

from __future__ import annotations

from contextlib import ExitStack, contextmanager
from typing import Any, Callable, Iterator, Optional

from torch import Tensor, nn
from torch.func import vmap

from fl_lightning.backends.batched.python_state import PythonState
from fl_lightning.backends.batched.run import FunctionalRun, carried_out
from fl_lightning.backends.batched.stacking import merge_leaves
from fl_lightning.backends.trial import client_state_kept
from fl_lightning.lightning_compat import routed_log, tree_unflatten
from fl_lightning.run import RunData


class ClientSpecific(Exception):
    """A vectorized ``client_final`` used what differs between the clients of a block; the message says what."""


class PerClient:
    """A field of the block's view (:class:`BlockFinalRun`) that each client of the block has its own of,
    which the view does not hold: reading it raises :class:`ClientSpecific` (a vectorized hook that read one
    client's value would silently give it to all); the run's constructor's write is ignored.

    Args:
        prefix: where the field is, from the run (``"data."``).
    """

    def __init__(self, prefix: str = "") -> None:
        self.prefix = prefix

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    def __get__(self, run: Any, owner: Optional[type] = None) -> Any:
        if run is None:
            return self
        raise ClientSpecific(f"it reads run.{self.prefix}{self.name}, which each client of a block has its own of")

    def __set__(self, run: Any, value: Any) -> None:
        """The run's constructor sets every field: a view holds none of these."""


class BlockFinalRun(FunctionalRun):
    """The view of a block's stacked runs that a vectorized ``client_final`` receives: the carry (model,
    optimizer state, start, state entries, scratch values) as one client's, the fields the clients share
    (round, steps taken, learning rate, layout), and no per-client field (:class:`PerClient`)."""

    client_id = PerClient()
    held = PerClient()
    metrics = PerClient()

    @classmethod
    def view(cls, template: FunctionalRun, carry: dict[str, Any], step: int, round_idx: int, extras: Any
             ) -> "FunctionalRun":
        run = super().view(template, carry, step, round_idx, extras)
        run.data = BlockFinalData(None, template.data.batch_size, template.data.eval_batch_size)
        return run


class BlockFinalData(RunData):
    """The client's data as the view of a block (:class:`BlockFinalRun`) has it: the batch sizes the clients share,
    and no per-client field or read (each raises :class:`ClientSpecific`)."""

    __slots__ = ()
    num_samples = PerClient("data.")
    batches = PerClient("data.")
    extra = PerClient("data.")

    def fetch(self, positions: Tensor) -> Any:
        raise ClientSpecific("it reads the client's data (run.data.fetch)")

    def epoch(self, batch_size: Optional[int] = None) -> Iterator[Any]:
        raise ClientSpecific("it reads the client's data (run.data.epoch)")


def _refuse_log(name: str, *args: Any, **kwargs: Any) -> None:
    """Stands in for ``self.log`` in a vectorized ``client_final``."""
    raise ClientSpecific(f"it logs {name!r} with self.log, once per client")


@contextmanager
def final_setting(algorithm: nn.Module, client: nn.Module, first: bool) -> Iterator[None]:
    """The setting of a vectorized ``client_final``: ``self.log`` of ``algorithm`` and of ``client`` raise
    :class:`ClientSpecific`; with ``first`` (the first try), the algorithm's Python state is put back on exit
    and a hook that changed it is refused."""
    with ExitStack() as stack:
        stack.enter_context(routed_log(algorithm, _refuse_log))  # type: ignore[arg-type]
        stack.enter_context(routed_log(client, _refuse_log))  # type: ignore[arg-type]
        guard = None
        if first:
            stack.enter_context(client_state_kept(algorithm))
            guard = PythonState(algorithm)
        yield
        changed = guard.changed() if guard is not None else []
        if changed:
            raise ClientSpecific(f"it changes Python state of the module ({', '.join(changed)}), once per client")


def vectorized_final(hook: Callable[[FunctionalRun], dict[str, Tensor]], template: FunctionalRun, spec: Any,
                     static: dict[int, Any], side: dict[str, Any], tensors: list[Tensor]
                     ) -> tuple[list[Tensor], dict[str, Tensor]]:
    """``hook`` (``client_final``) for every client of a stacked carry ``tensors`` (``template``'s
    fields: every client took ``template.local.steps_taken`` steps), ``vmap``-ped over the clients, no random
    draws allowed, each client's run a :class:`BlockFinalRun`: returns the new stacked carry's tensors (the
    state entries the hook set) and the uploads, stacked; ``side`` receives the new carry's structure
    (``"spec"``, ``"static"``)."""

    def one_client(tensors: list[Tensor]) -> tuple[list[Tensor], dict[str, Tensor]]:
        run = BlockFinalRun.view(template, tree_unflatten(merge_leaves(tensors, static), spec), template.local.steps_taken,
                                 template.round, None)
        uploads = dict(hook(run))
        if run.logs or run.metric_calls:  # the client's own training_step (run.loss_and_grad) logged
            raise ClientSpecific(f"its client's training_step logs {sorted(run.logs)}, once per client")
        return carried_out(run, side), uploads

    return vmap(one_client, randomness="error")(tensors)
