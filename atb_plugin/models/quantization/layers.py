"""Quantized linear layers, the base of their methods and the weight quantization (each scheme's
layer and method are in a file of their own: ``w8a16.py``, ``w8a8_dynamic.py``, ``w8a8_static.py``).

The layers are drop-in replacements of ``nn.Linear`` (same ``forward(x)``, any leading
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

from atb_plugin.distributed import TPShard, all_gather, tp_size
from atb_plugin.models.linear import ROW, LinearMethodBase, LinearSpec, attach
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


def frozen_parameter(tensor: torch.Tensor) -> nn.Parameter:
    return nn.Parameter(tensor, requires_grad=False)


class QuantLinear(nn.Module):
    """The parameters every scheme has and the float32-scale rule; a scheme with more tensors
    subclasses it (``W8A8StaticLinear``). Its method (``QuantLinearMethod``) makes it and computes
    the product: ``forward`` is ``quant_method.apply``."""

    quant_method: LinearMethodBase  # set on every layer by its method (models/linear.py: attach)

    @property
    def scheme(self) -> str:
        """msModelSlim's name of the layer's scheme."""
        return self.quant_method.name

    def __init__(self, in_features: int, out_features: int, bias: bool, device=None,
                 deq_scale_dtype: torch.dtype = torch.float32):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = frozen_parameter(torch.empty(out_features, in_features, dtype=torch.int8, device=device))
        self.weight_scale = frozen_parameter(torch.ones(out_features, 1, dtype=torch.float32, device=device))
        self.weight_offset = frozen_parameter(torch.zeros(out_features, 1, dtype=torch.float32, device=device))
        if bias:
            self.bias = frozen_parameter(torch.zeros(out_features, device=device))
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

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.quant_method.apply(self, x, self.bias)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, scheme={self.scheme}")


def channel_absmax(weight: torch.Tensor) -> torch.Tensor:
    """``max|W[n, :]|`` as float32 ``(out, 1)``."""
    return weight.detach().to(torch.float32).abs().amax(dim=1, keepdim=True)


def quantize_weight(weight: torch.Tensor, absmax: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-channel int8 (docs/quantization.md): ``scale = max|W[n, :]| / 127`` (1 for an
    all-zero row), ``W_q = clamp(round(W / scale), -127, 127)``; returns ``(W_q int8 (out, in),
    scale float32 (out, 1))``. ``export.py`` writes exactly these tensors, so an exported
    checkpoint and the same float checkpoint quantized on the fly hold bit-identical weights and
    scales. ``absmax``: the rows' maxima when they come from more than ``weight`` (a row-parallel
    shard); default ``channel_absmax(weight)``."""
    if absmax is None:
        absmax = channel_absmax(weight)
    scale = torch.where(absmax > 0, absmax / 127.0, torch.ones_like(absmax))
    q = torch.clamp(torch.round(weight.detach().to(torch.float32) / scale), -127, 127).to(torch.int8)
    return q, scale


class QuantLinearMethod(LinearMethodBase):
    """The method of a scheme whose layer is ``layer_cls`` (a ``QuantLinear``): msModelSlim's
    tensors created empty and filled by the loader, or, ``from_float``, a float ``nn.Linear``
    loaded from a float checkpoint and quantized after loading (``--quantization``: symmetric per
    output channel, ``quantize.quantize_weight``; a row-parallel layer takes each row's maximum
    over all ranks, one all-gather of ``(out, 1)``, so every rank's scales are the unsplit
    layer's as a quantized checkpoint's are). ``checkpoint_tensors``: what the scheme reads from
    a checkpoint besides ``weight`` (and ``bias``); ``native_format``: its format in the captured
    decode step (None: it has none)."""

    layer_cls: ClassVar[type[QuantLinear]] = QuantLinear
    checkpoint_tensors: ClassVar[tuple[str, ...]] = ("weight_scale", "weight_offset")
    native_format: ClassVar[int | None] = None

    def __init__(self, from_float: bool = False, deq_scale_dtype: torch.dtype = torch.float32):
        self.from_float, self.deq_scale_dtype = from_float, deq_scale_dtype

    def create_weights(self, spec: LinearSpec) -> nn.Module:
        if self.from_float:
            return nn.Linear(spec.in_features, spec.out_features, bias=spec.bias)
        return self.layer_cls(spec.in_features, spec.out_features, spec.bias, deq_scale_dtype=self.deq_scale_dtype)

    def process_weights_after_loading(self, layer: nn.Module) -> nn.Module:
        if not self.from_float or type(layer) is not nn.Linear:
            return layer
        spec = layer.linear_spec
        absmax = channel_absmax(layer.weight)
        if spec.parallel == ROW and tp_size() > 1:  # each rank holds some columns of every row
            absmax = all_gather(absmax, dim=1).amax(dim=1, keepdim=True)
        quantized = self.layer_cls(layer.in_features, layer.out_features, layer.bias is not None,
                                   device=layer.weight.device)
        q, scale = quantize_weight(layer.weight, absmax)
        with torch.no_grad():
            quantized.weight.copy_(q)
            quantized.weight_scale.copy_(scale)
            if layer.bias is not None:
                quantized.bias.data = layer.bias.detach().clone()
        return attach(quantized, self, spec)

    def native_operands(self, layer: nn.Module) -> cpu_native.LinearOperands | str:
        """What the captured decode step reads: the tensors the eager forward hands the native
        kernel on the CPU (models/native_decode.py)."""
        if self.native_format is None or not isinstance(layer, QuantLinear):
            return super().native_operands(layer)
        if layer.weight.device.type != "cpu" or not layer.weight.is_contiguous():
            return f"{layer.scheme} weight on {layer.weight.device}, contiguous={layer.weight.is_contiguous()}"

        def f32(tensor):  # as torch_kernels hands them to the kernel (a bias in bfloat16 is widened)
            return None if tensor is None else tensor.to(torch.float32).contiguous().view(-1)

        return cpu_native.LinearOperands(self.native_format, layer.weight, bias=f32(layer.bias),
                                         scale=f32(layer.weight_scale), offset=f32(self.native_offset(layer)))

    def native_offset(self, layer: QuantLinear) -> torch.Tensor | None:
        """The per-channel offset the native kernel adds to the weight (None: symmetric)."""
        return None
