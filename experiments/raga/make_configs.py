"""Writes configs/raga/*.yaml: the RAGA paper's experiment (Zuo et al., 2024, Sec. V) for LightningCLI.

One attack-free config per (dataset, model, method); the Byzantine fraction is added on the
command line (see the header of each file). Run: python experiments/raga/make_configs.py
"""

from __future__ import annotations

from pathlib import Path

DATASETS = {
    "mnist": {"class": "MNISTFederated", "rounds": 1000, "eval": 10,
              "mlp": {"in_features": 784}, "lenet": {"in_channels": 1, "image_size": 28}},
    "cifar10": {"class": "CIFAR10Federated", "rounds": 10000, "eval": 50,
                "mlp": {"in_features": 3072}, "lenet": {"in_channels": 3, "image_size": 32}},
}
METHODS = {
    "raga": ("fl_lightning.algorithms.raga.RAGA", {"local_steps": 3, "eps": 1.0e-5, "max_iter": 100}, None),
    "rfa": ("fl_lightning.algorithms.rfa.RFA", {"local_steps": 3}, None),
    "fedavg": ("fl_lightning.algorithms.rfa.RFA", {"local_steps": 3}, "fl_lightning.callbacks.aggregation.WeightedMean"),
    "byrdsaga": ("fl_lightning.algorithms.byrd_saga.ByrdSAGA", {"step_size": 0.1}, None),
}
NOTES = {
    "raga": "RAGA: mean of K = 3 local gradients, weighted geometric median (Weiszfeld, eps 1e-5), eta^t = T/(100t+10T).",
    "rfa": "RFA: model deltas after K = 3 local steps (RAGA's schedule), smoothed-Weiszfeld geometric median.",
    "fedavg": "FedAvg: RFA's clients with the weighted mean (WeightedMean replaces the geometric median).",
    "byrdsaga": "Byrd-SAGA: one SAGA step per round, unweighted geometric median, gamma = 0.1.",
}


def render(dataset: str, model: str, method: str) -> str:
    d = DATASETS[dataset]
    cls, args, aggregator = METHODS[method]
    if model == "mlp":
        client = "fl_lightning.models.MLP", {**d["mlp"], "hidden": "[100]", "num_classes": 10, "lr": 0.1}
    else:
        client = "fl_lightning.models.LeNet", {**d["lenet"], "num_classes": 10, "lr": 0.1}
    client_args = ", ".join(f"{k}: {v}" for k, v in client[1].items())
    algo_args = "".join(f"    {k}: {v}\n" for k, v in args.items())
    name = f"{dataset}_{model}_{method}"
    callbacks = f"  callbacks:\n    - class_path: {aggregator}\n" if aggregator else ""
    return f"""# RAGA paper (Zuo et al., 2024), {dataset.upper()} {model.upper()}: {NOTES[method]}
# 50 clients, Dirichlet(0.6), batch 512, full participation, T = {d['rounds']} rounds. Attack-free as written;
# add the paper's Gaussian attack at Byzantine data fraction 1 - C_alpha = 0.1 ... 0.4 with
#   fl-lightning fit --config configs/raga/{name}.yaml \\
#     --trainer.callbacks+=fl_lightning.callbacks.attacks.GaussianAttack --trainer.callbacks.fraction=0.2
# (other attacks: SignFlipAttack, ALIEAttack, IPMAttack, ScalingAttack, LabelFlipAttack in the same module).
seed_everything: 0
model:
  class_path: {cls}
  init_args:
    client:
      class_path: {client[0]}
      init_args: {{{client_args}}}
    clients_per_round: 50
{algo_args}    seed: 0
data:
  class_path: fl_lightning.datamodules.{d['class']}
  init_args:
    root: ../shared/data
    num_clients: 50
    partition: dirichlet
    alpha: 0.6
    min_samples: 10
    batch_size: 512
    seed: 0
trainer:
  max_epochs: {d['rounds']}
  accelerator: auto
  devices: 1
  check_val_every_n_epoch: {d['eval']}
  num_sanity_val_steps: 0
  enable_model_summary: false
  default_root_dir: runs/raga/{name}
{callbacks}"""


def main() -> None:
    out = Path(__file__).resolve().parents[2] / "configs" / "raga"
    out.mkdir(parents=True, exist_ok=True)
    for dataset in DATASETS:
        for model in ("mlp", "lenet"):
            for method in METHODS:
                (out / f"{dataset}_{model}_{method}.yaml").write_text(render(dataset, model, method))


if __name__ == "__main__":
    main()
