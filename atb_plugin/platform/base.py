"""``Platform``: which device, distributed backend and op kernels a process uses, and which engine
configurations (dtype, KV block size) its kernels can run."""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from types import ModuleType

import torch

DTYPES = ("float32", "float16", "bfloat16")


@dataclass(frozen=True)
class Platform:
    """Contract: ``name`` in {npu, cuda, cpu}; ``device(i)`` the torch device tensors go to;
    ``dist_backend`` for ``torch.distributed``; ``visible_devices_env`` the variable that selects
    cards; ``kernels`` the module implementing every op in ``atb_plugin.ops`` (named by
    ``kernels_module_name()``).

    Start-up checks (``EngineConfig`` calls ``check_engine_config`` once, so an illegal setting
    fails before any model is loaded, never at the first forward): ``resolve_dtype("auto")`` is
    the platform's dtype, ``default_block_size(head_size)`` its KV block size."""

    name: str
    device_type: str
    dist_backend: str
    visible_devices_env: str | None
    kernels_module: str

    @property
    def kernels(self) -> ModuleType:
        # Read on every op call: keep the module, re-import only when the chosen name changes
        # (the NPU's kernel set can be switched by ATB_PLUGIN_NPU_KERNELS, e.g. between tests).
        name = self.kernels_module_name()
        module = self.__dict__.get("_kernels")
        if module is None or module.__name__ != name:
            module = importlib.import_module(name)
            object.__setattr__(self, "_kernels", module)  # a cache, not state: frozen otherwise
        return module

    def kernels_module_name(self) -> str:
        return self.kernels_module

    def device(self, index: int = 0) -> torch.device:
        return torch.device(self.device_type, index) if self.device_type != "cpu" else torch.device("cpu")

    def is_available(self) -> bool:
        raise NotImplementedError

    # --- engine configuration ------------------------------------------------------------------

    def default_dtype(self) -> str:
        return "float32"

    def resolve_dtype(self, dtype: str) -> str:
        """``"auto"`` -> ``default_dtype()``; an explicit dtype is checked and returned."""
        if dtype == "auto":
            return self.default_dtype()
        if dtype not in DTYPES:
            raise ValueError(f"EngineConfig.dtype = {dtype!r}: expected auto or one of {', '.join(DTYPES)}")
        self.check_dtype(dtype)
        return dtype

    def check_dtype(self, dtype: str) -> None:
        """Raise ValueError when this platform's kernels cannot run ``dtype``."""

    def default_block_size(self, head_size: int | None = None) -> int:
        return 16

    def check_block_size(self, block_size: int, head_size: int | None = None) -> None:
        """Raise ValueError (naming field, value and valid range) when the kernels refuse it."""

    def check_environment(self) -> None:
        """Raise RuntimeError when the runtime cannot serve at all (libraries missing, unsupported chip)."""

    def check_engine_config(self, dtype: str, block_size: int | None,
                            head_size: int | None = None) -> tuple[str, int]:
        """Check the environment, resolve ``dtype`` (``"auto"``) and ``block_size`` (``None``)
        and check both against this platform's op rules; returns ``(dtype, block_size)``."""
        self.check_environment()
        dtype = self.resolve_dtype(dtype)
        if block_size is None:
            block_size = self.default_block_size(head_size)
        self.check_block_size(block_size, head_size)
        return dtype, block_size
