"""RMSNorm (Qwen2, Llama, Qwen-VL's LM): ``weight * x / sqrt(mean(x²) + eps)``, computed in fp32."""

from __future__ import annotations

import torch

from atb_plugin.platform import current_platform


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return current_platform().kernels.rms_norm(x, weight, eps)
