"""``MaxPool2d``: ``nn.MaxPool2d`` with the same numbers, faster on a CPU for wide feature maps.

PyTorch's CPU max-pool over a contiguous (NCHW) input is not vectorized across channels: for
the CNNs of these papers it is one of the slowest layers of a step. Its channels-last kernel
picks the same maxima and the same indices (the first maximum of a window in row-major order; a
NaN wins), so this module pools a channels-last copy of its input, returns the result laid out
as ``nn.MaxPool2d`` lays it out (channels-last for a channels-last input, else contiguous) and
takes the gradient with PyTorch's own backward kernel from those indices: values and gradients
are bitwise ``nn.MaxPool2d``'s.

The layout copy costs more than it saves on small maps (``benchmarks/pooling.py``, 2x2 pooling,
batch 32, one thread, forward and backward: 32 channels at 28x28 4.9 -> 2.6 ms, 64 at 14x14
2.6 -> 0.7 ms, 16 at 8x8 0.13 -> 0.17 ms), so the channels-last path is taken on a CPU for at
least :data:`CHANNELS_LAST_MIN_CHANNELS` channels and :data:`CHANNELS_LAST_MIN_SIZE` values a
sample, for unpadded, undilated, floor-mode pooling without returned indices; everything else is
``nn.MaxPool2d``'s own forward. Under :func:`torch.func.vmap` (the batched client backend) the
clients' batches are pooled as one batch; under ``torch.compile`` the compiler's pooling is used.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.modules.utils import _pair

#: the fewest channels, and values a sample (channels x height x width), for which the
#: channels-last copy pays off on a CPU (batch 32: 16 channels at 14x14 2.1x faster, at 8x8 0.75x;
#: 32 channels at 8x8 2.4x)
CHANNELS_LAST_MIN_CHANNELS = 16
#: see :data:`CHANNELS_LAST_MIN_CHANNELS`
CHANNELS_LAST_MIN_SIZE = 2048


class _ChannelsLastMaxPool(torch.autograd.Function):
    """Max-pool of a 4-d tensor through the channels-last kernel; backward from its indices."""

    @staticmethod
    def forward(x: Tensor, kernel_size: tuple[int, int], stride: tuple[int, int]) -> tuple[Tensor, Tensor]:
        values, indices = F.max_pool2d_with_indices(x.contiguous(memory_format=torch.channels_last), kernel_size, stride)
        if x.is_contiguous(memory_format=torch.channels_last):
            return values, indices  # channels-last in and out, as the kernel gives them
        return values.contiguous(), indices.contiguous()

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: tuple[Tensor, Tensor]) -> None:
        x, ctx.kernel_size, ctx.stride = inputs
        ctx.save_for_backward(x, output[1])
        ctx.mark_non_differentiable(output[1])

    @staticmethod
    def backward(ctx: Any, grad: Tensor, _: Any) -> tuple[Tensor, None, None]:
        x, indices = ctx.saved_tensors
        return torch.ops.aten.max_pool2d_with_indices_backward(
            grad, x, list(ctx.kernel_size), list(ctx.stride), [0, 0], [1, 1], False, indices), None, None

    @staticmethod
    def vmap(info: Any, in_dims: tuple[Any, ...], x: Tensor, kernel_size: tuple[int, int],
             stride: tuple[int, int]) -> tuple[tuple[Tensor, Tensor], tuple[int, int]]:
        x = x.movedim(in_dims[0], 0)
        values, indices = _ChannelsLastMaxPool.apply(x.flatten(0, 1), kernel_size, stride)
        return (values.unflatten(0, x.shape[:2]), indices.unflatten(0, x.shape[:2])), (0, 0)


class MaxPool2d(nn.MaxPool2d):
    """``nn.MaxPool2d`` (same arguments, same results) that pools wide CPU feature maps through
    PyTorch's channels-last kernel; see the module's docstring."""

    def _channels_last(self, x: Tensor) -> bool:
        return (x.dim() == 4 and x.device.type == "cpu" and x.shape[1] >= CHANNELS_LAST_MIN_CHANNELS
                and math.prod(x.shape[1:]) >= CHANNELS_LAST_MIN_SIZE
                and _pair(self.padding) == (0, 0) and _pair(self.dilation) == (1, 1) and not self.ceil_mode
                and not self.return_indices and not torch.compiler.is_compiling())

    def forward(self, x: Tensor) -> Tensor:
        if not self._channels_last(x):
            return super().forward(x)
        return _ChannelsLastMaxPool.apply(x, _pair(self.kernel_size), _pair(self.stride or self.kernel_size))[0]
