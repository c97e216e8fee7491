"""W8A16: int8 weights, activations in the model's dtype: ``y = x ((W + offset) * scale)^T + b``
(``ops.w8a16_linear``; docs/quantization.md). Its layer holds the common tensors only."""

from __future__ import annotations

import torch

from atb_plugin import ops
from atb_plugin.models.linear import register_linear_method
from atb_plugin.models.quantization.config import W8A16
from atb_plugin.models.quantization.layers import QuantLinear, QuantLinearMethod
from atb_plugin.ops import cpu_native


@register_linear_method
class W8A16LinearMethod(QuantLinearMethod):
    name = W8A16
    native_format = cpu_native.LINEAR_W8A16

    def apply(self, layer, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return ops.w8a16_linear(x, layer.weight, layer.weight_scale.view(-1), layer.weight_offset.view(-1), bias)

    def native_offset(self, layer: QuantLinear) -> torch.Tensor:
        return layer.weight_offset  # the kernel adds it to the weight, as the op does
