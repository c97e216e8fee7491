"""CUDA: the same plain torch kernels as CPU (SDPA), nccl for torch.distributed; ``dtype="auto"``
is bfloat16 where the GPU has it, else float16."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from atb_plugin.platform.base import DeviceGraphs, Platform


@dataclass(frozen=True)
class CudaPlatform(Platform):
    name: str = "cuda"
    device_type: str = "cuda"
    dist_backend: str = "nccl"
    visible_devices_env: str | None = "CUDA_VISIBLE_DEVICES"
    kernels_module: str = "atb_plugin.ops.torch_kernels"

    def is_available(self) -> bool:
        return torch.cuda.is_available()

    def device_graphs(self) -> DeviceGraphs:
        return DeviceGraphs(torch.cuda, "CUDAGraph")

    def default_dtype(self) -> str:
        return "bfloat16" if torch.cuda.is_bf16_supported() else "float16"

    def device_count(self) -> int:
        return torch.cuda.device_count()

    def bind_device(self, index: int) -> None:
        torch.cuda.set_device(index)

    # --- memory: torch's caching allocator on the current device --------------------------------

    def total_memory(self) -> int:
        return torch.cuda.mem_get_info()[1]

    def reset_peak_memory(self) -> None:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()

    def memory_in_use(self) -> int:
        torch.cuda.synchronize()
        return torch.cuda.memory_allocated()

    def peak_memory(self) -> int:
        torch.cuda.synchronize()  # kernels still queued have not allocated yet
        return torch.cuda.max_memory_allocated()
