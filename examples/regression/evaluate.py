"""config.yaml's federation from Python, printing the global and the per-client validation figures."""

import argparse

import pytorch_lightning as pl

from data import Sites
from fl_lightning.algorithms import FedAvg
from fl_lightning.callbacks import FederatedEvaluation
from model import Regressor


def main(rounds: int = 10) -> dict[str, float]:
    """Train for ``rounds`` rounds; return (and print) the validation figures, global and over clients."""
    pl.seed_everything(0)
    model = FedAvg(client=Regressor(), clients_per_round=5, local_steps=10, seed=0)
    trainer = pl.Trainer(max_epochs=rounds, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, callbacks=[FederatedEvaluation(split="val")])
    trainer.fit(model, Sites(partition="natural", batch_size=16, test_fraction=0.1))
    figures = {name: float(value) for name, value in sorted(trainer.callback_metrics.items())
               if name.startswith(("val/", "clients_val/"))}
    for name, value in figures.items():
        print(f"{name:<26} {value:8.4f}")
    return figures


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=10)
    main(parser.parse_args().rounds)
