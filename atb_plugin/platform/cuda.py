"""CUDA: the same plain torch kernels as CPU (SDPA), nccl for torch.distributed."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from atb_plugin.platform.base import Platform


@dataclass(frozen=True)
class CudaPlatform(Platform):
    name: str = "cuda"
    device_type: str = "cuda"
    dist_backend: str = "nccl"
    visible_devices_env: str | None = "CUDA_VISIBLE_DEVICES"
    kernels_module: str = "atb_plugin.ops.torch_kernels"

    def is_available(self) -> bool:
        return torch.cuda.is_available()
