"""``InputBatch``: the host-side tables of the running requests, one row per request.

Two system-level tables (as in vllm-ascend's prepare_inputs design), both numpy and allocated once::

    token_ids_cpu  (max_num_reqs, max_model_len)          every token id of request r, prompt + output
    block_table_cpu (max_num_reqs, max_blocks_per_req)    its KV blocks, logical -> physical

    max_model_len 12, block_size 2 (the worked example of prepare_inputs.py, step 2):

    row   token_ids_cpu                                  block_table_cpu       num_tokens  computed  blocks
     0    T00 T01 T02 T03  ?   ?   ?   ?   ?   ?  ?  ?   1  2  0  0  0  0        4          3        2
     1    T10 T11 T12  ?   ?   ?   ?   ?   ?   ?  ?  ?   3  7  0  0  0  0        3          2        2
     2    T20 T21 T22 T23 T24 T25 T26 T27  ?   ?  ?  ?   4  5  6  8  0  0        8          5        4
     3     ?   ?   ?   ?   ?   ?   ?   ?   ?   ?  ?  ?   0  0  0  0  0  0        (free row)

Only ``token_ids_cpu[r, :num_tokens[r]]`` and ``block_table_cpu[r, :num_blocks[r]]`` mean anything
(``?`` is stale); the rest of a block-table row is 0, the null block, so a row can be handed to a
kernel as is. A request keeps its row while it runs; ``remove_request`` frees the row (and zeroes
its blocks) and the next ``add_request`` reuses the lowest free row. Rows are therefore *not* the
order in which requests are scheduled: ``prepare_inputs`` maps each scheduled request to its row.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence

import numpy as np

from atb_plugin.utils import cdiv


class InputBatch:
    """Contract: for every live row r, 0 <= num_computed_tokens_cpu[r] <= num_tokens_cpu[r] <= max_model_len
    and num_blocks_cpu[r] <= max_blocks_per_req; block_table_cpu[r, num_blocks_cpu[r]:] == 0 and free rows
    are all 0 in the block table. The caller (scheduler / model runner) owns *which* blocks and how many
    tokens are computed; this class only stores them and checks bounds."""

    def __init__(self, max_num_reqs: int, max_model_len: int, block_size: int):
        for name, value in (("max_num_reqs", max_num_reqs), ("max_model_len", max_model_len),
                            ("block_size", block_size)):
            if not isinstance(value, (int, np.integer)) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        self.max_num_reqs = int(max_num_reqs)
        self.max_model_len = int(max_model_len)
        self.block_size = int(block_size)
        # Ceiling, not floor: a request of max_model_len tokens needs its last, partial block too
        # (the two agree whenever block_size divides max_model_len, as in that example).
        self.max_blocks_per_req = cdiv(self.max_model_len, self.block_size)
        # prepare_inputs computes token indices (row * max_model_len + position) in int32.
        if self.max_num_reqs * self.max_model_len >= 2**31:
            raise ValueError(f"max_num_reqs * max_model_len = {self.max_num_reqs * self.max_model_len} "
                             f"cells: the token table would not be indexable in int32 (nor fit in memory)")

        # int32 as vllm-ascend and vLLM store token ids; negative ids (media handles) fit too.
        self.token_ids_cpu = np.zeros((self.max_num_reqs, self.max_model_len), dtype=np.int32)
        self.block_table_cpu = np.zeros((self.max_num_reqs, self.max_blocks_per_req), dtype=np.int32)
        self.num_tokens_cpu = np.zeros(self.max_num_reqs, dtype=np.int32)
        self.num_computed_tokens_cpu = np.zeros(self.max_num_reqs, dtype=np.int32)
        self.num_blocks_cpu = np.zeros(self.max_num_reqs, dtype=np.int32)

        self._row_of: dict[str, int] = {}
        self._request_id_of_row: list[str | None] = [None] * self.max_num_reqs
        self._free_rows = list(range(self.max_num_reqs))  # a min-heap: reuse the lowest free row

    # ---- membership --------------------------------------------------------------------------

    @property
    def num_reqs(self) -> int:
        return len(self._row_of)

    @property
    def request_ids(self) -> list[str]:
        """Live requests in row order."""
        return [r for r in self._request_id_of_row if r is not None]

    def __len__(self) -> int:
        return len(self._row_of)

    def __contains__(self, request_id) -> bool:
        return request_id in self._row_of

    def row(self, request_id) -> int:
        try:
            return self._row_of[request_id]
        except KeyError:
            raise KeyError(f"request {request_id!r} is not in the input batch") from None

    def request_id_of_row(self, row: int) -> str | None:
        return self._request_id_of_row[row]

    # ---- add / remove --------------------------------------------------------------------------

    def add_request(self, request_id: str, token_ids: Sequence[int], num_computed_tokens: int,
                    block_ids: Sequence[int]) -> int:
        """Store a request in the lowest free row and return that row."""
        if request_id in self._row_of:
            raise RuntimeError(f"request {request_id!r} is already in the input batch (row {self._row_of[request_id]})")
        if not self._free_rows:
            raise RuntimeError(f"the input batch is full (max_num_reqs={self.max_num_reqs})")
        num_tokens = len(token_ids)
        if num_tokens > self.max_model_len:
            raise RuntimeError(f"request {request_id!r}: {num_tokens} tokens exceed max_model_len={self.max_model_len}")
        if not 0 <= num_computed_tokens <= num_tokens:
            raise RuntimeError(f"request {request_id!r}: num_computed_tokens={num_computed_tokens} is not in "
                             f"[0, {num_tokens}]")
        self._check_block_ids(request_id, block_ids, 0)
        token_array = np.asarray(token_ids, dtype=np.int64).reshape(-1)  # validated before the int32 store
        self._check_token_ids(request_id, token_array)

        row = heapq.heappop(self._free_rows)
        self._row_of[request_id] = row
        self._request_id_of_row[row] = request_id
        self.token_ids_cpu[row, :num_tokens] = token_array
        self.num_tokens_cpu[row] = num_tokens
        self.num_computed_tokens_cpu[row] = num_computed_tokens
        self.block_table_cpu[row, :len(block_ids)] = block_ids
        self.num_blocks_cpu[row] = len(block_ids)
        return row

    def remove_request(self, request_id) -> None:
        """Free the request's row. Its blocks go back to 0 (the padding contract); its token ids are
        left stale (never read past num_tokens), which keeps removal O(num_blocks)."""
        row = self.row(request_id)
        self.block_table_cpu[row, :self.num_blocks_cpu[row]] = 0
        self.num_tokens_cpu[row] = 0
        self.num_computed_tokens_cpu[row] = 0
        self.num_blocks_cpu[row] = 0
        del self._row_of[request_id]
        self._request_id_of_row[row] = None
        heapq.heappush(self._free_rows, row)

    # ---- per-step updates ----------------------------------------------------------------------

    def append_token(self, request_id, token_id: int) -> None:
        """Append one token (a sampled output) to the request's row."""
        row = self.row(request_id)
        n = int(self.num_tokens_cpu[row])
        if n >= self.max_model_len:
            raise RuntimeError(f"request {request_id!r} already holds max_model_len={self.max_model_len} tokens")
        self._check_token_ids(request_id, np.array([token_id], dtype=np.int64))
        self.token_ids_cpu[row, n] = token_id
        self.num_tokens_cpu[row] = n + 1

    def set_tokens(self, request_id, start: int, token_ids: Sequence[int]) -> None:
        """Write ``token_ids`` from position ``start`` on and end the row after them: a verify
        step's draft tokens, then the tokens it kept in their place (speculative decoding)."""
        row = self.row(request_id)
        end = start + len(token_ids)
        if not self.num_computed_tokens_cpu[row] <= start <= self.num_tokens_cpu[row] or end > self.max_model_len:
            raise RuntimeError(f"request {request_id!r}: tokens [{start}, {end}) do not continue its computed "
                               f"{int(self.num_computed_tokens_cpu[row])} tokens within max_model_len="
                               f"{self.max_model_len}")
        token_array = np.asarray(token_ids, dtype=np.int64).reshape(-1)
        self._check_token_ids(request_id, token_array)
        self.token_ids_cpu[row, start:end] = token_array
        self.num_tokens_cpu[row] = end

    def append_block_ids(self, request_id, block_ids: Sequence[int]) -> None:
        """Append newly allocated blocks to the request's block-table row."""
        row = self.row(request_id)
        start = int(self.num_blocks_cpu[row])
        self._check_block_ids(request_id, block_ids, start)
        self.block_table_cpu[row, start:start + len(block_ids)] = block_ids
        self.num_blocks_cpu[row] = start + len(block_ids)

    def set_num_computed_tokens(self, request_id, num_computed_tokens: int) -> None:
        row = self.row(request_id)
        if not 0 <= num_computed_tokens <= self.num_tokens_cpu[row]:
            raise RuntimeError(f"request {request_id!r}: num_computed_tokens={num_computed_tokens} is not in "
                             f"[0, {int(self.num_tokens_cpu[row])}]")
        self.num_computed_tokens_cpu[row] = num_computed_tokens

    # ---- views (tests, debugging) ------------------------------------------------------------

    def token_ids(self, request_id) -> np.ndarray:
        row = self.row(request_id)
        return self.token_ids_cpu[row, :self.num_tokens_cpu[row]]

    def block_ids(self, request_id) -> np.ndarray:
        row = self.row(request_id)
        return self.block_table_cpu[row, :self.num_blocks_cpu[row]]

    # ---- checks --------------------------------------------------------------------------------

    def _check_block_ids(self, request_id, block_ids: Sequence[int], start: int) -> None:
        if start + len(block_ids) > self.max_blocks_per_req:
            raise RuntimeError(f"request {request_id!r}: {start + len(block_ids)} blocks exceed "
                             f"max_model_len / block_size = {self.max_blocks_per_req}")
        # Block 0 is the null block (padding): a request never owns it.
        if len(block_ids) and not all(0 < b <= np.iinfo(np.int32).max for b in block_ids):
            raise RuntimeError(f"request {request_id!r}: block ids must be positive int32 (0 is the null block), "
                             f"got {list(block_ids)}")

    @staticmethod
    def _check_token_ids(request_id, token_ids: np.ndarray) -> None:
        info = np.iinfo(np.int32)
        if token_ids.size and (token_ids.min() < info.min or token_ids.max() > info.max):
            raise RuntimeError(f"request {request_id!r}: token ids must fit in int32")
