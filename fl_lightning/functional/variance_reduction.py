"""Variance-reduced gradient estimators, as pure functions.

The estimators correct a minibatch gradient with gradients at a reference point; they apply
to tensors of any shape (one parameter tensor, or a flat vector).

* :func:`svrg_direction`, :func:`sarah_direction`: FedProxVR's two estimators (Dinh et al., 2020);
* :func:`saga_direction`: SAGA's, from a table of stored component gradients (Byrd-SAGA);
* :func:`full_gradient`: the exact gradient of a mean loss over a data set given in chunks
  (SVRG's and SARAH's first direction).
"""

from __future__ import annotations

from typing import Any, Callable, Iterable, Sequence

from torch import Tensor


def svrg_direction(grad: Tensor, snapshot_grad: Tensor, full_grad: Tensor) -> Tensor:
    """SVRG: ``v_t = g_I(w_t) - g_I(w_0) + grad F(w_0)``, both minibatch gradients on the same batch ``I``."""
    return grad - snapshot_grad + full_grad


def sarah_direction(grad: Tensor, previous_grad: Tensor, previous_direction: Tensor) -> Tensor:
    """SARAH: ``v_t = g_I(w_t) - g_I(w_{t-1}) + v_{t-1}``, both minibatch gradients on the same batch ``I``."""
    return grad - previous_grad + previous_direction


def saga_direction(grad: Tensor, stored: Tensor, table_mean: Tensor) -> Tensor:
    """SAGA: ``v = g_j(w) - G_j + G_bar``, with ``G_j`` component ``j``'s stored gradient and
    ``G_bar`` the mean of the table."""
    return grad - stored + table_mean


def full_gradient(grad_fn: Callable[[Any], Sequence[Tensor]], chunks: Iterable[tuple[Any, int]]) -> list[Tensor]:
    """The gradient of the mean loss over a whole data set given as ``(batch, size)`` chunks.

    ``grad_fn(batch)`` is the gradient (a list of tensors) of the *mean* loss of a chunk; the
    result is ``sum_c size_c * grad_fn(c) / sum_c size_c``, accumulated in float64, returned in fp32.
    """
    total: list[Tensor] | None = None
    count = 0
    for batch, size in chunks:
        grads = [g.double() * size for g in grad_fn(batch)]
        total = grads if total is None else [t.add_(g) for t, g in zip(total, grads)]
        count += size
    if total is None or count == 0:
        raise ValueError("full_gradient needs at least one non-empty chunk")
    return [(t / count).float() for t in total]
