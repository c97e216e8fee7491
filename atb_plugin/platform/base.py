"""``Platform``: which device, distributed backend and op kernels a process uses."""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from functools import cached_property
from types import ModuleType

import torch


@dataclass(frozen=True)
class Platform:
    """Contract: ``name`` in {npu, cuda, cpu}; ``device(i)`` the torch device tensors go to;
    ``dist_backend`` for ``torch.distributed``; ``visible_devices_env`` the variable that selects
    cards; ``kernels`` the module implementing every op in ``atb_plugin.ops``."""

    name: str
    device_type: str
    dist_backend: str
    visible_devices_env: str | None
    kernels_module: str

    @cached_property
    def kernels(self) -> ModuleType:
        return importlib.import_module(self.kernels_module)

    def device(self, index: int = 0) -> torch.device:
        return torch.device(self.device_type, index) if self.device_type != "cpu" else torch.device("cpu")

    def is_available(self) -> bool:
        raise NotImplementedError
