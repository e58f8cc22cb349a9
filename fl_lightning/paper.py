"""``PaperDefaults``: the settings an algorithm's paper fixes, used where its arguments are not given.

An algorithm's defaults are its paper's (the project's rule): each ``FederatedModule`` subclass states
them in one class attribute, ``paper``, beside the equations of its docstring::

    class RAGA(FederatedModule):
        paper = PaperDefaults(local_steps=3)
"""

from __future__ import annotations

from dataclasses import dataclass

from fl_lightning.update import Weighting
from fl_lightning.validation import check_int


@dataclass(frozen=True)
class PaperDefaults:
    """What an algorithm's paper sets.

    Args:
        local_steps: the local steps per round when neither ``local_steps`` nor ``local_epochs`` is given.
        min_local_steps: the fewest local steps the algorithm takes: 1, or 0 for an algorithm whose round
            does its own work before the minibatch steps (FedProxVR's full-gradient step).
        weighting: the mean aggregate's client weights when the ``weighting`` argument is not given:
            ``"num_samples"`` (``sum_i n_i u_i / sum_i n_i``, FedAvg's) or ``"uniform"`` (``(1/|S|) sum_i u_i``).

    Raises:
        ValueError: ``local_steps`` below ``min_local_steps``, ``min_local_steps`` below 0, or another weighting.
    """

    local_steps: int = 10
    min_local_steps: int = 1
    weighting: Weighting = "num_samples"

    def __post_init__(self) -> None:
        check_int("min_local_steps", self.min_local_steps, 0)
        check_int("local_steps", self.local_steps, self.min_local_steps)
        if self.weighting not in ("num_samples", "uniform"):
            raise ValueError(f"weighting must be 'num_samples' or 'uniform', got {self.weighting!r}")
