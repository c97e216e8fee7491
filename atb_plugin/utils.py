"""Small helpers shared across the package (no torch / numpy import: anything may use them)."""

from __future__ import annotations

import json
import os
import sys

__all__ = ["available_cores", "cdiv", "json_object", "keep_request_buffers_in_heap", "limit_compute_threads"]

# glibc's mallopt parameters (malloc.h) and the values keep_request_buffers_in_heap sets.
_M_TRIM_THRESHOLD, _M_TOP_PAD, _M_MMAP_THRESHOLD = -1, -2, -3
_MMAP_THRESHOLD_BYTES = 32 << 20  # glibc's ceiling for this parameter on 64-bit
_TRIM_THRESHOLD_BYTES = 64 << 20
_TOP_PAD_BYTES = 16 << 20


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


def keep_request_buffers_in_heap() -> bool:
    """Let this process reuse the memory of its multi-megabyte request buffers instead of mapping
    fresh pages for each one. For the processes a request body passes through (the API process,
    the tokenizer workers); True when glibc took the settings, False where there is no glibc.

    Why: an image chat resends its data URL every turn, megabytes of base64 that are read,
    parsed and re-encoded several times per request. By default glibc serves blocks that large
    with ``mmap`` and returns them to the OS on ``free``, so every copy faults in and zeroes new
    pages: thousands of page faults per resent 1280x720 PNG in the API process, a visible share
    of a turn's time. With blocks up to 32 MiB taken from the heap, and up to 64 MiB of free heap
    kept before trimming, those faults are gone (benchmarks/RESULTS.md, bench_multiturn_image,
    P5's fifth round). The cost is bounded: at most ~80 MiB of freed memory stays mapped per
    process, the same amount whatever the load."""
    import ctypes

    try:
        mallopt = ctypes.CDLL("libc.so.6").mallopt
    except (OSError, AttributeError):
        return False
    return all(mallopt(parameter, value) == 1 for parameter, value in (
        (_M_MMAP_THRESHOLD, _MMAP_THRESHOLD_BYTES), (_M_TRIM_THRESHOLD, _TRIM_THRESHOLD_BYTES),
        (_M_TOP_PAD, _TOP_PAD_BYTES)))


def trim_heap() -> bool:
    """Hand the free pages of glibc's heap back to the OS (``malloc_trim(0)``), after a request
    large enough to leave many of them behind; False where there is no glibc."""
    import ctypes

    try:
        return bool(ctypes.CDLL("libc.so.6").malloc_trim(0))
    except (OSError, AttributeError):
        return False


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


def json_object(text: str) -> dict:
    """``text`` parsed, or ValueError saying it "is not JSON (...)" or "must be a JSON object, got ..."
    (callers prefix what it was)."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as error:
        raise ValueError(f"is not JSON ({error})") from None
    if not isinstance(value, dict):
        raise ValueError(f"must be a JSON object, got {type(value).__name__} {text[:80]!r}")
    return value
