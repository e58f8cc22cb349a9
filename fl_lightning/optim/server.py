"""Adaptive server optimizers of Reddi et al., "Adaptive Federated Optimization" (ICLR 2021).

The server treats the round's mean model delta ``Delta_t = (1/|S|) sum_{i in S} Delta_i``
(uniform over the round's clients ``S``, Algorithm 2: the module's default aggregation with these
optimizers; ``weighting="num_samples"`` weighs by sample count) as a pseudo-gradient (the engine
sets each parameter's ``.grad`` to ``-Delta_t``) and applies, per coordinate:

    m_t = beta1 m_{t-1} + (1 - beta1) Delta_t
    v_t = v_{t-1} + Delta_t^2                                        (FedAdagrad)
    v_t = beta2 v_{t-1} + (1 - beta2) Delta_t^2                      (FedAdam)
    v_t = v_{t-1} - (1 - beta2) Delta_t^2 sign(v_{t-1} - Delta_t^2)    (FedYogi)
    x_{t+1} = x_t + eta m_t / (sqrt(v_t) + tau)

with ``m_{-1} = 0`` and ``v_{-1} = tau^2`` (the paper's ``v_{-1} >= tau^2``), and no bias
correction. ``tau`` controls the adaptivity (the paper tunes it in {1e-3, ..., 1e-1}). Any
``torch.optim`` optimizer can be the server optimizer (``FederatedModule(server_optimizer=...)``);
these are torch optimizers too, so they are checkpointed and resumed like any other.

``convention="flower"`` reproduces Flower's strategies of the same names instead
(``flwr.server.strategy`` and ``flwr.serverapp.strategy``): the deltas weighted by sample count
(the module's default aggregation with this convention), ``v_{-1} = 0``; FedAdam's step is
bias-corrected, ``eta_t = eta sqrt(1 - beta2^(t+1)) / (1 - beta1^(t+1))`` in round ``t = 1, 2, ...``
(Flower's exponent is ``server_round + 1``); FedAdagrad has no momentum (``beta1 = 0``, so
``m_t = Delta_t``).
"""

from __future__ import annotations

import math
from typing import Any, Callable, Iterable, Literal, Optional, get_args

import torch
from torch import Tensor

from fl_lightning.validation import check_number

#: whose formulas: ``"reddi"`` (Algorithm 2 of Reddi et al.) or ``"flower"`` (Flower's strategies)
Convention = Literal["reddi", "flower"]
CONVENTIONS: tuple[str, ...] = get_args(Convention)


class _FedAdaptive(torch.optim.Optimizer):
    """The shared step of FedAdagrad, FedAdam and FedYogi (``_second_moment`` differs)."""

    @property
    def paper_weighting(self) -> str:
        """The default aggregation of a module with this server optimizer (``FederatedModule.weighting``):
        ``"uniform"`` under Reddi et al.'s convention (Algorithm 2, ``Delta_t = (1/|S|) sum_i Delta_i``),
        ``"num_samples"`` under Flower's (its strategies weigh each delta by the client's example count)."""
        return "num_samples" if self.defaults["convention"] == "flower" else "uniform"

    def __init__(self, params: Iterable[Tensor], lr: float, betas: tuple[float, float], tau: float,
                 convention: Convention) -> None:
        check_number("lr", lr, 0.0, low_open=True)
        check_number("betas[0]", betas[0], 0.0, 1.0)
        check_number("betas[1]", betas[1], 0.0, 1.0)
        check_number("tau", tau, 0.0, low_open=True)
        if convention not in CONVENTIONS:
            raise ValueError(f"convention must be one of {CONVENTIONS}, got {convention!r}")
        super().__init__(params, {"lr": lr, "betas": tuple(betas), "tau": tau, "convention": convention})

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        for group in self.param_groups:  # a state written before conventions existed is Reddi's
            group.setdefault("convention", "reddi")

    @staticmethod
    def _second_moment(v: Tensor, square: Tensor, beta2: float) -> Tensor:
        raise NotImplementedError

    @staticmethod
    def _step_size(lr: float, beta1: float, beta2: float, step: int, convention: Convention) -> float:
        """The step size ``eta_t`` of the ``step``-th round (from 1): ``eta`` (FedAdam's Flower convention differs)."""
        return lr

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
                    state["v"] = torch.full_like(p, group["tau"] ** 2 if group["convention"] == "reddi" else 0.0)
                state["step"] = state.get("step", 0) + 1
                state["m"].mul_(beta1).add_(delta, alpha=1 - beta1)
                state["v"] = self._second_moment(state["v"], delta * delta, beta2)
                eta = self._step_size(group["lr"], beta1, beta2, state["step"], group["convention"])
                p.add_(eta * state["m"] / (state["v"].sqrt() + group["tau"]))
        return loss


class FedAdagrad(_FedAdaptive):
    """FedAdagrad: ``v_t = v_{t-1} + Delta_t^2`` (``betas[1]`` unused).

    Args:
        params: the global model's parameters.
        lr: the server learning rate ``eta``.
        betas: ``(beta1, beta2)``; None: ``(0.9, 0.99)`` (Algorithm 2's momentum), or ``(0.0, 0.0)``
            with ``convention="flower"``, whose FedAdagrad has no momentum (a ``beta1 > 0`` is refused there).
        tau: the adaptivity ``tau`` (> 0).
        convention: ``"reddi"`` (``v_{-1} = tau^2``) or ``"flower"`` (``v_{-1} = 0``, ``beta1 = 0``).
    """

    def __init__(self, params: Iterable[Tensor], lr: float = 0.1, betas: Optional[tuple[float, float]] = None,
                 tau: float = 1e-3, convention: Convention = "reddi") -> None:
        if betas is None:
            betas = (0.0, 0.0) if convention == "flower" else (0.9, 0.99)
        elif convention == "flower" and betas[0] != 0:
            raise ValueError(f"betas[0] must be 0 with convention='flower' (Flower's FedAdagrad has no momentum), "
                             f"got betas={betas!r}; leave betas unset or use convention='reddi'")
        super().__init__(params, lr, betas, tau, convention)

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
        convention: ``"reddi"`` (``v_{-1} = tau^2``, step ``eta``) or ``"flower"`` (``v_{-1} = 0``,
            step ``eta sqrt(1 - beta2^(t+1)) / (1 - beta1^(t+1))`` in round ``t = 1, 2, ...``).
    """

    def __init__(self, params: Iterable[Tensor], lr: float = 0.01, betas: tuple[float, float] = (0.9, 0.99),
                 tau: float = 1e-3, convention: Convention = "reddi") -> None:
        super().__init__(params, lr, betas, tau, convention)

    @staticmethod
    def _second_moment(v: Tensor, square: Tensor, beta2: float) -> Tensor:
        return beta2 * v + (1 - beta2) * square

    @staticmethod
    def _step_size(lr: float, beta1: float, beta2: float, step: int, convention: Convention) -> float:
        """``eta``, or Flower's bias-corrected ``eta sqrt(1 - beta2^(t+1)) / (1 - beta1^(t+1))``."""
        if convention == "reddi":
            return lr
        return lr * math.sqrt(1 - beta2 ** (step + 1)) / (1 - beta1 ** (step + 1))


class FedYogi(_FedAdaptive):
    """FedYogi: ``v_t = v_{t-1} - (1 - beta2) Delta_t^2 sign(v_{t-1} - Delta_t^2)``.

    Args:
        params: the global model's parameters.
        lr: the server learning rate ``eta``.
        betas: ``(beta1, beta2)``.
        tau: the adaptivity ``tau`` (> 0).
        convention: ``"reddi"`` (``v_{-1} = tau^2``) or ``"flower"`` (``v_{-1} = 0``).
    """

    def __init__(self, params: Iterable[Tensor], lr: float = 0.01, betas: tuple[float, float] = (0.9, 0.99),
                 tau: float = 1e-3, convention: Convention = "reddi") -> None:
        super().__init__(params, lr, betas, tau, convention)

    @staticmethod
    def _second_moment(v: Tensor, square: Tensor, beta2: float) -> Tensor:
        return v - (1 - beta2) * square * torch.sign(v - square)


def check_server_optimizer(server_optimizer: Any, parameters: Any) -> Optional[str]:
    """Refuse a ``server_optimizer`` that is not a callable making a torch optimizer of ``parameters``
    (the global model's), or that fails to (a bad learning rate...), naming the argument; returns the
    ``paper_weighting`` its optimizer declares (Reddi et al.'s: ``"uniform"``), if any."""
    if server_optimizer is None:
        return None
    if not callable(server_optimizer):
        raise ValueError("server_optimizer must be None or a callable that makes a torch.optim optimizer of the "
                         f"global model's parameters (YAML: class_path + init_args), got {server_optimizer!r}")
    try:
        made = server_optimizer(parameters)
    except (TypeError, ValueError) as error:
        raise ValueError(f"server_optimizer={server_optimizer!r} cannot make an optimizer of the global model: "
                         f"{error}") from error
    if not isinstance(made, torch.optim.Optimizer):
        raise ValueError(f"server_optimizer must make a torch.optim.Optimizer, got {type(made).__name__} from "
                         f"{server_optimizer!r}")
    return getattr(made, "paper_weighting", None)
