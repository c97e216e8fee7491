"""Ops: one API per op, kernels chosen by the current platform (``atb_plugin.platform``).

- attention: ``write_kv_cache``, ``paged_attention`` (prefill / decode / chunked prefill over the
  paged cache), ``varlen_attention`` (vision encoders), ``AttentionMetadata``;
- ``rms_norm``; rotary (``RotaryEmbedding`` with rope scalings and M-RoPE, ``apply_rotary``);
- ``silu_and_mul``; ``fused_moe`` (router top-k + SwiGLU experts, ``ops/moe.py``), DeepSeek's
  ``grouped_topk`` router and the experts alone (``moe_experts``);
- multi-head latent attention over the latent cache (``ops/mla.py``: ``mla_write_latent``, the
  absorbed and expanded forms);
- quantized linears ``w8a16_linear``, ``w8a8_dynamic_linear``, ``w8a8_static_linear`` (``ops/quant.py``).
"""

from atb_plugin.ops.activation import silu_and_mul
from atb_plugin.ops.attention import AttentionMetadata, paged_attention, varlen_attention, write_kv_cache
from atb_plugin.ops.layernorm import rms_norm
from atb_plugin.ops.mla import (deinterleave, mla_absorbed_attention, mla_expanded_attention, mla_gather_context,
                                mla_write_latent)
from atb_plugin.ops.moe import GroupedRouting, fused_moe, grouped_topk, moe_experts
from atb_plugin.ops.quant import w8a8_dynamic_linear, w8a8_static_linear, w8a16_linear
from atb_plugin.ops.rotary import RotaryEmbedding, apply_rotary

__all__ = [
    "AttentionMetadata",
    "GroupedRouting",
    "RotaryEmbedding",
    "apply_rotary",
    "deinterleave",
    "fused_moe",
    "grouped_topk",
    "mla_absorbed_attention",
    "mla_expanded_attention",
    "mla_gather_context",
    "mla_write_latent",
    "moe_experts",
    "paged_attention",
    "rms_norm",
    "silu_and_mul",
    "varlen_attention",
    "w8a16_linear",
    "w8a8_dynamic_linear",
    "w8a8_static_linear",
    "write_kv_cache",
]
