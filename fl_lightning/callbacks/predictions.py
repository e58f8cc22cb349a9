"""``PredictionWriter``: ``trainer.predict``'s outputs saved to a file in the run's folder.

``fl-lightning predict`` adds it unless the configuration has a prediction writer of its own:
the global model's outputs on the datamodule's predict set (the global test set) go to
``<the log folder>/predictions.pt``, in the order of the set (from a checkpoint of a run: the run's
``predict`` folder, :class:`~fl_lightning.cli.FederatedCLI`), and its path is printed. The file holds tensors only
(``torch.load(path, weights_only=True)`` reads it)::

    fl-lightning predict --config configs/quickstart.yaml --ckpt_path <checkpoint>
"""

from __future__ import annotations

import os
from typing import Any, Optional, Sequence

import torch

from fl_lightning.lightning_package import BasePredictionWriter, pl


class PredictionWriter(BasePredictionWriter):
    """Writes the predictions of ``trainer.predict`` to ``<dirpath>/<filename>`` at the end of the
    predict epoch, and prints where (``predictions: <path>``).

    The file holds the predict steps' outputs concatenated along the first dimension when they are
    tensors, else their list (one list per dataloader with several). With several processes each
    writes ``<stem>_rank<r>.pt``: ``{"predictions": ..., "indices": ...}``, the dataset indices of
    its samples beside its outputs.

    Args:
        dirpath: the folder (default: the Trainer's ``log_dir``, else its ``default_root_dir``).
        filename: the file's name.
    """

    def __init__(self, dirpath: Optional[str] = None, filename: str = "predictions.pt") -> None:
        if not filename or os.sep in filename:
            raise ValueError(f"filename must be a file name without a folder, got {filename!r}")
        super().__init__(write_interval="epoch")
        self.dirpath = dirpath
        self.filename = filename

    def write_on_epoch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, predictions: Sequence[Any],
        batch_indices: Sequence[Any],
    ) -> None:
        folder = self.dirpath or trainer.log_dir or trainer.default_root_dir  # log_dir: a collective, every rank
        os.makedirs(folder, exist_ok=True)
        several = trainer.predict_loop.num_dataloaders > 1  # Lightning's lists: one per dataloader, else one
        if trainer.world_size == 1:
            path = os.path.join(folder, self.filename)
            torch.save(_joined(predictions, several), path)
            print(f"predictions: {path}", flush=True)
            return
        indices = [torch.as_tensor([i for batch in part for i in batch], dtype=torch.long) for part in batch_indices]
        stem, suffix = os.path.splitext(self.filename)
        torch.save({"predictions": _joined(predictions, several), "indices": indices if several else indices[0]},
                   os.path.join(folder, f"{stem}_rank{trainer.global_rank}{suffix}"))
        if trainer.is_global_zero:
            print(f"predictions: {os.path.join(folder, f'{stem}_rank*{suffix}')} (a file per process, "
                  f"{trainer.world_size} in all)", flush=True)


def _joined(predictions: Sequence[Any], several: bool) -> Any:
    """The outputs of each dataloader concatenated when they are tensors (else their list)."""
    def join(outputs: Sequence[Any]) -> Any:
        return torch.cat(list(outputs)) if outputs and all(isinstance(o, torch.Tensor) for o in outputs) else list(outputs)

    return [join(part) for part in predictions] if several else join(predictions)
