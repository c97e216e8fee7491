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
  ``rotary_mode="half"``); ``silu_and_mul``: ``npu_swiglu``;
- ``moe_select_experts`` / ``moe_experts`` (``ops/moe.py``): ``npu_moe_gating_top_k_softmax``, then
  ``npu_moe_init_routing`` -> ``npu_moe_compute_expert_tokens`` -> ``npu_grouped_matmul`` ->
  ``npu_swiglu`` -> ``npu_grouped_matmul`` -> ``npu_moe_finalize_routing``;
- quantised linears (docs/quantization.md): ``w8a16_linear`` ``npu_weight_quant_batchmatmul``;
  ``w8a8_dynamic_linear`` ``npu_dynamic_quant`` -> ``npu_quant_matmul``; ``w8a8_static_linear``
  ``npu_quantize`` -> ``npu_quant_matmul`` (int8 weights passed as ``weight.t()`` views).

Our KV cache layout, ``(num_blocks, block_size, num_kv_heads, head_dim)`` ND, is the one ATB's
ReshapeAndCache / PagedAttention take on Atlas A2/A3, so caches pass through unchanged (310P wants
an NZ layout, which is not supported here). ATB's PagedAttention needs ``block_size % 16 == 0``
(128 recommended); ``paged_attention`` refuses other block sizes up front, at the first prefill,
rather than at the first decode.

The lengths ATB reads on the host (``seq_len``, ``context_lens``) come from the metadata's CPU
copies and are passed through ``host()``, which checks they are CPU tensors and marks them as host
data (the simulated NPU cannot tell placement apart and checks the mark). Per-step derived tensors
(masks, gather indices, host lengths) are built once per step, cached on the ``AttentionMetadata``
(``AttentionMetadata.step_cache``), and shared by all layers. Reading a device tensor on the host
goes through ``_to_host()``, which reports the sync (the simulated NPU counts them); such reads are
cached per step too (on the ``slot_mapping`` / ``cu_seqlens`` tensor every layer receives), so a
step costs the same number of syncs whatever the number of layers.

Inside a graph capture (``ops/graph_capture.py``) decode attention launches
``_npu_paged_attention`` with a workspace in a task group whose update re-launches it with the
step's host ``context_lens`` before each replay, and the cache write skips its host check.

Limits (ATB PagedAttention): ``block_size % 16 == 0`` and ``block_size <= 128``; splitfuse also
``block_size * head_size <= 128 * 128`` and ``head_size <= 256``; SelfAttention (flash) ``head_size
<= 256``; plain paged decode ``head_size <= 576``. Violations raise ``UnsupportedOnNpu`` (a
``NotImplementedError`` and a ``ValueError``) when the kernel is used, before any ATB call.
"""

from __future__ import annotations

import torch

from atb_plugin.ops.graph_capture import GraphUnsupported, capturing
from atb_plugin.ops import torch_kernels
from atb_plugin.platform.npu import torch_npu

BLOCK_SIZE_MULTIPLE = 16  # ATB PagedAttention: "due to hardware restrictions, block_size % 16 == 0"
MAX_BLOCK_SIZE = 128  # ATB PagedAttention (decode and splitfuse): block_size <= 128
MAX_SPLITFUSE_BLOCK_ELEMS = 128 * 128  # splitfuse: block_size * head_size <= 16384
MAX_HEAD_SIZE = {  # per ATB op
    "_npu_flash_attention": 256,
    "_npu_flash_attention_unpad": 256,
    "_npu_paged_attention_splitfuse": 256,
    "_npu_paged_attention": 576,
}
HOST_MARK = "_atb_plugin_host_tensor"  # the attribute the simulated NPU checks (fake_torch_npu.HOST_MARK)
_STEP_CACHE_KEY = "npu_kernels"
_TENSOR_CACHE_ATTR = "_atb_plugin_npu_host_copy"


class UnsupportedOnNpu(NotImplementedError, ValueError):
    """A shape / size the ATB op cannot run (raised by the kernel before calling it)."""


def host(t: torch.Tensor) -> torch.Tensor:
    """Mark ``t`` as host data for an ATB argument read on the host (``seq_len``,
    ``context_lens``); it must already be a CPU tensor. Returns ``t``."""
    if t.device.type != "cpu":
        raise RuntimeError(f"ATB reads this argument on the host; got a tensor on {t.device}")
    setattr(t, HOST_MARK, True)
    return t


def _to_host(t: torch.Tensor) -> torch.Tensor:
    """``t.cpu()`` for a device tensor: a device-to-host sync on a real NPU, reported to the
    simulated one (``torch_npu.npu.note_host_sync``, absent on a real torch_npu)."""
    note = getattr(getattr(torch_npu(), "npu", None), "note_host_sync", None)
    if note is not None:
        note()
    return t.cpu()


def _host_copy_once(t: torch.Tensor, derive):
    """``derive(t.cpu())`` computed once per tensor version and kept on ``t`` itself: every layer
    of a step receives the same ``slot_mapping`` / ``cu_seqlens`` object, so the step pays one
    device-to-host sync, not one per layer."""
    key = (t._version, t.data_ptr(), tuple(t.shape))
    cached = getattr(t, _TENSOR_CACHE_ATTR, None)
    if cached is None or cached[0] != key:
        cached = (key, derive(_to_host(t)))
        setattr(t, _TENSOR_CACHE_ATTR, cached)
    return cached[1]


# --------------------------------------------------------------------------------------------
# KV cache
# --------------------------------------------------------------------------------------------


def _valid_slots(slots_cpu: torch.Tensor):
    """(index of the tokens to write or None for all, count)."""
    valid = slots_cpu >= 0
    if bool(valid.all()):
        return None, slots_cpu.numel()
    return torch.nonzero(valid).flatten(), int(valid.sum())


def write_kv_cache(key, value, key_cache, value_cache, slot_mapping) -> None:
    if capturing() is not None:  # inside a graph every slot is valid (padded rows: the null block)
        index, count = None, slot_mapping.numel()
    else:
        index, count = _host_copy_once(slot_mapping, _valid_slots)
    if count == 0:
        return
    if index is not None:  # -1 slots (padding): ATB does not document skipping them, so drop them
        index = index.to(slot_mapping.device)
        key, value, slot_mapping = key[index], value[index], slot_mapping[index]
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


def _large_negative(dtype: torch.dtype) -> float:
    """vllm-ascend's ``finfo(float32).min`` as it lands in ``dtype``: -inf in fp16 (overflow)."""
    return float("-inf") if dtype == torch.float16 else torch.finfo(torch.float32).min


def _prefill_mask(max_len: int, dtype: torch.dtype, device) -> torch.Tensor:
    """``[max_len, max_len]`` causal mask for ``_npu_flash_attention`` (SelfAttention, NORM mask):
    0/1 (1 = masked) for bfloat16, additive ``finfo(float32).min`` (-inf in fp16) otherwise.
    Built directly in ``dtype`` (no float32 intermediate of the same square size)."""
    value = 1.0 if dtype == torch.bfloat16 else _large_negative(dtype)
    future = torch.ones(max_len, max_len, dtype=torch.bool, device=device).triu_(1)
    return torch.zeros(max_len, max_len, dtype=dtype, device=device).masked_fill_(future, value)


def _splitfuse_mask(positions: torch.Tensor, max_len: int, dtype: torch.dtype) -> torch.Tensor:
    """``[num_tokens, max_len]`` additive mask for ``_npu_paged_attention_splitfuse``: row t hides
    keys after token t's position; -inf (fp16 / fp32) or -10000 (bf16), as vllm-ascend scales it."""
    future = torch.arange(max_len, device=positions.device)[None, :] > positions[:, None]
    value = -10000.0 if dtype == torch.bfloat16 else _large_negative(dtype)
    return torch.zeros(future.shape, dtype=dtype, device=positions.device).masked_fill_(future, value)


# --------------------------------------------------------------------------------------------
# paged attention
# --------------------------------------------------------------------------------------------


def check_paged_limits(block_size: int, head_size: int, op: str | None = None) -> None:
    """Raise ``UnsupportedOnNpu`` unless ATB can run paged attention with this KV block size and
    head size: always ``block_size % 16 == 0`` and ``<= 128`` (the cache outlives the step, and
    decode will need them); for ``op`` also its own limits (head size; splitfuse
    ``block_size * head_size <= 16384``)."""
    if block_size % BLOCK_SIZE_MULTIPLE or block_size > MAX_BLOCK_SIZE:
        raise UnsupportedOnNpu(
            f"NPU paged attention needs a KV block size that is a multiple of {BLOCK_SIZE_MULTIPLE} "
            f"and at most {MAX_BLOCK_SIZE} (ATB PagedAttention; 128 is recommended), got {block_size}")
    if op is None:
        return
    if not 0 < head_size <= MAX_HEAD_SIZE[op]:
        raise UnsupportedOnNpu(f"{op} supports head sizes up to {MAX_HEAD_SIZE[op]}, got {head_size}")
    if op == "_npu_paged_attention_splitfuse" and block_size * head_size > MAX_SPLITFUSE_BLOCK_ELEMS:
        raise UnsupportedOnNpu(
            f"{op} needs block_size * head_size <= 128 * 128, got {block_size} * {head_size}; "
            "use a smaller KV block size")


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
        self.context_lens = host(seq_lens[active].to(torch.int32).contiguous())  # host int32, as ATB reads it
        self.query_lens = host(query_lens[active].to(torch.int32).contiguous())  # host int32
        self.max_seq_len = int(self.context_lens.max()) if self.context_lens.numel() else 0
        # Absolute position of each new token: request r's j-th sits at seq_len[r] - q_len[r] + j.
        request = torch.repeat_interleave(torch.arange(query_lens.numel()), query_lens)
        offset = torch.arange(int(query_lens.sum())) - metadata.query_start_loc_cpu[:-1].to(torch.int64)[request]
        self.positions = ((seq_lens - query_lens)[request] + offset).to(device)
        self.request = request.to(device)
        self._metadata, self._derived = metadata, {}

    def _once(self, key, make):
        """``make()`` on the first layer that asks this step, the same tensor for every later one."""
        if key not in self._derived:
            self._derived[key] = make()
        return self._derived[key]

    def prefill_mask(self, dtype, device) -> torch.Tensor:
        return self._once(("prefill", dtype), lambda: _prefill_mask(self.max_seq_len, dtype, device))

    def splitfuse_mask(self, dtype) -> torch.Tensor:
        return self._once(("splitfuse", dtype), lambda: _splitfuse_mask(self.positions, self.max_seq_len, dtype))

    def new_token_slots(self, block_size: int) -> torch.Tensor:
        """Cache slot of every new token, via the block tables (what the CPU path reads)."""
        def slots():
            tables = self._metadata.block_tables.to(self.positions.device).long()
            blocks = tables[self.request, self.positions // block_size]
            return blocks * block_size + self.positions % block_size
        return self._once(("slots", block_size), slots)


def _step_inputs(metadata, device) -> _StepInputs:
    """The step's ``_StepInputs``, derived once per step (``AttentionMetadata.derived``)."""
    return metadata.derived(_STEP_CACHE_KEY, device, lambda: _StepInputs(metadata, device))


def paged_attention(query, key_cache, value_cache, metadata, scale) -> torch.Tensor:
    num_heads, (block_size, num_kv_heads, head_dim) = query.shape[1], key_cache.shape[1:]
    if metadata.is_decode_only:
        op = "_npu_paged_attention"
    elif metadata.is_prefill_only:
        op = "_npu_flash_attention"
    else:
        op = "_npu_paged_attention_splitfuse"
    check_paged_limits(block_size, head_dim, op)
    out = torch.empty_like(query)
    if query.shape[0] == 0:
        return out
    query = query.contiguous()
    params = capturing()
    if params is not None:
        if op != "_npu_paged_attention":
            raise GraphUnsupported(f"the ATB kernel set captures decode steps only ({op} needs masks built on the "
                                   "host each step); use ATB_PLUGIN_NPU_KERNELS=fia for speculative verify graphs")
        return _captured_decode(query, key_cache, value_cache, metadata, scale, out, params)
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


def _captured_decode(query, key_cache, value_cache, metadata, scale, out, params) -> torch.Tensor:
    """Decode attention inside a graph capture, as vllm-ascend's ACL graphs launch it: with a
    workspace from ``_npu_paged_attention_get_workspace``, in a task group whose update
    re-launches it with this step's host ``context_lens`` before each replay."""
    npu = torch_npu()
    num_heads, num_kv_heads = query.shape[1], key_cache.shape[2]
    tables = metadata.block_tables

    def context_lens(step_metadata):
        return host(step_metadata.seq_lens_cpu)

    workspace = params.workspace(("atb_paged", tuple(query.shape), tables.shape[1]),
                                 lambda: npu._npu_paged_attention_get_workspace(
                                     query=query, key_cache=key_cache, value_cache=value_cache,
                                     num_kv_heads=num_kv_heads, num_heads=num_heads, scale_value=float(scale),
                                     block_table=tables, context_lens=context_lens(metadata), out=out))

    def launch(lengths):
        npu._npu_paged_attention(
            query=query, key_cache=key_cache, value_cache=value_cache, num_kv_heads=num_kv_heads,
            num_heads=num_heads, scale_value=float(scale), block_table=tables, context_lens=lengths, out=out,
            workspace=workspace)

    launch_updatable(params, launch, (context_lens(metadata),), lambda step_metadata: (context_lens(step_metadata),))
    return out


def launch_updatable(params, launch, host_args: tuple, step_host_args) -> None:
    """Capture ``launch(*host_args)`` in a task group and leave in ``params`` an update task that
    re-launches it with ``step_host_args(metadata)`` before each replay (graph_task_update_begin/end;
    an ExternalEvent orders the update before the kernel). Shared with ``npu_fia_kernels``."""
    npu = torch_npu()
    stream = npu.npu.current_stream()
    event = npu.npu.ExternalEvent()
    event.wait(stream)
    event.reset(stream)
    npu.npu.graph_task_group_begin(stream)
    launch(*host_args)
    handle = npu.npu.graph_task_group_end(stream)

    def update(step_metadata, update_stream):
        with npu.npu.stream(update_stream):
            npu.npu.graph_task_update_begin(update_stream, handle)
            launch(*step_host_args(step_metadata))
            npu.npu.graph_task_update_end(update_stream)
            event.record(update_stream)

    params.add_task(update)


# --------------------------------------------------------------------------------------------
# vision / encoder attention
# --------------------------------------------------------------------------------------------


class _Segments:
    """Host int32 lengths of the non-empty segments of ``cu_seqlens``, and the causal masks built
    for them (per dtype / device): derived once per ``cu_seqlens`` tensor, shared by all layers."""

    def __init__(self, cu_cpu: torch.Tensor):
        lengths = (cu_cpu[1:] - cu_cpu[:-1]).to(torch.int32)
        self.lengths = host(lengths[lengths > 0].contiguous())
        self._masks = {}

    def causal_mask(self, dtype, device) -> torch.Tensor:
        key = (dtype, str(device))
        if key not in self._masks:
            self._masks[key] = _prefill_mask(int(self.lengths.max()), dtype, device)
        return self._masks[key]


def varlen_attention(query, key, value, cu_seqlens, scale, causal=False) -> torch.Tensor:
    out = torch.empty_like(query)
    op = "_npu_flash_attention" if causal else "_npu_flash_attention_unpad"
    if not 0 < query.shape[-1] <= MAX_HEAD_SIZE[op]:
        raise UnsupportedOnNpu(f"{op} supports head sizes up to {MAX_HEAD_SIZE[op]}, got {query.shape[-1]}")
    # One host read per cu_seqlens tensor (shared by every layer of the encoder), not per layer.
    segments = _host_copy_once(cu_seqlens, _Segments)
    lengths = segments.lengths
    if lengths.numel() == 0:
        return out
    query, key, value = query.contiguous(), key.contiguous(), value.contiguous()
    npu = torch_npu()
    if causal:
        mask = segments.causal_mask(query.dtype, query.device)
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


# --------------------------------------------------------------------------------------------
# mixture of experts (ops/moe.py): vllm-ascend's fused_experts sequence
# --------------------------------------------------------------------------------------------


def moe_select_experts(router_logits, top_k: int, renormalize: bool):
    """``npu_moe_gating_top_k_softmax`` on float32 logits (the op takes float32; the router's
    softmax runs in float32 on every path, as transformers runs it), then the renormalisation."""
    weights, ids, _ = torch_npu().npu_moe_gating_top_k_softmax(router_logits.float().contiguous(), None, k=top_k)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def moe_experts(hidden, weights, ids, w13, w2, first_expert: int) -> torch.Tensor:
    """Tokens sorted by expert (``npu_moe_init_routing``), each expert's rows counted
    (``npu_moe_compute_expert_tokens``: cumulative ends, the ``group_list`` form 0), one
    ``npu_grouped_matmul`` per projection over all local experts with ``npu_swiglu`` between,
    and the k outputs of each token weighted and summed back into place
    (``npu_moe_finalize_routing``).

    Expert parallelism (``first_expert`` / fewer local experts than the router scores):
    assignments to other ranks' experts get weight 0 and are sent to local expert 0, so the ops
    see in-range ids and fixed shapes (no host sync for the count of local rows); their rows are
    computed and dropped. That wastes the other ranks' share of the expert FLOPs on every rank:
    the real fix is token dispatch / combine (``npu_moe_distribute_dispatch``), not simulated here."""
    tokens, k = ids.shape
    local = w13.shape[0]
    if tokens == 0:
        return torch.zeros_like(hidden)
    npu = torch_npu()
    local_ids = ids.to(torch.int32) - first_expert
    outside = (local_ids < 0) | (local_ids >= local)
    local_ids = local_ids.masked_fill(outside, 0)
    weights = weights.masked_fill(outside, 0)
    # Source row of slot j of token i, in the k-major order the routing ops use: j * tokens + i.
    row_idx = torch.arange(tokens * k, dtype=torch.int32, device=hidden.device).view(k, tokens).t().contiguous()
    expanded_x, expanded_row_idx, expanded_expert_idx = npu.npu_moe_init_routing(
        hidden.contiguous(), row_idx, local_ids, active_num=tokens)
    group_list = npu.npu_moe_compute_expert_tokens(expanded_expert_idx, local).to(torch.int64)
    gate_up = npu.npu_grouped_matmul([expanded_x], [w13], group_list=group_list, split_item=2, group_type=0,
                                     group_list_type=0)[0]
    down = npu.npu_grouped_matmul([npu.npu_swiglu(gate_up, dim=-1)], [w2], group_list=group_list, split_item=2,
                                  group_type=0, group_list_type=0)[0]
    return npu.npu_moe_finalize_routing(
        down, skip1=None, skip2=None, bias=None, scales=weights.to(down.dtype),
        expanded_src_to_dst_row=expanded_row_idx, export_for_source_row=local_ids, drop_pad_mode=0, k=k)


def moe_grouped_topk(router_logits, routing, correction_bias):
    """DeepSeek's router (``ops.moe.GroupedRouting``) in one ``npu_moe_gating_top_k`` (what
    vllm-ascend calls): ``norm_type`` 1 sigmoid / 0 softmax, ``group_select_mode`` 1 top-2 sum /
    0 max, float32 logits and bias (A2 / A3 want a bias: zeros stand in for none). The op always
    renormalises its top-k; a routing without renormalisation (V2) takes the chosen experts'
    scores from the op's normalised scores (``out_flag``) instead."""
    experts = router_logits.shape[-1]
    bias = correction_bias.float() if correction_bias is not None else router_logits.new_zeros(experts)
    weights, ids, scores = torch_npu().npu_moe_gating_top_k(
        router_logits.float().contiguous(), routing.top_k, bias=bias, k_group=routing.topk_group,
        group_count=routing.n_group, group_select_mode=1 if routing.group_score == "top2_sum" else 0, renorm=0,
        norm_type=1 if routing.scoring == "sigmoid" else 0, out_flag=True,
        routed_scaling_factor=routing.routed_scaling_factor, eps=1e-20)
    ids = ids.long()
    if not routing.renormalize:
        weights = scores.gather(1, ids) * routing.routed_scaling_factor
    return weights, ids


# --------------------------------------------------------------------------------------------
# multi-head latent attention (ops/mla.py): vllm-ascend's MLA ops where their shapes fit
# --------------------------------------------------------------------------------------------
#
# The fused ops take DeepSeek-V3's sizes only (torch_npu docs): npu_kv_rmsnorm_rope_cache a latent
# of 512 + 64, the MLA form of npu_fused_infer_attention_score a 512-wide latent query with 64 rope
# dims, 32 / 64 / 128 heads per rank, page blocks of 16 or 128. Other sizes (and float32) run the
# same arithmetic as separate ops (npu_rms_norm, npu_rotary_mul, torch's gathers and SDPA), as
# do prefill chunks (vllm-ascend's prefill kernel, npu_ring_mla, is not simulated here).

MLA_FUSED_WIDTHS = (512, 64)  # (kv_lora_rank, qk_rope_head_dim) the fused MLA ops take
MLA_FIA_HEADS = (32, 64, 128)
MLA_FIA_BLOCK_SIZES = (16, 128)


def _has_op(name: str) -> bool:
    return hasattr(torch_npu(), name)


def mla_write_latent(latent, gamma, eps, cos, sin, kv_c_cache, k_pe_cache, slot_mapping, interleaved):
    rank, rope = kv_c_cache.shape[-1], k_pe_cache.shape[-1]
    tokens = latent.shape[0]
    index, _ = _host_copy_once(slot_mapping, _valid_slots)
    # -1 slots (padding): the op documents none, so a step with them writes through the separate ops
    fused = ((rank, rope) == MLA_FUSED_WIDTHS and interleaved and latent.dtype in (torch.float16, torch.bfloat16)
             and kv_c_cache.dtype == latent.dtype and index is None and _has_op("npu_kv_rmsnorm_rope_cache"))
    if fused:
        _, _, k_pe, kv_c = torch_npu().npu_kv_rmsnorm_rope_cache(
            latent.contiguous().view(tokens, 1, 1, rank + rope), gamma.to(latent.dtype),
            cos.to(latent.dtype).view(tokens, 1, 1, rope), sin.to(latent.dtype).view(tokens, 1, 1, rope),
            slot_mapping.to(torch.int64), k_pe_cache, kv_c_cache, epsilon=float(eps), cache_mode="PA",
            is_output_kv=True)
        return kv_c.view(tokens, rank), k_pe.view(tokens, rope)
    kv_c = rms_norm(latent[:, :rank].contiguous(), gamma, eps)
    k_pe = latent[:, rank:]
    if interleaved:
        k_pe = torch_kernels.deinterleave(k_pe)
    k_pe = apply_rotary(k_pe.unsqueeze(1).contiguous(), cos, sin).squeeze(1)
    slots, kv_c_rows, k_pe_rows = slot_mapping, kv_c, k_pe
    if index is not None:
        index = index.to(slot_mapping.device)
        slots, kv_c_rows, k_pe_rows = slot_mapping[index], kv_c[index], k_pe[index]
    kv_c_cache.view(-1, rank).index_copy_(0, slots, kv_c_rows.to(kv_c_cache.dtype))
    k_pe_cache.view(-1, rope).index_copy_(0, slots, k_pe_rows.to(k_pe_cache.dtype))
    return kv_c, k_pe


def _mla_fia_fits(q_latent, kv_c_cache, k_pe_cache, metadata) -> bool:
    # every request one token (its batch row), DeepSeek-V3's widths, the heads and blocks FIA takes
    return (metadata.is_decode_only and q_latent.shape[0] == metadata.num_reqs
            and (kv_c_cache.shape[-1], k_pe_cache.shape[-1]) == MLA_FUSED_WIDTHS
            and q_latent.shape[1] in MLA_FIA_HEADS and kv_c_cache.shape[1] in MLA_FIA_BLOCK_SIZES
            and q_latent.dtype in (torch.float16, torch.bfloat16) and _has_op("npu_fused_infer_attention_score"))


def mla_absorbed_attention(q_latent, q_pe, kv_c_cache, k_pe_cache, metadata, scale):
    """Decode-only steps at DeepSeek-V3's sizes: ``npu_fused_infer_attention_score`` in its MLA
    form (vllm-ascend's decode): each request's token a batch row (BSND, S = 1), the latent cache
    as key and value (``(num_blocks, block_size, 512)``, one KV head), the rope cache as
    ``key_rope``, no mask (``sparse_mode=0``). Otherwise the plain-op form (module comment)."""
    if not _mla_fia_fits(q_latent, kv_c_cache, k_pe_cache, metadata):
        return torch_kernels.mla_absorbed_attention(q_latent, q_pe, kv_c_cache, k_pe_cache, metadata, scale)
    num_blocks, block_size = kv_c_cache.shape[:2]
    tokens, heads, rank = q_latent.shape
    latents = kv_c_cache.view(num_blocks, block_size, rank)
    # The step's lengths and int32 block table, once for every layer.
    lengths, tables = metadata.derived("npu_kernels/mla", q_latent.device, lambda: (
        metadata.seq_lens_cpu.tolist(), metadata.block_tables.to(q_latent.device, torch.int32).contiguous()))
    out, _ = torch_npu().npu_fused_infer_attention_score(
        q_latent.contiguous().view(tokens, 1, heads, rank), latents, latents,
        query_rope=q_pe.contiguous().view(tokens, 1, heads, -1),
        key_rope=k_pe_cache.view(num_blocks, block_size, -1), actual_seq_lengths_kv=lengths, block_table=tables,
        num_heads=heads, scale=float(scale), input_layout="BSND", num_key_value_heads=1, sparse_mode=0,
        block_size=block_size)
    return out.view(tokens, heads, rank)


# The gathers and the expanded (prefill) form: torch ops on the device (module comment above).
mla_gather_context = torch_kernels.mla_gather_context
mla_expanded_attention = torch_kernels.mla_expanded_attention


# --------------------------------------------------------------------------------------------
# quantised linears (docs/quantization.md): vllm-ascend's W8A16 / W8A8_DYNAMIC / W8A8 sequences
# --------------------------------------------------------------------------------------------
#
# Weight layout: the checkpoint's int8 weight is (out, in); the ops want (in, out) = (k, n). Both
# npu_weight_quant_batchmatmul and npu_quant_matmul take a transposed ND view (``weight.t()``) as
# that layout (it reaches aclnn as transposeX2; the W8A16 op even recommends the transposed weight
# per channel), so the kernels pass ``weight.t()``: no load-time copy, no second int8 weight in
# memory, and the module keeps the checkpoint layout the CPU path reads. (vllm-ascend copies the
# transpose at load because it then casts to the FRACTAL_NZ format, which is not done here.)
# What the ops need in another dtype or shape than the module stores (scales, bias, the repeated
# activation scale) is derived once per parameter and cached on it (``_derived_once``), like
# ``_host_copy_once``: a step pays no per-layer conversion after the first.

_DERIVED_ATTR = "_atb_plugin_npu_derived"


def _derived_once(t: torch.Tensor, key, derive):
    """``derive(t)`` computed once per (parameter version, ``key``, view) and kept on the parameter
    ``t`` is or views: a layer that hands its op a fresh view each call (``weight_scale.view(-1)``)
    still hits the cache. Only for parameters: the data of a step's inputs can change without a
    version bump (numpy-filled buffers), which is why ``_host_copy_once`` keys on the object.
    Inference tensors have no version counter (they cannot be modified in place outside
    inference mode)."""
    owner = t if t._base is None else t._base
    try:
        counter = owner._version
    except RuntimeError:
        counter = None
    version = (counter, owner.data_ptr(), tuple(owner.shape), owner.dtype)
    cache = getattr(owner, _DERIVED_ATTR, None)
    if cache is None or cache[0] != version:
        cache = (version, {})
        setattr(owner, _DERIVED_ATTR, cache)
    entry = (key, t.data_ptr(), tuple(t.shape), t.stride())
    if entry not in cache[1]:
        cache[1][entry] = derive(t)
    return cache[1][entry]


def _as_dtype(t, dtype):
    """``t`` (a parameter) in ``dtype``, converted once; None stays None."""
    if t is None or t.dtype == dtype:
        return t
    return _derived_once(t, ("dtype", dtype), lambda v: v.to(dtype).contiguous())


def _rows(x: torch.Tensor) -> torch.Tensor:
    """``x`` (..., in) as the (tokens, in) matrix the quantised ops take (x1 / x of them is 2-D
    here, so pertoken_scale is the 1-D (m,) the op wants)."""
    return x.reshape(-1, x.shape[-1]).contiguous()


def w8a16_linear(x, weight, scale, offset, bias) -> torch.Tensor:
    """``y = x @ ((weight + offset[:, None]) * scale[:, None]).T + bias`` on
    ``npu_weight_quant_batchmatmul`` (per channel; ``antiquant_offset`` is added before scaling).
    The op wants ``antiquant_scale`` / ``antiquant_offset`` in x's dtype and the bias in float32
    for bfloat16 x, float16 for float16 x: converted once per parameter."""
    out_features = weight.shape[0]
    rows = _rows(x)
    if rows.shape[0] == 0:
        return x.new_zeros(*x.shape[:-1], out_features)
    y = torch_npu().npu_weight_quant_batchmatmul(
        rows, weight.t(), _as_dtype(scale, x.dtype),
        antiquant_offset=_as_dtype(offset, x.dtype),
        bias=_as_dtype(bias, torch.float32 if x.dtype == torch.bfloat16 else x.dtype))
    return y.reshape(*x.shape[:-1], out_features)


def w8a8_dynamic_linear(x, weight, weight_scale, bias) -> torch.Tensor:
    """Per-token symmetric dynamic int8 (``npu_dynamic_quant``), then ``npu_quant_matmul(q,
    weight.t(), weight_scale, pertoken_scale=..., bias=..., output_dtype=x.dtype)``:
    ``y = (q @ weight.T) * weight_scale * token_scale + bias``. The scale goes in float32 (what
    float16 output with a per-token scale requires, and bfloat16 output accepts); the bias in
    float32 unless it is already in x's dtype (both allowed with a per-token scale)."""
    out_features = weight.shape[0]
    rows = _rows(x)
    if rows.shape[0] == 0:
        return x.new_zeros(*x.shape[:-1], out_features)
    npu = torch_npu()
    q, token_scale = npu.npu_dynamic_quant(rows)
    if bias is not None and bias.dtype != x.dtype:
        bias = _as_dtype(bias, torch.float32)
    y = npu.npu_quant_matmul(q, weight.t(), _as_dtype(weight_scale, torch.float32), pertoken_scale=token_scale,
                             bias=bias, output_dtype=x.dtype)
    return y.reshape(*x.shape[:-1], out_features)


def _static_quant_params(input_scale, input_offset, in_features):
    """``npu_quantize``'s multiplier and zero point for the msModelSlim per-tensor activation
    quantisation, as vllm-ascend builds them (1 / input_scale and input_offset repeated over the
    in-features, div_mode=False), kept in float32 rather than the model dtype."""
    reciprocal = _derived_once(input_scale, ("reciprocal", in_features),
                               lambda s: (1.0 / s.float().reshape(-1)).repeat(in_features // s.numel()).contiguous())
    zero = _derived_once(input_offset, ("zero", in_features),
                         lambda o: o.float().reshape(-1).repeat(in_features // o.numel()).contiguous())
    return reciprocal, zero


def _deq_scale_float(deq_scale: torch.Tensor) -> torch.Tensor:
    """``deq_scale`` as float32: msModelSlim stores it int64 (float32 bits) for float16 models
    and float32 for bfloat16 ones; npu_quant_matmul takes float32 for either output dtype."""
    if deq_scale.dtype != torch.int64:
        return _as_dtype(deq_scale, torch.float32)
    return _derived_once(deq_scale, "float32",
                         lambda d: (d & 0xFFFFFFFF).to(torch.int32).view(torch.float32).contiguous())


def w8a8_static_linear(x, weight, input_scale, input_offset, deq_scale, quant_bias) -> torch.Tensor:
    """msModelSlim W8A8 as vllm-ascend's AscendW8A8LinearMethod runs it:
    ``q = clamp(round(x * (1 / input_scale) + input_offset), -128, 127)`` (``npu_quantize``,
    torch.qint8, axis -1, div_mode=False), then ``y = (q @ weight.T + quant_bias) * deq_scale``
    (``npu_quant_matmul``, int32 ``quant_bias``, output in x's dtype). ``quant_bias`` may be None
    (tensor-parallel ranks other than 0 pass none, as vllm-ascend does)."""
    out_features, in_features = weight.shape
    rows = _rows(x)
    if rows.shape[0] == 0:
        return x.new_zeros(*x.shape[:-1], out_features)
    npu = torch_npu()
    reciprocal, zero = _static_quant_params(input_scale, input_offset, in_features)
    q = npu.npu_quantize(rows, reciprocal, zero, torch.qint8, -1, False)
    y = npu.npu_quant_matmul(q, weight.t(), _deq_scale_float(deq_scale), bias=_as_dtype(quant_bias, torch.int32),
                             output_dtype=x.dtype)
    return y.reshape(*x.shape[:-1], out_features)
