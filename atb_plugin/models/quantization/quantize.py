"""Putting quantized layers into a model: on the fly over a loaded float model
(``quantize_model``, ``--quantization w8a16|w8a8`` on a float checkpoint), or before an
msModelSlim checkpoint loads (``prepare_checkpoint_layers``: the loader then fills them).

Which layers, on the fly: the language model's decoder projections, ``qkv_proj``, ``o_proj``,
``gate_up_proj``, ``down_proj`` of every dense decoder layer (every family's language model is a
``decoder.DecoderForCausalLM``), and the LM head only when asked (``quantize_lm_head``: vLLM and
msModelSlim leave it float by default, as llama.cpp's Q8_0 does not). Vision and audio towers,
projectors, the input embedding and mixture-of-experts layers (experts, shared expert, router)
stay float (docs/quantization.md).

Weights: symmetric per output channel, ``scale = max|W[n, :]| / 127`` (1 for an all-zero row),
``W_q = clamp(round(W / scale), -127, 127)``, offset zero; ``export.py`` writes exactly these
tensors, so an exported checkpoint and the same float checkpoint quantized on the fly hold
bit-identical weights and scales. Under tensor parallelism the swap runs on each rank's shard:
a column-parallel layer's rows are whole, so their scales are; a row-parallel layer
(``o_proj``, ``down_proj``, split along ``in``) takes each row's maximum over all ranks (one
all-gather of ``(out, 1)`` per layer at load), so every rank's scales are the unsplit layer's,
as they are when a quantized checkpoint is loaded.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
from safetensors import safe_open
from torch import nn

from atb_plugin.distributed import all_gather, tp_size
from atb_plugin.models.quantization.config import (FLOAT, ON_THE_FLY_SCHEME, W8A8, W8A8_DYNAMIC, W8A16, QuantConfig,
                                            QuantizationError, check_method)
from atb_plugin.models.quantization.layers import QuantLinear, layer_class

logger = logging.getLogger(__name__)

# The tensors each scheme's layer reads from a checkpoint besides ``weight`` (and ``bias``).
SCHEME_TENSORS = {
    W8A16: ("weight_scale", "weight_offset"),
    W8A8_DYNAMIC: ("weight_scale", "weight_offset"),
    W8A8: ("weight_scale", "weight_offset", "input_scale", "input_offset", "deq_scale", "quant_bias"),
}


def channel_absmax(weight: torch.Tensor) -> torch.Tensor:
    """``max|W[n, :]|`` as float32 ``(out, 1)``."""
    return weight.detach().to(torch.float32).abs().amax(dim=1, keepdim=True)


def quantize_weight(weight: torch.Tensor, absmax: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-channel int8: ``(W_q int8 (out, in), scale float32 (out, 1))`` (module
    docstring). ``absmax``: the rows' maxima when they come from more than ``weight`` (a
    row-parallel shard); default ``channel_absmax(weight)``."""
    if absmax is None:
        absmax = channel_absmax(weight)
    scale = torch.where(absmax > 0, absmax / 127.0, torch.ones_like(absmax))
    q = torch.clamp(torch.round(weight.detach().to(torch.float32) / scale), -127, 127).to(torch.int8)
    return q, scale


def quantized_from_float(linear: nn.Linear, scheme: str, absmax: torch.Tensor | None = None) -> QuantLinear:
    """A W8A16 / W8A8_DYNAMIC layer holding ``linear``'s weight quantized (its bias as it is)."""
    if scheme == W8A8:
        raise QuantizationError("static W8A8 needs calibrated activation scales: export it "
                                "(python -m atb_plugin.models.quantization.export --method w8a8)")
    weight = linear.weight
    layer = layer_class(scheme)(linear.in_features, linear.out_features, linear.bias is not None,
                                device=weight.device)
    q, scale = quantize_weight(weight, absmax)
    with torch.no_grad():
        layer.weight.copy_(q)
        layer.weight_scale.copy_(scale)
        if linear.bias is not None:
            layer.bias.data = linear.bias.detach().clone()
    return layer


@dataclass(frozen=True)
class LinearSlot:
    """One quantizable linear: ``getattr(parent, name)``; ``path`` its module name in the model;
    ``row_parallel``: split along its input features under tensor parallelism."""

    parent: nn.Module
    name: str
    path: str
    row_parallel: bool


def _is_row_parallel(parent: nn.Module, name: str) -> bool:
    from atb_plugin.models.weights import ShardedWeights  # models import this package: loaded on use

    if tp_size() == 1 or not isinstance(parent, ShardedWeights):
        return False
    split = parent.tp_shard(name, "weight", None)
    return split is not None and split.dim == 1


def language_model_linears(model: nn.Module) -> list[LinearSlot]:
    """The language model's decoder projections (module docstring), in layer order."""
    from atb_plugin.models.decoder import MLP  # models import this package: loaded on use

    language_model = model.get_language_model()
    prefix = next(name for name, module in model.named_modules() if module is language_model)
    prefix = f"{prefix}." if prefix else ""
    slots = []
    for index, layer in enumerate(language_model.model.layers):
        base = f"{prefix}model.layers.{index}"
        owners = [("self_attn", layer.self_attn, ("qkv_proj", "o_proj"))]
        if isinstance(layer.mlp, MLP):  # a dense layer; MoE layers stay float
            owners.append(("mlp", layer.mlp, ("gate_up_proj", "down_proj")))
        for owner_name, owner, names in owners:
            slots += [LinearSlot(owner, name, f"{base}.{owner_name}.{name}", _is_row_parallel(owner, name))
                      for name in names]
    return slots


def quantize_model(model: nn.Module, method: str, lm_head: bool = False) -> int:
    """Swap the language model's float projections for ``method``'s layers (``--quantization``
    on a float checkpoint), after the weights loaded, and its LM head too with ``lm_head``
    (``--quantize-lm-head``); returns how many were swapped."""
    check_method(method)
    scheme = ON_THE_FLY_SCHEME[method]
    slots = language_model_linears(model)
    for slot in slots:
        linear = getattr(slot.parent, slot.name)
        if type(linear) is not nn.Linear:
            raise QuantizationError(f"{slot.path} is a {type(linear).__name__}, not a float nn.Linear: "
                                    "quantize before the platform rewrites the model")
        absmax = channel_absmax(linear.weight)
        if slot.row_parallel:  # each rank holds some columns of every row: the row's maximum over all ranks
            absmax = all_gather(absmax, dim=1).amax(dim=1, keepdim=True)
        setattr(slot.parent, slot.name, quantized_from_float(linear, scheme, absmax))
    if lm_head:
        quantize_lm_head(model, scheme)
    logger.info("quantized %d linear layers on the fly (%s)%s", len(slots), scheme,
                ", and the LM head" if lm_head else "")
    return len(slots) + int(lm_head)


def quantize_lm_head(model: nn.Module, scheme: str) -> None:
    """The language model's LM head in ``scheme``'s layer. A tied head gets an int8 copy of the
    embedding's rows; the embedding keeps its float rows (a lookup reads a row per token, the
    head all of them every step). Vocabulary-parallel shards hold whole rows: their scales are
    the unsplit head's without any exchange."""
    language_model = model.get_language_model()
    language_model.share_tied_lm_head()  # a tied head becomes a module over the embedding's weight
    head = language_model.lm_head
    if type(head) is not nn.Linear:
        raise QuantizationError(f"the LM head is a {type(head).__name__}, not a float nn.Linear: "
                                "quantize before the platform rewrites the model")
    language_model.lm_head = quantized_from_float(head, scheme)


# --------------------------------------------------------------------------------------------
# msModelSlim checkpoints: layers built before the weights load
# --------------------------------------------------------------------------------------------


def checkpoint_tensor_dtypes(model_dir) -> dict[str, str]:
    """``{name: safetensors dtype ("I8", "F32", "I64", ...)}`` of every tensor (headers only)."""
    from atb_plugin.models.weights import checkpoint_files  # models import this package: loaded on use

    dtypes = {}
    for path in checkpoint_files(model_dir):
        with safe_open(str(path), framework="pt") as shard:
            for name in shard.keys():
                dtypes[name] = shard.get_slice(name).get_dtype()
    return dtypes


def _layer_groups(model, config: QuantConfig) -> dict[str, tuple[str, list[str]]]:
    """``{module name: (scheme, [checkpoint weight names])}`` for every layer the description
    marks quantized (the pieces of a fused projection together)."""
    from atb_plugin.models.weights import FusedWeights  # loaded on use (import cycle)

    # Not the model's cached loader: its parameter names are about to change.
    fused = FusedWeights(model, model.stacked_params)
    groups: dict[str, tuple[str, list[str]]] = {}
    for name, scheme in config.quantized_weights().items():
        found = model.checkpoint_target(name, fused)
        if found is None:
            raise QuantizationError(f"{config.path}: {name} is marked {scheme}, but {type(model).__name__} has no "
                                    "such linear layer")
        module_name = found[0].rpartition(".")[0]
        previous = groups.setdefault(module_name, (scheme, []))
        if previous[0] != scheme:
            raise QuantizationError(f"{config.path}: the pieces of {module_name} ({', '.join(previous[1] + [name])}) "
                                    f"are marked {previous[0]} and {scheme}: one fused layer takes one scheme")
        previous[1].append(name)
    # A fused projection is quantized whole or not at all.
    for name, scheme in config.tensors.items():
        if scheme == FLOAT and name.endswith(".weight"):
            found = model.checkpoint_target(name, fused)
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
        absent = [base + kind for kind in SCHEME_TENSORS[scheme] if base + kind not in dtypes]
        if absent:
            raise QuantizationError(f"{name} is marked {scheme} but the checkpoint lacks {', '.join(absent)}")


def prepare_checkpoint_layers(model: nn.Module, config: QuantConfig, model_dir) -> int:
    """Replace every linear the description marks quantized by its scheme's layer, on the meta
    device, before ``to_empty`` and the load (``PretrainedModel.from_pretrained``); returns how
    many were replaced."""
    dtypes = checkpoint_tensor_dtypes(model_dir)
    check_description(config, dtypes)
    for module_name, (scheme, names) in _layer_groups(model, config).items():
        parent_name, _, leaf = module_name.rpartition(".")
        parent = model.get_submodule(parent_name)
        linear = getattr(parent, leaf)
        if type(linear) is not nn.Linear:
            raise QuantizationError(f"{config.path}: {', '.join(names)} marked {scheme}, but {module_name} is a "
                                    f"{type(linear).__name__}: only linear layers are quantized")
        deq_dtypes = {dtypes.get(name[:-len("weight")] + "deq_scale") for name in names} - {None}
        deq_dtype = torch.int64 if deq_dtypes == {"I64"} else torch.float32
        if len(deq_dtypes) > 1:
            raise QuantizationError(f"{module_name}: its pieces store deq_scale as {sorted(deq_dtypes)}: one dtype")
        setattr(parent, leaf, layer_class(scheme)(linear.in_features, linear.out_features, linear.bias is not None,
                                                  device="meta", deq_scale_dtype=deq_dtype))
    return len(config.quantized_weights())


__all__ = ["language_model_linears", "prepare_checkpoint_layers", "quantize_model", "quantize_weight"]
