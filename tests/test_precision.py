"""Mixed precision: bf16-mixed trains on CPU close to fp32; 16-mixed (a CUDA or a CPU GradScaler) scales
local losses and unscales gradients before the algorithm's hook."""

from __future__ import annotations

import math
from typing import Any

import pytest
import pytorch_lightning as pl
import torch
from pytorch_lightning.plugins.precision import MixedPrecision

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


def fedprox_probe(**trainer_kwargs: Any) -> tuple[float, float, pl.Trainer]:
    """FedProx trained 3 rounds by a Trainer of ``trainer_kwargs``, its gradients probed where the proximal term is
    added: the largest finite gradient entry seen by the hook, the validation accuracy, the Trainer.
    With a loss scaler, local losses are scaled and gradients unscaled before the algorithm's
    gradient hook: FedProx's proximal term must see true gradients."""
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
    module = Probe(tiny_client(hidden=(32,)), mu=0.1, clients_per_round=8, local_steps=10)
    t = trainer(3, **trainer_kwargs)
    t.fit(module, dm)
    # a step whose scaled gradients overflowed has inf gradients after unscaling; the scaler skips it
    finite = [g for g in seen if math.isfinite(g)]
    assert len(finite) >= 0.8 * len(seen)
    assert torch.isfinite(global_vector(module)).all()
    return max(finite), t.validate(module, dm, verbose=False)[0]["val_acc"], t


def assert_scaled_like_fp32(scaled: tuple[float, float, pl.Trainer], fp32: tuple[float, float, pl.Trainer]) -> None:
    """The loss scaler was used, yet the hook saw unscaled gradients and training matched fp32."""
    scaler = scaled[2].precision_plugin.scaler
    assert scaler is not None and scaler.get_scale() > 1
    assert scaled[0] < 100 * fp32[0]  # unscaled before the hook
    assert abs(scaled[1] - fp32[1]) <= 0.05


def cpu_fp16_mixed() -> MixedPrecision:
    """16-mixed on the CPU: float16 autocast and a CPU GradScaler, the CUDA path without a GPU."""
    return MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu"))


def test_fp16_mixed_grad_scaler_on_cpu_scales_local_losses():
    """The 16-mixed GradScaler path on the CPU: catches breaks of the scaler path without a GPU."""
    assert_scaled_like_fp32(fedprox_probe(plugins=[cpu_fp16_mixed()]), fedprox_probe(precision="32-true"))


def test_batched_backend_refuses_fp16_mixed():
    """The batched backend runs the optimizer as a function, which no loss scaler can step: refused, with why."""
    module = FedAvg(tiny_client(), clients_per_round=2, local_steps=2, client_backend="batched")
    with pytest.raises(ValueError, match=r"precision '16-mixed' scales each optimizer's loss.*"
                                         r"use 'bf16-mixed' or client_backend='sequential'"):
        trainer(1, plugins=[cpu_fp16_mixed()]).fit(module, synthetic(4))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_fp16_mixed_on_cuda_scales_local_losses():
    """With 16-mixed on CUDA, local losses are scaled by the GradScaler and gradients unscaled
    before the algorithm's gradient hook: FedProx's proximal term must see true gradients."""
    fp32 = fedprox_probe(precision="32-true", accelerator="gpu")
    assert_scaled_like_fp32(fedprox_probe(precision="16-mixed", accelerator="gpu"), fp32)


def test_on_a_cpu_lightning_runs_16_mixed_as_bf16_mixed_so_the_batched_backend_gets_no_16_mixed_run():
    """``Trainer(precision="16-mixed")`` on a CPU is Lightning's ``bf16-mixed`` (it says so in a
    warning) before the engine sees it, on either backend: the batched backend's run is the
    bf16-mixed one, bit for bit, which it supports (the README says so). A 16-mixed plugin with its
    GradScaler on a CPU is refused (above)."""

    def run(precision: str) -> tuple[str, torch.Tensor]:
        module = FedAvg(tiny_client(hidden=(16,)), clients_per_round=4, local_steps=2, client_backend="batched")
        t = trainer(1, precision=precision)
        t.fit(module, synthetic(4))
        return t.precision, global_vector(module)

    with pytest.warns(UserWarning, match=r"precision='16-mixed'\)` but AMP with fp16 is not supported on CPU\. "
                                         r"Using `precision='bf16-mixed'` instead"):
        asked = run("16-mixed")
    assert asked[0] == "bf16-mixed" and torch.equal(asked[1], run("bf16-mixed")[1])
