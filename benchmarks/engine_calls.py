"""The engine's host work per round as a count of Python function calls: a deterministic measure of
overhead for a noisy machine, where wall-clock ratios (``benchmarks/overhead.py``) swing by 30%.

FedAvg on generated data (a logistic regression, 20 clients, 10 per round, 10 local steps of 16),
profiled with ``cProfile`` over 6 rounds after a warm-up fit, for each client backend. Run it in two
trees to compare them (``PYTHONPATH=<tree> python benchmarks/engine_calls.py``): the same count means
the same Python work per round.
"""

from __future__ import annotations

import cProfile
import pstats
import tempfile
import time
import warnings

import pytorch_lightning as pl
import torch

import fl_lightning
from fl_lightning.algorithms import FedAvg
from fl_lightning.datamodules import SyntheticFederated
from fl_lightning.models import LogisticRegression

ROUNDS = 6


def fit(backend: str, rounds: int, profile: bool) -> tuple[int, float]:
    """Function calls and main-thread CPU ms per round of a fit of ``rounds`` rounds."""
    torch.manual_seed(0)
    data = SyntheticFederated(num_clients=20, dim=20, batch_size=16, max_samples=120, min_samples=20)
    module = FedAvg(LogisticRegression(in_features=20, num_classes=10, lr=0.1), clients_per_round=10,
                    local_steps=10, client_backend=backend)
    trainer = pl.Trainer(max_epochs=rounds, logger=False, enable_checkpointing=False, accelerator="cpu", devices=1,
                         enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                         default_root_dir=tempfile.mkdtemp(prefix="fl-calls-"))
    profiler = cProfile.Profile()
    if profile:
        profiler.enable()
    start = time.thread_time()
    trainer.fit(module, data)
    elapsed = time.thread_time() - start
    profiler.disable()
    calls = pstats.Stats(profiler).total_calls if profile else 0  # type: ignore[attr-defined]
    return calls, 1000 * elapsed / rounds


def main() -> None:
    warnings.filterwarnings("ignore")
    print(f"fl_lightning at {fl_lightning.__file__}")
    for backend in ("sequential", "batched"):
        fit(backend, 2, profile=False)  # warm-up: imports, first-call caches
        calls, ms = fit(backend, ROUNDS, profile=True)
        print(f"{backend:10s}: {calls / ROUNDS:9.0f} Python calls per round ({ms:.1f} ms CPU per round, profiled)")


if __name__ == "__main__":
    main()
