"""``DraftModelProposer``: a smaller checkpoint with the target's tokenizer drafts k tokens
greedily, autoregressively, on its own KV cache.

It runs in the engine core's process through a ``ModelRunner`` of its own, driven with
scheduler outputs made here: per request a shadow ``Request`` (greedy) whose KV covers what the
draft has computed. Each call catches a request up with one chunk (the tokens accepted since its
last call: the longest prefix shared with what the draft saw, so KV of the draft's own rejected
tokens is recomputed over, never trusted), which samples the first draft, then runs k - 1
one-token steps for the rest (decode-only steps: the captured decode step applies on the CPU).
Its KV blocks come from a ``KVCacheManager`` of its own, sized like the target's in blocks (a
request never holds more draft tokens than target tokens + k), counted in the KV budget with the
draft's weights (``loading.SpecModel``); a request it cannot fit gets no drafts. Prompts holding media handles get no drafts (the draft is a text model)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from atb_plugin.engine.kv_cache_manager import KVCacheManager
from atb_plugin.engine.model_runner import ModelRunner
from atb_plugin.engine.request import Request
from atb_plugin.engine.sampling_params import SamplingParams
from atb_plugin.engine.scheduler import SchedulerOutput

_GREEDY = SamplingParams(temperature=0)


class DraftModelProposer:
    def __init__(self, draft_config, num_blocks: int, target_vocab_size: int, model):
        """``draft_config``: the EngineConfig of the draft checkpoint (the target's settings);
        ``model``: the draft, loaded by the worker (``loading.load_spec_model``: inside the KV
        budget); ``num_blocks``: its KV blocks (the null block included); drafts stop before any
        id outside the target's vocabulary."""
        self.config = draft_config
        self.runner = ModelRunner(model, draft_config, num_blocks)
        self.kv = KVCacheManager(num_blocks, draft_config.block_size, enable_prefix_caching=False)
        self.vocab_size = min(draft_config.vocab_size, target_vocab_size)
        self.shadows: dict[str, Request] = {}
        self._finished: list[str] = []

    def propose(self, request_ids: Sequence[str], token_ids: Sequence[Sequence[int]],
                max_drafts: Sequence[int]) -> list[list[int]]:
        for gone in set(self.shadows) - set(request_ids):
            self._drop(gone)
        drafts: dict[str, list[int]] = {}
        counts: dict[str, int] = {}
        new_requests, new_blocks = [], {}
        for request_id, ids, k in zip(request_ids, token_ids, max_drafts):
            if k <= 0 or min(ids) < 0:
                continue
            shadow = self.shadows.get(request_id)
            if shadow is None:
                shadow = Request(request_id, list(ids), _GREEDY)
                start, is_new = 0, True
            else:
                start, is_new = self._shared_prefix(shadow, ids), False
            shadow.num_computed_tokens = start
            blocks = self.kv.allocate_slots(shadow, len(ids) - start)
            if blocks is None:  # the draft's cache is full: this request goes without drafts
                self._drop(request_id)
                continue
            if is_new:
                self.shadows[request_id] = shadow
                new_requests.append(shadow)
                new_blocks[request_id] = self.kv.get_block_ids(request_id)
            else:
                batch = self.runner.input_batch
                batch.set_num_computed_tokens(request_id, start)
                batch.set_tokens(request_id, start, ids[start:])
                new_blocks[request_id] = blocks
            shadow.all_token_ids = list(ids)
            counts[request_id] = len(ids) - start
            drafts[request_id] = []
        limits = dict(zip(request_ids, max_drafts))
        while counts:
            output = SchedulerOutput(counts, new_requests, new_blocks, finished_request_ids=self._finished)
            self._finished = []
            result = self.runner.execute(output)
            counts, new_requests, new_blocks = {}, [], {}
            for request_id, token in result.sampled.items():
                shadow = self.shadows[request_id]
                shadow.num_computed_tokens = shadow.num_tokens + len(drafts[request_id])
                if token >= self.vocab_size:
                    continue  # outside the target's vocabulary: the drafts stop before it
                drafts[request_id].append(token)
                if len(drafts[request_id]) >= limits[request_id]:
                    continue
                blocks = self.kv.allocate_slots(shadow, 1)
                if blocks is None:
                    continue  # what it has drafted so far stands
                counts[request_id] = 1
                new_blocks[request_id] = blocks
        return [drafts.get(request_id, []) for request_id in request_ids]

    def _shared_prefix(self, shadow: Request, ids: Sequence[int]) -> int:
        """How many leading tokens of ``ids`` the draft's KV holds: its computed tokens, cut at
        the first position where what it computed (its own drafts included) differs."""
        row = self.runner.input_batch.token_ids(shadow.request_id)
        n = min(shadow.num_computed_tokens, len(ids) - 1, len(row))
        differs = np.flatnonzero(row[:n] != np.asarray(ids[:n]))
        return int(differs[0]) if differs.size else n

    def _drop(self, request_id: str) -> None:
        shadow = self.shadows.pop(request_id, None)
        if shadow is not None:
            self.kv.free(shadow)
            self._finished.append(request_id)
