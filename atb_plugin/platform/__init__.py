"""Platforms: ``current_platform()`` picks NPU when torch_npu imports and reports a device, else
CUDA, else CPU; ``ATB_PLUGIN_DEVICE=npu|cuda|cpu`` forces one (an unavailable one is an error).

The choice is made once per process and cached; ``use_platform(name)`` switches it for a block
(tests run the NPU path beside the CPU path) and ``reset_current_platform()`` forgets it so the
next ``current_platform()`` detects again (after ``ATB_PLUGIN_DEVICE`` or torch_npu changed).

Each platform also says which engine configurations its kernels run (``Platform.check_engine_config``:
the dtype ``"auto"`` stands for, the default KV block size, the op rules); ``EngineConfig`` asks the
platform its ``device`` names (``platform_for``) once, at construction.
"""

from __future__ import annotations

import contextlib
import os
import threading

import torch

from atb_plugin.platform import npu as _npu
from atb_plugin.platform.base import Platform
from atb_plugin.platform.cpu import CpuPlatform
from atb_plugin.platform.cuda import CudaPlatform
from atb_plugin.platform.npu import NpuPlatform

PLATFORMS: dict[str, Platform] = {"npu": NpuPlatform(), "cuda": CudaPlatform(), "cpu": CpuPlatform()}
DEVICE_ENV = "ATB_PLUGIN_DEVICE"
_current: Platform | None = None
_lock = threading.Lock()


def _detect() -> Platform:
    forced = os.environ.get(DEVICE_ENV, "").strip().lower()
    if forced:
        return _require(forced)
    return next(p for p in PLATFORMS.values() if p.is_available())


def _unavailable_reason(name: str) -> str:
    if name == "npu":
        return _npu.unavailable_reason() or "unknown reason"
    if name == "cuda":
        return f"torch.cuda.is_available() is False (torch {torch.__version__}, CUDA build: {torch.version.cuda})"
    return "unknown reason"


def _require(name: str) -> Platform:
    platform = PLATFORMS.get(name)
    if platform is None:
        raise ValueError(f"{DEVICE_ENV}={name!r}: expected one of {', '.join(PLATFORMS)}")
    if not platform.is_available():
        raise RuntimeError(f"platform {name!r} was asked for ({DEVICE_ENV} or use_platform) but is not "
                           f"available on this machine: {_unavailable_reason(name)}")
    return platform


def platform_for(device: str) -> Platform:
    """The platform an ``EngineConfig.device`` names: ``"auto"`` is ``current_platform()``; a named
    one must be available here (RuntimeError naming why not)."""
    return current_platform() if device == "auto" else _require(device)


def current_platform() -> Platform:
    global _current
    if _current is None:
        with _lock:
            if _current is None:
                _current = _detect()
    return _current


def reset_current_platform() -> None:
    """Forget the cached choice; the next ``current_platform()`` detects again."""
    global _current
    with _lock:
        _current = None


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


__all__ = ["DEVICE_ENV", "PLATFORMS", "Platform", "current_platform", "platform_for", "reset_current_platform",
           "use_platform"]
