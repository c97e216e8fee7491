"""Tiny random speculative-decoding heads for the tiny checkpoints (tests, offline), in the layouts
vLLM loads (docs/speculative.md): an EAGLE head, an EAGLE-3 head (own draft vocabulary with
``d2t``, three auxiliary target layers) and a target checkpoint carrying a DeepSeek-V3-style MTP
block. Random weights draft poorly, but losslessness does not depend on the head being trained.

    tiny_eagle_head("llama")              EAGLE head for tiny_checkpoint("llama")
    tiny_eagle_head("llama", eagle3=True) EAGLE-3 head
    tiny_mtp_checkpoint("qwen2")          tiny_checkpoint("qwen2") + num_nextn_predict_layers 1

Built once per process (a temporary directory removed at exit)."""

from __future__ import annotations

import atexit
import functools
import json
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from atb_plugin.testing import tiny

# EAGLE-3's auxiliary layers for a 2-layer tiny target: the embeddings, and each layer's output.
TINY_AUX_LAYER_IDS = [0, 1, 2]


def _layer_tensors(config: dict, prefix: str, qkv_in: int, qkv_bias: bool) -> dict[str, tuple[int, ...]]:
    hidden, inter = config["hidden_size"], config["intermediate_size"]
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    head_dim = config.get("head_dim") or hidden // heads
    shapes = {
        "self_attn.q_proj.weight": (heads * head_dim, qkv_in),
        "self_attn.k_proj.weight": (kv_heads * head_dim, qkv_in),
        "self_attn.v_proj.weight": (kv_heads * head_dim, qkv_in),
        "self_attn.o_proj.weight": (hidden, heads * head_dim),
        "mlp.gate_proj.weight": (inter, hidden),
        "mlp.up_proj.weight": (inter, hidden),
        "mlp.down_proj.weight": (hidden, inter),
        "post_attention_layernorm.weight": (hidden,),
    }
    if qkv_bias:
        shapes.update({f"self_attn.{p}_proj.bias": (shapes[f"self_attn.{p}_proj.weight"][0],) for p in "qkv"})
    return {prefix + name: shape for name, shape in shapes.items()}


def _random(shapes: dict[str, tuple[int, ...]], seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    state = {}
    for name, shape in shapes.items():
        state[name] = torch.empty(shape)
        tiny._fill_(name, state[name], gen)
    return state


def _head_config(target: dict, architecture: str, **extra) -> dict:
    keys = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
            "rms_norm_eps", "rope_theta", "rope_scaling", "max_position_embeddings", "vocab_size", "hidden_act")
    return {**{k: target[k] for k in keys if k in target}, "architectures": [architecture], "model_type": "llama",
            "num_hidden_layers": 1, "tie_word_embeddings": False, "torch_dtype": "float32", **extra}


def _build_eagle(out: Path, family: str, seed: int) -> None:
    target = json.loads((tiny.tiny_checkpoint(family) / "config.json").read_text())
    hidden = target["hidden_size"]
    shapes = {"fc.weight": (hidden, 2 * hidden), "fc.bias": (hidden,),
              **_layer_tensors(target, "layers.0.", hidden, False)}
    save_file(_random(shapes, seed), str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(_head_config(target, "LlamaForCausalLMEagle"), indent=2))


def _build_eagle3(out: Path, family: str, seed: int) -> None:
    target = json.loads((tiny.tiny_checkpoint(family) / "config.json").read_text())
    hidden, vocab = target["hidden_size"], target["vocab_size"]
    draft_vocab = vocab // 2
    shapes = {"fc.weight": (hidden, len(TINY_AUX_LAYER_IDS) * hidden), "norm.weight": (hidden,),
              "lm_head.weight": (draft_vocab, hidden), "midlayer.input_layernorm.weight": (hidden,),
              "midlayer.hidden_norm.weight": (hidden,), **_layer_tensors(target, "midlayer.", 2 * hidden, False)}
    state = _random(shapes, seed)
    # The draft vocabulary: every other target id (d2t[i] = target id - i), t2d its mask.
    kept = torch.arange(draft_vocab) * 2
    state["d2t"] = kept - torch.arange(draft_vocab)
    state["t2d"] = torch.zeros(vocab, dtype=torch.bool).index_fill_(0, kept, True)
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    config = _head_config(target, "LlamaForCausalLMEagle3", draft_vocab_size=draft_vocab,
                          eagle_config={"eagle_aux_hidden_state_layer_ids": TINY_AUX_LAYER_IDS,
                                        "use_aux_hidden_state": True})
    (out / "config.json").write_text(json.dumps(config, indent=2))


def _build_mtp(out: Path, family: str, seed: int) -> None:
    source = tiny.tiny_checkpoint(family)
    shutil.copytree(source, out, dirs_exist_ok=True)
    config = json.loads((source / "config.json").read_text())
    hidden, layers = config["hidden_size"], config["num_hidden_layers"]
    prefix = f"model.layers.{layers}."
    shapes = {prefix + "enorm.weight": (hidden,), prefix + "hnorm.weight": (hidden,),
              prefix + "eh_proj.weight": (hidden, 2 * hidden), prefix + "shared_head.norm.weight": (hidden,),
              prefix + "shared_head.head.weight": (config["vocab_size"], hidden),
              prefix + "input_layernorm.weight": (hidden,),
              **_layer_tensors(config, prefix, hidden, config.get("model_type") == "qwen2")}
    state = {**load_file(str(source / "model.safetensors")), **_random(shapes, seed)}
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps({**config, "num_nextn_predict_layers": 1}, indent=2))


_built: dict[str, Path] = {}


def _cached(name: str, build: Callable[[Path], None]) -> Path:
    """Built once per process, in a directory removed when the process exits (milliseconds to
    build: the tiny targets they sit on are the cached ones)."""
    if name not in _built:
        out = Path(tempfile.mkdtemp(prefix=f"atb-plugin-{name}-"))
        atexit.register(shutil.rmtree, out, ignore_errors=True)
        build(out)
        _built[name] = out
    return _built[name]


def tiny_eagle_head(family: str = "llama", eagle3: bool = False, seed: int = 0) -> Path:
    """A random EAGLE (or EAGLE-3) head for ``tiny_checkpoint(family)``."""
    build = _build_eagle3 if eagle3 else _build_eagle
    return _cached(f"{'eagle3' if eagle3 else 'eagle'}-{family}-{seed}", functools.partial(build, family=family,
                                                                                            seed=seed))


def tiny_mtp_checkpoint(family: str = "qwen2", seed: int = 0) -> Path:
    """``tiny_checkpoint(family)`` with a random MTP block (``num_nextn_predict_layers`` 1)."""
    return _cached(f"mtp-{family}-{seed}", functools.partial(_build_mtp, family=family, seed=seed))
