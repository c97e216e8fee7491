"""A simulated ``torch_npu`` for machines without an Ascend NPU: the ATB-backed ops that
``atb_plugin.ops.npu_kernels`` calls, computed in plain torch on CPU tensors with the semantics,
argument names and layouts the real ones document, so tests run the real NPU code path and compare
it with the CPU path. Nothing here returns placeholders: every op computes its documented result,
and calls that break the documented contract (wrong layout, dtype, host/device placement of a
length tensor, block size the hardware refuses) raise ``NpuOpError`` as the real op would fail.

Usage::

    from atb_plugin.testing import fake_torch_npu
    with fake_torch_npu.install() as fake:          # sys.modules["torch_npu"] = fake.module
        with use_platform("npu"):
            ...                                      # NPU kernels call fake.module._npu_* ops
        fake.module.calls["_npu_paged_attention"]    # how often each op ran

Sources of the contracts (read, not copied): Ascend/op-plugin ``op_plugin/ops/atb/*.cpp`` (the
schemas ``_npu_*`` are registered with), the CANN ATB operation docs (ReshapeAndCacheOperation,
SelfAttentionOperation, PagedAttentionOperation and its mask types), the torch_npu API docs
(``npu_rms_norm``, ``npu_rotary_mul``, ``npu_swiglu``; the MoE ops from the torch_npu wheel's
``_op_plugin_docs.py`` and meta registrations; the quantised-linear ops ``npu_quant_matmul``,
``npu_dynamic_quant``, ``npu_weight_quant_batchmatmul``, ``npu_quantize`` from the same and the CANN
aclnn docs), and vllm-ascend
(``vllm_ascend/attention/attention_v1.py``, ``attention_mask.py``; ``vllm_ascend/quantization``
for W8A8 / W8A16), the canonical caller.

Device story. A simulated NPU has no device memory, so its tensors stay on the CPU: the module
says so with ``FAKE_DEVICE = "cpu"``, which ``NpuPlatform.device()`` honours (a real torch_npu has
no such attribute and the platform returns ``torch.device("npu", i)``). Tensors the real ops want
on the *host* (``seq_len``, ``context_lens``: ATB reads them as host data) must be CPU int32 here
too; tensors the real ops want on the device are simply CPU tensors.

``torch.device("npu")``. ``install()`` also renames torch's PrivateUse1 backend to ``"npu"`` (what
the real torch_npu does on import) and registers a ``torch.npu`` device module, so the string
parses. The rename cannot be undone in a process, so it is made harmless for whatever runs after:
the registered ``torch.npu`` is a permanent proxy, and Python PrivateUse1 hooks are registered
beside it; both report a device only while a fake is installed. With none installed,
``torch.accelerator.is_available()`` is False, ``torch._C._get_accelerator()`` and
``torch.get_device_module()`` are CPU again (so ``init_process_group()`` without a backend still
picks gloo), ``torch.manual_seed`` stays silent, and no tensor can be allocated on ``npu``. (With
the rename alone, torch 2.13 raises from ``torch.accelerator.is_available()`` and
``torch.get_device_module()``.) The remainders are that ``torch.device("npu")`` parses and
``torch.accelerator.current_accelerator()`` without ``check_available`` names ``npu``, as it names
``cuda`` on a CUDA build without a GPU.

Dtypes. ATB's attention ops (``_npu_flash_attention``, ``_npu_flash_attention_unpad``,
``_npu_paged_attention``, ``_npu_paged_attention_splitfuse``) and ``_npu_reshape_and_cache`` take
float16 / bfloat16 (the cache op also int8, as the quantised caches do); the fake refuses float32
there, naming the op and the rule, as the real ops do. A test that is about something other than
precision may opt in: ``install(allow_fp32_attention=True)`` or, for a while,
``with handle.allow_fp32_attention(): ...``; fp32 is then treated like float16 (additive masks).
The mask conventions differ by dtype exactly where the real ones do (see ``_npu_flash_attention``).

Host tensors. The simulated NPU's tensors all live on the CPU, so placement cannot tell a host
tensor from a device one. Length tensors the real ops read on the host (``seq_len``,
``context_lens``) must therefore carry the host mark, ``setattr(t, HOST_MARK, True)``, which
``atb_plugin.ops.npu_kernels.host()`` sets after checking the tensor is on the CPU; the fake
refuses unmarked ones ("must be a host tensor").

Host syncs. ``torch_npu.npu.host_syncs`` counts the device-to-host copies the kernels report
through ``npu.note_host_sync()`` (``npu_kernels`` calls it wherever it reads a device tensor on
the host), so tests can bound them per step.

Graph mode. ``torch_npu.npu`` (and ``torch.npu``) also carry the ACL graph API (``NPUGraph``,
``graph``, ``graph_task_group_begin/end``, ``graph_task_update_begin/end``, streams, events) and
the graph-path ops (``npu_fused_infer_attention_score.out``, the get-workspace ops), simulated in
``atb_plugin.testing.fake_npu_graph``: a capture records, a replay re-runs the record over the
same tensors, and what the device would get wrong is refused. ``handle.graph_stats()`` counts
captures and replays.

Schemas. Every op's Python signature follows the real wheel's schema, recorded in
``atb_plugin/testing/npu_schemas.txt`` (``tests/test_npu_schemas.py`` checks it).
"""

from __future__ import annotations

import collections
import contextlib
import contextvars
import functools
import importlib.machinery
import sys
import threading
import types

import torch
import torch.nn.functional as F

from atb_plugin.utils import cdiv

FAKE_DEVICE = "cpu"

HOST_MARK = "_atb_plugin_host_tensor"  # set by npu_kernels.host(): "this tensor is host data"

_HALF_DTYPES = (torch.float16, torch.bfloat16)
_ELEMENTWISE_DTYPES = _HALF_DTYPES + (torch.float32,)  # aclnn RmsNorm / RotaryMul / SwiGlu take fp32 too
_CACHE_DTYPES = _HALF_DTYPES + (torch.int8,)  # ReshapeAndCache: float16 / bfloat16 / int8
_MAX_ATTN_HEAD_SIZE = 256  # SelfAttention / PagedAttention with masks (splitfuse): head_size in (0, 256]
_MAX_PAGED_HEAD_SIZE = 576  # plain PagedAttention decode: head_size in (0, 576]
_BLOCK_SIZE_MULTIPLE = 16  # PagedAttention: "due to hardware restrictions, block_size % 16 == 0"
_MAX_BLOCK_SIZE = 128  # PagedAttention (decode and splitfuse): block_size <= 128
_MAX_SPLITFUSE_BLOCK_ELEMS = 128 * 128  # splitfuse: block_size * head_size <= 16384

# Whether float32 is let through the ATB attention / cache ops (set per call from the module).
_allow_fp32 = contextvars.ContextVar("atb_plugin_fake_npu_allow_fp32", default=False)


class NpuOpError(RuntimeError):
    """A call the real op would reject (torch_npu surfaces ATB failures as RuntimeError)."""


def _require(condition: bool, op: str, message: str) -> None:
    if not condition:
        raise NpuOpError(f"{op}: {message}")


def _check_dtype(op: str, name: str, dtype: torch.dtype, allowed=_HALF_DTYPES) -> None:
    """The ATB attention / cache dtype rule, with the tests' explicit float32 opt-in."""
    if dtype == torch.float32 and _allow_fp32.get():
        return
    if dtype == torch.float32:
        raise NpuOpError(
            f"{op}: {name} is float32, but the ATB op takes float16 / bfloat16"
            f"{' / int8' if torch.int8 in allowed else ''} only; a test that means to run fp32 on the "
            "simulated NPU must opt in with fake_torch_npu.install(allow_fp32_attention=True) or "
            "`with handle.allow_fp32_attention():`")
    _require(dtype in allowed, op, f"{name} dtype {dtype} not supported (takes {', '.join(map(str, allowed))})")


def _host_lengths(t, op: str, name: str, count: int | None = None) -> list[int]:
    """A host-side int32 1-D length tensor (ATB reads it as host data: passing a device tensor
    crashes the real op). On the simulated NPU every tensor is on the CPU, so the caller must also
    have marked it as host data (``HOST_MARK``, set by ``npu_kernels.host()``). Returns its values."""
    _require(isinstance(t, torch.Tensor), op, f"{name} must be a tensor, got {type(t).__name__}")
    _require(t.device.type == "cpu", op, f"{name} must be a host (CPU) tensor, got {t.device}")
    _require(t.dtype == torch.int32, op, f"{name} must be int32, got {t.dtype}")
    _require(t.dim() == 1, op, f"{name} must be 1-D, got shape {tuple(t.shape)}")
    _require(getattr(t, HOST_MARK, False), op,
             f"{name} must be a host tensor: ATB reads it on the host, and this one was not marked as host "
             "data (pass it through atb_plugin.ops.npu_kernels.host(), which checks it is a CPU tensor)")
    if count is not None:
        _require(t.numel() == count, op, f"{name} has {t.numel()} entries, expected {count}")
    return t.tolist()


def _check_heads(op: str, query, num_heads: int, num_kv_heads: int, kv_heads_actual: int, head_size_max: int):
    _require(query.dim() == 3, op, f"query must be [num_tokens, num_heads, head_size], got {tuple(query.shape)}")
    _check_dtype(op, "query", query.dtype)
    _require(query.shape[1] == num_heads, op, f"num_heads={num_heads} but query has {query.shape[1]} heads")
    _require(kv_heads_actual == num_kv_heads, op,
             f"num_kv_heads={num_kv_heads} but key/value carry {kv_heads_actual} heads")
    _require(num_kv_heads > 0 and num_heads % num_kv_heads == 0, op,
             f"GQA needs num_heads % num_kv_heads == 0 (got {num_heads}, {num_kv_heads})")
    _require(0 < query.shape[2] <= head_size_max, op, f"head_size {query.shape[2]} outside (0, {head_size_max}]")


def _check_out(op: str, out, query) -> None:
    _require(isinstance(out, torch.Tensor), op, "out must be a preallocated tensor")
    _require(out.shape == query.shape and out.dtype == query.dtype, op,
             f"out must match query ({tuple(query.shape)}, {query.dtype}), got ({tuple(out.shape)}, {out.dtype})")
    _require(out.is_contiguous(), op, "out must be contiguous (written in place)")


def _attend(q, k, v, scale: float, bias=None):
    """q (Lq, H, D), k/v (Lk, Hkv, D), bias (Lq, Lk) float added to the scores or None. fp32 math."""
    groups = q.shape[1] // k.shape[1]
    k = k.float().repeat_interleave(groups, dim=1)
    v = v.float().repeat_interleave(groups, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.float(), k) * scale
    if bias is not None:
        scores = scores + bias.float()
    return torch.einsum("hqk,khd->qhd", scores.softmax(dim=-1), v)


def _check_paged_cache(op: str, key_cache, value_cache, query, splitfuse: bool, head_size_max: int):
    for name, cache in (("key_cache", key_cache), ("value_cache", value_cache)):
        _require(cache.dim() == 4, op,
                 f"{name} must be ND [num_blocks, block_size, num_kv_heads, head_size], got {tuple(cache.shape)}")
        _require(cache.dtype == query.dtype, op, f"{name} dtype {cache.dtype} != query dtype {query.dtype}")
    _require(key_cache.shape[:3] == value_cache.shape[:3], op, "key_cache and value_cache disagree on layout")
    _require(key_cache.shape[3] == query.shape[2], op,
             f"key_cache head_size {key_cache.shape[3]} != query head_size {query.shape[2]} "
             "(is the cache in [num_blocks, num_kv_heads, block_size, head_size] layout?)")
    block_size = key_cache.shape[1]
    _require(block_size % _BLOCK_SIZE_MULTIPLE == 0, op,
             f"block_size must be a multiple of {_BLOCK_SIZE_MULTIPLE} (hardware restriction), got {block_size}")
    _require(block_size <= _MAX_BLOCK_SIZE, op, f"block_size must be <= {_MAX_BLOCK_SIZE}, got {block_size}")
    if splitfuse:
        _require(block_size * query.shape[2] <= _MAX_SPLITFUSE_BLOCK_ELEMS, op,
                 f"block_size * head_size must be <= 128 * 128, got {block_size} * {query.shape[2]}")
    _require(query.shape[2] <= head_size_max, op, f"head_size {query.shape[2]} outside (0, {head_size_max}]")


def _gather_context(cache, block_table_row, context_len: int):
    block_size = cache.shape[1]
    blocks = block_table_row[: cdiv(context_len, block_size)].long()
    return cache[blocks].flatten(0, 1)[:context_len]


def _check_block_table(op: str, block_table, batch: int, num_blocks: int, block_size: int, max_context: int):
    _require(isinstance(block_table, torch.Tensor) and block_table.dtype == torch.int32, op,
             "block_table must be an int32 tensor")
    _require(block_table.dim() == 2 and block_table.shape[0] == batch, op,
             f"block_table must be [batch={batch}, max_num_blocks_per_seq], got {tuple(block_table.shape)}")
    _require(bool(((block_table >= 0) & (block_table < num_blocks)).all()), op,
             f"block_table values must lie in [0, num_blocks={num_blocks})")
    _require(block_table.shape[1] * block_size >= max_context, op,
             "max_num_blocks_per_seq * block_size must cover max(context_lens)")


# --------------------------------------------------------------------------------------------
# ATB ops (torch_npu's ``atb`` library; schemas as registered by op-plugin)
# --------------------------------------------------------------------------------------------


def _npu_reshape_and_cache(key, value, key_cache, value_cache, slot_indices):
    """``_npu_reshape_and_cache(Tensor key, Tensor value, Tensor(a!) key_cache, Tensor(b!) value_cache,
    Tensor slot_indices) -> ()`` — ATB ReshapeAndCacheOperation.

    Stores each token's ``key[i]`` / ``value[i]`` (``[num_tokens, num_kv_heads, head_size]``) into
    ``key_cache`` / ``value_cache`` (ND ``[num_blocks, block_size, num_kv_heads, head_size]``, the
    layout vllm-ascend allocates on A2/A3; 310P's NZ layout is not simulated) at flat slot
    ``slot_indices[i] = block_id * block_size + offset``, in place. ``slot_indices`` is int32.
    All of key, value and the caches share one dtype. Returns nothing (the schema returns ``()``).
    Negative slots (vLLM's padding id) are not documented for ATB, so the fake refuses them;
    the kernel drops such tokens before calling.
    """
    op = "_npu_reshape_and_cache"
    for name, t in (("key", key), ("value", value)):
        _require(t.dim() == 3, op, f"{name} must be [num_tokens, num_kv_heads, head_size], got {tuple(t.shape)}")
    for name, t in (("key_cache", key_cache), ("value_cache", value_cache)):
        _require(t.dim() == 4, op, f"{name} must be [num_blocks, block_size, num_kv_heads, head_size], "
                                   f"got {tuple(t.shape)}")
        _require(t.is_contiguous(), op, f"{name} must be contiguous (updated in place)")
    _require(key.shape[0] == value.shape[0], op, "key and value disagree on num_tokens")
    _require(key_cache.shape[2:] == key.shape[1:], op,
             f"key {tuple(key.shape)} does not fit key_cache {tuple(key_cache.shape)} "
             "(expected key_cache[..., num_kv_heads, head_size] == key[num_tokens, num_kv_heads, head_size])")
    _require(value_cache.shape[2:] == value.shape[1:], op,
             f"value {tuple(value.shape)} does not fit value_cache {tuple(value_cache.shape)}")
    _require(key_cache.shape[:2] == value_cache.shape[:2], op, "key_cache and value_cache disagree on blocks")
    dtypes = {key.dtype, value.dtype, key_cache.dtype, value_cache.dtype}
    _require(len(dtypes) == 1, op, f"key/value/caches must share one dtype, got {dtypes}")
    _check_dtype(op, "key", key.dtype, _CACHE_DTYPES)
    _require(isinstance(slot_indices, torch.Tensor) and slot_indices.dtype == torch.int32, op,
             "slot_indices must be an int32 tensor")
    _require(slot_indices.dim() == 1 and slot_indices.numel() == key.shape[0], op,
             f"slot_indices must be [num_tokens={key.shape[0]}], got {tuple(slot_indices.shape)}")
    num_slots = key_cache.shape[0] * key_cache.shape[1]
    _require(bool(((slot_indices >= 0) & (slot_indices < num_slots)).all()), op,
             f"slot_indices must lie in [0, num_blocks * block_size = {num_slots})")
    slots = slot_indices.long()
    key_cache.view(num_slots, *key_cache.shape[2:])[slots] = key
    value_cache.view(num_slots, *value_cache.shape[2:])[slots] = value


def _npu_flash_attention(query, key, value, mask, seq_len, scale_value, num_heads, num_kv_heads, out):
    """``_npu_flash_attention(Tensor query, Tensor key, Tensor value, Tensor mask, Tensor seq_len,
    float scale_value, int num_heads, int num_kv_heads, Tensor(a!) out) -> ()`` — ATB
    SelfAttentionOperation, calcType PA_ENCODER, maskType MASK_TYPE_NORM (prefill without cache).

    ``query`` ``[num_tokens, num_heads, head_size]``, ``key``/``value`` ``[num_tokens, num_kv_heads,
    head_size]``: the requests' tokens back to back. ``seq_len``: host int32 ``[batch]``, each
    request's length (not cumulative). Each request attends only within itself:
    ``softmax(scale_value * q·kᵀ ⊕ mask[:L, :L]) · v`` written into ``out`` (same shape as query).
    The op applies no causality of its own: the mask does. ``mask`` is ``[max_seq_len, max_seq_len]``
    (shared) or ``[batch, max_seq_len, max_seq_len]`` with ``max_seq_len >= max(seq_len)``, in the
    query dtype, and its meaning follows the dtype as vllm-ascend builds it:

    * float16 (and the fake's float32): additive; masked entries hold a large negative
      (vllm-ascend fills ``finfo(float32).min``, which is -inf in fp16), visible ones 0;
    * bfloat16: a 0/1 mask, 1 = masked (ATB: "in high-precision mode a NORM mask passes 1");
      the fake refuses other values.
    """
    op = "_npu_flash_attention"
    lengths = _check_self_attention(op, query, key, value, seq_len, num_heads, num_kv_heads)
    _require(isinstance(mask, torch.Tensor) and mask.dtype == query.dtype, op, "mask must be a tensor in the query dtype")
    _require(mask.dim() in (2, 3) and mask.shape[-1] == mask.shape[-2] and mask.shape[-1] >= max(lengths), op,
             f"mask must be [max_seq_len, max_seq_len] or [batch, max_seq_len, max_seq_len] with "
             f"max_seq_len >= {max(lengths)}, got {tuple(mask.shape)}")
    if mask.dim() == 3:
        _require(mask.shape[0] == len(lengths), op, "a per-request mask needs one [max, max] slice per request")
    if query.dtype == torch.bfloat16:
        _require(bool(((mask == 0) | (mask == 1)).all()), op, "a bfloat16 NORM mask must hold 0 (visible) / 1 (masked)")
    _check_out(op, out, query)
    start = 0
    for r, length in enumerate(lengths):
        m = (mask[r] if mask.dim() == 3 else mask)[:length, :length]
        bias = m.float().masked_fill(m == 1, float("-inf")).masked_fill(m != 1, 0.0) \
            if query.dtype == torch.bfloat16 else m
        end = start + length
        out[start:end] = _attend(query[start:end], key[start:end], value[start:end], scale_value, bias).to(out.dtype)
        start = end


def _check_self_attention_kv(op: str, query, key, value) -> None:
    for name, t in (("key", key), ("value", value)):
        _require(t.dim() == 3 and t.shape[0] == query.shape[0] and t.shape[2] == query.shape[2], op,
                 f"{name} must be [num_tokens={query.shape[0]}, num_kv_heads, head_size={query.shape[2]}], "
                 f"got {tuple(t.shape)}")
        _require(t.dtype == query.dtype, op, f"{name} dtype {t.dtype} != query dtype {query.dtype}")
    _require(key.shape == value.shape, op, "key and value shapes differ")


def _check_self_attention(op: str, query, key, value, seq_len, num_heads: int, num_kv_heads: int) -> list[int]:
    """What both self-attention ops require of their inputs; returns the per-request lengths."""
    _check_heads(op, query, num_heads, num_kv_heads, key.shape[1] if key.dim() == 3 else -1, _MAX_ATTN_HEAD_SIZE)
    _check_self_attention_kv(op, query, key, value)
    lengths = _host_lengths(seq_len, op, "seq_len")
    _require(sum(lengths) == query.shape[0] and min(lengths, default=1) > 0, op,
             f"seq_len {lengths} must be positive and sum to num_tokens={query.shape[0]}")
    return lengths


def _npu_flash_attention_unpad(query, key, value, seq_len, scale_value, num_heads, num_kv_heads, out):
    """``_npu_flash_attention_unpad(Tensor query, Tensor key, Tensor value, Tensor seq_len,
    float scale_value, int num_heads, int num_kv_heads, Tensor(a!) out) -> ()`` — ATB
    SelfAttentionOperation, PA_ENCODER with MASK_TYPE_UNDEFINED: no mask, full (bidirectional)
    attention within each request. Layouts as ``_npu_flash_attention``; ``seq_len`` is the host
    int32 per-request lengths (vllm-ascend passes ``torch.diff(cu_seqlens).cpu()`` for vision
    encoders). Writes ``out``.
    """
    op = "_npu_flash_attention_unpad"
    lengths = _check_self_attention(op, query, key, value, seq_len, num_heads, num_kv_heads)
    _check_out(op, out, query)
    start = 0
    for length in lengths:
        end = start + length
        out[start:end] = _attend(query[start:end], key[start:end], value[start:end], scale_value).to(out.dtype)
        start = end


def _npu_paged_attention(query, key_cache, value_cache, num_kv_heads, num_heads, scale_value, block_table,
                         context_lens, out, *, workspace=None):
    """``_npu_paged_attention(Tensor query, Tensor key_cache, Tensor value_cache, int num_kv_heads,
    int num_heads, float scale_value, Tensor block_table, Tensor context_lens, Tensor(a!) out,
    *, Tensor? workspace=None) -> ()`` — ATB PagedAttentionOperation, maskType UNDEFINED (decode).
    ``workspace`` (from ``_npu_paged_attention_get_workspace``, for graph capture) is accepted and
    unused: the simulation needs no scratch memory.

    One query token per sequence: ``query`` ``[batch, num_heads, head_size]``. Sequence b's keys and
    values are its first ``context_lens[b]`` cached tokens (host int32 ``[batch]``: computed + this
    step's token, which ``_npu_reshape_and_cache`` wrote beforehand), found through
    ``block_table[b]`` (int32 ``[batch, max_num_blocks_per_seq]``, physical block ids in
    ``[0, num_blocks)``; logical token t sits in block ``block_table[b][t // block_size]`` at offset
    ``t % block_size``) in the ND caches ``[num_blocks, block_size, num_kv_heads, head_size]``.
    No mask: the token sees its whole context. ``block_size % 16 == 0`` (hardware restriction)
    and ``block_size <= 128``.
    Writes ``softmax(scale_value * q·kᵀ) · v`` into ``out``.
    """
    op = "_npu_paged_attention"
    _check_heads(op, query, num_heads, num_kv_heads, key_cache.shape[2] if key_cache.dim() == 4 else -1,
                 _MAX_PAGED_HEAD_SIZE)
    _check_paged_cache(op, key_cache, value_cache, query, False, _MAX_PAGED_HEAD_SIZE)
    contexts = _host_lengths(context_lens, op, "context_lens", count=query.shape[0])
    _require(min(contexts, default=1) > 0, op, "every context_lens entry must be positive")
    _check_block_table(op, block_table, query.shape[0], key_cache.shape[0], key_cache.shape[1], max(contexts, default=0))
    _check_out(op, out, query)
    _require(workspace is None or isinstance(workspace, torch.Tensor), op, "workspace must be a tensor or None")
    for b, context_len in enumerate(contexts):
        k = _gather_context(key_cache, block_table[b], context_len)
        v = _gather_context(value_cache, block_table[b], context_len)
        out[b:b + 1] = _attend(query[b:b + 1], k, v, scale_value).to(out.dtype)


def _npu_paged_attention_splitfuse(query, key_cache, value_cache, block_table, context_lens, mask, seq_len,
                                   num_kv_heads, num_heads, scale_value, out):
    """``_npu_paged_attention_splitfuse(Tensor query, Tensor key_cache, Tensor value_cache,
    Tensor block_table, Tensor context_lens, Tensor mask, Tensor seq_len, int num_kv_heads,
    int num_heads, float scale_value, Tensor(a!) out) -> ()`` — ATB PagedAttentionOperation with
    calcType CALC_TYPE_SPEC, maskType MASK_TYPE_SPEC ("parallel decoding"); vllm-ascend's
    chunked-prefill / mixed-batch path.

    ``seq_len``: host int32 ``[batch]``, the number of *query* tokens of each sequence this step
    (vllm-ascend passes ``query_lens``); ``context_lens``: host int32 ``[batch]``, each sequence's
    cached tokens including this step's (``seq_lens``). ``query`` ``[sum(seq_len), num_heads,
    head_size]``, sequences back to back. Caches and ``block_table`` as ``_npu_paged_attention``.
    ``mask`` ``[num_tokens, max_seq_len]`` (``max_seq_len >= max(context_lens)``) is *additive*
    in both fp16 and bf16 (vllm-ascend: rows of the causal table picked by each token's position,
    scaled to -inf for fp16 and -10000 for bf16): query token t of sequence b scores context token
    j as ``scale_value * q_t·k_j + mask[t, j]`` for ``j < context_lens[b]``. The op adds no
    causality of its own. Needs block_size % 16 == 0, block_size <= 128, block_size * head_size
    <= 128 * 128. Writes ``out``.
    """
    op = "_npu_paged_attention_splitfuse"
    _check_heads(op, query, num_heads, num_kv_heads, key_cache.shape[2] if key_cache.dim() == 4 else -1,
                 _MAX_ATTN_HEAD_SIZE)
    _check_paged_cache(op, key_cache, value_cache, query, True, _MAX_ATTN_HEAD_SIZE)
    query_lens = _host_lengths(seq_len, op, "seq_len")
    contexts = _host_lengths(context_lens, op, "context_lens", count=len(query_lens))
    _require(sum(query_lens) == query.shape[0], op,
             f"seq_len (query lengths) {query_lens} must sum to num_tokens={query.shape[0]}")
    _require(all(0 < q <= c for q, c in zip(query_lens, contexts)), op,
             "each sequence needs 0 < seq_len <= context_lens")
    _check_block_table(op, block_table, len(query_lens), key_cache.shape[0], key_cache.shape[1],
                       max(contexts, default=0))
    _require(isinstance(mask, torch.Tensor) and mask.dtype == query.dtype, op, "mask must be a tensor in the query dtype")
    _require(mask.dim() == 2 and mask.shape[0] == query.shape[0] and mask.shape[1] >= max(contexts, default=0), op,
             f"mask must be [num_tokens={query.shape[0]}, max_seq_len >= {max(contexts, default=0)}], "
             f"got {tuple(mask.shape)}")
    _check_out(op, out, query)
    start = 0
    for b, (q_len, context_len) in enumerate(zip(query_lens, contexts)):
        end = start + q_len
        k = _gather_context(key_cache, block_table[b], context_len)
        v = _gather_context(value_cache, block_table[b], context_len)
        out[start:end] = _attend(query[start:end], k, v, scale_value, mask[start:end, :context_len]).to(out.dtype)
        start = end


# --------------------------------------------------------------------------------------------
# aclnn ops (torch_npu public API)
# --------------------------------------------------------------------------------------------


def npu_rms_norm(input, gamma, epsilon=1e-06):  # noqa: A002 - torch_npu's Python argument name
    """``npu_rms_norm(Tensor input, Tensor gamma, float epsilon=1e-06) -> (Tensor, Tensor)`` (the
    yaml schema says ``self``; the Python binding, what callers bind to, says ``input``).

    ``y = input * rstd * gamma`` with ``rstd = 1 / sqrt(mean(input², over gamma's trailing dims) +
    epsilon)``, computed in float32, ``y`` cast to ``input``'s dtype. Returns ``(y, rstd)``;
    ``rstd`` is float32 shaped like ``input`` with gamma's dims reduced to 1. ``input`` and
    ``gamma`` share a dtype (float16 / bfloat16 / float32); ``gamma`` matches ``input``'s trailing dims.
    """
    op = "npu_rms_norm"
    _require(input.dtype in _ELEMENTWISE_DTYPES, op, f"dtype {input.dtype} not supported")
    _require(gamma.dtype == input.dtype, op, f"gamma dtype {gamma.dtype} != input dtype {input.dtype}")
    _require(1 <= input.dim() <= 8 and 1 <= gamma.dim() <= input.dim(), op, "input must be 1-8 dims, gamma <= input")
    _require(input.shape[input.dim() - gamma.dim():] == gamma.shape, op,
             f"gamma {tuple(gamma.shape)} must match the trailing dims of input {tuple(input.shape)}")
    dims = tuple(range(input.dim() - gamma.dim(), input.dim()))
    x = input.float()
    rstd = torch.rsqrt(x.pow(2).mean(dim=dims, keepdim=True) + epsilon)
    return (x * rstd * gamma.float()).to(input.dtype), rstd


def npu_rotary_mul(input, r1, r2, rotary_mode="half", rotate=None):  # noqa: A002 - torch_npu's argument name
    """``npu_rotary_mul(Tensor input, Tensor r1, Tensor r2, str rotary_mode='half',
    Tensor? rotate=None) -> Tensor``. ``rotate`` (an explicit rotation matrix, for layouts the two
    modes do not cover) is not simulated: the fake refuses a non-None one rather than ignore it.

    ``r1 * input + r2 * rotate(input)``; ``half``: ``rotate(x) = cat(-x2, x1)`` of the two halves of
    the last dim; ``interleave``: pairs ``(x[2i], x[2i+1]) -> (-x[2i+1], x[2i])``. All three are
    4-D (layouts BNSD / BSND / SBND, r1/r2 broadcast like 11SD / 1S1D / S11D) and share a dtype;
    D is even. Returns a new tensor shaped like ``input``.
    """
    op = "npu_rotary_mul"
    _require(rotate is None, op, "rotate is not simulated by the fake (pass None)")
    for name, t in (("input", input), ("r1", r1), ("r2", r2)):
        _require(t.dim() == 4, op, f"{name} must be 4-D, got {tuple(t.shape)}")
        _require(t.dtype == input.dtype and t.dtype in _ELEMENTWISE_DTYPES, op, f"{name} dtype {t.dtype} mismatch")
    _require(r1.shape == r2.shape, op, "r1 and r2 shapes differ")
    _require(all(a == b or a == 1 for a, b in zip(r1.shape, input.shape)), op,
             f"r1 {tuple(r1.shape)} does not broadcast to input {tuple(input.shape)}")
    _require(r1.shape[-1] == input.shape[-1] and input.shape[-1] % 2 == 0, op, "last dims must match and be even")
    _require(rotary_mode in ("half", "interleave"), op, f"rotary_mode {rotary_mode!r} not supported")
    x = input.float()
    if rotary_mode == "half":
        x1, x2 = x.chunk(2, dim=-1)
        rotated = torch.cat((-x2, x1), dim=-1)
    else:
        rotated = torch.stack((-x[..., 1::2], x[..., ::2]), dim=-1).flatten(-2)
    return (r1.float() * x + r2.float() * rotated).to(input.dtype)


def npu_swiglu(input, dim=-1):  # noqa: A002 - torch_npu's argument name
    """``npu_swiglu(Tensor input, int dim=-1) -> Tensor``: split ``input`` in halves A (first) and
    B (second) along ``dim``; returns ``silu(A) * B = A * sigmoid(A) * B`` in ``input``'s dtype.
    ``input`` must be contiguous and non-empty with an even size along ``dim``."""
    op = "npu_swiglu"
    _require(input.dtype in _ELEMENTWISE_DTYPES, op, f"dtype {input.dtype} not supported")
    _require(input.is_contiguous(), op, "input must be contiguous")
    _require(input.numel() > 0 and input.shape[dim] % 2 == 0, op, f"size along dim {dim} must be even and non-zero")
    a, b = input.float().chunk(2, dim=dim)
    return (F.silu(a) * b).to(input.dtype)


# --------------------------------------------------------------------------------------------
# aclnn MoE ops (torch_npu public API; schemas and docs from the 2.13 wheel:
# npu_native_functions_by_codegen.yaml, _op_plugin_docs.py, op_plugin/meta/_meta_registrations.py)
# --------------------------------------------------------------------------------------------

_MAX_GATING_K = 1024  # npu_moe_gating_top_k_softmax: "k<=1024"
_MAX_ROUTING_ELEMENTS = 1 << 24  # npu_moe_init_routing / compute_expert_tokens: "小于2^24"
_MAX_EXPERTS = 2048  # npu_moe_compute_expert_tokens: num_expert in (0, 2048]
_MAX_GROUPS = 1024  # npu_grouped_matmul, one 3-D weight: "group_list第1维最大支持1024"
_GMM_INNER_LIMIT = 65536  # npu_grouped_matmul: every x / weight last dim < 65536 (A2)


def _int32_matrix(op: str, name: str, t, shape=None) -> None:
    _require(isinstance(t, torch.Tensor) and t.dtype == torch.int32, op, f"{name} must be an int32 tensor")
    _require(t.dim() == 2, op, f"{name} must be 2-D (NUM_ROWS, K), got {tuple(t.shape)}")
    if shape is not None:
        _require(tuple(t.shape) == tuple(shape), op, f"{name} must be {tuple(shape)}, got {tuple(t.shape)}")


def npu_moe_gating_top_k_softmax(x, finished=None, k=1):
    """``npu_moe_gating_top_k_softmax(Tensor x, Tensor? finished=None, int k=1) -> (Tensor, Tensor,
    Tensor)``: softmax over the last dim of ``x`` (2-D or 3-D; float16 / bfloat16 / float32,
    computed in float32), then its top ``k`` (``0 < k <= x.shape[-1]``, ``k <= 1024``). Returns
    ``y`` (the k values, ``x``'s dtype), ``expert_idx`` (their indices, int32) and ``row_idx``
    (int32, ``row_idx[..., i, j] = j * NUM_ROWS + i``: the k-major source-row numbering
    ``npu_moe_init_routing`` takes). The docs leave the order of equal scores open; this fake
    puts the lower expert index first (the CPU kernels' rule). ``finished`` (rows to skip) is
    not simulated: a non-None one is refused rather than ignored."""
    op = "npu_moe_gating_top_k_softmax"
    _require(finished is None, op, "finished is not simulated by the fake (pass None)")
    _require(isinstance(x, torch.Tensor) and x.dim() in (2, 3), op, "x must be a 2-D or 3-D tensor")
    _require(x.dtype in _ELEMENTWISE_DTYPES, op, f"x dtype {x.dtype} not supported (float16 / bfloat16 / float32)")
    _require(isinstance(k, int) and 0 < k <= x.shape[-1] and k <= _MAX_GATING_K, op,
             f"k must satisfy 0 < k <= {x.shape[-1]} (x's last dim) and k <= {_MAX_GATING_K}, got {k}")
    flat = x.reshape(-1, x.shape[-1]).float().softmax(dim=-1)
    values, indices = flat.sort(dim=-1, descending=True, stable=True)
    rows = flat.shape[0]
    row_idx = (torch.arange(k, dtype=torch.int32)[None, :] * rows + torch.arange(rows, dtype=torch.int32)[:, None])
    shape = (*x.shape[:-1], k)
    return (values[:, :k].to(x.dtype).reshape(shape), indices[:, :k].to(torch.int32).reshape(shape),
            row_idx.reshape(shape))


def npu_moe_init_routing(x, row_idx, expert_idx, active_num):
    """``npu_moe_init_routing(Tensor x, Tensor row_idx, Tensor expert_idx, int active_num) ->
    (Tensor, Tensor, Tensor)``: ``x`` (NUM_ROWS, H) float16 / bfloat16 / float32; ``row_idx``,
    ``expert_idx`` (NUM_ROWS, K) int32. The docs' formula::

        expanded_expert_idx, sorted_row_idx = keyValueSort(expert_idx, row_idx)
        expanded_row_idx[sorted_row_idx[i]] = i
        expanded_x[i] = x[sorted_row_idx[i] % NUM_ROWS]

    i.e. the (row, slot) pairs sorted by expert (equal experts by ``row_idx``); ``expanded_x``
    keeps the first ``min(NUM_ROWS, active_num) * K`` rows. Returns ``(expanded_x,
    expanded_row_idx (NUM_ROWS * K,) int32, expanded_expert_idx (NUM_ROWS * K,) int32)``."""
    op = "npu_moe_init_routing"
    _require(isinstance(x, torch.Tensor) and x.dim() == 2, op, "x must be 2-D (NUM_ROWS, H)")
    _require(x.dtype in _ELEMENTWISE_DTYPES, op, f"x dtype {x.dtype} not supported (float16 / bfloat16 / float32)")
    _require(x.numel() < _MAX_ROUTING_ELEMENTS, op, "x must hold fewer than 2^24 elements")
    _int32_matrix(op, "expert_idx", expert_idx)
    _require(expert_idx.shape[0] == x.shape[0], op, f"expert_idx has {expert_idx.shape[0]} rows, x {x.shape[0]}")
    _int32_matrix(op, "row_idx", row_idx, expert_idx.shape)
    _require(bool((expert_idx >= 0).all()), op, "expert_idx values must be >= 0")
    rows, k = expert_idx.shape
    _require(isinstance(active_num, int) and active_num >= 0, op, f"active_num must be an int >= 0, got {active_num!r}")
    source = row_idx.reshape(-1).long()
    _require(torch.equal(source.sort().values, torch.arange(rows * k)), op,
             f"row_idx must number the {rows * k} source rows 0 .. NUM_ROWS * K - 1 once each")
    keys = expert_idx.reshape(-1).long() * (rows * k) + source  # expert first, then row_idx
    order = keys.argsort()
    sorted_row_idx = source[order]
    expanded_row_idx = torch.empty(rows * k, dtype=torch.int32)
    expanded_row_idx[sorted_row_idx] = torch.arange(rows * k, dtype=torch.int32)
    kept = min(rows, active_num) * k
    expanded_x = x[sorted_row_idx[:kept] % rows]
    return expanded_x, expanded_row_idx, expert_idx.reshape(-1)[order].to(torch.int32)


def npu_moe_compute_expert_tokens(sorted_expert_for_source_row, num_expert):
    """``npu_moe_compute_expert_tokens(Tensor sorted_expert_for_source_row, int num_expert) ->
    Tensor``: for each expert i in [0, num_expert), the position after its last row in the sorted
    expert ids (a binary search; an expert with no row repeats the previous end): the cumulative
    counts ``npu_grouped_matmul`` takes as ``group_list_type=0``. Input 1-D int32, non-decreasing,
    values in [0, num_expert - 1], fewer than 2^24 entries; ``num_expert`` in (0, 2048]. Output
    (num_expert,) int32."""
    op = "npu_moe_compute_expert_tokens"
    t = sorted_expert_for_source_row
    _require(isinstance(t, torch.Tensor) and t.dtype == torch.int32 and t.dim() == 1, op,
             "sorted_expert_for_source_row must be a 1-D int32 tensor")
    _require(t.numel() < _MAX_ROUTING_ELEMENTS, op, "sorted_expert_for_source_row must hold fewer than 2^24 entries")
    _require(isinstance(num_expert, int) and 0 < num_expert <= _MAX_EXPERTS, op,
             f"num_expert must be in (0, {_MAX_EXPERTS}], got {num_expert!r}")
    _require(bool(((t >= 0) & (t < num_expert)).all()), op, f"expert ids must lie in [0, {num_expert - 1}]")
    _require(bool((t[1:] >= t[:-1]).all()), op, "sorted_expert_for_source_row must be non-decreasing")
    ends = torch.searchsorted(t.long(), torch.arange(num_expert), right=True)
    return ends.to(torch.int32)


def npu_grouped_matmul(x, weight, *, bias=None, scale=None, offset=None, antiquant_scale=None, antiquant_offset=None,
                       per_token_scale=None, group_list=None, activation_input=None, activation_quant_scale=None,
                       activation_quant_offset=None, split_item=0, group_type=None, group_list_type=0, act_type=0,
                       tuning_config=None, output_dtype=None, x_dtype=None, weight_dtype=None, scale_dtype=None,
                       per_token_scale_dtype=None):
    """``npu_grouped_matmul(Tensor[] x, Tensor[] weight, *, ... Tensor? group_list=None, ...,
    int? split_item=0, int? group_type=None, int? group_list_type=0, int? act_type=0, ...) ->
    Tensor[]`` (full schema in npu_schemas.txt). Simulated: the non-quantised "单单单" case the
    MoE kernels use, ``y[rows of group g] = x[rows of group g] @ weight[0][g]``: one 2-D ``x``
    (M, K), one 3-D ``weight`` (G, K, N) (a transposed view of (G, N, K) is fine: the op
    supports transposed weights), ``group_list`` an int64 1-D tensor of G entries (G <= 1024):
    cumulative ends, non-decreasing, the last equal to M (``group_list_type=0``) or counts
    summing to M (``group_list_type=1``); ``group_type=0`` (split M), ``split_item`` 2 or 3 (one
    output tensor); x and weight share a dtype (float16 / bfloat16 / float32), computed in
    float32, returned as ``[y]`` in that dtype (``output_dtype`` None). Every other argument
    (bias, quantisation scales, activation, the other group / split modes) is refused as not
    simulated."""
    op = "npu_grouped_matmul"
    unsimulated = dict(bias=bias, scale=scale, offset=offset, antiquant_scale=antiquant_scale,
                       antiquant_offset=antiquant_offset, per_token_scale=per_token_scale,
                       activation_input=activation_input, activation_quant_scale=activation_quant_scale,
                       activation_quant_offset=activation_quant_offset, tuning_config=tuning_config,
                       output_dtype=output_dtype, x_dtype=x_dtype, weight_dtype=weight_dtype, scale_dtype=scale_dtype,
                       per_token_scale_dtype=per_token_scale_dtype)
    given = [name for name, value in unsimulated.items() if value is not None]
    _require(not given, op, f"{', '.join(given)} not simulated by the fake (the non-quantised case only)")
    _require(act_type == 0, op, f"act_type {act_type} not simulated (0: no activation)")
    _require(group_type == 0 and split_item in (2, 3), op,
             f"only group_type=0 (split M) with split_item 2 or 3 (one output) is simulated, got group_type="
             f"{group_type}, split_item={split_item}")
    _require(isinstance(x, (list, tuple)) and len(x) == 1 and isinstance(weight, (list, tuple)) and len(weight) == 1,
             op, "x and weight must be lists of one tensor each (one x, one 3-D weight)")
    a, b = x[0], weight[0]
    _require(a.dim() == 2 and b.dim() == 3, op, f"x must be 2-D (M, K) and weight 3-D (G, K, N), got "
                                                f"{tuple(a.shape)} and {tuple(b.shape)}")
    _require(a.dtype == b.dtype and a.dtype in _ELEMENTWISE_DTYPES, op,
             f"x {a.dtype} and weight {b.dtype} must share float16 / bfloat16 / float32")
    _require(a.shape[1] == b.shape[1], op, f"x has K={a.shape[1]}, weight K={b.shape[1]}")
    _require(a.shape[1] < _GMM_INNER_LIMIT and b.shape[2] < _GMM_INNER_LIMIT, op,
             f"the inner dims must be < {_GMM_INNER_LIMIT}")
    _require(a.is_contiguous(), op, "x must not be transposed (contiguous)")
    groups = b.shape[0]
    _require(isinstance(group_list, torch.Tensor) and group_list.dtype == torch.int64 and group_list.dim() == 1, op,
             "group_list must be a 1-D int64 tensor")
    _require(group_list.numel() == groups and groups <= _MAX_GROUPS, op,
             f"group_list has {group_list.numel()} entries for {groups} weight groups (at most {_MAX_GROUPS})")
    _require(group_list_type in (0, 1), op, f"group_list_type must be 0 (cumsum) or 1 (counts), got {group_list_type}")
    _require(bool((group_list >= 0).all()), op, "group_list must be non-negative")
    if group_list_type == 0:
        _require(bool((group_list[1:] >= group_list[:-1]).all()), op, "group_list (cumsum) must be non-decreasing")
        ends = group_list
    else:
        ends = group_list.cumsum(0)
    _require(int(ends[-1]) == a.shape[0], op, f"group_list covers {int(ends[-1])} rows, x has {a.shape[0]}")
    out = torch.empty(a.shape[0], b.shape[2], dtype=a.dtype)
    start = 0
    for g, end in enumerate(ends.tolist()):
        out[start:end] = (a[start:end].float() @ b[g].float()).to(a.dtype)
        start = end
    return [out]


def npu_moe_finalize_routing(expanded_permuted_rows, skip1, skip2, bias, scales, expanded_src_to_dst_row,
                             export_for_source_row, drop_pad_mode=0, k=1):
    """``npu_moe_finalize_routing(Tensor expanded_permuted_rows, Tensor? skip1, Tensor? skip2,
    Tensor? bias, Tensor? scales, Tensor expanded_src_to_dst_row, Tensor? export_for_source_row,
    int? drop_pad_mode=0, int? k=1) -> Tensor``. The docs' formula::

        out[i, j] = skip1[i, j] + skip2[i, j]
                    + sum_k scales[i, k] * (rows[expanded_src_to_dst_row[i + k * NUM_ROWS], j] + bias[e_ik, j])

    with ``e_ik = export_for_source_row[i, k]``. ``expanded_permuted_rows`` (NUM_ROWS * K, H)
    float16 / bfloat16 / float32; ``scales`` (NUM_ROWS, K), ``skip*`` (NUM_ROWS, H), ``bias``
    (E, H) in its dtype; ``expanded_src_to_dst_row`` (NUM_ROWS * K,) int32 in [0, NUM_ROWS * K);
    ``export_for_source_row`` (NUM_ROWS, K) int32 (needed with ``bias``); skip2 only with skip1;
    ``drop_pad_mode`` 0 (dropless). Sums in float32, returns (NUM_ROWS, H) in the rows' dtype."""
    op = "npu_moe_finalize_routing"
    rows_t = expanded_permuted_rows
    _require(isinstance(rows_t, torch.Tensor) and rows_t.dim() == 2 and rows_t.dtype in _ELEMENTWISE_DTYPES, op,
             "expanded_permuted_rows must be a 2-D float16 / bfloat16 / float32 tensor (NUM_ROWS * K, H)")
    _require(drop_pad_mode == 0, op, f"drop_pad_mode must be 0 (dropless), got {drop_pad_mode}")
    if scales is not None:
        _require(scales.dim() == 2 and scales.dtype == rows_t.dtype, op,
                 f"scales must be 2-D (NUM_ROWS, K) in {rows_t.dtype}, got {tuple(scales.shape)} {scales.dtype}")
        num_rows, top_k = scales.shape
    else:
        _require(isinstance(k, int) and k > 0, op, "k must be given (> 0) when scales is None")
        top_k = k
        num_rows = expanded_src_to_dst_row.shape[0] // top_k
    _require(rows_t.shape[0] == num_rows * top_k, op,
             f"expanded_permuted_rows has {rows_t.shape[0]} rows, NUM_ROWS * K = {num_rows * top_k}")
    index = expanded_src_to_dst_row
    _require(isinstance(index, torch.Tensor) and index.dtype == torch.int32 and index.dim() == 1
             and index.numel() == num_rows * top_k, op,
             f"expanded_src_to_dst_row must be a 1-D int32 tensor of NUM_ROWS * K = {num_rows * top_k}")
    _require(bool(((index >= 0) & (index < num_rows * top_k)).all()), op,
             f"expanded_src_to_dst_row values must lie in [0, {num_rows * top_k - 1}]")
    _require(skip2 is None or skip1 is not None, op, "skip2 given without skip1")
    hidden = rows_t.shape[1]
    for name, skip in (("skip1", skip1), ("skip2", skip2)):
        if skip is not None:
            _require(tuple(skip.shape) == (num_rows, hidden) and skip.dtype == rows_t.dtype, op,
                     f"{name} must be ({num_rows}, {hidden}) in {rows_t.dtype}")
    if export_for_source_row is not None:
        _int32_matrix(op, "export_for_source_row", export_for_source_row, (num_rows, top_k))
    if bias is not None:
        _require(bias.dim() == 2 and bias.shape[1] == hidden and bias.dtype == rows_t.dtype, op,
                 f"bias must be (E, {hidden}) in {rows_t.dtype}")
        _require(export_for_source_row is not None, op, "bias needs export_for_source_row (each row's experts)")
    gathered = rows_t.float()[index.long()].view(top_k, num_rows, hidden)  # [slot k][row i]
    if bias is not None:
        gathered = gathered + bias.float()[export_for_source_row.long().t()]
    weight = scales.float().t().unsqueeze(-1) if scales is not None else 1.0
    out = (gathered * weight).sum(dim=0)
    for skip in (skip1, skip2):
        if skip is not None:
            out = out + skip.float()
    return out.to(rows_t.dtype)


# --------------------------------------------------------------------------------------------
# aclnn quantised-linear ops (torch_npu public API; schemas, docs and dtype rules from the 2.13
# wheel: npu_native_functions_by_codegen.yaml, _op_plugin_docs.py, op_plugin/meta/_meta_registrations.py;
# formulas from the CANN aclnn docs of QuantMatmulV4, DynamicQuant, WeightQuantBatchMatmulV2,
# AscendQuantV2). Simulated: the int8 W8A8 / W8A16 cases the kernels use (Atlas A2 / A3 rules);
# int4 packing, int8 / int32 outputs, MoE grouping and the other modes are refused as not simulated.
# --------------------------------------------------------------------------------------------

# The ScalarType enum values the bindings turn a torch.dtype argument into (``int? output_dtype``
# etc. in the schemas; torch_npu's meta registrations map them back with the same table).
_DTYPE_ENUM = {0: torch.uint8, 1: torch.int8, 3: torch.int32, 4: torch.int64, 5: torch.float16, 6: torch.float32,
               12: torch.qint8, 13: torch.quint8, 15: torch.bfloat16, 16: torch.quint4x2}
_QMM_MAX_INNER = 65535  # npu_quant_matmul / npu_weight_quant_batchmatmul: k, n <= 65535
_INT8_MIN, _INT8_MAX = -128, 127
_FP19_MASK = 0xFFFFE000  # int64 scale (npu_trans_quant_param): float32 bits truncated to FP19


def _dtype_arg(op: str, name: str, value):
    """A dtype argument as the binding takes it (a torch.dtype, or its ScalarType enum value)."""
    if value is None or isinstance(value, torch.dtype):
        return value
    _require(isinstance(value, int) and not isinstance(value, bool) and value in _DTYPE_ENUM, op,
             f"{name}={value!r} is not a dtype the op knows")
    return _DTYPE_ENUM[value]


def _is_transposed_view(t) -> bool:
    """The last two dims are a transposed view of a contiguous tensor (torch_npu's
    ``is_transpose_last_two_dims``: what aclnn passes on as transposeX1 / transposeX2)."""
    if t.dim() < 2 or (t.shape[-1] == 1 and t.shape[-2] == 1):
        return False
    if t.stride(-2) != 1 or t.stride(-1) != t.shape[-2]:
        return False
    step = t.shape[-1] * t.shape[-2]
    for d in range(t.dim() - 3, -1, -1):
        if t.stride(d) != step:
            return False
        step *= t.shape[d]
    return True


def _nd_matrix(op: str, name: str, t) -> None:
    """ND layout: contiguous, or a transposed view of a contiguous tensor (the ops read both)."""
    _require(t.is_contiguous() or _is_transposed_view(t), op,
             f"{name} must be contiguous or a transposed view of a contiguous tensor (ND), got strides {t.stride()}")


def _round_half_even_to_int8(values: torch.Tensor) -> torch.Tensor:
    """float32 -> int8: round half to even (the hardware's rint), saturating."""
    return values.round().clamp_(_INT8_MIN, _INT8_MAX).to(torch.int8)


def _int64_scale_as_float(scale: torch.Tensor, op: str) -> torch.Tensor:
    """An int64 ``scale`` (``npu_trans_quant_param`` without offset) as the float32 it packs:
    the low 32 bits hold the float32's bits, read as FP19 (13 low mantissa bits dropped). A scale
    that packs an offset (bits above 32) is not simulated."""
    _require(bool(((scale >> 32) == 0).all()), op, "an int64 scale packing an offset is not simulated")
    bits = (scale & _FP19_MASK).to(torch.int32)  # values < 2^32; the int32 wrap keeps the bit pattern
    return bits.view(torch.float32)


def npu_quant_matmul(x1, x2, scale, *, offset=None, pertoken_scale=None, bias=None, output_dtype=None, x1_dtype=None,
                     x2_dtype=None, pertoken_scale_dtype=None, scale_dtype=None, group_sizes=None, y_scale=None):
    """``npu_quant_matmul(Tensor x1, Tensor x2, Tensor scale, *, Tensor? offset=None, Tensor?
    pertoken_scale=None, Tensor? bias=None, int? output_dtype=None, ...) -> Tensor`` (full schema in
    npu_schemas.txt): the int8 x int8 matmul of aclnnQuantMatmulV4. ``x1`` (..., m, k) int8, ``x2``
    the weight **(..., k, n)** int8 (2-6 dims each, batch dims broadcast): contiguous, or a
    transposed view of a contiguous (n, k) tensor (the docs' ``x2.t()``); ``x1``'s k must equal
    ``x2``'s k, so an untransposed (n, k) weight is refused. The product accumulates exactly in
    int32 (|sum| <= 127 * 128 * 65535 < 2^31). Then, in float32::

        int32 bias:               out = (x1 @ x2 + bias) * scale [* pertoken_scale]
        float bias / no bias:     out = (x1 @ x2) * scale [* pertoken_scale] + bias

    cast to ``output_dtype``. ``scale`` 1-D (1,) or (n,): float32, bfloat16 (bfloat16 output only)
    or int64 (``npu_trans_quant_param``'s FP19 packing; float16 output without pertoken only);
    ``pertoken_scale`` float32 (m,) for 2-D ``x1`` (needs float16 / bfloat16 output); ``bias``
    (n,) or (batch, 1, n): int32 always; bfloat16 with bfloat16 output; float16 only with
    pertoken_scale and float16 output; float32 with pertoken_scale or bfloat16 output.
    Simulated outputs: float16 and bfloat16 (the docs' default, int8, and int32 are refused as not
    simulated, and with them ``offset``); int4 packing, ``x1_dtype`` / ``x2_dtype`` /
    ``scale_dtype`` / ``pertoken_scale_dtype`` / ``group_sizes`` / ``y_scale`` likewise."""
    op = "npu_quant_matmul"
    unsimulated = dict(x1_dtype=x1_dtype, x2_dtype=x2_dtype, pertoken_scale_dtype=pertoken_scale_dtype,
                       scale_dtype=scale_dtype, group_sizes=group_sizes, y_scale=y_scale, offset=offset)
    given = [name for name, value in unsimulated.items() if value is not None]
    _require(not given, op, f"{', '.join(given)} not simulated by the fake (int8 x int8, float output)")
    for name, t in (("x1", x1), ("x2", x2), ("scale", scale)):
        _require(isinstance(t, torch.Tensor) and t.numel() > 0, op, f"{name} must be a non-empty tensor")
    _require(x1.dtype == torch.int8, op, f"x1 must be int8, got {x1.dtype} (int32-packed int4 is not simulated)")
    _require(x2.dtype == x1.dtype, op, f"x2 dtype {x2.dtype} must match x1's ({x1.dtype})")
    _require(2 <= x1.dim() <= 6 and 2 <= x2.dim() <= 6, op,
             f"x1 and x2 must have 2-6 dims, got {x1.dim()} and {x2.dim()}")
    _nd_matrix(op, "x1", x1)
    _nd_matrix(op, "x2", x2)
    m, k = x1.shape[-2:]
    _require(x2.shape[-2] == k, op,
             f"k dim of x1 ({k}) and x2 ({x2.shape[-2]}) must be the same: x2 is the (k, n) weight "
             f"(pass a transposed view of an (n, k) weight), got x2 {tuple(x2.shape)}")
    n = x2.shape[-1]
    _require(k <= _QMM_MAX_INNER and n <= _QMM_MAX_INNER, op, f"the last dims of x1 / x2 must be <= {_QMM_MAX_INNER}")
    try:
        batch = torch.broadcast_shapes(x1.shape[:-2], x2.shape[:-2])
    except RuntimeError:
        raise NpuOpError(f"{op}: the batch shape cannot be broadcast ({tuple(x1.shape)} x {tuple(x2.shape)})") from None
    out_dtype = _dtype_arg(op, "output_dtype", output_dtype)
    _require(out_dtype in _HALF_DTYPES, op,
             f"output_dtype {out_dtype or 'None (int8)'} not simulated by the fake (float16 / bfloat16 only)")
    _require(scale.dim() == 1 and scale.shape[0] in (1, n), op,
             f"scale must be 1-D (1,) or (n={n},), got {tuple(scale.shape)}")
    _require(scale.dtype in (torch.float32, torch.bfloat16, torch.int64), op,
             f"scale dtype {scale.dtype} not supported (float32 / bfloat16 / int64)")
    _require(scale.dtype != torch.bfloat16 or out_dtype == torch.bfloat16, op,
             "when scale's dtype is bfloat16, output_dtype must be bfloat16")
    if pertoken_scale is not None:
        _require(isinstance(pertoken_scale, torch.Tensor) and pertoken_scale.dtype == torch.float32, op,
                 "pertoken_scale must be a float32 tensor")
        _require(pertoken_scale.dim() == 1 and pertoken_scale.shape[0] == m, op,
                 f"pertoken_scale must be 1-D (m={m},), got {tuple(pertoken_scale.shape)}")
    if out_dtype == torch.float16:
        _require(scale.dtype != torch.int64 or pertoken_scale is None, op,
                 "an int64 scale cannot be combined with pertoken_scale")
        _require(pertoken_scale is None or scale.dtype == torch.float32, op,
                 "float16 output with pertoken_scale needs a float32 scale")
    else:
        _require(scale.dtype != torch.int64, op, "bfloat16 output needs a float32 / bfloat16 scale, not int64")
    out_dims = len(batch) + 2
    if bias is not None:
        _require(isinstance(bias, torch.Tensor), op, "bias must be a tensor")
        _require(bias.dtype in (torch.int32, torch.bfloat16, torch.float16, torch.float32), op,
                 f"bias dtype {bias.dtype} not supported (int32 / bfloat16 / float16 / float32)")
        _require(bias.dtype != torch.bfloat16 or out_dtype == torch.bfloat16, op,
                 "when bias dtype is bfloat16, output_dtype must be bfloat16")
        if pertoken_scale is None:
            _require(bias.dtype != torch.float16, op, "bias dtype cannot be float16 when pertoken_scale is not given")
            _require(bias.dtype != torch.float32 or out_dtype == torch.bfloat16, op,
                     "a float32 bias without pertoken_scale needs bfloat16 output")
        else:
            _require(bias.dtype != torch.float16 or out_dtype == torch.float16, op,
                     "when bias dtype is float16 and pertoken_scale is given, output_dtype must be float16")
        if bias.dim() == 1:
            _require(bias.shape[0] == n, op, f"a 1-D bias must be (n={n},), got {tuple(bias.shape)}")
        else:
            _require(bias.dim() == 3 and out_dims == 3 and tuple(bias.shape) == (batch.numel(), 1, n), op,
                     f"bias must be (n,) or, with a 3-D output, (batch, 1, n); got {tuple(bias.shape)}")
    # int32 accumulation, exactly: float64 holds every partial sum (|sum| < 2^31 < 2^53).
    acc = torch.matmul(x1.to(torch.float64), x2.to(torch.float64))
    if bias is not None and bias.dtype == torch.int32:
        acc = acc + bias.to(torch.float64)
    acc = acc.to(torch.int32)
    scale_f = _int64_scale_as_float(scale, op) if scale.dtype == torch.int64 else scale.float()
    out = acc.float() * scale_f
    if pertoken_scale is not None:
        out = out * pertoken_scale[:, None]
    if bias is not None and bias.dtype != torch.int32:
        out = out + bias.float()
    return out.to(out_dtype)


def npu_dynamic_quant(input, *, smooth_scales=None, group_index=None, dst_type=None,  # noqa: A002 - binding's name
                      quant_mode="pertoken", dst_type_max=0.0):
    """``npu_dynamic_quant(Tensor input, *, Tensor? smooth_scales=None, Tensor? group_index=None,
    int? dst_type=None, str quant_mode="pertoken", float dst_type_max=0.0) -> (Tensor, Tensor)``:
    per-token symmetric dynamic quantisation. For each row (token) of ``input`` (float16 /
    bfloat16, at least 2-D), in float32::

        scale = rowMax(|x * smooth_scales|) / 127
        y     = round(x * smooth_scales / scale)        # int8, round half to even

    ``smooth_scales`` (optional) 1-D, the size of the last dim, in ``input``'s dtype. Returns ``(y``
    int8 shaped like ``input``, ``scale`` float32 shaped like ``input`` without its last dim``)``.
    A row of zeros (the docs' formula divides 0 by 0) gives y = 0, scale = 0. ``dst_type`` None /
    int8 and ``quant_mode="pertoken"`` are simulated; ``group_index`` (MoE), int4 output and the
    other modes are refused as not simulated."""
    op = "npu_dynamic_quant"
    _require(isinstance(input, torch.Tensor) and input.dtype in _HALF_DTYPES, op,
             f"input must be a float16 / bfloat16 tensor, got {getattr(input, 'dtype', type(input).__name__)}")
    _require(input.dim() > 1 and input.numel() > 0, op, f"input must have more than 1 dim and not be empty, "
                                                        f"got {tuple(input.shape)}")
    _require(group_index is None, op, "group_index (MoE groups) not simulated by the fake")
    _require(quant_mode == "pertoken" and dst_type_max == 0.0, op,
             f"only quant_mode='pertoken' (dst_type_max 0.0) is simulated, got {quant_mode!r}, {dst_type_max!r}")
    target = _dtype_arg(op, "dst_type", dst_type)
    _require(target in (None, torch.int8), op, f"dst_type {target} not simulated (int8 only)")
    x = input.float()
    if smooth_scales is not None:
        _require(isinstance(smooth_scales, torch.Tensor) and smooth_scales.dtype == input.dtype, op,
                 f"smooth_scales must be a tensor in input's dtype ({input.dtype})")
        _require(smooth_scales.dim() == 1 and smooth_scales.shape[0] == input.shape[-1], op,
                 f"smooth_scales must be 1-D with {input.shape[-1]} entries, got {tuple(smooth_scales.shape)}")
        x = x * smooth_scales.float()
    scale = x.abs().amax(dim=-1) / _INT8_MAX
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    y = _round_half_even_to_int8(x / safe[..., None])
    return y, scale


def npu_weight_quant_batchmatmul(x, weight, antiquant_scale, antiquant_offset=None, quant_scale=None,
                                 quant_offset=None, bias=None, antiquant_group_size=0, inner_precise=0,
                                 weight_dtype=None):
    """``npu_weight_quant_batchmatmul(Tensor x, Tensor weight, Tensor antiquant_scale, Tensor?
    antiquant_offset=None, Tensor? quant_scale=None, Tensor? quant_offset=None, Tensor? bias=None,
    int antiquant_group_size=0, int inner_precise=0, int? weight_dtype=None) -> Tensor``: W8A16
    (aclnnWeightQuantBatchMatmulV2)::

        y = x @ ((weight + antiquant_offset) * antiquant_scale) + bias

    ``x`` (M, K) float16 / bfloat16; ``weight`` **(K, N)** int8, contiguous or a transposed view of
    a contiguous (N, K) tensor (the docs recommend the transposed one per channel); K, N in
    [1, 65535]. ``antiquant_scale`` in ``x``'s dtype: per tensor (1,) / (1, 1), per channel (N,) /
    (1, N), per group (ceil(K / antiquant_group_size), N) with the group size a multiple of 32 in
    [32, K - 1]; ``antiquant_offset`` (optional) the same shape and dtype (the offset is *added*
    before scaling). ``bias`` (N,) / (1, N), contiguous: float32 for bfloat16 ``x``, float16 for
    float16 ``x``. Precision model: the antiquantised weight is rounded to ``x``'s dtype (the cube
    unit multiplies float16 / bfloat16), products accumulate in float32, bias added in float32,
    result in ``x``'s dtype. Not simulated (refused): ``quant_scale`` / ``quant_offset`` (int8
    output), an int64 ``antiquant_scale``, int32-packed int4 weights, ``weight_dtype``."""
    op = "npu_weight_quant_batchmatmul"
    unsimulated = dict(quant_scale=quant_scale, quant_offset=quant_offset, weight_dtype=weight_dtype)
    given = [name for name, value in unsimulated.items() if value is not None]
    _require(not given, op, f"{', '.join(given)} not simulated by the fake (int8 weight, float output)")
    _require(isinstance(x, torch.Tensor) and x.dtype in _HALF_DTYPES, op,
             f"x must be a float16 / bfloat16 tensor, got {getattr(x, 'dtype', type(x).__name__)}")
    _require(isinstance(weight, torch.Tensor) and weight.dtype == torch.int8, op,
             f"weight must be int8, got {getattr(weight, 'dtype', type(weight).__name__)} "
             "(int32-packed int4 is not simulated)")
    _require(x.dim() == 2 and weight.dim() == 2, op,
             f"x must be (M, K) and weight (K, N), got {tuple(x.shape)} and {tuple(weight.shape)}")
    _require(x.numel() > 0 and weight.numel() > 0, op, "empty tensors are not supported")
    _nd_matrix(op, "x", x)
    _nd_matrix(op, "weight", weight)
    k, n = x.shape[1], weight.shape[1]
    _require(weight.shape[0] == k, op,
             f"weight must be (K={k}, N): x's K and weight's K differ (weight {tuple(weight.shape)}; pass a "
             "transposed view of an (N, K) weight)")
    _require(k <= _QMM_MAX_INNER and n <= _QMM_MAX_INNER, op, f"K and N must be in [1, {_QMM_MAX_INNER}]")
    _require(isinstance(antiquant_scale, torch.Tensor) and antiquant_scale.dtype == x.dtype, op,
             f"antiquant_scale must be in x's dtype ({x.dtype}), got "
             f"{getattr(antiquant_scale, 'dtype', type(antiquant_scale).__name__)} (int64 is not simulated)")
    _require(inner_precise in (0, 1), op, f"inner_precise must be 0 or 1, got {inner_precise!r}")
    shape = tuple(antiquant_scale.shape)
    if antiquant_group_size:
        _require(isinstance(antiquant_group_size, int) and antiquant_group_size % 32 == 0
                 and 32 <= antiquant_group_size <= k - 1, op,
                 f"antiquant_group_size must be a multiple of 32 in [32, K-1={k - 1}], got {antiquant_group_size!r}")
        groups = cdiv(k, antiquant_group_size)
        _require(shape == (groups, n), op, f"per-group antiquant_scale must be ({groups}, {n}), got {shape}")
    else:
        _require(shape in ((1,), (1, 1), (n,), (1, n)), op,
                 f"antiquant_scale must be (1,) / (1, 1) per tensor or ({n},) / (1, {n}) per channel, got {shape}")
    if antiquant_offset is not None:
        _require(isinstance(antiquant_offset, torch.Tensor) and antiquant_offset.dtype == antiquant_scale.dtype, op,
                 f"antiquant_offset must be in antiquant_scale's dtype ({antiquant_scale.dtype})")
        _require(tuple(antiquant_offset.shape) == shape, op,
                 f"antiquant_offset must have antiquant_scale's shape {shape}, got {tuple(antiquant_offset.shape)}")
    if bias is not None:
        want = torch.float32 if x.dtype == torch.bfloat16 else torch.float16
        _require(isinstance(bias, torch.Tensor) and bias.dtype == want, op,
                 f"bias must be {want} for {x.dtype} x, got {getattr(bias, 'dtype', type(bias).__name__)}")
        _require(tuple(bias.shape) in ((n,), (1, n)), op, f"bias must be ({n},) or (1, {n}), got {tuple(bias.shape)}")
        _require(bias.is_contiguous(), op, "bias must be contiguous")

    def per_row(t):  # (K, N) view of a scale / offset
        t = t.float()
        if antiquant_group_size:
            return t.repeat_interleave(antiquant_group_size, dim=0)[:k]
        return t.reshape(1, -1).expand(k, n)

    w = weight.float()
    if antiquant_offset is not None:
        w = w + per_row(antiquant_offset)
    w = (w * per_row(antiquant_scale)).to(x.dtype)
    y = x.float() @ w.float()
    if bias is not None:
        y = y + bias.float().reshape(-1)
    return y.to(x.dtype)


def npu_quantize(input, scales, zero_points, dtype, axis=1, div_mode=True):  # noqa: A002 - binding's names
    """``npu_quantize(Tensor input, Tensor scales, Tensor? zero_points, int dtype, int axis=1,
    bool div_mode=True) -> Tensor`` (aclnnAscendQuantV2): static quantisation, in float32::

        div_mode=True:  y = round(input / scales + zero_points)
        div_mode=False: y = round(input * scales + zero_points)

    rounded half to even and saturated to ``dtype`` (``torch.qint8``: int8 output). ``input``
    float32 / float16 / bfloat16. ``scales`` broadcast along one axis: 1-D with the size of that
    axis of ``input`` or 1, or ``input``'s rank with every other dim 1. ``axis``: with div_mode
    False, -2 is the second-last axis and anything larger the last (values below -2, or past the
    rank, are refused); with div_mode True an ordinary axis index. div_mode False: ``scales``
    float32 / float16 / bfloat16 and ``zero_points`` the same shape and dtype (or None); div_mode
    True: ``scales`` float32 / bfloat16, ``zero_points`` int8 / uint8 / int32 / bfloat16 (or
    None). Simulated output: ``torch.qint8`` (int8); quint8 / int32 / quint4x2 are refused as not
    simulated."""
    op = "npu_quantize"
    _require(isinstance(input, torch.Tensor) and input.dtype in _ELEMENTWISE_DTYPES, op,
             f"input must be a float32 / float16 / bfloat16 tensor, got {getattr(input, 'dtype', type(input).__name__)}")
    _require(input.dim() >= 1, op, "input must have at least 1 dim")
    target = _dtype_arg(op, "dtype", dtype)
    _require(target in (torch.qint8, torch.int8), op, f"dtype {target} not simulated by the fake (torch.qint8 only)")
    _require(isinstance(axis, int) and not isinstance(axis, bool), op, f"axis must be an int, got {axis!r}")
    if div_mode:
        _require(-input.dim() <= axis < input.dim(), op, f"axis {axis} out of range for a {input.dim()}-D input")
        dim = axis % input.dim()
        scale_dtypes = (torch.float32, torch.bfloat16)
        zero_dtypes = (torch.int8, torch.uint8, torch.int32, torch.bfloat16)
    else:
        _require(-2 <= axis < input.dim() and (axis != -2 or input.dim() >= 2), op,
                 f"with div_mode=False axis must be in [-2, {input.dim() - 1}] (-2: second-last axis, "
                 f"else the last), got {axis}")
        dim = input.dim() - (2 if axis == -2 else 1)
        scale_dtypes = _ELEMENTWISE_DTYPES
        zero_dtypes = None
    _require(isinstance(scales, torch.Tensor) and scales.dtype in scale_dtypes, op,
             f"scales dtype {getattr(scales, 'dtype', None)} not supported with div_mode={div_mode} "
             f"({', '.join(map(str, scale_dtypes))})")
    size = input.shape[dim]

    def along_axis(t, name):
        if t.dim() == 1:
            _require(t.shape[0] in (size, 1), op, f"1-D {name} must have {size} (input dim {dim}) or 1 entries, "
                                                 f"got {t.shape[0]}")
            shape = [1] * input.dim()
            shape[dim] = t.shape[0]
            return t.reshape(shape)
        _require(t.dim() == input.dim() and all(s == 1 for d, s in enumerate(t.shape) if d != dim)
                 and t.shape[dim] in (size, 1), op,
                 f"{name} {tuple(t.shape)} must be 1-D or input's rank with every dim but {dim} equal to 1")
        return t

    s = along_axis(scales, "scales").float()
    y = input.float() / s if div_mode else input.float() * s
    if zero_points is not None:
        _require(isinstance(zero_points, torch.Tensor), op, "zero_points must be a tensor or None")
        if div_mode:
            _require(zero_points.dtype in zero_dtypes, op, f"zero_points dtype {zero_points.dtype} not supported "
                                                           f"with div_mode=True ({', '.join(map(str, zero_dtypes))})")
        else:
            _require(zero_points.dtype == scales.dtype and zero_points.shape == scales.shape, op,
                     f"with div_mode=False zero_points must have scales' shape and dtype ({tuple(scales.shape)}, "
                     f"{scales.dtype}), got ({tuple(zero_points.shape)}, {zero_points.dtype})")
        y = y + along_axis(zero_points, "zero_points").float()
    return _round_half_even_to_int8(y)


OPS = (
    _npu_reshape_and_cache,
    _npu_flash_attention,
    _npu_flash_attention_unpad,
    _npu_paged_attention,
    _npu_paged_attention_splitfuse,
    npu_rms_norm,
    npu_rotary_mul,
    npu_swiglu,
    npu_moe_gating_top_k_softmax,
    npu_moe_init_routing,
    npu_moe_compute_expert_tokens,
    npu_grouped_matmul,
    npu_moe_finalize_routing,
    npu_quant_matmul,
    npu_dynamic_quant,
    npu_weight_quant_batchmatmul,
    npu_quantize,
)


# --------------------------------------------------------------------------------------------
# installation
# --------------------------------------------------------------------------------------------

_lock = threading.Lock()
_active: "FakeTorchNpu | None" = None


class _NpuRuntime:
    """``torch_npu.npu`` (also reached as ``torch.npu``): the runtime queries the platform needs."""

    def __init__(self, device_count: int, chip: str = "Ascend910B3"):
        self._count = device_count
        self._chip = chip
        self._current = 0
        self.host_syncs = 0  # device-to-host copies reported by the kernels (note_host_sync)

    def note_host_sync(self) -> None:
        """Simulation only (a real torch_npu has no such hook): the kernels call it wherever they
        copy a device tensor to the host, which on a real NPU waits for the device (and inside a
        graph capture cannot happen: ``fake_npu_graph``)."""
        self._refuse_in_capture("a kernel read a device tensor on the host (note_host_sync)")
        self.host_syncs += 1

    def _refuse_in_capture(self, what: str) -> None:
        graphs = getattr(self, "graphs", None)
        if graphs is not None and graphs.runtime.capturing is not None:
            from atb_plugin.testing.fake_npu_graph import GraphCaptureError

            raise GraphCaptureError(f"host sync inside graph capture: {what}")

    def graph_stats(self) -> dict:
        """``{"captures": n, "replays": m}`` of every graph of this fake."""
        return self.graphs.stats()

    def is_available(self) -> bool:
        return self._count > 0

    def device_count(self) -> int:
        return self._count

    def current_device(self) -> int:
        return self._current

    def set_device(self, device) -> None:
        if isinstance(device, str):
            device = torch.device(device)
        index = (device.index or 0) if isinstance(device, torch.device) else int(device)
        if not 0 <= index < self._count:
            raise NpuOpError(f"set_device: device {index} out of range ({self._count} devices)")
        self._current = index

    def synchronize(self, device=None) -> None:
        """CPU work is synchronous: nothing to wait for (inside a graph capture: refused)."""
        self._refuse_in_capture("npu.synchronize()")

    def get_device_name(self, device=None) -> str:
        return self._chip


class _TorchNpuProxy(types.ModuleType):
    """The permanent ``torch.npu`` device module: delegates to the installed fake's runtime
    (``runtime``, set by ``install()`` and cleared by ``uninstall()``) and reports no device while
    none is installed, so the irreversible PrivateUse1 rename stays harmless. It also answers the
    RNG hooks ``torch.manual_seed`` looks for on the PrivateUse1 module (else it warns)."""

    _atb_plugin_fake_proxy = True

    def __init__(self):
        super().__init__("torch.npu", "torch.npu: the simulated NPU of atb_plugin.testing.fake_torch_npu")
        self.runtime = None

    def is_available(self) -> bool:
        return self.runtime is not None and self.runtime.is_available()

    def device_count(self) -> int:
        return self.runtime.device_count() if self.runtime is not None else 0

    def current_device(self) -> int:
        if self.runtime is None:
            raise RuntimeError("no NPU: the fake torch_npu is not installed")
        return self.runtime.current_device()

    def synchronize(self, device=None) -> None:
        return None if self.runtime is None else self.runtime.synchronize(device)

    def __getattr__(self, name):
        # The installed fake's runtime (its graph API: NPUGraph, graph, graph_task_update_begin, ...).
        runtime = self.__dict__.get("runtime")
        if runtime is not None and not name.startswith("__") and hasattr(runtime, name):
            return getattr(runtime, name)
        raise AttributeError(f"torch.npu has no attribute {name!r}")

    def is_initialized(self) -> bool:
        return self.runtime is not None

    def _is_in_bad_fork(self) -> bool:
        return False

    def manual_seed(self, seed) -> None:
        return None

    def manual_seed_all(self, seed) -> None:
        return None


class _PrivateUse1Hooks(torch._C._acc.PrivateUse1Hooks):
    """C++-side availability of the renamed backend: follows the proxy, so with no fake installed
    ``torch._C._get_accelerator()`` is CPU again (without hooks it raises after the rename)."""

    def is_available(self) -> bool:
        proxy = getattr(torch, "npu", None)
        return bool(proxy is not None and proxy.is_available())

    def has_primary_context(self, dev_id) -> bool:
        return False

    def is_built(self) -> bool:
        return True


def _npu_proxy() -> _TorchNpuProxy:
    """Rename PrivateUse1 to ``npu``, register the Python hooks and the ``torch.npu`` proxy (once
    per process); returns the proxy."""
    existing = getattr(torch, "npu", None)
    if existing is not None:
        if not getattr(existing, "_atb_plugin_fake_proxy", False):
            raise RuntimeError("torch.npu is already registered by something else (a real torch_npu?); "
                               "refusing to install the fake")
        return existing
    name = torch._C._get_privateuse1_backend_name()
    if name != "npu":
        if name != "privateuseone":
            raise RuntimeError(f"PrivateUse1 is already taken by backend {name!r}; cannot simulate an NPU")
        torch.utils.rename_privateuse1_backend("npu")
    torch._C._acc.register_python_privateuseone_hook(_PrivateUse1Hooks())
    proxy = _TorchNpuProxy()
    torch._register_device_module("npu", proxy)
    return proxy


class FakeTorchNpu:
    """Handle of an installed fake: ``module`` is ``sys.modules["torch_npu"]``; ``uninstall()``
    (or leaving the ``with`` block) restores the previous state."""

    def __init__(self, module: types.ModuleType):
        self.module = module
        self.installed = True

    def graph_stats(self) -> dict:
        """``{"captures": n, "replays": m}``: graphs captured and replayed on this fake so far."""
        return self.module.npu.graph_stats()

    @property
    def host_syncs(self) -> int:
        """Device-to-host syncs the kernels reported so far (``torch_npu.npu.host_syncs``)."""
        return self.module.npu.host_syncs

    @contextlib.contextmanager
    def allow_fp32_attention(self, allow: bool = True):
        """Let float32 through the ATB attention / cache ops inside the block (the real ones refuse
        it; for tests about something other than precision)."""
        previous = self.module.allow_fp32_attention
        self.module.allow_fp32_attention = allow
        try:
            yield self
        finally:
            self.module.allow_fp32_attention = previous

    def uninstall(self) -> None:
        global _active
        with _lock:
            if not self.installed:
                return
            if sys.modules.get("torch_npu") is self.module:
                del sys.modules["torch_npu"]
            self.installed = False
            if _active is self:
                _active = None
                proxy = getattr(torch, "npu", None)
                if getattr(proxy, "_atb_plugin_fake_proxy", False):
                    proxy.runtime = None
        _forget_cached_npu_probes()

    def __enter__(self) -> "FakeTorchNpu":
        return self

    def __exit__(self, *exc) -> None:
        self.uninstall()


def _forget_cached_npu_probes() -> None:
    """transformers caches ``is_torch_npu_available()``; drop the cache so an answer given while
    the fake was installed does not outlive it."""
    import_utils = sys.modules.get("transformers.utils.import_utils")
    probe = getattr(import_utils, "is_torch_npu_available", None)
    if probe is not None and hasattr(probe, "cache_clear"):
        probe.cache_clear()


def _counting(module: types.ModuleType, fn, name: str | None = None):
    name = name or fn.__name__

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        module.calls[name] += 1
        graphs = module.npu.graphs  # the graph mode (fake_npu_graph): capture records, an update re-targets
        if graphs.runtime.updating is not None:
            return graphs.update_npu_op(name, args, kwargs)
        token = _allow_fp32.set(bool(module.allow_fp32_attention))
        try:
            if graphs.runtime.capturing is not None:
                return graphs.runtime.capturing.on_npu_op(name, fn, args, kwargs)
            return fn(*args, **kwargs)
        finally:
            _allow_fp32.reset(token)

    return wrapper


# The chip the fake reports by default: an Atlas A2 (910B), what current deployments run, so the
# platform picks bf16 and the fused-infer-attention kernel set as it would there.
DEFAULT_CHIP = "Ascend910B3"


def build_module(device_count: int = 1, *, allow_fp32_attention: bool = False,
                 chip: str = DEFAULT_CHIP) -> types.ModuleType:
    """A fresh ``torch_npu`` module object (not installed). ``allow_fp32_attention``: let float32
    through the ATB attention / cache ops (the real ones refuse it). ``chip``: what
    ``torch_npu.npu.get_device_name()`` reports (e.g. "Ascend910B3", "Ascend310P3")."""
    from atb_plugin.testing import fake_fia_ops, fake_mla_ops  # import this module: not at the top
    module = types.ModuleType("torch_npu", __doc__)
    module.__spec__ = importlib.machinery.ModuleSpec("torch_npu", None)
    module.__version__ = "0.0.0+fake"
    module.FAKE_DEVICE = FAKE_DEVICE
    module.NpuOpError = NpuOpError
    module.calls = collections.Counter()
    module.allow_fp32_attention = allow_fp32_attention
    module.HOST_MARK = HOST_MARK
    module.npu = _NpuRuntime(device_count, chip)
    for fn in OPS + fake_fia_ops.OPS + fake_mla_ops.OPS:
        setattr(module, fn.__name__, _counting(module, fn))
    _add_graph_mode(module)
    return module


def _add_graph_mode(module: types.ModuleType) -> None:
    """``torch_npu.npu``'s graph API and the graph-path ops (``fake_npu_graph``)."""
    from atb_plugin.testing import fake_npu_graph  # imports this module: not at the top

    module.npu.graphs = graphs = fake_npu_graph.FakeGraphApi()
    for name in ("NPUGraph", "graph", "graph_pool_handle", "graph_task_group_begin", "graph_task_group_end",
                 "graph_task_update_begin", "graph_task_update_end", "Stream", "ExternalEvent", "current_stream",
                 "stream", "is_current_stream_capturing"):
        setattr(module.npu, name, getattr(graphs, name))
    for fn in fake_npu_graph.GRAPH_OPS:
        setattr(module, fn.__name__, _counting(module, fn))
    for op, out_fn in fake_npu_graph.OUT_VARIANTS.items():
        getattr(module, op).out = _counting(module, out_fn, f"{op}.out")


def _register_hccl() -> None:
    """The real torch_npu registers the ``hccl`` backend with torch.distributed (HCCL collectives
    on the NPU); the simulated NPU's tensors are host tensors, so its ``hccl`` is a gloo process
    group under that name: ``init_process_group("hccl")`` runs as on Ascend, gloo moves the bytes."""
    import torch.distributed as dist

    if "hccl" in dist.Backend.backend_list:
        return

    def create_gloo(store, rank, size, timeout):
        return dist.ProcessGroupGloo(store, rank, size, timeout)

    dist.Backend.register_backend("hccl", create_gloo, devices=["cpu"])


def install(device_count: int = 1, *, allow_fp32_attention: bool = False, chip: str = DEFAULT_CHIP) -> FakeTorchNpu:
    """Install a fake as ``sys.modules["torch_npu"]`` reporting ``device_count`` devices; returns the
    handle (a context manager). Refuses when a real torch_npu (or another fake) is loaded.
    ``allow_fp32_attention=True``: explicit opt-in to float32 in the ATB attention / cache ops."""
    global _active
    with _lock:
        present = sys.modules.get("torch_npu")
        if present is not None:
            what = "another fake torch_npu" if getattr(present, "FAKE_DEVICE", None) else "a real torch_npu"
            raise RuntimeError(f"cannot install the fake torch_npu: {what} is already loaded")
        proxy = _npu_proxy()
        handle = FakeTorchNpu(build_module(device_count, allow_fp32_attention=allow_fp32_attention, chip=chip))
        sys.modules["torch_npu"] = handle.module
        proxy.runtime = handle.module.npu
        _active = handle
    _register_hccl()
    _forget_cached_npu_probes()
    return handle


def installed() -> FakeTorchNpu | None:
    return _active


__all__ = ["FAKE_DEVICE", "HOST_MARK", "FakeTorchNpu", "NpuOpError", "OPS", "build_module", "install", "installed"] + [
    fn.__name__ for fn in OPS
]
