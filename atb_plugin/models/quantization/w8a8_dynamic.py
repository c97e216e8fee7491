"""W8A8_DYNAMIC: int8 weights (symmetric: ``weight_offset`` zero), activations quantized per
token at run time (``ops.w8a8_dynamic_linear``; docs/quantization.md)."""

from __future__ import annotations

import torch

from atb_plugin import ops
from atb_plugin.models.linear import register_linear_method
from atb_plugin.models.quantization.config import W8A8_DYNAMIC
from atb_plugin.models.quantization.layers import QuantLinear, QuantLinearMethod
from atb_plugin.ops import cpu_native


class W8A8DynamicLinear(QuantLinear):
    scheme = W8A8_DYNAMIC


@register_linear_method
class W8A8DynamicLinearMethod(QuantLinearMethod):
    name = W8A8_DYNAMIC
    layer_cls = W8A8DynamicLinear
    native_format = cpu_native.LINEAR_W8A8_DYNAMIC

    def apply(self, layer, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return ops.w8a8_dynamic_linear(x, layer.weight, layer.weight_scale.view(-1), bias)
