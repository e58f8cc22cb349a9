"""Norms of a model's worth of tensors, as pure functions."""

from __future__ import annotations

from typing import Sequence

import torch
from torch import Tensor


def joint_norm(tensors: Sequence[Tensor]) -> Tensor:
    """The Euclidean norm of a list of tensors taken as one vector (a 0-dim tensor: no host sync)."""
    return torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(t) for t in tensors]))
