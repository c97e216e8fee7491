"""PEFT adapters for tests and benchmarks, made on a checkpoint without PEFT installed, and the
reference they are checked against: the checkpoint with an adapter merged into its weights
(``W + scale * B @ A``, computed here in float64, independently of ``atb_plugin.lora``)."""

from __future__ import annotations

import json
import math
import re
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

ALL_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_BLOCK = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn",
          "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}


def _text_config(base: Path) -> dict:
    config = json.loads((base / "config.json").read_text())
    return config.get("text_config") or config


def _shapes(config: dict) -> dict[str, tuple[int, int]]:
    hidden, heads = config["hidden_size"], config["num_attention_heads"]
    head_dim = config.get("head_dim") or hidden // heads
    kv = config.get("num_key_value_heads") or heads
    inter = config["intermediate_size"]
    return {"q_proj": (hidden, heads * head_dim), "k_proj": (hidden, kv * head_dim), "v_proj": (hidden, kv * head_dim),
            "o_proj": (heads * head_dim, hidden), "gate_proj": (hidden, inter), "up_proj": (hidden, inter),
            "down_proj": (inter, hidden)}


def _pattern(patterns: dict, module: str, default):
    for key, value in patterns.items():
        if re.match(rf"(^|.*\.){key}$", module):
            return value
    return default


def make_adapter(out: str | Path, base: str | Path, *, r: int = 8, lora_alpha: float = 16,
                 target_modules=ALL_TARGETS, rank_pattern: dict | None = None, alpha_pattern: dict | None = None,
                 use_rslora: bool = False, seed: int = 0, std: float = 0.1, prefix: str = "model",
                 dtype=torch.float32, extra_tensors: dict | None = None, config_overrides: dict | None = None) -> Path:
    """Write a PEFT LoRA adapter for checkpoint ``base`` into ``out`` (random A and non-zero B,
    ``std`` each); ``prefix``: the decoder's path in the base model ("model"; a VL model's
    "model.language_model" or "language_model.model")."""
    out, base = Path(out), Path(base)
    out.mkdir(parents=True, exist_ok=True)
    config = _text_config(base)
    shapes = _shapes(config)
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(config["num_hidden_layers"]):
        for name in target_modules:
            module = f"{prefix}.layers.{layer}.{_BLOCK[name]}.{name}"
            rank = _pattern(rank_pattern or {}, module, r)
            in_features, out_features = shapes[name]
            key = f"base_model.model.{module}"
            tensors[f"{key}.lora_A.weight"] = (torch.randn(rank, in_features, generator=generator) * std).to(dtype)
            tensors[f"{key}.lora_B.weight"] = (torch.randn(out_features, rank, generator=generator) * std).to(dtype)
    tensors.update(extra_tensors or {})
    save_file(tensors, str(out / "adapter_model.safetensors"))
    adapter_config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": str(base), "r": r,
                      "lora_alpha": lora_alpha, "target_modules": list(target_modules), "lora_dropout": 0.0,
                      "bias": "none", "rank_pattern": rank_pattern or {}, "alpha_pattern": alpha_pattern or {},
                      "use_rslora": use_rslora, **(config_overrides or {})}
    (out / "adapter_config.json").write_text(json.dumps(adapter_config))
    return out


def merge_adapter(out: str | Path, base: str | Path, adapter: str | Path) -> Path:
    """Copy checkpoint ``base`` to ``out`` with ``adapter`` merged into its weights: each adapted
    ``W`` becomes ``W + scale * B @ A`` (PEFT's scale: ``alpha / r``, rsLoRA ``alpha / sqrt(r)``,
    per-module ``rank_pattern`` / ``alpha_pattern``)."""
    out, base, adapter = Path(out), Path(base), Path(adapter)
    shutil.copytree(base, out, dirs_exist_ok=True)
    config = json.loads((adapter / "adapter_config.json").read_text())
    lora = load_file(str(adapter / "adapter_model.safetensors"))
    files = sorted(out.glob("*.safetensors"))
    for file in files:
        state = load_file(str(file))
        for key in list(state):
            module = key.removesuffix(".weight")
            a = lora.get(f"base_model.model.{module}.lora_A.weight")
            if a is None:
                continue
            b = lora[f"base_model.model.{module}.lora_B.weight"]
            rank = a.shape[0]
            alpha = _pattern(config.get("alpha_pattern") or {}, module, config["lora_alpha"])
            scale = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
            merged = state[key].double() + scale * (b.double() @ a.double())
            state[key] = merged.to(state[key].dtype)
        save_file(state, str(file))
    return out
