"""Server optimizers (FedAdam, FedYogi, FedAdagrad: Reddi et al. 2021, Algorithm 2; any
torch.optim optimizer) and client sampling by fraction (Flower's fraction_fit, min_fit_clients)."""

from __future__ import annotations

import math
import re
from functools import partial

import numpy as np
import pytest
import torch

from fl_lightning.algorithms import FedAvg
from fl_lightning.callbacks import FederatedCallback
from fl_lightning.cli import FederatedCLI
from fl_lightning.optim import FedAdagrad, FedAdam, FedYogi
from tests.helpers import global_vector, synthetic, tiny_client, trainer

ETA, TAU, B1, B2 = 0.1, 0.05, 0.9, 0.99
DELTAS = ([0.5, -0.1, 0.0], [-0.2, 0.3, 0.04])  # two rounds' mean model deltas Delta_t


def hand_steps(rule: str) -> list[float]:
    """Algorithm 2 of Reddi et al. written out per coordinate, m_{-1} = 0, v_{-1} = tau^2."""
    out = []
    for i in range(3):
        x, m, v = 1.0, 0.0, TAU**2
        for delta in DELTAS:
            d = delta[i]
            m = B1 * m + (1 - B1) * d
            if rule == "adagrad":
                v = v + d * d
            elif rule == "adam":
                v = B2 * v + (1 - B2) * d * d
            else:  # yogi
                v = v - (1 - B2) * d * d * math.copysign(1.0, v - d * d) if v != d * d else v
            x = x + ETA * m / (math.sqrt(v) + TAU)
        out.append(x)
    return out


@pytest.mark.parametrize("cls, rule", [(FedAdagrad, "adagrad"), (FedAdam, "adam"), (FedYogi, "yogi")])
def test_adaptive_server_step_matches_the_paper_by_hand(cls, rule):
    x = torch.nn.Parameter(torch.ones(3, dtype=torch.float64))
    opt = cls([x], lr=ETA, betas=(B1, B2), tau=TAU)
    for delta in DELTAS:
        x.grad = -torch.tensor(delta, dtype=torch.float64)  # the engine's pseudo-gradient is -Delta_t
        opt.step()
    assert x.detach().tolist() == pytest.approx(hand_steps(rule), abs=1e-12)


FLOWER_DELTAS = DELTAS + ([0.1, 0.2, -0.3],)  # three rounds: the bias correction changes every round


def flower_steps(rule: str) -> np.ndarray:
    """Flower's strategies written out as in ``flwr/server/strategy/fed{adam,yogi,adagrad}.py``
    (``aggregate_fit``; ``flwr/serverapp/strategy`` is the same): ``m_t`` and ``v_t`` start at 0,
    FedAdagrad passes ``beta_1 = 0``, FedAdam's step is ``eta * sqrt(1 - beta_2^(r+1)) / (1 - beta_1^(r+1))``
    in ``server_round`` r = 1, 2, ..."""
    beta_1 = 0.0 if rule == "adagrad" else B1
    current_weights, m_t, v_t = np.ones(3), np.zeros(3), np.zeros(3)
    for server_round, delta in enumerate(FLOWER_DELTAS, start=1):
        delta_t = np.array(delta)
        m_t = np.multiply(beta_1, m_t) + (1 - beta_1) * delta_t
        eta = ETA
        if rule == "adagrad":
            v_t = v_t + np.multiply(delta_t, delta_t)
        elif rule == "adam":
            v_t = B2 * v_t + (1 - B2) * np.multiply(delta_t, delta_t)
            eta = ETA * np.sqrt(1 - np.power(B2, server_round + 1.0)) / (1 - np.power(B1, server_round + 1.0))
        else:  # yogi
            v_t = v_t - (1.0 - B2) * np.multiply(delta_t, delta_t) * np.sign(v_t - np.multiply(delta_t, delta_t))
        current_weights = current_weights + eta * m_t / (np.sqrt(v_t) + TAU)
    return current_weights


@pytest.mark.parametrize("cls, rule", [(FedAdagrad, "adagrad"), (FedAdam, "adam"), (FedYogi, "yogi")])
def test_flower_convention_matches_flowers_strategies(cls, rule):
    def run(convention):
        x = torch.nn.Parameter(torch.ones(3, dtype=torch.float64))
        betas = None if cls is FedAdagrad and convention == "flower" else (B1, B2)
        opt = cls([x], lr=ETA, betas=betas, tau=TAU, convention=convention)
        path = []
        for delta in FLOWER_DELTAS:
            x.grad = -torch.tensor(delta, dtype=torch.float64)
            opt.step()
            path.append(x.detach().clone())
        return torch.stack(path)

    flower, reddi = run("flower"), run("reddi")
    np.testing.assert_allclose(flower[-1].numpy(), flower_steps(rule), rtol=0, atol=1e-12)
    assert (flower - reddi).abs().max() > 1e-2  # the conventions differ by far more than rounding


def test_flower_convention_is_checked():
    x = [torch.nn.Parameter(torch.zeros(1))]
    with pytest.raises(ValueError, match=r"convention must be one of \('reddi', 'flower'\), got 'keras'"):
        FedAdam(x, convention="keras")
    with pytest.raises(ValueError, match=r"betas\[0\] must be 0 with convention='flower' .*got betas=\(0.9, 0.99\)"):
        FedAdagrad(x, betas=(0.9, 0.99), convention="flower")
    assert FedAdagrad(x, convention="flower").param_groups[0]["betas"] == (0.0, 0.0)
    assert FedAdagrad(x).param_groups[0]["betas"] == (0.9, 0.99)


def test_a_server_optimizer_state_of_before_conventions_resumes_as_reddi():
    x = torch.nn.Parameter(torch.ones(3, dtype=torch.float64))
    opt = FedYogi([x], lr=ETA, betas=(B1, B2), tau=TAU)
    x.grad = -torch.tensor(DELTAS[0], dtype=torch.float64)
    opt.step()
    saved = opt.state_dict()
    del saved["param_groups"][0]["convention"], saved["state"][0]["step"]
    resumed = FedYogi([x], lr=ETA, betas=(B1, B2), tau=TAU, convention="flower")
    resumed.load_state_dict(saved)
    x.grad = -torch.tensor(DELTAS[1], dtype=torch.float64)
    resumed.step()
    assert resumed.param_groups[0]["convention"] == "reddi"
    assert x.detach().tolist() == pytest.approx(hand_steps("yogi"), abs=1e-12)


@pytest.mark.parametrize("weighting", [None, "num_samples"])
def test_fedadam_on_the_engine_applies_its_step_to_the_mean_delta(weighting):
    """Algorithm 2's Delta_t = (1/|S|) sum_i Delta_i (uniform: the default with these optimizers) on
    clients of unequal size; ``weighting="num_samples"`` gives the sample-weighted mean instead."""
    x0 = global_vector(FedAvg(tiny_client(), clients_per_round=4, local_steps=3))
    deltas = {}
    for mean in ("uniform", "num_samples"):  # FedAvg with server SGD(lr=1): x1 = x0 + Delta
        plain = FedAvg(tiny_client(), clients_per_round=4, local_steps=3, weighting=mean)
        trainer(1).fit(plain, synthetic(4))
        deltas[mean] = global_vector(plain) - x0
    assert (deltas["uniform"] - deltas["num_samples"]).abs().max() > 1e-3  # unequal clients: the means differ
    delta = deltas[weighting or "uniform"]
    adam = FedAvg(tiny_client(), clients_per_round=4, local_steps=3, weighting=weighting,
                  server_optimizer=partial(FedAdam, lr=ETA, betas=(B1, B2), tau=TAU))
    trainer(1).fit(adam, synthetic(4))
    m, v = (1 - B1) * delta, B2 * TAU**2 + (1 - B2) * delta**2
    torch.testing.assert_close(global_vector(adam), x0 + ETA * m / (v.sqrt() + TAU), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("cls", [FedAdam, FedYogi, FedAdagrad])
def test_reddi_server_optimizers_make_the_mean_uniform_by_default(cls):
    """A module with one of Reddi et al.'s optimizers averages uniformly unless ``weighting`` says
    otherwise; with torch's SGD (FedAvg) it weighs by sample count."""
    assert FedAvg(tiny_client(), server_optimizer=cls).weighting == "uniform"
    assert FedAvg(tiny_client(), server_optimizer=cls, weighting="num_samples").weighting == "num_samples"
    assert FedAvg(tiny_client(), server_optimizer=torch.optim.SGD).weighting == "num_samples"
    # Flower's strategies weigh the deltas by sample count: so does the Flower convention by default
    flower = partial(cls, convention="flower")
    assert FedAvg(tiny_client(), server_optimizer=flower).weighting == "num_samples"
    assert FedAvg(tiny_client(), server_optimizer=flower, weighting="uniform").weighting == "uniform"


def test_any_torch_optimizer_is_a_server_optimizer_from_the_cli(tmp_path):
    cli = FederatedCLI(args=[
        "--model=fl_lightning.algorithms.FedAvg",
        "--model.client=fl_lightning.models.LogisticRegression",
        "--model.client.in_features=20",
        "--model.server_optimizer=torch.optim.SGD",
        "--model.server_optimizer.lr=0.5",
        "--model.server_optimizer.momentum=0.9",
        "--data=fl_lightning.datamodules.SyntheticFederated",
        f"--trainer.default_root_dir={tmp_path}",
    ], run=False)
    opt = cli.model.configure_server_optimizer()
    assert isinstance(opt, torch.optim.SGD)
    assert opt.param_groups[0]["lr"] == 0.5 and opt.param_groups[0]["momentum"] == 0.9
    cli = FederatedCLI(args=[
        "--model=fl_lightning.algorithms.FedAvg",
        "--model.client=fl_lightning.models.LogisticRegression",
        "--model.server_optimizer=fl_lightning.optim.FedYogi",
        "--model.server_optimizer.tau=0.01",
        "--data=fl_lightning.datamodules.SyntheticFederated",
        f"--trainer.default_root_dir={tmp_path}",
    ], run=False)
    opt = cli.model.configure_server_optimizer()
    assert isinstance(opt, FedYogi) and opt.param_groups[0]["tau"] == 0.01
    assert cli.model.weighting == "uniform"  # Algorithm 2's mean, also for an optimizer given from YAML


@pytest.mark.parametrize("bad", [{"tau": 0.0}, {"lr": -1.0}, {"betas": (1.5, 0.9)}])
def test_adaptive_optimizers_refuse_bad_settings(bad):
    name = "betas[0]" if "betas" in bad else next(iter(bad))
    with pytest.raises(ValueError, match=rf"{re.escape(name)}"):
        FedAdam([torch.nn.Parameter(torch.zeros(1))], **bad)


class RecordClients(FederatedCallback):
    """Keeps each round's sampled clients."""

    def __init__(self) -> None:
        self.rounds: list[list[int]] = []

    def on_round_end(self, trainer, module, round_idx, aggregate) -> None:
        self.rounds.append(list(module.engine.round_clients))


@pytest.mark.parametrize("fraction, min_clients, expected", [(0.5, 1, 5), (0.25, 1, 2), (0.1, 3, 3), (1.0, 1, 10)])
def test_sampling_by_fraction_takes_max_of_min_clients_and_the_share(fraction, min_clients, expected):
    record = RecordClients()
    module = FedAvg(tiny_client(), clients_fraction=fraction, min_clients=min_clients, local_steps=1)
    trainer(3, callbacks=[record]).fit(module, synthetic(10))
    assert [len(c) for c in record.rounds] == [expected] * 3
    assert all(len(set(c)) == expected for c in record.rounds)


def test_sampling_settings_are_checked():
    with pytest.raises(ValueError, match="at most one of clients_per_round and clients_fraction"):
        FedAvg(tiny_client(), clients_per_round=3, clients_fraction=0.5)
    with pytest.raises(ValueError, match="clients_fraction"):
        FedAvg(tiny_client(), clients_fraction=0.0)
    with pytest.raises(ValueError, match="min_clients=20 \\(with clients_fraction=0.5\\) is above the number of training clients \\(10\\)"):
        trainer(1).fit(FedAvg(tiny_client(), clients_fraction=0.5, min_clients=20, local_steps=1), synthetic(10))


def test_a_bad_server_optimizer_is_refused_at_construction_naming_it():
    """A server optimizer that cannot be made (a negative rate) or is no maker of one fails when the module
    is built, naming ``server_optimizer``, not at the first round's end."""
    import functools

    with pytest.raises(ValueError, match=r"server_optimizer=.*SGD.*cannot make an optimizer of the global model: "
                                         r"Invalid learning rate: -1.0"):
        FedAvg(tiny_client(), server_optimizer=functools.partial(torch.optim.SGD, lr=-1.0))
    with pytest.raises(ValueError, match=r"server_optimizer must be None or a callable .*got 'adam'"):
        FedAvg(tiny_client(), server_optimizer="adam")
    with pytest.raises(ValueError, match=r"server_optimizer must make a torch.optim.Optimizer, got list"):
        FedAvg(tiny_client(), server_optimizer=list)
