"""Per-round time and memory against the total number of clients, at 10 clients per round.

SCAFFOLD (it keeps per-client state) on generated MNIST-shaped data with 100, 1,000 and
10,000 clients: the per-round time and the client-state memory should follow the clients
per round, not the total. Prints one row per federation size and the time ratio to the
smallest one.

    python benchmarks/scale.py [--rounds 10]
"""

from __future__ import annotations

import argparse
import resource
import time

import pytorch_lightning as pl
import torch
from torch.utils.data import TensorDataset

from fl_lightning.algorithms import SCAFFOLD
from fl_lightning.datamodules import FederatedDataModule
from fl_lightning.models import MLP

SAMPLES = 60_000


class RandomMNIST(FederatedDataModule):
    """MNIST-shaped random data (60,000 samples)."""

    def build_datasets(self):
        g = torch.Generator().manual_seed(0)
        x = torch.randn(SAMPLES, 1, 28, 28, generator=g)
        return TensorDataset(x, torch.randint(0, 10, (SAMPLES,), generator=g)), None


class Timer(pl.Callback):
    """Seconds per round, excluding the first (warm-up) round."""

    def on_train_epoch_start(self, trainer, pl_module):
        if trainer.current_epoch == 1:
            self.start = time.perf_counter()

    def on_train_end(self, trainer, pl_module):
        self.per_round = (time.perf_counter() - self.start) / (trainer.current_epoch - 1)


def run(num_clients: int, rounds: int) -> tuple[float, int]:
    torch.manual_seed(0)
    dm = RandomMNIST(num_clients=num_clients, partition="iid", batch_size=4)
    module = SCAFFOLD(MLP(hidden=(200, 200), lr=0.05), clients_per_round=10, local_steps=10)
    timer = Timer()
    pl.Trainer(max_epochs=rounds, logger=False, enable_checkpointing=False, enable_progress_bar=False,
               enable_model_summary=False, limit_val_batches=0, callbacks=[timer]).fit(module, dm)
    return timer.per_round, module.store.nbytes()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=10)
    args = parser.parse_args()
    torch.set_num_threads(1)
    rows = []
    for n in (100, 1_000, 10_000):
        per_round, store = run(n, args.rounds)
        rows.append((n, per_round, store))
    base = rows[0][1]
    print(f"SCAFFOLD, MLP 784-200-200-10, 10 clients/round x 10 steps, {args.rounds} rounds")
    print(f"{'clients':>8} {'ms/round':>9} {'ratio':>6} {'client state MB':>16}")
    for n, per_round, store in rows:
        print(f"{n:>8} {per_round * 1e3:>9.1f} {per_round / base:>6.2f} {store / 2**20:>16.1f}")
    print(f"peak RSS of the process: {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.0f} MB")


if __name__ == "__main__":
    main()
