"""The guard against a vectorized ``training_step`` that changes Python state of the client module."""

from __future__ import annotations

from typing import Any

from torch import Tensor, nn
from torchmetrics import Metric

from fl_lightning.lightning_compat import lightning_module_attributes


class PythonState:
    """Detects a ``training_step`` that changes Python state of the client module: in a vectorized
    step it runs once for the whole block, not once per client, so a counter, a list it appends
    to or a tensor it keeps would be wrong. (The client's torchmetrics objects are not in the module
    during a vectorized step: their calls are recorded and made for every client after it,
    :mod:`~fl_lightning.backends.batched.metrics`.)

    The snapshot holds every attribute of the client module and its submodules but Lightning's
    and torch's own: scalars and strings by value, containers by length, other objects (tensors
    kept on ``self``) by identity.
    """

    def __init__(self, client: nn.Module) -> None:
        self.client = client
        self.before = self._snapshot()

    def _snapshot(self) -> dict[tuple[str, str], Any]:
        # attributes that Lightning and torch keep on every module are not the client's own Python state
        framework = lightning_module_attributes() | {"log"}
        values: dict[tuple[str, str], Any] = {}
        for prefix, mod in self.client.named_modules():
            for key, value in vars(mod).items():
                if key in framework and not (isinstance(mod, Metric) and key == "_update_count"):
                    continue
                if isinstance(value, (bool, int, float, str)) or value is None:
                    values[(prefix, key)] = value
                elif isinstance(value, (list, dict, set, tuple)):
                    values[(prefix, key)] = ("len", len(value))
                elif isinstance(value, Tensor):
                    values[(prefix, key)] = ("id", id(value))
        return values

    def changed(self) -> list[str]:
        """The client module's attributes that changed since the snapshot, by dotted name."""
        after = self._snapshot()
        return sorted(f"{p + '.' if p else ''}{k}" for (p, k), v in after.items()
                      if (p, k) not in self.before or self.before[(p, k)] != v)

    def check(self) -> None:
        """Refuse a ``training_step`` that changed the client module's Python state."""
        changed = self.changed()
        if changed:
            raise ValueError(
                f"the client's training_step changes Python state ({', '.join(changed)}): in the batched backend it "
                "runs once per block of clients, not once per client; keep such state out of training_step (a "
                "torchmetrics Metric it updates is fine: the backend updates it for every client) or use "
                "client_backend='sequential'"
            )
