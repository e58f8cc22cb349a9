"""Argument checks that name the parameter, the value and what is allowed."""

from __future__ import annotations

import math
import numbers
from typing import Any, Optional


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
    """``value`` as a float; a ValueError unless it is a finite number in the interval given."""
    inside = isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value) and (
        (value > low if low_open else value >= low) and (value < high if high_open else value <= high)
    )
    if not inside:
        if math.isinf(high):
            allowed = f"{'>' if low_open else '>='} {low:g} and finite"
        else:
            allowed = f"in {'(' if low_open else '['}{low:g}, {high:g}{')' if high_open else ']'}"
        raise ValueError(f"{name} must be {allowed}, got {value!r}")
    return float(value)
