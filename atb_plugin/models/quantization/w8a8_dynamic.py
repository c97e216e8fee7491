"""W8A8_DYNAMIC: int8 weights (symmetric: ``weight_offset`` zero), activations quantized per
token at run time (``ops.w8a8_dynamic_linear``; docs/quantization.md). Its layer holds the
common tensors only; the captured decode step runs it with the same native int8 kernel."""

from __future__ import annotations

from atb_plugin import ops
from atb_plugin.models.linear import register_linear_method
from atb_plugin.models.quantization.config import W8A8_DYNAMIC
from atb_plugin.models.quantization.layers import QuantLinearMethod
from atb_plugin.ops import cpu_native


@register_linear_method
class W8A8DynamicLinearMethod(QuantLinearMethod):
    name = W8A8_DYNAMIC
    native_format = cpu_native.LINEAR_W8A8_DYNAMIC

    def apply(self, layer, x, bias):
        return ops.w8a8_dynamic_linear(x, layer.weight, layer.weight_scale.view(-1), bias)
