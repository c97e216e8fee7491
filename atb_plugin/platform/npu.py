"""Ascend NPU: ATB-backed torch_npu kernels, hccl for torch.distributed.

The only module that imports ``torch_npu`` (lazily: it cannot even import without CANN).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from types import ModuleType

from atb_plugin.platform.base import Platform


def torch_npu() -> ModuleType:
    """The ``torch_npu`` module (raises ImportError where CANN / torch_npu are missing)."""
    return importlib.import_module("torch_npu")


@dataclass(frozen=True)
class NpuPlatform(Platform):
    name: str = "npu"
    device_type: str = "npu"
    dist_backend: str = "hccl"
    visible_devices_env: str | None = "ASCEND_RT_VISIBLE_DEVICES"
    kernels_module: str = "atb_plugin.ops.npu_kernels"

    def is_available(self) -> bool:
        try:
            module = torch_npu()
        except Exception:  # noqa: BLE001 - any failure to load CANN means "no NPU here"
            return False
        return bool(module.npu.is_available())
