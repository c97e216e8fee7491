"""Platforms: ``current_platform()`` picks NPU when torch_npu imports and reports a device, else
CUDA, else CPU; ``ATB_PLUGIN_DEVICE=npu|cuda|cpu`` forces one (an unavailable one is an error)."""

from __future__ import annotations

import contextlib
import os
import threading

from atb_plugin.platform.base import Platform
from atb_plugin.platform.cpu import CpuPlatform
from atb_plugin.platform.cuda import CudaPlatform
from atb_plugin.platform.npu import NpuPlatform

PLATFORMS: dict[str, Platform] = {"npu": NpuPlatform(), "cuda": CudaPlatform(), "cpu": CpuPlatform()}
_current: Platform | None = None
_lock = threading.Lock()


def _detect() -> Platform:
    forced = os.environ.get("ATB_PLUGIN_DEVICE", "").strip().lower()
    if forced:
        return _require(forced)
    return next(p for p in PLATFORMS.values() if p.is_available())


def _require(name: str) -> Platform:
    platform = PLATFORMS.get(name)
    if platform is None:
        raise ValueError(f"ATB_PLUGIN_DEVICE={name!r}: expected one of {', '.join(PLATFORMS)}")
    if not platform.is_available():
        raise RuntimeError(f"platform {name!r} was asked for but is not available on this machine")
    return platform


def current_platform() -> Platform:
    global _current
    if _current is None:
        with _lock:
            if _current is None:
                _current = _detect()
    return _current


@contextlib.contextmanager
def use_platform(name: str):
    """Run a block on another platform (tests compare the NPU path with the CPU path)."""
    global _current
    previous = _current
    _current = _require(name)
    try:
        yield _current
    finally:
        _current = previous


__all__ = ["PLATFORMS", "Platform", "current_platform", "use_platform"]
