"""Random checkpoints of a real model's shape for the benchmarks: SmolLM2's tokenizer and
vocabulary (llama.cpp's converter recognises it; the tiny test tokenizer's pre-tokenizer it
refuses), std-0.02 weights, unit norms, fp32 safetensors, written once into the models cache."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

import torch

from atb_plugin.default_model import default_model_dir


def random_checkpoint(name: str, shape: dict, *, qkv_bias: bool) -> Path:
    """``~/.cache/atb-plugin/models/<name>``: SmolLM2's config updated with ``shape`` (a
    ``tie_word_embeddings`` false there adds an LM head), q/k/v biases where ``qkv_bias``, heads of
    ``shape``'s ``head_dim`` (default hidden / heads); the seed is fixed, so a rerun writes the same weights."""
    from safetensors.torch import save_file

    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "atb-plugin" / "models"
    out = base / name
    if (out / ".complete").exists():
        return out
    base.mkdir(parents=True, exist_ok=True)
    source = default_model_dir()
    config = {**json.loads((source / "config.json").read_text()), **shape, "torch_dtype": "float32",
              "attention_bias": qkv_bias}  # SmolLM2's false would drop a Qwen2 shape's biases
    if config.get("rope_scaling") is None:
        config.pop("rope_scaling", None)
    scratch = Path(tempfile.mkdtemp(dir=base, prefix=f".{name}-"))
    for entry in os.listdir(source):
        if entry not in ("config.json", "model.safetensors") and (source / entry).is_file():
            (scratch / entry).write_bytes((source / entry).read_bytes())
    (scratch / "config.json").write_text(json.dumps(config, indent=2))
    gen = torch.Generator().manual_seed(0)
    hidden, inter, vocab = config["hidden_size"], config["intermediate_size"], config["vocab_size"]
    head_dim = config.get("head_dim") or hidden // config["num_attention_heads"]
    q, kv = config["num_attention_heads"] * head_dim, config["num_key_value_heads"] * head_dim

    def w(*shape):
        return torch.randn(*shape, generator=gen) * 0.02

    state = {"model.embed_tokens.weight": w(vocab, hidden), "model.norm.weight": torch.ones(hidden)}
    if not config.get("tie_word_embeddings", True):
        state["lm_head.weight"] = w(vocab, hidden)
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        state.update({p + "input_layernorm.weight": torch.ones(hidden),
                      p + "post_attention_layernorm.weight": torch.ones(hidden),
                      p + "self_attn.q_proj.weight": w(q, hidden), p + "self_attn.k_proj.weight": w(kv, hidden),
                      p + "self_attn.v_proj.weight": w(kv, hidden), p + "self_attn.o_proj.weight": w(hidden, q),
                      p + "mlp.gate_proj.weight": w(inter, hidden), p + "mlp.up_proj.weight": w(inter, hidden),
                      p + "mlp.down_proj.weight": w(hidden, inter)})
        if qkv_bias:
            state.update({p + f"self_attn.{proj}.bias": w(size) for proj, size in
                          (("q_proj", q), ("k_proj", kv), ("v_proj", kv))})
    save_file(state, str(scratch / "model.safetensors"), metadata={"format": "pt"})
    (scratch / ".complete").write_text(f"random weights of the shape {json.dumps(shape)}, seed 0\n")
    try:
        scratch.rename(out)
    except OSError:  # another process finished first
        pass
    return out
