"""A Dropout federation for tests to run under ``fl_ddp``: ``python -m tests.ddp_child DEVICES OUT``.

Lightning's ``fl_ddp`` (DDP launched as processes re-running this command, gloo on CPU) needs a
script entry point. Each process starts from another global torch RNG stream (seeded by its
rank), as processes of a real job do: only the engine's keying by (seed, round, client) makes
the clients' Dropout draws agree with one process. Rank 0 saves the global model to ``OUT``.
"""

from __future__ import annotations

import os
import sys

import torch

from tests.helpers import global_vector, synthetic, trainer
from tests.test_protocol import dropout_fedavg


def fit(devices: int) -> tuple[int, torch.Tensor]:
    """The federation on ``devices`` processes: this process's rank and the global model."""
    module = dropout_fedavg()
    torch.manual_seed(1000 + int(os.environ.get("LOCAL_RANK", "0")))
    strategy = "fl_ddp" if devices > 1 else "auto"
    t = trainer(3, devices=devices, strategy=strategy)
    t.fit(module, synthetic(6))
    return t.global_rank, global_vector(module)


def main() -> None:
    devices, out = int(sys.argv[1]), sys.argv[2]
    torch.set_num_threads(1)
    rank, model = fit(devices)
    if rank == 0:
        torch.save(model, out)


if __name__ == "__main__":
    main()
