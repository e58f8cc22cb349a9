"""The contract every algorithm keeps: two rounds on tiny data with each of the engine's features
(local finetuning, client metrics, an update attack, a robust aggregator, bf16-mixed), and the engine's
promises checked by ``fl_lightning.testing.check_algorithm`` (resume, two processes giving the result of one,
the batched backend, NaN updates left out, no per-client state outside the declared entries)."""

from __future__ import annotations

import copy
import pickle
from typing import Any, Callable

import pytest
import pytorch_lightning as pl
import torch

from fl_lightning.algorithms import (
    RAGA,
    RFA,
    SCAFFOLD,
    ByrdSAGA,
    CompositionalFedAvg,
    FastDRO,
    FedAvg,
    FedDeper,
    FedDRO,
    FedProx,
    FedProxVR,
    LocalOnly,
    PeFLL,
    PFedHN,
)
from fl_lightning.callbacks import ClientMetrics, CoordinateMedian, FederatedCallback, GaussianAttack, LocalFinetuning
from fl_lightning.functional.dro import KLDRO
from fl_lightning.models.hypernetwork import MLPEmbedding
from fl_lightning.module import FederatedModule
from fl_lightning.testing import PROPERTIES, check_algorithm
from tests.helpers import TWO_PROCESSES, synthetic, tiny_client, trainer

CLIENTS = 6


def _client(**kwargs):
    return tiny_client(hidden=(8,), **kwargs)


def _embedding() -> MLPEmbedding:
    """PeFLL's embedding network, initialized from seed 1 (the global RNG left as it was)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(1)
        return MLPEmbedding(20, 10, 4, hidden=(8,))


#: every algorithm of the package, built tiny: its class, its arguments (FedProxVR's clients_per_round=None: all
#: clients, its default) and its client
ALGORITHMS: dict[str, tuple[type[FederatedModule], dict[str, Any], Callable[[], pl.LightningModule]]] = {
    "FedAvg": (FedAvg, dict(clients_per_round=3, local_steps=2), _client),
    "FedProx": (FedProx, dict(mu=0.1, clients_per_round=3, local_steps=2), _client),
    "SCAFFOLD": (SCAFFOLD, dict(clients_per_round=3, local_steps=2), _client),
    "FedDeper": (FedDeper, dict(rho=0.1, clients_per_round=3, local_steps=2), _client),
    "FedProxVR-SVRG": (FedProxVR, dict(estimator="svrg", mu=0.1, local_steps=2, output_iterate="last",
                                       clients_per_round=None), _client),
    "FedProxVR-SARAH": (FedProxVR, dict(estimator="sarah", mu=0.1, local_steps=2, clients_per_round=None), _client),
    "RAGA": (RAGA, dict(clients_per_round=3, local_steps=2), _client),
    "RFA": (RFA, dict(clients_per_round=3, local_steps=2), _client),
    "ByrdSAGA": (ByrdSAGA, dict(clients_per_round=3), _client),
    "FedDRO": (FedDRO, dict(objective=KLDRO(lam=2.0), beta=0.5, local_steps=2, clients_per_round=CLIENTS), _client),
    "CompositionalFedAvg": (CompositionalFedAvg, dict(objective=KLDRO(lam=2.0), case="II", local_steps=2,
                                                      clients_per_round=CLIENTS), _client),
    "PeFLL": (PeFLL, dict(embedding=_embedding(), hypernetwork_width=8, clients_per_round=3,
                          local_steps=2), tiny_client),
    "PFedHN": (PFedHN, dict(embedding_dim=4, hypernetwork_width=8, new_client_rounds=1, clients_per_round=3,
                            local_steps=2), tiny_client),
    "LocalOnly": (LocalOnly, dict(clients_per_round=CLIENTS, local_steps=2), _client),
    "FastDRO": (FastDRO, dict(alpha=0.3, clients_per_round=3, local_steps=2), _client),
}


def build(name: str) -> FederatedModule:
    cls, kwargs, client = ALGORITHMS[name]
    module = client()
    torch.manual_seed(0)
    return cls(module, **copy.deepcopy(kwargs))


def data():
    return synthetic(CLIENTS, test_fraction=0.3)


def outcome(module: FederatedModule) -> dict[str, torch.Tensor]:
    """Everything a run produced: the module's tensors and every stored client entry."""
    out = {f"module.{k}": v.detach().cpu().float() for k, v in module.state_dict().items() if v.is_floating_point()}
    for cid in module.engine.store.clients():
        for name in module.engine.state_specs:
            value = module.engine.store.get(cid, name)
            if value is not None:
                out[f"store.{cid}.{name}"] = value
    return out


def assert_same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], atol: float = 0.0) -> None:
    assert a.keys() == b.keys()
    for key in a:
        assert (a[key] - b[key]).abs().max() <= atol, key


NAMES = list(ALGORITHMS)


#: the algorithms that train no global model (every client's model comes from the algorithm)
WITHOUT_GLOBAL_MODEL = ("PeFLL", "PFedHN", "LocalOnly")


#: each algorithm's default client weights of its mean (or geometric median) aggregate: its paper's
PAPER_WEIGHTING = {
    "FedAvg": "num_samples",  # McMahan et al., Algorithm 1: n_k / n
    "FedProx": "num_samples",  # Li et al. sample with p_k = n_k / n and average uniformly; sampled uniformly: n_k / n
    "SCAFFOLD": "uniform",  # Karimireddy et al., Algorithm 1: x + eta_g / |S| sum dy_i
    "FedDeper": "uniform",  # spec A5
    "FedProxVR-SVRG": "num_samples",  # spec A14: D_n / D
    "FedProxVR-SARAH": "num_samples",
    "RAGA": "num_samples",  # alpha_m = S_m / sum S
    "RFA": "num_samples",  # alpha_k = n_k / n
    "ByrdSAGA": "uniform",  # the unweighted geometric median
    "FedDRO": "num_samples",  # spec A7: n_k / n for x_bar (and y_bar)
    "CompositionalFedAvg": "num_samples",
    "PeFLL": "uniform",  # Algorithm 2: mean over |P|
    "PFedHN": "uniform",
    "LocalOnly": "num_samples",  # nothing is aggregated
    "FastDRO": "num_samples",  # FedAvg's mean (the paper's baseline is a one-client federation)
}


@pytest.mark.parametrize("name", NAMES)
def test_default_weighting_is_the_papers(name):
    """The mean aggregate (and a robust default aggregator) weighs clients as the algorithm's paper."""
    module = build(name)
    assert module.weighting == PAPER_WEIGHTING[name]
    if module.default_aggregator is not None:  # a robust rule of the algorithm's: the same weights
        assert module.default_aggregator.weighting == module.weighting


@pytest.mark.parametrize("cls", [RAGA, RFA, ByrdSAGA])
def test_weighting_is_one_argument_away_for_robust_aggregators(cls):
    other = {"num_samples": "uniform", "uniform": "num_samples"}[cls.paper.weighting]
    assert cls(_client(), weighting=other).default_aggregator.weighting == other


def test_weighting_is_checked():
    with pytest.raises(ValueError, match=r"weighting must be 'num_samples', 'uniform' or None .*got 'median'"):
        FedAvg(_client(), weighting="median")


@pytest.mark.parametrize("name", NAMES)
def test_local_finetuning_and_client_metrics(name):
    module = build(name)
    before = module.global_model.flatten()
    t = trainer(2, callbacks=[LocalFinetuning(steps=2), ClientMetrics()], check_val_every_n_epoch=2)
    if name in WITHOUT_GLOBAL_MODEL:  # finetuning a global model makes no sense: refused before any round
        with pytest.raises(ValueError, match=f"LocalFinetuning finetunes the global model, and {module.__class__.__name__} "
                                             "trains none.*ClientMetrics"):
            t.fit(module, data())
        assert t.current_epoch == 0
        return
    t.fit(module, data())
    for metric in ("finetuned_test/acc_mean", "clients_test/acc_mean"):
        assert 0.0 <= float(t.callback_metrics[metric]) <= 1.0
    after = module.global_model.flatten()
    assert torch.isfinite(after).all()
    t.validate(module, data(), verbose=False)  # finetuning leaves the global model alone
    assert torch.equal(module.global_model.flatten(), after)
    assert not torch.equal(after, before)


def test_client_metrics_alone_evaluate_the_algorithms_without_a_global_model():
    for name in WITHOUT_GLOBAL_MODEL:
        t = trainer(2, callbacks=[ClientMetrics()], check_val_every_n_epoch=2)
        t.fit(build(name), data())
        assert 0.0 <= float(t.callback_metrics["clients_test/acc_mean"]) <= 1.0


class CountingMedian(CoordinateMedian):
    """The coordinate median, counting the rounds it aggregates."""

    calls = 0

    def aggregate(self, trainer, module, updates):
        self.calls += 1
        return super().aggregate(trainer, module, updates)


@pytest.mark.parametrize("name", NAMES)
def test_an_update_attack_and_a_robust_aggregator(name):
    module = build(name)
    aggregator = CountingMedian()
    t = trainer(2, callbacks=[GaussianAttack(count=1, std=0.1), aggregator])
    if name == "LocalOnly":  # nothing is uploaded: an update attack and an aggregator have nothing to act on
        with pytest.raises(ValueError, match="GaussianAttack forges what Byzantine clients upload, and LocalOnly "
                                             "uploads nothing.*LabelFlipAttack"):
            t.fit(module, data())
        with pytest.raises(ValueError, match="CoordinateMedian combines the uploads declared with reduction "
                                             "'aggregator', and LocalOnly declares none"):
            trainer(2, callbacks=[CoordinateMedian()]).fit(build(name), data())
        return
    t.fit(module, data())
    assert torch.isfinite(module.global_model.flatten()).all()
    assert float(t.callback_metrics["attack/byzantine_fraction"]) > 0
    assert aggregator.calls == 2  # the Trainer's aggregator replaced the algorithm's own in every round


class AutocastProbe(FederatedCallback):
    """Records whether autocast is on in the client's forward during local work and in the round's end."""

    def __init__(self) -> None:
        self.local: list[bool] = []
        self.round_end: list[bool] = []

    def on_fit_start(self, trainer, module):
        def record(*_):
            if trainer.training:
                self.local.append(torch.is_autocast_enabled("cpu"))

        module.client.register_forward_hook(record)

    def on_round_updates(self, trainer, module, updates):
        self.round_end.append(torch.is_autocast_enabled("cpu"))
        return updates

    def on_round_end(self, trainer, module, round_idx, aggregate):
        self.round_end.append(torch.is_autocast_enabled("cpu"))


@pytest.mark.parametrize("name", NAMES)
def test_bf16_mixed(name):
    """Local steps run inside the precision plugin's autocast; the round's end (aggregation, server
    update, algorithm state) outside it, in fp32 or wider."""
    module = build(name)
    probe = AutocastProbe()
    trainer(2, precision="bf16-mixed", callbacks=[probe]).fit(module, data())
    assert probe.local and all(probe.local)
    assert probe.round_end and not any(probe.round_end)
    assert module.global_model.flatten().dtype == torch.float32 and torch.isfinite(module.global_model.flatten()).all()
    assert all(v.dtype in (torch.float32, torch.float64) for v in outcome(module).values())


class Snapshot(pl.Callback):
    """Saves the outcome of a run from rank 0 (the store does not travel back from spawned processes)."""

    def __init__(self, path: str) -> None:
        self.path = path

    def on_train_end(self, trainer: pl.Trainer, pl_module: FederatedModule) -> None:
        if trainer.global_rank == 0:
            torch.save(outcome(pl_module), self.path)


#: the properties of check_algorithm that do not apply to an algorithm (the report says why)
SKIPPED = {"ByrdSAGA": {"batched"}, "LocalOnly": {"nonfinite_update"}, "FedDRO": {"without_trainer"},
           "CompositionalFedAvg": {"without_trainer"}, "PeFLL": {"without_trainer"}, "PFedHN": {"without_trainer"}}


@pytest.mark.slow
@pytest.mark.parametrize("name", NAMES)
def test_keeps_the_engines_promises(name):
    """``fl_lightning.testing.check_algorithm``: no per-client state outside the declared entries; the batched
    backend gives the sequential one's results (1e-5; ByrdSAGA's per-client minibatch index is refused at setup); a run
    stopped after round 1 and resumed from its checkpoint gives the uninterrupted run's results, bitwise; a
    client's NaN update is left out (LocalOnly uploads nothing); a client's round without a Trainer gives the
    fit's, bitwise (not for lock-step algorithms and server networks trained on client data); two processes give
    the results of one (1e-5)."""
    cls, kwargs, client = ALGORITHMS[name]
    report = check_algorithm(cls, client, data, rounds=2, two_process_strategy=TWO_PROCESSES, **kwargs)
    assert list(report) == list(PROPERTIES)
    assert {p: r.split(":")[0] for p, r in report.items()} == {
        p: "skipped" if p in SKIPPED.get(name, ()) else "passed" for p in PROPERTIES}


@pytest.mark.parametrize("name", NAMES)
def test_pickles_for_the_spawn_launcher(name):
    """``fl_ddp_spawn`` sends the module to its processes pickled: every algorithm must pickle."""
    module = build(name)
    clone = pickle.loads(pickle.dumps(module))
    assert type(clone) is type(module)
    assert_same(outcome(module), outcome(clone))
