"""The client module as a function of its tensors.

``torch.func.functional_call`` evaluates a module with other tensors in place of its
parameters and buffers. :class:`StatelessClient` wraps the client module so that its
``forward``, its ``training_step`` and its evaluation steps (``validation_step``, ``test_step``)
can be evaluated at any model given as a list of tensors in
:class:`~fl_lightning.vectors.Layout` order (parameters, then floating buffers): the other
models of a local step in the sequential backend, every model in the batched one. Both backends
take the loss of a ``training_step`` with :func:`training_loss`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from torch import Tensor, nn
from torch.func import functional_call


#: the client hooks of one batch that :class:`StatelessClient` evaluates at given tensors
STEP_HOOKS: tuple[str, ...] = ("training_step", "validation_step", "test_step")


class _Step(nn.Module):
    """``forward(batch, index)`` is the client's hook ``hook(batch, index)`` (``training_step``,
    ``validation_step``, ``test_step``), for ``functional_call``."""

    def __init__(self, client: nn.Module, hook: str) -> None:
        super().__init__()
        self.client = client
        self.hook = hook

    def forward(self, batch: Any, index: int) -> Any:
        return getattr(self.client, self.hook)(batch, index)


class StatelessClient:
    """The client module's ``forward`` and its steps (:data:`STEP_HOOKS`) at given tensors.

    Args:
        client: the client module (its own tensors are left unchanged, except that a
            forward in train mode updates the *given* floating buffers, as the module's own).
    """

    def __init__(self, client: nn.Module) -> None:
        self.client = client
        self.names = [n for n, _ in client.named_parameters()] + [
            n for n, b in client.named_buffers() if b.is_floating_point()
        ]
        self.int_buffers = [n for n, b in client.named_buffers() if not b.is_floating_point()]
        self._steps = {hook: _Step(client, hook) for hook in STEP_HOOKS}

    def named(self, tensors: Sequence[Tensor]) -> dict[str, Tensor]:
        """``{name: tensor}`` for a model in layout order, with copies of the client's integer
        buffers (a forward at another model must not count the client's own BatchNorm steps)."""
        named = dict(zip(self.names, tensors))
        if self.int_buffers:
            buffers = dict(self.client.named_buffers())
            named.update({n: buffers[n].clone() for n in self.int_buffers})
        return named

    def forward(self, tensors: Sequence[Tensor], *args: Any) -> Any:
        """The client's forward on ``args`` at the model ``tensors``."""
        return functional_call(self.client, self.named(tensors), args)

    def training_step(self, tensors: Sequence[Tensor], batch: Any, index: int) -> Any:
        """The client's ``training_step(batch, index)`` at the model ``tensors``."""
        return self.step("training_step", tensors, batch, index)

    def step(self, hook: str, tensors: Sequence[Tensor], batch: Any, index: int) -> Any:
        """The client's ``hook(batch, index)`` (one of :data:`STEP_HOOKS`) at the model ``tensors``."""
        named = {f"client.{name}": t for name, t in self.named(tensors).items()}
        return functional_call(self._steps[hook], named, (batch, index))


def training_loss(output: Any, check_grad: bool = True) -> Tensor:
    """The loss of a ``training_step`` result: a tensor, or the ``"loss"`` of a dict, as a 0-dim tensor.

    Both backends take the loss here. A loss of more than one element, or one that does not
    require grad (detached, or computed under ``no_grad``), is refused with a ValueError: the
    first fails in ``backward`` / ``torch.func.grad``, the second would give the batched backend
    a zero gradient. The checks read tensor metadata only (no device sync). ``check_grad=False``
    leaves the second to the caller: under ``vmap`` a loss reads ``requires_grad=False`` even where
    its gradient is taken outside (:func:`loss_requiring_grad` checks the vmapped losses)."""
    loss = output["loss"] if isinstance(output, Mapping) and "loss" in output else output
    if not isinstance(loss, Tensor):
        got = f"a dict with keys {sorted(output)}" if isinstance(output, Mapping) else type(output).__name__
        raise TypeError(
            f"the client's training_step must return a loss tensor or a dict with a 'loss' tensor, got {got}"
        )
    if loss.numel() != 1:
        raise ValueError(f"the client's training_step returned a loss of shape {tuple(loss.shape)}: it must be a "
                         "scalar tensor (one element); reduce it, e.g. with .mean()")
    if check_grad:
        loss_requiring_grad(loss)
    return loss if loss.dim() == 0 else loss.reshape(())  # a view op and a backward node less per step


def loss_requiring_grad(loss: Tensor) -> Tensor:
    """``loss``, refused with a ValueError where it does not require grad."""
    if not loss.requires_grad:
        raise ValueError("the client's training_step returned a loss that does not require grad (detached, computed "
                         "under torch.no_grad(), or from no trainable parameter): it must be a tensor computed from "
                         "the model's parameters with grad enabled")
    return loss
