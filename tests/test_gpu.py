"""On a CUDA device: the same federation gives the same global model as on the CPU, client state
stays in CPU memory, robust aggregation runs in float64 where the updates are, and mixed
precision keeps aggregation in fp32. Every test skips without a GPU."""

from __future__ import annotations

import pytest
import pytorch_lightning as pl
import torch

from fl_lightning.algorithms import SCAFFOLD, FedAvg, FedDeper
from fl_lightning.callbacks.robust_aggregation import GeometricMedian
from fl_lightning.functional.robust import geometric_median
from tests.helpers import global_vector, synthetic, tiny_client, trainer

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


class _Devices(pl.Callback):
    """Where the global model is while the rounds run (Lightning moves it back to the CPU at teardown)."""

    def __init__(self) -> None:
        self.seen: set[str] = set()

    def on_train_epoch_end(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
        self.seen.add(next(module.client.parameters()).device.type)


def _fit(algorithm, accelerator: str, callbacks=None, rounds: int = 3, **kwargs):
    module = algorithm(tiny_client(hidden=(16,)), clients_per_round=6, local_steps=5, **kwargs)
    devices = _Devices()
    t = trainer(rounds, callbacks=[*(callbacks or []), devices], accelerator=accelerator)
    t.fit(module, synthetic(8))
    assert devices.seen == {"cuda" if accelerator == "gpu" else "cpu"}
    return module


@pytest.mark.parametrize(
    "algorithm, kwargs",
    [(FedAvg, {"server_momentum": 0.9}), (SCAFFOLD, {}), (FedDeper, {"rho": 0.03, "lam": 0.5})],
    ids=["fedavg", "scaffold", "feddeper"],
)
def test_gpu_run_equals_cpu_run_and_keeps_client_state_on_cpu(algorithm, kwargs):
    cpu = _fit(algorithm, "cpu", **kwargs)
    gpu = _fit(algorithm, "gpu", **kwargs)
    assert torch.allclose(global_vector(gpu), global_vector(cpu), atol=1e-4, rtol=1e-4)
    for client_id in gpu.engine.store.clients():
        for name in ("control", "personal"):
            value = gpu.engine.store.get(client_id, name)
            if value is not None:
                assert value.device.type == "cpu"  # invariant 6: stored state is off the accelerator
                assert torch.allclose(value, cpu.engine.store.get(client_id, name), atol=1e-4, rtol=1e-4)


def test_geometric_median_runs_in_float64_on_the_device_of_the_updates():
    torch.manual_seed(0)
    points = torch.randn(20, 50, device="cuda")
    weights = torch.rand(20, device="cuda")
    on_gpu = geometric_median(points, weights)
    assert on_gpu.median.device.type == "cuda" and on_gpu.median.dtype == torch.float64
    on_cpu = geometric_median(points.cpu(), weights.cpu())
    assert on_gpu.iterations == on_cpu.iterations
    assert torch.allclose(on_gpu.median.cpu(), on_cpu.median, atol=1e-8)


def test_robust_aggregator_on_gpu_equals_cpu():
    cpu = _fit(FedAvg, "cpu", callbacks=[GeometricMedian()])
    gpu = _fit(FedAvg, "gpu", callbacks=[GeometricMedian()])
    assert torch.allclose(global_vector(gpu), global_vector(cpu), atol=1e-4, rtol=1e-4)


def test_bf16_mixed_on_gpu_is_close_to_fp32_and_keeps_state_fp32():
    dm = synthetic(8)
    acc = {}
    for precision in ("32-true", "bf16-mixed"):
        module = SCAFFOLD(tiny_client(hidden=(16,)), clients_per_round=6, local_steps=8)
        t = trainer(5, precision=precision, accelerator="gpu")
        t.fit(module, dm)
        assert global_vector(module).dtype == torch.float32
        assert all(module.engine.store.get(i, "control").dtype == torch.float32 for i in module.engine.store.clients())
        acc[precision] = t.validate(module, dm, verbose=False)[0]["val_acc"]
    assert acc["32-true"] > 0.5
    assert abs(acc["32-true"] - acc["bf16-mixed"]) <= 0.05
