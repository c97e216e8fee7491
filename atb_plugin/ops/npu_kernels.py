"""NPU kernels: every op of ``atb_plugin.ops`` on the ATB-backed torch_npu ops (same names and
signatures as ``torch_kernels``). torch_npu comes from ``atb_plugin.platform.npu.torch_npu()`` at
call time, never imported here.

- ``write_kv_cache``: ``_npu_reshape_and_cache`` (slots as int32; ``-1`` slots dropped first);
- ``paged_attention``: decode-only batches ``_npu_paged_attention``; prefill-only batches
  ``_npu_flash_attention`` (this step's K/V read back from the cache, causal mask built here as
  vllm-ascend builds it); mixed batches / chunked prefill ``_npu_paged_attention_splitfuse``
  (one causal mask row per query token, picked by its position);
- ``varlen_attention`` (vision encoders): bidirectional ``_npu_flash_attention_unpad``, causal
  ``_npu_flash_attention``;
- ``rms_norm``: ``npu_rms_norm``; ``apply_rotary``: ``npu_rotary_mul`` (BSND with B = 1,
  ``rotary_mode="half"``); ``silu_and_mul``: ``npu_swiglu``.

Our KV cache layout, ``(num_blocks, block_size, num_kv_heads, head_dim)`` ND, is the one ATB's
ReshapeAndCache / PagedAttention take on Atlas A2/A3, so caches pass through unchanged (310P wants
an NZ layout, which is not supported here). ATB's PagedAttention needs ``block_size % 16 == 0``
(128 recommended); ``paged_attention`` refuses other block sizes up front, at the first prefill,
rather than at the first decode.

The lengths ATB reads on the host (``seq_len``, ``context_lens``) come from the metadata's CPU
copies, so attention needs no device sync (``write_kv_cache``'s test for ``-1`` slots is one);
per-step derived tensors (masks, gather indices) are built
once per step and cached on the ``AttentionMetadata`` object, shared by all layers.
"""

from __future__ import annotations

import torch

from atb_plugin.platform.npu import torch_npu

BLOCK_SIZE_MULTIPLE = 16  # ATB PagedAttention: "due to hardware restrictions, block_size % 16 == 0"
_STEP_CACHE_ATTR = "_npu_kernels_step_cache"


# --------------------------------------------------------------------------------------------
# KV cache
# --------------------------------------------------------------------------------------------


def write_kv_cache(key, value, key_cache, value_cache, slot_mapping) -> None:
    valid = slot_mapping >= 0
    if not bool(valid.all()):
        key, value, slot_mapping = key[valid], value[valid], slot_mapping[valid]
    if slot_mapping.numel() == 0:
        return
    torch_npu()._npu_reshape_and_cache(
        key=key.to(key_cache.dtype).contiguous(),
        value=value.to(value_cache.dtype).contiguous(),
        key_cache=key_cache,
        value_cache=value_cache,
        slot_indices=slot_mapping.to(torch.int32),
    )


# --------------------------------------------------------------------------------------------
# masks (vllm-ascend's conventions, per dtype)
# --------------------------------------------------------------------------------------------


def _prefill_mask(max_len: int, dtype: torch.dtype, device) -> torch.Tensor:
    """``[max_len, max_len]`` causal mask for ``_npu_flash_attention`` (SelfAttention, NORM mask):
    0/1 (1 = masked) for bfloat16, additive ``finfo(float32).min`` (-inf in fp16) otherwise."""
    future = torch.ones(max_len, max_len, dtype=torch.bool, device=device).triu(1)
    value = 1.0 if dtype == torch.bfloat16 else torch.finfo(torch.float32).min
    return torch.zeros(max_len, max_len, device=device).masked_fill(future, value).to(dtype)


def _splitfuse_mask(positions: torch.Tensor, max_len: int, dtype: torch.dtype) -> torch.Tensor:
    """``[num_tokens, max_len]`` additive mask for ``_npu_paged_attention_splitfuse``: row t hides
    keys after token t's position; -inf (fp16 / fp32) or -10000 (bf16), as vllm-ascend scales it."""
    future = torch.arange(max_len, device=positions.device)[None, :] > positions[:, None]
    value = -10000.0 if dtype == torch.bfloat16 else torch.finfo(torch.float32).min
    return torch.zeros(future.shape, device=positions.device).masked_fill(future, value).to(dtype)


# --------------------------------------------------------------------------------------------
# paged attention
# --------------------------------------------------------------------------------------------


def _check_block_size(key_cache) -> None:
    block_size = key_cache.shape[1]
    if block_size % BLOCK_SIZE_MULTIPLE:
        raise ValueError(
            f"NPU paged attention needs a KV block size that is a multiple of {BLOCK_SIZE_MULTIPLE} "
            f"(ATB PagedAttention hardware restriction; 128 is recommended), got {block_size}")


class _StepInputs:
    """What the ATB calls need from one step's metadata, derived once and shared by all layers.

    Requests without query tokens this step are left out (ATB wants every listed sequence to have
    some; they contribute no rows to ``query`` anyway)."""

    def __init__(self, metadata, device):
        query_lens = metadata.query_lens_cpu.to(torch.int64)
        seq_lens = metadata.seq_lens_cpu.to(torch.int64)
        active = query_lens > 0
        tables = metadata.block_tables
        if not bool(active.all()):
            tables = tables[torch.nonzero(active).flatten().to(tables.device)]
        self.block_tables = tables.to(torch.int32)
        self.context_lens = seq_lens[active].to(torch.int32).contiguous()  # host int32, as ATB reads it
        self.query_lens = query_lens[active].to(torch.int32).contiguous()  # host int32
        self.max_seq_len = int(self.context_lens.max()) if self.context_lens.numel() else 0
        # Absolute position of each new token: request r's j-th sits at seq_len[r] - q_len[r] + j.
        request = torch.repeat_interleave(torch.arange(query_lens.numel()), query_lens)
        offset = torch.arange(int(query_lens.sum())) - metadata.query_start_loc_cpu[:-1].to(torch.int64)[request]
        self.positions = ((seq_lens - query_lens)[request] + offset).to(device)
        self.request = request.to(device)
        self._metadata, self._masks = metadata, {}

    def prefill_mask(self, dtype, device) -> torch.Tensor:
        key = ("prefill", dtype)
        if key not in self._masks:
            self._masks[key] = _prefill_mask(self.max_seq_len, dtype, device)
        return self._masks[key]

    def splitfuse_mask(self, dtype) -> torch.Tensor:
        key = ("splitfuse", dtype)
        if key not in self._masks:
            self._masks[key] = _splitfuse_mask(self.positions, self.max_seq_len, dtype)
        return self._masks[key]

    def new_token_slots(self, block_size: int) -> torch.Tensor:
        """Cache slot of every new token, via the block tables (what the CPU path reads)."""
        key = ("slots", block_size)
        if key not in self._masks:
            tables = self._metadata.block_tables.to(self.positions.device).long()
            blocks = tables[self.request, self.positions // block_size]
            self._masks[key] = blocks * block_size + self.positions % block_size
        return self._masks[key]


def _step_inputs(metadata, device) -> _StepInputs:
    """The step's ``_StepInputs``, stored on the metadata. Keyed by a fingerprint of what they
    derive from (host lengths, the block table's storage and version counter), so a metadata
    object updated in place for a later step is derived afresh."""
    tables = metadata.block_tables
    fingerprint = (tuple(metadata.query_start_loc_cpu.tolist()), tuple(metadata.seq_lens_cpu.tolist()),
                   tables.data_ptr(), tables._version, tuple(tables.shape), str(device))
    cached = getattr(metadata, _STEP_CACHE_ATTR, None)
    if cached is None or cached[0] != fingerprint:
        cached = (fingerprint, _StepInputs(metadata, device))
        setattr(metadata, _STEP_CACHE_ATTR, cached)
    return cached[1]


def paged_attention(query, key_cache, value_cache, metadata, scale) -> torch.Tensor:
    _check_block_size(key_cache)
    out = torch.empty_like(query)
    if query.shape[0] == 0:
        return out
    query = query.contiguous()
    num_heads, (block_size, num_kv_heads, head_dim) = query.shape[1], key_cache.shape[1:]
    step = _step_inputs(metadata, query.device)
    npu = torch_npu()
    if metadata.is_decode_only:
        npu._npu_paged_attention(
            query=query, key_cache=key_cache, value_cache=value_cache, num_kv_heads=num_kv_heads,
            num_heads=num_heads, scale_value=float(scale), block_table=step.block_tables,
            context_lens=step.context_lens, out=out)
    elif metadata.is_prefill_only:
        # The layer wrote this step's K/V into the cache first; read them back contiguously.
        slots = step.new_token_slots(block_size)
        key = key_cache.view(-1, num_kv_heads, head_dim).index_select(0, slots)
        value = value_cache.view(-1, num_kv_heads, head_dim).index_select(0, slots)
        npu._npu_flash_attention(
            query=query, key=key, value=value, mask=step.prefill_mask(query.dtype, query.device),
            seq_len=step.context_lens, scale_value=float(scale), num_heads=num_heads,
            num_kv_heads=num_kv_heads, out=out)
    else:
        npu._npu_paged_attention_splitfuse(
            query=query, key_cache=key_cache, value_cache=value_cache, block_table=step.block_tables,
            context_lens=step.context_lens, mask=step.splitfuse_mask(query.dtype), seq_len=step.query_lens,
            num_kv_heads=num_kv_heads, num_heads=num_heads, scale_value=float(scale), out=out)
    return out


# --------------------------------------------------------------------------------------------
# vision / encoder attention
# --------------------------------------------------------------------------------------------


def varlen_attention(query, key, value, cu_seqlens, scale, causal=False) -> torch.Tensor:
    out = torch.empty_like(query)
    lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).to(device="cpu", dtype=torch.int32)
    if bool((lengths == 0).any()):
        lengths = lengths[lengths > 0]
    if lengths.numel() == 0:
        return out
    query, key, value = query.contiguous(), key.contiguous(), value.contiguous()
    npu = torch_npu()
    if causal:
        mask = _prefill_mask(int(lengths.max()), query.dtype, query.device)
        npu._npu_flash_attention(
            query=query, key=key, value=value, mask=mask, seq_len=lengths, scale_value=float(scale),
            num_heads=query.shape[1], num_kv_heads=key.shape[1], out=out)
    else:
        npu._npu_flash_attention_unpad(
            query=query, key=key, value=value, seq_len=lengths, scale_value=float(scale),
            num_heads=query.shape[1], num_kv_heads=key.shape[1], out=out)
    return out


# --------------------------------------------------------------------------------------------
# elementwise
# --------------------------------------------------------------------------------------------


def rms_norm(x, weight, eps) -> torch.Tensor:
    return torch_npu().npu_rms_norm(x, weight.to(x.dtype), epsilon=float(eps))[0]


def apply_rotary(x, cos, sin) -> torch.Tensor:
    """``x`` (T, H, D) as BSND with B = 1; cos/sin (T, D) as (1, T, 1, D)."""
    r1 = cos.to(x.dtype)[None, :, None, :]
    r2 = sin.to(x.dtype)[None, :, None, :]
    return torch_npu().npu_rotary_mul(x.unsqueeze(0), r1, r2, rotary_mode="half").squeeze(0)


def silu_and_mul(x) -> torch.Tensor:
    return torch_npu().npu_swiglu(x.contiguous(), dim=-1)
