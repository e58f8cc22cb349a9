"""The compiled batched step's cost before its first fast round: the quickstart's federation
(``configs/quickstart.yaml``: FedAvg, 10 logistic-regression clients a round, 20 local steps of 10) with
``client_backend="batched", compile_step=True``, every round's wall time and the graphs compiled.

The compile is in the first rounds (a step structure met later compiles then); their time beyond a
compiled round's is what it costs. Run it in alternation with another checkout (``PYTHONPATH``) to
compare two versions on a busy machine; ``OMP_NUM_THREADS=1`` gives both the same threads.

    OMP_NUM_THREADS=1 python benchmarks/compile_time.py --rounds 5
"""

from __future__ import annotations

import argparse
import statistics

import pytorch_lightning as pl
import torch
from torch._dynamo.utils import counters

from common import RoundTimes

from fl_lightning.algorithms import FedAvg
from fl_lightning.datamodules import SyntheticFederated
from fl_lightning.models import LogisticRegression


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5, help="rounds (at least 3: the compile, and rounds after it)")
    args = parser.parse_args()
    if args.rounds < 3:
        parser.error(f"--rounds must be >= 3, got {args.rounds}")
    pl.seed_everything(0)
    client = LogisticRegression(in_features=60, num_classes=10, lr=0.05)
    module = FedAvg(client, clients_per_round=10, local_steps=20, seed=0, client_backend="batched", compile_step=True)
    data = SyntheticFederated(alpha=1.0, beta=1.0, num_clients=30, batch_size=10, seed=0)
    timer = RoundTimes()
    pl.Trainer(max_epochs=args.rounds, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
               enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
               callbacks=[timer]).fit(module, data)
    compiled = statistics.median(timer.seconds[2:])
    print("rounds (s):", " ".join(f"{s:.3f}" for s in timer.seconds))
    print(f"graphs compiled: {counters['stats']['unique_graphs']}; threads: {torch.get_num_threads()}; the first two "
          f"rounds beyond two compiled ones: {sum(timer.seconds[:2]) - 2 * compiled:.2f} s")


if __name__ == "__main__":
    main()
