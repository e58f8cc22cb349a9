"""``fl_ddp``: DDP processes for a federation, without DDP's gradient all-reduce.

Lightning's ``ddp`` wraps the model in ``DistributedDataParallel``, which all-reduces the
gradients of every backward pass: every local step of every client would be averaged across
processes. A federation wants the opposite: each process runs its own clients independently
and the processes meet once per round (an all-reduce for a mean aggregate, an all-gather for
a robust one). ``FederatedDDPStrategy`` keeps everything of ``DDPStrategy`` (process
launching, process group, device placement, collectives, checkpoint saving on rank 0)
except the wrapper; it broadcasts rank 0's initial model so all processes start equal, and it
closes the process group when the process exits, whatever the backend.

Registered names: ``fl_ddp`` (subprocess launcher, like ``ddp``), ``fl_ddp_spawn`` and
``fl_ddp_notebook`` (``fork``), usable as ``Trainer(strategy="fl_ddp")`` and
``--trainer.strategy fl_ddp`` on the command line.
"""

from __future__ import annotations

import atexit

import torch.distributed
from pytorch_lightning.strategies import DDPStrategy, StrategyRegistry
from torch import nn

from fl_lightning.lightning_compat import sync_module_states


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

    def setup_distributed(self) -> None:
        """Join the process group, and close it when this process exits.

        Lightning closes only NCCL groups at exit. A gloo group left open is destroyed by C++
        static destructors after the interpreter has finalized, and there its threads sometimes
        abort the process ("terminate called without an active exception", about one spawned
        process in 50 on a 2-core machine) after a run that succeeded, which a spawn launcher
        reports as a failure.
        """
        super().setup_distributed()
        atexit.unregister(close_process_group)  # once per process, however many fits
        atexit.register(close_process_group)


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
