"""The mechanism of client-level differential privacy: clipping an update and Gaussian noise.

DP-FedAvg (McMahan et al., ICLR 2018) bounds each client's contribution by clipping its update
(all its tensors together) to an L2 norm ``C``, and hides it with Gaussian noise of standard
deviation proportional to ``C``. The callback :class:`~fl_lightning.callbacks.DifferentialPrivacy`
applies these per round; the privacy accounting is Opacus' (``callbacks/privacy.py``).
"""

from __future__ import annotations

import torch
from torch import Tensor

from fl_lightning.functional.norms import joint_norm


def clip_update(tensors: dict[str, Tensor], clip_norm: float) -> dict[str, Tensor]:
    """``tensors`` scaled so that their joint L2 norm is at most ``clip_norm``.

    >>> clip_update({"w": torch.tensor([3.0, 4.0])}, clip_norm=1.0)
    {'w': tensor([0.6000, 0.8000])}
    """
    norm = float(joint_norm([t.double() for t in tensors.values()]))
    scale = min(1.0, clip_norm / norm) if norm > 0 else 1.0
    return {name: t * scale for name, t in tensors.items()}


def gaussian_noise(like: Tensor, std: float, g: torch.Generator) -> Tensor:
    """``N(0, std^2)`` noise shaped like ``like``, from ``g`` (drawn on the CPU, so every device agrees)."""
    return (torch.randn(like.shape, generator=g, dtype=torch.float32) * std).to(like.device, like.dtype)
