"""FedDRO and vanilla compositional FedAvg: the paper's counter-example, y-bar tracking, the
-ST construction, class metrics, ResNet20, argument checks, 2 processes == 1. The DRO
objectives and the STORM estimate are tested in tests/functional/test_dro.py."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import pytorch_lightning as pl
import torch
from torch import Tensor, nn
from torch.utils.data import TensorDataset

from fl_lightning.algorithms.fedavg import FedAvg
from fl_lightning.algorithms.feddro import CompositionalFedAvg, FedDRO, frozen_running_stats
from fl_lightning.callbacks.class_metrics import ClassAccuracy, class_accuracy_summary
from fl_lightning.datamodules.base import FederatedDataModule
from fl_lightning.datamodules.subsample import st_indices
from fl_lightning.functional.dro import KLDRO, CompositionalObjective, NonFiniteEstimateError
from fl_lightning.models.resnet import ResNet20
from tests.helpers import global_vector, synthetic, tiny_client, trainer


# ---------------------------------------------------------------- the paper's counter-example
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
        super().__init__(num_clients=2, partition="natural", batch_size=1)

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
    pass


class ToyFedAvg(ToyLosses, CompositionalFedAvg):
    pass


def fit_toy(module_cls: type, rounds: int, **kwargs: Any) -> float:
    module = module_cls(Scalar(kwargs.pop("lr")), ToyObjective(), clients_per_round=2, **kwargs)
    trainer(rounds, limit_val_batches=0).fit(module, TwoClients())
    return float(module.client.x.detach())


@pytest.mark.parametrize("case, expected", [("I", 1.191332), ("II", 1.117421)])
def test_vanilla_fedavg_stalls_away_from_the_optimum(case, expected):
    """Thm 4.1 / Fig. 6 with eta = 0.04, I = 2: x_bar stays >= 0.5 and settles at the spec's value, not at 0."""
    x = fit_toy(ToyFedAvg, 100, lr=0.04, case=case, local_steps=2)
    assert x == pytest.approx(expected, abs=1e-3)


@pytest.mark.parametrize("beta", [0.1, 1.0])
def test_feddro_converges_to_the_optimum(beta):
    """Sharing y every step fixes it: x_bar -> x* = 0 (beta = 1 is the "modified FedAvg"); I = 2."""
    x = fit_toy(ToyFedDRO, 100, lr=0.1, beta=beta, local_steps=2)
    assert abs(x) < 1e-3


# ------------------------------------------------------------------------ y-bar tracking
class RecordingFedDRO(FedDRO):
    """Records ``(y_bar, sum_k w_k g_k(x_k; full data))`` at every step."""

    def client_share(self, run, batch):
        full = self.datamodule.client_data(run.client_id).full()
        self.truth[run.client_id] = self.inner_mean(run, full)  # g_k at the client's current model x_k^t
        return super().client_share(run, batch)

    def server_share(self, mean):
        y_bar = super().server_share(mean)
        total = sum(self.datamodule.num_samples(c) for c in self.truth)
        truth = sum(self.datamodule.num_samples(c) / total * g for c, g in self.truth.items())
        self.trace.append((float(y_bar[0]), float(truth[0])))
        return y_bar


@pytest.mark.parametrize("beta", [0.2, 1.0])
def test_y_bar_tracks_the_true_average_of_g(beta):
    """Full-batch clients: y_bar^t equals sum_k w_k g_k(x_k^t) at every step, across model averagings (A4)."""
    torch.manual_seed(0)
    module = RecordingFedDRO(tiny_client(lr=0.05), KLDRO(lam=2.0), beta=beta, local_steps=3, clients_per_round=4, seed=1)
    module.trace, module.truth = [], {}
    trainer(4, limit_val_batches=0).fit(module, synthetic(4, batch_size=1000))
    y, truth = np.array(module.trace).T
    assert len(y) == 12
    assert np.abs(y - truth).max() < 1e-9 * np.abs(truth).max()
    assert np.ptp(truth) > 1e-2  # the models moved, so the identity is not trivial


# ----------------------------------------------------------------------- argument checks
def test_non_finite_estimates_stop_the_run():
    torch.manual_seed(0)
    module = FedDRO(tiny_client(lr=0.1), KLDRO(lam=1e-3), clients_per_round=4)  # exp(l / 1e-3) overflows
    with pytest.raises(NonFiniteEstimateError, match="not finite"):
        trainer(1, limit_val_batches=0).fit(module, synthetic(4))


@pytest.mark.parametrize(
    "make, match",
    [
        (lambda: FedDRO(tiny_client(), KLDRO(), beta=0.0), r"beta must be in \(0, 1\], got 0.0"),
        (lambda: CompositionalFedAvg(tiny_client(), KLDRO(), case="III"), "case must be 'I' or 'II', got 'III'"),
    ],
)
def test_bad_arguments_fail_clearly(make, match):
    with pytest.raises(ValueError, match=match):
        make()


def test_partial_participation_is_refused():
    module = FedDRO(tiny_client(), KLDRO(), clients_per_round=3)
    with pytest.raises(ValueError, match=r"clients_per_round must equal the number of training clients \(4\), got 3"):
        trainer(1).fit(module, synthetic(4))


@pytest.mark.parametrize("algorithm", [FedDRO, CompositionalFedAvg])
@pytest.mark.parametrize("option, value", [("momentum", 0.9), ("weight_decay", 0.01)])
def test_a_local_optimizer_other_than_plain_sgd_is_refused(algorithm, option, value):
    """The local step is x <- x - eta [grad h + grad g grad f(y)]: momentum or weight decay would change it silently."""
    client = tiny_client()
    setattr(client, option, value)
    message = f"{algorithm.__name__} needs plain SGD: the client's optimizer has {option}={value}"
    with pytest.raises(ValueError, match=message):
        trainer(1).fit(algorithm(client, KLDRO(), clients_per_round=4), synthetic(4))


# ------------------------------------------------------------------------ learning
def test_feddro_trains_and_mixed_precision_keeps_estimates_in_fp64():
    torch.manual_seed(0)
    start = global_vector(FedAvg(tiny_client(hidden=(8,))))
    module = FedDRO(tiny_client(hidden=(8,)), KLDRO(lam=2.0), beta=0.5, local_steps=2, clients_per_round=4)
    trainer(2, limit_val_batches=0, precision="bf16-mixed").fit(module, synthetic(4))
    assert module.y_bar.dtype == torch.float64 and float(module.y_bar[0]) >= 1.0
    assert (global_vector(module) - start).abs().max() > 1e-3


def test_frozen_running_stats_leaves_batch_norm_buffers_alone():
    bn = nn.BatchNorm1d(3)
    with frozen_running_stats(bn):
        out = bn(torch.randn(8, 3) * 5 + 2)
    assert torch.equal(bn.running_mean, torch.zeros(3)) and int(bn.num_batches_tracked) == 0
    assert out.mean(0).abs().max() < 1e-5 and bn.track_running_stats


@pytest.mark.slow
def test_two_processes_equal_one():
    def run(devices: int) -> Tensor:
        torch.manual_seed(0)
        module = FedDRO(tiny_client(hidden=(8,)), KLDRO(lam=2.0), beta=0.5, local_steps=3, clients_per_round=5, seed=2)
        strategy = "fl_ddp_spawn" if devices > 1 else "auto"
        trainer(2, devices=devices, strategy=strategy, limit_val_batches=0).fit(module, synthetic(5))
        return global_vector(module)

    assert (run(1) - run(2)).abs().max() <= 1e-5


def test_checkpoint_resume_is_exact(tmp_path):
    def module() -> FedDRO:
        torch.manual_seed(0)
        return FedDRO(tiny_client(hidden=(8,)), KLDRO(lam=2.0), beta=0.5, local_steps=2, clients_per_round=4)

    straight = module()
    trainer(4, limit_val_batches=0).fit(straight, synthetic(4))
    first = module()
    t = trainer(2, limit_val_batches=0)
    t.fit(first, synthetic(4))
    t.save_checkpoint(tmp_path / "r2.ckpt")
    resumed = module()
    trainer(4, limit_val_batches=0).fit(resumed, synthetic(4), ckpt_path=tmp_path / "r2.ckpt")
    assert torch.allclose(global_vector(straight), global_vector(resumed), atol=1e-6)
    assert torch.allclose(straight.y_bar, resumed.y_bar)


# ------------------------------------------------------------------ data, metrics, model
def test_st_indices_cut_the_first_half_to_their_last_images():
    labels = np.repeat(np.arange(4), 5)[np.random.default_rng(0).permutation(20)]
    idx = st_indices(labels, keep=2)
    kept = labels[idx]
    assert np.bincount(kept, minlength=4).tolist() == [2, 2, 5, 5]
    for c in (0, 1):
        assert idx[kept == c].tolist() == np.flatnonzero(labels == c)[-2:].tolist()
    assert np.bincount(labels[st_indices(labels, keep=2, minority_half="second")], minlength=4).tolist() == [5, 5, 2, 2]
    with pytest.raises(ValueError, match="minority_half must be 'first' or 'second', got 'middle'"):
        st_indices(labels, keep=2, minority_half="middle")


def test_class_accuracy_summary():
    correct = torch.tensor([1, 2, 9, 10])
    total = torch.tensor([10, 10, 10, 10])
    summary = class_accuracy_summary(correct, total, minority=[0, 1])
    assert summary == pytest.approx({"acc": 0.55, "acc_worst_class": 0.1, "acc_minority": 0.15, "acc_majority": 0.95})


def test_class_accuracy_callback_logs_worst_class():
    torch.manual_seed(0)
    module = FedAvg(tiny_client(), clients_per_round=4, local_steps=2)
    t = trainer(1, callbacks=[ClassAccuracy(num_classes=10)])
    t.fit(module, synthetic(4, test_fraction=0.3))
    logged = t.callback_metrics
    assert 0.0 <= float(logged["class/acc_worst_class"]) <= float(logged["class/acc"]) <= 1.0


def test_resnet20_shape_and_size():
    torch.manual_seed(0)
    model = ResNet20(num_classes=10)
    assert model(torch.randn(2, 3, 32, 32)).shape == (2, 10)
    assert 0.26e6 < sum(p.numel() for p in model.parameters()) < 0.28e6
