"""Plain-torch kernels: the CPU and CUDA implementations of every op (SDPA for attention)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from atb_plugin.ops import cpu_native
from atb_plugin.ops.graph_capture import GraphUnsupported, capturing
from atb_plugin.utils import cdiv


def write_kv_cache(key, value, key_cache, value_cache, slot_mapping) -> None:
    # Inside a graph every slot is valid (padded rows write the null block): no host check.
    if capturing() is None and not _all_slots_valid(slot_mapping):
        valid = slot_mapping >= 0
        key, value, slot_mapping = key[valid], value[valid], slot_mapping[valid]
    num_kv_heads, head_dim = key_cache.shape[-2:]
    key_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, key.to(key_cache.dtype))
    value_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, value.to(value_cache.dtype))


def _once_per_step(tensor: torch.Tensor, attr: str, key: tuple, build):
    """``build()`` kept on ``tensor`` (under ``attr``, with ``key``): every layer of a step receives
    the same tensor object, so the step pays for it once. ``key`` holds the versions it derives
    from, so a tensor updated in place is derived afresh. ``build()`` must not return a view of
    ``tensor`` (a leak: see ``_rotary_tables``)."""
    cached = getattr(tensor, attr, None)
    if cached is None or cached[0] != key:
        cached = (key, build())
        setattr(tensor, attr, cached)
    return cached[1]


def _all_slots_valid(slot_mapping: torch.Tensor) -> bool:
    """No -1 (padding) slot (on CUDA each check would be a device sync, once per step now)."""
    key = (slot_mapping._version, slot_mapping.data_ptr(), tuple(slot_mapping.shape))
    return _once_per_step(slot_mapping, "_atb_plugin_all_slots_valid", key,
                          lambda: bool((slot_mapping >= 0).all()))


def _sdpa(query, key, value, scale, mask, causal: bool = False):
    """(q_len, H, D) x (k_len, Hkv, D) with GQA; mask (q_len, k_len) bool or None; ``causal``
    (q_len == k_len) lets SDPA use its causal kernel instead of reading a mask."""
    # 4-D (1, H, L, D): on CPU, 3-D inputs fall back to SDPA's unfused math path, slower for
    # BERT-sized heads (benchmarks/RESULTS.md, bench_embed).
    out = F.scaled_dot_product_attention(
        query.transpose(0, 1)[None], key.transpose(0, 1)[None], value.transpose(0, 1)[None], attn_mask=mask,
        scale=scale, is_causal=causal, enable_gqa=query.shape[1] != key.shape[1],
    )
    return out[0].transpose(0, 1)


class _Decodes:
    """Requests with one new token, attended together: by the native kernel over the blocks in
    place (``library``: CPU float32), else in one SDPA call over their gathered, padded contexts."""

    def __init__(self, metadata, rows: list[int], tokens: list[int], block_size: int, device, library=None):
        lens = metadata.seq_lens_cpu[rows]
        self.max_seq_len = int(lens.max())
        self.tokens = torch.tensor(tokens, device=device)
        index = torch.tensor(rows, device=metadata.block_tables.device)
        tables = metadata.block_tables[index][:, :cdiv(self.max_seq_len, block_size)]
        self.library = library
        if library is not None:
            self.tables = tables.to(device=device, dtype=torch.int32).contiguous()
            self.seq_lens = lens.to(torch.int32).contiguous()
            self.max_block = int(self.tables.max())
            return
        self.tables = tables.long().to(device)
        # The new token is the last of its sequence: it sees every cached position < seq_len.
        mask = torch.arange(self.max_seq_len)[None, :] < lens[:, None]
        self.mask = mask[:, None, None, :].to(device)


class _Chunk:
    """One request's new tokens attended on their own: a prefill (chunk) or a lone decode."""

    def __init__(self, metadata, row: int, start: int, end: int, block_size: int, device):
        self.start, self.end = start, end
        self.seq_len = seq_len = int(metadata.seq_lens_cpu[row])
        self.blocks = metadata.block_tables[row][:cdiv(seq_len, block_size)].long().to(device)
        q_len = end - start
        # A decode sees everything; a prefill from an empty cache is plain causal attention; a
        # chunk after cached tokens: new token j sits at position seq_len - q_len + j and sees
        # keys 0 .. that position (bottom-right causal).
        self.causal = q_len == seq_len and q_len > 1
        self.mask = None
        # On the CPU a chunk after cached tokens is two mask-free kernels (_chunk_after_prefix).
        self.split_at = seq_len - q_len if 1 < q_len < seq_len and device.type == "cpu" else None
        if 1 < q_len < seq_len and self.split_at is None:
            query_pos = torch.arange(seq_len - q_len, seq_len)
            self.mask = (torch.arange(seq_len)[None, :] <= query_pos[:, None]).to(device)


class _AttentionStep:
    """What ``paged_attention`` derives from a step's metadata, once for all layers: decodes
    batched together when there are several, everything else request by request."""

    def __init__(self, metadata, block_size: int, device, dtype, head_dim: int):
        starts = metadata.query_start_loc_cpu.tolist()
        spans = [(r, start, end) for r, (start, end) in enumerate(zip(starts[:-1], starts[1:])) if end > start]
        decodes = [(r, start) for r, start, end in spans if end - start == 1]
        # The native kernel takes a lone decode too (it gathers nothing); SDPA only pays off batched.
        library = None
        if head_dim % cpu_native.DECODE_HEAD_DIM_MULTIPLE == 0:
            library = cpu_native.library_for(dtype, device)
        self.decodes = None
        if len(decodes) > (0 if library is not None else 1):
            self.decodes = _Decodes(metadata, [r for r, _ in decodes], [t for _, t in decodes], block_size, device,
                                    library)
        batched = {r for r, _ in decodes} if self.decodes is not None else set()
        self.chunks = [_Chunk(metadata, r, start, end, block_size, device) for r, start, end in spans
                       if r not in batched]
        # Every token a batched decode, in order: the batched output is the whole output.
        self.only_decodes = not self.chunks and self.decodes is not None and len(decodes) == starts[-1]


def _gather_blocks(cache, block_ids: torch.Tensor) -> torch.Tensor:
    """``cache[block_ids]`` for an index tensor of any shape, as ``index_select`` over the
    flattened ids: each block is one contiguous row to copy, several times faster on the CPU than
    advanced indexing's element-wise gather (benchmarks/RESULTS.md, bench_engine "Second round")."""
    return cache.index_select(0, block_ids.flatten()).view(*block_ids.shape, *cache.shape[1:])


def _batched_decode(query, key_cache, value_cache, decodes: _Decodes, scale):
    """(B, H, D) queries, one per request, over the requests' cached contexts."""
    if decodes.library is not None:
        return cpu_native.paged_decode(decodes.library, query, key_cache, value_cache, decodes.tables,
                                       decodes.seq_lens, decodes.max_block, scale)
    key = _gather_blocks(key_cache, decodes.tables).flatten(1, 2)[:, :decodes.max_seq_len]  # (B, max_seq_len, Hkv, D)
    value = _gather_blocks(value_cache, decodes.tables).flatten(1, 2)[:, :decodes.max_seq_len]
    # GQA as query length: a KV head's query heads are consecutive (head h reads KV head
    # h // group), so (B, Hkv, group, D) queries attend each gathered K/V head once, where
    # enable_gqa walks it once per query head (benchmarks/RESULTS.md, bench_engine "Second round").
    batch, heads, head_dim = query.shape
    kv_heads = key.shape[2]
    grouped = query.view(batch, kv_heads, heads // kv_heads, head_dim)
    out = F.scaled_dot_product_attention(
        grouped, key.transpose(1, 2), value.transpose(1, 2), attn_mask=decodes.mask, scale=scale,
    )
    return out.reshape(batch, heads, head_dim)  # (B, H, D)


def captured_decode(query, key_cache, value_cache, metadata, scale) -> torch.Tensor:
    """Decode attention with no host data (what a CUDA graph can hold): each request's whole
    block-table row gathered, the keys past its ``seq_lens`` (a device tensor, read at replay)
    masked. One query token per request. It gathers ``max_model_len`` keys per request whatever
    the context, the price of a shape fixed at capture."""
    if query.shape[0] != metadata.num_reqs:
        raise GraphUnsupported("the plain-torch graph path captures one query token per request (decode); "
                               "speculative verify steps run eager on this platform")
    tables = metadata.block_tables.long()
    key = _gather_blocks(key_cache, tables).flatten(1, 2)  # (B, blocks * block_size, Hkv, D)
    value = _gather_blocks(value_cache, tables).flatten(1, 2)
    visible = torch.arange(key.shape[1], device=query.device)[None, :] < metadata.seq_lens[:, None].long()
    batch, heads, head_dim = query.shape
    kv_heads = key.shape[2]
    grouped = query.view(batch, kv_heads, heads // kv_heads, head_dim)
    out = F.scaled_dot_product_attention(grouped, key.transpose(1, 2), value.transpose(1, 2),
                                         attn_mask=visible[:, None, None, :], scale=scale)
    return out.reshape(batch, heads, head_dim)


def paged_attention(query, key_cache, value_cache, metadata, scale) -> torch.Tensor:
    if capturing() is not None:
        return captured_decode(query, key_cache, value_cache, metadata, scale)
    block_size = key_cache.shape[1]
    head_dim = query.shape[-1]
    step = metadata.derived(f"torch_kernels/{block_size}/{query.dtype}/{head_dim}", query.device,
                            lambda: _AttentionStep(metadata, block_size, query.device, query.dtype, head_dim))
    # Decodes (one new token) are the bulk of a busy batch: one batched call for all of them;
    # prefill chunks, few and long, go one by one (padding them together would waste memory).
    if step.only_decodes:
        return _batched_decode(query, key_cache, value_cache, step.decodes, scale)
    out = torch.empty_like(query)
    if step.decodes is not None:
        tokens = step.decodes.tokens
        out[tokens] = _batched_decode(query[tokens], key_cache, value_cache, step.decodes, scale)
    for chunk in step.chunks:
        key = _gather_blocks(key_cache, chunk.blocks).flatten(0, 1)[:chunk.seq_len]  # (seq_len, num_kv_heads, head_dim)
        value = _gather_blocks(value_cache, chunk.blocks).flatten(0, 1)[:chunk.seq_len]
        if chunk.split_at is not None:
            out[chunk.start:chunk.end] = _chunk_after_prefix(query[chunk.start:chunk.end], key, value, scale,
                                                            chunk.split_at)
        else:
            out[chunk.start:chunk.end] = _sdpa(query[chunk.start:chunk.end], key, value, scale, chunk.mask,
                                               chunk.causal)
    return out


def _chunk_after_prefix(query, key, value, scale, prefix: int):
    """A prefill chunk after ``prefix`` cached tokens (chunked prefill), on the CPU: every cached
    key is visible to every new token, the chunk's own keys causally. Rather than one SDPA call
    with a ``(q_len, seq_len)`` mask (the masked path is slower: benchmarks/RESULTS.md,
    bench_engine), two mask-free flash calls whose outputs are merged by their log-sum-exps (the
    softmax over the union):
    ``out = (o1 e^(l1-m) + o2 e^(l2-m)) / (e^(l1-m) + e^(l2-m))``, ``m = max(l1, l2)``."""
    heads, kv_heads = query.shape[1], key.shape[1]
    q = query.transpose(0, 1)[None]  # (1, H, q_len, D)
    k = key.repeat_interleave(heads // kv_heads, dim=1).transpose(0, 1)[None]  # the op takes no GQA
    v = value.repeat_interleave(heads // kv_heads, dim=1).transpose(0, 1)[None]
    flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    cached_out, cached_lse = flash(q, k[:, :, :prefix], v[:, :, :prefix], scale=scale)[:2]
    own_out, own_lse = flash(q, k[:, :, prefix:], v[:, :, prefix:], is_causal=True, scale=scale)[:2]
    top = torch.maximum(cached_lse, own_lse)
    cached_w, own_w = torch.exp(cached_lse - top).unsqueeze(-1), torch.exp(own_lse - top).unsqueeze(-1)
    out = (cached_out * cached_w + own_out * own_w) / (cached_w + own_w)
    return out[0].transpose(0, 1)  # (q_len, H, D)


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
    library = cpu_native.library_for(x.dtype, x.device)
    if library is not None:
        return cpu_native.rms_norm(library, x, weight, eps)
    input_dtype = x.dtype
    hidden = x.float()
    hidden = hidden * torch.rsqrt(hidden.pow(2).mean(-1, keepdim=True) + eps)
    return weight * hidden.to(input_dtype)


def _rotary_tables(cos, sin) -> tuple[torch.Tensor, torch.Tensor]:
    """``cos`` and ``sin`` with its first half negated, both ``(T, 1, D)``; the latter once per
    step. Only that new tensor is kept on ``cos``: a view of ``cos`` kept there would tie ``cos``
    to itself through the view's base, a cycle the garbage collector cannot see (every step's
    tables leaked)."""
    def build():
        half = sin.shape[-1] // 2
        return torch.cat((-sin[..., :half], sin[..., half:]), dim=-1).unsqueeze(1)

    signed_sin = _once_per_step(cos, "_atb_plugin_signed_sin", (cos._version, sin._version, sin.data_ptr()), build)
    return cos.unsqueeze(1), signed_sin


def apply_rotary(x, cos, sin) -> torch.Tensor:
    # rotate_half(x) * sin == roll(x, half) * signed_sin exactly (the negation moves from x's
    # second half to sin's first half), and it is one op per layer instead of four.
    library = cpu_native.library_for(x.dtype, x.device)
    if library is not None:
        return cpu_native.apply_rotary(library, x, cos, sin)
    cos, signed_sin = _rotary_tables(cos, sin)
    return x * cos + x.roll(x.shape[-1] // 2, dims=-1) * signed_sin


def silu_and_mul(x) -> torch.Tensor:
    library = cpu_native.library_for(x.dtype, x.device)
    if library is not None:
        return cpu_native.silu_and_mul(library, x)
    half = x.shape[-1] // 2
    return F.silu(x[..., :half]) * x[..., half:]


# --------------------------------------------------------------------------------------------
# mixture of experts (ops/moe.py)
# --------------------------------------------------------------------------------------------


def top_k_lowest_index_first(probs: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``top_k`` largest entries of each row, largest first, equal values in index order
    (``torch.topk`` leaves that order open). A stable descending sort of ``E`` router scores per
    token: negligible beside the experts' GEMMs."""
    values, ids = probs.sort(dim=-1, descending=True, stable=True)
    return values[:, :top_k], ids[:, :top_k]


def moe_select_experts(router_logits, top_k: int, renormalize: bool):
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
    weights, ids = top_k_lowest_index_first(probs, top_k)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def moe_grouped_topk(router_logits, routing, correction_bias):
    """DeepSeek's grouped router (``ops.moe.GroupedRouting``), transformers' arithmetic."""
    tokens, experts = router_logits.shape
    if routing.scoring == "sigmoid":
        scores = router_logits.sigmoid()
    else:
        scores = torch.softmax(router_logits, dim=-1)
    choice = scores if correction_bias is None else scores + correction_bias.float()
    if routing.n_group > 1:
        grouped = choice.view(tokens, routing.n_group, experts // routing.n_group)
        if routing.group_score == "top2_sum":
            group_scores = top_k_lowest_index_first(grouped.flatten(0, 1), 2)[0].sum(-1).view(tokens, -1)
        else:
            group_scores = grouped.amax(dim=-1)
        kept = top_k_lowest_index_first(group_scores, routing.topk_group)[1]
        keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, kept, True)
        choice = choice.masked_fill(~keep.repeat_interleave(experts // routing.n_group, dim=1), float("-inf"))
    ids = top_k_lowest_index_first(choice, routing.top_k)[1]
    weights = scores.gather(1, ids)
    if routing.renormalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * routing.routed_scaling_factor, ids


def _grouped_matmul(x: torch.Tensor, weight: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """``x`` (M, K), rows sorted by group with ``counts[g]`` rows for group ``g``, times
    ``weight[g]`` (G, K, N) for each group -> (M, N). On the CPU one ``torch._grouped_mm`` call
    (its loop over groups runs in C++, empty groups cost nothing); it needs rows of a multiple of
    16 bytes (every published MoE size is), so elsewhere, and for odd sizes, one GEMM per group
    that has rows (reading the counts is a device sync off the CPU)."""
    aligned = (x.shape[1] * x.element_size()) % 16 == 0 and (weight.shape[2] * weight.element_size()) % 16 == 0
    if x.device.type == "cpu" and aligned:
        return torch._grouped_mm(x.contiguous(), weight, offs=counts.cumsum(0).to(torch.int32))
    out = x.new_empty(x.shape[0], weight.shape[2])
    start = 0
    for group, count in enumerate(counts.tolist()):
        if count:
            torch.mm(x[start:start + count], weight[group], out=out[start:start + count])
            start += count
    return out


def moe_experts(hidden, weights, ids, w13, w2, first_expert: int) -> torch.Tensor:
    """Each token's k (expert, weight) pairs: the (token, slot) assignments this rank's experts
    own, sorted by expert, run as one grouped GEMM per projection over the active experts
    (never a loop over experts per token), scaled, and added back to their tokens."""
    k = ids.shape[1]
    local = w13.shape[0]
    out = torch.zeros_like(hidden)
    if hidden.shape[0] == 0:
        return out
    flat = ids.reshape(-1) - first_expert  # local expert of every (token, slot), row-major
    mine = (flat >= 0) & (flat < local)
    assignments = None if bool(mine.all()) else mine.nonzero().squeeze(1)  # EP: only this rank's experts
    if assignments is not None:
        if assignments.numel() == 0:
            return out
        flat = flat[assignments]
    order = torch.argsort(flat, stable=True)
    assignments = order if assignments is None else assignments[order]
    counts = torch.bincount(flat, minlength=local)
    rows = assignments // k  # the token of each sorted assignment
    x = hidden.index_select(0, rows)
    gate_up = _grouped_matmul(x, w13, counts)
    down = _grouped_matmul(silu_and_mul(gate_up), w2, counts)
    down = down.to(hidden.dtype) * weights.reshape(-1).index_select(0, assignments).unsqueeze(1).to(hidden.dtype)
    return out.index_add_(0, rows, down)


# --------------------------------------------------------------------------------------------
# quantized linears (ops/quant.py; formulas in docs/quantization.md)
# --------------------------------------------------------------------------------------------

# float32 holds every integer up to 2^24: a dot product of int8 x int8 terms (each |p| <= 2^14)
# over at most 2^10 of them is exact in float32, whatever the summation order.
_EXACT_F32_DEPTH = 1024


def _native_int8(x: torch.Tensor, weight: torch.Tensor):
    """The native library for an int8 linear on the CPU (its operands as the kernels take them),
    or None: the torch formulas below, which are also the kernels' reference."""
    if x.device.type != "cpu" or not weight.is_contiguous():
        return None
    return cpu_native.linear_library(x.device)


def _f32(tensor: torch.Tensor | None) -> torch.Tensor | None:
    return None if tensor is None else tensor.to(torch.float32).contiguous()


def int8_matmul(q: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``q (M, K) int8 @ weight (N, K) int8 .T`` -> ``(M, N)`` int32, exact. The one place the
    W8A8 products multiply: the CPU's native int8 kernels plug in here.

    CUDA: ``torch._int_mm`` where its shape rules hold (M > 16, K and N multiples of 8), else the
    float path. CPU: ``torch._int_mm`` is exact there too but ~20-30x slower, so the float path:
    float32 GEMMs over slices of ``_EXACT_F32_DEPTH`` columns (each exact), converted to int32 and
    summed; as fast as one float32 GEMM, twice as fast as an exact float64 one (docs/quantization.md,
    "What each platform runs", has the measurement)."""
    rows, depth = q.shape
    if (q.device.type == "cuda" and rows > 16 and depth % 8 == 0 and weight.shape[0] % 8 == 0):
        return torch._int_mm(q, weight.t())
    out = None
    for start in range(0, depth, _EXACT_F32_DEPTH):
        part = torch.matmul(q[:, start:start + _EXACT_F32_DEPTH].to(torch.float32),
                            weight[:, start:start + _EXACT_F32_DEPTH].to(torch.float32).t()).to(torch.int32)
        out = part if out is None else out.add_(part)
    return out


def w8a16_linear(x, weight, scale, offset, bias) -> torch.Tensor:
    """``x @ ((weight + offset[:, None]) * scale[:, None]).T + bias``, float32 accumulation,
    returned in ``x.dtype``. Computed as ``(x @ weight.T + sum(x) * offset) * scale``: the scale
    and offset apply to the ``(M, out)`` output, so the weight is read (and converted) once.
    On the CPU the native kernel widens the int8 weights in registers instead (cpu_native)."""
    library = _native_int8(x, weight)
    if library is not None:
        return cpu_native.w8a16_linear(library, x, weight, _f32(scale), _f32(offset), _f32(bias))
    rows = x.reshape(-1, x.shape[-1]).to(torch.float32)
    out = torch.matmul(rows, weight.to(torch.float32).t())
    if offset is not None:
        out = out + rows.sum(dim=-1, keepdim=True) * offset.to(torch.float32)[None, :]
    out = out * scale.to(torch.float32)[None, :]
    if bias is not None:
        out = out + bias.to(torch.float32)
    return out.to(x.dtype).reshape(*x.shape[:-1], weight.shape[0])


def dynamic_quant_per_token(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``rows (M, K)`` -> ``(q int8 (M, K), s float32 (M,))``, ``s = max|row| / 127`` (1 for an
    all-zero row, whose codes are then all zero), ``q = clamp(round(row / s), -128, 127)``
    (round half to even)."""
    rows = rows.to(torch.float32)
    scale = rows.abs().amax(dim=-1) / 127.0
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.clamp(torch.round(rows / scale[:, None]), -128, 127).to(torch.int8)
    return q, scale


def w8a8_dynamic_linear(x, weight, weight_scale, bias) -> torch.Tensor:
    """Per-token dynamic int8 activations: ``(q @ weight.T) * s_t[:, None] * weight_scale[None, :]
    + bias`` with the integer product exact (``int8_matmul``), in ``x.dtype``. On the CPU the
    native kernel quantizes and multiplies in one call (exact int32 sums: cpu_native)."""
    library = _native_int8(x, weight)
    if library is not None:
        return cpu_native.w8a8_dynamic_linear(library, x, weight, _f32(weight_scale), _f32(bias))
    q, token_scale = dynamic_quant_per_token(x.reshape(-1, x.shape[-1]))
    out = int8_matmul(q, weight).to(torch.float32) * token_scale[:, None] * weight_scale.to(torch.float32)[None, :]
    if bias is not None:
        out = out + bias.to(torch.float32)
    return out.to(x.dtype).reshape(*x.shape[:-1], weight.shape[0])


def w8a8_static_linear(x, weight, input_scale, input_offset, deq_scale, quant_bias) -> torch.Tensor:
    """msModelSlim's static W8A8 as vllm-ascend runs it (``npu_quantize`` with the reciprocal
    scale, then ``npu_quant_matmul(scale=deq_scale, bias=quant_bias)``)::

        q = clamp(round(x * (1 / input_scale) + input_offset), -128, 127)      int8, per tensor
        y = (q @ weight.T + quant_bias) * deq_scale                            int32 sum, float32 scale

    in float32, returned in ``x.dtype``."""
    rows = x.reshape(-1, x.shape[-1]).to(torch.float32)
    reciprocal = 1.0 / input_scale.to(torch.float32).reshape(1)
    q = torch.clamp(torch.round(rows * reciprocal + input_offset.to(torch.float32).reshape(1)), -128, 127)
    acc = int8_matmul(q.to(torch.int8), weight) + quant_bias.to(torch.int32)[None, :]
    out = acc.to(torch.float32) * deq_scale.to(torch.float32)[None, :]
    return out.to(x.dtype).reshape(*x.shape[:-1], weight.shape[0])


# --------------------------------------------------------------------------------------------
# multi-head latent attention (ops/mla.py)
# --------------------------------------------------------------------------------------------


def deinterleave(x: torch.Tensor) -> torch.Tensor:
    """``[x0, x1, x2, x3, ...]`` -> ``[x0, x2, ..., x1, x3, ...]`` on the last dimension: the
    interleaved-pair rope layout as rotate-half rotary takes it (``ops.deinterleave``)."""
    return torch.cat((x[..., 0::2], x[..., 1::2]), dim=-1)


def mla_write_latent(latent, gamma, eps, cos, sin, kv_c_cache, k_pe_cache, slot_mapping, interleaved):
    rank = kv_c_cache.shape[-1]
    kv_c = rms_norm(latent[:, :rank], gamma, eps)
    k_pe = latent[:, rank:]
    if interleaved:
        k_pe = deinterleave(k_pe)
    k_pe = apply_rotary(k_pe.unsqueeze(1), cos, sin).squeeze(1)
    kv_c_rows, k_pe_rows = kv_c, k_pe
    if not _all_slots_valid(slot_mapping):
        valid = slot_mapping >= 0
        kv_c_rows, k_pe_rows, slot_mapping = kv_c[valid], k_pe[valid], slot_mapping[valid]
    kv_c_cache.view(-1, rank).index_copy_(0, slot_mapping, kv_c_rows.to(kv_c_cache.dtype))
    k_pe_cache.view(-1, k_pe_cache.shape[-1]).index_copy_(0, slot_mapping, k_pe_rows.to(k_pe_cache.dtype))
    return kv_c, k_pe


class _MlaStep:
    """What the MLA kernels derive from a step's metadata, once for all layers: the requests with
    new tokens (``spans``: row, first token, end token, seq_len), the flat cache slot of every
    context token of theirs in order (``context_slots``) and its cumulative ends, and the batched
    decodes (two or more requests with one new token)."""

    def __init__(self, metadata, block_size: int, device):
        starts = metadata.query_start_loc_cpu.tolist()
        seq_lens = metadata.seq_lens_cpu.tolist()
        self.spans = [(r, s, e, seq_lens[r]) for r, (s, e) in enumerate(zip(starts[:-1], starts[1:])) if e > s]
        rows = torch.tensor([r for r, *_ in self.spans], dtype=torch.long)
        lens = torch.tensor([n for *_, n in self.spans], dtype=torch.long)
        ends = lens.cumsum(0)
        self.context_ends = [0, *ends.tolist()]
        positions = torch.arange(int(ends[-1]) if len(ends) else 0) - torch.repeat_interleave(ends - lens, lens)
        tables = metadata.block_tables.long().to(device)
        row_of = torch.repeat_interleave(rows, lens).to(device)
        positions = positions.to(device)
        self.context_slots = tables[row_of, positions // block_size] * block_size + positions % block_size
        decodes = [(r, s) for r, s, e, _ in self.spans if e - s == 1]
        self.decodes = None
        if len(decodes) > 1:
            self.decodes = _Decodes(metadata, [r for r, _ in decodes], [t for _, t in decodes], block_size, device)
        batched = {r for r, _ in decodes} if self.decodes is not None else set()
        self.chunks = [(i, span) for i, span in enumerate(self.spans) if span[0] not in batched]
        self.only_decodes = not self.chunks and self.decodes is not None


def _mla_step(metadata, block_size: int, device) -> _MlaStep:
    return metadata.derived(f"torch_kernels/mla/{block_size}", device, lambda: _MlaStep(metadata, block_size, device))


def _bottom_right_causal(q_len: int, kv_len: int, device) -> torch.Tensor | None:
    """New token j of ``q_len`` sits at position ``kv_len - q_len + j`` and sees keys up to it;
    None where every key is visible (a lone decode)."""
    if q_len == 1:
        return None
    return (torch.arange(kv_len)[None, :] <= torch.arange(kv_len - q_len, kv_len)[:, None]).to(device)


def mla_gather_context(kv_c_cache, k_pe_cache, metadata):
    step = _mla_step(metadata, kv_c_cache.shape[1], kv_c_cache.device)
    return (kv_c_cache.view(-1, kv_c_cache.shape[-1]).index_select(0, step.context_slots),
            k_pe_cache.view(-1, k_pe_cache.shape[-1]).index_select(0, step.context_slots))


def mla_absorbed_attention(q_latent, q_pe, kv_c_cache, k_pe_cache, metadata, scale):
    """Multi-query attention over the latents: one KV "head" with key ``[c_kv, k_pe]`` and value
    ``c_kv``; every query head of a token is a row of the same (1-head) attention."""
    step = _mla_step(metadata, kv_c_cache.shape[1], kv_c_cache.device)
    query = torch.cat((q_latent, q_pe), dim=-1)
    rank = kv_c_cache.shape[-1]
    out = query.new_empty(*q_latent.shape)
    if step.decodes is not None:
        decodes = step.decodes
        latents = _gather_blocks(kv_c_cache, decodes.tables).flatten(1, 2)[:, :decodes.max_seq_len]  # (B, S, 1, R)
        rope = _gather_blocks(k_pe_cache, decodes.tables).flatten(1, 2)[:, :decodes.max_seq_len]
        key = torch.cat((latents, rope), dim=-1).transpose(1, 2)  # (B, 1, S, R + P)
        rows = query[decodes.tokens].unsqueeze(1)  # (B, 1, H, R + P)
        result = F.scaled_dot_product_attention(rows, key, latents.transpose(1, 2), attn_mask=decodes.mask,
                                                scale=scale)[:, 0]
        if step.only_decodes:
            return result
        out[decodes.tokens] = result
    kv_c_flat, k_pe_flat = kv_c_cache.view(-1, rank), k_pe_cache.view(-1, k_pe_cache.shape[-1])
    for index, (_, start, end, seq_len) in step.chunks:
        slots = step.context_slots[step.context_ends[index]:step.context_ends[index + 1]]
        latents = kv_c_flat.index_select(0, slots)
        key = torch.cat((latents, k_pe_flat.index_select(0, slots)), dim=-1)
        mask = _bottom_right_causal(end - start, seq_len, query.device)
        out[start:end] = F.scaled_dot_product_attention(
            query[start:end].transpose(0, 1)[None], key[None, None], latents[None, None], attn_mask=mask,
            scale=scale)[0].transpose(0, 1)
    return out


def mla_expanded_attention(q_nope, q_pe, k_nope, k_pe, value, metadata, scale):
    starts = metadata.query_start_loc_cpu.tolist()
    seq_lens = metadata.seq_lens_cpu.tolist()
    heads = q_nope.shape[1]
    query = torch.cat((q_nope, q_pe), dim=-1)
    key = torch.cat((k_nope, k_pe.unsqueeze(1).expand(-1, heads, -1)), dim=-1)
    out = value.new_empty(q_nope.shape[0], heads, value.shape[-1])
    context = 0
    for row, (start, end) in enumerate(zip(starts[:-1], starts[1:])):
        if end == start:
            continue
        seq_len = seq_lens[row]
        q_len = end - start
        k, v = key[context:context + seq_len], value[context:context + seq_len]
        causal = q_len == seq_len and q_len > 1
        mask = None if causal else _bottom_right_causal(q_len, seq_len, query.device)
        out[start:end] = _sdpa(query[start:end], k, v, scale, mask, causal)
        context += seq_len
    return out
