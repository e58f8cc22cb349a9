"""The mean, the geometric median and the trimmed mean against sign-flipping clients: test accuracy."""

import argparse

import pytorch_lightning as pl

from fl_lightning.algorithms import FedAvg
from fl_lightning.callbacks import GeometricMedian, SignFlipAttack, TrimmedMean, WeightedMean
from fl_lightning.datamodules import SyntheticFederated
from fl_lightning.models import LogisticRegression

AGGREGATORS = {
    "mean": lambda: WeightedMean(),
    "geometric median": lambda: GeometricMedian(),
    "trimmed mean": lambda: TrimmedMean(num_trimmed=3),
}


def accuracy(aggregator: str, rounds: int, attackers: int) -> float:
    """The global model's test accuracy after ``rounds`` rounds with ``attackers`` Byzantine clients."""
    pl.seed_everything(0)
    model = FedAvg(client=LogisticRegression(in_features=60, num_classes=10, lr=0.05), clients_per_round=20,
                   local_steps=10, seed=0)
    callbacks = [AGGREGATORS[aggregator]()]
    if attackers:
        callbacks.append(SignFlipAttack(scale=10.0, count=attackers))
    trainer = pl.Trainer(max_epochs=rounds, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, callbacks=callbacks)
    data = SyntheticFederated(num_clients=20, iid=True, min_samples=200, max_samples=200, batch_size=10, seed=0)
    trainer.fit(model, data)
    return trainer.test(model, data, verbose=False)[0]["test_acc"]


def main(rounds: int = 20, attackers: int = 3) -> dict[str, tuple[float, float]]:
    """Each aggregator's test accuracy without and with the attack, printed as a table and returned."""
    results = {name: (accuracy(name, rounds, 0), accuracy(name, rounds, attackers)) for name in AGGREGATORS}
    print(f"{'aggregator':<18} {'no attack':>10} {f'{attackers} attackers':>13}")
    for name, (clean, attacked) in results.items():
        print(f"{name:<18} {clean:>10.4f} {attacked:>13.4f}")
    return results


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--attackers", type=int, default=3)
    args = parser.parse_args()
    main(args.rounds, args.attackers)
