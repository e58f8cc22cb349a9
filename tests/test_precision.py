"""Mixed precision: bf16-mixed trains on CPU close to fp32; 16-mixed on CUDA scales local losses."""

from __future__ import annotations

import math

import pytest
import torch

from fl_lightning.algorithms import FedAvg, SCAFFOLD
from tests.helpers import global_vector, synthetic, tiny_client, trainer


def accuracy(precision: str, algorithm=FedAvg, rounds: int = 5) -> float:
    module = algorithm(tiny_client(hidden=(16,)), clients_per_round=6, local_steps=8)
    t = trainer(rounds, precision=precision)
    dm = synthetic(8)
    t.fit(module, dm)
    assert torch.isfinite(global_vector(module)).all()
    assert global_vector(module).dtype == torch.float32  # aggregation and state stay fp32
    return t.validate(module, dm, verbose=False)[0]["val_acc"]


def test_bf16_mixed_on_cpu_is_close_to_fp32():
    fp32, bf16 = accuracy("32-true"), accuracy("bf16-mixed")
    assert fp32 > 0.5
    assert abs(fp32 - bf16) <= 0.05


def test_bf16_mixed_keeps_scaffold_state_fp32():
    accuracy("bf16-mixed", SCAFFOLD, rounds=2)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_fp16_mixed_on_cuda_scales_local_losses():
    """With 16-mixed, local losses are scaled by the GradScaler and gradients unscaled before
    the algorithm's gradient hook: FedProx's proximal term must see true gradients."""
    from fl_lightning.algorithms import FedProx
    from fl_lightning.functional.prox import proximal_gradient

    seen = []

    class Probe(FedProx):
        def client_step(self, run, batch):
            loss, grads = run.loss_and_grad(batch)  # what FedProx's proximal term is added to
            seen.append(max(float(g.abs().max()) for g in grads))
            run.step(proximal_gradient(grads, run.params, run.layout.split_params(run.start), self.mu))
            return loss

    dm = synthetic(8)
    runs = {}
    for precision in ("32-true", "16-mixed"):
        seen.clear()
        module = Probe(tiny_client(hidden=(32,)), mu=0.1, clients_per_round=8, local_steps=10)
        t = trainer(3, precision=precision, accelerator="gpu")
        t.fit(module, dm)
        # a step whose scaled gradients overflowed has inf gradients after unscaling; the scaler skips it
        finite = [g for g in seen if math.isfinite(g)]
        assert len(finite) >= 0.8 * len(seen)
        runs[precision] = (max(finite), t.validate(module, dm, verbose=False)[0]["val_acc"])
        if precision == "16-mixed":
            assert t.precision_plugin.scaler is not None and t.precision_plugin.scaler.get_scale() > 1
    assert runs["16-mixed"][0] < 100 * runs["32-true"][0]  # unscaled before the hook
    assert abs(runs["16-mixed"][1] - runs["32-true"][1]) <= 0.05
