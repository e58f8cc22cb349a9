"""A model's floating-point state as one flat fp32 vector.

Aggregators, robust statistics and per-client state all work on flat vectors: a client
update is ``end - start`` of these, and a stack of updates is a ``[clients, dim]`` matrix.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn


class StateVector:
    """Reads and writes the parameters and floating buffers of ``module`` as one vector.

    The order is: all parameters (``module.parameters()`` order), then floating buffers.
    Integer buffers (``num_batches_tracked``) are not part of it. Tensors are looked up on
    each call, so the vector stays valid after the module moves between devices.
    """

    def __init__(self, module: nn.Module, include_buffers: bool = True) -> None:
        self.module = module
        self.include_buffers = include_buffers
        self.num_params = sum(p.numel() for p in module.parameters())
        self.dim = sum(t.numel() for t in self.tensors)

    @property
    def params(self) -> list[Tensor]:
        """The parameters, in vector order."""
        return list(self.module.parameters())

    @property
    def tensors(self) -> list[Tensor]:
        """Parameters then floating buffers, in vector order."""
        out = self.params
        if self.include_buffers:
            out += [b for b in self.module.buffers() if b.is_floating_point()]
        return out

    def flatten(self, dtype: torch.dtype = torch.float32) -> Tensor:
        """A new flat tensor holding the current values."""
        with torch.no_grad():
            return torch.cat([t.detach().reshape(-1).to(dtype) for t in self.tensors])

    def load(self, vector: Tensor) -> None:
        """Write ``vector`` (length ``dim``) into the tensors, in place."""
        if vector.numel() != self.dim:
            raise ValueError(f"state vector has {vector.numel()} entries, the model has {self.dim}")
        tensors = self.tensors
        with torch.no_grad():
            for t, v in zip(tensors, vector.split([t.numel() for t in tensors])):
                t.copy_(v.view_as(t))

    def copy_from(self, other: "StateVector") -> None:
        """Write ``other``'s values into these tensors, in place, tensor by tensor (no flat copy).

        ``other`` must describe a module of the same architecture (a copy of this one).
        """
        mine, theirs = self.tensors, other.tensors
        if [t.shape for t in mine] != [t.shape for t in theirs]:
            raise ValueError("copy_from needs a module of the same architecture: the tensor shapes differ")
        with torch.no_grad():
            for t, o in zip(mine, theirs):
                t.copy_(o)

    def grads(self) -> Tensor:
        """The parameters' gradients as one flat fp32 vector (zeros where a gradient is None)."""
        return torch.cat(
            [torch.zeros(p.numel(), device=p.device) if p.grad is None else p.grad.reshape(-1).float() for p in self.params]
        )
