"""The batched backend's compiled step (``compile_step=True``): equal to the eager step, compiled once
per step structure and reused, refused where it does not apply, eager again where torch cannot compile."""

from __future__ import annotations

import logging
from typing import Optional

import pytest
import pytorch_lightning as pl
import torch
from torch._dynamo.exc import InternalTorchDynamoError
from torch._dynamo.utils import counters

from fl_lightning.algorithms import FedAvg
from fl_lightning.backends import BatchedBackend
from fl_lightning.backends.batched.backend import vectorized_hook
from fl_lightning.backends.batched.compiled import CompiledStep
from fl_lightning.models import MLP
from tests.helpers import synthetic, trainer
from tests.test_batched import SUPPORTED, DropoutClient, assert_close
from tests.test_contract import outcome


@pytest.fixture(autouse=True)
def fresh_compiler():
    """Each test compiles from scratch (and counts its own compiles)."""
    torch._dynamo.reset()
    counters.clear()
    yield
    torch._dynamo.reset()


class GraphsPerRound(pl.Callback):
    """The number of graphs compiled so far, at the end of each round."""

    def __init__(self) -> None:
        self.graphs: list[int] = []

    def on_train_epoch_end(self, trainer, pl_module) -> None:
        self.graphs.append(counters["stats"]["unique_graphs"])


def fitted(make, compiler: Optional[str], rounds: int = 3):
    """``make``'s federation (its 4 to 6 clients a round in one block) after ``rounds``
    rounds of the batched backend, its step eager (``compiler`` None) or compiled by torch.compile's
    ``compiler`` backend (``"inductor"``: what ``compile_step=True`` runs)."""
    module = make("batched", 8)
    module.engine.backend = BatchedBackend(8, compile_step=compiler is not None)
    if compiler not in (None, "inductor"):
        module.engine.backend._vectorized = CompiledStep(vectorized_hook, backend=compiler)
    graphs = GraphsPerRound()
    t = trainer(rounds, callbacks=[graphs])
    t.fit(module, synthetic(6))
    return module, t, graphs.graphs


#: the algorithms whose step is compiled in the tests (an optimizer state, per-client scratch values, two
#: models and named outputs, a lock-step share), with the graphs their step compiles to: one per structure
#: of the step, all in the first round, none for a new step index or round. Momentum's buffer starts at
#: the first step (a step without it, then one with it); FedDRO's lock-step round has its share and its
#: step, the first step without the server's shared value. ``aot_eager`` captures the step as
#: ``compile_step`` does (Dynamo's graph and guards, AOT autograd) without generating code, which takes
#: seconds per graph on two cores; one test runs the real compiler.
CAPTURED = {"FedAvg": 1, "FedAvg-momentum-wd": 2, "SCAFFOLD": 1, "FedDeper": 1, "FedDRO": 3, "FedProxVR-svrg-last": 1}


@pytest.mark.parametrize("name", list(CAPTURED))
def test_captured_step_equals_eager(name):
    """Three rounds: every tensor of the module and every client's state equal the eager step's to
    1e-5, and so does the client's logged training loss; the step is compiled once per structure, in
    the first round, and every later step and round reuses it (the step index and the round are
    symbols of the graph, not constants that a new value recompiles)."""
    eager, eager_trainer, eager_graphs = fitted(SUPPORTED[name], None)
    assert eager_graphs == [0, 0, 0]
    compiled, compiled_trainer, graphs = fitted(SUPPORTED[name], "aot_eager")
    assert graphs == [CAPTURED[name]] * 3, graphs
    assert compiled.engine.backend._vectorized.compiles == CAPTURED[name]
    assert_close(outcome(eager), outcome(compiled), atol=1e-5)
    logged = {k: v for k, v in eager_trainer.callback_metrics.items() if "loss" in k}
    assert logged, "the client logs a training loss"
    for key, value in logged.items():
        assert torch.allclose(value, compiled_trainer.callback_metrics[key], atol=1e-5), key


def test_compiled_step_with_dropout_equals_eager(caplog):
    """``compile_step=True`` (Inductor) on a client with Dropout: the same model to 1e-5, the compiled
    step drawing the eager step's random numbers (``fallback_random``); one graph, announced with one line."""

    def make(backend, block):
        torch.manual_seed(0)
        return FedAvg(DropoutClient(), clients_per_round=4,
                      local_steps=3, client_backend=backend, clients_per_block=block, seed=1)

    eager, _, _ = fitted(make, None, rounds=2)
    with caplog.at_level(logging.INFO):
        compiled, _, graphs = fitted(make, "inductor", rounds=2)
    assert graphs == [1, 1]
    notices = [r.getMessage() for r in caplog.records if r.getMessage().startswith("compile_step:")]
    assert notices == ["compile_step: compiling the batched step; once per structure of the step (shapes of the "
                       "block's tensors, Python values the step reads), seconds to a minute on a CPU"]
    assert_close(outcome(eager), outcome(compiled), atol=1e-5)


def test_each_backend_compiles_its_own_step():
    """Every backend's compiled step has a code object, so a compile cache, of its own: federations
    run one after another in a process (a sweep) never share torch.compile's limit of recompilations."""
    first, second = (BatchedBackend(4, compile_step=True) for _ in range(2))
    assert first._vectorized.function.__code__ is not second._vectorized.function.__code__
    assert first._vectorized.function.__code__ is not vectorized_hook.__code__
    torch._dynamo.config.recompile_limit, limit = 1, torch._dynamo.config.recompile_limit
    try:  # with a limit of one graph per code object, each of two federations still compiles its step
        for _ in range(2):
            before = counters["stats"]["unique_graphs"]
            module = SUPPORTED["FedAvg"]("batched", 8)
            module.engine.backend = BatchedBackend(8, compile_step=True)
            module.engine.backend._vectorized = CompiledStep(vectorized_hook, backend="aot_eager")
            trainer(1).fit(module, synthetic(6))
            assert counters["stats"]["unique_graphs"] > before
    finally:
        torch._dynamo.config.recompile_limit = limit


def test_the_module_argument_compiles_the_batched_step():
    module = FedAvg(MLP(in_features=20, hidden=(8,), num_classes=10), client_backend="batched", compile_step=True)
    assert isinstance(module.engine.backend, BatchedBackend) and module.engine.backend.compile_step
    assert module.engine.backend._vectorized is not vectorized_hook
    assert FedAvg(MLP(in_features=20, hidden=(8,), num_classes=10), client_backend="batched").engine.backend._vectorized \
        is vectorized_hook


@pytest.mark.parametrize("kwargs, match", [
    ({"compile_step": True}, "compile_step=True compiles the batched backend's vectorized step; client_backend is "
                             "'sequential'"),
    ({"client_backend": "batched", "compile_step": "yes"}, "compile_step must be True or False, got 'yes'"),
])
def test_bad_compile_step_is_refused(kwargs, match):
    with pytest.raises(ValueError, match=match):
        FedAvg(MLP(in_features=20, hidden=(8,), num_classes=10), **kwargs)


def test_a_step_torch_cannot_compile_runs_eagerly_with_a_warning():
    """Where compiling fails, the step runs eagerly from then on (same results), with a one-time warning."""
    calls = []

    def failing(*args):
        calls.append(1)
        raise InternalTorchDynamoError("no compiler for this step")

    eager, _, _ = fitted(SUPPORTED["SCAFFOLD"], None)
    module = SUPPORTED["SCAFFOLD"]("batched", 8)
    module.engine.backend = BatchedBackend(8, compile_step=True)
    module.engine.backend._vectorized = failing
    with pytest.warns(UserWarning, match="compile_step: the batched step could not be compiled, it runs eagerly: no "
                                         "compiler for this step"):
        trainer(3).fit(module, synthetic(6))
    assert len(calls) == 1 and module.engine.backend._vectorized is vectorized_hook
    assert_close(outcome(eager), outcome(module), atol=0.0)
