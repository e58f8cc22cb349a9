"""The spec's acceptance checks 5 and 6 for FedDRO (``../shared/specs/feddro.md`` §6.1) on the engine.

    python -m experiments.feddro.acceptance --out docs/results/feddro_acceptance.json
    python -m experiments.feddro.acceptance --out runs/acc.json --seeds 0 --iterations 300   # a quick look

The data (spec check 5): 10 classes of Gaussians in 20-D, class means ``mu_c ~ N(0, I)`` rescaled
to norm ``0.8 sqrt(20) ~ 3.58``, ``x = mu_c + N(0, I)``; the minority classes 0-4 have 10
training samples each, the majority classes 5-9 500 each; a balanced test set of 200 per class.
Data seed ``100 + seed``; the run seed ``seed`` sets the split and the batch order. A multinomial
logistic regression started at ``W = 0``, K = 8 clients, batch 16, plain SGD with lr 0.05, all
clients at every step, T local iterations (``T / I`` rounds of I local steps).

* Check 5 (worst-class accuracy): FedAvg on the mean cross-entropy against FedDRO (KL-DRO with
  ``f = lam log``, lam = 2, beta = 0.5) on an equal random split, I = 1 and I = 8. Directional:
  FedDRO's worst-class test accuracy above FedAvg's on every seed, its mean accuracy not lower.
* Check 6 (plug-in bias): the vanilla compositional FedAvg (Algorithm 1 case I, each client
  normalizes with its own minibatch) against FedDRO, same objective, on the label-sorted split
  (client k holds the k-th block of the label-sorted data), I = 1 and I = 8. Directional: FedDRO's
  global KL-DRO objective ``lam log((1/n) sum_i exp(l_i / lam))`` on the whole training set lower on
  every seed, its worst-class accuracy not lower.

Each run is one ``Trainer.fit`` of the engine's classes (``client_backend="batched"`` with
``compile_step=True``); its final figures go into the result file (:mod:`experiments.results`)
as soon as it ends, with the commit it ran on, its device (the CPU), its environment, its seed and
its rounds. Runs already in the file are skipped, so a stopped experiment resumes.
"""

from __future__ import annotations

import argparse
import math
import time
from dataclasses import dataclass
from typing import Any, Optional

import numpy as np
import pytorch_lightning as pl
import torch
import torch.nn.functional as F
from torch.utils.data import Dataset, TensorDataset

from experiments import results
from fl_lightning.algorithms.fedavg import FedAvg
from fl_lightning.algorithms.feddro import CompositionalFedAvg, FedDRO
from fl_lightning.datamodules.base import FederatedDataModule
from fl_lightning.datamodules.partitioners import IidPartitioner, SortedPartitioner
from fl_lightning.functional.dro import KLDRO
from fl_lightning.models import LogisticRegression
from fl_lightning.module import FederatedModule

DIM, CLASSES, MINORITY, MAJORITY, TEST_PER_CLASS = 20, 10, 10, 500, 200
CLIENTS, BATCH, LR, LAM, BETA = 8, 16, 0.05, 2.0, 0.5
ALGORITHMS = ("fedavg", "feddro", "compfedavg")


def gaussian_classes(data_seed: int, minority: int = MINORITY, majority: int = MAJORITY,
                     test_per_class: int = TEST_PER_CLASS) -> tuple[TensorDataset, TensorDataset]:
    """The spec's imbalanced training set (``minority`` samples in classes 0-4, ``majority`` in 5-9)
    and its balanced test set (``test_per_class`` per class), float32 features, int64 labels."""
    rng = np.random.default_rng(data_seed)
    means = rng.standard_normal((CLASSES, DIM))
    means *= 0.8 * math.sqrt(DIM) / np.linalg.norm(means, axis=1, keepdims=True)

    def draw(counts: list[int]) -> TensorDataset:
        labels = np.repeat(np.arange(CLASSES), counts)
        x = means[labels] + rng.standard_normal((len(labels), DIM))
        return TensorDataset(torch.tensor(x, dtype=torch.float32), torch.tensor(labels))

    half = CLASSES // 2
    return draw([minority] * half + [majority] * half), draw([test_per_class] * CLASSES)


class GaussianClasses(FederatedDataModule):
    """:func:`gaussian_classes` split over ``num_clients`` clients (no validation split: the spec has none)."""

    def __init__(self, data_seed: int, split: str, seed: int, num_clients: int = CLIENTS, **sizes: int) -> None:
        if split not in ("iid", "sorted"):
            raise ValueError(f"split must be 'iid' or 'sorted', got {split!r}")
        partitioner = IidPartitioner() if split == "iid" else SortedPartitioner()
        super().__init__(num_clients=num_clients, partitioner=partitioner, val_fraction=0.0, batch_size=BATCH,
                         eval_batch_size=4096, seed=seed)
        self.data = gaussian_classes(data_seed, **sizes)

    def build_datasets(self) -> tuple[Dataset, Optional[Dataset]]:
        return self.data


@dataclass(frozen=True)
class Setting:
    """One run: the algorithm, the split, I, the number of local iterations and the seed."""

    algorithm: str
    split: str
    local_steps: int
    iterations: int
    seed: int

    @property
    def rounds(self) -> int:
        return self.iterations // self.local_steps

    @property
    def name(self) -> str:
        return f"{self.algorithm}_{self.split}_I{self.local_steps}_T{self.iterations}_s{self.seed}"


def build(setting: Setting, backend: str = "batched", compile_step: bool = True) -> FederatedModule:
    """The engine module of ``setting``: a zero-initialized logistic regression under FedAvg,
    FedDRO or the vanilla compositional FedAvg (case I), its clients run by ``backend``
    (``compile_step``: the batched backend's compiled step, worth its compile time on long runs)."""
    client = LogisticRegression(in_features=DIM, num_classes=CLASSES, lr=LR)
    with torch.no_grad():
        for p in client.parameters():
            p.zero_()
    common: dict[str, Any] = dict(clients_per_round=CLIENTS, local_steps=setting.local_steps, seed=setting.seed,
                                  client_backend=backend, compile_step=compile_step and backend == "batched")
    objective = KLDRO(lam=LAM, scale_by_lambda=True)
    if setting.algorithm == "fedavg":
        return FedAvg(client, **common)
    if setting.algorithm == "feddro":
        return FedDRO(client, objective, beta=BETA, **common)
    if setting.algorithm == "compfedavg":
        return CompositionalFedAvg(client, objective, case="I", **common)
    raise ValueError(f"algorithm must be one of {ALGORITHMS}, got {setting.algorithm!r}")


def quiet_trainer(rounds: int) -> pl.Trainer:
    """A CPU Trainer without validation, logger, checkpoints or progress bar."""
    return pl.Trainer(max_epochs=rounds, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                      enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
                      num_sanity_val_steps=0, default_root_dir="runs/feddro")


@torch.no_grad()
def measure(model: torch.nn.Module, train: TensorDataset, test: TensorDataset) -> dict[str, float]:
    """Test accuracy, worst-class and minority-half test accuracy, and the KL-DRO objective
    ``lam log((1/n) sum_i exp(l_i / lam))`` on the whole training set (float64)."""
    model.eval()
    x, y = test.tensors
    correct = (model(x).argmax(-1) == y).double()
    per_class = torch.stack([correct[y == c].mean() for c in range(CLASSES)])
    losses = F.cross_entropy(model(train.tensors[0]).double(), train.tensors[1], reduction="none")
    objective = LAM * (torch.logsumexp(losses / LAM, 0) - math.log(len(losses)))
    return {"test_acc": float(correct.mean()), "test_acc_worst_class": float(per_class.min()),
            "test_acc_minority": float(per_class[: CLASSES // 2].mean()), "train_dro_objective": float(objective)}


def run(setting: Setting, backend: str = "batched", compile_step: bool = True, **sizes: int) -> dict[str, float]:
    """Fit ``setting`` (:func:`build`; ``sizes``: :func:`gaussian_classes`' class sizes) and return
    its :func:`measure` figures."""
    module = build(setting, backend, compile_step)
    data = GaussianClasses(100 + setting.seed, setting.split, setting.seed, **sizes)
    quiet_trainer(setting.rounds).fit(module, data)
    return measure(module.client, *data.data)


def settings(seeds: list[int], iterations: int) -> list[Setting]:
    """The runs of checks 5 (FedAvg and FedDRO, iid split) and 6 (compositional FedAvg and FedDRO,
    sorted split), each at I = 1 and I = 8."""
    pairs = [("fedavg", "iid"), ("feddro", "iid"), ("compfedavg", "sorted"), ("feddro", "sorted")]
    return [Setting(a, split, i, iterations, s) for s in seeds for i in (1, 8) for a, split in pairs]


def mean_std(values: list[float]) -> str:
    """``mean ± sample std`` (ddof = 1); the mean alone for one value."""
    if len(values) < 2:
        return f"{values[0]:.4f}"
    return f"{np.mean(values):.4f} ± {np.std(values, ddof=1):.4f}"


def report(runs: list[results.Run]) -> str:
    """The table (mean ± sample std over seeds, and the per-seed values) and the verdict of each check."""
    lines = ["| check | split | I | algorithm | seeds | rounds | test acc | worst-class | minority (0-4) | "
             "train KL-DRO objective | worst-class per seed | objective per seed |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    verdicts = []
    for check, split, baseline in ((5, "iid", "fedavg"), (6, "sorted", "compfedavg")):
        for i in (1, 8):
            group = {a: sorted(results.select(runs, algorithm=a, split=split, local_steps=i),
                               key=lambda r: r["params"]["seed"]) for a in (baseline, "feddro")}
            for a, rs in group.items():
                if not rs:
                    continue
                col = {k: [r["history"][-1][k] for r in rs] for k in rs[0]["history"][-1] if k != "round"}
                lines.append(f"| {check} | {split} | {i} | {a} | {','.join(str(r['params']['seed']) for r in rs)} | "
                             f"{rs[0]['params']['rounds']} | {mean_std(col['test_acc'])} | "
                             f"{mean_std(col['test_acc_worst_class'])} | {mean_std(col['test_acc_minority'])} | "
                             f"{mean_std(col['train_dro_objective'])} | "
                             f"{', '.join(f'{v:.3f}' for v in col['test_acc_worst_class'])} | "
                             f"{', '.join(f'{v:.4f}' for v in col['train_dro_objective'])} |")
            paired = [(b, d) for b in group[baseline] for d in group["feddro"] if b["params"]["seed"] == d["params"]["seed"]]
            if paired:
                verdicts.append(f"check {check}, I = {i}: " + verdict(check, [(b["history"][-1], d["history"][-1])
                                                                            for b, d in paired]))
    return "\n".join(lines + [""] + verdicts)


def verdict(check: int, pairs: list[tuple[dict[str, float], dict[str, float]]]) -> str:
    """Whether FedDRO passes ``check`` on every (baseline, FedDRO) pair of final figures of a seed."""
    worst = [d["test_acc_worst_class"] - b["test_acc_worst_class"] for b, d in pairs]
    if check == 5:
        acc = [d["test_acc"] - b["test_acc"] for b, d in pairs]
        ok = min(worst) > 0 and np.mean(acc) >= 0
        what = (f"FedDRO - FedAvg worst-class per seed {', '.join(f'{w:+.3f}' for w in worst)}, "
                f"mean accuracy {np.mean(acc):+.4f}")
    else:
        objective = [d["train_dro_objective"] - b["train_dro_objective"] for b, d in pairs]
        ok = max(objective) < 0 and min(worst) >= 0
        what = (f"FedDRO - plug-in objective per seed {', '.join(f'{o:+.4f}' for o in objective)}, "
                f"worst-class {', '.join(f'{w:+.3f}' for w in worst)}")
    return f"{'PASS' if ok else 'FAIL'} ({what}, {len(pairs)} seeds)"


def main(argv: Optional[list[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default="docs/results/feddro_acceptance.json", help="the result file")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--iterations", type=int, default=3000, help="T, local iterations of every run")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    head = results.commit()
    done = {r["name"] for r in results.load(args.out)}
    for setting in settings(args.seeds, args.iterations):
        if setting.name in done:
            continue
        start = time.perf_counter()
        figures = run(setting)
        wall = time.perf_counter() - start
        params = dict(algorithm=setting.algorithm, split=setting.split, local_steps=setting.local_steps,
                      iterations=setting.iterations, rounds=setting.rounds, seed=setting.seed, lam=LAM, beta=BETA,
                      lr=LR, clients=CLIENTS, batch_size=BATCH)
        results.add(args.out, results.record(setting.name, head, params, wall,
                                             [{"round": setting.rounds, **figures}], "cpu"))
        print(f"{setting.name}: {figures} ({wall:.1f} s)", flush=True)
    print(report(results.load(args.out)))


if __name__ == "__main__":
    main()
