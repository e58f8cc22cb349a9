"""SCAFFOLD on the shipped MNIST config (``configs/fedavg_mnist.yaml`` with SCAFFOLD as the model):
the global test accuracy after rounds 50, 100, 150 and 200, for one seed, as JSON.

    python -m experiments.scaffold_control.run --seed 0 --out scaffold_0.json

``docs/results/scaffold.md`` compares the sample-weighted control-variate mean of the engine
before "Engine v2" with the uniform mean of SCAFFOLD's Algorithm 1.
"""

from __future__ import annotations

import argparse
import json

import pytorch_lightning as pl
import torch

from experiments.sweep import evaluate, in_process_cli


class Accuracy(pl.Callback):
    """The global model's accuracy on the global test set every 50 rounds, by round (1-based)."""

    def __init__(self) -> None:
        self.by_round: dict[str, float] = {}

    def on_train_epoch_end(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
        done = trainer.current_epoch + 1
        if done % 50 == 0:
            with torch.no_grad():
                _, accuracy = evaluate(module.client, trainer.datamodule.global_test_set(), batch_size=2000)
            self.by_round[str(done)] = accuracy


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--data", default="../shared/data", help="MNIST root")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    seed = str(args.seed)
    cli = in_process_cli([
        "--config", "configs/fedavg_mnist.yaml", "--model.class_path", "fl_lightning.algorithms.SCAFFOLD",
        "--model.init_args.seed", seed, "--seed_everything", seed, "--data.init_args.root", args.data,
        "--trainer.callbacks", "[]", "--trainer.enable_progress_bar", "false", "--trainer.logger", "false",
        "--trainer.enable_checkpointing", "false", "--trainer.limit_val_batches", "0",
        # the results were measured with every client's data in training (no validation split)
        "--data.init_args.val_fraction", "0",
        # ... and with the model deltas weighted by sample count (the engine's default then; SCAFFOLD's is uniform)
        "--model.init_args.weighting", "num_samples",
    ])
    accuracy = Accuracy()
    cli.trainer.callbacks.append(accuracy)
    cli.trainer.fit(cli.model, cli.datamodule)
    with open(args.out, "w") as f:
        json.dump(accuracy.by_round, f)
    print(seed, accuracy.by_round)


if __name__ == "__main__":
    main()
