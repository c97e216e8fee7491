"""Quantized linear layers: drop-in replacements of ``nn.Linear`` (same ``forward(x)``, any leading
dimensions) whose parameters are msModelSlim's tensors, under msModelSlim's names, so that a
quantized checkpoint loads through the ordinary loader (``models/weights.py``) and a float one
quantized on the fly ends up in the very same parameters (docs/quantization.md).

=====================  =========================  ====================================
parameter              dtype, shape               schemes
=====================  =========================  ====================================
``weight``             int8 (out, in)             all
``weight_scale``       float32 (out, 1)           all (per output channel)
``weight_offset``      float32 (out, 1)           all (zero for symmetric weights)
``bias``               model dtype (out,)         W8A16, W8A8_DYNAMIC, when the layer has one
``input_scale``        float32 (1,)               W8A8 (static, per tensor)
``input_offset``       float32 (1,)               W8A8 (integer-valued)
``deq_scale``          float32 (out,) or int64    W8A8 (``input_scale * weight_scale``)
``quant_bias``         int32 (out,)               W8A8 (bias and offset correction)
=====================  =========================  ====================================

Scales keep float32 whatever the model's dtype (a per-channel scale rounded to bfloat16 shifts
that channel by up to 0.4%): ``_apply`` leaves their dtype alone when the model is cast.
The products themselves are the ops in ``atb_plugin.ops.quant``.
"""

from __future__ import annotations

from typing import ClassVar

import torch
from torch import nn

from atb_plugin import ops
from atb_plugin.distributed import TPShard
from atb_plugin.models.quantization.config import W8A8, W8A8_DYNAMIC, W8A16
from atb_plugin.ops import cpu_native

# Parameter kinds beyond weight / bias, by how tensor parallelism splits them.
PER_CHANNEL_KINDS = ("weight_scale", "weight_offset", "deq_scale")  # one per output row
PER_TENSOR_KINDS = ("input_scale", "input_offset")  # one value for the whole layer
QUANT_BIAS = "quant_bias"  # per output row, added once like a bias
QUANT_KINDS = (*PER_CHANNEL_KINDS, *PER_TENSOR_KINDS, QUANT_BIAS)
FLOAT32_KINDS = ("weight_scale", "weight_offset", "input_scale", "input_offset", "deq_scale")


def quant_tp_shard(tp_shard, leaf: str, kind: str, shard: int | None) -> TPShard | None:
    """This rank's part of quantization tensor ``<leaf>.<kind>``, derived from how its owner
    splits the layer's weight (``tp_shard``: the owner's ``ShardedWeights.tp_shard``): per-channel
    tensors follow the weight's output rows (column-parallel) and are whole on every rank of a
    row-parallel layer (its output channels are not split); ``quant_bias`` is split like a bias
    (whole on rank 0, zero elsewhere for a row-parallel layer: the all-reduce adds it once);
    per-tensor scales are whole everywhere. Other kinds: the owner's own answer."""
    if kind in PER_TENSOR_KINDS:
        return None
    if kind == QUANT_BIAS:
        return tp_shard(leaf, "bias", shard)
    if kind in PER_CHANNEL_KINDS:
        split = tp_shard(leaf, "weight", shard)
        return split if split is not None and split.dim == 0 else None
    return tp_shard(leaf, kind, shard)


def _frozen(tensor: torch.Tensor) -> nn.Parameter:
    return nn.Parameter(tensor, requires_grad=False)


class QuantLinear(nn.Module):
    """Common parameters and the float32-scale rule; subclasses add their tensors and ``forward``.
    ``scheme``: msModelSlim's name of the subclass's scheme."""

    scheme: ClassVar[str]

    def __init__(self, in_features: int, out_features: int, bias: bool, device=None,
                 deq_scale_dtype: torch.dtype = torch.float32):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = _frozen(torch.empty(out_features, in_features, dtype=torch.int8, device=device))
        self.weight_scale = _frozen(torch.ones(out_features, 1, dtype=torch.float32, device=device))
        self.weight_offset = _frozen(torch.zeros(out_features, 1, dtype=torch.float32, device=device))
        if bias:
            self.bias = _frozen(torch.zeros(out_features, device=device))
        else:
            self.register_parameter("bias", None)

    def _apply(self, fn, recurse=True):
        # Module.to(dtype) casts every floating parameter: scales stay float32 (module docstring);
        # device moves and to_empty still apply to them.
        before = {name: getattr(self, name).data for name in FLOAT32_KINDS if getattr(self, name, None) is not None}
        super()._apply(fn, recurse)
        for name, old in before.items():
            new = getattr(self, name)
            if new.dtype != old.dtype:
                new.data = old.to(device=new.device)
        return self

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, scheme={self.scheme}")


def _int8_operands(layer: QuantLinear, format: int, offset: torch.Tensor | None) -> cpu_native.LinearOperands | str:
    if layer.weight.device.type != "cpu" or not layer.weight.is_contiguous():
        return f"{layer.scheme} weight on {layer.weight.device}, contiguous={layer.weight.is_contiguous()}"

    def f32(tensor):  # as torch_kernels hands them to the kernel (a bias in bfloat16 is widened)
        return None if tensor is None else tensor.to(torch.float32).contiguous().view(-1)

    return cpu_native.LinearOperands(format, layer.weight, bias=f32(layer.bias), scale=f32(layer.weight_scale),
                                     offset=f32(offset))


class W8A16Linear(QuantLinear):
    """int8 weights, activations in the model's dtype: ``y = x ((W + offset) * scale)^T + b``."""

    scheme = W8A16

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ops.w8a16_linear(x, self.weight, self.weight_scale.view(-1), self.weight_offset.view(-1), self.bias)

    def native_operands(self) -> cpu_native.LinearOperands | str:
        """What the captured decode step reads: the tensors the eager forward hands the native
        kernel on the CPU (models/native_decode.py)."""
        return _int8_operands(self, cpu_native.LINEAR_W8A16, self.weight_offset)


class W8A8DynamicLinear(QuantLinear):
    """int8 weights (symmetric: ``weight_offset`` zero), activations quantized per token at run
    time (``ops.w8a8_dynamic_linear``)."""

    scheme = W8A8_DYNAMIC

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ops.w8a8_dynamic_linear(x, self.weight, self.weight_scale.view(-1), self.bias)

    def native_operands(self) -> cpu_native.LinearOperands | str:
        """As ``W8A16Linear.native_operands``."""
        return _int8_operands(self, cpu_native.LINEAR_W8A8_DYNAMIC, None)


class W8A8StaticLinear(QuantLinear):
    """int8 weights, activations quantized with the calibrated per-tensor ``input_scale`` /
    ``input_offset``; the float bias is folded into ``quant_bias`` (``ops.w8a8_static_linear``).
    ``deq_scale``: float32, or msModelSlim's float16-model layout, int64 holding float32 bits."""

    scheme = W8A8

    def __init__(self, in_features: int, out_features: int, bias: bool = False, device=None,
                 deq_scale_dtype: torch.dtype = torch.float32):
        super().__init__(in_features, out_features, False, device)
        if deq_scale_dtype not in (torch.float32, torch.int64):
            raise ValueError(f"deq_scale dtype {deq_scale_dtype}: expected float32 or int64")
        self.input_scale = _frozen(torch.ones(1, dtype=torch.float32, device=device))
        self.input_offset = _frozen(torch.zeros(1, dtype=torch.float32, device=device))
        self.deq_scale = _frozen(torch.ones(out_features, dtype=deq_scale_dtype, device=device))
        self.quant_bias = _frozen(torch.zeros(out_features, dtype=torch.int32, device=device))

    def dequant_scale(self) -> torch.Tensor:
        if self.deq_scale.dtype == torch.int64:  # float32 bits in the low 32 bits
            return self.deq_scale.to(torch.int32).view(torch.float32)
        return self.deq_scale

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ops.w8a8_static_linear(x, self.weight, self.input_scale, self.input_offset, self.dequant_scale(),
                                      self.quant_bias)


LAYERS: dict[str, type[QuantLinear]] = {cls.scheme: cls for cls in (W8A16Linear, W8A8DynamicLinear, W8A8StaticLinear)}


def layer_class(scheme: str) -> type[QuantLinear]:
    try:
        return LAYERS[scheme]
    except KeyError:
        raise ValueError(f"quantization scheme {scheme!r}: expected one of {', '.join(LAYERS)}") from None
