"""Attention over a paged KV cache, and plain variable-length attention for vision encoders.

KV cache of one layer: two tensors ``(num_blocks, block_size, num_kv_heads, head_dim)`` (the
layout ``torch_npu._npu_reshape_and_cache`` and ``_npu_paged_attention`` use). Block 0 is the
engine's null block. A token's *slot* is ``block_id * block_size + offset``::

    block_table[r] = [7, 2, 9]        request r, block_size 4, seq_len 10
    logical token:  0 1 2 3 | 4 5 6 7 | 8 9
    physical slot: 28 ... 31| 8 ...11 |36 37        slot_mapping holds these for the new tokens

A step's tokens are laid out request after request (``query_start_loc``); request r's new tokens
are the last ``q_len`` of its ``seq_len`` tokens, so prefill, decode and chunked prefill are one
case: causal attention from position ``seq_len - q_len + j`` over cached tokens ``0..seq_len-1``.
Layers write the new K/V first (``write_kv_cache``), then attend (``paged_attention``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from atb_plugin.platform import current_platform
from atb_plugin.utils import cdiv


@dataclass
class AttentionMetadata:
    """Per-step attention inputs (what ``prepare_inputs`` computes). Tensors on the model's device."""

    query_start_loc: torch.Tensor  # (num_reqs + 1,) int32: request r's new tokens are [qsl[r], qsl[r+1])
    seq_lens: torch.Tensor  # (num_reqs,) int32: computed + new tokens of request r
    block_tables: torch.Tensor  # (num_reqs, max_blocks_per_req) int32, padded with 0 (the null block)
    slot_mapping: torch.Tensor  # (num_tokens,) int64: cache slot of each new token; -1 = do not write
    max_query_len: int
    max_seq_len: int
    # CPU copies for kernels that loop over requests or need host-side lengths (no device sync).
    query_start_loc_cpu: torch.Tensor | None = None
    seq_lens_cpu: torch.Tensor | None = None
    # What kernels derive from this step's inputs (masks, host length tensors, gather indices),
    # built lazily by the first layer that needs it and reused by every other layer. Each kernel
    # owns one key and keeps its own staleness check (an engine may update a metadata in place).
    step_cache: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    def __post_init__(self):
        if self.query_start_loc_cpu is None:
            self.query_start_loc_cpu = self.query_start_loc.cpu()
        if self.seq_lens_cpu is None:
            self.seq_lens_cpu = self.seq_lens.cpu()
        if self.query_start_loc.dim() != 1 or self.query_start_loc.numel() != self.seq_lens.numel() + 1:
            raise ValueError("query_start_loc must have num_reqs + 1 entries")

    def derived(self, key: str, device, build):
        """``build()`` once per step for every layer: what a kernel derives from this step's inputs
        (index tensors, masks, host lists), kept in ``step_cache`` under ``key``. Keyed by a
        fingerprint of what it derives from (the host length tensors' identity and version, the
        block table's storage and version counter; no device reads), so a metadata object updated
        in place for a later step is derived afresh."""
        tables, qsl, seq = self.block_tables, self.query_start_loc_cpu, self.seq_lens_cpu
        fingerprint = (id(qsl), qsl._version, qsl.data_ptr(), id(seq), seq._version, seq.data_ptr(),
                       tables.data_ptr(), tables._version, tuple(tables.shape), str(device))
        cached = self.step_cache.get(key)
        if cached is None or cached[0] != fingerprint:
            cached = (fingerprint, build())
            self.step_cache[key] = cached
        return cached[1]

    @property
    def num_reqs(self) -> int:
        return self.seq_lens.numel()

    @property
    def query_lens_cpu(self) -> torch.Tensor:
        return self.query_start_loc_cpu[1:] - self.query_start_loc_cpu[:-1]

    @property
    def num_computed_tokens_cpu(self) -> torch.Tensor:
        return self.seq_lens_cpu - self.query_lens_cpu

    @property
    def is_prefill_only(self) -> bool:
        """Every request starts from an empty cache (plain prefill)."""
        return bool((self.num_computed_tokens_cpu == 0).all())

    @property
    def is_decode_only(self) -> bool:
        return self.max_query_len == 1

    @classmethod
    def for_prefill(cls, seq_lens: list[int], block_size: int, device="cpu", first_block: int = 1):
        """Metadata for fresh prefills of ``seq_lens`` with consecutive blocks (tests, profiling)."""
        blocks_per_req = [cdiv(n, block_size) for n in seq_lens]
        width = max(blocks_per_req)
        tables, slots, next_block = [], [], first_block
        for n, count in zip(seq_lens, blocks_per_req):
            blocks = list(range(next_block, next_block + count))
            next_block += count
            tables.append(blocks + [0] * (width - count))
            slots += [blocks[i // block_size] * block_size + i % block_size for i in range(n)]
        qsl = [0]
        for n in seq_lens:
            qsl.append(qsl[-1] + n)
        return cls(
            query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=device),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
            block_tables=torch.tensor(tables, dtype=torch.int32, device=device),
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
            max_query_len=max(seq_lens),
            max_seq_len=max(seq_lens),
        )


def write_kv_cache(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                   slot_mapping: torch.Tensor) -> None:
    """Store ``key``/``value`` ``(num_tokens, num_kv_heads, head_dim)`` at ``slot_mapping``."""
    current_platform().kernels.write_kv_cache(key, value, key_cache, value_cache, slot_mapping)


def paged_attention(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                    metadata: AttentionMetadata, scale: float) -> torch.Tensor:
    """Causal attention of ``query`` ``(num_tokens, num_heads, head_dim)`` over each request's
    cached K/V (which already holds this step's tokens). Returns ``(num_tokens, num_heads, head_dim)``."""
    return current_platform().kernels.paged_attention(query, key_cache, value_cache, metadata, scale)


def varlen_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, cu_seqlens: torch.Tensor,
                     scale: float, causal: bool = False) -> torch.Tensor:
    """Attention within each segment ``[cu_seqlens[i], cu_seqlens[i+1])`` (vision encoders, window
    attention). ``(num_tokens, num_heads, head_dim)`` in and out; no cache."""
    return current_platform().kernels.varlen_attention(query, key, value, cu_seqlens, scale, causal)
