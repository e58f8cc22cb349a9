"""FedDeper: the spec's degenerate cases, a hand-computed round, DDP, resume, validation,
the paper's CNNs and the personalized evaluation on local test sets."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from pytorch_lightning.callbacks import ModelCheckpoint

from fl_lightning.algorithms.fedavg import FedAvg
from fl_lightning.algorithms.feddeper import FedDeper, mix_personal
from fl_lightning.callbacks import FederatedCallback
from fl_lightning.callbacks.personalized import PersonalizedAccuracy, add_extra_classes, local_test_indices
from fl_lightning.models.cnn import CNN
from fl_lightning.optim.plain_sgd import require_plain_sgd
from fl_lightning.seeding import generator
from tests.helpers import (
    TWO_PROCESSES,
    checkpoint_client_state,
    global_vector,
    straight_and_resumed,
    synthetic,
    tiny_client,
    trainer,
)


def make(cls=FedDeper, hidden=(8,), **kwargs):
    kwargs.setdefault("clients_per_round", 3)
    kwargs.setdefault("local_steps", 3)
    kwargs.setdefault("seed", 1)
    return cls(tiny_client(hidden=hidden), **kwargs)


class Recorder(FederatedCallback):
    """Keeps, per round, the start model, the uploads and the personal models before the round."""

    def __init__(self):
        self.rounds = []

    def on_round_start(self, trainer, module, round_idx, clients):
        before = {c: module.personal_model(c).cpu().clone() for c in module.engine.datamodule.train_clients}
        self.rounds.append({"start": module.engine.round_start.cpu().clone(), "uploads": {}, "before": before})

    def on_client_update(self, trainer, module, update):
        self.rounds[-1]["uploads"][update.client_id] = update.tensors["delta"].cpu().clone()
        return update


# ------------------------------------------------------------------ pure functions
def test_mixing():
    v, y = torch.tensor([3.0, -1.0]), torch.tensor([0.0, 4.0])
    assert torch.allclose(mix_personal(v, y, 0.25), 0.75 * v + 0.25 * y)
    assert torch.equal(mix_personal(v, y, 1.0), y)


def test_plain_sgd_is_required():
    p = [torch.nn.Parameter(torch.zeros(2))]
    assert require_plain_sgd(torch.optim.SGD(p, lr=0.05), "FedDeper") == 0.05
    with pytest.raises(ValueError, match="momentum=0.9"):
        require_plain_sgd(torch.optim.SGD(p, lr=0.05, momentum=0.9), "FedDeper")
    with pytest.raises(ValueError, match="plain torch.optim.SGD, got Adam"):
        require_plain_sgd(torch.optim.Adam(p), "FedDeper")
    module = FedDeper(tiny_client(hidden=(8,)), clients_per_round=2, local_steps=1)
    module.client.momentum = 0.9
    with pytest.raises(ValueError, match="momentum"):
        trainer(1).fit(module, synthetic(4))


@pytest.mark.parametrize("kwargs,match", [({"rho": 1.0}, "rho must be in \\[0, 1\\), got 1.0"),
                                          ({"rho": -0.1}, "rho must be in"),
                                          ({"lam": 1.5}, "lam must be in \\[0, 1\\], got 1.5"),
                                          ({"lam": -0.1}, "lam must be in"),
                                          ({"update_order": "random"}, "update_order must be 'jacobi' or 'gauss_seidel'")])
def test_invalid_rho_and_lam(kwargs, match):
    with pytest.raises(ValueError, match=match):
        FedDeper(tiny_client(), **kwargs)


def test_small_lam_warns():
    with pytest.warns(UserWarning, match="lam=0.45 is below 0.5"):
        FedDeper(tiny_client(), lam=0.45)


# ------------------------------------------------------------------ the update rules
def test_rho_zero_gives_fedavg_trajectory():
    deper, avg = make(rho=0.0, lam=0.7), make(FedAvg, weighting="uniform")  # FedDeper's mean is uniform (A5)
    trainer(3).fit(deper, synthetic(6))
    trainer(3).fit(avg, synthetic(6))
    assert torch.equal(global_vector(deper), global_vector(avg))
    assert (global_vector(deper) - global_vector(make())).abs().max() > 1e-3  # it trained


@pytest.mark.parametrize("weighting", [None, "num_samples"])
def test_aggregate_is_the_uniform_mean_by_default(weighting):
    """Spec A5: x1 = x0 + (1/|U|) sum_i (y_i - x0) on clients of unequal size; ``weighting="num_samples"``
    gives sum_i n_i (y_i - x0) / sum_i n_i."""
    recorder, module, dm = Recorder(), make(weighting=weighting), synthetic(6)
    trainer(1, callbacks=[recorder]).fit(module, dm)
    uploads = recorder.rounds[0]["uploads"]
    sizes = torch.tensor([float(dm.num_samples(c)) for c in uploads], dtype=torch.float64)
    assert len(set(sizes.tolist())) > 1
    deltas = torch.stack(list(uploads.values())).double()
    means = {"uniform": deltas.mean(0), "num_samples": (deltas * sizes[:, None]).sum(0) / sizes.sum()}
    assert (means["uniform"] - means["num_samples"]).abs().max() > 1e-4
    expected = recorder.rounds[0]["start"] + means[weighting or "uniform"].float()
    assert torch.allclose(global_vector(module), expected, atol=1e-6)


def tiny_grad(w: torch.Tensor, batch) -> torch.Tensor:
    """The gradient of ``tiny_client``'s mean cross-entropy on ``batch`` at its flat parameters ``w``."""
    w = w.clone().requires_grad_(True)
    logits = batch[0] @ w[:200].view(10, 20).T + w[200:]
    return torch.autograd.grad(F.cross_entropy(logits, batch[1]), w)[0]


def test_one_round_matches_the_equations():
    """Two local steps of one client on a linear model, computed by hand (Jacobi order: y uses v_j)."""
    lr, rho, lam, seed = 0.1, 0.2, 0.7, 5
    module = FedDeper(tiny_client(lr=lr), rho=rho, lam=lam, clients_per_round=1, local_steps=2, seed=seed)
    x0 = global_vector(module)
    dm = synthetic(4)
    trainer(1).fit(module, dm)
    (cid,) = module.engine.round_clients

    y, v = x0.clone(), x0.clone()
    for batch in dm.client_data(cid, "train").step_batches(2, generator(seed, "batches", 0, cid)):
        y, v = y - lr * tiny_grad(y, batch) - rho * (v + y - 2 * x0), v - lr * tiny_grad(v, batch)
    assert torch.allclose(global_vector(module), y, atol=1e-6)
    assert torch.allclose(module.engine.store.get(cid, "personal"), (1 - lam) * v + lam * y, atol=1e-6)


def test_gauss_seidel_order_uses_the_stepped_personal_model():
    """``update_order="gauss_seidel"``: v steps first, the y-step pulls toward 2x - v_{j+1}."""
    lr, rho, lam, seed = 0.1, 0.2, 0.7, 5
    module = FedDeper(tiny_client(lr=lr), rho=rho, lam=lam, clients_per_round=1, local_steps=2, seed=seed,
                      update_order="gauss_seidel")
    x0 = global_vector(module)
    dm = synthetic(4)
    trainer(1).fit(module, dm)
    (cid,) = module.engine.round_clients

    y, v = x0.clone(), x0.clone()
    for batch in dm.client_data(cid, "train").step_batches(2, generator(seed, "batches", 0, cid)):
        v = v - lr * tiny_grad(v, batch)
        y = y - lr * tiny_grad(y, batch) - rho * (v + y - 2 * x0)
    assert torch.allclose(global_vector(module), y, atol=1e-6)
    assert torch.allclose(module.engine.store.get(cid, "personal"), (1 - lam) * v + lam * y, atol=1e-6)


def test_independent_batches_step_v_on_its_own_stream():
    """With ``independent_batches`` v takes its batches from the stream "personal_batches"."""
    lr, rho, lam, seed = 0.1, 0.2, 0.7, 5
    module = FedDeper(tiny_client(lr=lr), rho=rho, lam=lam, clients_per_round=1, local_steps=2, seed=seed,
                      independent_batches=True)
    x0 = global_vector(module)
    dm = synthetic(4)
    trainer(1).fit(module, dm)
    (cid,) = module.engine.round_clients

    data = dm.client_data(cid, "train")
    y_batches = data.step_batches(2, generator(seed, "batches", 0, cid))
    v_batches = data.step_batches(2, generator(seed, "personal_batches", 0, cid))
    y, v = x0.clone(), x0.clone()
    for by, bv in zip(y_batches, v_batches):
        assert not torch.equal(by[1], bv[1])  # the two streams differ
        y, v = y - lr * tiny_grad(y, by) - rho * (v + y - 2 * x0), v - lr * tiny_grad(v, bv)
    assert torch.allclose(global_vector(module), y, atol=1e-6)
    assert torch.allclose(module.engine.store.get(cid, "personal"), (1 - lam) * v + lam * y, atol=1e-6)


def test_reset_personal_starts_v_from_the_global_model():
    """``reset_personal``: the second round's personal model starts from x^1, not from the stored
    v_i (which the same client's first round left elsewhere), and the stored v_i is still mixed."""
    lr, rho, lam, seed = 0.1, 0.2, 0.7, 5

    ends = {}
    for reset in (True, False):
        recorder = Recorder()
        module = FedDeper(tiny_client(lr=lr), rho=rho, lam=lam, clients_per_round=1, local_steps=2, seed=seed,
                          reset_personal=reset)
        dm = synthetic(1)
        trainer(2, callbacks=[recorder]).fit(module, dm)
        x1, (cid,) = recorder.rounds[1]["start"], module.engine.round_clients
        stored_before = recorder.rounds[1]["before"][cid]
        assert not torch.equal(stored_before, x1)  # the first round left a personal model of its own
        y, v = x1.clone(), (x1 if reset else stored_before).clone()
        for batch in dm.client_data(cid, "train").step_batches(2, generator(seed, "batches", 1, cid)):
            y, v = y - lr * tiny_grad(y, batch) - rho * (v + y - 2 * x1), v - lr * tiny_grad(v, batch)
        assert torch.allclose(global_vector(module), y, atol=1e-6)
        assert torch.allclose(module.engine.store.get(cid, "personal"), (1 - lam) * v + lam * y, atol=1e-6)
        ends[reset] = global_vector(module)
    assert not torch.allclose(ends[True], ends[False], atol=1e-4)


def test_personal_init_first_round_starts_a_new_client_from_that_rounds_global_model():
    """``personal_init="first_round"``: a client first sampled in round 1 starts v from x^1 (with
    ``"x0"``, from x^0), so its y-step pulls toward ``2x^1 - v``; a client sampled again resumes its v_i."""
    lr, rho, lam, seed = 0.1, 0.2, 0.7, 5

    ends = {}
    for init in ("first_round", "x0"):
        recorder = Recorder()
        module = FedDeper(tiny_client(lr=lr), rho=rho, lam=lam, clients_per_round=1, local_steps=2, seed=seed,
                          personal_init=init)
        x0 = global_vector(module)
        dm = synthetic(6)
        trainer(2, callbacks=[recorder]).fit(module, dm)
        (first,), (cid,) = recorder.rounds[0]["uploads"], recorder.rounds[1]["uploads"]
        assert cid != first  # round 1's client is new (seeded draw)
        x1 = recorder.rounds[1]["start"]
        y, v = x1.clone(), (x1 if init == "first_round" else x0).clone()
        for batch in dm.client_data(cid, "train").step_batches(2, generator(seed, "batches", 1, cid)):
            y, v = y - lr * tiny_grad(y, batch) - rho * (v + y - 2 * x1), v - lr * tiny_grad(v, batch)
        assert torch.allclose(global_vector(module), y, atol=1e-6)
        assert torch.allclose(module.engine.store.get(cid, "personal"), (1 - lam) * v + lam * y, atol=1e-6)
        ends[init] = global_vector(module)
    assert not torch.allclose(ends["first_round"], ends["x0"], atol=1e-4)


def test_personal_init_is_checked():
    with pytest.raises(ValueError, match="personal_init must be 'x0' or 'first_round', got 'x1'"):
        FedDeper(tiny_client(), personal_init="x1")


def test_lam_one_restarts_personal_from_upload_and_others_keep_theirs():
    recorder = Recorder()
    module = make(lam=1.0)
    x0 = global_vector(module)
    trainer(3, callbacks=[recorder]).fit(module, synthetic(6))
    last = recorder.rounds[-1]
    for cid in module.engine.datamodule.train_clients:
        stored = module.personal_model(cid).cpu()
        if cid in last["uploads"]:
            assert torch.allclose(stored, last["start"] + last["uploads"][cid], atol=1e-6)
        else:
            assert torch.equal(stored, last["before"][cid])
    never = [c for c in module.engine.datamodule.train_clients if all(c not in r["uploads"] for r in recorder.rounds)]
    for cid in never:
        assert cid not in module.engine.store and torch.equal(module.personal_model(cid).cpu(), x0)


def test_personal_models_live_in_the_store_on_cpu():
    module = make()
    trainer(1).fit(module, synthetic(6))
    assert sorted(module.engine.store.clients()) == module.engine.round_clients  # lazily created
    assert all(module.engine.store.get(c, "personal").device.type == "cpu" for c in module.engine.store.clients())
    assert module.engine.store.nbytes() == 3 * module.global_model.dim * 4


# ------------------------------------------------------------------ resume and DDP
def test_resume_is_exact_with_personal_models(tmp_path):
    straight, resumed = straight_and_resumed(make, lambda: synthetic(6), 4, 2, tmp_path)
    assert torch.equal(global_vector(straight), global_vector(resumed))
    assert torch.equal(straight.initial_state, resumed.initial_state)
    assert sorted(straight.engine.store.clients()) == sorted(resumed.engine.store.clients())
    for cid in straight.engine.store.clients():
        assert torch.equal(straight.engine.store.get(cid, "personal"), resumed.engine.store.get(cid, "personal"))


@pytest.mark.slow
def test_two_processes_equal_one(tmp_path):
    stores = []
    for devices in (1, 2):
        ckpt = ModelCheckpoint(dirpath=tmp_path / str(devices), save_last=True, save_top_k=0)
        strategy = TWO_PROCESSES if devices > 1 else "auto"
        module = make(clients_per_round=5, local_steps=4)
        trainer(3, callbacks=[ckpt], enable_checkpointing=True, devices=devices, strategy=strategy).fit(module, synthetic(8))
        stores.append((global_vector(module), torch.load(tmp_path / str(devices) / "last.ckpt", weights_only=False)))
    (g1, c1), (g2, c2) = stores
    assert (g1 - g2).abs().max() <= 1e-5
    s1, s2 = (checkpoint_client_state(c) for c in (c1, c2))
    assert sorted(s1) == sorted(s2) and len(s1) > 5  # rank 0 holds the personal models of both ranks' clients
    for cid in s1:
        assert (s1[cid]["personal"] - s2[cid]["personal"]).abs().max() <= 1e-5


# ------------------------------------------------------------------ models
def test_paper_cnns():
    mnist, cifar = CNN(), CNN.cifar10()
    assert sum(p.numel() for p in mnist.parameters()) == 3_761_034
    assert sum(p.numel() for p in cifar.parameters()) == 4_146_314
    assert mnist(torch.zeros(2, 1, 28, 28)).shape == (2, 10)
    assert cifar(torch.zeros(2, 3, 32, 32)).shape == (2, 10)
    with pytest.raises(ValueError, match="image_size=8 is too small"):
        CNN(image_size=8, kernel_size=5, padding=0)


# ------------------------------------------------------------------ personalized evaluation
def test_local_test_sets_follow_training_labels():
    train = [np.array([0] * 90 + [1] * 10), np.array([1] * 90), np.array([2] * 50)]
    test = np.array([0] * 10 + [1] * 20 + [2] * 5 + [3] * 4)
    local = local_test_indices(train, test)
    assert local[0].tolist() == list(range(10)) + [10, 11]  # all the 0s, its 10% share of the 1s
    assert local[1].tolist() == list(range(12, 30))
    assert local[2].tolist() == list(range(30, 35))  # class 3 is held by no client


def test_extra_classes_are_absent_classes_of_equal_size():
    test = np.repeat(np.arange(5), 20)
    local = np.arange(20, 30)  # ten samples of class 1
    out = add_extra_classes(local, test, 2, np.random.default_rng(0))
    classes, counts = np.unique(test[out], return_counts=True)
    assert 1 in classes and len(classes) == 3 and counts.tolist() == [10, 10, 10]
    assert np.array_equal(out, add_extra_classes(local, test, 2, np.random.default_rng(0)))
    with pytest.raises(ValueError, match="extra_classes=5 but only 4 classes"):
        add_extra_classes(local, test, 5, np.random.default_rng(0))


def test_personalized_accuracy_is_logged():
    cbs = [PersonalizedAccuracy(), PersonalizedAccuracy(extra_classes=2)]
    t = trainer(2, callbacks=cbs, check_val_every_n_epoch=1)
    t.fit(make(), synthetic(6))
    for prefix in ("local", "local+2"):
        for name in ("personal_acc_mean", "personal_acc_worst", "global_acc_mean", "global_acc_worst"):
            assert 0.0 <= float(t.callback_metrics[f"{prefix}/{name}"]) <= 1.0
    assert t.callback_metrics["local/personal_acc_worst"] <= t.callback_metrics["local/personal_acc_mean"]
    t = trainer(1, callbacks=[PersonalizedAccuracy()], check_val_every_n_epoch=1)
    t.fit(make(FedAvg), synthetic(6))
    assert "local/global_acc_mean" in t.callback_metrics and "local/personal_acc_mean" not in t.callback_metrics
