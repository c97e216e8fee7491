"""Quantized linear products (docs/quantization.md has the formulas every platform implements):

- ``w8a16_linear(x, weight, scale, offset, bias)``: int8 weight, activations in ``x.dtype``:
  ``y = x @ ((weight + offset[:, None]) * scale[:, None]).T + bias`` (the offset is added,
  ``npu_weight_quant_batchmatmul``'s antiquant rule);
- ``w8a8_dynamic_linear(x, weight, weight_scale, bias)``: each token quantized symmetrically to
  int8 at run time (``s_t = max|x_t| / 127``), the int8 x int8 product exact in int32, then
  ``* s_t * weight_scale + bias``;
- ``w8a8_static_linear(x, weight, input_scale, input_offset, deq_scale, quant_bias)``:
  msModelSlim's static W8A8, ``q = clamp(round(x / input_scale + input_offset))``, then
  ``y = (q @ weight.T + quant_bias) * deq_scale``.

Shapes: ``x (..., in)``; ``weight`` int8 ``(out, in)``; per-channel tensors ``(out,)``
(``scale``, ``offset``, ``weight_scale``, ``deq_scale`` float32; ``quant_bias`` int32); per-tensor
``input_scale`` / ``input_offset`` ``(1,)`` float32; ``bias`` ``(out,)`` or None. The result has
``x``'s dtype and leading dimensions.

Kernels (``current_platform().kernels``, the same names): CPU / CUDA ``torch_kernels``; NPU
``npu_kernels`` (``npu_weight_quant_batchmatmul``, ``npu_dynamic_quant`` + ``npu_quant_matmul``,
``npu_quantize`` + ``npu_quant_matmul``).
"""

from __future__ import annotations

import torch

from atb_plugin.platform import current_platform

__all__ = ["w8a16_linear", "w8a8_dynamic_linear", "w8a8_static_linear"]


def _check(op: str, x: torch.Tensor, weight: torch.Tensor, per_channel: dict, per_tensor: dict = {}) -> None:
    """ValueError naming the shapes when they do not fit together (before any kernel runs)."""
    if weight.dtype != torch.int8 or weight.dim() != 2:
        raise ValueError(f"{op}: weight must be int8 (out, in), got {weight.dtype} {tuple(weight.shape)}")
    out_features, in_features = weight.shape
    if x.shape[-1] != in_features:
        raise ValueError(f"{op}: x {tuple(x.shape)} does not fit weight {tuple(weight.shape)} (in = {in_features})")
    for name, tensor in per_channel.items():
        if tensor is not None and tuple(tensor.shape) != (out_features,):
            raise ValueError(f"{op}: {name} {tuple(tensor.shape)} must be ({out_features},)")
    for name, tensor in per_tensor.items():
        if tensor.numel() != 1:
            raise ValueError(f"{op}: {name} {tuple(tensor.shape)} must hold one value (per-tensor)")


def w8a16_linear(x, weight, scale, offset, bias) -> torch.Tensor:
    _check("w8a16_linear", x, weight, {"scale": scale, "offset": offset, "bias": bias})
    return current_platform().kernels.w8a16_linear(x, weight, scale, offset, bias)


def w8a8_dynamic_linear(x, weight, weight_scale, bias) -> torch.Tensor:
    _check("w8a8_dynamic_linear", x, weight, {"weight_scale": weight_scale, "bias": bias})
    return current_platform().kernels.w8a8_dynamic_linear(x, weight, weight_scale, bias)


def w8a8_static_linear(x, weight, input_scale, input_offset, deq_scale, quant_bias) -> torch.Tensor:
    _check("w8a8_static_linear", x, weight, {"deq_scale": deq_scale, "quant_bias": quant_bias},
           {"input_scale": input_scale, "input_offset": input_offset})
    return current_platform().kernels.w8a8_static_linear(x, weight, input_scale, input_offset, deq_scale,
                                                          quant_bias)
