"""Small helpers shared across the package (no torch / numpy import: anything may use them)."""

from __future__ import annotations

__all__ = ["cdiv"]


def cdiv(a, b):
    """Ceiling division ``ceil(a / b)`` for ``b > 0``: exact for ints of any size (unlike
    ``math.ceil(a / b)``, which goes through a float), and elementwise for numpy arrays and
    torch tensors (whatever supports floor division ``//`` and negation)."""
    return -(-a // b)
