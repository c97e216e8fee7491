"""``AsyncEngine``: the API process's frontend. Requests in, a stream of ``RequestOutput`` out.

    route ──► TokenizerPool (ids + handles, leased in worker i's ShmStore)
          ──► AsyncEngine.generate(): OutputProcessor.add_request, EngineClient.add_request
                  EngineCoreRequest(ids, params, eos ids, shm_instances={worker i's instance})
          ◄── per-request asyncio.Queue of RequestOutput ◄── _on_outputs (one reader task:
              EngineCoreOutputs ─► OutputProcessor.process ─► queues; stop strings ─► abort)
    finished (any reason) ──► OutputProcessor.on_finish ─► release(worker i, request id) + metrics

Whatever ends a request (it finishes, the client disconnects, the engine or its worker dies,
shutdown) goes through ``OutputProcessor`` exactly once, so its lease is released exactly once.

``n > 1`` (``generate_choices``): the prompt runs as n engine requests
(``parallel_sampling.ParentRequest``) that share one lease, the parent id's: it is released
when the last of them ends.

A pooling request (``encode``) has one output, the pooled tensor, and no lease: its ids come
from the client or from a worker's tokenizer, never with media handles, so no worker holds
anything for it (its ``worker`` is None and a worker's death does not concern it).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from atb_plugin.engine.messages import EngineCoreOutputs, EngineCoreRequest
from atb_plugin.engine.output_processor import OutputProcessor, RequestOutput
from atb_plugin.engine.parallel_sampling import ParentRequest, fans_out
from atb_plugin.engine.sampling_params import SamplingParams
from atb_plugin.pooling.outputs import PoolingRequestOutput
from atb_plugin.pooling.params import PoolingParams
from atb_plugin.server.engine_client import EngineClient
from atb_plugin.server.errors import APIError
from atb_plugin.server.metrics import ServerMetrics
from atb_plugin.server.workers import TokenizerPool

logger = logging.getLogger("atb_plugin.server")


@dataclass
class _Tracked:
    queue: asyncio.Queue
    worker: int | None  # the tokenizer worker holding its lease; None: it holds none (pooling)
    arrival: float
    lease_id: str  # the request id the worker leased its segments under (n > 1: the parent's)
    first_token: float | None = None
    last_token: float | None = None
    itls: list = field(default_factory=list)


class EngineDeadError(APIError):
    def __init__(self, message: str = "the engine-core process died; the service is restarting"):
        super().__init__(500, message)


class AsyncEngine:
    def __init__(self, engine_client: EngineClient, pool: TokenizerPool, tokenizer, eos_token_ids,
                 metrics: ServerMetrics, max_queued_requests: int):
        self.engine_client = engine_client
        self.pool = pool
        self.eos_token_ids = tuple(eos_token_ids)
        self.metrics = metrics
        self.max_queued_requests = max_queued_requests
        self.output_processor = OutputProcessor(tokenizer, on_finish=self._on_finish)
        self._tracked: dict[str, _Tracked] = {}
        self._lease_holders: dict[str, int] = {}  # lease id -> requests still holding it
        self.dead_reason: str | None = None
        self.num_preparing = 0

    # -- admission ---------------------------------------------------------------------------------

    def check_admission(self, new_requests: int = 1) -> None:
        """503 when the engine is gone, 429 when ``new_requests`` more would exceed
        --max-queued-requests (a pooling request with N inputs is N engine requests)."""
        if self.dead_reason is not None:
            raise APIError(503, f"the service is unhealthy: {self.dead_reason}", retry_after=5)
        if len(self._tracked) + self.num_preparing + new_requests > self.max_queued_requests:
            raise APIError(429, f"too many requests in flight ({self.max_queued_requests}, "
                                "--max-queued-requests); retry later", retry_after=1)

    # -- requests ----------------------------------------------------------------------------------

    def generate(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, worker: int,
                 instance_id: str | None, prompt=None) -> AsyncIterator[RequestOutput]:
        """Run one request; yields a RequestOutput per step, the last one finished. Closing the
        generator early (client gone) aborts the request in the core."""
        instances = (instance_id,) if instance_id else ()
        message = EngineCoreRequest(request_id, list(prompt_token_ids), params, self.eos_token_ids, instances)
        return self._stream(message, worker, prompt)

    async def generate_choices(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                               worker: int, instance_id: str | None) -> AsyncIterator[tuple[int, RequestOutput]]:
        """Run ``params.n`` choices of one prompt; yields (choice index, that choice's
        RequestOutput) as each steps, until all are finished. Closing it early aborts them all;
        a failing choice (an exception from its stream) ends them all with that exception."""
        if not fans_out(params):  # no fan-out: no task or queue hop per token
            async for output in self.generate(request_id, prompt_token_ids, params, worker, instance_id):
                yield 0, output
            return
        parent = ParentRequest(request_id, params)
        instances = (instance_id,) if instance_id else ()
        streams = [self._stream(EngineCoreRequest(child_id, list(prompt_token_ids), child_params,
                                                  self.eos_token_ids, instances), worker, None, lease_id=request_id)
                   for child_id, child_params in parent.children]
        merged: asyncio.Queue = asyncio.Queue()
        started: set[int] = set()

        async def pump(index: int, stream) -> None:
            started.add(index)  # the stream's body runs from here on, with no await in between
            try:
                async for output in stream:
                    merged.put_nowait((index, output))
            except Exception as error:  # noqa: BLE001 - handed to the consumer, which raises it
                merged.put_nowait((index, error))
            merged.put_nowait((index, None))

        # Every child is registered (tracked, lease held) before any can finish and release it.
        for index, stream in enumerate(streams):
            self._hold_lease(request_id, worker)
        tasks = [asyncio.ensure_future(pump(index, stream)) for index, stream in enumerate(streams)]
        try:
            running = len(tasks)
            while running:
                index, item = await merged.get()
                if item is None:
                    running -= 1
                elif isinstance(item, Exception):
                    raise item
                else:
                    yield index, item
        finally:
            for task in tasks:
                task.cancel()  # a child still running: its stream's finally aborts it
            await asyncio.gather(*tasks, return_exceptions=True)
            for index, stream in enumerate(streams):
                if index not in started:
                    self._drop_lease(request_id, worker)  # never started: its hold was taken above
                await stream.aclose()

    async def encode(self, request_id: str, prompt_token_ids: list[int], pooling_params: PoolingParams,
                     worker: int | None = None, token_type_start: int | None = None) -> PoolingRequestOutput:
        """Run one pooling request; returns its one finished output (``outputs.data`` None when it
        failed or was aborted). Cancelling the caller aborts it in the core."""
        message = EngineCoreRequest(request_id, list(prompt_token_ids), None, pooling_params=pooling_params,
                                    token_type_start=token_type_start)
        stream = self._stream(message, worker, None)
        try:
            return await anext(stream)  # a pooling request's first output is its last
        finally:
            await stream.aclose()

    def _hold_lease(self, lease_id: str, worker: int | None) -> None:
        if worker is not None:
            self._lease_holders[lease_id] = self._lease_holders.get(lease_id, 0) + 1

    def _drop_lease(self, lease_id: str, worker: int | None) -> None:
        """One holder less; the worker releases the lease when none is left."""
        if worker is None:
            return
        holders = self._lease_holders.pop(lease_id, 1) - 1
        if holders > 0:
            self._lease_holders[lease_id] = holders
        else:
            self.pool.release(worker, lease_id)

    async def _stream(self, message: EngineCoreRequest, worker: int | None, prompt,
                      lease_id: str | None = None) -> AsyncIterator:
        """Hand ``message`` to the core and yield its outputs until the finished one; leaving
        early (closed, cancelled) aborts it there. ``worker``: whose lease it holds, if any,
        under ``lease_id`` (default: its own id; a choice of n > 1 holds its parent's, counted
        by ``generate_choices`` before it starts)."""
        request_id = message.request_id
        shared = lease_id is not None
        lease_id = lease_id or request_id
        if not shared:
            self._hold_lease(lease_id, worker)
        if self.dead_reason is not None:
            self._drop_lease(lease_id, worker)
            raise EngineDeadError()
        queue: asyncio.Queue = asyncio.Queue()
        self._tracked[request_id] = _Tracked(queue, worker, time.monotonic(), lease_id)
        self.output_processor.add_request(request_id, prompt, message.prompt_token_ids,
                                          message.sampling_params or message.pooling_params)
        try:
            self.engine_client.add_request(message)
        except Exception as error:
            # Nothing reached the core: end it here (releases the lease) and report our failure.
            self.output_processor.abort(request_id, "error", str(error))
            raise APIError(500, f"could not hand the request to the engine core: {error}") from error
        finished = False
        try:
            while not finished:
                item = await queue.get()
                if isinstance(item, Exception):
                    raise item
                finished = item.finished
                yield item
        finally:
            if not finished:
                self.abort(request_id)

    def abort(self, request_id: str, reason: str = "abort", error: str | None = None) -> None:
        if request_id not in self._tracked:
            return
        self.engine_client.abort([request_id])
        self.output_processor.abort(request_id, reason, error)  # -> _on_finish

    # -- from the engine ---------------------------------------------------------------------------

    def on_outputs(self, outputs: EngineCoreOutputs) -> None:
        now = time.monotonic()
        if outputs.stats is not None:
            stats = outputs.stats
            self.metrics.set_scheduler_stats(stats.num_running, stats.num_waiting, stats.kv_cache_usage)
            self.metrics.add_prefix_cache(stats.prefix_cache_queries, stats.prefix_cache_hits)
        queues = {}
        for out in outputs.outputs:
            tracked = self._tracked.get(out.request_id)
            if tracked is None:
                continue  # aborted here while the core was still stepping it
            queues[out.request_id] = tracked.queue
            if out.new_token_ids:
                if tracked.first_token is None:
                    tracked.first_token = now
                else:
                    tracked.itls.append(now - tracked.last_token)
                tracked.last_token = now
        processed = self.output_processor.process(outputs.outputs)  # finished ones -> _on_finish
        if processed.to_abort:
            self.engine_client.abort(processed.to_abort)
        for request_output in processed.request_outputs:
            queues[request_output.request_id].put_nowait(request_output)

    def _on_finish(self, output: RequestOutput | PoolingRequestOutput) -> None:
        """Exactly once per request, whatever ended it: release its lease, record its metrics."""
        tracked = self._tracked.pop(output.request_id, None)
        if tracked is None:
            return
        self._drop_lease(tracked.lease_id, tracked.worker)
        if isinstance(output, PoolingRequestOutput):
            self._record_pooling(output, tracked)
            return
        completion = output.outputs[0]
        num_prompt, num_output = len(output.prompt_token_ids), len(completion.token_ids)
        ttft = None if tracked.first_token is None else tracked.first_token - tracked.arrival
        self.metrics.record_finished(
            prompt_tokens=num_prompt, generation_tokens=num_output, finish_reason=completion.finish_reason,
            ttft=ttft, itls=tracked.itls, e2e=time.monotonic() - tracked.arrival, queue_time=output.queue_time)
        logger.info("request %s: %d prompt + %d output tokens, TTFT %s, finish %s%s", output.request_id,
                    num_prompt, num_output, "-" if ttft is None else f"{ttft:.3f}s", completion.finish_reason,
                    f" ({output.error})" if output.error else "")

    def _record_pooling(self, output: PoolingRequestOutput, tracked: _Tracked) -> None:
        # vLLM counts a pooling request like a generation with no output tokens: success by
        # finish reason, its prompt tokens, its end-to-end and queue times.
        num_prompt = len(output.prompt_token_ids)
        self.metrics.record_finished(prompt_tokens=num_prompt, finish_reason=output.finish_reason or "stop",
                                     e2e=time.monotonic() - tracked.arrival, queue_time=output.queue_time)
        logger.debug("pooling request %s: %d prompt tokens, finish %s%s", output.request_id, num_prompt,
                     output.finish_reason, f" ({output.error})" if output.error else "")

    def on_engine_death(self, exit_code) -> None:
        self.dead_reason = f"the engine-core process exited with code {exit_code}"
        self._fail_all(EngineDeadError(), lambda tracked: True)

    def on_worker_death(self, index: int, instance_id: str | None) -> None:
        # Its segments are about to be reaped: the requests built there cannot go on.
        self._fail_all(APIError(500, f"tokenizer worker {index} died; this request's images are gone. Retry it"),
                       lambda tracked: tracked.worker == index)

    def _fail_all(self, error: Exception, which) -> None:
        for request_id, tracked in list(self._tracked.items()):
            if which(tracked):
                self.abort(request_id, "error", str(error))
                tracked.queue.put_nowait(error)

    async def abort_all(self) -> None:
        for request_id in list(self._tracked):
            self.abort(request_id)
