"""Plain-torch kernels: the CPU and CUDA implementations of every op (SDPA for attention)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from atb_plugin.utils import cdiv


def write_kv_cache(key, value, key_cache, value_cache, slot_mapping) -> None:
    valid = slot_mapping >= 0
    if not bool(valid.all()):
        key, value, slot_mapping = key[valid], value[valid], slot_mapping[valid]
    num_kv_heads, head_dim = key_cache.shape[-2:]
    key_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, key.to(key_cache.dtype))
    value_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, value.to(value_cache.dtype))


def _gather_request_kv(cache: torch.Tensor, block_table: torch.Tensor, seq_len: int) -> torch.Tensor:
    block_size = cache.shape[1]
    blocks = block_table[: cdiv(seq_len, block_size)].long()
    return cache[blocks].flatten(0, 1)[:seq_len]  # (seq_len, num_kv_heads, head_dim)


def _sdpa(query, key, value, scale, mask):
    """(q_len, H, D) x (k_len, Hkv, D) with GQA; mask (q_len, k_len) bool or None."""
    # 4-D (1, H, L, D): on CPU, 3-D inputs fall back to SDPA's unfused math path (~1.4x slower
    # for BERT-sized heads, measured with benchmarks/bench_embed.py's profile).
    out = F.scaled_dot_product_attention(
        query.transpose(0, 1)[None], key.transpose(0, 1)[None], value.transpose(0, 1)[None], attn_mask=mask,
        scale=scale, enable_gqa=query.shape[1] != key.shape[1],
    )
    return out[0].transpose(0, 1)


def _batched_decode(query, key_cache, value_cache, block_tables, seq_lens, max_seq_len, scale):
    """One query token per request, all requests in one SDPA call over their padded contexts."""
    block_size = key_cache.shape[1]
    num_blocks = cdiv(max_seq_len, block_size)
    tables = block_tables[:, :num_blocks].long()
    key = key_cache[tables].flatten(1, 2)[:, :max_seq_len]  # (B, max_seq_len, Hkv, D)
    value = value_cache[tables].flatten(1, 2)[:, :max_seq_len]
    # The new token is the last of its sequence: it sees every cached position < seq_len.
    mask = torch.arange(max_seq_len, device=query.device)[None, :] < seq_lens[:, None].to(query.device)
    out = F.scaled_dot_product_attention(
        query.unsqueeze(2), key.transpose(1, 2), value.transpose(1, 2), attn_mask=mask[:, None, None, :],
        scale=scale, enable_gqa=query.shape[1] != key.shape[2],
    )
    return out.squeeze(2)  # (B, H, D)


def paged_attention(query, key_cache, value_cache, metadata, scale) -> torch.Tensor:
    out = torch.empty_like(query)
    starts = metadata.query_start_loc_cpu.tolist()
    seq_lens = metadata.seq_lens_cpu.tolist()
    query_lens = [end - start for start, end in zip(starts[:-1], starts[1:])]
    # Decodes (one new token) are the bulk of a busy batch: one batched call for all of them;
    # prefill chunks, few and long, go one by one (padding them together would waste memory).
    decodes = [r for r, q_len in enumerate(query_lens) if q_len == 1]
    if len(decodes) > 1:
        index = torch.tensor(decodes, device=query.device)
        tokens = torch.tensor([starts[r] for r in decodes], device=query.device)
        lens = metadata.seq_lens_cpu[decodes]
        out[tokens] = _batched_decode(query[tokens], key_cache, value_cache, metadata.block_tables[index],
                                      lens, int(lens.max()), scale)
    for r, seq_len in enumerate(seq_lens):
        start, end = starts[r], starts[r + 1]
        q_len = end - start
        if q_len == 0 or (q_len == 1 and len(decodes) > 1):
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
