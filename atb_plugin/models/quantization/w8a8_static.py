"""Static W8A8 (msModelSlim's ``W8A8``): int8 weights, activations quantized with the calibrated
per-tensor ``input_scale`` / ``input_offset``; the float bias is folded into ``quant_bias``
(``ops.w8a8_static_linear``; docs/quantization.md). Only from a checkpoint: the activation
scales need calibrating (``export.py --method w8a8``)."""

from __future__ import annotations

import torch

from atb_plugin import ops
from atb_plugin.models.linear import register_linear_method
from atb_plugin.models.quantization.config import W8A8, QuantizationError
from atb_plugin.models.quantization.layers import QuantLinear, QuantLinearMethod, frozen_parameter


class W8A8StaticLinear(QuantLinear):
    """``deq_scale``: float32, or msModelSlim's float16-model layout, int64 holding float32 bits."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False, device=None,
                 deq_scale_dtype: torch.dtype = torch.float32):
        super().__init__(in_features, out_features, False, device)
        if deq_scale_dtype not in (torch.float32, torch.int64):
            raise ValueError(f"deq_scale dtype {deq_scale_dtype}: expected float32 or int64")
        self.input_scale = frozen_parameter(torch.ones(1, dtype=torch.float32, device=device))
        self.input_offset = frozen_parameter(torch.zeros(1, dtype=torch.float32, device=device))
        self.deq_scale = frozen_parameter(torch.ones(out_features, dtype=deq_scale_dtype, device=device))
        self.quant_bias = frozen_parameter(torch.zeros(out_features, dtype=torch.int32, device=device))

    def dequant_scale(self) -> torch.Tensor:
        if self.deq_scale.dtype == torch.int64:  # float32 bits in the low 32 bits
            return self.deq_scale.to(torch.int32).view(torch.float32)
        return self.deq_scale


@register_linear_method
class W8A8StaticLinearMethod(QuantLinearMethod):
    name = W8A8
    layer_cls = W8A8StaticLinear
    checkpoint_tensors = ("weight_scale", "weight_offset", "input_scale", "input_offset", "deq_scale", "quant_bias")

    def __init__(self, from_float: bool = False, deq_scale_dtype: torch.dtype = torch.float32):
        if from_float:
            raise QuantizationError("static W8A8 needs calibrated activation scales: export it "
                                    "(python -m atb_plugin.models.quantization.export --method w8a8)")
        super().__init__(from_float, deq_scale_dtype)

    def apply(self, layer, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        # The bias is folded into quant_bias (a static layer has no float bias).
        return ops.w8a8_static_linear(x, layer.weight, layer.input_scale, layer.input_offset, layer.dequant_scale(),
                                      layer.quant_bias)
