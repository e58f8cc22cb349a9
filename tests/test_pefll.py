"""PeFLL, pFedHN, Local only, local finetuning and PeFLL-predict: tiny models, generated data."""

from __future__ import annotations

import copy
import warnings

import pytest
import pytorch_lightning as pl
import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call

from fl_lightning.algorithms.fedavg import FedAvg
from fl_lightning.algorithms.local_only import LocalOnly
from fl_lightning.algorithms.pefll import PeFLL, regularized_pseudo_gradient, vector_jacobian
from fl_lightning.algorithms.pfedhn import PFedHN
from fl_lightning.callbacks import FederatedCallback
from fl_lightning.callbacks.client_metrics import ClientMetrics
from fl_lightning.callbacks.finetune import LocalFinetuning
from fl_lightning.checkpoints import CheckpointError, load_checkpoint
from fl_lightning.models import MLP, LeNet
from fl_lightning.models.hypernetwork import (
    CNNEmbedding,
    HyperNetwork,
    LabelEmbedding,
    MLPEmbedding,
    mean_descriptor,
)
from fl_lightning.predict import load_pefll, mask_absent_classes, personalize, predict_clients
from fl_lightning.seeding import generator, sample_clients
from fl_lightning.vectors import ModelVector
from tests.helpers import synthetic, tiny_client, trainer


def pefll(use_labels: bool = True, **kwargs) -> PeFLL:
    torch.manual_seed(0)
    kwargs.setdefault("clients_per_round", 3)
    kwargs.setdefault("local_steps", 3)
    kwargs.setdefault("hypernetwork_width", 16)
    embedding = MLPEmbedding(20, 10, 4, hidden=(8,), use_labels=use_labels)
    return PeFLL(tiny_client(hidden=(8,)), embedding, **kwargs)


def data(num_clients: int = 10, **kwargs):
    kwargs.setdefault("test_fraction", 0.3)
    return synthetic(num_clients, **kwargs)


# ------------------------------------------------------------------ architectures
def test_hypernetwork_output_has_the_client_models_exact_shapes():
    client = LeNet(in_channels=3, image_size=32, conv_channels=(16, 32), hidden=(120, 84), num_classes=10)
    state = ModelVector(client)
    hyper = HyperNetwork(26, [p.shape for p in state.params], size="M")
    theta = hyper(torch.randn(26))
    assert theta.shape == (state.num_params,) == (121_182,)  # the paper's CIFAR-10 client (spec AC-7)
    for p, part in zip(state.params, theta.split([p.numel() for p in state.params])):
        assert part.view_as(p).shape == p.shape
    state.load(theta.detach())
    assert torch.equal(state.flatten(), theta.detach())
    assert sum(p.numel() for p in hyper.parameters()) == 12_272_382
    assert sum(p.numel() for p in CNNEmbedding(3, 32, 10, 26).parameters()) == 126_542


@pytest.mark.parametrize("size, hidden_layers", [("S", 2), ("M", 4), ("L", 6)])
def test_hypernetwork_sizes(size, hidden_layers):
    hyper = HyperNetwork(5, [(3, 2), (3,)], size=size, width=7)
    assert sum(isinstance(m, nn.Linear) for m in hyper.trunk) == hidden_layers
    assert hyper(torch.zeros(5)).shape == (9,)


def test_bad_arguments_fail_clearly():
    with pytest.raises(ValueError, match="size must be one of"):
        HyperNetwork(4, [(2,)], size="XL")
    with pytest.raises(ValueError, match="descriptor_dim"):
        HyperNetwork(0, [(2,)])
    with pytest.raises(ValueError, match="out_features"):
        PeFLL(tiny_client(), nn.ReLU())
    with pytest.raises(ValueError, match="floating buffers"):
        PeFLL(_BatchNormClient(), MLPEmbedding(20, 10, 4))
    with pytest.raises(ValueError, match="server_optimizer"):
        pefll(server_optimizer="rmsprop")
    with pytest.raises(ValueError, match="needs labels"):
        MLPEmbedding(20, 10, 4)(torch.zeros(2, 20), None)


def test_an_embedding_network_stays_out_of_the_hyperparameters_without_a_warning():
    """The embedding is a module argument: it is left out of ``hparams`` (checkpoints hold weights,
    not pickled objects), and Lightning's advice to leave it out is not shown to the user."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        module = PeFLL(tiny_client(), MLPEmbedding(20, 10, 4))
    assert "embedding" not in module.hparams and module.hparams["hypernetwork_width"] == 100


class _BatchNormClient(MLP):
    def __init__(self) -> None:
        super().__init__(in_features=20, hidden=(), num_classes=10)
        self.net = nn.Sequential(nn.Linear(20, 10), nn.BatchNorm1d(10))


# ------------------------------------------------------------------ descriptors
def test_descriptor_is_the_permutation_invariant_mean():
    torch.manual_seed(0)
    emb = MLPEmbedding(20, 10, 4, hidden=(8,))
    x, y = torch.randn(6, 20), torch.randint(0, 10, (6,))
    v = mean_descriptor(emb, x, y)
    assert v.shape == (4,)
    torch.testing.assert_close(v, emb(x, y).sum(0) / 6)
    perm = torch.randperm(6)
    torch.testing.assert_close(mean_descriptor(emb, x[perm], y[perm]), v)


def test_label_embedding_descriptor_is_linear_in_the_label_histogram():
    emb = LabelEmbedding(num_classes=5, descriptor_dim=3)
    y = torch.tensor([0, 0, 3, 4])
    hist = torch.bincount(y, minlength=5).float() / len(y)
    torch.testing.assert_close(mean_descriptor(emb, None, y), emb.linear.weight @ hist + emb.linear.bias)


def test_cnn_embedding_with_and_without_labels():
    x, y = torch.randn(2, 1, 28, 28), torch.tensor([1, 7])
    assert CNNEmbedding(1, 28, 10, 6)(x, y).shape == (2, 6)
    assert CNNEmbedding(1, 28, 10, 6, use_labels=False)(x).shape == (2, 6)


# ------------------------------------------------------------------ the two-stage backward
def test_split_vector_jacobian_products_equal_one_fused_backward():
    """Server VJP through h (to eta_h and v), then client VJP through phi, = autograd of the composition."""
    torch.manual_seed(0)
    emb, hyper = MLPEmbedding(20, 10, 4, hidden=(8,)), HyperNetwork(4, [(10, 20), (10,)], width=8)
    x, y, dtheta = torch.randn(5, 20), torch.randint(0, 10, (5,)), torch.randn(210)
    v = mean_descriptor(emb, x, y)
    received = v.detach().requires_grad_()
    theta = hyper(received)
    *d_hyper, dv = vector_jacobian(theta, [*hyper.parameters(), received], dtheta)
    d_embed = vector_jacobian(v, list(emb.parameters()), dv)
    fused = torch.autograd.grad(hyper(mean_descriptor(emb, x, y)), [*hyper.parameters(), *emb.parameters()], dtheta)
    for a, b in zip(d_hyper + d_embed, fused):
        torch.testing.assert_close(a, b)


class _Record(FederatedCallback):
    def on_round_start(self, trainer, module, round_idx, clients):
        self.before = {k: v.detach().clone() for k, v in module.named_parameters() if not k.startswith("client.")}


def test_one_round_with_one_plain_sgd_step_equals_end_to_end_sgd():
    """Spec AC-1/AC-12: k=1, plain SGD of step beta, server SGD lr 1, no penalty, no clipping ->
    eta_after = eta_before - beta * grad_eta L(h(v(B; eta_v); eta_h); B')."""
    beta, seed = 0.1, 5
    module = pefll(clients_per_round=1, local_steps=1, server_optimizer="sgd", server_lr=1.0, lambda_h=0.0,
                   lambda_v=0.0, server_clip=None, client_clip=None, seed=seed)
    module.client.lr = beta
    client0 = copy.deepcopy(module.client)
    record = _Record()
    dm = data(6)
    trainer(1, callbacks=[record]).fit(module, dm)

    cid = sample_clients(seed, 0, list(dm.train_clients), 1)[0]
    x_desc, y_desc = module.descriptor_batch(cid, 0)
    x, y = next(dm.client_data(cid, "train").step_batches(1, generator(seed, "batches", 0, cid)))
    before = {k: v.clone().requires_grad_() for k, v in record.before.items()}
    hyper, emb = copy.deepcopy(module.hypernetwork), copy.deepcopy(module.embedding)
    hyper_p = {k[len("hypernetwork."):]: v for k, v in before.items() if k.startswith("hypernetwork.")}
    emb_p = {k[len("embedding."):]: v for k, v in before.items() if k.startswith("embedding.")}
    v = functional_call(emb, emb_p, (x_desc, y_desc)).mean(0)
    theta = functional_call(hyper, hyper_p, ((v - module.descriptor_shift) / module.descriptor_scale,))
    shapes = [p.shape for p in client0.parameters()]
    names = [n for n, _ in client0.named_parameters()]
    params = {n: t.view(s) for n, t, s in zip(names, theta.split([s.numel() for s in shapes]), shapes)}
    loss = F.cross_entropy(functional_call(client0, params, (x,)), y)
    grads = torch.autograd.grad(loss, list(before.values()))
    after = dict(module.named_parameters())
    for (name, b), g in zip(before.items(), grads):
        torch.testing.assert_close(after[name].detach(), b.detach() - beta * g, rtol=1e-4, atol=1e-6)
    assert any(g.abs().max() > 0 for g in grads)


def test_regularized_pseudo_gradient():
    torch.testing.assert_close(
        regularized_pseudo_gradient(torch.tensor([1.0, -2.0]), torch.tensor([3.0, 4.0]), 0.5), torch.tensor([2.0, 6.0])
    )


# ------------------------------------------------------------------ training: state and statelessness
class _Shift(FederatedCallback):
    def __init__(self) -> None:
        self.values = []

    def on_round_end(self, trainer, module, round_idx, aggregate):
        self.values.append((float(module.descriptor_shift), float(module.descriptor_scale)))


def test_standardisation_is_frozen_and_clients_are_stateless():
    module, shift = pefll(), _Shift()
    trainer(3, callbacks=[shift]).fit(module, data(8))
    assert len(set(shift.values)) == 1 and shift.values[0] != (0.0, 1.0)
    assert len(module.engine.store) == 0  # nothing per client
    assert module.engine.upload_sizes() == {
        "hyper": sum(p.numel() for p in module.hypernetwork.parameters()),
        "embed": sum(p.numel() for p in module.embedding.parameters()),
    }


class _Curve(pl.Callback):
    def __init__(self) -> None:
        self.values: list[float] = []

    def on_validation_epoch_end(self, trainer, module):
        self.values.append(float(trainer.callback_metrics["clients_test/acc_mean"]))


def test_pefll_learns_personalized_models():
    """On label-skewed clients the generated models' accuracy rises well above where it starts."""
    module, curve = pefll(clients_per_round=4, local_steps=5, server_lr=3e-2), _Curve()
    dm = data(12, partition="classes", classes_per_client=2)
    trainer(6, callbacks=[ClientMetrics(), curve], check_val_every_n_epoch=1).fit(module, dm)
    assert curve.values[-1] >= curve.values[0] + 0.15, curve.values


class _DeltaNorms(FederatedCallback):
    def __init__(self):
        self.norms = []

    def on_client_update(self, trainer, module, update):
        self.norms.append(float(update.metrics["delta_norm"]))  # a device tensor until the round ends
        return update


def test_the_round_logs_the_mean_norm_of_the_clients_differences():
    module, spy = pefll(clients_per_round=3, local_steps=2), _DeltaNorms()
    fit = trainer(1, callbacks=[spy])
    fit.fit(module, data(6))
    assert len(spy.norms) == 3 and min(spy.norms) > 0
    assert float(fit.callback_metrics["round/client_delta_norm"]) == pytest.approx(sum(spy.norms) / 3, rel=1e-6)


# ------------------------------------------------------------------ PeFLL-predict
def trained(use_labels: bool = True) -> tuple[PeFLL, object]:
    module, dm = pefll(use_labels=use_labels), data(10, unseen_fraction=0.2)
    trainer(2).fit(module, dm)
    return module, dm


def test_predict_gives_an_unseen_client_its_model_without_training():
    module, dm = trained()
    cid = dm.unseen_clients[0]
    x, y = dm.client_data(cid, "train").full()
    server_before = [p.detach().clone() for p in module.parameters()]
    model = personalize(module, (x, y))
    again = personalize(module, (x, y))
    assert model is not module.client and not model.training
    torch.testing.assert_close(ModelVector(model).flatten(), ModelVector(again).flatten())
    torch.testing.assert_close(ModelVector(model).flatten(), module.client_eval_state(cid))
    assert all(torch.equal(a, b) for a, b in zip(server_before, module.parameters()))
    assert all(p.grad is None for p in module.parameters())
    assert model(x).shape == (len(x), 10)


def test_predict_with_hidden_labels_needs_a_label_free_embedding():
    module, dm = trained()
    x, y = dm.client_data(dm.unseen_clients[0], "train").full()
    with pytest.raises(ValueError, match="use_labels=False"):
        personalize(module, (x, y), labels_hidden=True)
    with pytest.raises(ValueError, match="use_labels=False"):
        personalize(module, x)
    free, dm = trained(use_labels=False)
    x, y = dm.client_data(dm.unseen_clients[0], "train").full()
    torch.testing.assert_close(
        ModelVector(personalize(free, x)).flatten(), ModelVector(personalize(free, (x, y), labels_hidden=True)).flatten()
    )


def test_checkpoint_round_trip(tmp_path):
    module, dm = trained()
    tr = trainer(1)
    tr.fit(module, dm)
    path = tmp_path / "pefll.ckpt"
    tr.save_checkpoint(path)
    embedding = MLPEmbedding(20, 10, 4, hidden=(8,))  # the architectures; the weights come from the checkpoint
    loaded = load_pefll(path, client=tiny_client(hidden=(8,)), embedding=embedding)
    x, y = dm.client_data(dm.unseen_clients[0], "train").full()
    torch.testing.assert_close(ModelVector(personalize(loaded, (x, y))).flatten(),
                               ModelVector(personalize(module, (x, y))).flatten())
    with pytest.raises(ValueError, match="checkpoint_path"):
        load_pefll(tmp_path / "missing.ckpt")
    with pytest.raises(ValueError, match="does not record the embedding network.*pass embedding="):
        load_pefll(path)  # Trainer.fit in Python: the embedding is an object, not in the hyper-parameters
    rebuilt = load_pefll(path, embedding=MLPEmbedding(20, 10, 4, hidden=(8,)))  # the client from its recipe
    torch.testing.assert_close(ModelVector(personalize(rebuilt, (x, y))).flatten(),
                               ModelVector(personalize(module, (x, y))).flatten())
    legacy = tmp_path / "legacy.ckpt"  # without its checksum: refused unless the caller vouches for it
    torch.save(load_checkpoint(path), legacy)
    with pytest.raises(CheckpointError, match="has no checksum"):
        load_pefll(legacy)
    unverified = load_pefll(legacy, allow_unverified=True, embedding=MLPEmbedding(20, 10, 4, hidden=(8,)))
    torch.testing.assert_close(ModelVector(personalize(unverified, (x, y))).flatten(),
                               ModelVector(personalize(module, (x, y))).flatten())
    models = predict_clients(path, dm, output_dir=tmp_path / "models", client=tiny_client(hidden=(8,)),
                             embedding=MLPEmbedding(20, 10, 4, hidden=(8,)))
    assert sorted(models) == sorted(dm.unseen_clients)
    saved = torch.load(tmp_path / "models" / f"client_{dm.unseen_clients[0]}.pt")
    torch.testing.assert_close(saved, models[dm.unseen_clients[0]].state_dict())


def test_mask_absent_classes():
    logits = torch.tensor([[-1.0, -2.0, -3.0], [5.0, 0.0, 1.0]])
    masked = mask_absent_classes(logits, torch.tensor([1, 2]))
    assert masked.argmax(-1).tolist() == [1, 2]
    assert torch.isinf(masked[:, 0]).all()


# ------------------------------------------------------------------ baselines
def test_pfedhn_keeps_one_embedding_per_client_and_fits_new_ones():
    torch.manual_seed(0)
    module = PFedHN(tiny_client(hidden=(8,)), embedding_dim=4, new_client_rounds=2, clients_per_round=3, local_steps=2,
                    hypernetwork_width=16)
    dm = data(10, unseen_fraction=0.2)
    tr = trainer(2, callbacks=[ClientMetrics(), ClientMetrics(clients="unseen")], check_val_every_n_epoch=2)
    tr.fit(module, dm)
    assert module.client_embeddings.weight.shape == (10, 4)  # grows with the clients, unlike PeFLL
    assert {"clients_test/acc_mean", "clients_unseen_test/acc_mean"} <= set(tr.callback_metrics)
    cid = dm.unseen_clients[0]
    torch.testing.assert_close(module.fit_new_client(cid), module.fit_new_client(cid))


def test_pfedhn_defaults_are_the_reference_codes():
    """One client per server step, and the reference's weight decay 1e-3 (penalty 5e-4) on every
    embedding row, sampled or not: a row no client touched shrinks by ``1 - 2 lr lambda_e``."""
    module = PFedHN(tiny_client(hidden=(8,)), embedding_dim=4, local_steps=2, hypernetwork_width=16, server_momentum=0.0)
    assert (module.clients_per_round, module.lambda_e, module.lambda_h) == (1, 5e-4, 5e-4)
    assert PFedHN(tiny_client(hidden=(8,)), embedding_dim=4, clients_fraction=0.5).clients_fraction == 0.5
    trainer(1).fit(module, data(10))
    assert len(module.engine.round_clients) == 1
    before = torch.randn(10, 4, generator=generator(0, "pfedhn-embeddings"))
    untouched = [c for c in range(10) if c not in module.engine.round_clients]
    torch.testing.assert_close(module.client_embeddings.weight.detach()[untouched],
                               before[untouched] * (1 - 2 * module.server_lr * 5e-4))


def test_local_only_trains_each_client_alone():
    module = LocalOnly(tiny_client(hidden=(8,)), clients_per_round=8, local_steps=5)
    dm = data(10, unseen_fraction=0.2)
    tr = trainer(1, callbacks=[ClientMetrics(), ClientMetrics(clients="unseen")])
    tr.fit(module, dm)
    assert sorted(module.engine.store.clients()) == list(dm.train_clients)
    initial = ModelVector(tiny_client(hidden=(8,))).flatten()
    torch.testing.assert_close(module.global_model.flatten(), initial)  # no global model is trained
    unseen = module.client_eval_state(dm.unseen_clients[0])
    assert (unseen - initial).abs().max() > 0 and dm.unseen_clients[0] not in module.engine.store
    assert {"clients_test/acc_mean", "clients_unseen_test/acc_mean"} <= set(tr.callback_metrics)


class RecordSteps(FederatedCallback):
    """Adds up the local steps each client took over the run."""

    def __init__(self) -> None:
        self.steps: dict[int, float] = {}

    def on_client_update(self, trainer, module, update):
        self.steps[update.client_id] = self.steps.get(update.client_id, 0.0) + update.metrics["steps"]
        return update


@pytest.mark.parametrize("make", [lambda **kw: pefll(client_clip=0.05, **kw), lambda **kw: pefll(False, **kw)],
                         ids=["local gradients clipped", "label-free"])
def test_the_batched_backend_trains_the_hypernetwork_as_the_sequential_one(make):
    """The clients start from their generated models, detached; the graph back to the hypernetwork
    (and the embedding) waits in ``run.held`` until ``client_final``, outside the vectorized steps.
    (``tests/test_batched.py`` runs PeFLL with client momentum and pFedHN the same way.)"""
    runs = {}
    for backend in ("sequential", "batched"):
        module, fit = make(client_backend=backend), trainer(3)
        fit.fit(module, data(8))
        runs[backend] = (torch.cat([p.detach().flatten() for p in module.parameters()]),
                         {name: float(value) for name, value in fit.callback_metrics.items()})
    (sequential, logged), (batched, batched_logged) = runs["sequential"], runs["batched"]
    assert not torch.equal(sequential, torch.cat([p.detach().flatten() for p in make().parameters()]))  # it trained
    assert (batched - sequential).abs().max() <= 1e-6
    assert batched_logged == pytest.approx(logged, abs=1e-6) and "round/client_delta_norm" in logged


@pytest.mark.parametrize("backend", ["sequential", "batched"])
def test_local_only_spends_one_budget_per_client_whatever_the_rounds(backend):
    """Three rounds leave every client's model as one round does (the budget of an unseen client,
    trained once when evaluated); with partial participation no client trains twice."""
    def run(rounds, per_round):
        module = LocalOnly(tiny_client(hidden=(8,)), clients_per_round=per_round, local_steps=3, client_backend=backend)
        dm, record = data(10, unseen_fraction=0.2), RecordSteps()
        trainer(rounds, callbacks=[record]).fit(module, dm)
        return module, dm, record.steps

    one, dm, _ = run(1, 8)
    three, _, steps = run(3, 8)
    assert steps == {cid: 3.0 for cid in dm.train_clients}
    for cid in dm.train_clients:
        torch.testing.assert_close(three.client_eval_state(cid), one.client_eval_state(cid), rtol=0, atol=0)
    _, _, steps = run(4, 3)
    assert set(steps.values()) == {3.0}


def test_local_finetuning_restores_the_global_model():
    module = FedAvg(tiny_client(hidden=(8,)), clients_per_round=3, local_steps=3)
    finetune = LocalFinetuning(steps=10, clients="unseen")
    dm = data(10, unseen_fraction=0.2, partition="classes", classes_per_client=2)
    tr = trainer(2, callbacks=[ClientMetrics(clients="unseen"), finetune], check_val_every_n_epoch=2)
    tr.fit(module, dm)
    before = module.global_model.flatten()
    accuracies = finetune.evaluate(module)
    torch.testing.assert_close(module.global_model.flatten(), before)
    assert set(accuracies) == set(dm.unseen_clients)
    assert float(tr.callback_metrics["finetuned_unseen_test/acc_mean"]) > float(tr.callback_metrics["clients_unseen_test/acc_mean"])
    with pytest.raises(ValueError, match="steps"):
        LocalFinetuning(steps=0)


def test_pfedhn_gives_each_sampled_client_its_own_embedding_update_under_any_aggregator():
    """The embedding table's upload is declared "sum": row i of the round's total is client i's own
    ``de_i``, whatever the aggregator (a coordinate median would zero the rows: each is nonzero in one
    upload only). One round of server SGD: ``e_i <- e_i + lr * de_i`` for the round's clients, others unchanged."""
    from fl_lightning.callbacks import CoordinateMedian

    class Record(FederatedCallback):
        def on_client_update(self, trainer, module, update):
            rows[update.client_id] = update.tensors["codes"].view(10, 4)[update.client_id].clone()
            return update

    rows = {}
    torch.manual_seed(0)
    module = PFedHN(tiny_client(hidden=(8,)), embedding_dim=4, clients_per_round=3, local_steps=2,
                    hypernetwork_width=16, server_clip=None, lambda_e=0.0, server_lr=0.5)
    trainer(1, callbacks=[Record(), CoordinateMedian()]).fit(module, data(10))
    assert module.engine.update_specs["codes"].reduction == "sum"
    before = torch.randn(10, 4, generator=generator(0, "pfedhn-embeddings"))
    after = module.client_embeddings.weight.detach()
    assert sorted(rows) == sorted(module.engine.round_clients)
    for cid in range(10):
        expected = before[cid] + 0.5 * rows[cid] if cid in rows else before[cid]
        torch.testing.assert_close(after[cid], expected)
    assert all(rows[c].abs().max() > 0 for c in rows)
