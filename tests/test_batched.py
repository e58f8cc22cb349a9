"""The batched client backend: the sequential backend's results for every supported algorithm,
ragged clients, BatchNorm with per-client statistics, client logs, keyed Dropout, bf16, refusals,
blocks bounding memory, and two processes giving the result of one."""

from __future__ import annotations

import functools

import pytest
import pytorch_lightning as pl
import torch
import torch.nn.functional as F
from torch import nn

from fl_lightning.algorithms import (
    PDSGD,
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
from fl_lightning.backends import BatchedBackend
from fl_lightning.callbacks import FederatedCallback
from fl_lightning.backends.batched import backend as backend_module
from fl_lightning.backends.sequential import train_one_by_one
from fl_lightning.backends.batched.final import BlockFinalRun
from fl_lightning.backends.batched.sizing import activation_bytes
from fl_lightning.functional.dro import KLDRO
from fl_lightning.models import MLP
from fl_lightning.models.hypernetwork import MLPEmbedding
from fl_lightning.optim.prox_sgd import ProxSGD
from fl_lightning.run import plain_step
from tests.helpers import TWO_PROCESSES, synthetic, trainer
from tests.test_contract import outcome


def mlp(momentum: float = 0.0, weight_decay: float = 0.0) -> MLP:
    torch.manual_seed(0)
    return MLP(in_features=20, hidden=(8,), num_classes=10, lr=0.1, momentum=momentum, weight_decay=weight_decay)


def common(backend: str, block: int) -> dict:
    return {"local_steps": 3, "client_backend": backend, "clients_per_block": block, "seed": 1}


SUPPORTED = {
    "FedAvg": lambda b, k: FedAvg(mlp(), clients_per_round=5, **common(b, k)),
    "FedAvg-momentum-wd": lambda b, k: FedAvg(mlp(0.9, 1e-3), clients_per_round=5, **common(b, k)),
    "FedAvg-nesterov": lambda b, k: FedAvg(_nesterov(), clients_per_round=5, **common(b, k)),
    "FedProx": lambda b, k: FedProx(mlp(0.5), mu=0.1, clients_per_round=5, **common(b, k)),
    "SCAFFOLD": lambda b, k: SCAFFOLD(mlp(), clients_per_round=5, **common(b, k)),
    "FedDeper": lambda b, k: FedDeper(mlp(), rho=0.1, clients_per_round=5, **common(b, k)),
    "FedDeper-independent": lambda b, k: FedDeper(mlp(), rho=0.1, independent_batches=True, update_order="gauss_seidel",
                                                  clients_per_round=5, **common(b, k)),
    "FedDeper-reset": lambda b, k: FedDeper(mlp(), rho=0.1, reset_personal=True, clients_per_round=5, **common(b, k)),
    "FedDeper-first-round": lambda b, k: FedDeper(mlp(), rho=0.1, personal_init="first_round", clients_per_round=5,
                                                  **common(b, k)),
    "RAGA": lambda b, k: RAGA(mlp(), clients_per_round=5, **common(b, k)),
    "RFA": lambda b, k: RFA(mlp(), clients_per_round=5, **common(b, k)),
    "FedDRO": lambda b, k: FedDRO(mlp(), KLDRO(lam=2.0), beta=0.5, clients_per_round=6, **common(b, k)),
    "CompositionalFedAvg": lambda b, k: CompositionalFedAvg(mlp(), KLDRO(lam=2.0), case="II", clients_per_round=6,
                                                            **common(b, k)),
    "LocalOnly": lambda b, k: LocalOnly(mlp(), clients_per_round=6, **common(b, k)),
    "FastDRO-cvar": lambda b, k: FastDRO(mlp(), alpha=0.3, clients_per_round=5, **common(b, k)),
    "FastDRO-chi-square": lambda b, k: FastDRO(mlp(), robust_loss="chi_square", lam=0.5, clients_per_round=5,
                                               **common(b, k)),
    "FedProxVR-svrg-last": lambda b, k: FedProxVR(mlp(), mu=0.1, lr=0.05, output_iterate="last", **common(b, k)),
    "FedProxVR-sarah-random": lambda b, k: FedProxVR(mlp(), estimator="sarah", mu=0.1, lr=0.05, clients_per_round=5,
                                                     **common(b, k)),
    "FedProxVR-sgd-client-rate": lambda b, k: FedProxVR(mlp(), estimator="sgd", mu=0.5, clients_per_round=5,
                                                        **common(b, k)),
    "PeFLL": lambda b, k: PeFLL(mlp(0.9), MLPEmbedding(20, 10, 4, hidden=(8,)), hypernetwork_width=16,
                                clients_per_round=5, **common(b, k)),
    "pFedHN": lambda b, k: PFedHN(mlp(), embedding_dim=4, hypernetwork_width=16, clients_per_round=5, **common(b, k)),
}


def _nesterov() -> MLP:
    client = mlp(0.9)
    client.configure_optimizers = lambda: torch.optim.SGD(client.parameters(), lr=0.1, momentum=0.9, nesterov=True,
                                                          dampening=0.0)
    return client


def fitted(make, backend: str, block: int = 4, rounds: int = 3, **data) -> tuple[pl.LightningModule, pl.Trainer]:
    module = make(backend, block)
    t = trainer(rounds)
    t.fit(module, synthetic(6, **data))
    return module, t


def assert_close(a: dict, b: dict, atol: float) -> None:
    assert a.keys() == b.keys()
    for key in a:
        assert (a[key] - b[key]).abs().max() <= atol, key


@pytest.mark.parametrize("name", list(SUPPORTED))
def test_batched_equals_sequential(name):
    """Three rounds, blocks of 4 (a block and a remainder): the global model, server state, every
    client's state and the logged metrics equal the sequential backend's to 1e-5 (fp32, CPU)."""
    sequential, logged = fitted(SUPPORTED[name], "sequential")
    batched, logged_batched = fitted(SUPPORTED[name], "batched")
    assert isinstance(batched.engine.backend, BatchedBackend)
    assert_close(outcome(sequential), outcome(batched), atol=1e-5)
    # the client's logs too, those of client_init's and client_final's eager work included (FedProxVR's
    # full gradient)
    assert_close(dict(logged.callback_metrics), dict(logged_batched.callback_metrics), atol=1e-5)


class RecordSteps(FederatedCallback):
    """Each (round, client)'s local steps, as its update reports them."""

    def __init__(self) -> None:
        self.steps: dict[tuple[int, int], float] = {}

    def on_client_update(self, trainer, module, update):
        self.steps[module.current_epoch, update.client_id] = update.metrics["steps"]
        return update


@pytest.mark.parametrize("momentum", [0.0, 0.9])
def test_ragged_clients_need_no_padding(momentum):
    """local_epochs (clients with different step counts, a smaller last batch) and clients with fewer
    samples than the batch size: grouped by batch shape, equal to sequential (with and without
    momentum buffers in the optimizer state)."""
    epochs = lambda b, k: FedAvg(mlp(momentum), clients_per_round=5, local_epochs=2, client_backend=b,  # noqa: E731
                                 clients_per_block=k)
    steps = {}
    for backend in ("sequential", "batched"):
        module, record = epochs(backend, 4), RecordSteps()
        trainer(3, callbacks=[record]).fit(module, synthetic(6))
        steps[backend] = (outcome(module), record.steps)
    assert_close(steps["sequential"][0], steps["batched"][0], atol=1e-5)
    assert steps["batched"][1] == steps["sequential"][1] and len(set(steps["batched"][1].values())) > 1
    small = SUPPORTED["SCAFFOLD"]
    a, b = fitted(small, "sequential", batch_size=64), fitted(small, "batched", batch_size=64)
    assert_close(outcome(a[0]), outcome(b[0]), atol=1e-5)


@pytest.mark.parametrize("name", ["RAGA", "SCAFFOLD", "FedDeper", "LocalOnly"])
def test_a_vectorizable_client_final_runs_once_a_block(name, monkeypatch):
    """A ``client_final`` of tensors and of what a block's clients share has its call made once for a
    block (a view of the stacked clients: no client id), not once per client, with nothing declared:
    blocks of 4 and 1 (LocalOnly: 4 and 2) in each round (the equality with the sequential backend:
    test_batched_equals_sequential)."""
    module = SUPPORTED[name]("batched", 4)
    calls = []
    final = type(module).client_final

    def counted(self, run):
        calls.append(type(run))
        return final(self, run)

    monkeypatch.setattr(type(module), "client_final", counted)
    rounds = 1 if name == "LocalOnly" else 3  # LocalOnly's clients have spent their budget after one round
    trainer(rounds).fit(module, synthetic(6))
    assert module.engine.context.finalizes_rounds and module.engine.backend._eager_final is None
    assert calls == [BlockFinalRun] * 2 * rounds


class _Tally:
    """Counts calls: Python state of the module's own that a vectorized ``client_final`` would change once a block."""

    def __init__(self) -> None:
        self.calls = 0


class _ClientSpecificFinal(SCAFFOLD):
    """SCAFFOLD whose ``client_final`` uses what each client has its own of (``kind``), which a view of a block
    does not hold: vectorized, it would silently give one client's to all."""

    def __init__(self, client, kind: str, **kwargs) -> None:
        super().__init__(client, **kwargs)
        self.kind, self.tally = kind, []

    def client_final(self, run):
        out = super().client_final(run)
        if self.kind == "client_id":
            out["delta"] = out["delta"] * (1.0 + 0.01 * (run.client_id % 2))
        elif self.kind == "num_samples":
            out["delta"] = out["delta"] * (run.data.num_samples / (run.data.num_samples + 1.0))
        elif self.kind == "metrics":
            run.metrics["delta_norm"] = out["delta"].norm()
        elif self.kind == "log":
            self.log("final_norm", out["delta"].norm())
        elif self.kind == "state":
            self.tally.append(1)
        return out


@pytest.mark.parametrize("kind, reason", [
    ("client_id", r"reads run.client_id"), ("num_samples", r"reads run.data.num_samples"),
    ("metrics", r"reads run.metrics"), ("log", r"logs 'final_norm' with self.log"),
    ("state", r"changes Python state of the module \(tally\)"),
])
def test_a_client_final_that_uses_a_clients_own_values_is_not_vectorized(kind, reason):
    """Nothing declared: a ``client_final`` that reads a client's own field (its id, sample count, metrics),
    logs, or changes the module's Python state is found out at its first vectorized try, which leaves no
    trace, and runs once per client from then on (a one-time warning says why), with the sequential
    backend's results."""
    make = lambda b, k: _ClientSpecificFinal(mlp(), kind, clients_per_round=5, **common(b, k))  # noqa: E731
    with pytest.warns(UserWarning, match=r"_ClientSpecificFinal.client_final runs once per client: it cannot be "
                                         r"vectorized over a block \(ClientSpecific: it " + reason):
        batched, _ = fitted(make, "batched")
    sequential, _ = fitted(make, "sequential")
    assert_close(outcome(sequential), outcome(batched), atol=1e-5)
    assert len(batched.tally) == len(sequential.tally)


def test_a_client_final_that_cannot_be_vectorized_runs_per_client_with_a_reason():
    """A ``client_final`` that draws random numbers: refused by ``vmap`` at its first vectorized try, it runs
    once per client from then on (a one-time warning says why), with the sequential backend's result;
    clients that took different numbers of steps (``local_epochs``) run it per client too."""

    class Drawing(RAGA):
        def client_final(self, run):
            out = super().client_final(run)
            return {"grad": out["grad"] + 0.0 * torch.rand(())}

    make = lambda b, k: Drawing(mlp(), clients_per_round=5, **common(b, k))  # noqa: E731
    with pytest.warns(UserWarning, match=r"Drawing.client_final runs once per client: it cannot be vectorized"):
        batched, _ = fitted(make, "batched")
    assert batched.engine.backend._eager_final is not None
    assert_close(outcome(fitted(make, "sequential")[0]), outcome(batched), atol=1e-5)

    calls = []

    class Ragged(SCAFFOLD):
        def client_final(self, run):
            calls.append(run.client_id)
            return super().client_final(run)

    epochs = lambda b, k: Ragged(mlp(), clients_per_round=5, local_epochs=1, client_backend=b,  # noqa: E731
                                 clients_per_block=k, seed=1)
    sequential = fitted(epochs, "sequential", rounds=1)[0]
    sequential_calls, calls[:] = list(calls), []
    ragged = fitted(epochs, "batched", block=5, rounds=1)[0]  # one block, clients of unequal step counts
    assert None not in calls and sorted(calls) == sorted(sequential_calls)
    assert_close(outcome(sequential), outcome(ragged), atol=1e-5)


def test_clients_smaller_than_the_batch_step_as_blocks_of_their_own(monkeypatch):
    """With local_steps, clients whose batches differ in shape (fewer samples than the batch size) form
    blocks of their own: every vectorized call is over a whole block (no client's values gathered out
    of the block and written back each step), and each client still gets its own batch shape."""
    calls = []
    advance = BatchedBackend._advance

    def spy(self, context, block, groups, step, phase, reseed=None):
        if block.work != "trial":  # the round's blocks, not the setup's trial of the first step
            calls.append((block, len(block.runs), [len(g.members) for g in groups]))  # the block kept: ids unique
        return advance(self, context, block, groups, step, phase, reseed)

    monkeypatch.setattr(BatchedBackend, "_advance", spy)
    fitted(SUPPORTED["SCAFFOLD"], "batched", block=5, rounds=1, batch_size=64)  # batches of 64, 62, 43, 28...
    assert all(members == [size] for _, size, members in calls)  # each call: one group, the whole block
    blocks = {id(block): size for block, size, _ in calls}
    assert len(blocks) > 1 and sum(blocks.values()) == 5 and len(calls) == 3 * len(blocks)


@pytest.mark.parametrize("name", ["FedAvg", "FedAvg-momentum-wd", "FedProx"])
def test_default_uploads_are_computed_per_block(name, monkeypatch):
    """An algorithm with the default ``client_final`` (``end - start``) gets its uploads from the
    block's stacked values, with no per-client call (optimizer state between the model and the
    start in the carry, and blocks of the ragged batch shapes); equal to sequential above."""
    from fl_lightning.module import FederatedModule

    calls = []
    final = FederatedModule.client_final
    counted = functools.wraps(final)(lambda self, run: calls.append(run) or final(self, run))  # still the default
    monkeypatch.setattr(FederatedModule, "client_final", counted)
    module, _ = fitted(SUPPORTED[name], "batched", batch_size=64)
    assert calls == [] and module.engine.round_num_updates == 5
    monkeypatch.undo()
    reference, _ = fitted(SUPPORTED[name], "sequential", batch_size=64)
    assert_close(outcome(reference), outcome(module), atol=1e-5)


def test_frozen_parameters_stay_frozen():
    """A parameter with requires_grad=False moves in neither backend, even with weight decay and
    momentum (torch.optim.SGD skips a parameter without a gradient); the rest equals sequential."""

    def make(backend, block):
        client = mlp(0.9, 1e-2)
        client.net[1].weight.requires_grad_(False)
        return FedAvg(client, clients_per_round=5, **common(backend, block))

    frozen = mlp().net[1].weight.detach().clone()
    (seq, _), (bat, _) = fitted(make, "sequential"), fitted(make, "batched")
    for module in (seq, bat):
        assert torch.equal(module.client.net[1].weight, frozen)
        assert not torch.equal(module.client.net[-1].weight, mlp().net[-1].weight)
    assert_close(outcome(seq), outcome(bat), atol=1e-5)


def _first_layer_frozen(how: str) -> MLP:
    """``mlp()`` whose first layer (the first parameters) is left out of ``configure_optimizers``
    or has ``requires_grad=False``."""
    client = mlp()
    if how == "left_out":
        client.configure_optimizers = lambda: torch.optim.SGD(client.net[-1].parameters(), lr=0.1)
    else:
        client.net[1].requires_grad_(False)
    return client


@pytest.mark.parametrize("how", ["left_out", "requires_grad"])
@pytest.mark.parametrize("algorithm", [SCAFFOLD, FedDeper])
def test_a_frozen_first_layer_in_both_backends(algorithm, how):
    """The local rate is that of the parameters the optimizer moves, not 0 for the frozen first
    layer: SCAFFOLD's (x - y) / (K lr) and FedDeper's steps stay finite, the model trains, both
    backends agree; the frozen layer stays put in the global model and in every stored state
    (FedDeper's personal models v_i, SCAFFOLD's controls: 0 there)."""
    make = lambda b, k: algorithm(_first_layer_frozen(how), clients_per_round=5, **common(b, k))  # noqa: E731
    (seq, _), (bat, _) = fitted(make, "sequential"), fitted(make, "batched")
    x0 = torch.cat([p.detach().reshape(-1) for p in mlp().parameters()])
    first = mlp().net[1].weight.numel() + mlp().net[1].bias.numel()
    for module in (seq, bat):
        assert torch.equal(module.client.net[1].weight, mlp().net[1].weight)
        assert (module.client.net[-1].weight - mlp().net[-1].weight).abs().max() > 1e-3
        for cid in module.engine.store.clients():
            for name, value in module.engine.context.load_client_state(cid).items():
                frozen_part = x0[:first] if name == "personal" else torch.zeros(first)
                assert torch.equal(value[:first].cpu(), frozen_part), name
    assert_close(outcome(seq), outcome(bat), atol=1e-5)


class BatchNormClient(pl.LightningModule):
    """BatchNorm in train mode (per-client running statistics) and a logged loss."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(20, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 10))

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        loss = F.cross_entropy(self(batch[0]), batch[1])
        self.log("client_loss", loss, prog_bar=True)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


def test_batch_norm_statistics_and_client_logs_follow_each_client():
    make = lambda b, k: FedAvg(BatchNormClient(), clients_per_round=5, **common(b, k))  # noqa: E731
    (seq, t_seq), (bat, t_bat) = fitted(make, "sequential"), fitted(make, "batched")
    assert_close(outcome(seq), outcome(bat), atol=1e-5)  # running means/vars included
    assert float(t_bat.callback_metrics["client_loss"]) == pytest.approx(float(t_seq.callback_metrics["client_loss"]),
                                                                          rel=1e-5)
    assert "client_loss" in t_bat.progress_bar_metrics  # the call's options are kept
    # integer buffers are not federated: both backends leave the counter at the global model's value
    assert [int(m.client.net[1].num_batches_tracked) for m in (seq, bat)] == [0, 0]


def test_cumulative_batch_norm_is_warned_about():
    client = BatchNormClient()
    client.net[1].momentum = None
    with pytest.warns(UserWarning, match=r"BatchNorm layer\(s\) \['net.1'\] have momentum=None"):
        trainer(1).fit(FedAvg(client, clients_per_round=2, local_steps=1), synthetic(4))


def test_bf16_mixed():
    module = SUPPORTED["SCAFFOLD"]("batched", 4)
    trainer(2, precision="bf16-mixed").fit(module, synthetic(6))
    assert module.global_model.flatten().dtype == torch.float32 and torch.isfinite(module.global_model.flatten()).all()


class DropoutClient(pl.LightningModule):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(20, 16), nn.ReLU(), nn.Dropout(0.5), nn.Linear(16, 10))

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        return F.cross_entropy(self(batch[0]), batch[1])

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_dropout_is_reproducible_for_a_seed_and_block_layout():
    def run(seed: int, block: int) -> torch.Tensor:
        module = FedAvg(DropoutClient(), clients_per_round=6, local_steps=3, seed=seed, client_backend="batched",
                        clients_per_block=block)
        torch.manual_seed(123 + seed + block)  # the global stream does not matter
        trainer(2).fit(module, synthetic(6))
        return module.global_model.flatten()

    first = run(0, 3)
    assert torch.equal(first, run(0, 3))
    assert not torch.equal(first, run(1, 3))  # another seed, other draws
    assert not torch.equal(first, run(0, 2))  # another block layout, other draws (equal in distribution only)


class _StepWrittenOut(FedAvg):
    """FedAvg with its plain step written out as its own ``client_step``: the batched backend takes
    its gradient inside ``vmap``, as it does for any algorithm's step."""

    def client_step(self, run, batch):
        return plain_step(run, batch)


@pytest.mark.parametrize("client", [lambda: mlp(0.9, 1e-3), _nesterov, BatchNormClient, DropoutClient],
                         ids=["momentum-wd", "nesterov", "batchnorm-logs", "dropout"])
def test_the_plain_step_takes_its_gradient_outside_vmap_with_the_same_result(client, monkeypatch):
    calls = []
    fast = backend_module.vectorized_plain_step
    monkeypatch.setattr(backend_module, "vectorized_plain_step", lambda *args: calls.append(1) or fast(*args))
    runs = []
    for cls in (FedAvg, _StepWrittenOut):
        module = cls(client(), clients_per_round=5, **common("batched", 4))
        fit = trainer(2)
        fit.fit(module, synthetic(6))
        runs.append((module.global_model.flatten(), {k: float(v) for k, v in fit.callback_metrics.items()}))
        if cls is FedAvg:
            assert calls, "the plain step did not take the gradient outside vmap"
            del calls[:]
    assert not calls  # a client_step of the algorithm's own runs under vmap(grad)
    (plain, plain_metrics), (written, written_metrics) = runs
    # the same arithmetic, in other kernels: a batched matrix product under vmap(grad), a plain one outside
    # it (and BatchNorm's other kernels under grad); on some CPUs (AMD EPYC here) they round differently,
    # a few fp32 units in the last place after 2 rounds (6e-8 at most at values up to 0.55), on others not
    assert (plain - written).abs().max() <= 1e-6
    assert plain_metrics == pytest.approx(written_metrics, rel=1e-6)


def test_dropout_draws_are_independent_per_client():
    """Two clients of one block with the same start, the same batch: different Dropout masks."""
    module = FedAvg(DropoutClient(), clients_per_round=2, local_steps=1, client_backend="batched")
    batch = (torch.randn(8, 20), torch.randint(0, 10, (8,)))
    trainer(1).fit(module, synthetic(2))  # attaches the Trainer
    from fl_lightning.backends.batched.backend import Block
    from fl_lightning.backends.batched.batches import BatchGroup

    backend = module.engine.backend
    module.on_train_epoch_start()
    block = Block([backend.new_run(module.engine.context, cid) for cid in (0, 1)], iter([]))
    backend._advance(module.engine.context, block, [BatchGroup([0, 1], [(batch, {}), (batch, {})])], 0, "step")
    block.unstack()
    assert not torch.equal(block.runs[0].end(), block.runs[1].end())


class Counting(DropoutClient):
    def training_step(self, batch, batch_idx):
        self.steps_taken = getattr(self, "steps_taken", 0) + 1
        return super().training_step(batch, batch_idx)


class PythonStateClient(DropoutClient):
    """A training_step that keeps per-client Python state in one of several ways."""

    def __init__(self, kind: str):
        super().__init__()
        self.kind, self._calls, self.history = kind, 0, []

    def training_step(self, batch, batch_idx):
        if self.kind == "private counter":
            self._calls += 1
        elif self.kind == "list":
            self.history.append(batch_idx)
        elif self.kind == "item":
            self.log("loss_value", F.cross_entropy(self(batch[0]), batch[1]).item())
        return super().training_step(batch, batch_idx)


class AdamClient(DropoutClient):
    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=1e-3)


class _OwnOptimizer(FedAvg):
    """Sets an optimizer of its own in ``client_init``: Adam, or proximal SGD at a rate per client."""

    def __init__(self, client, per_client_rate: bool = False, **kwargs) -> None:
        super().__init__(client, **kwargs)
        self.per_client_rate = per_client_rate

    def client_init(self, run) -> None:
        if self.per_client_rate:
            run.local.optimizer = ProxSGD(run.params, lr=0.1 * (1 + run.client_id), mu=0.1)
        else:
            run.local.optimizer = torch.optim.Adam(run.params)


@pytest.mark.parametrize(
    "make, match",
    [
        (lambda: FedAvg(Counting(), clients_per_round=2, local_steps=2, client_backend="batched"),
         r"training_step changes Python state \(steps_taken\).*client_backend='sequential'"),
        (lambda: FedAvg(PythonStateClient("private counter"), clients_per_round=2, local_steps=2,
                        client_backend="batched"), r"changes Python state \(_calls\)"),
        (lambda: FedAvg(PythonStateClient("list"), clients_per_round=2, local_steps=2, client_backend="batched"),
         r"changes Python state \(history\)"),
        (lambda: FedAvg(PythonStateClient("item"), clients_per_round=2, local_steps=2, client_backend="batched"),
         r"PythonStateClient's training_step cannot be vectorized over clients.*\.item\(\).*"
         r"client_backend='sequential'"),
        (lambda: FedAvg(AdamClient(), clients_per_round=2, local_steps=2, client_backend="batched"),
         r"supports \['SGD'\].*returned Adam: use client_backend='sequential'"),
        (lambda: _OwnOptimizer(mlp(), clients_per_round=2, local_steps=2, client_backend="batched"),
         r"client_init sets a torch optimizer of its own, Adam; .*knows SGD and ProxSGD"),
        (lambda: ByrdSAGA(mlp(), clients_per_round=2, client_backend="batched"),
         r"ByrdSAGA's first step of a round, tried at setup as the batched backend runs it: the clients of a block "
         r"hold different non-tensor run values .*client_backend='sequential'"),
        (lambda: _ClientKeyedStep(mlp(), clients_per_round=2, local_steps=2, client_backend="batched"),
         r"_ClientKeyedStep.client_step cannot be vectorized over clients \(TypeError: .*\): a block's step has no "
         r"client id or sample count .*client_backend='sequential'"),
        (lambda: _OptedOut(mlp(), clients_per_round=2, local_steps=2, client_backend="batched"),
         r"cannot run _OptedOut: _OptedOut declares batchable = False .*client_backend='sequential'"),
    ],
)
def test_what_cannot_be_batched_is_refused_clearly(make, match):
    """Refused at setup, with the reason and the way out: what the backend finds out itself (the client's
    step, the algorithm's first step of a round: no declaration), and the algorithm's explicit opt-out."""
    with pytest.raises(ValueError, match=match):
        trainer(1).fit(make(), synthetic(4))


class _ClientKeyedStep(FedAvg):
    """A step that reads the client's id (None in a block's step): it runs on one client, not on a block."""

    def client_step(self, run, batch):
        loss, grads = run.loss_and_grad(batch)
        run.step([g * (1.0 + 0.0 * run.client_id) for g in grads])
        return loss


class _OptedOut(FedAvg):
    """Vectorizable, but opted out (as a step with a Python effect the backend cannot see would be)."""

    batchable = False


def test_a_step_that_reads_the_sample_count_is_refused_at_setup_and_the_trial_leaves_no_trace():
    """PDSGD's step reads ``run.data.num_samples`` (None in a block's step): the trial of its first step at setup
    refuses it; its ``client_init`` ran there, on a round start that is gone again, and stored nothing."""
    module = PDSGD(mlp(), lam=1.0, local_steps=2, client_backend="batched", seed=1)
    with pytest.raises(ValueError, match=r"PDSGD.client_step cannot be vectorized over clients \(TypeError"):
        trainer(1).fit(module, synthetic(1))
    assert module.engine.round_start is None and not list(module.engine.store.entries())


def test_clients_with_different_local_optimizers_step_in_blocks_of_their_own():
    """``client_init`` giving each client proximal SGD at a rate of its own (as a configured ``lr`` does):
    a block steps the clients of one optimizer, and the round gives the sequential backend's result."""
    make = lambda b, k: _OwnOptimizer(mlp(), per_client_rate=True, clients_per_round=5,  # noqa: E731
                                      **common(b, k))
    assert_close(outcome(fitted(make, "sequential")[0]), outcome(fitted(make, "batched")[0]), atol=1e-5)


def test_bad_backend_arguments():
    with pytest.raises(ValueError, match="client_backend must be 'sequential' or 'batched', got 'vmap'"):
        FedAvg(mlp(), client_backend="vmap")
    with pytest.raises(ValueError, match="clients_per_block must be >= 1 and an integer, got 0"):
        FedAvg(mlp(), client_backend="batched", clients_per_block=0)


def test_blocks_bound_the_stacked_clients():
    """A round of 6 clients in blocks of 2: no vectorized call holds more than 2 clients, and the
    round has 3 work items."""
    sizes = []

    class Recording(BatchedBackend):
        def _call(self, context, block, tensors, items, step, phase):
            sizes.append(tensors[0].shape[0])  # the clients stacked in this call
            return super()._call(context, block, tensors, items, step, phase)

    module = FedAvg(mlp(), clients_per_round=6, local_steps=2, client_backend="batched", clients_per_block=2)
    module.engine.backend = Recording(2)
    trainer(1).fit(module, synthetic(6))
    assert max(sizes) == 2 and module.engine.num_work_items() == 3


def test_the_default_block_is_the_round_within_a_share_of_free_memory(monkeypatch):
    """``clients_per_block=None``: one block of the round's clients where a quarter of the free
    memory holds them, else as many as it holds (at least one), settled at setup; and the result
    is the one of explicit blocks of that size."""
    from fl_lightning.backends.batched import backend as batched

    module = FedAvg(mlp(), clients_per_round=6, local_steps=2, client_backend="batched")
    trainer(1).fit(module, synthetic(6))
    assert module.engine.backend.clients_per_block == 6 and module.engine.num_work_items() == 1
    assert module.engine.backend.evaluation_block(40) == 40  # evaluating more clients than a round: all at once
    model = sum(p.numel() * 4 for p in module.client.parameters())
    assert module.engine.client_bytes() == 4 * model + 4 * module.global_model.dim  # four copies and the upload
    activations = activation_bytes(module.engine.context)
    per_client = module.engine.client_bytes() + activations.step  # the run's tensors and its step's activations
    assert activations.step > 0 and module.engine.backend._memory[0] == module.engine.client_bytes() + activations.evaluation

    monkeypatch.setattr(batched, "free_memory", lambda device: 4 * 2 * per_client + 3)  # a quarter holds 2
    auto = FedAvg(mlp(), clients_per_round=6, local_steps=2, client_backend="batched", seed=1)
    trainer(1).fit(auto, synthetic(6))
    assert auto.engine.backend.clients_per_block == 2 and auto.engine.num_work_items() == 3
    evaluation = auto.engine.backend._memory[0]  # an evaluation's client: the eval batch's activations, not a step's
    assert evaluation > per_client and auto.engine.backend.evaluation_block(40) == max(1, (2 * per_client) // evaluation)
    explicit = FedAvg(mlp(), clients_per_round=6, local_steps=2, client_backend="batched", clients_per_block=2, seed=1)
    trainer(1).fit(explicit, synthetic(6))
    assert torch.equal(auto.global_model.flatten(), explicit.global_model.flatten())
    monkeypatch.setattr(batched, "free_memory", lambda device: 0)
    tiny = FedAvg(mlp(), clients_per_round=6, local_steps=2, client_backend="batched")
    trainer(1).fit(tiny, synthetic(6))
    assert tiny.engine.backend.clients_per_block == 1


@pytest.mark.parametrize("name, where", [("FedAvg", "step"), ("SCAFFOLD", "final")])
def test_a_default_block_out_of_memory_steps_again_in_halves(name, where, monkeypatch):
    """``clients_per_block=None``: a block that runs out of device memory (simulated: any block of more
    than 2 clients, at its second local step or in its vectorized ``client_final``) steps again in
    halves from its clients' start, and later blocks are no larger, with one warning: the results
    and the logged metrics are the sequential backend's (the failed block's step logs are not
    counted twice). A block size the user chose is theirs: its error is raised."""
    from fl_lightning.backends.batched import backend as batched

    sequential, _ = fitted(SUPPORTED[name], "sequential")
    logged = fitted(SUPPORTED[name], "sequential", rounds=1)[1]  # the round of the failures: its logs
    oom = torch.cuda.OutOfMemoryError("CUDA out of memory (simulated)")
    if where == "step":
        advance = BatchedBackend._advance

        def failing_advance(self, context, block, groups, step, phase, reseed=None):
            if len(block.runs) > 2 and step == 1:
                raise oom
            return advance(self, context, block, groups, step, phase, reseed)

        monkeypatch.setattr(BatchedBackend, "_advance", failing_advance)
    else:
        final = batched.vectorized_final

        def failing_final(hook, template, spec, static, side, tensors):
            if len(tensors[0]) > 2:
                raise oom
            return final(hook, template, spec, static, side, tensors)

        monkeypatch.setattr(batched, "vectorized_final", failing_final)
    with pytest.warns(UserWarning, match="ran out of memory in training, in a block of 5 clients") as warned:
        halved, _ = fitted(SUPPORTED[name], "batched", block=None)
    assert sum("ran out of memory" in str(w.message) for w in warned) == 1
    assert halved.engine.backend.clients_per_block == 5 and halved.engine.backend._fitting == {"training": 2}  # 5 -> 3 + 2 -> 2 + 1 + 2
    assert_close(outcome(sequential), outcome(halved), atol=1e-5)
    logged_halved = fitted(SUPPORTED[name], "batched", block=None, rounds=1)[1]
    assert_close(dict(logged.callback_metrics), dict(logged_halved.callback_metrics), atol=1e-5)
    with pytest.raises(torch.cuda.OutOfMemoryError):
        fitted(SUPPORTED[name], "batched", block=4, rounds=1)


def test_a_lockstep_default_block_counts_every_runs_tensors_and_raises_out_of_memory_with_the_way_out(monkeypatch):
    """Lock-step rounds (FedDRO) hold every client's run through the round: the default block is
    the clients whose steps' activations fit beside all of them in a quarter of the free memory
    (with a warning where the runs alone take more); the result is that of explicit blocks of that
    size. A lock-step round that runs out of memory is not retried: the error says what to change."""
    from fl_lightning.backends.batched import backend as batched

    make = SUPPORTED["FedDRO"]
    probe, _ = fitted(make, "batched", block=None, rounds=1)
    tensors, step = probe.engine.client_bytes(), activation_bytes(probe.engine.context).step
    assert probe.engine.backend.clients_per_block == 6
    # a quarter of the free memory holds the six runs and two clients' activations (a block counted as in other
    # rounds, its own clients' runs and activations, would be larger)
    monkeypatch.setattr(batched, "free_memory", lambda device: 4 * (6 * tensors + 2 * step) + 3)
    auto, _ = fitted(make, "batched", block=None)
    assert auto.engine.backend.clients_per_block == 2 and auto.engine.num_work_items() == auto.local_steps
    explicit, _ = fitted(make, "batched", block=2)
    assert_close(outcome(auto), outcome(explicit), atol=0)
    monkeypatch.setattr(batched, "free_memory", lambda device: 4 * 5 * tensors)
    with pytest.warns(UserWarning, match="lock-step round holds all of a process's 6 clients"):
        tight, _ = fitted(make, "batched", block=None, rounds=1)
    assert tight.engine.backend.clients_per_block == 1

    def failing_advance(self, context, block, groups, step, phase, reseed=None):
        raise torch.cuda.OutOfMemoryError("CUDA out of memory (simulated)")

    monkeypatch.setattr(BatchedBackend, "_advance", failing_advance)
    with pytest.raises(torch.cuda.OutOfMemoryError) as raised:
        fitted(make, "batched", block=None, rounds=1)
    assert any("lock-step round (6 here, in blocks of 1)" in note and "clients_per_block" in note
               for note in raised.value.__notes__)


def test_a_steps_activations_grow_with_its_batch_and_leave_the_run_as_it_was():
    """The activation estimate of the default block: what autograd saves for one ``training_step``
    (twice), for an MLP a multiple of the batch size (and a few scalars); for an evaluation, the
    peak of an evaluation batch's forward, which grows with ``eval_batch_size``, not with the
    training batch. Taking it draws no number from the run's RNG, changes no model tensor, and the
    steps' ``self.log`` calls are dropped (outside Lightning's loop, as here after ``fit``,
    Lightning's own ``log`` would raise)."""
    estimates = []
    for batch_size, eval_batch_size in ((4, 8), (8, 8), (12, 8), (4, 16)):
        module = FedAvg(mlp(), clients_per_round=2, local_steps=1, client_backend="batched", clients_per_block=1)
        trainer(1).fit(module, synthetic(3, batch_size=batch_size, eval_batch_size=eval_batch_size))
        model, rng = module.global_model.flatten(), torch.get_rng_state()
        estimates.append(activation_bytes(module.engine.context))
        assert torch.equal(torch.get_rng_state(), rng) and torch.equal(module.global_model.flatten(), model)
    steps = [a.step for a in estimates[:3]]
    per_4 = steps[1] - steps[0]
    assert per_4 > 0 and steps[2] - steps[1] == per_4 and 0 <= steps[0] - per_4 < 64
    assert estimates[0].evaluation == estimates[1].evaluation == estimates[2].evaluation  # the eval batch's, not the step's
    per_8 = estimates[3].evaluation - estimates[0].evaluation
    # 8 more samples: at least their features (20 floats) and labels; at most those and all their values in the
    # model (hidden 8, its ReLU, 10 logits and a softmax of them) at once
    assert 8 * (20 * 4 + 8) <= per_8 <= 8 * (4 * (20 + 8 + 8 + 10 + 10) + 8)


def test_peak_live_bytes_counts_what_is_alive_at_once():
    from fl_lightning.backends.batched.sizing import peak_live_bytes

    x = torch.ones(1000)
    w = torch.ones(1000)

    def chain():
        a = x * 2  # 4000
        b = a + 1  # a, b: 8000
        del a
        c = b.view(10, 100)  # a view: no new storage
        c.mul_(w.view(10, 100))  # in place on b's storage: nothing new
        return (b * 3).sum()  # b, b * 3 and the sum: 8004

    assert peak_live_bytes(chain) == 8004
    assert peak_live_bytes(lambda: w.mul_(2)) == 0  # an input written in place
    assert peak_live_bytes(lambda: (x * 2) * 2, exclude=[x]) == 8000  # x * 2 and its double
    with torch.no_grad():
        model = nn.Sequential(*[nn.Linear(100, 100) for _ in range(10)])
        per_layer = 64 * 100 * 4
        peak = peak_live_bytes(lambda: model(torch.ones(64, 100)), exclude=list(model.parameters()))
    assert 2 * per_layer <= peak <= 4 * per_layer  # a few layers' outputs at once, not ten


def test_saved_tensor_bytes_counts_each_storage_once_and_not_the_excluded():
    from fl_lightning.backends.batched.sizing import saved_tensor_bytes

    w = torch.ones(3, 4, requires_grad=True)
    x = torch.ones(5, 3)
    assert saved_tensor_bytes(lambda: (x @ w).relu().sum(), exclude=[w]) == 5 * 3 * 4 + 5 * 4 * 4  # x, relu's output
    assert saved_tensor_bytes(lambda: (x @ w).relu().sum()) == 5 * 3 * 4 + 5 * 4 * 4  # w is not saved here
    y = x.clone().requires_grad_()
    assert saved_tensor_bytes(lambda: (y * y[:, :1]).sum()) == 5 * 3 * 4  # both factors are views of one storage


def test_block_size():
    from fl_lightning.backends.batched.sizing import block_size

    assert block_size(50, 10, None) == 50 and block_size(50, 0, 100) == 50
    assert block_size(50, 10, 400) == 10 and block_size(50, 10, 39) == 1
    assert block_size(50, 10, 400, held=40) == 6 and block_size(50, 10, 400, held=400) == 1
    with pytest.raises(ValueError, match="clients=0"):
        block_size(0, 10, 100)
    with pytest.raises(ValueError, match="held=-1"):
        block_size(5, 10, 100, held=-1)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["SCAFFOLD", "FedDRO"])
def test_two_processes_equal_one(name, tmp_path):
    from tests.test_contract import Snapshot

    results = []
    for devices in (1, 2):
        path = str(tmp_path / f"{devices}.pt")
        strategy = TWO_PROCESSES if devices > 1 else "auto"
        module = SUPPORTED[name]("batched", 2)
        trainer(2, devices=devices, strategy=strategy, callbacks=[Snapshot(path)]).fit(module, synthetic(6))
        results.append(torch.load(path))
    assert_close(*results, atol=1e-5)


def test_a_block_copies_and_checks_its_clients_with_operations_that_do_not_grow_with_them():
    """On a GPU each tensor operation is a launch: a block's round copies no client's start model
    of its own (without ``client_init``) and checks the block's uploads for NaN/Inf with one
    reduction, so the copies and checks of a round are as many for 12 clients as for 4."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Counted(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.names: list[str] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.names.append(str(func))
            return func(*args, **(kwargs or {}))

    def copies_and_checks(clients: int) -> int:
        module = FedAvg(mlp(), clients_per_round=clients, **common("batched", clients))
        with Counted() as counted:
            trainer(2).fit(module, synthetic(clients))
        return sum(name.startswith(("aten.clone", "aten.aminmax")) for name in counted.names)

    assert copies_and_checks(12) == copies_and_checks(4)


def _finetuned(module: pl.LightningModule, clients: list[int], steps: int = 4) -> dict[int, torch.Tensor]:
    return dict(module.engine.train_clients_locally(clients, steps=steps, stream="finetune", round_idx=0))


@pytest.mark.parametrize("name", ["FedAvg", "FedAvg-momentum-wd", "FedProx", "SCAFFOLD"])
@pytest.mark.parametrize("block", [None, 3])
def test_plain_training_of_many_clients_equals_one_by_one(name, block, monkeypatch):
    """``train_clients_locally`` (finetuning, say) trains blocks of clients at once, each step one
    vectorized call over the block (the client's loss and its optimizer as a function, momentum and
    weight decay included; clients with fewer samples than the batch in blocks of their own): the
    sequential backend's models to 1e-5, from the same global model, the client module left as it was."""
    module, _ = fitted(SUPPORTED[name], "batched", block=4, rounds=1, batch_size=64)
    module.engine.backend.requested_block = block  # the asked-for block, or (None) what memory holds
    if block is not None:
        module.engine.backend.clients_per_block = block
    clients = list(range(6))
    before = module.global_model.flatten().clone()
    one_by_one = dict(train_one_by_one(module.engine.context, clients, before, 4, "finetune", 0))
    assert torch.equal(module.global_model.flatten(), before)
    calls = []
    advance = BatchedBackend._advance
    monkeypatch.setattr(BatchedBackend, "_advance", lambda self, context, block_, groups, step, phase, reseed=None: (
        calls.append([len(g.members) for g in groups]) or advance(self, context, block_, groups, step, phase, reseed)))
    monkeypatch.setattr("fl_lightning.backends.batched.backend.train_one_by_one", None)  # not used: all vectorized
    together = _finetuned(module, clients)
    assert torch.equal(module.global_model.flatten(), before)
    assert list(together) == clients
    assert_close(one_by_one, together, atol=1e-5)
    assert max(abs(float((one_by_one[c] - before).abs().max())) for c in clients) > 1e-3  # they trained
    assert sum(sum(sizes) for sizes in calls) == 4 * len(clients)  # every client's 4 steps, in vectorized calls
    assert len(calls) < 4 * len(clients)


def test_plain_training_keeps_each_clients_batches_and_its_stream():
    """A client's finetuned model does not depend on the others trained beside it, and another
    stream (or round) draws other batches."""
    module, _ = fitted(SUPPORTED["FedAvg"], "batched", rounds=1)
    alone = _finetuned(module, [2])[2]
    assert_close({2: alone}, {2: _finetuned(module, [0, 1, 2, 5])[2]}, atol=1e-6)
    other = dict(module.engine.train_clients_locally([2], steps=4, stream="batches", round_idx=0))[2]
    assert float((other - alone).abs().max()) > 1e-4


def test_plain_training_with_batches_a_callback_changes_runs_one_client_after_another(monkeypatch):
    """Where a callback rewrites local batches (label flipping), the batched backend trains the clients
    one after another through the callbacks, as the sequential backend does."""
    from fl_lightning.backends.batched import backend as batched_module
    from fl_lightning.callbacks import LabelFlipAttack

    results, one_by_one = [], []
    monkeypatch.setattr(batched_module, "train_one_by_one",
                        lambda *args: one_by_one.append(args[1]) or train_one_by_one(*args))
    for backend in ("sequential", "batched"):
        module = FedAvg(mlp(), clients_per_round=5, local_steps=3, client_backend=backend, seed=1)
        trainer(1, callbacks=[LabelFlipAttack(fraction=0.4, seed=0)]).fit(module, synthetic(6))
        results.append(_finetuned(module, list(range(6))))
    assert one_by_one == [list(range(6))]
    assert_close(*results, atol=1e-5)


def test_finetuning_figures_are_the_same_in_both_backends():
    """``LocalFinetuning`` logs the same figures whichever backend finetunes the clients."""
    from fl_lightning.callbacks import LocalFinetuning

    figures = []
    for backend in ("sequential", "batched"):
        module = FedAvg(mlp(0.9), clients_per_round=5, local_steps=3, client_backend=backend, seed=1)
        t = trainer(2, callbacks=[LocalFinetuning(steps=5, split=["val", "test"])], check_val_every_n_epoch=1)
        t.fit(module, synthetic(6, val_fraction=0.2))
        figures.append({k: float(v) for k, v in t.callback_metrics.items() if k.startswith("finetuned_")})
    assert figures[0] and figures[0] == figures[1]


def test_plain_training_out_of_memory_goes_again_in_halves(monkeypatch):
    """A default-sized block of plain training that runs out of device memory (simulated: any block of
    more than 2 clients, at its second step) trains again in halves from the start, with one warning,
    and gives the same models; a block size the user chose raises the error."""
    module, _ = fitted(SUPPORTED["FedAvg-momentum-wd"], "batched", rounds=1)
    module.engine.backend.requested_block = None
    module.engine.backend._memory = (1, torch.device("cpu"))  # sized by memory: all 6 clients fit
    start = module.global_model.flatten().clone()
    expected = dict(train_one_by_one(module.engine.context, list(range(6)), start, 4, "finetune", 0))
    advance = BatchedBackend._advance

    def failing_advance(self, context, block, groups, step, phase, reseed=None):
        if len(block.runs) > 2 and step == 1:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory (simulated)")
        return advance(self, context, block, groups, step, phase, reseed)

    monkeypatch.setattr(BatchedBackend, "_advance", failing_advance)
    with pytest.warns(UserWarning, match="ran out of memory in training, in a block of 6 clients"):
        halved = _finetuned(module, list(range(6)))
    assert module.engine.backend._fitting == {"training": 2}  # 6 -> 3 -> 2
    assert list(halved) == list(range(6))
    assert_close(expected, halved, atol=1e-5)
    module.engine.backend.requested_block = module.engine.backend.clients_per_block = 4
    with pytest.raises(torch.cuda.OutOfMemoryError):
        _finetuned(module, list(range(6)))
