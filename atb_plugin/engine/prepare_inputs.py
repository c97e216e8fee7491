"""``prepare_inputs``: from the input batch and the scheduler's ``{request: num_new_tokens}`` to the
model's inputs (input ids, positions) and their attention metadata, exactly as vllm-ascend's
prepare_inputs design guide ("Prepare inputs for model forwarding", "the guide" below) describes,
vectorised with numpy (no per-token Python loop; the only Python loop is the O(num_reqs)
request-id -> row lookup).

Token level (one entry per scheduled token, requests one after another in scheduling order)::

    guide, step 2: scheduled {0: 1, 1: 1, 2: 3}, num_computed [3, 2, 5], M = max_model_len = 12,
                   K = max blocks per request = 6, block_size = 2

    req_indices          [0, 1, 2, 2, 2]         index into the scheduled requests
    positions            [3, 2, 5, 6, 7]         num_computed[req] + offset within this step's chunk
    token_indices        [3, 14, 29, 30, 31]     row * M + position  (into token_ids_cpu.ravel())
    input_ids            token_ids_cpu.ravel()[token_indices]
    block_table_indices  [1, 7, 14, 15, 15]      row * K + position // block_size
    block_numbers        [2, 7, 6, 8, 8]         block_table_cpu.ravel()[block_table_indices]
    block_offsets        [1, 0, 1, 0, 1]         position % block_size
    slot_mapping         [5, 14, 13, 16, 17]     block_number * block_size + block_offset

Request level: ``query_start_loc`` [0, 1, 2, 5] (prefix sum of the scheduled counts), ``seq_lens``
[4, 3, 8] (computed + scheduled), ``num_computed_tokens`` [3, 2, 5], ``max_query_len`` 3, and
``logits_indices`` [0, 1, 4] (each request's last scheduled token) with ``samples`` [True, True,
True] (the step reaches the end of the request's tokens, so the model's output there is a new token;
a middle prefill chunk does not sample).

"row" is the request's row in the batch tables. The guide's example has rows equal to the
scheduling order (``req_indices``); here rows are reused as requests come and go, so
``token_indices`` and ``block_table_indices`` use the row of the token's request
(``rows[req_indices]``), not ``req_indices`` itself.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from atb_plugin.engine.input_batch import InputBatch
from atb_plugin.utils import cdiv
from atb_plugin.ops import AttentionMetadata


@dataclass
class PreparedInputs:
    """One step's model inputs. Contract: ``input_ids``/``positions`` are the model's arguments,
    ``attn_metadata`` its attention metadata (tensors on the requested device, host copies of
    ``query_start_loc`` / ``seq_lens``), ``logits_indices`` pick each request's last scheduled
    token from the model output and ``samples[i]`` says whether request i samples this step.
    The numpy arrays (token level: ``num_tokens`` entries; request level: ``num_reqs``) are fresh
    per call and never alias the batch's tables; on the CPU the torch tensors share their memory."""

    request_ids: list[str]
    # request level (numpy)
    rows: np.ndarray  # (num_reqs,) int64: row of each scheduled request in the batch tables
    num_scheduled_tokens: np.ndarray  # (num_reqs,) int32
    query_start_loc_cpu: np.ndarray  # (num_reqs + 1,) int32
    seq_lens_cpu: np.ndarray  # (num_reqs,) int32
    num_computed_tokens_cpu: np.ndarray  # (num_reqs,) int32
    block_tables_cpu: np.ndarray  # (num_reqs, cdiv(max_seq_len, block_size)) int32, 0-padded
    logits_indices_cpu: np.ndarray  # (num_reqs,) int64
    samples: np.ndarray  # (num_reqs,) bool
    max_query_len: int
    max_seq_len: int
    # token level (numpy)
    req_indices: np.ndarray  # (num_tokens,) int32
    positions_cpu: np.ndarray  # (num_tokens,) int64
    token_indices: np.ndarray  # (num_tokens,) int32
    input_ids_cpu: np.ndarray  # (num_tokens,) int64
    block_table_indices: np.ndarray  # (num_tokens,) int32
    block_numbers: np.ndarray  # (num_tokens,) int32 (the block table's dtype)
    block_offsets: np.ndarray  # (num_tokens,) int32
    slot_mapping_cpu: np.ndarray  # (num_tokens,) int64
    # model inputs (torch, on the device)
    input_ids: torch.Tensor  # (num_tokens,) long
    positions: torch.Tensor  # (num_tokens,) long
    logits_indices: torch.Tensor  # (num_reqs,) long
    attn_metadata: AttentionMetadata

    def __post_init__(self):
        num_reqs, num_tokens = len(self.request_ids), self.input_ids_cpu.shape[0]
        request_level = (self.rows, self.num_scheduled_tokens, self.seq_lens_cpu, self.num_computed_tokens_cpu,
                         self.logits_indices_cpu, self.samples)
        token_level = (self.req_indices, self.positions_cpu, self.token_indices, self.block_table_indices,
                       self.block_numbers, self.block_offsets, self.slot_mapping_cpu)
        if any(len(a) != num_reqs for a in request_level) or len(self.query_start_loc_cpu) != num_reqs + 1:
            raise RuntimeError(f"request-level arrays must have {num_reqs} entries (query_start_loc one more)")
        if any(len(a) != num_tokens for a in token_level) or self.query_start_loc_cpu[-1] != num_tokens:
            raise RuntimeError(f"token-level arrays must have {num_tokens} entries (= query_start_loc[-1])")

    @property
    def num_reqs(self) -> int:
        return len(self.request_ids)

    @property
    def num_tokens(self) -> int:
        return self.input_ids_cpu.shape[0]

    @property
    def is_prefill_only(self) -> bool:
        """Every request starts from an empty cache (the guide's step 1)."""
        return not self.num_computed_tokens_cpu.any()


def prepare_inputs(batch: InputBatch, request_ids: Sequence[str], num_scheduled_tokens: Sequence[int] | np.ndarray,
                   device="cpu") -> PreparedInputs:
    """Model inputs for scheduling ``num_scheduled_tokens[i]`` new tokens of ``request_ids[i]``.

    Each request's new tokens are its tokens ``num_computed .. num_computed + n - 1``; they must already
    be in the batch's token table and covered by its blocks. The batch is not modified (advancing
    ``num_computed_tokens`` after the step is the caller's job)."""
    # Called once per engine step between model forwards, i.e. with cold caches, and for a decode
    # batch each numpy call costs more than its arithmetic (benchmarks/RESULTS.md,
    # bench_prepare_inputs): so few calls as possible (the checks are one test with a slow path
    # that explains, nothing is gathered through req_indices).
    num_reqs = len(request_ids)
    num_scheduled = np.asarray(num_scheduled_tokens, dtype=np.int64)
    if num_reqs == 0 or num_scheduled.shape != (num_reqs,):
        raise RuntimeError(f"num_scheduled_tokens must have one entry per request ({num_reqs}), got shape "
                         f"{num_scheduled.shape}; prepare_inputs needs at least one request")
    # The one per-request Python loop: request id -> row (dict lookups, driven from C by map).
    try:
        rows = np.fromiter(map(batch._row_of.__getitem__, request_ids), dtype=np.int64, count=num_reqs)
    except KeyError as missing:
        raise KeyError(f"request {missing.args[0]!r} is not in the input batch") from None

    # ---- request level -------------------------------------------------------------------------
    block_size = batch.block_size
    num_computed = batch.num_computed_tokens_cpu[rows]
    num_tokens = batch.num_tokens_cpu[rows]
    seq_lens = num_computed + num_scheduled
    max_seq_len = int(seq_lens.max())
    if (num_scheduled.min() < 1 or (seq_lens > num_tokens).any()
            or (cdiv(seq_lens, block_size) > batch.num_blocks_cpu[rows]).any()
            or len(set(request_ids)) != num_reqs):
        _raise_bad_schedule(batch, request_ids, num_scheduled, rows)
    cu_num_tokens = np.cumsum(num_scheduled)
    total = int(cu_num_tokens[-1])
    query_start_loc = np.zeros(num_reqs + 1, dtype=np.int32)
    query_start_loc[1:] = cu_num_tokens
    # Only the blocks the longest sequence reaches go to the device; the rest of a row is padding.
    block_tables = batch.block_table_cpu[rows, :cdiv(max_seq_len, block_size)]

    # ---- token level ---------------------------------------------------------------------------
    # The guide's formulas (position = num_computed[req] + offset in the chunk, token index =
    # row * M + position, block-table index = row * K + position // block_size) with their
    # per-request parts spread to the tokens by np.repeat. int32 where the values allow it
    # (InputBatch guarantees max_num_reqs * max_model_len < 2**31): half the bytes to write.
    arange = _arange(total)
    req_indices = np.repeat(arange[:num_reqs], num_scheduled)
    positions_int32 = np.repeat((num_computed - (cu_num_tokens - num_scheduled)).astype(np.int32), num_scheduled)
    positions_int32 += arange
    token_indices = np.repeat((rows * batch.max_model_len).astype(np.int32), num_scheduled)
    token_indices += positions_int32
    input_ids = batch.token_ids_cpu.reshape(-1).take(token_indices).astype(np.int64)
    block_table_indices, block_offsets = _divmod_block_size(positions_int32, block_size)
    block_table_indices += np.repeat((rows * batch.max_blocks_per_req).astype(np.int32), num_scheduled)
    block_numbers = batch.block_table_cpu.reshape(-1).take(block_table_indices)
    slot_mapping = block_numbers * np.int64(block_size)  # int64 before the multiply: no int32 overflow
    slot_mapping += block_offsets
    positions = positions_int32.astype(np.int64)

    # ---- torch -----------------------------------------------------------------------------
    # from_numpy shares memory (no copy on CPU); the arrays are fresh per call, so that is safe.
    seq_lens = seq_lens.astype(np.int32)
    query_start_loc_t, seq_lens_t = torch.from_numpy(query_start_loc), torch.from_numpy(seq_lens)
    attn_metadata = AttentionMetadata(
        query_start_loc=query_start_loc_t.to(device),
        seq_lens=seq_lens_t.to(device),
        block_tables=torch.from_numpy(block_tables).to(device),
        slot_mapping=torch.from_numpy(slot_mapping).to(device),
        max_query_len=int(num_scheduled.max()),
        max_seq_len=max_seq_len,
        query_start_loc_cpu=query_start_loc_t,
        seq_lens_cpu=seq_lens_t,
    )
    logits_indices = cu_num_tokens - 1
    return PreparedInputs(
        request_ids=list(request_ids),
        rows=rows,
        num_scheduled_tokens=num_scheduled.astype(np.int32),
        query_start_loc_cpu=query_start_loc,
        seq_lens_cpu=seq_lens,
        num_computed_tokens_cpu=num_computed,
        block_tables_cpu=block_tables,
        logits_indices_cpu=logits_indices,
        samples=seq_lens == num_tokens,
        max_query_len=attn_metadata.max_query_len,
        max_seq_len=max_seq_len,
        req_indices=req_indices,
        positions_cpu=positions,
        token_indices=token_indices,
        input_ids_cpu=input_ids,
        block_table_indices=block_table_indices,
        block_numbers=block_numbers,
        block_offsets=block_offsets,
        slot_mapping_cpu=slot_mapping,
        input_ids=torch.from_numpy(input_ids).to(device),
        positions=torch.from_numpy(positions).to(device),
        logits_indices=torch.from_numpy(logits_indices).to(device),
        attn_metadata=attn_metadata,
    )


def _raise_bad_schedule(batch: InputBatch, request_ids, num_scheduled: np.ndarray, rows: np.ndarray):
    """The slow path of prepare_inputs' one combined check: name what is wrong."""
    if len(set(request_ids)) != len(request_ids):
        raise RuntimeError("a request is scheduled twice in one step")
    for request_id, n, row in zip(request_ids, num_scheduled.tolist(), rows.tolist()):
        computed, num_tokens = int(batch.num_computed_tokens_cpu[row]), int(batch.num_tokens_cpu[row])
        num_blocks = int(batch.num_blocks_cpu[row])
        if n < 1:
            raise RuntimeError(f"request {request_id!r}: every scheduled request needs >= 1 token, got {n}")
        if computed + n > num_tokens:
            raise RuntimeError(f"request {request_id!r}: {computed} computed + {n} scheduled tokens exceed the "
                             f"{num_tokens} tokens in the batch")
        if cdiv(computed + n, batch.block_size) > num_blocks:
            raise RuntimeError(f"request {request_id!r}: {computed + n} tokens need "
                             f"{cdiv(computed + n, batch.block_size)} blocks, the batch has {num_blocks}")
    raise AssertionError("unreachable: the combined check failed but no single check does")


_arange_cache = np.arange(8192, dtype=np.int32)
_arange_cache.flags.writeable = False


def _arange(n: int) -> np.ndarray:
    """``np.arange(n)`` (int32, read only) sliced from a cached array that grows as needed."""
    global _arange_cache
    if n > len(_arange_cache):
        _arange_cache = np.arange(max(n, 2 * len(_arange_cache)), dtype=np.int32)
        _arange_cache.flags.writeable = False
    return _arange_cache[:n]


def _divmod_block_size(positions: np.ndarray, block_size: int) -> tuple[np.ndarray, np.ndarray]:
    """``(positions // block_size, positions % block_size)``; a shift and a mask for the usual
    power-of-two block sizes (numpy's integer ``%`` is several times slower than ``&``:
    benchmarks/RESULTS.md, bench_prepare_inputs)."""
    if block_size & (block_size - 1) == 0:
        return positions >> (block_size.bit_length() - 1), positions & (block_size - 1)
    blocks = positions // block_size
    return blocks, positions - blocks * block_size


def attention_mask(prepared: PreparedInputs) -> np.ndarray:
    """The step's attention mask as the guide draws it, ``True`` = may attend (tests, debugging;
    kernels build their own).

    - Prefill only (every request starts from an empty cache, the guide's step 1): one causal
      ``(max_query_len, max_query_len)`` matrix that every request reuses (its top-left
      ``q_len x q_len`` corner), e.g. 5 x 5 for scheduled [3, 2, 5].
    - Otherwise (decode, chunked prefill, the guide's step 2): ``(num_tokens, max_seq_len)``, one row
      per scheduled token; token t sees keys ``0 .. positions[t]`` of its own request, e.g. 5 x 8.

    The NPU kernels apply the same matrices with the opposite convention (1 / -inf = hidden,
    ``ops.npu_kernels._prefill_mask`` / ``_splitfuse_mask``)."""
    if prepared.is_prefill_only:
        size = prepared.max_query_len
        return np.tri(size, size, dtype=bool)
    return np.arange(prepared.max_seq_len)[None, :] <= prepared.positions_cpu[:, None]
