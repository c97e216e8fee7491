"""Ascend NPU: ATB-backed torch_npu kernels, hccl for torch.distributed.

The only module that imports ``torch_npu`` (lazily: it cannot even import without CANN). Others,
``atb_plugin.ops.npu_kernels`` included, reach it through ``torch_npu()``.

A simulated NPU (``atb_plugin.testing.fake_torch_npu``) carries ``FAKE_DEVICE = "cpu"``: it has no
device memory, so ``device()`` returns that device instead of ``npu:i``. A real torch_npu has no
such attribute.
"""

from __future__ import annotations

import importlib
import sys
from dataclasses import dataclass
from types import ModuleType

import torch

from atb_plugin.platform.base import Platform


def torch_npu() -> ModuleType:
    """The ``torch_npu`` module (raises ImportError where CANN / torch_npu are missing)."""
    module = sys.modules.get("torch_npu")
    return module if module is not None else importlib.import_module("torch_npu")


def unavailable_reason() -> str | None:
    """Why no NPU can be used here, or None when one can."""
    try:
        module = torch_npu()
    except Exception as exc:  # noqa: BLE001 - any failure to load CANN means "no NPU here"
        return f"torch_npu does not import ({type(exc).__name__}: {exc})"
    try:
        if not module.npu.is_available():
            return "torch_npu imports but torch_npu.npu.is_available() is False"
        if module.npu.device_count() < 1:
            return "torch_npu imports but reports no device"
    except Exception as exc:  # noqa: BLE001 - a broken runtime is no NPU either
        return f"torch_npu's runtime query failed ({type(exc).__name__}: {exc})"
    return None


@dataclass(frozen=True)
class NpuPlatform(Platform):
    name: str = "npu"
    device_type: str = "npu"
    dist_backend: str = "hccl"
    visible_devices_env: str | None = "ASCEND_RT_VISIBLE_DEVICES"
    kernels_module: str = "atb_plugin.ops.npu_kernels"

    def is_available(self) -> bool:
        return unavailable_reason() is None

    def is_simulated(self) -> bool:
        """True when the loaded torch_npu is the CPU simulation (``FAKE_DEVICE`` set)."""
        return getattr(sys.modules.get("torch_npu"), "FAKE_DEVICE", None) is not None

    def device(self, index: int = 0) -> torch.device:
        fake_device = getattr(torch_npu(), "FAKE_DEVICE", None)
        if fake_device is not None:
            return torch.device(fake_device)
        return torch.device(self.device_type, index)
