"""Simulated aclnn ops for DeepSeek's MLA and grouped gating (``atb_plugin.ops.npu_kernels``'
MLA section): ``npu_kv_rmsnorm_rope_cache``, ``npu_moe_gating_top_k`` and the MLA form of
``npu_fused_infer_attention_score`` (``query_rope`` / ``key_rope``, reached through
``fake_fia_ops``), in plain torch with the real Python signatures and the documented semantics of
the subset vllm-ascend uses. ``OPS`` is registered into ``fake_torch_npu``'s module beside the
others; contract violations raise ``NpuOpError``, features outside the simulation
``NotImplementedError`` naming them.

Sources (read, not copied): the torch_npu 2.13 wheel's schemas (``npu_schemas.txt``) and
``torch_npu/_op_plugin_docs.py`` (the FIA MLA constraints: query S 1-16, N 32 / 64 / 128, D 512,
rope D 64, one KV head, page blocks of 16 or 128), the torch_npu API pages for
``npu_kv_rmsnorm_rope_cache`` (kv ``[B, 1, S, 576]`` = 512 RMSNorm + 64 rope columns, PA caches
``[block_num, block_size, 1, 64 | 512]``, index one slot per token) and ``npu_moe_gating_top_k``,
CANN's ``aclnnKvRmsNormRopeCache`` / ``aclnnMoeGatingTopK`` formulas (interleaved rope:
``cat(x[0::2], x[1::2]) * cos + cat(-x[1::2], x[0::2]) * sin``; gating: normalise, add the bias for
the choice, group scores by max or top-2 sum, keep ``k_group`` groups, top ``k`` of the kept,
``y / (sum(y) + eps) * routed_scaling_factor`` over the unbiased scores), and vllm-ascend's
``mla_v1.py`` / ``fused_moe`` callers.
"""

from __future__ import annotations

import torch

from atb_plugin.testing.fake_torch_npu import NpuOpError
from atb_plugin.utils import cdiv

KV_RMS_SIZE, KV_ROPE_SIZE = 512, 64  # npu_kv_rmsnorm_rope_cache: "rms_size 仅支持512", "rope_size 仅支持64"
MLA_HEADS = (32, 64, 128)  # FIA with query_rope (sparse != 4): query N
MLA_BLOCK_SIZES = (16, 128)
MLA_MAX_QUERY_S = 16
MAX_GATING_EXPERTS = 2048
_HALF = (torch.float16, torch.bfloat16)
_GATING_DTYPES = _HALF + (torch.float32,)


def _require(condition: bool, op: str, message: str) -> None:
    if not condition:
        raise NpuOpError(f"{op}: {message}")


def _unsupported(op: str, what: str) -> NotImplementedError:
    return NotImplementedError(f"{op}: {what} is not simulated by atb_plugin.testing.fake_mla_ops")


def _interleaved_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    first, second = x[..., 0::2], x[..., 1::2]
    return torch.cat((first, second), dim=-1) * cos + torch.cat((-second, first), dim=-1) * sin


def npu_kv_rmsnorm_rope_cache(kv, gamma, cos, sin, index, k_cache, ckv_cache, *, k_rope_scale=None,
                              c_kv_scale=None, k_rope_offset=None, c_kv_offset=None, v=None, epsilon=1e-5,
                              cache_mode='Norm', is_output_kv=False):
    """``npu_kv_rmsnorm_rope_cache(Tensor kv, Tensor gamma, Tensor cos, Tensor sin, Tensor index,
    Tensor k_cache, Tensor ckv_cache, *, ..., float epsilon=1e-5, str cache_mode='Norm', bool
    is_output_kv=False) -> (Tensor, Tensor, Tensor, Tensor)``.

    ``kv`` ``[B, 1, S, 576]`` float16 / bfloat16: columns ``:512`` get RMSNorm with ``gamma``
    (512,), columns ``512:`` interleaved rope with ``cos`` / ``sin`` ``[B, 1, S, 64]``; the results
    are written to ``ckv_cache`` / ``k_cache``. Simulated cache modes: ``"PA"`` / ``"PA_BNSD"``
    (caches ``[block_num, block_size, 1, 512 | 64]``, ``index`` int64 ``[B * S]``, one flat slot
    per token, in range); ``"Norm"`` (caches ``[B, 1, cache_length, D]``, ``index`` ``[B, S]``
    offsets per batch). NZ / block modes and the quantised caches are not simulated. Returns
    ``(k_cache, ckv_cache, k_rope, c_kv)``; the last two are the written rows ``[B, 1, S, 64 |
    512]`` with ``is_output_kv``, empty tensors without."""
    op = "npu_kv_rmsnorm_rope_cache"
    for name, arg in (("k_rope_scale", k_rope_scale), ("c_kv_scale", c_kv_scale), ("k_rope_offset", k_rope_offset),
                      ("c_kv_offset", c_kv_offset), ("v", v)):
        if arg is not None:
            raise _unsupported(op, f"{name} (quantised caches / the separate-v form)")
    if cache_mode in ("PA_NZ", "PA_BLK_BNSD", "PA_BLK_NZ"):
        raise _unsupported(op, f"cache_mode={cache_mode!r}")
    _require(cache_mode in ("Norm", "PA", "PA_BNSD"), op, f"unknown cache_mode {cache_mode!r}")
    for name, t in (("kv", kv), ("gamma", gamma), ("cos", cos), ("sin", sin), ("index", index), ("k_cache", k_cache),
                    ("ckv_cache", ckv_cache)):
        _require(isinstance(t, torch.Tensor), op, f"{name} must be a tensor")
    _require(kv.dim() == 4 and kv.shape[1] == 1 and kv.shape[3] == KV_RMS_SIZE + KV_ROPE_SIZE, op,
             f"kv must be [batch_size, 1, seq_len, {KV_RMS_SIZE + KV_ROPE_SIZE}] (BNSD), got {tuple(kv.shape)}")
    _require(kv.dtype in _HALF, op, f"kv dtype must be float16 / bfloat16, got {kv.dtype}")
    batch, _, seq, _ = kv.shape
    _require(tuple(gamma.shape) == (KV_RMS_SIZE,) and gamma.dtype == kv.dtype, op,
             f"gamma must be [{KV_RMS_SIZE}] of kv's dtype, got {tuple(gamma.shape)} {gamma.dtype}")
    for name, t in (("cos", cos), ("sin", sin)):
        _require(tuple(t.shape) == (batch, 1, seq, KV_ROPE_SIZE) and t.dtype == kv.dtype, op,
                 f"{name} must be [{batch}, 1, {seq}, {KV_ROPE_SIZE}] of kv's dtype, got {tuple(t.shape)} {t.dtype}")
    _require(index.dtype == torch.int64, op, f"index must be int64, got {index.dtype}")
    for name, t, width in (("k_cache", k_cache, KV_ROPE_SIZE), ("ckv_cache", ckv_cache, KV_RMS_SIZE)):
        _require(t.dim() == 4 and t.shape[-1] == width and t.dtype == kv.dtype, op,
                 f"{name} must be 4-D with last dim {width} and kv's dtype, got {tuple(t.shape)} {t.dtype}")
    rows = kv.float()
    normed = rows[..., :KV_RMS_SIZE]
    normed = normed * torch.rsqrt(normed.pow(2).mean(-1, keepdim=True) + float(epsilon)) * gamma.float()
    roped = _interleaved_rope(rows[..., KV_RMS_SIZE:], cos.float(), sin.float())
    normed, roped = normed.to(kv.dtype), roped.to(kv.dtype)
    if cache_mode == "Norm":
        _require(k_cache.shape[:2] == (batch, 1) and ckv_cache.shape[:2] == (batch, 1), op,
                 "Norm mode caches must be [batch_size, 1, cache_length, D]")
        _require(tuple(index.shape) == (batch, seq), op, f"Norm mode index must be [{batch}, {seq}]")
        length = k_cache.shape[2]
        _require(bool(((index >= 0) & (index < length)).all()), op, f"index values must lie in [0, {length})")
        for b in range(batch):
            k_cache[b, 0, index[b]] = roped[b, 0]
            ckv_cache[b, 0, index[b]] = normed[b, 0]
    else:
        _require(k_cache.shape[:3] == ckv_cache.shape[:3] and k_cache.shape[2] == 1, op,
                 "PA caches must be [block_num, block_size, 1, D] with the same blocks")
        _require(tuple(index.shape) == (batch * seq,), op, f"PA index must be [batch_size * seq_len = {batch * seq}]")
        slots = k_cache.shape[0] * k_cache.shape[1]
        _require(bool(((index >= 0) & (index < slots)).all()), op,
                 f"index values must lie in [0, block_num * block_size = {slots})")
        k_cache.view(slots, KV_ROPE_SIZE)[index] = roped.reshape(-1, KV_ROPE_SIZE)
        ckv_cache.view(slots, KV_RMS_SIZE)[index] = normed.reshape(-1, KV_RMS_SIZE)
    if not is_output_kv:
        return k_cache, ckv_cache, kv.new_empty(0), kv.new_empty(0)
    return k_cache, ckv_cache, roped, normed


def _top_lowest_index_first(values: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of the k largest per row, equal values in index order (the docs leave ties open)."""
    return values.sort(dim=-1, descending=True, stable=True)[1][..., :k]


def npu_moe_gating_top_k(x, k, *, bias=None, input_ids=None, tid2eid=None, k_group=1, group_count=1,
                         group_select_mode=0, renorm=0, norm_type=0, out_flag=False, routed_scaling_factor=1.0,
                         eps=1e-20):
    """``npu_moe_gating_top_k(Tensor x, int k, *, Tensor? bias=None, ..., int k_group=1, int
    group_count=1, int group_select_mode=0, int renorm=0, int norm_type=0, bool out_flag=False,
    float routed_scaling_factor=1.0, float eps=1e-20) -> (Tensor, Tensor, Tensor)``.

    ``x`` ``(tokens, E)`` float16 / bfloat16 / float32, ``E <= 2048`` divisible by
    ``group_count``; ``norm_type`` 0 softmax / 1 sigmoid over ``x`` (float32); ``bias`` (E,) of
    ``x``'s dtype added for the choice only; with ``group_count > 1`` each group scores its max
    (``group_select_mode`` 0) or the sum of its top two (1) and the best ``k_group`` groups stay;
    the top ``k`` of the kept (``1 <= k <= E / group_count * k_group``, ``k <= 32``) by biased
    score; ``y = s / (sum(s) + eps) * routed_scaling_factor`` over their unbiased scores ``s``.
    Returns ``(y (tokens, k) x's dtype, expert_idx (tokens, k) int32, out)``: ``out`` the
    normalised scores ``(tokens, E)`` float32 with ``out_flag``, an empty tensor without. Ties go
    to the lower index (open in the docs). ``renorm`` 1 (top-k before the norm) and the
    ``input_ids`` / ``tid2eid`` hash routing are not simulated."""
    op = "npu_moe_gating_top_k"
    if input_ids is not None or tid2eid is not None:
        raise _unsupported(op, "input_ids / tid2eid (hash routing)")
    if renorm != 0:
        raise _unsupported(op, f"renorm={renorm}")
    _require(isinstance(x, torch.Tensor) and x.dim() == 2, op, "x must be a 2-D tensor (tokens, experts)")
    _require(x.dtype in _GATING_DTYPES, op, f"x dtype {x.dtype} not supported (float16 / bfloat16 / float32)")
    experts = x.shape[1]
    _require(experts <= MAX_GATING_EXPERTS, op, f"x's last dim (experts) must be <= {MAX_GATING_EXPERTS}")
    _require(isinstance(group_count, int) and group_count >= 1 and experts % group_count == 0, op,
             f"group_count {group_count} must divide the {experts} experts")
    _require(isinstance(k_group, int) and 1 <= k_group <= group_count, op,
             f"k_group must be in [1, group_count = {group_count}], got {k_group}")
    _require(isinstance(k, int) and 1 <= k <= min(32, experts // group_count * k_group), op,
             f"k must be in [1, min(32, x.shape[-1] / group_count * k_group)], got {k}")
    _require(group_select_mode in (0, 1) and norm_type in (0, 1), op,
             f"group_select_mode and norm_type must be 0 or 1, got {group_select_mode}, {norm_type}")
    if bias is not None:
        _require(isinstance(bias, torch.Tensor) and tuple(bias.shape) == (experts,) and bias.dtype == x.dtype, op,
                 f"bias must be ({experts},) of x's dtype, got {tuple(bias.shape)} {bias.dtype}")
    scores = x.float().sigmoid() if norm_type == 1 else x.float().softmax(dim=-1)
    choice = scores if bias is None else scores + bias.float()
    if group_count > 1:
        grouped = choice.view(-1, group_count, experts // group_count)
        if group_select_mode == 1:
            group_scores = grouped.sort(dim=-1, descending=True)[0][..., :2].sum(-1)
        else:
            group_scores = grouped.amax(dim=-1)
        keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(
            1, _top_lowest_index_first(group_scores, k_group), True)
        choice = choice.masked_fill(~keep.repeat_interleave(experts // group_count, dim=1), float("-inf"))
    ids = _top_lowest_index_first(choice, k)
    chosen = scores.gather(1, ids)
    y = chosen / (chosen.sum(-1, keepdim=True) + float(eps)) * float(routed_scaling_factor)
    return y.to(x.dtype), ids.to(torch.int32), scores if out_flag else x.new_empty(0, dtype=torch.float32)


def fia_mla_form(query, key, value, *, query_rope, key_rope, atten_mask, actual_seq_lengths, actual_seq_lengths_kv,
                 block_table, num_heads, scale, input_layout, num_key_value_heads, sparse_mode, block_size,
                 softmax_lse_flag):
    """``npu_fused_infer_attention_score`` with ``query_rope`` / ``key_rope`` (MLA; called by
    ``fake_fia_ops`` with the arguments that matter here, the others already refused there).

    Simulated: ``input_layout="BSND"`` with page attention, sparse_mode 0 (every Q_S = 1, no
    mask) or 3 (the compressed causal mask). ``query`` ``(B, S, N, 512)``, ``S <= 16``,
    ``N = num_heads`` in 32 / 64 / 128; ``query_rope`` ``(B, S, N, 64)``; ``key`` and ``value`` the
    latent cache ``(num_blocks, block_size, 512)`` (one KV head: ``num_key_value_heads=1``),
    ``key_rope`` ``(num_blocks, block_size, 64)``; ``block_size`` 16 or 128; ``block_table`` int32
    ``(B, max_blocks)``; ``actual_seq_lengths_kv`` per batch. ``softmax(scale * (q . k + q_rope .
    k_rope)) . v``, float32 inside, output ``(B, S, N, 512)`` in the query's dtype."""
    op = "npu_fused_infer_attention_score"
    _require(query_rope is not None and key_rope is not None, op,
             "query_rope and key_rope must be configured together (MLA)")
    if input_layout != "BSND":
        raise _unsupported(op, f"the MLA form with input_layout={input_layout!r} (only 'BSND' is)")
    _require(block_table is not None, op, "the MLA form needs page attention (block_table)")
    for name, t in (("query", query), ("key", key), ("value", value), ("query_rope", query_rope),
                    ("key_rope", key_rope)):
        _require(isinstance(t, torch.Tensor) and t.dtype in _HALF and t.dtype == query.dtype, op,
                 f"{name} must be float16 / bfloat16 like query")
        _require(t.is_contiguous(), op, f"{name} must be contiguous")
    _require(query.dim() == 4 and query.shape[3] == KV_RMS_SIZE, op,
             f"MLA query must be (B, S, N, {KV_RMS_SIZE}), got {tuple(query.shape)}")
    batch, q_len, heads, _ = query.shape
    _require(1 <= q_len <= MLA_MAX_QUERY_S and heads in MLA_HEADS and heads == num_heads, op,
             f"MLA query needs S in [1, {MLA_MAX_QUERY_S}] and N = num_heads in {MLA_HEADS}, got S {q_len}, "
             f"N {heads}, num_heads {num_heads}")
    _require(tuple(query_rope.shape) == (batch, q_len, heads, KV_ROPE_SIZE), op,
             f"query_rope must be ({batch}, {q_len}, {heads}, {KV_ROPE_SIZE}), got {tuple(query_rope.shape)}")
    _require(num_key_value_heads == 1, op, f"MLA needs num_key_value_heads=1, got {num_key_value_heads}")
    _require(key.dim() == 3 and key.shape[2] == KV_RMS_SIZE and key.shape == value.shape, op,
             f"MLA key / value must be the latent cache (num_blocks, block_size, {KV_RMS_SIZE}), got "
             f"{tuple(key.shape)} / {tuple(value.shape)}")
    _require(block_size in MLA_BLOCK_SIZES and key.shape[1] == block_size, op,
             f"MLA page attention takes block_size {MLA_BLOCK_SIZES} equal to the cache's, got {block_size}")
    _require(tuple(key_rope.shape) == (*key.shape[:2], KV_ROPE_SIZE), op,
             f"key_rope must be ({key.shape[0]}, {block_size}, {KV_ROPE_SIZE}), got {tuple(key_rope.shape)}")
    _require(block_table.dtype == torch.int32 and block_table.dim() == 2 and block_table.shape[0] == batch, op,
             f"block_table must be int32 ({batch}, max_blocks)")
    if q_len == 1:
        _require(sparse_mode == 0 and atten_mask is None, op, "Q_S = 1 takes sparse_mode=0 without a mask")
    else:
        _require(sparse_mode == 3 and atten_mask is not None, op, "Q_S > 1 takes sparse_mode=3 with the mask")
    lengths = list(actual_seq_lengths_kv or [])
    _require(len(lengths) == batch and all(isinstance(n, int) and 0 <= n <= block_table.shape[1] * block_size
                                           for n in lengths), op,
             f"actual_seq_lengths_kv must hold {batch} per-batch lengths within the block table")
    out = torch.zeros_like(query)
    for b, kv_len in enumerate(lengths):
        if kv_len == 0:
            continue
        blocks = block_table[b, :cdiv(kv_len, block_size)].long()
        latents = key[blocks].flatten(0, 1)[:kv_len].float()
        rope = key_rope[blocks].flatten(0, 1)[:kv_len].float()
        scores = (torch.einsum("snd,kd->nsk", query[b].float(), latents)
                  + torch.einsum("snd,kd->nsk", query_rope[b].float(), rope)) * float(scale)
        _require(kv_len >= q_len, op, "each batch needs Q_S <= KV_S")
        visible = torch.arange(kv_len)[None, :] <= torch.arange(q_len)[:, None] + kv_len - q_len
        scores = scores.masked_fill(~visible[None], float("-inf"))
        out[b] = torch.einsum("nsk,kd->snd", scores.softmax(-1), value[blocks].flatten(0, 1)[:kv_len].float()
                              ).to(out.dtype)
    lse = torch.zeros(1, dtype=torch.float32, device=query.device)
    if softmax_lse_flag:
        raise _unsupported(op, "softmax_lse_flag in the MLA form")
    return out, lse


OPS = (npu_kv_rmsnorm_rope_cache, npu_moe_gating_top_k)

__all__ = ["OPS", "fia_mla_form", "npu_kv_rmsnorm_rope_cache", "npu_moe_gating_top_k"]
