"""The studies of ``docs/results/fedproxvr.md``: ``python -m experiments.sweep fedproxvr``.

Each run is a config of ``configs/fedproxvr/`` (a base and the row's override) with the seed (the
initialization, the batch order and the random choices; the data partition keeps seed 0, so every
run of a study sees the same federation), the number of rounds and the study's scale-down
overrides. The global model is evaluated before the first round and every ``every`` rounds on the
global test set (the union of the clients' test splits) and on the pooled training splits (whose
mean loss is the paper's training loss); the Trainer's own validation is off.

* ``mu``: the mu study (Fig. 4) at 20 clients, 25 rounds; ``mu_n100_r100``, ``mu_n100_r400``: at
  the paper's 100 clients, 100 and 400 rounds;
* ``table1``, ``table1_r100``: Table 1 (MNIST for Fashion-MNIST), 6 and 100 rounds;
* ``table2``, ``table2_r50``: Table 2 at 3 % of the images, tau = 10, B = 16, 5 and 50 rounds;
  ``table2_sarah_beta20``: SARAH there with the smaller step beta = 20;
* ``table2_gpu``: Table 2 at the paper's data size (30 % of the images) and rows, 300 rounds, for a
  GPU (the document's section 2c: its result files were lost).
"""

from __future__ import annotations

from typing import Any

from experiments.sweep import Run

#: row label -> config files (a base of configs/fedproxvr/ and the row's override)
MU = {"FedAvg": ["mu_synthetic_logreg.yaml", "mu/fedavg.yaml"]} | {
    f"FedProxVR ({e.upper()}) mu={m}": ["mu_synthetic_logreg.yaml", *o]
    for e, o in (("svrg", []), ("sarah", ["mu/sarah.yaml"])) for m in (0, 1, 4)}
TABLE1 = {"FedAvg": ["table1_mnist_logreg.yaml", "table1/fedavg.yaml"], "FedProxVR (SVRG)": ["table1_mnist_logreg.yaml"],
          "FedProxVR (SARAH)": ["table1_mnist_logreg.yaml", "table1/sarah.yaml"]}
TABLE2 = {"FedAvg": ["table2_mnist_cnn.yaml", "table2/fedavg.yaml"], "FedProxVR (SVRG)": ["table2_mnist_cnn.yaml"],
          "FedProxVR (SARAH)": ["table2_mnist_cnn.yaml", "table2/sarah.yaml"]}
MU_20 = ["data.init_args.num_clients=20", "model.init_args.clients_per_round=20"]
SMALL_CNN = ["data.init_args.partitioner.init_args.used_fraction=0.03", "model.init_args.local_steps=10", "data.init_args.batch_size=16"]
#: study -> (rows, rounds, evaluated every, scale-down overrides, seeds)
STUDIES: dict[str, tuple[dict[str, list[str]], int, int, list[str], tuple[int, ...]]] = {
    "mu": (MU, 25, 1, MU_20, (0, 1, 2)),
    "mu_n100_r100": (MU, 100, 5, [], (0, 1, 2)),
    "mu_n100_r400": (MU, 400, 10, [], (0, 1, 2)),
    "table1": (TABLE1, 6, 1, [], (0, 1, 2)),
    "table1_r100": (TABLE1, 100, 5, [], (0, 1, 2)),
    "table2": (TABLE2, 5, 1, SMALL_CNN, (0, 1, 2)),
    "table2_r50": (TABLE2, 50, 2, SMALL_CNN, (0, 1, 2)),
    "table2_sarah_beta20": ({"FedProxVR (SARAH)": TABLE2["FedProxVR (SARAH)"]}, 5, 1,
                            [*SMALL_CNN, "model.init_args.beta=20"], (0, 1)),
    "table2_gpu": (TABLE2, 300, 10, ["data.init_args.partitioner.init_args.used_fraction=0.3"], (0, 1, 2)),
}


def slug(label: str) -> str:
    """``FedProxVR (SVRG) mu=0`` -> ``svrg_mu0``."""
    return label.replace("FedProxVR (", "").replace(")", "").replace(" mu=", "_mu").lower()


def runs() -> list[Run]:
    plan = []
    for study, (rows, rounds, every, overrides, seeds) in STUDIES.items():
        for label, configs in rows.items():
            mu = ["--model.init_args.mu", label.rsplit("=", 1)[1]] if " mu=" in label else []
            for seed in seeds:
                args = [*(a for c in configs for a in ("--config", f"configs/fedproxvr/{c}")), *mu,
                        *(a for kv in overrides for a in ("--" + kv.split("=", 1)[0], kv.split("=", 1)[1])),
                        "--seed_everything", str(seed), "--model.init_args.seed", str(seed),
                        "--trainer.max_epochs", str(rounds), "--trainer.limit_val_batches", "0"]
                params = dict(study=study, label=label, seed=seed, rounds=rounds, overrides=overrides)
                plan.append(Run(f"{study}/{slug(label)}_s{seed}", args, params, every=every, at_start=True, train=True))
    return plan


def summary(cli: Any) -> dict[str, Any]:
    """The federation: training split sizes and the number of test samples."""
    dm = cli.datamodule
    sizes = [len(s) for s in dm.splits["train"]]
    return {"train_sizes": dict(min=min(sizes), max=max(sizes), total=sum(sizes), clients=len(sizes)),
            "test_samples": len(dm.global_test_set())}
