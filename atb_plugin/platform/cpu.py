"""CPU: plain torch kernels, gloo for torch.distributed. Always available; ``dtype="auto"`` is
float32, the default KV block size 16, and any block size >= 1 runs."""

from __future__ import annotations

from dataclasses import dataclass

from atb_plugin.platform.base import Platform


@dataclass(frozen=True)
class CpuPlatform(Platform):
    name: str = "cpu"
    device_type: str = "cpu"
    dist_backend: str = "gloo"
    visible_devices_env: str | None = None
    kernels_module: str = "atb_plugin.ops.torch_kernels"

    def is_available(self) -> bool:
        return True

    def prepare_model(self, model, *, pack_weights: bool) -> None:
        if pack_weights:
            from atb_plugin.ops.packed_linear import pack_linear_layers  # torch ops: load on use

            pack_linear_layers(model)
