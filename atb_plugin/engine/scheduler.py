"""The scheduler: which requests run this step, and how many of their tokens.

One token budget per step (``max_num_batched_tokens``). Running requests go first, in the order
they were admitted (a decode is 1 token, plus its draft tokens under speculative decoding; an
unfinished prefill the rest of its prompt, cut to the budget: chunked prefill); then waiting
requests in FCFS order while budget, ``max_num_seqs`` and KV blocks last (none in a step that
preempted; a structured request whose grammar is still compiling keeps its place while those
behind it are admitted). When a running request cannot get a block, the most recently admitted
running request is preempted by recompute: its blocks are freed and it goes back to the FRONT of
the waiting queue, so it is the next to resume (no starvation: the earliest-admitted running
request is never the victim while another runs).

Pooling requests are prefill only: each is scheduled whole (never chunked: a pooler needs every
hidden state of the prompt in one step) or waits, and the step's pooled result finishes it, so
its KV blocks live for that one step.

With a KV connector (docs/kv-transfer.md) a waiting request's prompt tokens after its device
prefix-cache hits may come from outside (a host / disk tier, a prefill instance): they count as
computed, their blocks are filled by the worker side before the step's forward. A load that
fails voids the request's step (recompute from scratch, or the request fails: the config's
kv_load_failure_policy); a finished request's blocks may outlive it until the connector has
sent them.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Collection
from dataclasses import dataclass, field

from atb_plugin.engine.kv_cache_manager import KVCacheManager
from atb_plugin.engine.kv_transfer.base import KVConnectorBase, KVConnectorMetadata, KVConnectorOutput
from atb_plugin.engine.messages import (EngineCoreOutput, KVTransferStats, LogprobsEntry, PooledData, SchedulerStats,
                                        SpecDecodingStats)
from atb_plugin.engine.request import Request, RequestStatus
from atb_plugin.utils import cdiv


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 64
    max_model_len: int = 4096
    # Distinct LoRA adapters among the running requests at most (their device slots); 0: LoRA off.
    max_loras: int = 0

    def __post_init__(self):
        for name in ("max_num_batched_tokens", "max_num_seqs", "max_model_len"):
            if getattr(self, name) <= 0:
                raise ValueError(f"SchedulerConfig.{name} must be > 0, got {getattr(self, name)}")


@dataclass
class SchedulerOutput:
    num_scheduled_tokens: dict[str, int]  # request id -> tokens this step, in batch order
    new_requests: list[Request]  # scheduled for the first time, or again after preemption
    new_block_ids: dict[str, list[int]]  # blocks appended to each scheduled request this step
    preempted_request_ids: list[str] = field(default_factory=list)
    finished_request_ids: list[str] = field(default_factory=list)  # since the previous step
    # Each scheduled request's computed tokens before this step (tensor-parallel ranks check
    # their copies of the requests against it: engine/worker.py, RequestMirror).
    computed_tokens: dict[str, int] = field(default_factory=dict)
    # The grammar masks of this step's structured requests that sample (the core fills it:
    # structured_output.GrammarBitmask); None when there are none.
    grammar_bitmask: object | None = None
    # The media of this step's new requests, read from the core's shared memory for ranks on
    # other nodes (filled by the Ray executor when it has such ranks: multimodal/shipped.py).
    shipped_media: dict | None = None
    # Speculative decoding: the draft tokens scheduled after each verifying request's last token
    # (its num_scheduled_tokens count them: 1 + len(drafts)); the runner verifies them.
    scheduled_spec_tokens: dict[str, list[int]] = field(default_factory=dict)
    # The KV connector's instructions for the worker side this step (loads before the forward,
    # saves after it): ``build_connector_meta``'s, pickled to every rank; None without a connector.
    kv_connector_metadata: KVConnectorMetadata | None = None

    @property
    def total_num_scheduled_tokens(self) -> int:
        return sum(self.num_scheduled_tokens.values())


class Scheduler:
    """``is_ready(request)``, when given, holds a waiting request back while it is False (a
    structured request whose grammar is still compiling): it keeps its place in the queue and the
    requests behind it are admitted meanwhile. ``connector``: the scheduler side of the engine's
    KV connector, or None."""

    def __init__(self, config: SchedulerConfig, kv_cache_manager: KVCacheManager,
                 is_ready: Callable[[Request], bool] | None = None, connector: KVConnectorBase | None = None):
        self.config = config
        self.connector = connector
        # Finished requests whose blocks the connector still reads (request id -> request), freed
        # when a KVConnectorOutput.finished_sending names them.
        self.pending_frees: dict[str, Request] = {}
        # Requests whose connector load failed, recomputed from scratch: never asked again.
        self._skip_connector: set[str] = set()
        # Requests waiting for remote KV whose asynchronous load finished (finished_recving).
        self._received: set[str] = set()
        # Requests put back to waiting after a failed load: reported to the runners (and the
        # ranks' mirrors) as preempted with the next step, so they drop their rows.
        self._rolled_back: list[str] = []
        # The connector's kv_transfer_params of requests finished since the last outputs.
        self._finished_kv_params: dict[str, dict] = {}
        self._external_queries = self._external_hits = 0  # tokens, since the last make_stats
        self._kv_stats: KVTransferStats | None = None
        self.kv_cache_manager = kv_cache_manager
        self.is_ready = is_ready or (lambda request: True)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self._finished_since_last_step: list[str] = []
        self.num_preemptions = 0  # a metric, and lets tests prove preemption happened
        self._reported_preemptions = 0
        self._prefix_queries = self._prefix_hits = 0  # tokens, since the last make_stats
        # Speculative decoding's counters: since the start (tests, the offline door), and since the
        # last make_stats (the server's metrics).
        self.spec_decoding = SpecDecodingStats()
        self._spec_stats: SpecDecodingStats | None = None

    # -- requests --------------------------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        if request.request_id in self.pending_frees:
            raise ValueError(f"request id {request.request_id!r} is still in use: a KV connector still reads the "
                             "blocks of the finished request of that id")
        if request.is_pooling:
            if request.num_prompt_tokens > self.config.max_model_len:
                raise ValueError(f"the prompt has {request.num_prompt_tokens} tokens; max_model_len is "
                                 f"{self.config.max_model_len}")
            longest = request.num_prompt_tokens
        elif request.num_prompt_tokens >= self.config.max_model_len:
            raise ValueError(
                f"the prompt has {request.num_prompt_tokens} tokens; max_model_len is "
                f"{self.config.max_model_len}, leaving no room for output"
            )
        else:
            max_tokens = request.sampling_params.max_tokens or self.config.max_model_len
            longest = min(request.num_prompt_tokens + max_tokens, self.config.max_model_len)
        blocks_needed = cdiv(longest, self.kv_cache_manager.block_size)
        if blocks_needed > self.kv_cache_manager.num_blocks - 1:
            # Alone in the cache it could still not finish: it would preempt itself forever.
            raise ValueError(
                f"the request may grow to {longest} tokens ({blocks_needed} KV blocks); the KV cache has "
                f"{self.kv_cache_manager.num_blocks - 1}: lower max_tokens or give the cache more blocks"
            )
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def finish(self, request_id: str, status: RequestStatus) -> Request | None:
        """End a request (stopped, length, aborted, failed): free its blocks, forget it."""
        request = self.requests.pop(request_id, None)
        if request is None:
            return None
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        # A request still receiving its KV: the connector writes into its blocks until it reports.
        receiving = request.status is RequestStatus.WAITING_FOR_REMOTE_KVS and request_id not in self._received
        request.status = status
        self._skip_connector.discard(request_id)
        self._received.discard(request_id)
        delay = receiving
        if self.connector is not None:
            sending, params = self.connector.request_finished(request, self.kv_cache_manager.get_block_ids(request_id))
            delay = delay or sending
            if params is not None:
                self._finished_kv_params[request_id] = params
        if delay:
            self.pending_frees[request_id] = request  # its blocks stay until the connector is done with them
        else:
            self.kv_cache_manager.free(request)
        self._finished_since_last_step.append(request_id)
        return request

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running)

    def has_pending_kv_transfers(self) -> bool:
        """Finished requests whose blocks a connector still reads: the core keeps stepping
        (cheap empty steps poll the workers) until they are freed."""
        return bool(self.pending_frees)

    # -- the step --------------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        # Invariant: every running request holds KV blocks for its num_computed_tokens; each
        # request is scheduled at most once per step; the step's tokens never exceed the budget
        # and never take a request past max_model_len.
        budget = self.config.max_num_batched_tokens
        scheduled: dict[str, int] = {}
        new_block_ids: dict[str, list[int]] = {}
        new_requests: list[Request] = []
        preempted: list[str] = []
        spec_tokens: dict[str, list[int]] = {}

        index = 0
        while index < len(self.running) and budget > 0:
            request = self.running[index]
            num_new = self._num_new_tokens(request, budget)
            if num_new == 0:
                index += 1
                continue
            blocks = self.kv_cache_manager.allocate_slots(request, num_new)
            while blocks is None:
                victim = self.running.pop()  # the most recently admitted
                self._preempt(victim)
                preempted.append(victim.request_id)
                scheduled.pop(victim.request_id, None)
                new_block_ids.pop(victim.request_id, None)
                spec_tokens.pop(victim.request_id, None)
                if victim is request:
                    break
                blocks = self.kv_cache_manager.allocate_slots(request, num_new)
            if blocks is None:
                break
            scheduled[request.request_id] = num_new
            new_block_ids[request.request_id] = blocks
            num_drafts = num_new - (request.num_tokens - request.num_computed_tokens)
            if num_drafts > 0:  # the budget or the context window may have cut some
                spec_tokens[request.request_id] = request.spec_token_ids[:num_drafts]
            budget -= num_new
            index += 1

        # Admit waiting requests only when nothing was preempted: a step that ran out of blocks
        # must not hand the freed ones to newcomers ahead of the preempted request.
        not_ready: list[Request] = []
        while self.waiting and not preempted and budget > 0 and len(self.running) < self.config.max_num_seqs:
            request = self.waiting[0]
            if not self.is_ready(request) or not self._has_lora_slot(request):
                not_ready.append(self.waiting.popleft())
                continue
            if request.status is RequestStatus.WAITING_FOR_REMOTE_KVS:
                if request.request_id not in self._received:
                    not_ready.append(self.waiting.popleft())  # its asynchronous load is still running
                    continue
                # Loaded: it holds its blocks and counts them computed; now they may be hit.
                self._received.discard(request.request_id)
                self.kv_cache_manager.cache_blocks(request, request.num_computed_tokens)
                computed_block_ids, num_cached, num_external, load_async, loaded = [], 0, 0, False, True
            else:
                loaded = False
                computed_block_ids, num_cached = self.kv_cache_manager.get_computed_blocks(request)
                num_external, load_async = self._external_tokens(request, num_cached)
                if num_external is None:  # the connector does not know yet: ask again next step
                    not_ready.append(self.waiting.popleft())
                    continue
            if load_async:
                # The blocks now, the tokens once finished_recving names the request: it keeps
                # its place in the queue meanwhile, its blocks out of the prefix cache.
                blocks = self.kv_cache_manager.allocate_slots(request, num_external, computed_block_ids,
                                                              delay_cache=True)
                if blocks is None:
                    break
                self._admitted(request, num_cached, num_external, computed_block_ids + blocks)
                request.status = RequestStatus.WAITING_FOR_REMOTE_KVS
                not_ready.append(self.waiting.popleft())
                continue
            num_new = self._num_new_tokens(request, budget, num_cached + num_external)
            if request.is_pooling and num_new < request.num_tokens - num_cached:
                break  # a pooling prompt runs whole: it waits for a step with room for all of it
            blocks = self.kv_cache_manager.allocate_slots(request, num_external + num_new, computed_block_ids)
            if blocks is None:
                break
            self.waiting.popleft()
            if not loaded:  # one that loaded asynchronously was admitted when it got its blocks
                self._admitted(request, num_cached, num_external, computed_block_ids + blocks)
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            new_requests.append(request)
            scheduled[request.request_id] = num_new
            new_block_ids[request.request_id] = self.kv_cache_manager.get_block_ids(request.request_id)
            budget -= num_new
        self.waiting.extendleft(reversed(not_ready))  # back in front, in their order

        finished, self._finished_since_last_step = self._finished_since_last_step, []
        computed = {request_id: self.requests[request_id].num_computed_tokens for request_id in scheduled}
        # Rolled back after a failed load: the runners drop their rows as for a preemption (a
        # request re-admitted in this very step comes back whole among new_requests).
        preempted = self._rolled_back + preempted
        self._rolled_back = []
        output = SchedulerOutput(scheduled, new_requests, new_block_ids, preempted, finished, computed,
                                 scheduled_spec_tokens=spec_tokens)
        if self.connector is not None:
            output.kv_connector_metadata = self.connector.build_connector_meta(output)
        return output

    # -- KV connector ----------------------------------------------------------------------------

    def _admitted(self, request: Request, num_cached: int, num_external: int, block_ids: list[int]) -> None:
        """A waiting request got its blocks: its local hits and external tokens count computed
        (vLLM counts both in num_cached_tokens: neither was computed here), its first admission
        counts in the prefix-cache stats, the connector learns its blocks."""
        if request.first_scheduled_time is None:
            request.first_scheduled_time = time.monotonic()
            self._prefix_queries += request.num_tokens
            self._prefix_hits += num_cached
            if self._asks_connector(request):
                # vLLM's external_prefix_cache_*: the tokens after the local hit were asked for.
                self._external_queries += request.num_tokens - num_cached
                self._external_hits += num_external
        request.num_computed_tokens = request.num_cached_tokens = num_cached + num_external
        if self.connector is not None:
            self.connector.update_state_after_alloc(request, block_ids, num_external)

    def _asks_connector(self, request: Request) -> bool:
        # A request owing its prompt logprobs needs every prompt position's logits computed here.
        return (self.connector is not None and request.request_id not in self._skip_connector
                and not request.needs_prompt_logprobs and not request.is_pooling)

    def _external_tokens(self, request: Request, num_cached: int) -> tuple[int | None, bool]:
        """Tokens after the ``num_cached`` local hits the connector delivers (0 without one),
        cut so the last token is always computed here (None: it does not know yet), and whether
        it loads them asynchronously."""
        if not self._asks_connector(request):
            return 0, False
        num_external, load_async = self.connector.get_num_new_matched_tokens(request, num_cached)
        if num_external is None:
            return None, False
        num_external = max(0, min(num_external, request.num_tokens - 1 - num_cached))
        return num_external, bool(load_async and num_external)

    def update_from_kv_connector_output(self, output: KVConnectorOutput | None) -> tuple[list[EngineCoreOutput], set[str]]:
        """The workers' report of the step (merged over ranks), before the step's tokens are
        read: frees the blocks of requests whose sending finished, and voids the step of every
        request holding a block whose load failed. Returns the outputs of requests that failed
        for it (kv_load_failure_policy "fail") and the ids whose step results must be dropped
        (their tokens come from garbage KV)."""
        if self.connector is None or output is None:
            return [], set()
        self.connector.update_connector_output(output)
        if output.stats is not None:
            self._add_kv_stats(output.stats)
        voided: tuple[list[EngineCoreOutput], set[str]] = [], set()
        if output.invalid_block_ids:  # before the receives: a failed load is no finished one
            voided = self._void_failed_loads(output.invalid_block_ids)
        for request_id in output.finished_sending | output.finished_recving:
            request = self.pending_frees.pop(request_id, None)
            if request is not None:
                self.kv_cache_manager.free(request)
            elif request_id in output.finished_recving and self._is_receiving(request_id):
                self._received.add(request_id)
        return voided

    def _is_receiving(self, request_id: str) -> bool:
        request = self.requests.get(request_id)
        return request is not None and request.status is RequestStatus.WAITING_FOR_REMOTE_KVS

    def has_requests_receiving_kv(self) -> bool:
        """Requests waiting for an asynchronous KV load (their steps schedule nothing meanwhile)."""
        return any(request.status is RequestStatus.WAITING_FOR_REMOTE_KVS for request in self.waiting)

    def _void_failed_loads(self, invalid: set[int]) -> tuple[list[EngineCoreOutput], set[str]]:
        kv = self.kv_cache_manager
        # allocate_slots cached the blocks already: their contents are garbage, so no later
        # request may hit them.
        kv.uncache_blocks(invalid)
        for request_id, request in list(self.pending_frees.items()):
            if invalid.intersection(kv.get_block_ids(request_id)):  # finished while loading: done now
                del self.pending_frees[request_id]
                kv.free(request)
        receiving = [r for r in self.waiting if r.status is RequestStatus.WAITING_FOR_REMOTE_KVS]
        affected = [r for r in self.running + receiving if invalid.intersection(kv.get_block_ids(r.request_id))]
        self._add_kv_stats(KVTransferStats(num_failed_loads=len(affected)))
        outputs = []
        for request in affected:
            request_id = request.request_id
            if request.status is RequestStatus.WAITING_FOR_REMOTE_KVS:
                # Its load is over (it failed): it may be freed or end at once.
                request.status = RequestStatus.WAITING
                self._received.discard(request_id)
            if self.connector.config.kv_load_failure_policy == "fail":
                why = (f"KV connector {self.connector.name}: the KV load failed for {len(invalid)} block(s) of this "
                       "request's prompt (kv_load_failure_policy 'fail')")
                self.finish(request_id, RequestStatus.FINISHED_ERROR)
                outputs.append(EngineCoreOutput(request_id, finish_reason=RequestStatus.FINISHED_ERROR.value,
                                                error=why, kv_transfer_params=self._finished_kv_params.pop(request_id,
                                                                                                           None)))
                continue
            # Recompute: back to the front of the waiting queue (a receiving one keeps its place),
            # its blocks freed, never asked of the connector again; its output tokens (if any) stay.
            self._skip_connector.add(request_id)
            if request in self.running:
                self.running.remove(request)
                self._rolled_back.append(request_id)
                self._requeue(request)
            else:
                self._release_for_recompute(request)
        return outputs, {request.request_id for request in affected}

    def _add_kv_stats(self, stats) -> None:
        stats = KVTransferStats.from_value(stats)
        self._kv_stats = stats if self._kv_stats is None else self._kv_stats.merged(stats)

    def update_from_output(self, output: SchedulerOutput, sampled: dict[str, int],
                           logprobs: dict[str, object] | None = None,
                           failed: dict[str, str] | None = None,
                           pooled: dict[str, PooledData] | None = None,
                           prompt_logprobs: dict[str, list[LogprobsEntry]] | None = None,
                           spec_sampled: dict[str, list[int]] | None = None,
                           spec_logprobs: dict[str, list] | None = None) -> list[EngineCoreOutput]:
        """Advance the step's requests: append each sampled token, decide each request's finish
        (``check_stop``) and free a finished request's blocks, all here, so a status is written
        once. ``failed`` requests (e.g. a bad media block) end with "error"; a pooling request
        with its ``pooled`` result ends with "stop". ``prompt_logprobs`` (the runner's, per prompt
        chunk) are gathered on the request and sent whole with its first token. A request that
        verified drafts emits ``sampled`` then ``spec_sampled`` (the rest of its accepted run,
        with ``spec_logprobs``): its computed tokens roll back past the rejected drafts
        (``computed_advance``), and the run stops at the first token that finishes it (EOS, stop
        id, max_tokens). Returns one ``EngineCoreOutput`` per request that produced a token or a
        result, or ended, this step."""
        outputs: list[EngineCoreOutput] = []
        for request_id, why in (failed or {}).items():
            if self.finish(request_id, RequestStatus.FINISHED_ERROR) is not None:
                outputs.append(EngineCoreOutput(request_id, finish_reason=RequestStatus.FINISHED_ERROR.value,
                                                error=why))
        for request_id, num_tokens in output.num_scheduled_tokens.items():
            request = self.requests.get(request_id)
            if request is None or request.status is not RequestStatus.RUNNING:
                continue  # finished (failed, aborted) during the step, or rolled back (a failed KV load)
            chunk_start = request.num_computed_tokens
            drafts = output.scheduled_spec_tokens.get(request_id, ())
            tokens = emitted_tokens(request_id, sampled, spec_sampled)
            entries = [(logprobs or {}).get(request_id), *(spec_logprobs or {}).get(request_id, ())]
            request.num_computed_tokens += computed_advance(num_tokens, len(drafts), len(tokens))
            request.spec_token_ids = []
            if drafts:
                self._count_spec(len(drafts), len(tokens) - 1)
            if request.is_pooling:
                result = (pooled or {}).get(request_id)
                if result is None:
                    raise RuntimeError(f"pooling request {request_id} ran its whole prompt but got no pooled output")
                out = EngineCoreOutput(request_id, pooled=result, finish_reason=RequestStatus.FINISHED_STOPPED.value,
                                       queue_time=self._queue_time(request))
                self.finish(request_id, RequestStatus.FINISHED_STOPPED)
                outputs.append(out)
                continue
            if prompt_logprobs and request_id in prompt_logprobs:
                self._gather_prompt_logprobs(request, chunk_start, prompt_logprobs[request_id])
            if not tokens:
                request.check()
                continue  # a prefill chunk short of the prompt's end
            first_output = request.num_output_tokens == 0
            status = None
            for count, token in enumerate(tokens, 1):
                request.append_output_token(token)
                status = check_stop(request, request.eos_token_ids, self.config.max_model_len)
                if status is not None:
                    # The rest of an accepted run is dropped (it comes after the end), and
                    # with it the computed tokens it stood for.
                    request.num_computed_tokens = min(request.num_computed_tokens, request.num_tokens)
                    break
            request.check()
            entries = entries[:count]
            out = EngineCoreOutput(request_id, tokens[:count], entries if entries[0] is not None else None,
                                   num_cached_tokens=request.num_cached_tokens)
            if first_output:
                out.queue_time = self._queue_time(request)
                out.prompt_logprobs, request.prompt_logprobs = request.prompt_logprobs, None
            if status is not None:
                self.finish(request_id, status)  # the one place a finished status is written
                out.finish_reason = status.value
            outputs.append(out)
        if self._finished_kv_params:
            for out in outputs:
                if out.finished:
                    out.kv_transfer_params = self._finished_kv_params.pop(out.request_id, None)
            self._finished_kv_params.clear()  # aborted between steps: nobody reads them
        return outputs

    def _count_spec(self, num_drafts: int, num_accepted: int) -> None:
        if self._spec_stats is None:
            self._spec_stats = SpecDecodingStats()
        self._spec_stats.observe(num_drafts, num_accepted)
        self.spec_decoding.observe(num_drafts, num_accepted)

    @staticmethod
    def _gather_prompt_logprobs(request: Request, chunk_start: int, entries: list[LogprobsEntry]) -> None:
        """Append the entries of one prompt chunk starting at ``chunk_start`` (those of prompt
        tokens ``chunk_start + 1 ..``). Preemption policy: a chunk at position 0 restarts the
        list, so a request preempted mid-prompt, recomputed from scratch (it takes no prefix-cache
        hits while it owes these), neither repeats nor loses an entry; one preempted after its
        first token has sent them and the runner computes none again."""
        if chunk_start == 0:
            request.prompt_logprobs = [None]  # the first prompt token: nothing precedes it
        if request.prompt_logprobs is None or len(request.prompt_logprobs) != chunk_start + 1:
            have = None if request.prompt_logprobs is None else len(request.prompt_logprobs)
            raise RuntimeError(f"request {request.request_id}: prompt logprobs for a chunk at {chunk_start} "
                               f"follow {have} entries, expected {chunk_start + 1}")
        request.prompt_logprobs += entries

    def make_stats(self) -> SchedulerStats:
        """Gauges now, and the counters accumulated since the previous call."""
        stats = SchedulerStats(len(self.running), len(self.waiting), self.kv_cache_manager.usage,
                               self._prefix_queries, self._prefix_hits, self.num_preemptions - self._reported_preemptions)
        stats.spec_decoding, self._spec_stats = self._spec_stats, None
        self._prefix_queries = self._prefix_hits = 0
        if self.connector is not None:
            self._add_kv_stats(KVTransferStats.from_value(self.connector.get_stats()) or KVTransferStats())
            stats.external_prefix_cache_queries, stats.external_prefix_cache_hits = (self._external_queries,
                                                                                     self._external_hits)
            stats.kv_transfer = self._kv_stats
            self._external_queries = self._external_hits = 0
            # Gauges carry over: the tiers' bytes stay what they were until a report changes them.
            self._kv_stats = KVTransferStats(tier_bytes=dict(self._kv_stats.tier_bytes))
        self._reported_preemptions = self.num_preemptions
        return stats

    # -- helpers ---------------------------------------------------------------------------------

    def _has_lora_slot(self, request: Request) -> bool:
        """Whether ``request``'s adapter (if any) fits the running requests' ``max_loras`` slots:
        its adapter runs already, or a slot is free. One that waits keeps its place."""
        lora = getattr(request, "lora_request", None)
        if lora is None:
            return True
        running = {r.lora_request.key for r in self.running if r.lora_request is not None}
        return lora.key in running or len(running) < self.config.max_loras

    def _num_new_tokens(self, request: Request, budget: int, num_cached: int = 0) -> int:
        num_computed = request.num_computed_tokens + num_cached
        remaining = request.num_tokens + len(request.spec_token_ids) - num_computed
        room = self.config.max_model_len - num_computed
        return max(0, min(remaining, budget, room))

    @staticmethod
    def _queue_time(request: Request) -> float | None:
        if request.first_scheduled_time is None:
            return None
        return max(0.0, request.first_scheduled_time - request.arrival_time)

    def _preempt(self, request: Request) -> None:
        self.num_preemptions += 1
        self._requeue(request)

    def _requeue(self, request: Request) -> None:
        """A request taken off ``running`` (preempted, or its KV load failed) goes back to the
        front of the waiting queue, to be recomputed."""
        self._release_for_recompute(request)
        request.status = RequestStatus.PREEMPTED
        self.waiting.appendleft(request)

    def _release_for_recompute(self, request: Request) -> None:
        self.kv_cache_manager.free(request)
        request.num_computed_tokens = 0  # recompute from scratch (the prefix cache may help)
        request.spec_token_ids = []  # proposed again once it decodes


def emitted_tokens(request_id: str, sampled: dict[str, int], spec_sampled: dict[str, list[int]] | None) -> list[int]:
    """The tokens a step emitted for ``request_id``, in order: its sampled token, then the rest of
    its accepted run when it verified drafts; [] when it sampled none (a prefill chunk short of
    its prompt's end). The core and every tensor-parallel rank's mirror read a step by this rule."""
    token = sampled.get(request_id)
    return [] if token is None else [token, *(spec_sampled or {}).get(request_id, ())]


def computed_advance(num_scheduled: int, num_drafts: int, num_emitted: int) -> int:
    """How far a step moves a request's computed tokens: all it scheduled, less the drafts it
    rejected (``num_emitted - 1`` were accepted). Their KV slots stay allocated and are
    overwritten when the positions are computed again. The core and every tensor-parallel
    rank's mirror (engine/worker.py) advance by this one rule."""
    if not num_drafts:
        return num_scheduled
    return num_scheduled - (num_drafts - (num_emitted - 1))


def check_stop(request: Request, eos_token_ids: Collection[int],
               max_model_len: int | None = None) -> RequestStatus | None:
    """After a token was appended: the status ``request`` finishes with, or None to go on.
    Pure: the scheduler writes the status (``Scheduler.finish``).

    Order (vLLM v1's): nothing stops a request short of min_tokens but the length limits; then
    EOS (unless ignore_eos) and the stop token ids give FINISHED_STOPPED; then max_tokens or the
    context window (``max_model_len`` total tokens) give FINISHED_LENGTH. So a last token that is
    both EOS and the max_tokens-th reports "stop". Stop strings are the frontend's business
    (text: its detokenizer finds them and aborts the request here)."""
    params = request.sampling_params
    if request.num_output_tokens == 0:
        return None
    last = request.output_token_ids[-1]
    if request.num_output_tokens >= params.min_tokens:
        if (not params.ignore_eos and last in eos_token_ids) or last in params.stop_token_ids:
            return RequestStatus.FINISHED_STOPPED
    if (params.max_tokens is not None and request.num_output_tokens >= params.max_tokens) or (
            max_model_len is not None and request.num_tokens >= max_model_len):
        return RequestStatus.FINISHED_LENGTH
    return None
