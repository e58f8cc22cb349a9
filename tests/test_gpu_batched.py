"""On a CUDA device: the batched client backend gives the sequential backend's results (FedAvg,
SCAFFOLD, FedProx, RAGA, FedDeper, FedProxVR, PeFLL; fp32 and bf16-mixed), and its compiled step
(``BatchedBackend(compile_step=True)``) the eager step's. The federations are those of
``tests/test_batched.py`` (which checks fp32 on the CPU); the CUDA tests skip without a GPU."""

from __future__ import annotations

import inspect

import pytest
import torch
from torch._dynamo.utils import counters

from fl_lightning.backends import BatchedBackend
from tests.helpers import synthetic, trainer
from tests.test_batched import SUPPORTED, assert_close
from tests.test_contract import outcome

CUDA = pytest.param("cuda", marks=[pytest.mark.gpu,
                                   pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")])

#: the algorithms whose batched runs are compared (keys of ``tests.test_batched.SUPPORTED``)
ALGORITHMS = ["FedAvg", "SCAFFOLD", "FedProx", "RAGA", "FedDeper", "FedProxVR-svrg-last", "PeFLL"]

#: the clients a vectorized block holds: 5 clients a round make a block of 4 and a remainder of 1
BLOCK = 4

#: bf16-mixed runs its matrix products with 8-bit mantissas (a relative rounding of 2**-8 = 3.9e-3 per
#: product); the backends round in another order (one batched product over the block against one
#: product per client), so they agree only to about what bf16 changes itself: on the CPU the largest
#: difference over the outcome was 3.8e-3 (FedDeper; bf16 against fp32, sequential: 2.2e-3), and a
#: tolerance of 1e-2 is that with some margin, still well under what a wrong run changes (one local
#: step fewer: 7e-2). fp32 is held to 1e-5.
TOLERANCE = {"32-true": 1e-5, "bf16-mixed": 1e-2}

HAS_COMPILE_STEP = "compile_step" in inspect.signature(BatchedBackend.__init__).parameters


def fitted_outcome(name: str, backend: str, device: str, precision: str = "32-true", **backend_options) -> dict:
    """``outcome`` (the module's tensors, every client's stored state) of 3 rounds of the algorithm
    ``name`` of ``tests.test_batched.SUPPORTED`` on ``device``; ``backend_options`` make the module's
    batched backend anew with those arguments."""
    module = SUPPORTED[name](backend, BLOCK)
    if backend_options:
        module.engine.backend = BatchedBackend(BLOCK, **backend_options)
    accelerator = "gpu" if device == "cuda" else "cpu"
    trainer(3, accelerator=accelerator, precision=precision).fit(module, synthetic(6))
    return outcome(module)


@pytest.mark.parametrize("name", ALGORITHMS)
@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed"])
@pytest.mark.parametrize("device", [CUDA, "cpu"])
def test_batched_equals_sequential_on_the_device(device, precision, name):
    """The global model, server state and every client's state of the batched backend equal the
    sequential backend's in the same precision (the CPU's fp32 case is ``tests/test_batched.py``'s)."""
    if device == "cpu" and precision == "32-true":
        pytest.skip("tests/test_batched.py::test_batched_equals_sequential checks fp32 on the CPU")
    sequential = fitted_outcome(name, "sequential", device, precision)
    batched = fitted_outcome(name, "batched", device, precision)
    assert_close(sequential, batched, atol=TOLERANCE[precision])


@pytest.mark.slow  # a compile of a few seconds per algorithm
@pytest.mark.skipif(not HAS_COMPILE_STEP, reason="this BatchedBackend has no compile_step parameter")
@pytest.mark.parametrize("name", ALGORITHMS)
@pytest.mark.parametrize("device", [CUDA])
def test_compiled_step_equals_eager_step_on_the_device(device, name):
    """``compile_step=True`` compiles the step (at least one graph: no silent eager fallback) and
    gives the eager step's outcome to 1e-5 (``tests/test_compile_step.py`` checks the CPU)."""
    eager = fitted_outcome(name, "batched", device, compile_step=False)
    torch.compiler.reset()  # compile from scratch: the earlier tests' graphs count against the recompile limit
    counters.clear()
    compiled = fitted_outcome(name, "batched", device, compile_step=True)
    assert counters["stats"]["unique_graphs"] > 0
    assert_close(eager, compiled, atol=1e-5)


@pytest.mark.parametrize("device", [CUDA])
def test_finetuning_figures_of_both_backends_on_the_device(device):
    """``LocalFinetuning`` on the device: the batched backend finetunes blocks of clients at once and
    logs the sequential backend's figures (on the CPU: ``tests/test_batched.py``)."""
    from fl_lightning.algorithms import FedAvg
    from fl_lightning.callbacks import LocalFinetuning
    from tests.test_batched import mlp

    figures = []
    for backend in ("sequential", "batched"):
        module = FedAvg(mlp(0.9), clients_per_round=5, local_steps=3, client_backend=backend, seed=1)
        t = trainer(2, callbacks=[LocalFinetuning(steps=5, split=["val", "test"])], check_val_every_n_epoch=1,
                    accelerator="gpu")
        t.fit(module, synthetic(6, val_fraction=0.2))
        figures.append({k: float(v) for k, v in t.callback_metrics.items() if k.startswith("finetuned_")})
    assert figures[0] and figures[0] == figures[1]
