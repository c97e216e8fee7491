"""Small helpers shared across the package (no torch / numpy import: anything may use them)."""

from __future__ import annotations

import os
import sys

__all__ = ["available_cores", "cdiv", "limit_compute_threads"]


def available_cores() -> int:
    """CPU cores this process may run on (its affinity mask: a container's or taskset's cpuset)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def limit_compute_threads(count: int) -> None:
    """This process's compute thread pools: torch's intra-op threads now if torch is loaded, and
    through the environment the OpenMP / BLAS pools of whatever loads later (numpy's BLAS reads
    it at import). For the frontend processes (tokenizer workers), which must leave the cores to
    the engine (docs/architecture.md, "Threads")."""
    for variable in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
        os.environ[variable] = str(count)
    torch = sys.modules.get("torch")
    if torch is not None:
        torch.set_num_threads(count)


def cdiv(a, b):
    """Ceiling division ``ceil(a / b)`` for ``b > 0``: exact for ints of any size (unlike
    ``math.ceil(a / b)``, which goes through a float), and elementwise for numpy arrays and
    torch tensors (whatever supports floor division ``//`` and negation)."""
    return -(-a // b)


def lookup(registry: dict, name: str, what: str):
    """``registry[name]``, or ValueError naming ``what`` was asked for and the known names."""
    try:
        return registry[name]
    except KeyError:
        raise ValueError(f"unknown {what} {name!r}; known: {', '.join(sorted(registry))}") from None
