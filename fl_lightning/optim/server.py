"""Adaptive server optimizers of Reddi et al., "Adaptive Federated Optimization" (ICLR 2021).

The server treats the round's mean model delta ``Delta_t`` as a pseudo-gradient (the engine
sets each parameter's ``.grad`` to ``-Delta_t``) and applies, per coordinate (Algorithm 2):

    m_t = beta1 m_{t-1} + (1 - beta1) Delta_t
    v_t = v_{t-1} + Delta_t^2                                        (FedAdagrad)
    v_t = beta2 v_{t-1} + (1 - beta2) Delta_t^2                      (FedAdam)
    v_t = v_{t-1} - (1 - beta2) Delta_t^2 sign(v_{t-1} - Delta_t^2)    (FedYogi)
    x_{t+1} = x_t + eta m_t / (sqrt(v_t) + tau)

with ``m_{-1} = 0`` and ``v_{-1} = tau^2`` (the paper's ``v_{-1} >= tau^2``), and no bias
correction. ``tau`` controls the adaptivity (the paper tunes it in {1e-3, ..., 1e-1}). Any
``torch.optim`` optimizer can be the server optimizer (``FederatedModule(server_optimizer=...)``);
these are torch optimizers too, so they are checkpointed and resumed like any other.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable, Optional

import torch
from torch import Tensor

from fl_lightning.validation import check_number


class _FedAdaptive(torch.optim.Optimizer):
    """The shared step of FedAdagrad, FedAdam and FedYogi (``_second_moment`` differs)."""

    def __init__(self, params: Iterable[Tensor], lr: float, betas: tuple[float, float], tau: float) -> None:
        check_number("lr", lr, 0.0, low_open=True)
        check_number("betas[0]", betas[0], 0.0, 1.0)
        check_number("betas[1]", betas[1], 0.0, 1.0)
        check_number("tau", tau, 0.0, low_open=True)
        super().__init__(params, {"lr": lr, "betas": tuple(betas), "tau": tau})

    @staticmethod
    def _second_moment(v: Tensor, square: Tensor, beta2: float) -> Tensor:
        raise NotImplementedError

    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], Any]] = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                delta = -p.grad  # the pseudo-gradient is -Delta_t
                state = self.state[p]
                if not state:
                    state["m"] = torch.zeros_like(p)
                    state["v"] = torch.full_like(p, group["tau"] ** 2)
                state["m"].mul_(beta1).add_(delta, alpha=1 - beta1)
                state["v"] = self._second_moment(state["v"], delta * delta, beta2)
                p.add_(group["lr"] * state["m"] / (state["v"].sqrt() + group["tau"]))
        return loss


class FedAdagrad(_FedAdaptive):
    """FedAdagrad: ``v_t = v_{t-1} + Delta_t^2`` (``betas[1]`` unused).

    Args:
        params: the global model's parameters.
        lr: the server learning rate ``eta``.
        betas: ``(beta1, beta2)``.
        tau: the adaptivity ``tau`` (> 0).
    """

    def __init__(self, params: Iterable[Tensor], lr: float = 0.1, betas: tuple[float, float] = (0.9, 0.99),
                 tau: float = 1e-3) -> None:
        super().__init__(params, lr, betas, tau)

    @staticmethod
    def _second_moment(v: Tensor, square: Tensor, beta2: float) -> Tensor:
        return v + square


class FedAdam(_FedAdaptive):
    """FedAdam: ``v_t = beta2 v_{t-1} + (1 - beta2) Delta_t^2``.

    Args:
        params: the global model's parameters.
        lr: the server learning rate ``eta``.
        betas: ``(beta1, beta2)``.
        tau: the adaptivity ``tau`` (> 0).
    """

    def __init__(self, params: Iterable[Tensor], lr: float = 0.01, betas: tuple[float, float] = (0.9, 0.99),
                 tau: float = 1e-3) -> None:
        super().__init__(params, lr, betas, tau)

    @staticmethod
    def _second_moment(v: Tensor, square: Tensor, beta2: float) -> Tensor:
        return beta2 * v + (1 - beta2) * square


class FedYogi(_FedAdaptive):
    """FedYogi: ``v_t = v_{t-1} - (1 - beta2) Delta_t^2 sign(v_{t-1} - Delta_t^2)``.

    Args:
        params: the global model's parameters.
        lr: the server learning rate ``eta``.
        betas: ``(beta1, beta2)``.
        tau: the adaptivity ``tau`` (> 0).
    """

    def __init__(self, params: Iterable[Tensor], lr: float = 0.01, betas: tuple[float, float] = (0.9, 0.99),
                 tau: float = 1e-3) -> None:
        super().__init__(params, lr, betas, tau)

    @staticmethod
    def _second_moment(v: Tensor, square: Tensor, beta2: float) -> Tensor:
        return v - (1 - beta2) * square * torch.sign(v - square)
