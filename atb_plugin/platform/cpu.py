"""CPU: plain torch kernels, gloo for torch.distributed. Always available; ``dtype="auto"`` is
float32 unless this CPU measured bfloat16 faster (``measured_dtype``), the default KV block size
16, and any block size >= 1 runs."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from atb_plugin.platform.base import Platform


@dataclass(frozen=True)
class CpuPlatform(Platform):
    name: str = "cpu"
    device_type: str = "cpu"
    dist_backend: str = "gloo"
    visible_devices_env: str | None = None
    kernels_module: str = "atb_plugin.ops.torch_kernels"
    captures_decode_step: bool = True  # with the native kernels: models/native_decode.py

    def is_available(self) -> bool:
        return True

    def check_environment(self) -> None:
        from atb_plugin.ops import cpu_native, huge_pages  # load nothing until asked

        cpu_native.choice()  # an unknown ATB_PLUGIN_CPU_KERNELS fails the config, not the first step
        huge_pages.choice()  # so does an unknown ATB_PLUGIN_HUGE_PAGES, not the model's load

    def measured_dtype(self, dtype: str, layers: list[tuple[int, int]], checkpoint_dtype: str | None,
                       threads: int) -> tuple[str, str]:
        from atb_plugin.ops import calibration  # load nothing until asked

        return calibration.auto_dtype(layers, checkpoint_dtype, threads)

    def prepare_model(self, model) -> None:
        # After the load packed the weights (the panels are what the kernels read: models/linear.py),
        # before the captured decode step records any weight's address.
        from atb_plugin.ops.huge_pages import move_weights_to_huge_pages

        move_weights_to_huge_pages(model)
        # Build (or load from the cache) the native kernels now, before the memory profile, rather
        # than inside the first request's step; with ATB_PLUGIN_CPU_KERNELS=native a missing
        # compiler fails start-up here.
        from atb_plugin.ops import cpu_native

        dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)
        cpu_native.library_for(dtype, torch.device("cpu"))
