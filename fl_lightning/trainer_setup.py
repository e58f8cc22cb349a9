"""What the engine asks of the Trainer it runs in, checked and set up once per stage."""

from __future__ import annotations

import warnings

from fl_lightning.checkpoints import install_safe_io
from fl_lightning.lightning_compat import batch_norm_layers
from fl_lightning.lightning_package import DDPStrategy, pl, rank_zero_warn


def prepare_trainer(trainer: pl.Trainer, client: pl.LightningModule, stage: str) -> None:
    """Set ``trainer`` up for a federation of ``client`` modules: checkpoints read with
    ``weights_only=True`` and clear errors, no advice to log more often than once a round; refuse
    a DDP strategy that all-reduces every local step's gradients (``fl_ddp`` is the federated
    one); warn about BatchNorm layers whose cumulative statistics cannot federate."""
    strategy = trainer.strategy
    install_safe_io(strategy)  # checkpoints are read with weights_only=True and clear errors
    # rounds are logged per epoch: Lightning's advice to lower log_every_n_steps does not apply
    warnings.filterwarnings("ignore", message=r"The number of training batches \(\d+\) is smaller than the logging")
    if isinstance(strategy, DDPStrategy) and not getattr(strategy, "is_federated", False):
        raise ValueError(
            f"strategy {type(strategy).__name__} all-reduces the gradients of every local step; "
            "use strategy='fl_ddp' (or 'fl_ddp_spawn'), fl_lightning's DDP strategy for federations"
        )
    cumulative = [name for name, m in batch_norm_layers(client) if m.track_running_stats and m.momentum is None]
    if stage == "fit" and cumulative:
        rank_zero_warn(
            f"BatchNorm layer(s) {cumulative[:5]} have momentum=None (a cumulative average weighted by "
            "num_batches_tracked): integer buffers are not federated (local work leaves them at the global model's "
            "value), so these cumulative averages restart in every client's local work; give the layers a momentum "
            "(e.g. 0.1) for running statistics that federate"
        )
