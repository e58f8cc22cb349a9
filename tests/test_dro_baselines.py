"""FastDRO and PDSGD, the centralized DRO baselines of FedDRO: their weights, their steps, their refusals."""

from __future__ import annotations

import math
import pickle
import warnings

import pytest
import pytorch_lightning as pl
import torch
import torch.nn.functional as F

from fl_lightning.algorithms import PDSGD, FastDRO, FedAvg
from fl_lightning.functional.dro import (
    chi_square_penalty,
    chi_square_weights,
    cvar_weights,
    kl_dual_step,
    simplex_projection,
)
from fl_lightning.seeding import generator
from tests.helpers import TWO_PROCESSES, global_vector, straight_and_resumed, synthetic, tiny_client, trainer


# ------------------------------------------------------------------ the weights
def test_cvar_weights_take_the_upper_tail():
    losses = torch.tensor([0.1, 3.0, 0.5, 2.0, 1.0])
    q = cvar_weights(losses, 0.3)  # alpha b = 1.5 samples: the largest, and half the next
    torch.testing.assert_close(q, torch.tensor([0.0, 2 / 3, 0.0, 1 / 3, 0.0]))
    assert float((q * losses).sum()) == pytest.approx((3.0 + 0.5 * 2.0) / 1.5)
    torch.testing.assert_close(cvar_weights(losses, 1.0), torch.full((5,), 0.2))
    batch = torch.rand(4, 7)
    torch.testing.assert_close(torch.vmap(lambda l: cvar_weights(l, 0.5))(batch),
                               torch.stack([cvar_weights(l, 0.5) for l in batch]))
    with pytest.raises(ValueError, match="alpha must be in"):
        cvar_weights(losses, 0.0)


def test_chi_square_weights_maximize_the_penalized_objective():
    torch.manual_seed(0)
    losses, lam = torch.tensor([0.1, 3.0, 0.5, 2.0, 1.0], dtype=torch.float64), 1.0
    q = chi_square_weights(losses, lam)
    assert float(q.sum()) == pytest.approx(1.0) and bool((q >= 0).all()) and float(q[0]) == 0.0  # clipped
    best = float((q * losses).sum() - chi_square_penalty(q, lam))
    others = torch.distributions.Dirichlet(torch.ones(5, dtype=torch.float64)).sample((20000,))
    values = (others * losses).sum(-1) - chi_square_penalty(others, lam)
    assert float(values.max()) <= best + 1e-12
    torch.testing.assert_close(chi_square_weights(losses, 1e9), torch.full((5,), 0.2, dtype=torch.float64))
    with pytest.raises(ValueError, match="lam must be > 0"):
        chi_square_weights(losses, 0.0)


def test_simplex_projection_is_the_nearest_point_of_the_simplex():
    torch.manual_seed(1)
    v = torch.randn(6, dtype=torch.float64)
    p = simplex_projection(v)
    assert float(p.sum()) == pytest.approx(1.0) and bool((p >= 0).all())
    others = torch.distributions.Dirichlet(torch.ones(6, dtype=torch.float64)).sample((20000,))
    assert float(((others - v) ** 2).sum(-1).min()) >= float(((p - v) ** 2).sum()) - 1e-12
    torch.testing.assert_close(simplex_projection(torch.tensor([0.2, 0.3, 0.5])), torch.tensor([0.2, 0.3, 0.5]))


def test_the_dual_step_converges_to_the_kl_worst_case():
    """With the full losses as the gradient, the proximal steps converge to ``q* = softmax(l / lam)``,
    the maximizer of ``sum q l - lam KL(q || 1/n)``."""
    losses, lam = torch.tensor([0.2, 1.5, 0.7, 3.0], dtype=torch.float64), 0.8
    log_q = torch.full((4,), -torch.log(torch.tensor(4.0, dtype=torch.float64)).item(), dtype=torch.float64)
    for _ in range(200):
        log_q = kl_dual_step(log_q, losses, lam, lr=0.5)
    torch.testing.assert_close(log_q.exp(), torch.softmax(losses / lam, 0))


# ------------------------------------------------------------------ FastDRO
def test_fastdro_steps_along_the_weighted_gradient():
    """One client, one step: ``x1 = x0 - lr sum_i q_i grad l_i(x0)`` with the CVaR weights of the batch."""
    module = FastDRO(tiny_client(lr=0.3), alpha=0.25, clients_per_round=1, local_steps=1, seed=5)
    start = global_vector(module)
    batches = []

    class Record(FastDRO):
        def client_step(self, run, batch):
            batches.append(batch)
            return super().client_step(run, batch)

    recorded = Record(tiny_client(lr=0.3), alpha=0.25, clients_per_round=1, local_steps=1, seed=5)
    trainer(1).fit(recorded, synthetic(1))
    x, y = batches[0]
    reference = tiny_client(lr=0.3)
    losses = F.cross_entropy(reference(x), y, reduction="none")
    q = cvar_weights(losses.detach(), 0.25)
    grads = torch.autograd.grad((q * losses).sum(), list(reference.parameters()))
    expected = start - 0.3 * torch.cat([g.reshape(-1) for g in grads])
    torch.testing.assert_close(global_vector(recorded), expected)
    assert (global_vector(recorded) - global_vector(module)).abs().max() > 1e-4  # it trained


def test_fastdro_at_alpha_one_is_fedavg():
    fast = FastDRO(tiny_client(), alpha=1.0, clients_per_round=3, local_steps=2, seed=2)
    fedavg = FedAvg(tiny_client(), clients_per_round=3, local_steps=2, seed=2)
    for module in (fast, fedavg):
        trainer(2).fit(module, synthetic(6))
    torch.testing.assert_close(global_vector(fast), global_vector(fedavg))


@pytest.mark.parametrize("bad, match", [
    (dict(robust_loss="kl"), "robust_loss must be 'cvar' or 'chi_square'"),
    (dict(alpha=1.5), "alpha must be in"),
    (dict(lam=-1.0), "lam must be > 0"),
])
def test_fastdro_refuses_bad_arguments(bad, match):
    with pytest.raises(ValueError, match=match):
        FastDRO(tiny_client(), **bad)


def test_fastdro_refuses_momentum():
    client = tiny_client()
    client.configure_optimizers = lambda: torch.optim.SGD(client.parameters(), lr=0.1, momentum=0.9)
    with pytest.raises(ValueError, match="FastDRO"):
        trainer(1).fit(FastDRO(client, clients_per_round=2), synthetic(4))


# ------------------------------------------------------------------ PDSGD
def test_pdsgd_takes_the_primal_and_dual_steps_of_its_docstring():
    """Two steps on the one client, replayed by hand from its keyed minibatch indices."""
    lr, lam, dual_lr, b = 0.2, 2.0, 0.5, 16
    module = PDSGD(tiny_client(lr=lr), lam=lam, dual_lr=dual_lr, local_steps=2, seed=3)
    dm = synthetic(1, batch_size=b)
    trainer(1).fit(module, dm)

    train = torch.as_tensor(dm.splits["train"][0])
    xs, ys = (torch.stack([dm.pool[int(i)][k] for i in train]) for k in (0, 1))
    n = len(train)
    positions = torch.randint(n, (2, b), generator=generator(3, "pdsgd", 0, 0))
    reference = tiny_client(lr=lr)
    log_q = torch.full((n,), -math.log(n), dtype=torch.float64)
    for pos in positions:
        losses = F.cross_entropy(reference(xs[pos]), ys[pos], reduction="none")
        weights = (n / b) * log_q[pos].exp().float()
        grads = torch.autograd.grad((weights * losses).sum(), list(reference.parameters()))
        with torch.no_grad():
            for p, g in zip(reference.parameters(), grads):
                p -= lr * g
        estimate = torch.zeros(n, dtype=torch.float64).index_add_(0, pos, losses.detach().double() * (n / b))
        log_q = kl_dual_step(log_q, estimate, lam, dual_lr)
    torch.testing.assert_close(global_vector(module), torch.cat([p.detach().reshape(-1) for p in reference.parameters()]))
    stored = module.engine.store.get(0, "log_dual")
    torch.testing.assert_close(stored.to(log_q.dtype), log_q)
    assert float(stored.exp().sum()) == pytest.approx(1.0)


def test_pdsgd_resumes_exactly_with_its_duals(tmp_path):
    def build() -> PDSGD:
        return PDSGD(tiny_client(), lam=1.0, dual_lr=0.3, local_steps=3, seed=1)

    straight, resumed = straight_and_resumed(build, lambda: synthetic(1), 3, 2, tmp_path)
    assert torch.equal(global_vector(straight), global_vector(resumed))
    assert torch.equal(straight.engine.store.get(0, "log_dual"), resumed.engine.store.get(0, "log_dual"))
    assert isinstance(pickle.loads(pickle.dumps(build())), PDSGD)


def test_pdsgd_warns_when_its_dual_step_would_pile_the_duals_onto_the_latest_batches():
    """dual_lr * n / b > 1 warns; at 14 the duals concentrate on the latest batch and the primal step stops."""
    data = synthetic(1, min_samples=2000, max_samples=2000, batch_size=10)
    steps = []

    class Moves(pl.Callback):
        def on_train_epoch_start(self, trainer, module):
            self.start = global_vector(module).clone()

        def on_train_epoch_end(self, trainer, module):
            steps.append(float((global_vector(module) - self.start).norm()))

    with pytest.warns(UserWarning, match=r"1399 samples .* dual_lr \* n / b = 14 .* use dual_lr below b / n = 0.00715"):
        trainer(3, callbacks=[Moves()]).fit(PDSGD(tiny_client(), lam=1.0, dual_lr=0.1, local_steps=2, seed=0), data)
    assert steps[0] > 0 and max(steps[1:]) < 1e-6 * steps[0]  # moved in round 1, then stopped
    steps.clear()
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="PDSGD")
        trainer(3, callbacks=[Moves()]).fit(PDSGD(tiny_client(), lam=1.0, dual_lr=0.0007, local_steps=2, seed=0),
                                            synthetic(1, min_samples=2000, max_samples=2000, batch_size=10))
    assert min(steps) > 0.1 * steps[0]


def test_pdsgd_needs_the_one_client_that_holds_every_sample():
    with pytest.raises(ValueError, match=r"one-client federation .* got 4 training clients"):
        trainer(1).fit(PDSGD(tiny_client()), synthetic(4))


@pytest.mark.parametrize("bad, match", [
    (dict(lam=0.0), "lam must be > 0"),
    (dict(dual_lr=0.0), "dual_lr must be > 0"),
    (dict(local_epochs=1), "local_epochs must be None"),
])
def test_pdsgd_refuses_bad_arguments(bad, match):
    with pytest.raises(ValueError, match=match):
        PDSGD(tiny_client(), **bad)


@pytest.mark.slow
def test_pdsgd_on_two_processes_equals_one():
    """The one client runs on one of the two processes; the other has no client and waits."""
    models = []
    for devices in (1, 2):
        module = PDSGD(tiny_client(), lam=1.0, dual_lr=0.3, local_steps=3, seed=1)
        trainer(2, devices=devices, strategy=TWO_PROCESSES if devices > 1 else "auto").fit(module, synthetic(1))
        models.append(global_vector(module))
    assert (models[0] - models[1]).abs().max() <= 1e-6
