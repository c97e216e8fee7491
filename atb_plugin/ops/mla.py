"""Multi-head latent attention (DeepSeek-V2 / V3) over the latent paged KV cache.

The cache of one layer is two tensors in vllm-ascend's MLA block layout, one row per token shared
by every head (not one per head)::

    kv_c_cache  (num_blocks, block_size, 1, kv_lora_rank)      the normalised latent c_kv
    k_pe_cache  (num_blocks, block_size, 1, qk_rope_head_dim)  the rotated shared rope key

A token costs ``kv_lora_rank + qk_rope_head_dim`` values per layer (576 on DeepSeek-V3, against
128 heads x (192 + 128) = 40960 for the same attention as plain MHA). Slots, block tables and
the metadata are the paged cache's (``ops/attention.py``).

Two forms of the same attention (docs/architecture.md, "Latent cache and the two MLA forms"):

- **expanded** (prefill): the context's latents are gathered (``mla_gather_context``) and
  expanded into per-head keys and values by ``kv_b_proj`` (``k_nope``, ``v``), then ordinary
  causal attention with the shared rope key (``mla_expanded_attention``): cheap when many new
  tokens share one expansion;
- **absorbed** (decode): ``W_UK`` (the key half of ``kv_b_proj``) is folded into the query,
  ``q_lat = q_nope @ W_UK`` (per head, ``kv_lora_rank`` wide), so attention runs directly over
  the cached latents as multi-query attention with one KV "head" of key ``[c_kv, k_pe]`` and
  value ``c_kv`` (``mla_absorbed_attention``); ``W_UV`` is applied to the latent output
  afterwards. Nothing is expanded per cached token: what vLLM and vllm-ascend run for decode.

Rope: DeepSeek's checkpoints rotate interleaved pairs ``(x0, x1), (x2, x3), ...``; the kernels
de-interleave first (evens, then odds) and rotate the halves, exactly as
``npu_kv_rmsnorm_rope_cache`` and transformers' ``apply_rotary_pos_emb_interleave`` do: queries
and keys are permuted alike, so every dot product is the checkpoint's.
"""

from __future__ import annotations

import torch

from atb_plugin.ops.attention import AttentionMetadata
from atb_plugin.ops.torch_kernels import deinterleave  # a layout permutation, the same on every platform
from atb_plugin.platform import current_platform

__all__ = ["deinterleave", "mla_absorbed_attention", "mla_expanded_attention", "mla_gather_context",
           "mla_write_latent"]


def mla_write_latent(latent: torch.Tensor, gamma: torch.Tensor, eps: float, cos: torch.Tensor, sin: torch.Tensor,
                     kv_c_cache: torch.Tensor, k_pe_cache: torch.Tensor, slot_mapping: torch.Tensor,
                     interleaved: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """``latent`` ``(T, kv_lora_rank + rope)`` (``kv_a_proj_with_mqa``'s output): RMSNorm of the
    first ``kv_lora_rank`` columns with ``gamma``, rope of the rest (``cos`` / ``sin`` ``(T,
    rope)``; ``interleaved``: the checkpoint's pair layout, de-interleaved first), both written
    to the caches at ``slot_mapping`` (-1: not written). Returns ``(c_kv (T, R), k_pe (T, P))``."""
    return current_platform().kernels.mla_write_latent(latent, gamma, eps, cos, sin, kv_c_cache, k_pe_cache,
                                                       slot_mapping, interleaved)


def mla_absorbed_attention(q_latent: torch.Tensor, q_pe: torch.Tensor, kv_c_cache: torch.Tensor,
                           k_pe_cache: torch.Tensor, metadata: AttentionMetadata, scale: float) -> torch.Tensor:
    """Causal attention of ``q_latent`` ``(T, H, R)`` (W_UK folded in) and ``q_pe`` ``(T, H, P)``
    over each request's cached latents: ``softmax(scale * (q_latent . c_kv + q_pe . k_pe)) @
    c_kv``. Returns ``(T, H, R)`` (W_UV is the caller's)."""
    return current_platform().kernels.mla_absorbed_attention(q_latent, q_pe, kv_c_cache, k_pe_cache, metadata,
                                                             scale)


def mla_gather_context(kv_c_cache: torch.Tensor, k_pe_cache: torch.Tensor,
                       metadata: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
    """The cached latents of every request that has new tokens this step, request after request,
    each its ``seq_len`` tokens (cached and new): ``(c_kv (S, R), k_pe (S, P))``."""
    return current_platform().kernels.mla_gather_context(kv_c_cache, k_pe_cache, metadata)


def mla_expanded_attention(q_nope: torch.Tensor, q_pe: torch.Tensor, k_nope: torch.Tensor, k_pe: torch.Tensor,
                           value: torch.Tensor, metadata: AttentionMetadata, scale: float) -> torch.Tensor:
    """Causal attention with per-head keys ``[k_nope (S, H, N), k_pe (S, P) shared]`` and values
    ``(S, H, V)`` laid out as ``mla_gather_context`` returns them; queries ``[q_nope (T, H, N),
    q_pe (T, H, P)]``; request r's new tokens are the last of its context. Returns ``(T, H, V)``."""
    return current_platform().kernels.mla_expanded_attention(q_nope, q_pe, k_nope, k_pe, value, metadata, scale)
