"""How many clients a vectorized block holds when the user leaves it to the engine
(``clients_per_block=None``): every client of the round, as far as memory allows, a client
counted with the activations of its local step and of an evaluation batch (:func:`activation_bytes`)."""

from __future__ import annotations

import math
import os
from typing import TYPE_CHECKING, Any, Callable, NamedTuple, Optional, Sequence

import torch
from torch import Tensor

from fl_lightning.backends.stateless import training_loss
from fl_lightning.lightning_compat import routed_log

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


def saved_tensor_bytes(fn: Callable[[], Any], exclude: Sequence[Tensor] = ()) -> int:
    """Bytes of the tensors autograd saves for the backward of what ``fn`` computes: each storage
    counted once, those of ``exclude`` (the model's own tensors, counted elsewhere) not.

    >>> w = torch.ones(3, 4, requires_grad=True)
    >>> saved_tensor_bytes(lambda: (torch.ones(5, 3) @ w).relu().sum(), exclude=[w])  # input and relu's output
    140
    """
    skip = {(t.device, t.untyped_storage().data_ptr()) for t in exclude}
    seen: dict[tuple[torch.device, int], int] = {}

    def pack(t: Tensor) -> Tensor:
        storage = t.untyped_storage()
        key = (t.device, storage.data_ptr())
        if key not in skip:
            seen[key] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()  # kept until every saved tensor is counted, so that no storage is reused meanwhile
    del out
    return sum(seen.values())


class Activations(NamedTuple):
    """Bytes one client of a block holds beyond its run's tensors: in a local step (``step``) and in
    an evaluation batch (``evaluation``)."""

    step: int
    evaluation: int


def activation_bytes(context: "ClientContext") -> Activations:
    """About what one client of a block holds beyond its run's tensors, from the bytes autograd saves
    for the backward of the client's ``training_step`` on a batch of the largest training client's
    first samples (at most ``batch_size``), at copies of the model's tensors, in the run's precision:

    * in a local step, twice that (the gradients flowing back through the saved tensors take about
      as much again at their peak);
    * in an evaluation, that scaled from the step's batch to ``eval_batch_size`` (no gradient is
      taken, but a batch's intermediate values are alive at once as it passes through the model).

    One step, once, at setup: random draws are taken from a forked RNG, and the step's ``self.log``
    calls are dropped, so that the run is what it would be without it. ``benchmarks/block_memory.py``
    measures both against a block's peak memory."""
    data = context.algorithm.datamodule
    if not data.train_clients:
        return Activations(0, 0)
    split = data.client_data(max(data.train_clients, key=data.num_samples), "train")
    batch_size = split.step_batch_size
    batch = context.gather(split.indices[:batch_size])
    model = context.global_model
    tensors = [t.detach().clone().requires_grad_(i < model.layout.num_param_tensors)
               for i, t in enumerate(model.tensors)]
    devices = [context.device] if context.device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices), routed_log(context.client, lambda *args, **kwargs: None), \
            context.forward_context():
        saved = saved_tensor_bytes(lambda: training_loss(context.stateless.training_step(tensors, batch, 0)),
                                   exclude=tensors)
    return Activations(step=2 * saved, evaluation=math.ceil(saved * data.eval_batch_size / batch_size))
