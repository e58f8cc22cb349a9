"""A federation for tests/test_reliability.py to kill: ``python -m tests.crash_child ALGORITHM DIR MODE``.

It trains 5 rounds with a ``RoundCheckpoint`` in ``DIR`` and, in round 3, writes ``DIR/ready``
and hangs: ``MODE=round`` in the middle of the round (after its first client), ``MODE=write``
in the middle of writing the round's checkpoint (a partial temporary file on disk).
"""

from __future__ import annotations

import os
import sys
import time

import torch

from fl_lightning.callbacks import FederatedCallback, RoundCheckpoint
from tests.test_reliability import build, data

torch.set_num_threads(1)
HANG_ROUND = 3


class HangInRound(FederatedCallback):
    """Hangs in round 3 after its first client, once round 2's checkpoint is on disk: its write runs on
    a background thread, which a loaded machine may not have scheduled yet (a kill would then lose
    round 2 as well, which the checkpoint allows, but the test expects round 2 kept)."""

    def __init__(self, folder: str, checkpoint: RoundCheckpoint) -> None:
        self.folder = folder
        self.checkpoint = checkpoint

    def on_client_update(self, trainer, module, update):
        if module.current_epoch == HANG_ROUND:
            self.checkpoint.wait()
            _hang(self.folder)
        return update


class HangInWrite(RoundCheckpoint):
    """Hangs in the middle of writing round 3's file (on the background writer thread)."""

    def write(self, strategy, checkpoint, path):
        if checkpoint["epoch"] == HANG_ROUND:
            with open(path + ".tmp", "wb") as f:
                f.write(b"PK\x03\x04 a checkpoint cut short")
            _hang(os.path.dirname(path))
        super().write(strategy, checkpoint, path)


def _hang(folder: str) -> None:
    with open(os.path.join(folder, "ready"), "w") as f:
        f.write("ready")
    while True:
        time.sleep(1)


def main() -> None:
    algorithm, folder, mode = sys.argv[1:4]
    from tests.helpers import trainer

    if mode == "write":
        callbacks = [HangInWrite(dirpath=folder)]
    else:
        checkpoint = RoundCheckpoint(dirpath=folder)
        callbacks = [checkpoint, HangInRound(folder, checkpoint)]
    trainer(5, callbacks=callbacks, enable_checkpointing=True).fit(build(algorithm), data())


if __name__ == "__main__":
    main()
