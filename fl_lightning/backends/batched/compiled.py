"""The batched backend's compiled step (``compile_step=True``): a vectorized step captured by
``torch.compile`` once per step structure, with a one-line notice each time it compiles."""

from __future__ import annotations

import types
from typing import Any, Callable

import torch

from fl_lightning.lightning_compat import compile_started, dynamic_int_arguments
from fl_lightning.lightning_package import rank_zero_info

#: the step's integer arguments that change from call to call (the local step, the round): traced as
#: symbols, so that no graph holds their values
CHANGING_INTEGERS = ("step", "round_idx")


def own_copy(function: Callable[..., Any]) -> Callable[..., Any]:
    """``function`` with a code object of its own. ``torch.compile`` keeps its compiled graphs, and its
    limit of 8 recompilations, per code object: each backend's compiled step gets a cache of its own,
    so that a process running many federations (a sweep) keeps compiling theirs instead of falling
    back to eager once earlier federations have used up the limit (the cache goes with the backend)."""
    return types.FunctionType(function.__code__.replace(), function.__globals__, function.__name__,
                              function.__defaults__, function.__closure__)


class CompiledStep:
    """``function`` (a vectorized step) compiled with ``torch.compile``: one graph per structure of the
    step (its tensors' shapes, the Python values it reads), reused over steps, blocks and rounds. The
    step index and the round (:data:`CHANGING_INTEGERS`) are symbols of the graph, not constants: a
    FedAvg block compiles once for the whole run. Each compile is announced with one line
    (``rank_zero_info``), since it takes seconds to a minute on a CPU.

    Args:
        function: the step; its arguments named in :data:`CHANGING_INTEGERS` are integers.
        backend: ``torch.compile``'s backend (``"inductor"``: generated kernels; the tests capture
            the same graphs with ``"aot_eager"``, without generating code).
    """

    def __init__(self, function: Callable[..., Any], backend: str = "inductor") -> None:
        #: the step with a code object of its own (:func:`own_copy`), as compiled
        self.function = own_copy(function)
        dynamic_int_arguments(self.function, CHANGING_INTEGERS)
        # a random draw in the step (Dropout) gives the eager step's numbers
        options = {"fallback_random": True} if backend == "inductor" else None
        self._compiled = torch.compile(self.function, backend=backend, options=options)
        #: graphs compiled so far
        self.compiles = 0

    def __call__(self, *args: Any) -> Any:
        with compile_started(self._announce):
            return self._compiled(*args)

    def _announce(self) -> None:
        self.compiles += 1
        again = "" if self.compiles == 1 else f" again, for a new structure of the step (graph {self.compiles})"
        rank_zero_info(f"compile_step: compiling the batched step{again}; once per structure of the step (shapes of "
                       "the block's tensors, Python values the step reads), seconds to a minute on a CPU")
