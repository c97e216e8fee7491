"""SiLU-and-mul (SwiGLU): ``silu(x[..., :d]) * x[..., d:]`` for ``x`` of width ``2d``."""

from __future__ import annotations

import torch

from atb_plugin.platform import current_platform


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    return current_platform().kernels.silu_and_mul(x)
