"""The paper's two-client counter-example (Appendix D, Thm 4.1, Fig. 6; spec §6.1 checks 1 and 2) on the engine.

    python -m experiments.feddro.counterexample --out docs/results/feddro_counterexample.json

Client 1 holds ``g_1(x) = 4x - 4``, client 2 ``g_2(x) = -2x + 4``, ``f(y) = sqrt(y^2 + 4)``, ``h = 0``:
``Phi(x) = f((g_1 + g_2) / 2) = sqrt(x^2 + 4)``, minimized at ``x* = 0``, from ``x_bar^0 = 0.5``.
Full-batch, deterministic (one sample per client, batch 1), plain SGD. The vanilla compositional
FedAvg (Algorithm 1, cases I and II) stalls above 1 (the spec's values: check 1); FedDRO, which
averages the inner estimate at every step, reaches ``x* = 0`` (check 2). Each run's final
``x_bar`` goes into the result file (:mod:`experiments.results`) with the commit it ran on, its device
(the CPU) and its environment.
``tests/test_feddro.py`` runs a short version of both checks with these classes.
"""

from __future__ import annotations

import argparse
import time
from typing import Any, Optional

import pytorch_lightning as pl
import torch
from torch import Tensor, nn
from torch.utils.data import TensorDataset

from experiments import results
from experiments.feddro.acceptance import quiet_trainer
from fl_lightning.algorithms.feddro import CompositionalFedAvg, FedDRO
from fl_lightning.datamodules.base import FederatedDataModule
from fl_lightning.functional.dro import CompositionalObjective

#: the spec's limits of x_bar for the vanilla compositional FedAvg (check 1), by (case, eta, I)
SPEC_LIMITS = {("I", 0.01, 2): 1.1737, ("I", 0.02, 2): 1.1792, ("I", 0.04, 2): 1.1913,
               ("II", 0.01, 2): 1.0705, ("II", 0.02, 2): 1.0858, ("II", 0.04, 2): 1.1174,
               ("I", 0.04, 5): 1.259, ("II", 0.04, 5): 1.252, ("I", 0.04, 10): 1.351, ("II", 0.04, 10): 1.351}


class ToyObjective(CompositionalObjective):
    """Appendix D: ``f(y) = sqrt(y^2 + 4)``, ``g_k(x) = a_k x + b_k``, ``h = 0``."""

    def terms(self, losses: Tensor) -> tuple[Tensor, Tensor]:
        losses = losses.double()
        return torch.zeros_like(losses), losses.unsqueeze(-1)

    def outer(self, y: Tensor) -> Tensor:
        return torch.sqrt(y**2 + 4).sum()

    def outer_grad(self, y: Tensor) -> Tensor:
        return y / torch.sqrt(y**2 + 4)


class Scalar(pl.LightningModule):
    """One parameter ``x`` (0.5 at start), plain SGD."""

    def __init__(self, lr: float) -> None:
        super().__init__()
        self.x = nn.Parameter(torch.tensor([0.5], dtype=torch.float64))
        self.lr = lr

    def forward(self, coeffs: Tensor) -> Tensor:
        return coeffs[:, 0] * self.x + coeffs[:, 1]

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=self.lr)


class TwoClients(FederatedDataModule):
    """Client 0 holds ``g_1 = 4x - 4``, client 1 holds ``g_2 = -2x + 4`` (one sample each)."""

    def __init__(self) -> None:
        super().__init__(num_clients=2, partition="natural", batch_size=1, val_fraction=0.0)

    def build_datasets(self):
        coeffs = torch.tensor([[4.0, -4.0], [-2.0, 4.0]], dtype=torch.float64)
        return TensorDataset(coeffs, torch.tensor([0, 1])), None

    def partition_keys(self):
        return [0, 1]


class ToyLosses:
    """Per-sample "losses" of the toy are the values ``a_k x + b_k`` of the client's ``g_k``."""

    def sample_losses(self, output: Tensor, batch: Any) -> Tensor:
        return output


class ToyFedDRO(ToyLosses, FedDRO):
    """FedDRO on the toy."""


class ToyFedAvg(ToyLosses, CompositionalFedAvg):
    """The vanilla compositional FedAvg (Algorithm 1) on the toy."""


def fit_toy(module_cls: type, rounds: int, lr: float, **kwargs: Any) -> float:
    """``x_bar`` after ``rounds`` rounds of ``module_cls`` (``ToyFedAvg`` or ``ToyFedDRO``) with
    local rate ``lr`` and its other arguments (``case``, ``beta``, ``local_steps``)."""
    module = module_cls(Scalar(lr), ToyObjective(), clients_per_round=2, **kwargs)
    quiet_trainer(rounds).fit(module, TwoClients())
    return float(module.client.x.detach())


def runs(iterations: int) -> list[tuple[str, type, dict[str, Any]]]:
    """(name, class, arguments) of check 1 (vanilla FedAvg, cases I and II, the spec's eta and I)
    and check 2 (FedDRO, beta in {0.1, 0.9, 1}, eta in {0.01, 0.04}, I in {2, 10}); every run
    takes ``iterations`` local steps."""
    vanilla = [(f"compfedavg_case{case}_lr{lr:g}_I{i}", ToyFedAvg, dict(case=case, lr=lr, local_steps=i))
               for case, lr, i in SPEC_LIMITS]
    feddro = [(f"feddro_beta{beta:g}_lr{lr:g}_I{i}", ToyFedDRO, dict(beta=beta, lr=lr, local_steps=i))
              for beta in (0.1, 0.9, 1.0) for lr in (0.01, 0.04) for i in (2, 10)]
    return [(f"{name}_T{iterations}", cls, kw) for name, cls, kw in vanilla + feddro]


def main(argv: Optional[list[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default="docs/results/feddro_counterexample.json", help="the result file")
    parser.add_argument("--iterations", type=int, default=4000, help="local steps of every run")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    head = results.commit()
    done = {r["name"] for r in results.load(args.out)}
    print("| algorithm | eta | I | beta | rounds | x_bar at the end | spec |\n|---|---|---|---|---|---|---|")
    for name, cls, kw in runs(args.iterations):
        rounds = args.iterations // kw["local_steps"]
        if name not in done:
            start = time.perf_counter()
            x = fit_toy(cls, rounds, **kw)
            params = dict(algorithm=cls.__name__, **kw, rounds=rounds, seed=0)
            results.add(args.out, results.record(name, head, params, time.perf_counter() - start,
                                                 [{"round": rounds, "x_bar": x}], "cpu"))
        run = next(r for r in results.load(args.out) if r["name"] == name)
        x = results.last(run, "x_bar")
        if cls is ToyFedAvg:
            spec = f"{SPEC_LIMITS[(kw['case'], kw['lr'], kw['local_steps'])]:.4f}"
            label, beta = f"vanilla comp. FedAvg, case {kw['case']}", "-"
        else:
            spec, label, beta = "→ 0 (\\|x\\| < 1e-7)", "FedDRO", f"{kw['beta']:g}"
        print(f"| {label} | {kw['lr']:g} | {kw['local_steps']} | {beta} | {rounds} | {x:.5g} | {spec} |", flush=True)


if __name__ == "__main__":
    main()
