"""``AsyncLLM``: the server's frontend. Requests in, a stream of ``RequestOutput`` out.

The same three parts as the offline ``LLM`` (input processor, engine client, output processing
through the ``RequestTracker``), arranged for an event loop:

    route ──► prompt_ids / chat_ids / pooling_ids / pair_ids: the InputProcessor's own methods,
              run in a tokenizer worker (TokenizerPool; ids + handles leased in worker i's store),
              or in a media worker when the request carries video or audio
          ──► InputProcessor.check_prompt / finalize (API process) ──► generate() / encode()
          ──► InputProcessor.make_requests ─► RequestTracker.add ─► MPClient (engine-core process)
          ◄── one asyncio.Queue per call ◄── on_outputs (the client's reader task:
              EngineCoreOutputs ─► RequestTracker.process ─► queues; stop strings ─► abort)
    finished (any reason) ──► the lease dropped (the last holder: release in worker i) + metrics

Whatever ends a request (it finishes, the client disconnects, the engine or its worker dies,
shutdown) goes through the tracker exactly once, so its lease is released exactly once.

``n > 1``: the prompt runs as n engine requests (``parallel_sampling.ParentRequest``) that share
one lease and one queue; ``generate`` yields (choice index, that choice's output).

A pooling request (``encode``) has one output, the pooled tensor, and no lease: its ids come
from the client or from a worker's tokenizer, never with media handles.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from atb_plugin.engine.dp_client import make_client
from atb_plugin.engine.config import EngineConfig
from atb_plugin.engine.messages import EngineCoreOutputs
from atb_plugin.engine.sampling_params import SamplingParams
from atb_plugin.frontend.errors import InvalidRequestError, RequestError
from atb_plugin.frontend.input_processor import InputLimits, InputProcessor, Lease, PreparedPrompt, load_router
from atb_plugin.frontend.output_processor import RequestOutput
from atb_plugin.frontend.request_tracker import RequestTracker
from atb_plugin.frontend.tokenizer_pool import (ChatJob, PairJob, PoolJob, PromptJob, TokenizerPool,
                                                WorkerSettings)
from atb_plugin.lora.request import LoRARequest
from atb_plugin.pooling.outputs import PoolingRequestOutput
from atb_plugin.pooling.params import PoolingParams

logger = logging.getLogger("atb_plugin.server")

__all__ = ["AsyncLLM", "Deadlines", "EngineDeadError", "FrontendMetrics", "RequestTimeoutError"]


class FrontendMetrics(Protocol):
    """Where ``AsyncLLM`` reports what it sees (the server's Prometheus metrics)."""

    def set_scheduler_stats(self, num_running: int, num_waiting: int, kv_cache_usage: float,
                            engine: int = 0) -> None: ...

    def add_prefix_cache(self, queries: int, hits: int, engine: int = 0) -> None: ...

    def add_spec_decoding(self, stats, engine: int = 0) -> None: ...

    def record_finished(self, *, prompt_tokens: int, finish_reason: str | None, e2e: float,
                        queue_time: float | None, generation_tokens: int = 0, ttft: float | None = None,
                        itls: Sequence[float] = (), engine: int = 0) -> None: ...

    def record_timeout(self, kind: str) -> None: ...


@dataclass(frozen=True)
class Deadlines:
    """A request's time limits (MindIE's e2eTimeout and tokenTimeout): ``request_timeout`` seconds
    for the whole request from ``start``, ``token_timeout`` seconds to its first token and between
    tokens (any choice's); None: no limit."""

    request_timeout: float | None = None
    token_timeout: float | None = None
    start: float = field(default_factory=time.monotonic)

    def next_wait(self, last_output: float) -> tuple[float | None, str]:
        """Seconds the next output may take, and which limit that is ("request" or "token")."""
        now = time.monotonic()
        waits = []
        if self.request_timeout is not None:
            waits.append((self.start + self.request_timeout - now, "request"))
        if self.token_timeout is not None:
            waits.append((last_output + self.token_timeout - now, "token"))
        return min(waits) if waits else (None, "")


class RequestTimeoutError(RequestError):
    """A request aborted for its time limit: 504, as a gateway reports a timed-out upstream."""

    def __init__(self, kind: str, deadlines: Deadlines):
        if kind == "request":
            message = (f"the request ran longer than its limit of {deadlines.request_timeout:g} s "
                       "(--request-timeout, or the request's request_timeout) and was aborted")
        else:
            message = (f"no token came within {deadlines.token_timeout:g} s (--token-timeout, or the request's "
                       "token_timeout): the request was aborted")
        super().__init__(504, message)
        self.kind = kind


@dataclass
class _Tracked:
    queue: asyncio.Queue
    index: int  # its choice index (n > 1), 0 otherwise
    arrival: float
    first_token: float | None = None
    last_token: float | None = None
    itls: list = field(default_factory=list)
    engine: int = 0  # the engine core whose outputs it got (data parallelism): its metrics' label


class EngineDeadError(RequestError):
    def __init__(self, message: str = "the engine-core process died; the service is restarting"):
        super().__init__(500, message)


class AsyncLLM:
    """``await start()`` spawns the engine core and the tokenizer workers; ``shutdown()`` stops
    them. ``limits`` are the frontend's own (``InputLimits``; the KV capacity is filled in
    once the core has sized its cache)."""

    def __init__(self, config: EngineConfig, settings: WorkerSettings, *, num_workers: int,
                 shm_budget_bytes: int | None, limits: InputLimits, metrics: FrontendMetrics,
                 max_queued_requests: int, on_engine_death=None, shm_help: str = "",
                 data_parallel_routing: str = "cache-aware", num_media_workers: int = 0):
        self.config = config
        self.metrics = metrics
        self.max_queued_requests = max_queued_requests
        self._limits = limits
        self._on_engine_death = on_engine_death
        # The API process needs the tokenizer (detokenising outputs) and the family's EOS ids;
        # it never builds inputs, so its router never creates a shared-memory store.
        self.router = load_router(config)
        self.tokenizer = self.router.tokenizer
        self.processor = InputProcessor(config, self.router, limits)
        self.pool = TokenizerPool(settings, num_workers, shm_budget_bytes, on_worker_death=self.on_worker_death,
                                  shm_help=shm_help, num_media_workers=num_media_workers)
        self.client = make_client(config, on_outputs=self.on_outputs, on_death=self.on_engine_death,
                                  routing=data_parallel_routing)
        self.tracker = RequestTracker(self.client, self.tokenizer, release=self._release, on_finish=self._on_finish)
        self._tracked: dict[str, _Tracked] = {}
        self.dead_reason: str | None = None
        self.num_preparing = 0
        self.started = False

    async def start(self) -> None:
        # Both run to the end before a failure is raised, so shutdown() never races a half-started part.
        for result in await asyncio.gather(self.client.start(), self.pool.start(), return_exceptions=True):
            if isinstance(result, BaseException):
                raise result
        self.processor.limits = InputLimits(self._limits.max_input_tokens, self._limits.max_parallel_samples,
                                            self.client.max_tokens_per_request)
        self.started = True

    async def shutdown(self) -> None:
        await self.abort_all()
        await self.client.shutdown()
        await self.pool.shutdown()  # each worker's store unlinks its segments

    @property
    def healthy(self) -> bool:
        return self.health_problem is None

    @property
    def health_problem(self) -> str | None:
        """Why the service cannot serve now (/health's 503), or None."""
        if not self.started:
            return "not ready"
        if self.dead_reason is not None or not self.client.alive:
            return self.dead_reason or "the engine-core process is gone"
        return self.pool.health_problem()

    # -- admission ---------------------------------------------------------------------------------

    def check_admission(self, new_requests: int = 1) -> None:
        """503 when starting or the engine is gone, 429 when ``new_requests`` more would exceed
        --max-queued-requests (a pooling request with N inputs is N engine requests)."""
        if not self.started:
            raise RequestError(503, "the service is starting", retry_after=5)
        if self.dead_reason is not None:
            raise RequestError(503, f"the service is unhealthy: {self.dead_reason}", retry_after=5)
        if len(self._tracked) + self.num_preparing + new_requests > self.max_queued_requests:
            raise RequestError(429, f"too many requests in flight ({self.max_queued_requests}, "
                                    "--max-queued-requests); retry later", retry_after=1)

    # -- input processing (the id-making half in a tokenizer worker) -------------------------------

    async def _prepare(self, job) -> tuple[int, str, object]:
        """A job on the pool. Cancelled (the client left while its request waited for a worker):
        the pool drops the job if it has not run, and the request counts as aborted."""
        self.num_preparing += 1
        start = time.monotonic()
        try:
            return await self.pool.call(job)
        except asyncio.CancelledError:
            self.metrics.record_finished(prompt_tokens=0, finish_reason="abort", e2e=time.monotonic() - start,
                                         queue_time=None)
            raise
        finally:
            self.num_preparing -= 1

    async def prompt_ids(self, request_id: str, prompt, add_special_tokens: bool = True,
                         release_now: bool = False) -> PreparedPrompt:
        """A completion prompt: a client's token ids are checked here (no lease), a text is
        tokenised in a worker."""
        if isinstance(prompt, list):
            return PreparedPrompt(self.processor.prompt_ids(prompt, request_id))
        worker, instance, ids = await self._prepare(PromptJob(request_id, prompt, add_special_tokens, release_now))
        return PreparedPrompt(ids, None if release_now else Lease(request_id, worker), instance)

    async def chat_ids(self, request_id: str, messages: list, *, add_generation_prompt: bool = True,
                       chat_template_kwargs: dict | None = None, tools: list | None = None,
                       release_now: bool = False, mm_processor_kwargs: dict | None = None) -> PreparedPrompt:
        worker, instance, ids = await self._prepare(ChatJob(request_id, messages, add_generation_prompt,
                                                            chat_template_kwargs, tools, release_now,
                                                            mm_processor_kwargs))
        return PreparedPrompt(ids, None if release_now else Lease(request_id, worker), instance)

    async def pooling_ids(self, request_id: str, prompts: list, truncate_to: int | None,
                          label: str = "input") -> list[list[int]]:
        """Texts tokenised in a worker (one job for all of them); a client's token ids checked here."""
        if not isinstance(prompts[0], str):
            return self.processor.pooling_ids(prompts, truncate_to, label)
        _, _, ids = await self._prepare(PoolJob(request_id, prompts, truncate_to, label))
        return ids

    async def pair_ids(self, request_id: str, pairs: list, truncate_to: int | None,
                       label: str = "input") -> list[tuple[list[int], int | None]]:
        _, _, encoded = await self._prepare(PairJob(request_id, [list(p) for p in pairs], truncate_to, label))
        return [(ids, start) for ids, start in encoded]

    async def check_grammar(self, params: SamplingParams, field_name: str | None) -> None:
        """A bad schema, regex or grammar is the client's 400, found before the engine sees it; a
        server without xgrammar answers 501 naming the extra to install.
        Off the event loop: the first check imports xgrammar (seconds), a large schema takes a
        while to compile."""
        if params.structured_outputs is None:
            return
        from atb_plugin.engine import structured_output

        try:
            await asyncio.to_thread(structured_output.check, params.structured_outputs)
        except ValueError as error:
            raise InvalidRequestError(f"{field_name}: {error}", param=field_name) from None
        except structured_output.StructuredOutputUnavailable as error:
            # An optional dependency this installation lacks: 501 naming the extra, never a 500.
            raise RequestError(501, f"{field_name}: {error}", param=field_name) from None

    def release(self, prompt: PreparedPrompt) -> None:
        """Drop a prepared prompt's segments when it will not run (refused after preparing)."""
        if prompt.lease is not None:
            self._release(prompt.lease)

    def _release(self, lease: Lease) -> None:
        self.pool.release(lease.owner, lease.lease_id)

    # -- requests ----------------------------------------------------------------------------------

    def generate(self, request_id: str, prompt: PreparedPrompt, params: SamplingParams | PoolingParams,
                 deadlines: Deadlines | None = None,
                 lora_request: LoRARequest | None = None,
                 kv_transfer_params: dict | None = None) -> AsyncIterator[tuple[int, RequestOutput]]:
        """Run one prompt (``params.n`` choices): its requests reach the core now, before the
        first ``anext`` (a stream whose body never starts still ends them, and releases the
        prompt's lease, when they finish). The iterator yields (choice index, that choice's
        RequestOutput) as each steps, until all are finished. Closing it early aborts them all;
        a failing choice (an engine or worker death) ends them all with that exception, and so
        does a limit of ``deadlines`` (``RequestTimeoutError``, counted in the metrics).
        ``lora_request``: the adapter its choices run through (None: the base model);
        ``kv_transfer_params``: for the engine's KV connector (docs/kv-transfer.md)."""
        queue: asyncio.Queue = asyncio.Queue()
        return self._outputs(self._add(request_id, prompt, params, queue, lora_request, kv_transfer_params), queue,
                             deadlines)

    async def _outputs(self, requests: list, queue: asyncio.Queue,
                       deadlines: Deadlines | None) -> AsyncIterator[tuple[int, RequestOutput]]:
        running = len(requests)
        finished: set[str] = set()
        last_output = time.monotonic() if deadlines is None else deadlines.start
        try:
            while running:
                wait, kind = (None, "") if deadlines is None else deadlines.next_wait(last_output)
                try:
                    item = await (queue.get() if wait is None else asyncio.wait_for(queue.get(), max(wait, 0.0)))
                except asyncio.TimeoutError:
                    self.metrics.record_timeout(kind)
                    logger.warning("request %s: %s timeout, aborted", requests[0].request_id, kind)
                    raise RequestTimeoutError(kind, deadlines) from None  # the finally aborts them
                last_output = time.monotonic()
                if isinstance(item, Exception):
                    raise item
                index, output = item
                if output.finished:
                    running -= 1
                    finished.add(output.request_id)
                yield index, output
        finally:
            for request in requests:
                if request.request_id not in finished:
                    self.abort(request.request_id)

    async def encode(self, request_id: str, prompt: PreparedPrompt, params: PoolingParams) -> PoolingRequestOutput:
        """Run one pooling request; returns its one finished output (``outputs.data`` None when it
        failed or was aborted). Cancelling the caller aborts it in the core."""
        stream = self.generate(request_id, prompt, params)
        try:
            _, output = await anext(stream)  # a pooling request's first output is its last
            return output
        finally:
            await stream.aclose()

    def _add(self, request_id: str, prompt: PreparedPrompt, params, queue: asyncio.Queue,
             lora_request: LoRARequest | None = None, kv_transfer_params: dict | None = None) -> list:
        if self.dead_reason is not None:
            self.release(prompt)
            raise EngineDeadError()
        try:
            requests, _ = self.processor.make_requests(request_id, prompt, params, lora_request, kv_transfer_params)
        except InvalidRequestError:
            self.release(prompt)
            raise
        now = time.monotonic()
        for index, request in enumerate(requests):
            self._tracked[request.request_id] = _Tracked(queue, index, now)
        try:
            self.tracker.add(requests, None, prompt.lease)
        except Exception as error:
            for request in requests:
                self._tracked.pop(request.request_id, None)
            # Nothing ran (the tracker has released the lease): our failure, not the client's.
            raise RequestError(500, f"could not hand the request to the engine core: {error}") from error
        return requests

    def abort(self, request_id: str, reason: str = "abort", error: str | None = None) -> None:
        self.tracker.abort(request_id, reason, error)  # -> _on_finish

    # -- from the engine ---------------------------------------------------------------------------

    def on_outputs(self, outputs: EngineCoreOutputs, engine: int = 0) -> None:
        """A step's outputs from engine ``engine`` (its index under data parallelism)."""
        now = time.monotonic()
        if outputs.stats is not None:
            stats = outputs.stats
            self.metrics.set_scheduler_stats(stats.num_running, stats.num_waiting, stats.kv_cache_usage, engine)
            self.metrics.add_prefix_cache(stats.prefix_cache_queries, stats.prefix_cache_hits, engine)
            self.metrics.add_spec_decoding(stats.spec_decoding, engine)
            self.metrics.add_kv_transfer(stats.external_prefix_cache_queries, stats.external_prefix_cache_hits,
                                         stats.kv_transfer, engine)
        tracked_now = {}
        for out in outputs.outputs:
            tracked = self._tracked.get(out.request_id)
            if tracked is None:
                continue  # aborted here while the core was still stepping it
            tracked_now[out.request_id] = tracked
            tracked.engine = engine
            if out.new_token_ids:
                if tracked.first_token is None:
                    tracked.first_token = now
                else:
                    tracked.itls.append(now - tracked.last_token)
                tracked.last_token = now
        for request_output in self.tracker.process(outputs.outputs):  # finished ones -> _on_finish
            tracked = tracked_now[request_output.request_id]
            tracked.queue.put_nowait((tracked.index, request_output))

    def _on_finish(self, output: RequestOutput | PoolingRequestOutput) -> None:
        """Exactly once per request, whatever ended it (the lease is the tracker's): metrics."""
        tracked = self._tracked.pop(output.request_id, None)
        if tracked is None:
            return
        e2e = time.monotonic() - tracked.arrival
        if isinstance(output, PoolingRequestOutput):
            # vLLM counts a pooling request like a generation with no output tokens: success by
            # finish reason, its prompt tokens, its end-to-end and queue times.
            self.metrics.record_finished(prompt_tokens=len(output.prompt_token_ids), e2e=e2e,
                                         finish_reason=output.finish_reason or "stop", queue_time=output.queue_time,
                                         engine=tracked.engine)
            logger.debug("pooling request %s: %d prompt tokens, finish %s%s", output.request_id,
                         len(output.prompt_token_ids), output.finish_reason, f" ({output.error})" if output.error else "")
            return
        completion = output.outputs[0]
        num_prompt, num_output = len(output.prompt_token_ids), len(completion.token_ids)
        ttft = None if tracked.first_token is None else tracked.first_token - tracked.arrival
        self.metrics.record_finished(
            prompt_tokens=num_prompt, generation_tokens=num_output, finish_reason=completion.finish_reason,
            ttft=ttft, itls=tracked.itls, e2e=e2e, queue_time=output.queue_time, engine=tracked.engine)
        logger.info("request %s: %d prompt + %d output tokens, TTFT %s, finish %s%s", output.request_id,
                    num_prompt, num_output, "-" if ttft is None else f"{ttft:.3f}s", completion.finish_reason,
                    f" ({output.error})" if output.error else "")

    def on_engine_death(self, exit_code) -> None:
        self.dead_reason = f"the engine-core process exited with code {exit_code}"
        self.fail_all(EngineDeadError(), lambda request_id: True)
        if self._on_engine_death is not None:
            self._on_engine_death(exit_code)

    def on_worker_death(self, index: int, instance_id: str | None) -> None:
        # Its segments are about to be reaped: the requests built there cannot go on, except those
        # whose lease the pool adopted (a media worker's: their segments live on until they end).
        def built_there(request_id: str) -> bool:
            lease = self.tracker.lease_of(request_id)
            return (lease is not None and lease.owner == index
                    and not self.pool.lease_adopted(index, lease.lease_id))

        self.fail_all(RequestError(500, f"tokenizer worker {index} died; this request's images are gone. Retry it"),
                      built_there)

    def fail_all(self, error: Exception, which) -> None:
        """End every running request for which ``which(request_id)`` is true with ``error``:
        aborted in the core (its lease released once, through the tracker) and ``error`` raised
        from its stream. An engine or worker death fails the requests it took with it; the
        server's shutdown watcher the requests still running at --shutdown-timeout."""
        for request_id, tracked in list(self._tracked.items()):
            if which(request_id):
                self.abort(request_id, "error", str(error))
                tracked.queue.put_nowait(error)

    async def abort_all(self) -> None:
        for request_id in list(self._tracked):
            self.abort(request_id)
