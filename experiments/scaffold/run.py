"""SCAFFOLD on the shipped MNIST config (``configs/fedavg_mnist.yaml`` with SCAFFOLD as the model): the
global test accuracy after rounds 50, 100, 150 and 200, with the clients' control deltas averaged
uniformly (SCAFFOLD's Algorithm 1, the engine's since "Engine v2") or by sample count (the engine's
before), one record per seed in a result file (:mod:`experiments.results`).

    python -m experiments.scaffold.run --out docs/results/scaffold.json                 # both, seeds 0-2
    python -m experiments.scaffold.run --control sample_weighted --seeds 0 --out runs/scaffold.json
    python -m experiments.scaffold.report docs/results/scaffold.json                   # the document's table

Runs already in the file are skipped. ``docs/results/scaffold.md`` compares the two control means.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import pytorch_lightning as pl
import torch

from experiments import results
from experiments.sweep import device_name, evaluate, in_process_cli
from fl_lightning.algorithms import SCAFFOLD

CONTROLS = ("uniform", "sample_weighted")
ROUNDS = 200
#: the rounds after which the global model is measured
EVERY = 50


class SampleWeightedControlSCAFFOLD(SCAFFOLD):
    """SCAFFOLD as the engine ran it before "Engine v2": the control deltas averaged by sample count, like
    the model deltas, ``c <- c + (|S| / N) sum_i n_i dc_i / sum_i n_i``, instead of Algorithm 1's uniform mean."""

    def __init__(self, client: pl.LightningModule, **kwargs: Any) -> None:
        super().__init__(client, **kwargs)
        self.add_update("control", self.engine.update_specs["control"].size, reduction="weighted_mean")


class Accuracy(pl.Callback):
    """The global model's accuracy on the global test set every :data:`EVERY` rounds."""

    def __init__(self) -> None:
        self.history: list[dict[str, float]] = []

    def on_train_epoch_end(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
        done = trainer.current_epoch + 1
        if done % EVERY == 0:
            with torch.no_grad():
                _, accuracy = evaluate(module.client, trainer.datamodule.global_test_set(), batch_size=2000)
            self.history.append({"round": done, "test_acc": accuracy})


def fit(control: str, seed: int, data: str, commit: str) -> results.Run:
    """Train SCAFFOLD with ``control``'s mean for one ``seed`` (model and sampling) and return its record."""
    algorithm = SCAFFOLD if control == "uniform" else SampleWeightedControlSCAFFOLD
    cli = in_process_cli([
        "--config", "configs/fedavg_mnist.yaml", "--model.class_path", f"{algorithm.__module__}.{algorithm.__name__}",
        "--model.init_args.seed", str(seed), "--seed_everything", str(seed), "--data.init_args.root", data,
        "--trainer.callbacks", "[]", "--trainer.enable_progress_bar", "false", "--trainer.logger", "false",
        "--trainer.enable_checkpointing", "false", "--trainer.limit_val_batches", "0",
        "--trainer.max_epochs", str(ROUNDS), "--trainer.accelerator", "cpu",
        # the results were measured with every client's data in training (no validation split)
        "--data.init_args.val_fraction", "0",
        # ... and with the model deltas weighted by sample count (the engine's default then; SCAFFOLD's is uniform)
        "--model.init_args.weighting", "num_samples",
    ])
    accuracy = Accuracy()
    cli.trainer.callbacks.append(accuracy)
    start = time.perf_counter()
    cli.trainer.fit(cli.model, cli.datamodule)
    return results.record(f"{control}/s{seed}", commit, {"control": control, "seed": seed, "rounds": ROUNDS},
                          time.perf_counter() - start, accuracy.history, device_name(cli.trainer))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--control", nargs="+", choices=CONTROLS, default=list(CONTROLS),
                        help="the control deltas' mean: Algorithm 1's uniform one, or by sample count")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--data", default="../shared/data", help="MNIST root")
    parser.add_argument("--out", required=True, help="the result file")
    args = parser.parse_args()
    torch.set_num_threads(1)
    commit = results.commit()
    done = {r["name"] for r in results.load(args.out)}
    for control in args.control:
        for seed in args.seeds:
            if f"{control}/s{seed}" not in done:
                record = fit(control, seed, args.data, commit)
                results.add(args.out, record)
                print(record["name"], [(h["round"], round(h["test_acc"], 4)) for h in record["history"]], flush=True)


if __name__ == "__main__":
    main()
