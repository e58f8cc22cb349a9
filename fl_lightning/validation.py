"""Argument checks that name the parameter, the value and what is allowed."""

from __future__ import annotations

import math
import numbers
from typing import Any, Optional, Sequence


def check_int(name: str, value: Any, minimum: int, maximum: Optional[int] = None) -> int:
    """``value`` as an int; a ValueError unless it is an integer (not a bool) in ``[minimum, maximum]``."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < minimum or (
        maximum is not None and value > maximum
    ):
        bound = f">= {minimum}" if maximum is None else f"in [{minimum}, {maximum}]"
        raise ValueError(f"{name} must be {bound} and an integer, got {value!r}")
    return int(value)


def check_number(name: str, value: Any, low: float, high: float = math.inf, low_open: bool = False,
                 high_open: bool = True) -> float:
    """``value`` as a float; a ValueError unless it is a finite number in the interval given
    (``low=-math.inf`` and the default ``high``: any finite number)."""
    inside = isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value) and (
        (value > low if low_open else value >= low) and (value < high if high_open else value <= high)
    )
    if not inside:
        if math.isinf(high):
            allowed = "finite" if math.isinf(low) else f"{'>' if low_open else '>='} {low:g} and finite"
        else:
            allowed = f"in {'(' if low_open else '['}{low:g}, {high:g}{')' if high_open else ']'}"
        raise ValueError(f"{name} must be {allowed}, got {value!r}")
    return float(value)


def check_federation_arguments(
    clients_per_round: Optional[int], clients_fraction: Optional[float], min_clients: int, local_steps: Optional[int],
    local_epochs: Optional[int], default_local_steps: int, min_local_steps: int, server_lr: float, server_momentum: float,
    nonfinite_updates: str, seed: int, client_backend: str, backends: Sequence[str], clients_per_block: Optional[int],
    compile_step: bool, client_state_memory: int, client_state_checkpoints: Optional[int], weighting: Optional[str],
) -> tuple[Optional[int], Optional[int]]:
    """Check ``FederatedModule``'s arguments (see its docstring); returns ``clients_per_round`` (10
    unless ``clients_fraction`` is given) and ``local_steps`` (``default_local_steps`` unless
    ``local_epochs`` is given) with their defaults resolved; ``local_steps`` may be as low as
    ``min_local_steps``."""
    if local_steps is None and local_epochs is None:
        local_steps = default_local_steps
    if clients_per_round is not None and clients_fraction is not None:
        raise ValueError(f"give at most one of clients_per_round and clients_fraction, got clients_per_round="
                         f"{clients_per_round}, clients_fraction={clients_fraction}")
    if clients_fraction is not None:
        check_number("clients_fraction", clients_fraction, 0.0, 1.0, low_open=True, high_open=False)
    elif clients_per_round is None:
        clients_per_round = 10
    if clients_per_round is not None:
        check_int("clients_per_round", clients_per_round, 1)
    check_int("min_clients", min_clients, 1)
    if local_steps is not None and local_epochs is not None:
        raise ValueError(
            f"give exactly one of local_steps and local_epochs, got local_steps={local_steps}, "
            f"local_epochs={local_epochs}"
        )
    if local_steps is not None:
        check_int("local_steps", local_steps, min_local_steps)
    if local_epochs is not None:
        check_int("local_epochs", local_epochs, 1)
    check_number("server_lr", server_lr, 0.0, low_open=True)
    check_number("server_momentum", server_momentum, 0.0, 1.0)
    if nonfinite_updates not in ("skip", "raise"):
        raise ValueError(f"nonfinite_updates must be 'skip' or 'raise', got {nonfinite_updates!r}")
    check_int("seed", seed, 0)
    if client_backend not in backends:
        raise ValueError(f"client_backend must be {' or '.join(map(repr, backends))}, got {client_backend!r}")
    if clients_per_block is not None:
        check_int("clients_per_block", clients_per_block, 1)
    if not isinstance(compile_step, bool):
        raise ValueError(f"compile_step must be True or False, got {compile_step!r}")
    if compile_step and client_backend != "batched":
        raise ValueError(f"compile_step=True compiles the batched backend's vectorized step; client_backend is "
                         f"{client_backend!r}: use client_backend='batched' or compile_step=False")
    check_int("client_state_memory", client_state_memory, 0)
    if client_state_checkpoints is not None:
        check_int("client_state_checkpoints", client_state_checkpoints, 1)
    if weighting not in (None, "num_samples", "uniform"):
        raise ValueError(f"weighting must be 'num_samples', 'uniform' or None (the paper's), got {weighting!r}")
    return clients_per_round, local_steps
