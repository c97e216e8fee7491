"""Linear layers and their methods (vLLM's ``QuantizationConfig.get_quant_method`` design;
docs/quantization.md, "Linear methods").

A model builds each linear layer through ``parallel_layers`` (``column_parallel_linear``,
``row_parallel_linear``, ``lm_head_linear``) with a ``LinearSpec``: its sizes, how tensor
parallelism splits it, and its role. The quantization config the model is built under
(``building``, set by ``PretrainedModel.from_pretrained``) hands that layer its method
(``QuantizationConfig.get_quant_method(spec, prefix)``), and the method carries the layer from
then on, in one path::

    config -> method per layer -> create_weights (on the meta device) -> the checkpoint loads
           -> process_weights_after_loading -> apply (every forward), native_operands (capture)

- ``create_weights(spec)`` makes the layer holding the parameters the checkpoint fills (float
  ``nn.Linear`` weights, or a scheme's int8 tensors under msModelSlim's names);
- ``process_weights_after_loading(layer)`` turns the loaded layer into the one that serves:
  itself, its int8 form (a float checkpoint quantized on the fly), or on the CPU its weight
  packed for the kernels (``UnquantizedLinearMethod``: the native kernels' panels or oneDNN's);
  ``process_weights_after_loading(model, config)`` below runs it for every linear layer once,
  at the end of the load, and puts what it returns in the layer's place;
- ``apply(layer, x, bias)``: the product (each layer class's ``forward``);
- ``native_operands(layer)``: the tensors the captured decode step reads (models/native_decode.py),
  or why the layer has none.

Which module classes serve is each method's choice (``nn.Linear``, ``ops.packed_linear``'s
``PanelLinear`` / ``PackedLinear``, a scheme's ``QuantLinear``); every one of them carries its
method (``quant_method``) and its spec (``linear_spec``). Linear layers a model builds as plain
``nn.Linear`` (vision and audio towers, projectors, routers, pooling heads) are replicated float
layers: the config's ``float_method`` processes them.

A new scheme is one file under ``models/quantization/`` (its layer and its method, registered
with ``register_linear_method``): docs/quantization.md, "Adding a scheme".
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
from collections.abc import Iterator
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import nn
from torch.nn import functional as F

from atb_plugin.ops import calibration, cpu_native
from atb_plugin.ops.packed_linear import PackingRule, PackingSummary, PanelLinear

logger = logging.getLogger(__name__)

# How tensor parallelism splits a layer (atb_plugin.distributed): by output rows (each rank's rows
# whole), by input columns (each rank holds part of every row; one all-reduce after), or not at all.
COLUMN, ROW, REPLICATED = "column", "row", "replicated"
# What the layer is in the model, for configs that choose by it (quantize.OnTheFlyConfig).
DECODER = "decoder"  # a dense decoder layer's projection (attention, SwiGLU MLP)
EXPERT = "expert"  # a mixture-of-experts layer's (Qwen2-MoE's shared expert)
LM_HEAD = "lm_head"
OTHER = "other"


@dataclass(frozen=True)
class LinearSpec:
    """One linear layer as its model builds it: this rank's sizes, ``parallel`` (``COLUMN``,
    ``ROW``, ``REPLICATED``) and ``role``."""

    in_features: int
    out_features: int
    bias: bool
    parallel: str = REPLICATED
    role: str = OTHER


def float_spec(linear: nn.Linear) -> LinearSpec:
    """The spec of a plain ``nn.Linear`` a model built without one (replicated, float)."""
    return LinearSpec(linear.in_features, linear.out_features, linear.bias is not None)


class LinearMethodBase:
    """How one kind of linear layer is made, finished after loading, run and captured (module
    docstring). ``name``: the scheme it implements (msModelSlim's spelling for quantized ones)."""

    name: ClassVar[str]

    def create_weights(self, spec: LinearSpec) -> nn.Module:
        raise NotImplementedError

    def process_weights_after_loading(self, layer: nn.Module) -> nn.Module:
        return layer

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        raise NotImplementedError

    def native_operands(self, layer: nn.Module) -> cpu_native.LinearOperands | str:
        return f"{type(layer).__name__} has no native form (pack_weights off, or a format the plan lacks)"


LINEAR_METHODS: dict[str, type[LinearMethodBase]] = {}


def register_linear_method(cls: type[LinearMethodBase]) -> type[LinearMethodBase]:
    """Class decorator: ``cls`` serves the scheme ``cls.name`` (``linear_method_class``)."""
    if cls.name in LINEAR_METHODS:
        raise ValueError(f"linear method {cls.name!r} registered twice")
    LINEAR_METHODS[cls.name] = cls
    return cls


def linear_method_class(name: str) -> type[LinearMethodBase]:
    try:
        return LINEAR_METHODS[name]
    except KeyError:
        raise ValueError(f"quantization scheme {name!r}: expected one of {', '.join(LINEAR_METHODS)}") from None


def attach(layer: nn.Module, method: LinearMethodBase, spec: LinearSpec) -> nn.Module:
    """``layer`` carrying its method and spec (plain attributes: neither parameters nor modules)."""
    layer.quant_method, layer.linear_spec = method, spec
    return layer


class UnquantizedLinearMethod(LinearMethodBase):
    """Float weights (``nn.Linear``). With ``pack`` (``--pack-weights``, the default), a CPU
    layer's weight is packed after loading as ``ops.packed_linear.PackingRule`` decides: the
    native kernels' column panels (``PanelLinear``), else oneDNN's (``PackedLinear``), else it
    stays dense. A weight another module still reads (a tied LM head's) is packed as a copy."""

    name = "FLOAT"

    def __init__(self, pack: bool = False):
        self.pack = pack

    def create_weights(self, spec: LinearSpec) -> nn.Module:
        return nn.Linear(spec.in_features, spec.out_features, bias=spec.bias)

    def packs(self, layer: nn.Module) -> bool:
        return self.pack and type(layer) is nn.Linear and layer.weight.device.type == "cpu"

    def process_weights_after_loading(self, layer: nn.Module, rule: PackingRule | None = None) -> nn.Module:
        if not self.packs(layer):
            return layer
        packed = (rule or PackingRule.current()).pack(layer.weight, layer.bias)
        return layer if packed is None else attach(packed, self, getattr(layer, "linear_spec", float_spec(layer)))

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if type(layer) is nn.Linear:
            return F.linear(x, layer.weight, bias)
        return layer(x)  # a packed layer: its own product over the packed weight

    def native_operands(self, layer: nn.Module) -> cpu_native.LinearOperands | str:
        if isinstance(layer, PanelLinear):  # the panels as the captured decode step reads them
            return layer.native_operands()
        return super().native_operands(layer)


class QuantizationConfig:
    """Which method each linear layer gets. This base: every layer float (packed where ``pack``);
    the quantized configs are in ``models/quantization/quantize.py``."""

    def __init__(self, pack: bool = False):
        self.float_method = UnquantizedLinearMethod(pack)

    def get_quant_method(self, spec: LinearSpec, prefix: str) -> LinearMethodBase:
        return self.float_method

    def finish_building(self, model: nn.Module) -> None:
        """After the model is built, before it loads: a config that names layers the model built
        as plain ``nn.Linear`` (not through ``parallel_layers``) gives them their methods here
        (``quantize.MsModelSlimConfig``); nothing for float."""


_BUILDING: contextvars.ContextVar[QuantizationConfig | None] = contextvars.ContextVar("quant_config", default=None)


@contextlib.contextmanager
def building(config: QuantizationConfig) -> Iterator[QuantizationConfig]:
    """Build a model under ``config``: its linear layers take their methods from it."""
    token = _BUILDING.set(config)
    try:
        yield config
    finally:
        _BUILDING.reset(token)


def linear_method(spec: LinearSpec, prefix: str) -> LinearMethodBase:
    """The method of the layer ``spec`` describes at ``prefix`` (its module path in the model),
    from the config the model is being built under (float outside ``building``)."""
    return (_BUILDING.get() or QuantizationConfig()).get_quant_method(spec, prefix)


def make_linear(spec: LinearSpec, prefix: str) -> nn.Module:
    """That layer, made by its method."""
    method = linear_method(spec, prefix)
    return attach(method.create_weights(spec), method, spec)


def _float_shapes(model: nn.Module, method: UnquantizedLinearMethod) -> list[tuple[str, int, int, bool]]:
    """(dtype name, out, in, bias) of each float layer of ``model`` that ``method`` packs."""
    return [(str(m.weight.dtype).removeprefix("torch."), *m.weight.shape, m.bias is not None) for m in model.modules()
            if isinstance(getattr(m, "quant_method", method), UnquantizedLinearMethod) and method.packs(m)]


def process_weights_after_loading(model: nn.Module, config: QuantizationConfig) -> PackingSummary:
    """Finish every linear layer of the loaded ``model`` with its method (module docstring), a
    plain ``nn.Linear`` with ``config.float_method``; each layer is replaced by what its method
    returns. Returns (and logs) what the float method packed."""
    holders: dict[int, int] = {}  # id(weight) -> how many modules hold it (a tied head shares the embedding's)
    for module in model.modules():
        for parameter in module.parameters(recurse=False):
            holders[id(parameter)] = holders.get(id(parameter), 0) + 1
    # The forms this machine runs fastest, measured once (ops/calibration.py); only where a CPU float
    # layer packs: a model on the NPU (or one with no such layer) neither measures nor builds the
    # native CPU kernels for it.
    shapes = _float_shapes(model, config.float_method) if config.float_method.pack else []
    rule = calibration.packing_rule(shapes) if shapes else None
    summary = PackingSummary()
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            method = getattr(child, "quant_method", None)
            if method is None and type(child) is not nn.Linear:
                continue
            if method is None or isinstance(method, UnquantizedLinearMethod):
                method = config.float_method  # whether float layers pack is this load's choice
                attach(child, method, getattr(child, "linear_spec", None) or float_spec(child))
                if not method.packs(child):
                    continue
                served = method.process_weights_after_loading(child, rule)
                summary.record(child, served, holders.get(id(child.weight), 0) > 1)
            else:
                served = method.process_weights_after_loading(child)
            if served is not child:
                setattr(parent, name, served)
    if config.float_method.pack:
        summary.log()
    return summary


def pack_linear_layers(model: nn.Module) -> PackingSummary:
    """Pack every CPU ``nn.Linear`` of any module tree (``UnquantizedLinearMethod`` with packing)."""
    return process_weights_after_loading(model, QuantizationConfig(pack=True))


__all__ = ["COLUMN", "ROW", "REPLICATED", "DECODER", "EXPERT", "LM_HEAD", "OTHER", "LinearSpec", "LinearMethodBase",
           "UnquantizedLinearMethod", "QuantizationConfig", "building", "linear_method", "make_linear",
           "register_linear_method", "linear_method_class", "process_weights_after_loading", "pack_linear_layers"]
