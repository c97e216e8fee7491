"""PEFT adapters on disk: ``adapter_config.json`` and ``adapter_model.safetensors``, read and
checked against the base model without torch (the frontends check an adapter before any request
uses it: a bad one is a 400 naming what is wrong, never a failed step).

What is served (docs/lora.md): LoRA on the decoder's linear layers (``q_proj``, ``k_proj``,
``v_proj``, ``o_proj``, ``gate_proj``, ``up_proj``, ``down_proj``; the fused ``qkv_proj`` /
``gate_up_proj`` take the pieces), per-module ranks and alphas (``rank_pattern``,
``alpha_pattern``), rsLoRA scaling. Refused, each with its own message: a rank above
``max_lora_rank``, a target module the model lacks, the vision / audio towers, mixture-of-experts
MLPs, tensors whose shapes are not the model's (an adapter of another base model), DoRA, trained
biases or saved modules, and files that are missing or not what their header says.
"""

from __future__ import annotations

import json
import math
import os
import re
import struct
from dataclasses import dataclass
from pathlib import Path

from atb_plugin.models import registry

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
# PEFT's module name -> the layer that serves it here and its piece of that layer's output.
TARGETS: dict[str, tuple[str, int]] = {
    "q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2), "o_proj": ("o_proj", 0),
    "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1), "down_proj": ("down_proj", 0),
}
# How many pieces each served layer has (its slices).
SLICES = {"qkv_proj": 3, "o_proj": 1, "gate_up_proj": 2, "down_proj": 1}
# Parts of multimodal checkpoints that adapters may not touch: they are not adapted here.
_TOWERS = ("visual", "vision_tower", "vision_model", "vision_encoder", "audio_tower", "multi_modal_projector",
           "mm_projector", "audio_encoder")
_KEY = re.compile(r"^base_model\.model\.(?P<module>(?:.*\.)?layers\.(?P<layer>\d+)\.(?P<block>[\w.]+?)\.(?P<name>\w+))"
                  r"\.lora_(?P<ab>[AB])\.weight$")
_SAFETENSORS_FLOATS = {"F32": 4, "F16": 2, "BF16": 2}


class LoRAError(ValueError):
    """An adapter that cannot be served here: the message names the adapter and what is wrong
    (HTTP 400)."""


@dataclass(frozen=True)
class ModuleLoRA:
    """One adapted module: layer ``layer``'s PEFT module ``name``, its rank and scale
    (``lora_alpha / r``, or ``/ sqrt(r)`` under rsLoRA), and its two tensors' names in the file."""

    layer: int
    name: str
    rank: int
    scale: float
    key_a: str
    key_b: str


@dataclass(frozen=True)
class AdapterInfo:
    """An adapter checked against a base model: where it is, its modules, its largest rank."""

    path: str
    modules: tuple[ModuleLoRA, ...]
    max_rank: int
    base_model_name_or_path: str | None


def model_shapes(hf_config: dict) -> dict[str, tuple[int, int]]:
    """(in_features, out_features) of each PEFT module name of the base model's decoder layers."""
    value = lambda key, default=None: registry.config_value(hf_config, key, default)  # noqa: E731
    hidden, heads = value("hidden_size"), value("num_attention_heads")
    head_dim = value("head_dim") or hidden // heads
    kv = value("num_key_value_heads") or heads
    inter = value("intermediate_size")
    return {"q_proj": (hidden, heads * head_dim), "k_proj": (hidden, kv * head_dim), "v_proj": (hidden, kv * head_dim),
            "o_proj": (heads * head_dim, hidden), "gate_proj": (hidden, inter), "up_proj": (hidden, inter),
            "down_proj": (inter, hidden)}


def _pattern_value(patterns: dict, module: str, default):
    """PEFT's ``rank_pattern`` / ``alpha_pattern`` lookup: the first key that matches the end of
    the module's path (a key starting with ``^`` matches from its start), else ``default``."""
    for key, value in patterns.items():
        if (re.match(key, module) if key.startswith("^") else re.match(rf"(^|.*\.){key}$", module)):
            return value
    return default


def read_safetensors_header(path: Path) -> dict[str, dict]:
    """The tensors a safetensors file declares (name -> dtype, shape, data_offsets), checked to
    cover the file exactly: a truncated, padded or garbled file is refused here."""
    try:
        with open(path, "rb") as f:
            raw = f.read(8)
            if len(raw) != 8:
                raise ValueError("shorter than its 8-byte header length")
            (length,) = struct.unpack("<Q", raw)
            size = os.fstat(f.fileno()).st_size
            if length > size - 8:
                raise ValueError(f"header of {length} bytes in a {size}-byte file")
            header = json.loads(f.read(length))
    except (OSError, ValueError, UnicodeDecodeError) as error:
        raise LoRAError(f"{path}: not a readable safetensors file ({error})") from None
    if not isinstance(header, dict):
        raise LoRAError(f"{path}: not a safetensors file (its header is not a table)")
    header.pop("__metadata__", None)
    end = 0
    for name, entry in header.items():
        try:
            begin, stop = entry["data_offsets"]
            count = math.prod(entry["shape"]) * _SAFETENSORS_FLOATS[entry["dtype"]]
        except (KeyError, TypeError, ValueError):
            raise LoRAError(f"{path}: tensor {name!r} is not a float tensor of F32 / F16 / BF16 with a shape "
                            f"and offsets ({entry!r})") from None
        if stop - begin != count or begin < 0:
            raise LoRAError(f"{path}: tensor {name!r} declares {stop - begin} bytes for shape {entry['shape']}")
        end = max(end, stop)
    if 8 + length + end != size:
        raise LoRAError(f"{path}: the file is {size} bytes, its header says {8 + length + end} (truncated or "
                        "corrupt)")
    return header


def read_adapter_config(path: Path) -> dict:
    try:
        config = json.loads((path / CONFIG_FILE).read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise LoRAError(f"{path}: no {CONFIG_FILE} (not a PEFT adapter directory)") from None
    except (OSError, ValueError) as error:
        raise LoRAError(f"{path / CONFIG_FILE}: not readable JSON ({error})") from None
    if not isinstance(config, dict):
        raise LoRAError(f"{path / CONFIG_FILE}: expected a JSON object")
    kind = config.get("peft_type", "LORA")
    if str(kind).upper() != "LORA":
        raise LoRAError(f"{path}: peft_type {kind!r}; only LORA adapters are served")
    for flag, why in (("use_dora", "DoRA"), ("modules_to_save", "saved full modules")):
        if config.get(flag):
            raise LoRAError(f"{path}: {why} ({flag}) are not served; only low-rank A/B pairs are")
    if config.get("bias", "none") != "none":
        raise LoRAError(f"{path}: trained biases (bias={config['bias']!r}) are not served")
    for key in ("r", "lora_alpha"):
        if key in config and (not isinstance(config[key], (int, float)) or config[key] <= 0):
            raise LoRAError(f"{path / CONFIG_FILE}: {key} = {config[key]!r}, expected a positive number")
    return config


def _check_targets(path: Path, targets, shapes: dict) -> None:
    """Each named target module must be a linear layer the model adapts (a regex string or
    "all-linear" is checked through the file's tensors instead)."""
    if isinstance(targets, str) or targets is None:
        return
    for target in targets:
        last = str(target).split(".")[-1]
        if any(tower in str(target) for tower in _TOWERS):
            raise LoRAError(f"{path}: target module {target!r} is in a vision / audio tower; only the language "
                            "model's layers are adapted")
        if last not in shapes:
            raise LoRAError(f"{path}: target module {target!r} is not a layer the model adapts (expected some of "
                            f"{', '.join(shapes)})")


def inspect_adapter(path, hf_config: dict, max_lora_rank: int) -> AdapterInfo:
    """Check the adapter in directory ``path`` against the base model's ``hf_config`` and
    ``max_lora_rank``; ``LoRAError`` naming the adapter and the problem (module docstring)."""
    path = Path(path)
    if not path.is_dir():
        raise LoRAError(f"LoRA adapter {str(path)!r}: no such directory")
    config = read_adapter_config(path)
    weights = path / WEIGHTS_FILE
    if not weights.is_file():
        other = " (adapter_model.bin, a pickle, is not loaded: save with safe_serialization)" if (
            path / "adapter_model.bin").exists() else ""
        raise LoRAError(f"{path}: no {WEIGHTS_FILE}{other}")
    shapes = model_shapes(hf_config)
    _check_targets(path, config.get("target_modules"), shapes)
    header = read_safetensors_header(weights)
    num_layers = registry.config_value(hf_config, "num_hidden_layers")
    moe = isinstance(registry.config_value(hf_config, "num_experts", registry.config_value(
        hf_config, "num_local_experts")), int)
    pairs: dict[tuple[int, str], dict[str, tuple[str, list[int]]]] = {}
    for key, entry in header.items():
        if any(f"{tower}." in key or f".{tower}" in key for tower in _TOWERS):
            raise LoRAError(f"{path}: {key} adapts a vision / audio tower; only the language model is adapted")
        match = _KEY.match(key)
        if match is None:
            raise LoRAError(f"{path}: tensor {key!r} is not a LoRA A/B weight of a decoder layer "
                            "(base_model.model.<module>.lora_A/B.weight)")
        block, name, layer = match["block"], match["name"], int(match["layer"])
        if "experts" in block or (moe and block.startswith("mlp")):
            raise LoRAError(f"{path}: {key} adapts a mixture-of-experts MLP; LoRA is served on the attention "
                            "layers of MoE models only")
        if block not in ("self_attn", "mlp") or name not in shapes:
            raise LoRAError(f"{path}: target module {match['module']!r} is not a layer the model adapts")
        if not 0 <= layer < num_layers:
            raise LoRAError(f"{path}: {key} is for layer {layer}; the base model has {num_layers} layers "
                            "(an adapter of another base model)")
        pairs.setdefault((layer, name), {})[match["ab"]] = (key, entry["shape"], match["module"])
    modules = []
    for (layer, name), found in sorted(pairs.items()):
        if set(found) != {"A", "B"}:
            raise LoRAError(f"{path}: layer {layer} {name} has lora_{''.join(found)} but not its pair")
        (key_a, shape_a, module), (key_b, shape_b, _) = found["A"], found["B"]
        in_features, out_features = shapes[name]
        rank = shape_a[0] if len(shape_a) == 2 else -1
        if len(shape_a) != 2 or len(shape_b) != 2 or shape_b[1] != rank:
            raise LoRAError(f"{path}: {key_a} {shape_a} and {key_b} {shape_b} are not a rank-r pair")
        if shape_a[1] != in_features or shape_b[0] != out_features:
            raise LoRAError(f"{path}: base-model mismatch: {name} of layer {layer} is ({shape_b[0]} x {rank}) @ "
                            f"({rank} x {shape_a[1]}), the base model's {name} maps {in_features} -> {out_features} "
                            f"features (adapter made for {config.get('base_model_name_or_path')!r})")
        declared = _pattern_value(config.get("rank_pattern") or {}, module, config.get("r", rank))
        if declared != rank:
            raise LoRAError(f"{path}: {module} has rank {rank} in {WEIGHTS_FILE}, {declared} in {CONFIG_FILE}")
        if rank > max_lora_rank:
            raise LoRAError(f"{path}: {module} has rank {rank}, above max_lora_rank {max_lora_rank} "
                            "(--max-lora-rank)")
        alpha = _pattern_value(config.get("alpha_pattern") or {}, module, config.get("lora_alpha", rank))
        scale = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
        modules.append(ModuleLoRA(layer, name, rank, float(scale), key_a, key_b))
    if not modules:
        raise LoRAError(f"{path}: {WEIGHTS_FILE} holds no LoRA weights")
    return AdapterInfo(str(path), tuple(modules), max(m.rank for m in modules), config.get("base_model_name_or_path"))


def check_allowed(path: str, allowed_dirs) -> str:
    """``path`` resolved (links followed), refused unless it lies under one of ``allowed_dirs``."""
    real = os.path.realpath(path)
    for root in allowed_dirs:
        root = os.path.realpath(root)
        if real == root or real.startswith(root.rstrip(os.sep) + os.sep):
            return real
    raise LoRAError(f"LoRA adapter path {path!r} is outside the allowed directories "
                    f"({', '.join(allowed_dirs) or 'none: start the server with --allowed-lora-dirs'})")
