"""The CPU's intra-op threads during a fit: one for small clients, unless the user chose.

torch runs each operation on as many threads as the machine has cores. A small client's operations
(a logistic regression's, an MLP's on MNIST) are too small to share: the threads' hand-offs cost more
than they save, and on a machine whose cores are busy with other work every hand-off waits for a
descheduled thread. Measured on a 2-core CPU (``benchmarks/threads.py``, ``docs/performance.md``): the
quickstart's round took 1.7x longer with torch's 2 threads than with one on quiet cores (the whole run,
16.6 s against 10.0 s), 9-33x longer on busy ones; MNIST's MLP 3.4-10x; a CNN whose step is a
thousand times a logistic regression's still 5x on busy cores, where on quiet cores its arithmetic
gains from more threads.

So a fit on the CPU whose client's local step is small (:data:`SMALL_STEP_FLOPS`, counted once when
the fit starts: :func:`~fl_lightning.backends.trial.step_flops`) runs one intra-op thread, and a larger
one keeps torch's threads, each with one line that says so and how to choose; the choice is the user's
wherever they made one (:func:`threads_chosen`), and torch's count is put back when the fit ends or
fails (:class:`FitThreads`, a callback the ``FederatedModule`` adds to every Trainer).
"""

from __future__ import annotations

import os
from typing import Any, Optional

import torch

from fl_lightning.backends.context import ClientContext
from fl_lightning.backends.trial import step_flops
from fl_lightning.lightning_package import pl, rank_zero_info

#: a client whose local step's forward takes fewer floating-point operations runs one thread on the CPU
#: (MNIST's MLP, 784-200-200-10 on batches of 64: 25 MFLOP; FedDeper's MNIST CNN: 970 MFLOP)
SMALL_STEP_FLOPS = 10**8

#: the environment variables that set torch's threads when it starts
THREAD_VARIABLES = ("OMP_NUM_THREADS", "MKL_NUM_THREADS")

#: torch's intra-op threads when fl_lightning was imported (a later change is the user's choice)
THREADS_AT_IMPORT = torch.get_num_threads()


def threads_chosen() -> bool:
    """Whether the user chose torch's intra-op threads: the environment names a count
    (:data:`THREAD_VARIABLES`), or ``torch.set_num_threads`` changed it since fl_lightning was imported."""
    return any(os.environ.get(name) for name in THREAD_VARIABLES) or torch.get_num_threads() != THREADS_AT_IMPORT


class FitThreads(pl.Callback):
    """The threads of a fit: chosen when it starts (:meth:`choose`, with the federated module's
    ``context``), torch's count put back when it ends or fails."""

    def __init__(self) -> None:
        #: torch's count before the fit, where the fit changed it
        self.before: Optional[int] = None

    def on_fit_start(self, trainer: pl.Trainer, pl_module: Any) -> None:
        self.choose(pl_module.engine.context)

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self.restore()

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        self.restore()

    def choose(self, context: ClientContext) -> None:
        """One intra-op thread on the CPU for a client whose step is small, where torch runs more and the
        user did not choose; one line of notice where the choice matters (more than one thread)."""
        threads = torch.get_num_threads()
        if context.device.type != "cpu" or threads == 1 or threads_chosen():
            return
        flops = step_flops(context)
        how = "set OMP_NUM_THREADS (or call torch.set_num_threads) to choose"
        if flops < SMALL_STEP_FLOPS:
            self.before = threads
            torch.set_num_threads(1)
            rank_zero_info(f"fl_lightning: a small client ({flops / 1e6:.3g} MFLOP a step): the fit runs 1 intra-op "
                           f"thread on the CPU, not torch's {threads} (the quickstart: 1.7x faster on 2 quiet cores, "
                           f"its rounds 9-33x on busy ones; docs/performance.md); {how}")
        else:
            rank_zero_info(f"fl_lightning: the fit runs torch's {threads} intra-op threads on the CPU for a client of "
                           f"{flops / 1e6:.3g} MFLOP a step; on busy cores one thread can be several times faster (a "
                           f"970 MFLOP CNN: 5x on 2 busy cores; docs/performance.md); {how}")

    def restore(self) -> None:
        """Put back torch's count where :meth:`choose` changed it."""
        if self.before is not None:
            torch.set_num_threads(self.before)
            self.before = None
