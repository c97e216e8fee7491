"""Which model class serves a checkpoint, and the facts the engine reads from its config.json.

The engine core resolves its model here from ``config.json`` alone (no tokenizer, no router):
routers are the frontend's. ``routers`` reuses this table, so a family is registered once.
"""

from __future__ import annotations

import importlib
import json
from pathlib import Path

# registry key -> "module:Class" (imported only when asked for)
MODEL_CLASSES: dict[str, str] = {
    "qwen2": "atb_plugin.models.qwen2:Qwen2ForCausalLM",
    "llama": "atb_plugin.models.llama:LlamaForCausalLM",
    "qwen3": "atb_plugin.models.qwen3:Qwen3ForCausalLM",
    "qwen3_moe": "atb_plugin.models.qwen3:Qwen3MoeForCausalLM",
    "qwen2_moe": "atb_plugin.models.qwen3:Qwen2MoeForCausalLM",
    "qwen2_vl": "atb_plugin.models.qwen2_vl:Qwen2VLForConditionalGeneration",
    "qwen2_5_vl": "atb_plugin.models.qwen2_vl:Qwen2VLForConditionalGeneration",
    "qwen3_vl": "atb_plugin.models.qwen3_vl:Qwen3VLForConditionalGeneration",
    "qwen3_vl_moe": "atb_plugin.models.qwen3_vl:Qwen3VLMoeForConditionalGeneration",
    "llava": "atb_plugin.models.llava:LlavaForConditionalGeneration",
    "qwen_vl": "atb_plugin.models.qwen_vl:QwenVLForCausalLM",
    "qwen2_audio": "atb_plugin.models.qwen2_audio:Qwen2AudioForConditionalGeneration",
    "bert": "atb_plugin.models.bert:BertModel",
    "deepseek_v2": "atb_plugin.models.deepseek:DeepseekV2ForCausalLM",
    "deepseek_v3": "atb_plugin.models.deepseek:DeepseekV3ForCausalLM",
}


# Native pooling models, by architecture name (config.json's ``architectures[0]``): served as they
# are with ``runner="pooling"``. Any other architecture of a family above is its generative class,
# which ``atb_plugin.models.pooling_adapters`` converts when the runner is "pooling".
POOLING_CLASSES: dict[str, str] = {
    "BertModel": "atb_plugin.models.bert:BertEmbeddingModel",
    "BertForSequenceClassification": "atb_plugin.models.bert:BertForSequenceClassification",
    "Qwen2ForRewardModel": "atb_plugin.models.qwen2:Qwen2ForRewardModel",
}


def read_checkpoint_config(model_dir) -> dict:
    """``config.json`` of ``model_dir`` as a dict; a missing or unreadable file is a ValueError
    naming the path (the user pointed us at the wrong directory)."""
    path = Path(model_dir) / "config.json"
    try:
        with open(path, encoding="utf-8") as file:
            config = json.load(file)
    except FileNotFoundError:
        raise ValueError(f"{path} does not exist: is {model_dir} a checkpoint directory?") from None
    except json.JSONDecodeError as error:
        raise ValueError(f"{path} is not valid JSON: {error}") from error
    if not isinstance(config, dict):
        raise ValueError(f"{path} must hold a JSON object")
    return config


def registry_key(config: dict) -> str | None:
    model_type = config.get("model_type")
    # Qwen-VL calls itself "qwen" like the text-only Qwen-1; its vision tower tells them apart.
    if model_type == "qwen" and "visual" in config:
        return "qwen_vl"
    return model_type


def config_value(config: dict, key: str, default=None):
    """A value from config.json, top level first, then text_config (transformers 5 nests)."""
    for scope in (config, config.get("text_config") or {}):
        if key in scope:
            return scope[key]
    return default


def declared_max_model_len(config: dict) -> int | None:
    """The context window the checkpoint declares."""
    for scope in (config, config.get("text_config") or {}):
        for key in ("max_position_embeddings", "seq_length"):
            if isinstance(scope.get(key), int):
                return scope[key]
    return None


def model_class_path(config: dict, runner: str = "generate") -> str:
    """The class serving a checkpoint: with ``runner="pooling"`` a native pooling class of its
    architecture if there is one, else its family's class (generative; adapted by the engine)."""
    if runner == "pooling" and architecture(config) in POOLING_CLASSES:
        return POOLING_CLASSES[architecture(config)]
    key = registry_key(config)
    if key not in MODEL_CLASSES:
        raise ValueError(f"unsupported model_type {config.get('model_type')!r}; supported: "
                         f"{', '.join(sorted(MODEL_CLASSES))}")
    return MODEL_CLASSES[key]


def architecture(config: dict) -> str:
    """``architectures[0]`` of config.json; without one, the family's registered class name."""
    names = config.get("architectures")
    if isinstance(names, list) and names and isinstance(names[0], str):
        return names[0]
    return MODEL_CLASSES.get(registry_key(config), ":").partition(":")[2]


def import_model_class(path: str) -> type:
    """The class a ``"module:Class"`` path names (imported now)."""
    module_name, _, class_name = path.partition(":")
    return getattr(importlib.import_module(module_name), class_name)
