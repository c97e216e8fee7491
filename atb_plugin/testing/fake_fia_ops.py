"""Simulated aclnn attention ops for the FIA kernel set (``atb_plugin.ops.npu_fia_kernels``):
``npu_fused_infer_attention_score`` and ``npu_scatter_pa_kv_cache``, in plain torch on CPU
tensors, with the real Python signatures and the documented semantics of the subset the kernels
use. ``OPS`` is meant to be registered into ``fake_torch_npu``'s module beside the ATB ops.

Sources (read, not copied): the torch_npu 2.13 wheel, ``torch_npu/csrc/aten/
npu_native_functions_by_codegen.yaml`` (the registered schemas, pasted in each docstring),
``torch_npu/_op_plugin_docs.py`` (argument meanings and constraints) and
``torch_npu/op_plugin/meta/_meta_registrations.py`` (output shapes); vllm-ascend's
``attention_v1.py`` (the canonical caller: TND query, paged KV viewed as ``(num_blocks,
block_size, num_kv_heads * head_dim)``, ``sparse_mode=3`` with a 2048x2048 compressed mask).

What is simulated, and what is refused:

* ``npu_fused_infer_attention_score``: ``input_layout="TND"`` only, with paged KV
  (``block_table`` + ``block_size``; caches ``(num_blocks, block_size, H)`` or
  ``(num_blocks, KV_N, block_size, D)``) or contiguous TND key/value; ``sparse_mode`` 0 without
  a mask (no masking) or 3 (``rightDownCausal``) with the compressed causal mask; GQA through
  ``num_key_value_heads``; ``softmax_lse_flag``. Any other layout, sparse mode, quantisation,
  pse, padding, shared-prefix or lone MLA-rope argument raises ``NotImplementedError`` naming it (it
  is not a contract violation, just outside this simulation). Contract violations (float32
  inputs, a mask that is not the 2048x2048 strictly-upper-triangular one, block sizes the docs
  refuse, non-cumulative TND lengths, ...) raise ``NpuOpError``. With both ``query_rope`` and
  ``key_rope`` (DeepSeek's MLA) the call is ``fake_mla_ops.fia_mla_form``'s.
* ``npu_scatter_pa_kv_cache``: scenario 2 of the docs only (3-D key/value, ND caches
  ``(num_blocks, block_size, num_heads, head_size)``, ``cache_mode="Norm"`` or None). The NZ
  cache layout (the default ``cache_mode='PA_NZ'``) and the compressed scenario 3 are refused.

All arithmetic is float32 (the real kernels accumulate in float32), outputs cast to the query
dtype.
"""

from __future__ import annotations

import weakref

import torch

from atb_plugin.testing import fake_mla_ops
from atb_plugin.testing.fake_torch_npu import NpuOpError
from atb_plugin.utils import cdiv

INT_MAX = 2147483647
COMPRESSED_MASK_SIZE = 2048  # sparse_mode 2/3/4: "S的值需要固定为2048"
_FIA_DTYPES = (torch.float16, torch.bfloat16)  # int8 (quantised) exists but is not simulated
_MASK_DTYPES = (torch.bool, torch.int8, torch.uint8)
_MAX_BLOCK_SIZE = 512
_PFA_BLOCK_SIZE_MULTIPLE = 128  # Q_S > 1: "block_size最小为128, 最大为512, 且要求是128的倍数"
_IFA_BLOCK_SIZE_MULTIPLE = 16  # Q_S == 1, fp16/bf16: "block_size ... 需要16对齐", at most 512
_MAX_GQA_RATIO = 64
_MAX_HEAD_DIM = 512
_SCATTER_DTYPES = (torch.float16, torch.float32, torch.bfloat16, torch.int8, torch.uint8, torch.int16,
                   torch.int32)

FIA_SCHEMA = (
    "npu_fused_infer_attention_score(Tensor query, Tensor key, Tensor value, *, Tensor? pse_shift=None, "
    "Tensor? atten_mask=None, SymInt[]? actual_seq_lengths=None, SymInt[]? actual_seq_lengths_kv=None, "
    "Tensor? dequant_scale1=None, Tensor? quant_scale1=None, Tensor? dequant_scale2=None, "
    "Tensor? quant_scale2=None, Tensor? quant_offset2=None, Tensor? antiquant_scale=None, "
    "Tensor? antiquant_offset=None, Tensor? key_antiquant_scale=None, Tensor? key_antiquant_offset=None, "
    "Tensor? value_antiquant_scale=None, Tensor? value_antiquant_offset=None, Tensor? block_table=None, "
    "Tensor? query_padding_size=None, Tensor? kv_padding_size=None, Tensor? key_shared_prefix=None, "
    "Tensor? value_shared_prefix=None, SymInt[]? actual_shared_prefix_len=None, Tensor? query_rope=None, "
    "Tensor? key_rope=None, Tensor? key_rope_antiquant_scale=None, int num_heads=1, float scale=1.0, "
    "int pre_tokens=2147483647, int next_tokens=2147483647, str input_layout=\"BSH\", "
    "int num_key_value_heads=0, int sparse_mode=0, int inner_precise=0, int block_size=0, "
    "int antiquant_mode=0, int key_antiquant_mode=0, int value_antiquant_mode=0, "
    "bool softmax_lse_flag=False) -> (Tensor, Tensor)"
)
SCATTER_SCHEMA = (
    "npu_scatter_pa_kv_cache(Tensor key, Tensor value, Tensor(a!) key_cache, Tensor(b!) value_cache, "
    "Tensor slot_mapping, *, Tensor? compress_lens=None, Tensor? compress_seq_offsets=None, "
    "Tensor? seq_lens=None, str? cache_mode='PA_NZ') -> ()"
)


def _require(condition: bool, op: str, message: str) -> None:
    if not condition:
        raise NpuOpError(f"{op}: {message}")


def _unsupported(op: str, what: str) -> NotImplementedError:
    return NotImplementedError(f"{op}: {what} is not simulated by atb_plugin.testing.fake_fia_ops")


def _int_list(values, op: str, name: str) -> list[int]:
    """A ``SymInt[]`` argument: a list/tuple of Python ints (what vllm-ascend passes)."""
    _require(isinstance(values, (list, tuple)), op,
             f"{name} is SymInt[]: pass a list of ints, got {type(values).__name__}")
    _require(all(isinstance(v, int) and not isinstance(v, bool) for v in values), op, f"{name} must hold ints")
    return list(values)


# mask checks are the expensive part of a call; a mask object is checked once per version
# (keyed by identity, held weakly: a new tensor at a freed mask's address is checked afresh)
_checked_masks: dict[int, tuple] = {}


def _check_compressed_causal_mask(op: str, mask) -> torch.Tensor:
    _require(isinstance(mask, torch.Tensor), op, "sparse_mode=3 needs atten_mask (the 2048x2048 compressed mask)")
    size = COMPRESSED_MASK_SIZE
    _require(tuple(mask.shape) in ((size, size), (1, size, size), (1, 1, size, size)), op,
             f"sparse_mode=3 needs atten_mask of shape (2048, 2048), (1, 2048, 2048) or (1, 1, 2048, 2048), "
             f"got {tuple(mask.shape)}")
    _require(mask.dtype in _MASK_DTYPES, op, f"atten_mask dtype must be bool/int8/uint8, got {mask.dtype}")
    _require(mask.is_contiguous(), op, "atten_mask must be contiguous")
    seen = _checked_masks.get(id(mask))
    if seen is None or seen[0]() is not mask or seen[1] != mask._version:
        square = mask.reshape(size, size)
        expected = torch.ones(size, size, dtype=torch.bool, device=mask.device).triu(1)
        _require(torch.equal(square.bool(), expected) and bool(((square == 0) | (square == 1)).all()), op,
                 "sparse_mode=3 atten_mask must be the compressed causal mask: 1 (masked) strictly above the "
                 "diagonal, 0 elsewhere (triu(ones(2048, 2048), diagonal=1))")
        if len(_checked_masks) > 64:
            _checked_masks.clear()
        _checked_masks[id(mask)] = (weakref.ref(mask), mask._version)
    return mask


def _attend(q, k, v, scale: float, visible):
    """q (Sq, N, D), k/v (Skv, KV_N, D), visible (Sq, Skv) bool or None. Returns (out fp32, lse fp32 (Sq, N))."""
    groups = q.shape[1] // k.shape[1]
    k = k.float().repeat_interleave(groups, dim=1)
    v = v.float().repeat_interleave(groups, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.float(), k) * scale
    if visible is not None:
        scores = scores.masked_fill(~visible[None], float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)  # (N, Sq)
    out = torch.einsum("hqk,khd->qhd", torch.exp(scores - lse[..., None]), v)
    return out, lse.transpose(0, 1)


def npu_fused_infer_attention_score(query, key, value, *, pse_shift=None, atten_mask=None, actual_seq_lengths=None,
                                    actual_seq_lengths_kv=None, dequant_scale1=None, quant_scale1=None,
                                    dequant_scale2=None, quant_scale2=None, quant_offset2=None, antiquant_scale=None,
                                    antiquant_offset=None, key_antiquant_scale=None, key_antiquant_offset=None,
                                    value_antiquant_scale=None, value_antiquant_offset=None, block_table=None,
                                    query_padding_size=None, kv_padding_size=None, key_shared_prefix=None,
                                    value_shared_prefix=None, actual_shared_prefix_len=None, query_rope=None,
                                    key_rope=None, key_rope_antiquant_scale=None, num_heads=1, scale=1.0,
                                    pre_tokens=2147483647, next_tokens=2147483647, input_layout="BSH",
                                    num_key_value_heads=0, sparse_mode=0, inner_precise=0, block_size=0,
                                    antiquant_mode=0, key_antiquant_mode=0, value_antiquant_mode=0,
                                    softmax_lse_flag=False):
    """``npu_fused_infer_attention_score(Tensor query, Tensor key, Tensor value, *, ...,
    int num_heads=1, float scale=1.0, ..., str input_layout="BSH", int num_key_value_heads=0,
    int sparse_mode=0, int inner_precise=0, int block_size=0, ..., bool softmax_lse_flag=False)
    -> (Tensor, Tensor)`` (full schema: ``FIA_SCHEMA``). ``attention_out = softmax(scale *
    query·keyᵀ + atten_mask) · value``; returns ``(attention_out, softmax_lse)``.

    Simulated: ``input_layout="TND"``. ``query`` ``(T, N, D)``, ``num_heads == N``;
    ``actual_seq_lengths`` (required) is *cumulative*: entry b is the sum of the query lengths of
    batches 0..b, non-decreasing, its length is the batch count B, the last equals T.

    * Paged KV (``block_table`` given): ``key``/``value`` are the caches, ``(num_blocks,
      block_size, KV_N * D)`` or ``(num_blocks, KV_N, block_size, D)``, identical shapes;
      ``block_table`` int32 ``(B, max_blocks_per_seq)``; ``block_size`` the cache's block size;
      ``actual_seq_lengths_kv`` (required) holds each batch's own KV length (*not* cumulative in
      the page-attention case), at most ``max_blocks_per_seq * block_size``. Batch b's token k
      lives at ``block_table[b, k // block_size]``, offset ``k % block_size``. block_size: when
      some batch has more than one query token (the PFA branch) a multiple of 128 in
      [128, 512]; otherwise (IFA, every Q_S = 1) a multiple of 16 in [16, 512].
    * Contiguous KV (no ``block_table``): ``key``/``value`` TND ``(T_kv, KV_N, D)`` and
      ``actual_seq_lengths_kv`` cumulative like ``actual_seq_lengths``.

    GQA: ``num_key_value_heads`` (0 = ``num_heads``) divides ``num_heads``, ratio <= 64.
    ``sparse_mode=0`` without ``atten_mask``: no masking (``pre_tokens``/``next_tokens`` ignored).
    ``sparse_mode=3`` (rightDownCausal): ``atten_mask`` is the compressed 2048x2048 mask (bool /
    int8 / uint8, 1 = masked strictly above the diagonal); batch b with Sq query and Skv KV tokens
    lets query i see KV tokens ``j <= i + Skv - Sq`` (the causal triangle anchored at the bottom
    right: the new tokens are the last Sq of the sequence), so prefill, chunked prefill and decode
    are the same call. Needs Sq <= Skv. A batch with Skv = 0 yields zeros.

    dtypes: query/key/value float16 or bfloat16, all equal, contiguous; D a multiple of 16, <= 512.
    ``attention_out`` has the query's shape and dtype. ``softmax_lse``: with ``softmax_lse_flag``
    float32 ``(T, N, 1)``, ``log(sum(exp(scores)))`` over the visible keys; without it the
    docs' placeholder, a float32 ``[1]`` zero tensor.
    """
    op = "npu_fused_infer_attention_score"
    # -- features outside the simulation --------------------------------------------------------
    for name, arg in (("pse_shift", pse_shift), ("dequant_scale1", dequant_scale1), ("quant_scale1", quant_scale1),
                      ("dequant_scale2", dequant_scale2), ("quant_scale2", quant_scale2),
                      ("quant_offset2", quant_offset2), ("antiquant_scale", antiquant_scale),
                      ("antiquant_offset", antiquant_offset), ("key_antiquant_scale", key_antiquant_scale),
                      ("key_antiquant_offset", key_antiquant_offset), ("value_antiquant_scale", value_antiquant_scale),
                      ("value_antiquant_offset", value_antiquant_offset), ("query_padding_size", query_padding_size),
                      ("kv_padding_size", kv_padding_size), ("key_shared_prefix", key_shared_prefix),
                      ("value_shared_prefix", value_shared_prefix), ("actual_shared_prefix_len", actual_shared_prefix_len),
                      ("key_rope_antiquant_scale", key_rope_antiquant_scale),
                      # one of the two MLA ropes alone (the MLA form takes both: below)
                      ("query_rope", None if key_rope is not None else query_rope),
                      ("key_rope", None if query_rope is not None else key_rope)):
        if arg is not None:
            raise _unsupported(op, f"{name} (quantisation / pse / padding / shared prefix / one MLA rope alone)")
    for name, mode in (("antiquant_mode", antiquant_mode), ("key_antiquant_mode", key_antiquant_mode),
                       ("value_antiquant_mode", value_antiquant_mode)):
        if mode != 0:
            raise _unsupported(op, f"{name}={mode}")
    if query_rope is not None and key_rope is not None:  # the MLA form (DeepSeek): fake_mla_ops
        if sparse_mode == 3:
            _check_compressed_causal_mask(op, atten_mask)
        return fake_mla_ops.fia_mla_form(
            query, key, value, query_rope=query_rope, key_rope=key_rope, atten_mask=atten_mask,
            actual_seq_lengths=actual_seq_lengths, actual_seq_lengths_kv=actual_seq_lengths_kv,
            block_table=block_table, num_heads=num_heads, scale=scale, input_layout=input_layout,
            num_key_value_heads=num_key_value_heads, sparse_mode=sparse_mode, block_size=block_size,
            softmax_lse_flag=softmax_lse_flag)
    if input_layout != "TND":
        if input_layout in ("BSH", "BSND", "BNSD", "BNSD_BSND", "NTD", "TND_NTD", "NTD_TND", "NSD"):
            raise _unsupported(op, f"input_layout={input_layout!r} (only 'TND' is)")
        raise NpuOpError(f"{op}: unknown input_layout {input_layout!r}")
    _require(sparse_mode in (0, 1, 2, 3, 4, 9), op, f"sparse_mode must be one of 0, 1, 2, 3, 4, 9, got {sparse_mode}")
    if sparse_mode not in (0, 3) or (sparse_mode == 0 and atten_mask is not None):
        what = f"sparse_mode={sparse_mode}" + (" with an atten_mask" if sparse_mode == 0 else "")
        raise _unsupported(op, f"{what} (only sparse_mode=0 without a mask and sparse_mode=3 are)")
    _require(inner_precise in (0, 1, 2, 3), op, f"inner_precise must be 0..3, got {inner_precise}")

    # -- query ------------------------------------------------------------------------------------
    _require(isinstance(query, torch.Tensor) and query.dim() == 3, op,
             f"TND query must be (T, N, D), got {tuple(getattr(query, 'shape', ()))}")
    if query.dtype == torch.int8:
        raise _unsupported(op, "int8 query (full quantisation)")
    _require(query.dtype in _FIA_DTYPES, op, f"query dtype must be float16 or bfloat16, got {query.dtype}")
    for name, t in (("query", query), ("key", key), ("value", value)):
        _require(isinstance(t, torch.Tensor), op, f"{name} must be a tensor")
        _require(t.is_contiguous(), op, f"{name} must be contiguous (non-contiguous tensors are not supported)")
    _require(key.dtype == query.dtype and value.dtype == query.dtype, op,
             f"query/key/value dtypes differ: {query.dtype}, {key.dtype}, {value.dtype}")
    _require(tuple(key.shape) == tuple(value.shape), op,
             f"key and value shapes must be identical, got {tuple(key.shape)} and {tuple(value.shape)}")
    num_tokens, n, d = query.shape
    _require(num_heads == n, op, f"num_heads={num_heads} but the TND query has N={n}")
    kv_heads = num_heads if num_key_value_heads == 0 else num_key_value_heads
    _require(kv_heads > 0 and num_heads % kv_heads == 0, op,
             f"num_heads ({num_heads}) must be a multiple of num_key_value_heads ({kv_heads})")
    _require(num_heads // kv_heads <= _MAX_GQA_RATIO, op, f"num_heads / num_key_value_heads must be <= {_MAX_GQA_RATIO}")
    _require(d % 16 == 0 and 0 < d <= _MAX_HEAD_DIM, op, f"head dim D={d} must be a multiple of 16 in (0, 512]")
    _require(isinstance(scale, (int, float)) and not isinstance(scale, bool), op, "scale must be a float")

    # -- lengths ----------------------------------------------------------------------------------
    _require(actual_seq_lengths is not None, op, "input_layout='TND' requires actual_seq_lengths")
    q_cum = _int_list(actual_seq_lengths, op, "actual_seq_lengths")
    _require(len(q_cum) > 0, op, "actual_seq_lengths must list at least one batch")
    _require(all(v >= 0 for v in q_cum) and all(b >= a for a, b in zip(q_cum, q_cum[1:])), op,
             f"TND actual_seq_lengths is cumulative (non-negative, non-decreasing), got {q_cum}")
    _require(q_cum[-1] == num_tokens, op,
             f"actual_seq_lengths must end at T={num_tokens} (it is cumulative), got {q_cum[-1]}")
    batch = len(q_cum)
    q_lens = [b - a for a, b in zip([0] + q_cum[:-1], q_cum)]
    _require(actual_seq_lengths_kv is not None, op, "input_layout='TND' requires actual_seq_lengths_kv")
    kv_arg = _int_list(actual_seq_lengths_kv, op, "actual_seq_lengths_kv")
    _require(len(kv_arg) == batch, op, f"actual_seq_lengths_kv has {len(kv_arg)} entries, expected B={batch}")
    _require(all(v >= 0 for v in kv_arg), op, "actual_seq_lengths_kv must be non-negative")

    paged = block_table is not None
    if paged:
        kv_lens = kv_arg  # page attention: each batch's own KV length
        _require(isinstance(block_table, torch.Tensor) and block_table.dtype == torch.int32, op,
                 "block_table must be an int32 tensor")
        _require(block_table.dim() == 2 and block_table.shape[0] == batch, op,
                 f"block_table must be 2-D (B={batch}, max_blocks_per_seq), got {tuple(block_table.shape)}")
        _require(isinstance(block_size, int) and 0 < block_size <= _MAX_BLOCK_SIZE, op,
                 f"page attention needs 0 < block_size <= {_MAX_BLOCK_SIZE}, got {block_size}")
        if max(q_lens) > 1:
            _require(block_size % _PFA_BLOCK_SIZE_MULTIPLE == 0, op,
                     f"page attention with Q_S > 1 needs block_size a multiple of {_PFA_BLOCK_SIZE_MULTIPLE} "
                     f"in [128, 512], got {block_size}")
        else:
            _require(block_size % _IFA_BLOCK_SIZE_MULTIPLE == 0, op,
                     f"page attention (fp16/bf16) needs block_size a multiple of {_IFA_BLOCK_SIZE_MULTIPLE}, "
                     f"got {block_size}")
        if key.dim() == 3:
            _require(key.shape[1] == block_size and key.shape[2] == kv_heads * d, op,
                     f"paged key (num_blocks, block_size, H) must be (*, {block_size}, {kv_heads * d}) "
                     f"(num_key_value_heads * D), got {tuple(key.shape)}")
            k_blocks = key.view(key.shape[0], block_size, kv_heads, d)
            v_blocks = value.view(value.shape[0], block_size, kv_heads, d)
        elif key.dim() == 4:
            _require(key.shape[1] == kv_heads and key.shape[2] == block_size and key.shape[3] == d, op,
                     f"paged key (num_blocks, KV_N, block_size, D) must be (*, {kv_heads}, {block_size}, {d}), "
                     f"got {tuple(key.shape)}")
            k_blocks, v_blocks = key.transpose(1, 2), value.transpose(1, 2)
        elif key.dim() == 5:
            raise _unsupported(op, "the NZ paged key/value layout (num_blocks, KV_N, D/16, block_size, 16)")
        else:
            raise NpuOpError(f"{op}: paged key/value must be 3-D (num_blocks, block_size, H) or 4-D "
                             f"(num_blocks, KV_N, block_size, D), got {tuple(key.shape)}")
        num_blocks = key.shape[0]
        needed = max((cdiv(s, block_size) for s in kv_lens), default=0)
        _require(block_table.shape[1] >= needed, op,
                 f"block_table has {block_table.shape[1]} columns, fewer than the {needed} blocks "
                 f"max(actual_seq_lengths_kv) needs")
        for b, s in enumerate(kv_lens):
            used = block_table[b, :cdiv(s, block_size)]
            _require(bool(((used >= 0) & (used < num_blocks)).all()), op,
                     f"block_table row {b} references blocks outside [0, {num_blocks})")
    else:
        _require(key.dim() == 3 and key.shape[1] == kv_heads and key.shape[2] == d, op,
                 f"TND key/value must be (T_kv, {kv_heads}, {d}), got {tuple(key.shape)}")
        _require(all(b >= a for a, b in zip(kv_arg, kv_arg[1:])) and kv_arg[-1] == key.shape[0], op,
                 f"TND actual_seq_lengths_kv is cumulative and ends at T_kv={key.shape[0]}, got {kv_arg}")
        kv_lens = [b - a for a, b in zip([0] + kv_arg[:-1], kv_arg)]
    if sparse_mode == 3:
        _check_compressed_causal_mask(op, atten_mask)
        _require(all(q <= s for q, s in zip(q_lens, kv_lens) if s > 0), op,
                 f"sparse_mode=3 needs each batch's query length <= its KV length, got {q_lens} vs {kv_lens}")

    # -- compute ----------------------------------------------------------------------------------
    out = torch.zeros_like(query)
    lse = torch.zeros(num_tokens, n, 1, dtype=torch.float32, device=query.device)
    q_start, kv_start = 0, 0
    for b, (q_len, kv_len) in enumerate(zip(q_lens, kv_lens)):
        q_end = q_start + q_len
        if q_len and kv_len:
            if paged:
                blocks = block_table[b, :cdiv(kv_len, block_size)].long()
                k = k_blocks[blocks].flatten(0, 1)[:kv_len]
                v = v_blocks[blocks].flatten(0, 1)[:kv_len]
            else:
                k, v = key[kv_start:kv_start + kv_len], value[kv_start:kv_start + kv_len]
            visible = None
            if sparse_mode == 3:
                offset = kv_len - q_len
                visible = torch.arange(kv_len)[None, :] <= torch.arange(q_len)[:, None] + offset
            o, row_lse = _attend(query[q_start:q_end], k, v, float(scale), visible)
            out[q_start:q_end] = o.to(out.dtype)
            lse[q_start:q_end, :, 0] = row_lse
        q_start, kv_start = q_end, kv_start + kv_len
    if not softmax_lse_flag:
        lse = torch.zeros(1, dtype=torch.float32, device=query.device)
    return out, lse


def npu_scatter_pa_kv_cache(key, value, key_cache, value_cache, slot_mapping, *, compress_lens=None,
                            compress_seq_offsets=None, seq_lens=None, cache_mode='PA_NZ'):
    """``npu_scatter_pa_kv_cache(Tensor key, Tensor value, Tensor(a!) key_cache, Tensor(b!)
    value_cache, Tensor slot_mapping, *, Tensor? compress_lens=None, Tensor? compress_seq_offsets=None,
    Tensor? seq_lens=None, str? cache_mode='PA_NZ') -> ()``.

    Simulated: the docs' scenario 2, ``key`` ``(T, N, Dk)``, ``value`` ``(T, N, Dv)``, ND caches
    ``key_cache`` ``(num_blocks, block_size, N, Dk)`` / ``value_cache`` ``(num_blocks, block_size,
    N, Dv)``, ``cache_mode`` ``"Norm"`` or None (ND memory layout; the default ``'PA_NZ'`` is the
    FRACTAL_NZ layout, which a plain ND cache is not: refused). Token i is written in place at flat
    slot ``slot_mapping[i] = block * block_size + offset``. ``slot_mapping`` int32 or int64,
    ``(T,)``, values in ``[0, num_blocks * block_size - 1]`` and distinct (duplicates give
    undefined results on the device; refused here). key/value/caches share one dtype; all inputs
    contiguous. Returns None.
    """
    op = "npu_scatter_pa_kv_cache"
    if compress_lens is not None or compress_seq_offsets is not None or seq_lens is not None:
        raise _unsupported(op, "compress_lens / compress_seq_offsets / seq_lens (compressed scenario 3)")
    if cache_mode == "PA_NZ":
        raise NpuOpError(f"{op}: cache_mode='PA_NZ' (the default) expects FRACTAL_NZ caches "
                         "(npu_format_cast(..., 29)); ND caches (num_blocks, block_size, N, D) need "
                         "cache_mode='Norm'. The NZ layout is not simulated.")
    _require(cache_mode in (None, "Norm"), op, f"cache_mode must be 'PA_NZ', 'Norm' or None, got {cache_mode!r}")
    for name, t in (("key", key), ("value", value), ("key_cache", key_cache), ("value_cache", value_cache),
                    ("slot_mapping", slot_mapping)):
        _require(isinstance(t, torch.Tensor), op, f"{name} must be a tensor")
        _require(t.is_contiguous(), op, f"{name} must be contiguous (non-contiguous inputs are not supported)")
    if key.dim() == 4:
        raise _unsupported(op, "4-D key/value (compressed scenario 3)")
    _require(key.dim() == 3 and value.dim() == 3, op,
             f"key/value must be 3-D (T, N, D), got {tuple(key.shape)} and {tuple(value.shape)}")
    _require(key.shape[:2] == value.shape[:2], op, "key and value must agree on (T, N)")
    _require(key_cache.dim() == 4 and value_cache.dim() == 4, op, "key_cache/value_cache must be 4-D")
    dtypes = {key.dtype, value.dtype, key_cache.dtype, value_cache.dtype}
    _require(len(dtypes) == 1, op, f"key, value, key_cache and value_cache must share one dtype, got {dtypes}")
    _require(key.dtype in _SCATTER_DTYPES, op, f"dtype {key.dtype} not supported")
    _require(key_cache.shape[2:] == key.shape[1:], op,
             f"ND key_cache must be (num_blocks, block_size, {key.shape[1]}, {key.shape[2]}), "
             f"got {tuple(key_cache.shape)}")
    _require(value_cache.shape[2:] == value.shape[1:], op,
             f"ND value_cache must be (num_blocks, block_size, {value.shape[1]}, {value.shape[2]}), "
             f"got {tuple(value_cache.shape)}")
    _require(key_cache.shape[:2] == value_cache.shape[:2], op, "key_cache and value_cache disagree on blocks")
    _require(slot_mapping.dtype in (torch.int32, torch.int64), op,
             f"slot_mapping must be int32 or int64, got {slot_mapping.dtype}")
    _require(slot_mapping.dim() == 1 and slot_mapping.numel() == key.shape[0], op,
             f"slot_mapping must be (T={key.shape[0]},), got {tuple(slot_mapping.shape)}")
    num_slots = key_cache.shape[0] * key_cache.shape[1]
    _require(bool(((slot_mapping >= 0) & (slot_mapping < num_slots)).all()), op,
             f"slot_mapping values must lie in [0, num_blocks * block_size - 1 = {num_slots - 1}]")
    _require(slot_mapping.unique().numel() == slot_mapping.numel(), op, "slot_mapping values must be distinct")
    slots = slot_mapping.long()
    key_cache.view(num_slots, *key_cache.shape[2:])[slots] = key
    value_cache.view(num_slots, *value_cache.shape[2:])[slots] = value


OPS = (npu_fused_infer_attention_score, npu_scatter_pa_kv_cache)
SCHEMAS = {"npu_fused_infer_attention_score": FIA_SCHEMA, "npu_scatter_pa_kv_cache": SCATTER_SCHEMA}

__all__ = ["COMPRESSED_MASK_SIZE", "FIA_SCHEMA", "OPS", "SCATTER_SCHEMA", "SCHEMAS",
           "npu_fused_infer_attention_score", "npu_scatter_pa_kv_cache"]
