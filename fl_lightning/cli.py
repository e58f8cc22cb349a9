"""``fl-lightning``: LightningCLI over federated modules and datamodules.

::

    fl-lightning fit --config configs/quickstart.yaml
    fl-lightning fit --config configs/fedavg_mnist.yaml --model.local_steps 5 --trainer.max_epochs 50
    fl-lightning validate --config configs/quickstart.yaml --ckpt_path last.ckpt
    fl-lightning fit --config configs/quickstart.yaml --print_config

``--model`` accepts any ``FederatedModule`` subclass and ``--data`` any
``FederatedDataModule`` subclass (``class_path`` + ``init_args``). The federated DDP
strategies are registered on import, so ``--trainer.strategy fl_ddp`` works.
"""

from __future__ import annotations

from typing import Optional

from pytorch_lightning.cli import LightningCLI

from fl_lightning.datamodules.base import FederatedDataModule
from fl_lightning.module import FederatedModule


class FederatedCLI(LightningCLI):
    """``LightningCLI`` in subclass mode for ``FederatedModule`` and ``FederatedDataModule``."""

    def __init__(self, args: Optional[list[str]] = None, run: bool = True) -> None:
        super().__init__(
            FederatedModule,
            FederatedDataModule,
            subclass_mode_model=True,
            subclass_mode_data=True,
            args=args,
            run=run,
            save_config_kwargs={"overwrite": True},
        )


def main(args: Optional[list[str]] = None) -> None:
    """Entry point of the ``fl-lightning`` command."""
    FederatedCLI(args=args)


if __name__ == "__main__":
    main()
