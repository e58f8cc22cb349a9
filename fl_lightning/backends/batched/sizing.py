"""How many clients a vectorized block holds when the user leaves it to the engine
(``clients_per_block=None``): every client of the round, as far as memory allows, a client
counted with the activations of its local step and of an evaluation batch (:func:`activation_bytes`)."""

from __future__ import annotations

import math
import os
import weakref
from typing import TYPE_CHECKING, Any, Callable, NamedTuple, Optional, Sequence

import torch
from torch import Tensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from fl_lightning.backends.evaluate import evaluation_setting
from fl_lightning.backends.stateless import training_loss
from fl_lightning.backends.trial import largest_client, trial_setting
from fl_lightning.lightning_package import overrides_hook

if TYPE_CHECKING:
    from fl_lightning.backends.context import ClientContext

#: the share of the device's free memory a block's clients (their tensors and their steps' activations) may take
MEMORY_SHARE = 0.25


def free_memory(device: torch.device) -> Optional[int]:
    """Bytes free on ``device``: the CUDA allocator's view of the GPU, the host's available physical
    memory for the CPU (where the OS says it), None where neither is known."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    if device.type == "cpu":
        try:
            return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        except (AttributeError, ValueError, OSError):  # not a POSIX system that reports it
            return None
    return None


def block_size(clients: int, client_bytes: int, free: Optional[int], share: float = MEMORY_SHARE,
               held: int = 0) -> int:
    """Clients per block for ``clients`` clients a round (this process's), each holding
    ``client_bytes`` in the block: all of them, or as many as fit in ``share`` of ``free`` bytes
    beside the ``held`` bytes the round keeps outside its blocks (a lock-step round's runs; at
    least 1; ``free=None``: no bound).

    >>> block_size(50, 4 * 10**6, 8 * 10**9)
    50
    >>> block_size(1000, 4 * 10**8, 8 * 10**9)
    5
    >>> block_size(1000, 4 * 10**8, 8 * 10**9, held=10**9)
    2
    """
    if clients < 1 or client_bytes < 0 or held < 0:
        raise ValueError(f"need clients >= 1, client_bytes >= 0 and held >= 0, got clients={clients}, "
                         f"client_bytes={client_bytes}, held={held}")
    if free is None or client_bytes == 0:
        return clients
    return max(1, min(clients, (int(share * free) - held) // client_bytes))


def _storage_key(t: Tensor) -> tuple[torch.device, int]:
    """A tensor's storage, the same for all its views (its device and first byte's address)."""
    return t.device, t.untyped_storage().data_ptr()


def saved_tensor_bytes(fn: Callable[[], Any], exclude: Sequence[Tensor] = ()) -> int:
    """Bytes of the tensors autograd saves for the backward of what ``fn`` computes: each storage
    counted once, those of ``exclude`` (the model's own tensors, counted elsewhere) not.

    >>> w = torch.ones(3, 4, requires_grad=True)
    >>> saved_tensor_bytes(lambda: (torch.ones(5, 3) @ w).relu().sum(), exclude=[w])  # input and relu's output
    140
    """
    skip = {_storage_key(t) for t in exclude}
    seen: dict[tuple[torch.device, int], int] = {}

    def pack(t: Tensor) -> Tensor:
        key = _storage_key(t)
        if key not in skip:
            seen[key] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()  # kept until every saved tensor is counted, so that no storage is reused meanwhile
    del out
    return sum(seen.values())


class _LiveTensors(TorchDispatchMode):
    """Counts the bytes of the storages that the operations run under it create, from their first
    tensor's creation to their last tensor's end, and the most of them alive at once (``peak``)."""

    def __init__(self, exclude: Sequence[Tensor]) -> None:
        super().__init__()
        self.skip = {_storage_key(t) for t in exclude}
        self.users: dict[tuple[torch.device, int], int] = {}  # storage -> its tensors alive
        self.sizes: dict[tuple[torch.device, int], int] = {}
        self.live = self.peak = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        before = {_storage_key(t) for t in tree_leaves((args, kwargs)) if isinstance(t, Tensor)}
        for t in tree_leaves(out):
            if not isinstance(t, Tensor):
                continue
            key = _storage_key(t)
            if key in self.skip or not key[1] or (key not in self.users and key in before):
                continue  # excluded, empty, or an input written in place: not made here
            if key not in self.users:
                self.users[key], self.sizes[key] = 0, t.untyped_storage().nbytes()
                self.live += self.sizes[key]
                self.peak = max(self.peak, self.live)
            self.users[key] += 1
            weakref.finalize(t, self._release, key)
        return out

    def _release(self, key: tuple[torch.device, int]) -> None:
        self.users[key] -= 1
        if not self.users[key]:
            del self.users[key]
            self.live -= self.sizes.pop(key)


def peak_live_bytes(fn: Callable[[], Any], exclude: Sequence[Tensor] = ()) -> int:
    """The most bytes that the tensors ``fn`` makes hold at once while it runs (each storage once,
    alive from its first tensor's creation to its last tensor's end; those of ``exclude``, and
    inputs written in place, not counted): the peak of a forward without gradients.

    >>> x = torch.ones(1000)
    >>> def fn():
    ...     a = x * 2
    ...     b = a + 1     # a and b: 8000 bytes
    ...     del a
    ...     return b * 3  # b and the result: 8000 bytes
    >>> peak_live_bytes(fn)
    8000
    """
    tracker = _LiveTensors(exclude)
    with tracker:
        out = fn()
    del out
    return tracker.peak


class Activations(NamedTuple):
    """Bytes one client of a block holds beyond its run's tensors: in a local step (``step``) and in
    an evaluation batch (``evaluation``)."""

    step: int
    evaluation: int


def activation_bytes(context: "ClientContext") -> Activations:
    """About what one client of a block holds beyond its run's tensors, measured once at setup on
    the largest training client's first samples, at copies of the model's tensors, in the run's
    precision:

    * in a local step, twice the bytes autograd saves for the backward of the client's
      ``training_step`` on a batch of ``batch_size`` samples (the gradients flowing back through
      the saved tensors take about as much again at their peak);
    * in an evaluation, the most bytes alive at once in the client's ``validation_step`` (its
      ``training_step`` where it has none) on a batch of ``eval_batch_size`` samples, the batch
      itself included, in eval mode without gradients (:func:`peak_live_bytes`; scaled up where the
      client has fewer samples).

    Both run in the setup's trial of the client's steps (:func:`~fl_lightning.backends.trial.trial_setting`),
    so that the run is what it would be without them. ``benchmarks/block_memory.py`` measures both
    against a block's peak memory."""
    data = context.engine.datamodule
    client_id = largest_client(data)
    if client_id is None:
        return Activations(0, 0)
    split = data.client_data(client_id, "train")
    batch_size, eval_size = split.step_batch_size, min(data.eval_batch_size, len(split.indices))
    overridden = overrides_hook(context.client, "validation_step")
    hook = "validation_step" if overridden else "training_step"
    with trial_setting(context) as tensors:
        batch = context.gather(split.indices[:batch_size])
        saved = saved_tensor_bytes(lambda: training_loss(context.stateless.training_step(tensors, batch, 0)),
                                   exclude=tensors)
        with evaluation_setting(context):
            evaluation = peak_live_bytes(
                lambda: context.stateless.step(hook, tensors, context.gather(split.indices[:eval_size]), 0),
                exclude=tensors)
    return Activations(step=2 * saved, evaluation=math.ceil(evaluation * data.eval_batch_size / eval_size))
