"""The federation of config.yaml from Python: FedAvg of model.py's Classifier over data.py's Blobs."""

import argparse

import pytorch_lightning as pl

from data import Blobs
from fl_lightning.algorithms import FedAvg
from fl_lightning.datamodules import DirichletPartitioner
from model import Classifier


def main(rounds: int = 20) -> dict[str, float]:
    """Train for ``rounds`` rounds and return the global model's test metrics."""
    pl.seed_everything(0)
    model = FedAvg(client=Classifier(), clients_per_round=10, local_steps=10, seed=0)
    data = Blobs(num_clients=20, partitioner=DirichletPartitioner(alpha=0.5), batch_size=16, seed=0)
    trainer = pl.Trainer(max_epochs=rounds, check_val_every_n_epoch=5, accelerator="cpu", devices=1,
                         default_root_dir="runs/own_module_python", enable_progress_bar=False)
    trainer.fit(model, data)
    return trainer.test(model, data)[0]


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=20)
    main(parser.parse_args().rounds)
