"""``fl_ddp``: DDP processes for a federation, without DDP's gradient all-reduce.

Lightning's ``ddp`` wraps the model in ``DistributedDataParallel``, which all-reduces the
gradients of every backward pass: every local step of every client would be averaged across
processes. A federation wants the opposite: each process runs its own clients independently
and the processes meet once per round (an all-reduce for a mean aggregate, an all-gather for
a robust one). ``FederatedDDPStrategy`` keeps everything of ``DDPStrategy`` (process
launching, process group, device placement, collectives, checkpoint saving on rank 0)
except the wrapper; it broadcasts rank 0's initial model so all processes start equal, and it
closes the process group when the process exits, whatever the backend. Its evaluation loaders
split the set over the processes without repeating a sample (:func:`unpadded`), so that what the
processes evaluate together is the set that one process evaluates.

Registered names: ``fl_ddp`` (subprocess launcher, like ``ddp``), ``fl_ddp_spawn`` and
``fl_ddp_notebook`` (``fork``), usable as ``Trainer(strategy="fl_ddp")`` and
``--trainer.strategy fl_ddp`` on the command line.
"""

from __future__ import annotations

import atexit

import torch.distributed
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler

from fl_lightning.lightning_compat import is_unpadded, quiet_padding_notice, sync_module_states, unpadded_shards
from fl_lightning.lightning_package import DDPStrategy, StrategyRegistry


class FederatedDDPStrategy(DDPStrategy):
    """DDP process management with no ``DistributedDataParallel`` wrapper."""

    strategy_name = "fl_ddp"
    #: ``FederatedModule`` refuses DDP strategies that lack this flag.
    is_federated = True

    # private Lightning API (checked: lightning_compat.OVERRIDDEN_PRIVATE_METHODS)
    def _setup_model(self, model: nn.Module) -> nn.Module:
        sync_module_states(model)
        return model

    def _register_ddp_hooks(self) -> None:
        """No DDP wrapper, no communication hooks."""

    def process_dataloader(self, dataloader: object) -> object:
        """Each loader as Lightning prepared it, an evaluation loader's shards without padding (:func:`unpadded`)."""
        return unpadded(super().process_dataloader(dataloader))

    def setup_distributed(self) -> None:
        """Join the process group, and close it when this process exits; drop Lightning's notice that
        an evaluation on several processes repeats samples (here it repeats none: :meth:`process_dataloader`).

        Lightning closes only NCCL groups at exit. A gloo group left open is destroyed by C++
        static destructors after the interpreter has finalized, and there its threads sometimes
        abort the process ("terminate called without an active exception", about one spawned
        process in 50 on a 2-core machine) after a run that succeeded, which a spawn launcher
        reports as a failure.
        """
        super().setup_distributed()
        quiet_padding_notice()
        atexit.unregister(close_process_group)  # once per process, however many fits
        atexit.register(close_process_group)


def unpadded(dataloader: object) -> object:
    """``dataloader`` with its shards holding each sample of the set once.

    Lightning gives an evaluation loader under DDP a ``DistributedSampler``, which pads the shards to
    the same size with repeated samples when the set's size is not a multiple of the processes (and a
    ``drop_last`` one leaves samples out): the processes' metrics together would count a sample twice
    (a validation accuracy of 3/54 for 3/53). Such a loader is rebuilt with the same split without
    padding (:func:`~fl_lightning.lightning_compat.unpadded_shards`); the shards' sizes then differ by
    at most one sample, and their batch counts by at most one. Any other loader is returned as it is
    (the federation's train loader, whose sampler has one replica, a loader whose shards are even).

    Raises:
        ValueError: the sampler that pads is not a plain ``DistributedSampler`` (Lightning's wrapper
            of a loader's own sampler), or the set has fewer samples than there are processes (one
            would evaluate nothing, and wait forever for the others in a ``Metric``'s sync).
    """
    sampler = getattr(dataloader, "sampler", None)
    if not isinstance(dataloader, DataLoader) or not isinstance(sampler, DistributedSampler) \
            or is_unpadded(sampler) or sampler.total_size == len(sampler.dataset):
        return dataloader
    size, processes = len(sampler.dataset), sampler.num_replicas
    if type(sampler) is not DistributedSampler:
        raise ValueError(f"fl_ddp evaluates each sample of a set once, and a loader's {type(sampler).__name__} "
                         f"shards {size} samples over {processes} processes as {sampler.total_size}: give the "
                         f"loader a sequential (or random) sampler, which fl_ddp splits without repeating "
                         f"samples, or a set whose size is a multiple of {processes}")
    if size < processes:
        raise ValueError(f"fl_ddp evaluates each sample of a set once, and a loader of {size} samples on "
                         f"{processes} processes would leave a process without any: use at most {size} "
                         f"processes or a larger set")
    return unpadded_shards(dataloader, sampler)


def close_process_group() -> None:
    """Destroy the default process group if one is open (an ``atexit`` handler)."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


for _name, _start in (("fl_ddp", "popen"), ("fl_ddp_spawn", "spawn"), ("fl_ddp_notebook", "fork")):
    if _name not in StrategyRegistry:
        StrategyRegistry.register(
            _name,
            FederatedDDPStrategy,
            description=f"federated DDP ({_start}): one process per device, no per-step gradient all-reduce",
            start_method=_start,
        )
