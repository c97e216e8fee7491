"""NPU kernels, FIA flavour: the same interface as ``npu_kernels`` (and ``torch_kernels``), with
the paged KV path on the aclnn ops vllm-ascend uses on Atlas A2/A3 with CANN 8.3+:

- ``write_kv_cache``: ``torch_npu.npu_scatter_pa_kv_cache`` with ``cache_mode="Norm"`` (our ND
  cache ``(num_blocks, block_size, num_kv_heads, head_dim)``; the op's default ``'PA_NZ'`` wants
  FRACTAL_NZ caches). ``-1`` slots are dropped first, as in ``npu_kernels``.
- ``paged_attention``: one ``torch_npu.npu_fused_infer_attention_score`` call per layer and step,
  whatever the batch holds (prefill, chunked prefill, decode, or a mix): ``input_layout="TND"``,
  the caches viewed (no copy) as ``(num_blocks, block_size, num_kv_heads * head_dim)``,
  ``block_table``, cumulative ``actual_seq_lengths`` (query ends), per-request
  ``actual_seq_lengths_kv`` (``seq_lens``), ``sparse_mode=3`` (causal triangle anchored at the
  bottom right: request r's j-th new token sees cached tokens ``0 .. seq_len - q_len + j``) with
  the fixed 2048x2048 compressed causal mask.
- ``varlen_attention``, ``rms_norm``, ``apply_rotary``, ``silu_and_mul``, the MoE ops:
  ``npu_kernels``'s (ATB flash attention for vision towers, aclnn elementwise and MoE ops).

Block size: the op's PFA branch (any request with more than one new token) takes page-attention
block sizes that are multiples of 128 in [128, 512] (torch_npu docs: "block_size最小为128, 最大为512,
且要求是128的倍数"); ``paged_attention`` refuses others up front (``check_block_size``), at the
first step, not at the first prefill that happens to reach the op. Dtypes: float16 / bfloat16
(the op has no float32).

Inside a graph capture (``ops/graph_capture.py``) the attention op is launched as
``npu_fused_infer_attention_score.out`` with a workspace, in a task group whose update re-launches
it with the step's lengths before each replay (docs/graph-mode.md).

Host data: the length lists (``SymInt[]`` arguments) come from the metadata's CPU copies and are
built once per step, cached on the ``AttentionMetadata`` object with the device block table, and
shared by every layer; the compressed mask is built once per device (module-level cache).
"""

from __future__ import annotations

import threading

import torch

from atb_plugin.ops import npu_kernels as _atb
from atb_plugin.ops.graph_capture import capturing
from atb_plugin.platform.npu import torch_npu

# Delegated unchanged (same names, same signatures).
varlen_attention = _atb.varlen_attention
rms_norm = _atb.rms_norm
apply_rotary = _atb.apply_rotary
silu_and_mul = _atb.silu_and_mul
moe_select_experts = _atb.moe_select_experts
moe_experts = _atb.moe_experts
moe_grouped_topk = _atb.moe_grouped_topk
mla_write_latent = _atb.mla_write_latent
mla_absorbed_attention = _atb.mla_absorbed_attention
mla_gather_context = _atb.mla_gather_context
mla_expanded_attention = _atb.mla_expanded_attention
w8a16_linear = _atb.w8a16_linear
w8a8_dynamic_linear = _atb.w8a8_dynamic_linear
w8a8_static_linear = _atb.w8a8_static_linear

# The torch_npu functions this set calls are listed in atb_plugin.platform.npu.KERNEL_SET_OPS (the
# platform checks they exist at start-up). The vision towers' varlen attention is still ATB's
# (_npu_flash_attention(_unpad)): serving a VL model on this set needs the ATB library too.

BLOCK_SIZE_MULTIPLE = 128  # FIA page attention with Q_S > 1: multiple of 128 ...
MAX_BLOCK_SIZE = 512  # ... at most 512
MASK_SIZE = 2048  # sparse_mode 2/3/4: the compressed mask is always 2048 x 2048
SPARSE_MODE_RIGHT_DOWN_CAUSAL = 3
_DTYPES = (torch.float16, torch.bfloat16)
_STEP_CACHE_KEY = "npu_fia_kernels"

_masks: dict[str, torch.Tensor] = {}
_masks_lock = threading.Lock()


def check_block_size(block_size: int) -> None:
    """Raise ValueError unless ``block_size`` is one FIA's page attention takes for prefill."""
    if block_size % BLOCK_SIZE_MULTIPLE or not 0 < block_size <= MAX_BLOCK_SIZE:
        raise ValueError(
            f"the FIA NPU kernels (npu_fused_infer_attention_score page attention) need a KV block size "
            f"that is a multiple of {BLOCK_SIZE_MULTIPLE} in [{BLOCK_SIZE_MULTIPLE}, {MAX_BLOCK_SIZE}] "
            f"(128 recommended), got {block_size}")


def causal_mask(device) -> torch.Tensor:
    """The compressed causal mask for ``sparse_mode=3``: ``(2048, 2048)`` int8, 1 (masked) strictly
    above the diagonal (vllm-ascend's ``triu(ones(2048, 2048), diagonal=1).to(int8)``). Built once
    per device; its dtype does not follow the query's (the op takes bool / int8 / uint8 masks)."""
    key = str(torch.device(device))
    mask = _masks.get(key)
    if mask is None:
        with _masks_lock:
            mask = _masks.get(key)
            if mask is None:
                mask = torch.ones(MASK_SIZE, MASK_SIZE, dtype=torch.int8, device=device).triu_(1)
                _masks[key] = mask
    return mask


# --------------------------------------------------------------------------------------------
# KV cache
# --------------------------------------------------------------------------------------------


def write_kv_cache(key, value, key_cache, value_cache, slot_mapping) -> None:
    # Inside a graph every slot is valid (padded rows write the null block): no host check.
    valid = None if capturing() is not None else slot_mapping >= 0
    if valid is not None and not bool(valid.all()):
        key, value, slot_mapping = key[valid], value[valid], slot_mapping[valid]
    if slot_mapping.numel() == 0:
        return
    torch_npu().npu_scatter_pa_kv_cache(
        key.to(key_cache.dtype).contiguous(),
        value.to(value_cache.dtype).contiguous(),
        key_cache,
        value_cache,
        slot_mapping.contiguous(),
        cache_mode="Norm",
    )


# --------------------------------------------------------------------------------------------
# paged attention
# --------------------------------------------------------------------------------------------


class _StepInputs:
    """One step's FIA arguments derived from the metadata's host copies, shared by all layers.
    Requests without new tokens are left out (they own no query rows)."""

    def __init__(self, metadata, device):
        query_lens = metadata.query_lens_cpu.to(torch.int64)
        active = query_lens > 0
        self.all_active = bool(active.all())
        ends = metadata.query_start_loc_cpu[1:].to(torch.int64)
        self.actual_seq_lengths = ends[active].tolist()  # cumulative query ends (TND)
        self.actual_seq_lengths_kv = metadata.seq_lens_cpu.to(torch.int64)[active].tolist()  # per request
        tables = metadata.block_tables
        if not self.all_active:
            tables = tables[torch.nonzero(active).flatten().to(tables.device)]
        self.block_table = tables.to(device=device, dtype=torch.int32).contiguous()


def _step_inputs(metadata, device) -> _StepInputs:
    """The step's ``_StepInputs``, derived once per step (``AttentionMetadata.derived``)."""
    return metadata.derived(_STEP_CACHE_KEY, device, lambda: _StepInputs(metadata, device))


def paged_attention(query, key_cache, value_cache, metadata, scale) -> torch.Tensor:
    num_blocks, block_size, num_kv_heads, head_dim = key_cache.shape
    check_block_size(block_size)
    if query.dtype not in _DTYPES:
        raise ValueError(f"the FIA NPU kernels run float16 / bfloat16 attention, got {query.dtype} "
                         "(load the model in half precision, or use ATB_PLUGIN_NPU_KERNELS=atb)")
    if query.shape[0] == 0:
        return torch.empty_like(query)
    params = capturing()
    if params is not None:
        return _captured_attention(query, key_cache, value_cache, metadata, scale, params)
    step = _step_inputs(metadata, query.device)
    out, _ = torch_npu().npu_fused_infer_attention_score(
        query.contiguous(),
        key_cache.view(num_blocks, block_size, num_kv_heads * head_dim),
        value_cache.view(num_blocks, block_size, num_kv_heads * head_dim),
        atten_mask=causal_mask(query.device),
        actual_seq_lengths=step.actual_seq_lengths,
        actual_seq_lengths_kv=step.actual_seq_lengths_kv,
        block_table=step.block_table,
        num_heads=query.shape[1],
        scale=float(scale),
        input_layout="TND",
        num_key_value_heads=num_kv_heads,
        sparse_mode=SPARSE_MODE_RIGHT_DOWN_CAUSAL,
        block_size=block_size,
    )
    return out


def _graph_lengths(metadata) -> tuple[list[int], list[int]]:
    """(cumulative query ends, KV lengths) from the metadata's host copies: the host parameters a
    captured launch holds, and what each update re-launches with. Every row of a graph batch has
    query tokens (padded rows too), so no row is left out."""
    ends = _atb.host(metadata.query_start_loc_cpu)[1:].tolist()
    return ends, _atb.host(metadata.seq_lens_cpu).tolist()


def _captured_attention(query, key_cache, value_cache, metadata, scale, params) -> torch.Tensor:
    """``paged_attention`` inside a graph capture, as vllm-ascend's full decode graphs launch it:
    ``npu_fused_infer_attention_score.out`` with a workspace sized for these shapes, in a task group
    whose handle becomes an update task (the host lengths of this step re-launched before each
    replay, graph_task_update_begin/end; an ExternalEvent orders the update before the kernel)."""
    npu = torch_npu()
    num_blocks, block_size, num_kv_heads, head_dim = key_cache.shape
    query = query.contiguous()
    key = key_cache.view(num_blocks, block_size, num_kv_heads * head_dim)
    value = value_cache.view(num_blocks, block_size, num_kv_heads * head_dim)
    mask, tables = causal_mask(query.device), metadata.block_tables
    ends, kv_lens = _graph_lengths(metadata)
    workspace = params.workspace(("fia", tuple(query.shape), tuple(key.shape), tables.shape[1]),
                                 lambda: npu._npu_fused_infer_attention_score_get_max_workspace(
                                     query, key, value, atten_mask=mask, actual_seq_lengths=ends,
                                     actual_seq_lengths_kv=kv_lens, block_table=tables, num_heads=query.shape[1],
                                     scale=float(scale), input_layout="TND", num_key_value_heads=num_kv_heads,
                                     sparse_mode=SPARSE_MODE_RIGHT_DOWN_CAUSAL, block_size=block_size))
    out = torch.empty_like(query)
    lse = torch.empty(1, dtype=torch.float32, device=query.device)

    def launch(ends, kv_lens):
        npu.npu_fused_infer_attention_score.out(
            query, key, value, atten_mask=mask, actual_seq_lengths=ends, actual_seq_lengths_kv=kv_lens,
            block_table=tables, num_heads=query.shape[1], scale=float(scale), input_layout="TND",
            num_key_value_heads=num_kv_heads, sparse_mode=SPARSE_MODE_RIGHT_DOWN_CAUSAL, block_size=block_size,
            workspace=workspace, out=[out, lse])

    _atb.launch_updatable(params, launch, (ends, kv_lens), _graph_lengths)
    return out


__all__ = ["BLOCK_SIZE_MULTIPLE", "MASK_SIZE", "MAX_BLOCK_SIZE", "apply_rotary", "causal_mask", "check_block_size",
           "paged_attention", "rms_norm", "silu_and_mul", "varlen_attention", "write_kv_cache"]
