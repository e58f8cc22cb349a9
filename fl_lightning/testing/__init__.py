"""``check_algorithm``: whether an algorithm keeps the engine's promises.

An algorithm that runs and learns can still break what the engine promises for every algorithm that keeps
its rules (``docs/engine.md``): one that keeps per-client values in a dict on ``self`` gives the same result
on both backends, and silently breaks resume and multi-process runs. :func:`check_algorithm` runs a small
federation of an algorithm (6 generated Synthetic(1, 1) clients, a small MLP client, 3 clients a round, 3
rounds; each overridable) and checks each promise, one function per property
(:mod:`fl_lightning.testing.properties`):

=======================  ==================================================================================
``"client_state"``       no per-client state outside the declared entries (:func:`check_client_state`)
``"batched"``            the batched backend gives the sequential backend's results (:func:`check_batched`)
``"resume"``             a run stopped after a round and resumed from its checkpoint gives the uninterrupted
                         run's results, bitwise (:func:`check_resume`)
``"nonfinite_update"``   a client whose update holds NaN is left out and the round goes on with the others
                         (:func:`check_nonfinite_update`)
``"without_trainer"``    a client's round without a Trainer (``run_client``, what a deployment node runs)
                         gives the fit's, bitwise (:func:`check_without_trainer`)
``"two_processes"``      two processes give the results of one (:func:`check_two_processes`)
=======================  ==================================================================================

"Results" are a run's :func:`outcome` after every round: the global model and the module's other tensors, the
server optimizer's state, a lock-step algorithm's shared value and every client's stored entries. A property
that fails raises ``AssertionError`` naming the property, what differed (the first round and tensor, by how
much) and the likely cause with its fix; a property that cannot apply (the batched backend refuses the
algorithm, its clients upload nothing) is skipped, with the reason in the report.
"""

from __future__ import annotations

from typing import Any, Sequence, Union

import torch

from fl_lightning.lightning_package import Strategy
from fl_lightning.module import FederatedModule
from fl_lightning.testing.federation import (
    TOLERANCE,
    AlgorithmCheck,
    ClientSource,
    DataSource,
    default_client,
    default_datamodule,
    first_difference,
    outcome,
)
from fl_lightning.testing.properties import (
    CHECKS,
    PASSED,
    PROPERTIES,
    check_batched,
    check_client_state,
    check_nonfinite_update,
    check_resume,
    check_two_processes,
    check_without_trainer,
)
from fl_lightning.testing.state_probe import StateProbe

#: every property (the default of :func:`check_algorithm`'s ``properties``)
ALL = PROPERTIES

__all__ = [
    "ALL",
    "AlgorithmCheck",
    "CHECKS",
    "PASSED",
    "PROPERTIES",
    "StateProbe",
    "TOLERANCE",
    "check_algorithm",
    "check_batched",
    "check_client_state",
    "check_nonfinite_update",
    "check_resume",
    "check_two_processes",
    "check_without_trainer",
    "default_client",
    "default_datamodule",
    "first_difference",
    "outcome",
]


def check_algorithm(cls: type[FederatedModule], client: ClientSource = None, datamodule: DataSource = None, *,
                    rounds: int = 3, properties: Union[str, Sequence[str]] = ALL,
                    two_process_strategy: Union[str, Strategy] = "fl_ddp_spawn", **kwargs: Any) -> dict[str, str]:
    """Run a small federation of ``cls`` and check that it keeps the engine's promises
    (:data:`~fl_lightning.testing.PROPERTIES`).

    About a second a property on a CPU for a small client (one or two runs of ``rounds`` rounds each and a
    reference run they share), but the two-process check, whose ``"fl_ddp_spawn"`` starts two Python
    processes (mostly their imports: 40 to 90 s measured on a busy two-core machine; forked with
    ``"fl_ddp_notebook"``, 4 s). In a script, call it under ``if __name__ == "__main__":`` (the spawned
    processes import the script). The global RNG is as it was afterwards.

    Args:
        cls: the algorithm, a :class:`~fl_lightning.module.FederatedModule` subclass.
        client: the client module (copied for each run), or a function returning a new one; None: a small MLP
            (:func:`default_client`).
        datamodule: the data (copied for each run), or a function returning a new one; None: 6 generated
            clients (:func:`default_datamodule`).
        rounds: the rounds of each run (>= 2).
        properties: the properties to check, one or some of :data:`~fl_lightning.testing.PROPERTIES` (default: all).
        two_process_strategy: the two-process run's strategy (see :class:`AlgorithmCheck`).
        **kwargs: ``cls``'s arguments (``clients_per_round`` is 3 unless it or ``clients_fraction`` is given).

    Returns:
        Each property checked, in :data:`~fl_lightning.testing.PROPERTIES`' order, with ``"passed"`` or
        ``"skipped: <reason>"``.

    Raises:
        AssertionError: a property does not hold; the message names it, what differed and the likely fix.
        ValueError: ``properties`` names none or an unknown property, or a bad argument (see
            :class:`AlgorithmCheck`).
        TypeError: ``cls`` is not a ``FederatedModule`` subclass.

    Example::

        from fl_lightning.algorithms import FedProx
        from fl_lightning.testing import check_algorithm

        if __name__ == "__main__":
            print(check_algorithm(FedProx, mu=0.1))  # {'client_state': 'passed', 'batched': 'passed', ...}
    """
    chosen = (properties,) if isinstance(properties, str) else tuple(properties)
    unknown = [p for p in chosen if p not in CHECKS]
    if unknown or not chosen:
        raise ValueError(f"properties must be one or some of {list(PROPERTIES)}, got {properties!r}")
    check = AlgorithmCheck(cls, client, datamodule, rounds=rounds, two_process_strategy=two_process_strategy,
                           **kwargs)
    try:
        with torch.random.fork_rng(devices=[]):
            return {name: CHECKS[name](check) for name in PROPERTIES if name in chosen}
    finally:
        check.close()
