"""``fl_lightning.models.pooling.MaxPool2d``: bitwise ``nn.MaxPool2d``'s values, indices and gradients
on its channels-last path (ties, NaN, infinities, overlapping and odd windows, vmap, double backward,
bf16), ``nn.MaxPool2d`` itself wherever that path does not apply."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.func import grad, vmap
from torch.utils.data import TensorDataset

from fl_lightning.algorithms import FedAvg
from fl_lightning.datamodules import FederatedDataModule
from fl_lightning.models import CNN, FedProxVRCNN, LeNet
from fl_lightning.models.pooling import MaxPool2d, _ChannelsLastMaxPool
from tests.helpers import global_vector, trainer


def inputs(kind: str, shape: tuple[int, ...]) -> torch.Tensor:
    """Values that exercise the choice of a window's maximum: ties (ReLU's zeros, small integers), NaN, infinities."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(shape, generator=g)
    if kind == "relu":
        x = x.relu()
    elif kind == "integers":
        x = torch.randint(0, 3, shape, generator=g).float()
    elif kind == "nan":
        x[x > 0.8] = float("nan")
    elif kind == "inf":
        x[x > 0.8], x[x < -0.8] = float("inf"), -float("inf")
    return x


def assert_bitwise(a: torch.Tensor, b: torch.Tensor) -> None:
    assert a.dtype == b.dtype and a.shape == b.shape and a.stride() == b.stride()
    assert torch.equal(a.isnan(), b.isnan()) and torch.equal(a.nan_to_num(0.5), b.nan_to_num(0.5))
    assert torch.equal(a.signbit(), b.signbit())


WINDOWS = [dict(kernel_size=2), dict(kernel_size=3, stride=2), dict(kernel_size=3, stride=1),
           dict(kernel_size=2, stride=3), dict(kernel_size=(2, 3), stride=(1, 2))]


@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("kind", ["randn", "relu", "integers", "nan", "inf"])
def test_channels_last_path_gives_max_pool_values_indices_and_gradients(window, kind):
    x = inputs(kind, (3, 16, 15, 17)).requires_grad_()
    ours, theirs = MaxPool2d(**window), nn.MaxPool2d(**window)
    assert ours._channels_last(x)
    y, y_ref = ours(x), theirs(x)
    assert_bitwise(y, y_ref)
    stride = window.get("stride", window["kernel_size"])
    _, indices = _ChannelsLastMaxPool.apply(x, nn.modules.utils._pair(window["kernel_size"]), nn.modules.utils._pair(stride))
    assert torch.equal(indices, F.max_pool2d_with_indices(x, window["kernel_size"], stride)[1])
    g = inputs("randn", tuple(y.shape))
    assert_bitwise(torch.autograd.grad(y, x, g)[0], torch.autograd.grad(y_ref, x, g)[0])


@pytest.mark.parametrize("module, x", [
    (MaxPool2d(2), torch.randn(2, 8, 16, 16)),  # few channels
    (MaxPool2d(2), torch.randn(2, 16, 8, 8)),  # a small map
    (MaxPool2d(2, padding=1), torch.randn(2, 16, 16, 16)),
    (MaxPool2d(2, dilation=2), torch.randn(2, 16, 16, 16)),
    (MaxPool2d(2, ceil_mode=True), torch.randn(2, 16, 15, 15)),
    (MaxPool2d(2, return_indices=True), torch.randn(2, 16, 16, 16)),
    (MaxPool2d(2), torch.randn(16, 16, 16)),  # unbatched
])
def test_other_pooling_is_max_pool2d_itself(module, x):
    assert not module._channels_last(x)
    reference = nn.MaxPool2d(module.kernel_size, module.stride, module.padding, module.dilation, module.return_indices,
                             module.ceil_mode)
    out, ref = module(x), reference(x)
    for a, b in zip(out if isinstance(out, tuple) else (out,), ref if isinstance(ref, tuple) else (ref,)):
        assert_bitwise(a, b)


@pytest.mark.parametrize("x", [torch.randn(2, 16, 16, 16).contiguous(memory_format=torch.channels_last),
                               torch.randn(2, 16, 16, 32)[..., ::2], torch.randn(2, 16, 16, 16).transpose(2, 3)])
def test_the_output_and_gradient_are_laid_out_as_max_pool2ds(x):
    """Channels-last in, channels-last out; any other layout in, contiguous out (the native kernel's choice)."""
    x.requires_grad_()
    assert MaxPool2d(2)._channels_last(x)
    y, y_ref = MaxPool2d(2)(x), nn.MaxPool2d(2)(x)
    assert_bitwise(y, y_ref)
    g = torch.randn_like(y_ref)
    assert_bitwise(torch.autograd.grad(y, x, g)[0], torch.autograd.grad(y_ref, x, g)[0])


def net_loss(pool: nn.Module):
    """The loss of a conv -> ReLU -> pool -> linear net of ``weights`` on one batch."""
    def loss(weights: tuple[torch.Tensor, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        conv, linear = weights
        return (pool(F.conv2d(x, conv, padding=1).relu()).flatten(1) @ linear).square().mean()
    return loss


def test_vectorized_gradients_equal_max_pool2d(monkeypatch):
    """The batched backend's step: per-client gradients under vmap (and vmap under grad), the clients'
    batches pooled as one by the channels-last path."""
    g = torch.Generator().manual_seed(0)
    weights = (torch.randn(4, 16, 1, 3, 3, generator=g), torch.randn(4, 16 * 7 * 7, 3, generator=g))
    x = torch.randn(4, 5, 1, 14, 14, generator=g)
    batched_calls = []
    rule = _ChannelsLastMaxPool.vmap
    monkeypatch.setattr(_ChannelsLastMaxPool, "vmap", staticmethod(lambda *a: batched_calls.append(a) or rule(*a)))
    per_client = [vmap(grad(net_loss(pool)))(weights, x) for pool in (MaxPool2d(2), nn.MaxPool2d(2))]
    summed = [grad(lambda w, p=pool: vmap(net_loss(p))(w, x).sum())(weights) for pool in (MaxPool2d(2), nn.MaxPool2d(2))]
    assert len(batched_calls) == 2
    for ours, theirs in (per_client, summed):
        for a, b in zip(ours, theirs):
            assert_bitwise(a, b)


def test_double_backward_equals_max_pool2d():
    x = inputs("relu", (2, 16, 12, 12)).requires_grad_()
    out = []
    for pool in (MaxPool2d(2), nn.MaxPool2d(2)):
        y = pool(x)
        g = inputs("randn", tuple(y.shape)).requires_grad_()
        gx, = torch.autograd.grad(y, x, g, create_graph=True)
        out.append(torch.autograd.grad(gx.square().sum(), g)[0])
    assert_bitwise(*out)


def test_bf16_equals_max_pool2d():
    x = inputs("relu", (2, 32, 10, 10)).bfloat16().requires_grad_()
    y, y_ref = MaxPool2d(2)(x), nn.MaxPool2d(2)(x)
    assert_bitwise(y, y_ref)
    g = torch.ones_like(y)
    assert_bitwise(torch.autograd.grad(y, x, g)[0], torch.autograd.grad(y_ref, x, g)[0])


def test_it_compiles_into_one_graph_with_max_pool2d_values():
    """``compile_step``'s path (there the compiler's own pooling)."""
    pool = MaxPool2d(2)
    x = inputs("relu", (2, 16, 16, 16))
    torch._dynamo.reset()
    try:
        compiled = torch.compile(pool, backend="aot_eager", fullgraph=True)
        assert torch.equal(compiled(x), nn.MaxPool2d(2)(x))
    finally:
        torch._dynamo.reset()


@pytest.mark.parametrize("make", [CNN, FedProxVRCNN, lambda: LeNet(conv_channels=(16, 32))])
def test_reference_cnns_train_as_with_max_pool2d(make):
    """The reference CNNs use it; one SGD step gives nn.MaxPool2d's gradients, bit for bit."""
    torch.manual_seed(0)
    model = make()
    pools = [m for m in model.modules() if isinstance(m, nn.MaxPool2d)]
    assert pools and all(type(m) is MaxPool2d for m in pools)
    x, y = inputs("randn", (4, 1, 28, 28)), torch.arange(4)
    grads = []
    for cls in (MaxPool2d, nn.MaxPool2d):
        for m in pools:
            m.__class__ = cls
        model.zero_grad()
        F.cross_entropy(model(x), y).backward()
        grads.append([p.grad.clone() for p in model.parameters()])
    for a, b in zip(*grads):
        assert_bitwise(a, b)


class Images(FederatedDataModule):
    """120 generated 1x12x12 images of 4 classes."""

    def build_datasets(self):
        g = torch.Generator().manual_seed(0)
        y = torch.arange(120) % 4
        return TensorDataset(torch.randn(120, 1, 12, 12, generator=g) + y[:, None, None, None], y), None


@pytest.mark.parametrize("backend, precision", [("sequential", "32-true"), ("batched", "32-true"),
                                                ("sequential", "bf16-mixed")])
def test_a_federation_trains_bitwise_as_with_max_pool2d(backend, precision, monkeypatch):
    """FedAvg rounds of a CNN whose first max-pool takes the channels-last path: the same global model,
    bit for bit, as with ``nn.MaxPool2d``, on either client backend and in bf16-mixed precision."""
    models = []
    for pool in (MaxPool2d, nn.MaxPool2d):
        monkeypatch.setattr("fl_lightning.models.cnn.MaxPool2d", pool)
        torch.manual_seed(0)
        client = CNN(image_size=12, conv_channels=(16, 32), hidden=(16,), num_classes=4, lr=0.05)
        assert {type(m) for m in client.modules() if isinstance(m, nn.MaxPool2d)} == {pool}
        assert MaxPool2d(2)._channels_last(torch.empty(8, 16, 12, 12))
        module = FedAvg(client, clients_per_round=3, local_steps=2, seed=0, client_backend=backend)
        trainer(2, precision=precision).fit(module, Images(num_clients=4, batch_size=8, seed=0))
        models.append(global_vector(module))
    assert not torch.equal(models[0], torch.zeros_like(models[0]))
    assert_bitwise(*models)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_on_a_gpu_it_is_max_pool2d_itself():
    x = inputs("relu", (2, 32, 16, 16)).cuda()
    assert not MaxPool2d(2)._channels_last(x)
    assert_bitwise(MaxPool2d(2)(x), nn.MaxPool2d(2)(x))
