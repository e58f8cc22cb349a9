"""A model's floating-point state as one flat fp32 vector, and the few conversions around it.

Aggregators, robust statistics and per-client state all work on flat vectors: a client
update is ``end - start`` of these, and a stack of updates is a ``[clients, dim]`` matrix.
Local steps work on lists of tensors shaped like the model's (a gradient, a control variate).
:class:`Layout` converts between the two; it is the only place that walks offsets.
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch import Tensor, nn


class Layout:
    """The shapes of a model's state: its parameters, then its floating buffers.

    A flat vector in this layout holds every tensor's entries, one tensor after the other;
    the first ``num_params`` entries are the parameters.

    Args:
        shapes: the shape of each tensor, parameters first.
        num_param_tensors: how many of ``shapes`` are parameters.
    """

    def __init__(self, shapes: Sequence[torch.Size], num_param_tensors: int) -> None:
        self.shapes = [torch.Size(s) for s in shapes]
        self._views = [tuple(s) for s in self.shapes]  # view() takes a tuple in under half a Size's time
        self.numels = [s.numel() for s in self.shapes]
        self.num_param_tensors = num_param_tensors
        self.num_params = sum(self.numels[:num_param_tensors])
        self.dim = sum(self.numels)

    def split(self, vector: Tensor) -> list[Tensor]:
        """Views of ``vector`` (length ``dim``) shaped like every tensor of the state."""
        if vector.numel() != self.dim:
            raise ValueError(f"state vector has {vector.numel()} entries, the model has {self.dim}")
        return [part.view(shape) for part, shape in zip(vector.split(self.numels), self._views)]

    def copy(self, vector: Tensor) -> list[Tensor]:
        """A model as new tensors shaped like the state: a copy of ``vector`` (length ``dim``), in the order
        of :meth:`split` (the other models of a client's step: FedDeper's personal model, FedProxVR's
        reference point)."""
        return [t.clone() for t in self.split(vector)]

    def write(self, tensors: Sequence[Tensor], vector: Tensor) -> None:
        """Write ``vector`` (length ``dim``) into ``tensors`` (shaped like the state), in place: one
        multi-tensor copy."""
        with torch.no_grad():
            torch._foreach_copy_(list(tensors), self.split(vector))

    def split_params(self, vector: Tensor) -> list[Tensor]:
        """Views of ``vector`` (length ``num_params`` or ``dim``) shaped like the parameters."""
        if vector.numel() not in (self.num_params, self.dim):
            raise ValueError(f"vector has {vector.numel()} entries, the parameters {self.num_params}")
        parts = vector[: self.num_params].split(self.numels[: self.num_param_tensors])
        return [part.view(shape) for part, shape in zip(parts, self._views)]

    def params_of(self, vector: Tensor) -> Tensor:
        """The parameters' entries of a state vector (length ``dim``, or ``[..., dim]`` rows): a view, its
        first ``num_params`` entries (SCAFFOLD's control variates live on the parameters only)."""
        return vector[..., : self.num_params]

    def buffers_of(self, vector: Tensor) -> Tensor:
        """The floating buffers' entries of a state vector (BatchNorm's statistics): a view, the entries
        after the parameters'."""
        return vector[..., self.num_params :]

    @staticmethod
    def flatten(tensors: Sequence[Tensor], dtype: torch.dtype = torch.float32) -> Tensor:
        """One new flat ``dtype`` vector of ``tensors`` (detached), in their order."""
        with torch.no_grad():  # no graph: each tensor's flat view goes in as it is, cast only where it must be
            return torch.cat([t.reshape(-1) if t.dtype == dtype else t.reshape(-1).to(dtype) for t in tensors])


class ModelVector:
    """Reads and writes the parameters and floating buffers of ``module`` as one vector.

    The order is: all parameters (``module.parameters()`` order), then floating buffers.
    Integer buffers (``num_batches_tracked``) are not part of it. Tensors are looked up on
    each call, so the vector stays valid after the module moves between devices.
    """

    def __init__(self, module: nn.Module, include_buffers: bool = True) -> None:
        self.module = module
        self.include_buffers = include_buffers
        self.layout = Layout([t.shape for t in self.tensors], len(self.params))
        self.num_params = self.layout.num_params
        self.dim = self.layout.dim

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
        return Layout.flatten(self.tensors, dtype)

    def load(self, vector: Tensor) -> None:
        """Write ``vector`` (length ``dim``) into the tensors, in place."""
        self.layout.write(self.tensors, vector)

    def set_grads(self, grads: Sequence[Tensor]) -> None:
        """Make ``grads`` (shaped like the parameters) the parameters' ``.grad`` (see :func:`set_grads`)."""
        set_grads(self.params, grads)


def set_grads(params: Sequence[Tensor], grads: Sequence[Tensor]) -> None:
    """Make ``grads`` the ``.grad`` of ``params`` (same shapes), for an optimizer step along them.

    A tensor that already is a parameter's gradient is not copied. A frozen parameter
    (``requires_grad=False``) keeps no gradient, so a ``torch.optim`` optimizer leaves it as it
    is, as in plain training (not even weight decay or momentum move it).
    """
    for p, g in zip(params, grads):
        if not p.requires_grad:
            p.grad = None
        elif p.grad is not g:
            p.grad = g.to(dtype=p.dtype, device=p.device)
