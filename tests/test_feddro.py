"""FedDRO and vanilla compositional FedAvg: the paper's counter-example, y-bar tracking, the spec's
checks 5 and 6 (worst-class accuracy, plug-in bias) at a reduced size, the lr drop placed in epochs
and the configs' schedule, the -ST construction, class metrics, ResNet20, argument checks,
2 processes == 1. The DRO
objectives and the STORM estimate are tested in tests/functional/test_dro.py."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset

from experiments.feddro.acceptance import Setting, run
from experiments.feddro.counterexample import ToyFedAvg, ToyFedDRO, fit_toy
from fl_lightning.algorithms.fedavg import FedAvg
from fl_lightning.algorithms.feddro import CompositionalFedAvg, FedDRO, frozen_running_stats
from fl_lightning.callbacks.class_metrics import ClassAccuracy, class_accuracy_summary
from fl_lightning.cli import FederatedCLI
from fl_lightning.datamodules.subsample import st_indices
from fl_lightning.functional.dro import KLDRO, NonFiniteEstimateError
from fl_lightning.hooks import FederatedCallback
from fl_lightning.models import LogisticRegression
from fl_lightning.models.resnet import ResNet20
from fl_lightning.schedules import epochs_per_round, lr_drop_rounds
from tests.helpers import global_vector, synthetic, tiny_client, trainer


# ---------------------------------------------------------------- the paper's counter-example
# (the classes and the command that runs the spec's grid: experiments/feddro/counterexample.py)
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


def test_the_counterexample_records_each_run_with_its_commit_device_and_environment(tmp_path, monkeypatch):
    """``experiments.feddro.counterexample`` writes one record per setting, each naming the commit, the device
    and the environment it ran with, and the run's final x_bar as ``fit_toy`` gives it."""
    from experiments import results
    from experiments.feddro import counterexample

    monkeypatch.setenv("FL_LIGHTNING_COMMIT", "0123abc")
    out = tmp_path / "toy.json"
    counterexample.main(["--out", str(out), "--iterations", "10"])
    records = results.load(out)
    assert [r["name"] for r in records] == [name for name, _, _ in counterexample.runs(10)]
    for record in records:
        assert record["commit"] == "0123abc" and record["device"] == "cpu"
        assert record["env"] == {**results.environment(), "threads": 1}  # the script's one thread
    first = records[0]
    kw = {k: first["params"][k] for k in ("case", "lr", "local_steps")}
    assert results.last(first, "x_bar") == fit_toy(ToyFedAvg, first["params"]["rounds"], **kw)


# ------------------------------------------------------------------------ y-bar tracking
class RecordingFedDRO(FedDRO):
    """Records ``(y_bar, sum_k w_k g_k(x_k; full data))`` at every step."""

    def client_share(self, run, batch):
        full = self.engine.datamodule.client_data(run.client_id).full()
        self.truth[run.client_id] = self.inner_mean(run, full)  # g_k at the client's current model x_k^t
        return super().client_share(run, batch)

    def server_share(self, mean):
        y_bar = super().server_share(mean)
        total = sum(self.engine.datamodule.num_samples(c) for c in self.truth)
        truth = sum(self.engine.datamodule.num_samples(c) / total * g for c, g in self.truth.items())
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
        (lambda: FedDRO(tiny_client(), KLDRO(), lr_drop_epochs=[90, 30]),
         r"lr_drop_epochs must be increasing numbers > 0 \(passes over a client's training split\), got \[90.0, 30.0\]"),
        (lambda: FedDRO(tiny_client(), KLDRO(), lr_drop_epochs=[90], lr_drop_gamma=2.0),
         r"lr_drop_gamma must be in \(0, 1\], got 2.0"),
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


# ------------------------------------------------------------- the lr drop placed in epochs
class LocalRates(FederatedCallback):
    """Records the scheduled local learning rate of every round."""

    def __init__(self) -> None:
        self.rates: list[float] = []

    def on_round_start(self, trainer, module, round_idx, clients):
        self.rates.append(module.engine.local_lr)


def test_lr_drop_epochs_become_rounds_from_the_training_split():
    """80 samples per client, 72 train after the 10 % validation split: 72 // 16 = 4 steps per pass,
    2 rounds per pass at I = 2, so the drop after epoch 1.5 comes after round ceil(1.5 * 4 / 2) = 3
    (after round 2 without the validation split: 80 // 16 = 5 steps per pass)."""
    rates = LocalRates()
    module = FedDRO(tiny_client(lr=0.1), KLDRO(lam=2.0), local_steps=2, clients_per_round=4, lr_drop_epochs=[1.5],
                    lr_drop_gamma=0.5)
    trainer(5, callbacks=[rates], limit_val_batches=0).fit(module, synthetic(4, min_samples=80, max_samples=80))
    assert rates.rates == pytest.approx([0.1, 0.1, 0.1, 0.05, 0.05])


def test_lr_drop_epochs_are_refused_where_the_algorithm_schedules_its_own_rate():
    from fl_lightning.algorithms import RAGA

    with pytest.raises(ValueError, match=r"lr_drop_epochs=\[2.0\]: RAGA schedules its local learning rate itself"):
        RAGA(tiny_client(), lr_drop_epochs=[2])


def test_lr_drop_epochs_and_a_client_scheduler_are_refused_together():
    client = LogisticRegression(in_features=20, num_classes=10, lr_milestones=[3])
    module = FedAvg(client, clients_per_round=4, lr_drop_epochs=[2])
    with pytest.raises(ValueError, match=r"lr_drop_epochs=\[2.0\] and the client's own lr scheduler both"):
        trainer(1).fit(module, synthetic(4))


CIFAR10_TRAIN = [5000] * 10
MNIST_TRAIN = [5923, 6742, 5958, 6131, 5842, 5421, 5918, 6265, 5851, 5949]


@pytest.mark.parametrize(
    "config, class_sizes, steps_per_pass, drop_round",
    [
        # 5 * 100 + 5 * 5000 = 25,500 images, 8 clients, 10 % validation: 2,868-2,870 train, // 16 = 179;
        # I = 1: after round 90 * 179 = 16,110 (the config's old milestone, 18,000, was epoch 100.6)
        ("cifar10_st.yaml", CIFAR10_TRAIN, 179, 16_110),
        # 500 + 29,404 = 29,904 images: 3,362-3,365 train, // 16 = 210; I = 8: ceil(90 * 210 / 8) = 2,363
        ("mnist_st.yaml", MNIST_TRAIN, 210, 2_363),
    ],
)
def test_feddro_configs_drop_the_lr_after_epoch_90(config, class_sizes, steps_per_pass, drop_round, monkeypatch):
    """Spec A11: the x0.1 drop after local epoch 90 with the configs' default validation split. The
    config is parsed and built by the CLI; the data are labels only (the -ST cut and the splits
    only read labels), in the real training sets' class sizes."""
    monkeypatch.setattr("sys.argv", ["fl-lightning"])
    path = Path(__file__).resolve().parents[1] / "configs" / "feddro" / config
    cli = FederatedCLI(args=["--config", str(path), "--trainer.logger", "false", "--trainer.accelerator", "cpu"],
                       run=False)
    dm, module = cli.datamodule, cli.model
    labels = torch.cat([torch.full((n,), c) for c, n in enumerate(class_sizes)])
    monkeypatch.setattr(dm, "build_datasets", lambda: (TensorDataset(torch.zeros(len(labels), 1), labels), None))
    monkeypatch.setattr(dm, "print_summary", False)
    dm.setup("fit")
    sizes = [dm.num_samples(c) for c in dm.train_clients]
    assert dm.val_fraction == 0.1 and len(sizes) == 8 and {n // 16 for n in sizes} == {steps_per_pass}
    per_round = epochs_per_round(sizes, dm.batch_size, module.local_steps, module.local_epochs)
    assert module.lr_drop_epochs == [90.0] and module.lr_drop_gamma == 0.1
    assert lr_drop_rounds(module.lr_drop_epochs, per_round) == [drop_round]
    assert (drop_round - 1) * module.local_steps < 90 * steps_per_pass <= drop_round * module.local_steps


# ------------------------------------------------------------------------ learning
def test_feddro_trains_and_mixed_precision_keeps_estimates_in_fp64():
    torch.manual_seed(0)
    start = global_vector(FedAvg(tiny_client(hidden=(8,))))
    module = FedDRO(tiny_client(hidden=(8,)), KLDRO(lam=2.0), beta=0.5, local_steps=2, clients_per_round=4)
    trainer(2, limit_val_batches=0, precision="bf16-mixed").fit(module, synthetic(4))
    assert module.y_bar.dtype == torch.float64 and float(module.y_bar[0]) >= 1.0
    assert (global_vector(module) - start).abs().max() > 1e-3


# ------------------------------------------- spec checks 5 and 6 (experiments/feddro/acceptance.py)
# Reduced from the spec's size: T = 400 local iterations (50 rounds of I = 8) instead of 3000, one
# seed, the sequential backend (no compile time); the data, the model, K = 8, b = 16, lr 0.05,
# lam = 2 and beta = 0.5 are the spec's. At this size FedDRO's margins over seeds 0-3 were
# 0.04-0.22 in worst-class accuracy (check 5) and 3-4 % of the KL-DRO objective (check 6).
SMALL = dict(local_steps=8, iterations=400, seed=0)


def test_feddro_raises_the_worst_class_accuracy_of_fedavg():
    """Check 5: on the equal random split of the imbalanced Gaussian classes, FedDRO's worst-class
    test accuracy is above FedAvg's (0.24 against 0.025 for seed 0) and its mean accuracy not lower."""
    fedavg = run(Setting("fedavg", "iid", **SMALL), backend="sequential")
    feddro = run(Setting("feddro", "iid", **SMALL), backend="sequential")
    assert feddro["test_acc_worst_class"] > fedavg["test_acc_worst_class"]
    assert feddro["test_acc"] >= fedavg["test_acc"]


def test_feddro_lowers_the_global_dro_objective_of_the_plug_in():
    """Check 6: on the label-sorted split, FedDRO's global KL-DRO objective on the whole training set
    is below the plug-in's (Algorithm 1 case I: each client normalizes with its own minibatch;
    0.190 against 0.196 for seed 0) and its worst-class accuracy not lower."""
    plug_in = run(Setting("compfedavg", "sorted", **SMALL), backend="sequential")
    feddro = run(Setting("feddro", "sorted", **SMALL), backend="sequential")
    assert feddro["train_dro_objective"] < plug_in["train_dro_objective"]
    assert feddro["test_acc_worst_class"] >= plug_in["test_acc_worst_class"]


def test_frozen_running_stats_leaves_batch_norm_buffers_alone():
    bn = nn.BatchNorm1d(3)
    with frozen_running_stats(bn):
        out = bn(torch.randn(8, 3) * 5 + 2)
    assert torch.equal(bn.running_mean, torch.zeros(3)) and int(bn.num_batches_tracked) == 0
    assert out.mean(0).abs().max() < 1e-5 and bn.track_running_stats


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
