"""``ClientConfig``: the settings of one client's local work in one round (Flower's fit config).

The engine builds each client's run of a round from its configuration: how much local work it
does (``local_steps`` or ``local_epochs``, the unit the module counts its work in), at what
learning rate, or none at all (``drop``: the client drops out of the round and sends nothing).
Every client starts from the module's arguments; a
:class:`~fl_lightning.hooks.FederatedCallback` changes the configuration per round and per client
in its ``configure_client`` hook (what Flower's ``on_fit_config_fn`` and a strategy's
``configure_fit`` do), e.g. :class:`~fl_lightning.callbacks.Stragglers`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Literal, Optional, Sequence

from fl_lightning.validation import check_int, check_number

#: the names of a client's unit of local work, as ``FederatedModule`` takes them
WorkUnit = Literal["local_steps", "local_epochs"]


@dataclass(frozen=True)
class ClientConfig:
    """One client's settings for one round; exactly one of ``local_steps`` and ``local_epochs`` is set.

    Args:
        local_steps: local optimizer steps (for a module that counts its local work in steps).
        local_epochs: passes over the client's training split (for a module that counts in epochs).
        lr: the local learning rate, set on every parameter group that trains (None: the client
            optimizer's rate of the round, as its schedule gives it). Refused for an optimizer whose
            trainable groups have different rates: scale them with ``lr_scale``.
        lr_scale: a factor on the local learning rate of every parameter group that trains (after ``lr``).
        drop: the client drops out of the round: it does no local work and sends no update.

    Raises:
        ValueError: a setting out of range, or not exactly one of ``local_steps`` and ``local_epochs``.
    """

    local_steps: Optional[int] = None
    local_epochs: Optional[int] = None
    lr: Optional[float] = None
    lr_scale: float = 1.0
    drop: bool = False

    def __post_init__(self) -> None:
        if (self.local_steps is None) == (self.local_epochs is None):
            raise ValueError(f"a client's configuration gives exactly one of local_steps and local_epochs, got "
                             f"local_steps={self.local_steps}, local_epochs={self.local_epochs}")
        if self.local_steps is not None:
            check_int("local_steps", self.local_steps, 0)
        if self.local_epochs is not None:
            check_int("local_epochs", self.local_epochs, 1)
        if self.lr is not None:
            check_number("lr", self.lr, 0.0, low_open=True)
        check_number("lr_scale", self.lr_scale, 0.0, low_open=True)
        if not isinstance(self.drop, bool):
            raise ValueError(f"drop must be True or False, got {self.drop!r}")

    def replace(self, **changes: Any) -> "ClientConfig":
        """A copy with ``changes`` (settings by name), checked as a new configuration.

        Raises:
            ValueError: a name that is no setting, or a setting out of range.
        """
        names = [f.name for f in dataclasses.fields(self)]
        unknown = sorted(set(changes) - set(names))
        if unknown:
            raise ValueError(f"a client's configuration has no setting {', '.join(map(repr, unknown))}; "
                             f"its settings are {', '.join(names)}")
        return dataclasses.replace(self, **changes)

    @property
    def unit(self) -> WorkUnit:
        """The unit of the client's local work: ``"local_steps"`` or ``"local_epochs"``."""
        return "local_steps" if self.local_steps is not None else "local_epochs"

    @property
    def work(self) -> int:
        """The amount of the client's local work, in its :attr:`unit`."""
        return self.local_steps if self.local_steps is not None else self.local_epochs  # type: ignore[return-value]

    @property
    def changes_lr(self) -> bool:
        """Whether the configuration changes the local optimizer's learning rate."""
        return self.lr is not None or self.lr_scale != 1.0

    def rates(self, rates: Sequence[float]) -> list[float]:
        """The learning rates of the local optimizer's trainable parameter groups, given as ``rates``,
        under this configuration: each ``lr`` if it is set, else its own, times ``lr_scale``.

        Raises:
            ValueError: ``lr`` is set and ``rates`` are not all the same.
        """
        if self.lr is not None and len(set(rates)) > 1:
            raise ValueError(f"a client's configuration sets lr={self.lr}, and the local optimizer's trainable "
                             f"parameter groups have several rates ({sorted(set(rates))}): scale them with lr_scale")
        return [(rate if self.lr is None else self.lr) * self.lr_scale for rate in rates]
