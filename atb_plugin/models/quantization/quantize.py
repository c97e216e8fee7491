"""Which linear layers are quantized, and by which method: the quantization configs a model is
built under (``models/linear.py``; docs/quantization.md).

- ``OnTheFlyConfig`` (``--quantization w8a16|w8a8`` on a float checkpoint): the language model's
  dense decoder projections, ``qkv_proj``, ``o_proj``, ``gate_up_proj``, ``down_proj`` of every
  dense decoder layer (every family's language model is a ``decoder.DecoderForCausalLM``), get
  the scheme's method over float weights, quantized after they load; the LM head too only when
  asked (``quantize_lm_head``: vLLM and msModelSlim leave it float by default, as llama.cpp's
  Q8_0 does not). Vision and audio towers, projectors, the input embedding and mixture-of-experts
  layers (experts, shared expert, router) stay float.
- ``MsModelSlimConfig``: the layers an msModelSlim checkpoint's description marks, each with its
  scheme's method, their int8 tensors filled by the loader.
- ``quantization_config``: the one of these (or float) for a checkpoint and the flags.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch
from safetensors import safe_open
from torch import nn

from atb_plugin.models.linear import (DECODER, LM_HEAD, LinearMethodBase, LinearSpec, QuantizationConfig,
                                      attach, float_spec, linear_method_class)
from atb_plugin.models.quantization import w8a8_dynamic, w8a8_static, w8a16  # noqa: F401 (their methods register)
from atb_plugin.models.quantization.config import (FLOAT, ON_THE_FLY_SCHEME, QuantConfig, QuantizationError,
                                                   resolve_quantization)
from atb_plugin.models.weights import checkpoint_files

logger = logging.getLogger(__name__)


class OnTheFlyConfig(QuantizationConfig):
    """``scheme``'s method (``from_float``) for every dense decoder projection, and the LM head
    with ``lm_head`` (module docstring); float for the rest."""

    def __init__(self, scheme: str, lm_head: bool = False, pack: bool = False):
        super().__init__(pack)
        self.method = linear_method_class(scheme)(from_float=True)
        self.lm_head = lm_head

    def get_quant_method(self, spec: LinearSpec, prefix: str) -> LinearMethodBase:
        if spec.role == DECODER or (spec.role == LM_HEAD and self.lm_head):
            return self.method
        return self.float_method


@dataclass(frozen=True)
class DescribedLayer:
    """A linear layer an msModelSlim description marks: its scheme, the checkpoint weights that
    fill it (the pieces of a fused projection), the dtype its ``deq_scale`` is stored in."""

    scheme: str
    names: tuple[str, ...]
    deq_scale_dtype: torch.dtype = torch.float32


class MsModelSlimConfig(QuantizationConfig):
    """The described layers' methods by module path (``layers``), float for the rest."""

    def __init__(self, description: QuantConfig, layers: dict[str, DescribedLayer], pack: bool = False):
        super().__init__(pack)
        self.description, self.layers = description, layers
        self._built: set[str] = set()

    @classmethod
    def read(cls, model: nn.Module, description: QuantConfig, model_dir, pack: bool = False) -> "MsModelSlimConfig":
        """Check ``description`` against the checkpoint's tensors and find its layers in
        ``model`` (built float on the meta device, only to map checkpoint names to its own)."""
        dtypes = checkpoint_tensor_dtypes(model_dir)
        check_description(description, dtypes)
        layers = {}
        for module_name, (scheme, names) in _layer_groups(model, description).items():
            deq_dtypes = {dtypes.get(name[:-len("weight")] + "deq_scale") for name in names} - {None}
            if len(deq_dtypes) > 1:
                raise QuantizationError(f"{module_name}: its pieces store deq_scale as {sorted(deq_dtypes)}: one dtype")
            layers[module_name] = DescribedLayer(scheme, tuple(names),
                                                 torch.int64 if deq_dtypes == {"I64"} else torch.float32)
        return cls(description, layers, pack)

    def get_quant_method(self, spec: LinearSpec, prefix: str) -> LinearMethodBase:
        layer = self.layers.get(prefix)
        if layer is None:
            return self.float_method
        self._built.add(prefix)
        return linear_method_class(layer.scheme)(deq_scale_dtype=layer.deq_scale_dtype)

    def finish_building(self, model: nn.Module) -> None:
        """A described layer the model built as a plain ``nn.Linear`` (a vision tower's, not made
        through ``parallel_layers``) gets its scheme's layer here, on the meta device, before
        anything loads; one that is no linear layer at all is refused."""
        for module_name, layer in self.layers.items():
            if module_name in self._built:
                continue
            parent_name, _, leaf = module_name.rpartition(".")
            module = model.get_submodule(module_name)
            if type(module) is not nn.Linear:
                raise QuantizationError(f"{self.description.path}: {', '.join(layer.names)} marked {layer.scheme}, but "
                                        f"{module_name} is a {type(module).__name__}: only linear layers are quantized")
            spec = float_spec(module)
            method = self.get_quant_method(spec, module_name)
            with torch.device("meta"):
                setattr(model.get_submodule(parent_name), leaf, attach(method.create_weights(spec), method, spec))


def quantization_config(build_float_model: Callable[[], nn.Module], model_dir, quantization: str | None,
                        quantize_lm_head: bool = False, pack: bool = False) -> QuantizationConfig:
    """The config a model from ``model_dir`` is built under for ``--quantization quantization``
    (``resolve_quantization``): an msModelSlim checkpoint's (``build_float_model`` makes the
    model float on the meta device to find the described layers), the flag's on-the-fly one for a
    float checkpoint, else float. ``pack``: CPU float layers are packed after loading."""
    method, described = resolve_quantization(model_dir, quantization, quantize_lm_head)
    if described is not None:
        return MsModelSlimConfig.read(build_float_model(), described, model_dir, pack)
    if method is not None:
        logger.info("quantizing the language model's decoder projections on the fly (%s)%s", ON_THE_FLY_SCHEME[method],
                    ", and the LM head" if quantize_lm_head else "")
        return OnTheFlyConfig(ON_THE_FLY_SCHEME[method], quantize_lm_head, pack)
    return QuantizationConfig(pack)


@dataclass(frozen=True)
class LinearSlot:
    """One linear layer ``OnTheFlyConfig`` quantizes: ``getattr(parent, name)``; ``path`` its
    module name in the model."""

    parent: nn.Module
    name: str
    path: str


def language_model_linears(model: nn.Module) -> list[LinearSlot]:
    """The language model's dense decoder projections (module docstring), in layer order."""
    slots = []
    for path, module in model.named_modules():
        spec = getattr(module, "linear_spec", None)
        if spec is not None and spec.role == DECODER:
            parent, _, name = path.rpartition(".")
            slots.append(LinearSlot(model.get_submodule(parent), name, path))
    return slots


# --------------------------------------------------------------------------------------------
# msModelSlim checkpoints: the description checked and its layers found
# --------------------------------------------------------------------------------------------


def checkpoint_tensor_dtypes(model_dir) -> dict[str, str]:
    """``{name: safetensors dtype ("I8", "F32", "I64", ...)}`` of every tensor (headers only)."""
    dtypes = {}
    for path in checkpoint_files(model_dir):
        with safe_open(str(path), framework="pt") as shard:
            for name in shard.keys():
                dtypes[name] = shard.get_slice(name).get_dtype()
    return dtypes


def _layer_groups(model, config: QuantConfig) -> dict[str, tuple[str, list[str]]]:
    """``{module name: (scheme, [checkpoint weight names])}`` for every layer the description
    marks quantized (the pieces of a fused projection together)."""
    groups: dict[str, tuple[str, list[str]]] = {}
    for name, scheme in config.quantized_weights().items():
        found = model.checkpoint_target(name)
        if found is None:
            # A model may know why (models/moe.py: experts the fused MoE op runs in float only).
            why = getattr(model, "unquantizable_reason", lambda _: None)(name)
            raise QuantizationError(f"{config.path}: {name} is marked {scheme}, but " + (
                why or f"{type(model).__name__} has no such linear layer"))
        module_name = found[0].rpartition(".")[0]
        previous = groups.setdefault(module_name, (scheme, []))
        if previous[0] != scheme:
            raise QuantizationError(f"{config.path}: the pieces of {module_name} ({', '.join(previous[1] + [name])}) "
                                    f"are marked {previous[0]} and {scheme}: one fused layer takes one scheme")
        previous[1].append(name)
    # A fused projection is quantized whole or not at all.
    for name, scheme in config.tensors.items():
        if scheme == FLOAT and name.endswith(".weight"):
            found = model.checkpoint_target(name)
            if found is not None and found[0].rpartition(".")[0] in groups:
                raise QuantizationError(f"{config.path}: {name} is FLOAT but the other pieces of its fused layer "
                                        f"{found[0].rpartition('.')[0]} are quantized")
    return groups


def check_description(config: QuantConfig, dtypes: dict[str, str]) -> None:
    """Every tensor the description names is in the checkpoint, and every quantized layer has the
    tensors its scheme reads, int8 weights among them."""
    missing = sorted(set(config.tensors) - set(dtypes))
    if missing:
        raise QuantizationError(f"{config.path} names tensors the checkpoint does not have: "
                                f"{', '.join(missing[:10])}" + (" ..." if len(missing) > 10 else ""))
    for name, scheme in config.quantized_weights().items():
        if dtypes[name] != "I8":
            raise QuantizationError(f"{name} is marked {scheme} but its checkpoint dtype is {dtypes[name]}, not int8")
        base = name[:-len("weight")]
        absent = [base + kind for kind in linear_method_class(scheme).checkpoint_tensors if base + kind not in dtypes]
        if absent:
            raise QuantizationError(f"{name} is marked {scheme} but the checkpoint lacks {', '.join(absent)}")


__all__ = ["MsModelSlimConfig", "OnTheFlyConfig", "language_model_linears", "quantization_config"]
