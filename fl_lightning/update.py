"""What one client sends back to the server after its local work."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor


@dataclass
class ClientUpdate:
    """One client's contribution to a round.

    Attributes:
        client_id: index of the client in the federation.
        num_samples: size of the client's training split (the weight of sample-weighted means).
        tensors: named flat fp32 tensors to aggregate, e.g. ``{"delta": y - x}``; an algorithm
            chooses the names (an averaged gradient, a control-variate delta...).
        metrics: scalars for logging (local loss, ...), not aggregated into the model.
    """

    client_id: int
    num_samples: int
    tensors: dict[str, Tensor]
    metrics: dict[str, float] = field(default_factory=dict)

    def is_finite(self) -> bool:
        """Whether every tensor of the update is free of NaN and Inf.

        A float64 sum propagates any NaN/Inf and cannot overflow for float32 inputs, so one
        reduction per tensor decides it.
        """
        return all(bool(torch.isfinite(t.sum(dtype=torch.float64))) for t in self.tensors.values())

    def to(self, device: torch.device | str) -> "ClientUpdate":
        """A copy with every tensor on ``device``."""
        return ClientUpdate(
            self.client_id,
            self.num_samples,
            {k: v.to(device) for k, v in self.tensors.items()},
            dict(self.metrics),
        )
