"""Plain-torch kernels: the CPU and CUDA implementations of every op (SDPA for attention)."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def write_kv_cache(key, value, key_cache, value_cache, slot_mapping) -> None:
    valid = slot_mapping >= 0
    if not bool(valid.all()):
        key, value, slot_mapping = key[valid], value[valid], slot_mapping[valid]
    num_kv_heads, head_dim = key_cache.shape[-2:]
    key_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, key.to(key_cache.dtype))
    value_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, value.to(value_cache.dtype))


def _gather_request_kv(cache: torch.Tensor, block_table: torch.Tensor, seq_len: int) -> torch.Tensor:
    block_size = cache.shape[1]
    blocks = block_table[: -(-seq_len // block_size)].long()
    return cache[blocks].flatten(0, 1)[:seq_len]  # (seq_len, num_kv_heads, head_dim)


def _sdpa(query, key, value, scale, mask):
    """(q_len, H, D) x (k_len, Hkv, D) with GQA; mask (q_len, k_len) bool or None."""
    groups = query.shape[1] // key.shape[1]
    if groups > 1:
        key = key.repeat_interleave(groups, dim=1)
        value = value.repeat_interleave(groups, dim=1)
    out = F.scaled_dot_product_attention(
        query.transpose(0, 1), key.transpose(0, 1), value.transpose(0, 1), attn_mask=mask, scale=scale
    )
    return out.transpose(0, 1)


def paged_attention(query, key_cache, value_cache, metadata, scale) -> torch.Tensor:
    out = torch.empty_like(query)
    starts = metadata.query_start_loc_cpu.tolist()
    for r, seq_len in enumerate(metadata.seq_lens_cpu.tolist()):
        start, end = starts[r], starts[r + 1]
        q_len = end - start
        if q_len == 0:
            continue
        key = _gather_request_kv(key_cache, metadata.block_tables[r], seq_len)
        value = _gather_request_kv(value_cache, metadata.block_tables[r], seq_len)
        # New token j sits at position seq_len - q_len + j and sees keys 0 .. that position.
        query_pos = torch.arange(seq_len - q_len, seq_len, device=query.device)
        mask = torch.arange(seq_len, device=query.device)[None, :] <= query_pos[:, None]
        out[start:end] = _sdpa(query[start:end], key, value, scale, mask)
    return out


def varlen_attention(query, key, value, cu_seqlens, scale, causal=False) -> torch.Tensor:
    out = torch.empty_like(query)
    bounds = cu_seqlens.tolist()
    for start, end in zip(bounds[:-1], bounds[1:]):
        if end == start:
            continue
        mask = None
        if causal:
            length = end - start
            mask = torch.ones(length, length, dtype=torch.bool, device=query.device).tril()
        out[start:end] = _sdpa(query[start:end], key[start:end], value[start:end], scale, mask)
    return out


def rms_norm(x, weight, eps) -> torch.Tensor:
    input_dtype = x.dtype
    hidden = x.float()
    hidden = hidden * torch.rsqrt(hidden.pow(2).mean(-1, keepdim=True) + eps)
    return weight * hidden.to(input_dtype)


def _rotate_half(x):
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rotary(x, cos, sin) -> torch.Tensor:
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return x * cos + _rotate_half(x) * sin


def silu_and_mul(x) -> torch.Tensor:
    half = x.shape[-1] // 2
    return F.silu(x[..., :half]) * x[..., half:]
