"""Qwen3, Qwen3-MoE and Qwen2-MoE (the decoder is shared: see decoder.py; the sparse layers: moe.py).

Qwen3 is the Qwen2 decoder without q/k/v biases (config.json's ``attention_bias``, false on the
published checkpoints) and with a per-head RMSNorm of queries and keys before rotary
(``self_attn.q_norm`` / ``k_norm``, weights of ``head_dim``). Qwen3-MoE adds sparse MLP layers:
router softmax -> top-k -> renormalised when ``norm_topk_prob``, SwiGLU experts of
``moe_intermediate_size``; ``decoder_sparse_step`` / ``mlp_only_layers`` keep some layers dense.
Qwen2-MoE (Qwen1.5-MoE, Qwen2-57B-A14B) is the Qwen2 decoder (q/k/v biases, no q/k norms) with the
same sparse layers plus a shared expert behind a sigmoid gate.
"""

from __future__ import annotations

from atb_plugin.models.decoder import DecoderConfig, DecoderForCausalLM
from atb_plugin.models.moe import ExpertWeightsMixin, MoeConfig

__all__ = ["Qwen2MoeForCausalLM", "Qwen3ForCausalLM", "Qwen3MoeForCausalLM"]


class Qwen3ForCausalLM(DecoderForCausalLM):
    @classmethod
    def config_from_hf(cls, config: dict) -> DecoderConfig:
        return DecoderConfig.from_hf(config, qk_norm=True)


class Qwen3MoeForCausalLM(ExpertWeightsMixin, DecoderForCausalLM):
    """Per-expert checkpoint tensors (``mlp.experts.E.{gate,up,down}_proj.weight``) load into the
    stacked experts of each sparse layer (``ExpertWeightsMixin``); the router is ``mlp.gate``."""

    @classmethod
    def config_from_hf(cls, config: dict) -> DecoderConfig:
        return DecoderConfig.from_hf(config, qk_norm=True, moe=MoeConfig.from_hf(config))


class Qwen2MoeForCausalLM(ExpertWeightsMixin, DecoderForCausalLM):
    @classmethod
    def config_from_hf(cls, config: dict) -> DecoderConfig:
        # q/k/v biases unless config.json says otherwise (transformers' Qwen2MoeConfig.qkv_bias)
        return DecoderConfig.from_hf(config, qkv_bias=config.get("qkv_bias", True), moe=MoeConfig.from_hf(config))
