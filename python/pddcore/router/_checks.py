"""Argument checks shared by the router and its estimators: a clear ValueError naming
the argument, e.g. ``check_nonneg("wan_rtt_s", -1.0)`` raises
``ValueError: wan_rtt_s must be a finite number >= 0, got -1.0``."""

from __future__ import annotations

import math
from typing import Any


def check_nonneg(name: str, value: Any, *, integer: bool = False, optional: bool = False) -> None:
    if value is None and optional:
        return
    if integer:
        ok = type(value) is int and value >= 0
    else:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool) and value >= 0 and not math.isinf(value)
    if not ok:
        kind = "an integer" if integer else "a finite number"
        raise ValueError(f"{name} must be {kind} >= 0{' or None' if optional else ''}, got {value!r}")


def check_positive(name: str, value: Any) -> float:
    """``value`` as a float when it is a finite number > 0, else ValueError naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0 or math.isinf(value):
        raise ValueError(f"{name} must be a finite number > 0, got {value!r}")
    return float(value)
