"""Field checks shared by the request parameter types (``SamplingParams``, ``PoolingParams``).

Each returns the value normalised or raises ``ValueError`` (never ``TypeError``: the HTTP server
answers any ``ValueError`` with 400) whose message starts with the field's ``name`` and gives the
value, its type and what is accepted. Ints must be ints (``bool`` and ``2.0`` are refused; numpy
integers are taken as ints), floats take ints or floats but must be finite, flags must be
``bool``. No torch, nothing heavy: the API process imports these.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence

__all__ = ["check_bool", "check_float", "check_int", "check_list", "describe"]


def describe(value) -> str:
    """``value`` as error messages show it: its repr and its type."""
    return f"{value!r} ({type(value).__name__})"


def check_int(name: str, value, accepted: str) -> int:
    """``value`` as an int, or ValueError naming ``name``; ``accepted`` describes the valid range."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ValueError(f"{name} must be an int {accepted}, got {describe(value)}")
    return int(value)


def check_float(name: str, value, accepted: str) -> float:
    """``value`` (an int or a float) as a finite float, or ValueError naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValueError(f"{name} must be a number {accepted}, got {describe(value)}")
    number = float(value)
    if not math.isfinite(number):
        raise ValueError(f"{name} must be a finite number {accepted}, got {value!r}")
    return number


def check_bool(name: str, value) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be a bool, got {describe(value)}")
    return value


def check_list(name: str, value, accepted: str) -> list:
    """A list or tuple (not a string, not a set: order and repeats are the caller's) as a new list."""
    if not isinstance(value, Sequence) or isinstance(value, (str, bytes)):
        raise ValueError(f"{name} must be a list {accepted}, got {describe(value)}")
    return list(value)
