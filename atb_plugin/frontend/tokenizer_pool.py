"""The tokenizer worker pool: the input processor's id-making half, out of the API process.

Each worker owns an ``InputProcessor`` (router: tokenizer, chat template, input builder) and its
own ``ShmStore``, so the shared-memory segments of a request belong to the worker that built it::

    API process ── [msgpack Job] ──► worker i (PULL ipc://…-w<i>)
        ▲                              InputProcessor.chat_ids / prompt_ids / pooling_ids / pair_ids
        │                              images: load → preprocess → store_i.put(…, request_id)
        └──── [msgpack Reply] ◄─────── PUSH ipc://…-results (shared by all workers)

Jobs and replies are typed msgspec structs (``Job``, ``Reply``), as ``engine/messages.py`` is
for the core: a job names the input processor's method and carries its arguments, so the
offline ``LLM`` (which calls the same methods in its own process) and the server run the same
input rules. A request's lease ends when the API process sends ``ReleaseJob`` to the worker
that built it (the request tracker, whatever ended the request). Ownership is per worker so no
store is shared across processes, and a worker that dies takes nothing with it: the
replacement's ``ShmStore()`` reaps the dead instance's segments on start, and the API process
fails the requests that were using them (a media worker's are adopted instead: below).

Media workers: a chat or prompt job that carries video or audio (``media_items``) runs on one of
the pool's media workers, the same worker code in processes of their own, so decoding never holds
up a text request's tokenisation. A media worker takes one job at a time (later ones wait in the
API process for a free one), so whatever happens to it concerns that one job: the builders refuse
a video or audio item over its decode budget (frames, wall clock: ``MediaLimits``) with a 400,
and a media worker still busy past its job's budget (a stuck decoder) is killed and replaced,
failing that job alone with a 504: the requests it built earlier keep their media, their leases
adopted by the API process (``self.adopted``), which unlinks their segments as each ends. /health looks at the tokenizer workers only: it stays 200
while a media worker is being replaced.

Errors: bad input (the builders' ``InputBuilderError`` / ``MediaError``, the input processor's
``InvalidRequestError``) is the client's 400; a full store is 503; anything else raised in a
worker is our bug: a 500, its traceback logged by the worker.
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import logging
import multiprocessing
import os
import signal
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any, NamedTuple, Union

import msgspec
import zmq
import zmq.asyncio

import shm
from atb_plugin import processes
from atb_plugin.engine.config import EngineConfig
from atb_plugin.frontend.errors import InvalidRequestError, RequestError
from atb_plugin.multimodal.parts import AUDIO_PART_TYPES, VIDEO_PART_TYPES
from atb_plugin.utils import trim_heap

logger = logging.getLogger(__name__)


# -- the messages ----------------------------------------------------------------------------------

class ChatJob(msgspec.Struct, tag="chat"):
    """``InputProcessor.chat_ids``; ``release_now``: only the ids are wanted (/tokenize)."""

    request_id: str
    messages: list[Any]
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[Any] | None = None
    release_now: bool = False
    mm_processor_kwargs: dict[str, Any] | None = None  # the video sampling overrides (input_builders.video)


class PromptJob(msgspec.Struct, tag="prompt"):
    """``InputProcessor.prompt_ids`` of a text (or MindIE's item list)."""

    request_id: str
    prompt: Any
    add_special_tokens: bool = True
    release_now: bool = False


class PoolJob(msgspec.Struct, tag="pool"):
    """``InputProcessor.pooling_ids`` of texts."""

    request_id: str
    items: list[str]
    truncate_to: int | None = None
    label: str = "input"


class PairJob(msgspec.Struct, tag="pair"):
    """``InputProcessor.pair_ids`` of ``[first, second]`` texts (cross-encoders)."""

    request_id: str
    items: list[list[str]]
    truncate_to: int | None = None
    label: str = "input"


class StatsJob(msgspec.Struct, tag="stats"):
    """The worker's store statistics and its compute threads."""


class ReleaseJob(msgspec.Struct, tag="release"):
    request_id: str


class CancelJob(msgspec.Struct, tag="cancel"):
    """The client of job ``job_id`` left: drop the job if it has not run yet."""

    job_id: int


class StopJob(msgspec.Struct, tag="stop"):
    pass


Job = Union[ChatJob, PromptJob, PoolJob, PairJob, StatsJob, ReleaseJob, CancelJob, StopJob]


class Envelope(msgspec.Struct):
    id: int  # -1: no reply expected (release, stop)
    job: Job


class Reply(msgspec.Struct, tag="reply"):
    id: int
    ok: Any = None
    error: str | None = None
    kind: str | None = None  # with error: "client" (400), "busy" (503), "internal" (500) or "cancelled"
    leased: list[str] = []  # with ok: the segments the job's request holds a lease on


class Ready(msgspec.Struct, tag="ready"):
    index: int
    instance: str


_job_decoder = msgspec.msgpack.Decoder(Envelope)
_reply_decoder = msgspec.msgpack.Decoder(Union[Reply, Ready])
_encoder = msgspec.msgpack.Encoder()


@dataclass(frozen=True)
class WorkerSettings:
    """What a worker needs to build its input processor (picklable: it crosses the spawn)."""

    engine: EngineConfig
    media_config: object
    chat_template: str | None = None
    shm_capacity_bytes: int | None = None
    shm_cache_bytes: int | None = None  # None: the store's own default (a quarter of /dev/shm, <= 1 GiB)


# -- the worker process ----------------------------------------------------------------------------

def run_tokenizer_worker(index: int, settings: WorkerSettings, job_address: str, result_address: str,
                         log_level: int = logging.INFO) -> None:
    logging.basicConfig(level=log_level, format=f"%(asctime)s %(levelname)s [tokenizer-{index}] %(message)s")
    # The API process decides when workers stop (a group-wide SIGINT/SIGTERM must not kill them
    # before it has drained); a worker exits by itself when the API process is gone.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    # One compute thread: the cores belong to the engine (docs/architecture.md, "Threads"); N
    # workers each spinning up a full OpenMP pool for a resize or a tokenizer call would
    # oversubscribe them and slow the decode of every running request.
    from atb_plugin.utils import keep_request_buffers_in_heap, limit_compute_threads

    limit_compute_threads(1)
    keep_request_buffers_in_heap()  # the data URLs of image requests arrive here too
    import shm
    from atb_plugin.frontend.input_processor import InputProcessor, load_router

    parent = os.getppid()
    if settings.shm_capacity_bytes is not None:
        from input_builders.image import limit_decoded_image_cache

        limit_decoded_image_cache(settings.shm_capacity_bytes)
    store = shm.ShmStore(shm.ShmStoreConfig(capacity_bytes=settings.shm_capacity_bytes,
                                            cache_bytes=settings.shm_cache_bytes))
    router = load_router(settings.engine, store, settings.media_config, settings.chat_template)
    processor = InputProcessor(settings.engine, router, shm_store=store)
    context = zmq.Context()
    jobs = context.socket(zmq.PULL)
    jobs.connect(job_address)
    results = context.socket(zmq.PUSH)
    results.connect(result_address)
    results.send(_encoder.encode(Ready(index, store.instance_id)))
    loop = _WorkerLoop(settings, processor, store, jobs, results, parent)
    try:
        loop.run()
    finally:
        loop.fetcher.shutdown(wait=False, cancel_futures=True)
        store.close()
        results.close(linger=1000)
        jobs.close(linger=0)
        context.term()


# Threads that fetch http(s) media for the jobs of one worker: each fetch is bounded by its
# deadline (MediaConfig.http_timeout_s), so this many slow hosts at once delay only their own jobs.
_FETCH_THREADS = 4
_FETCH_POLL_MS = 5  # while fetches are in flight: how often the loop looks for finished ones
_LARGE_JOB_BYTES = 8 << 20  # after a job this large, the worker trims its heap


def media_urls(job: Job) -> list[str]:
    """The http(s) URLs a chat or prompt job names as media (an ``image_url``'s ``url``, MindIE's
    ``{"image": url}``), in order, once each. Video URLs are not among them: the loader fetches
    those itself, under the video byte limit (a prefetch is made under the image policy)."""
    found: list[str] = []

    def walk(value, key=None):
        if isinstance(value, dict):
            for k, v in value.items():
                if k != "video_url":
                    walk(v, k)
        elif isinstance(value, list):
            for item in value:
                walk(item)
        elif isinstance(value, str) and key in ("url", "image"):
            url = value.strip()
            if url[:8].lower().startswith(("http://", "https://")) and url not in found:
                found.append(url)

    walk(job.messages if isinstance(job, ChatJob) else job.prompt if isinstance(job, PromptJob) else None)
    return found


_DECODED_KINDS = frozenset(VIDEO_PART_TYPES + AUDIO_PART_TYPES)
_DECODED_KEYS = ("video", "audio")  # MindIE's spelling: the key names the kind


def media_items(job: Job) -> int:
    """How many video and audio items a chat or prompt job carries (what a media worker decodes);
    0 for any other job. Reads the parts where a message's content holds them, nothing deeper."""
    if isinstance(job, ChatJob):
        contents = [message.get("content") for message in job.messages if isinstance(message, dict)]
    elif isinstance(job, PromptJob) and isinstance(job.prompt, list):
        contents = [job.prompt]
    else:
        return 0
    count = 0
    for content in contents:
        for part in content if isinstance(content, list) else [content]:
            if isinstance(part, dict) and (part.get("type") in _DECODED_KINDS
                                           or ("type" not in part and any(key in part for key in _DECODED_KEYS))):
                count += 1
    return count


class _WorkerLoop:
    """The worker's job loop. Jobs run one at a time on the main thread, in arrival order, except
    that a job naming http(s) media waits for its downloads on the fetch threads while the jobs
    behind it run: a slow or silent host delays only the requests that asked for it. A
    ``CancelJob`` (the client left) drops its job if it has not run yet."""

    def __init__(self, settings: WorkerSettings, processor, store, jobs, results, parent: int):
        from concurrent.futures import ThreadPoolExecutor

        self.media_config = settings.media_config
        self.fetch = bool(getattr(settings.media_config, "allowed_domains", ()))  # else URLs are refused at once
        self.processor, self.store, self.jobs, self.results, self.parent = processor, store, jobs, results, parent
        self.fetcher = ThreadPoolExecutor(_FETCH_THREADS, thread_name_prefix="media-fetch")
        self.ready: collections.deque = collections.deque()  # (envelope, prefetched media or None)
        self.fetching: dict[int, tuple[Envelope, Any]] = {}  # job id -> (envelope, future of its media)
        self.large: set[int] = set()  # jobs whose message was over _LARGE_JOB_BYTES

    def run(self) -> None:
        while True:
            timeout = 0 if self.ready else _FETCH_POLL_MS if self.fetching else 500
            while self.jobs.poll(timeout):
                payload = self.jobs.recv()
                envelope = _job_decoder.decode(payload)
                if isinstance(envelope.job, StopJob):
                    return
                if len(payload) > _LARGE_JOB_BYTES:
                    self.large.add(envelope.id)
                payload = None  # a large request's bytes must not outlive its decoding
                self.receive(envelope)
                envelope = None
                timeout = 0
            for job_id, (envelope, future) in list(self.fetching.items()):
                if future.done():
                    del self.fetching[job_id]
                    self.ready.append((envelope, future.result()))
            if not self.ready:
                if os.getppid() != self.parent:
                    return
                continue
            envelope, media = self.ready.popleft()
            if isinstance(envelope.job, ReleaseJob):
                self.store.release(envelope.job.request_id)
                continue
            self.results.send(_encoder.encode(run_job(envelope.id, envelope.job, self.processor, self.store, media)))
            job_id, envelope, media = envelope.id, None, None
            if job_id in self.large:  # its buffers are free now: give the pages back
                self.large.discard(job_id)
                trim_heap()

    def receive(self, envelope: Envelope) -> None:
        job = envelope.job
        if isinstance(job, CancelJob):
            self.cancel(job.job_id)
            return
        urls = media_urls(job) if self.fetch else []
        if urls:
            self.fetching[envelope.id] = (envelope, self.fetcher.submit(_prefetch, urls, self.media_config))
        else:
            self.ready.append((envelope, None))

    def cancel(self, job_id: int) -> None:
        """Drop a job that has not run (a job that ran has replied already: nothing to do)."""
        self.large.discard(job_id)
        dropped = self.fetching.pop(job_id, None)
        if dropped is not None:
            dropped[1].cancel()
        else:
            waiting = [entry for entry in self.ready if entry[0].id == job_id]
            if not waiting:
                return
            self.ready.remove(waiting[0])
        self.results.send(_encoder.encode(Reply(job_id, error="cancelled: the client left", kind="cancelled")))


def _prefetch(urls: list[str], config) -> dict:
    from input_builders.fetch import fetch_url

    return {url: fetch_url(url, config) for url in urls}


def run_job(job_id: int, job: Job, processor, store, media: dict | None = None) -> Reply:
    """One job on this worker's input processor. A failed job's segments are released."""
    import shm
    from input_builders import InputBuilderError
    from input_builders.fetch import prefetched
    from input_builders.media_errors import MediaError

    request_id = getattr(job, "request_id", "")
    try:
        with prefetched(media or {}):
            return _run(job_id, job, processor, store)
    except shm.ShmStoreFullError as error:
        store.release(request_id)
        return Reply(job_id, error=str(error), kind="busy")
    except RecursionError:
        store.release(request_id)
        return Reply(job_id, error="the request is nested too deeply to render", kind="client")
    except (InputBuilderError, MediaError, InvalidRequestError) as error:  # bad input, by contract
        store.release(request_id)
        return Reply(job_id, error=str(error), kind="client")
    except Exception as error:  # noqa: BLE001 - reported as a 500 with the traceback logged here
        logger.error("job %s failed:\n%s", type(job).__name__, traceback.format_exc())
        store.release(request_id)
        return Reply(job_id, error=f"{type(error).__name__}: {error}", kind="internal")


def _run(job_id: int, job: Job, processor, store) -> Reply:
    if isinstance(job, ChatJob):
        ok = processor.chat_ids(job.messages, job.request_id, add_generation_prompt=job.add_generation_prompt,
                                chat_template_kwargs=job.chat_template_kwargs, tools=job.tools,
                                mm_processor_kwargs=job.mm_processor_kwargs)
    elif isinstance(job, PromptJob):
        ok = processor.prompt_ids(job.prompt, job.request_id, job.add_special_tokens)
    elif isinstance(job, PoolJob):
        ok = processor.pooling_ids(job.items, job.truncate_to, job.label)
    elif isinstance(job, PairJob):
        ok = [list(pair) for pair in processor.pair_ids(job.items, job.truncate_to, job.label)]
    elif isinstance(job, StatsJob):
        torch = sys.modules.get("torch")
        threads = torch.get_num_threads() if torch is not None else int(os.environ["OMP_NUM_THREADS"])
        ok = {**store.stats(), "compute_threads": threads}
    else:
        raise RuntimeError(f"unknown job {type(job).__name__}")
    if getattr(job, "release_now", False):
        store.release(job.request_id)  # /tokenize: the ids are all the caller wants
    return Reply(job_id, ok, leased=store.leased_names(job.request_id) if hasattr(job, "request_id") else [])


class _JobBudget(NamedTuple):
    deadline: float  # monotonic: when the job's budget ends
    error: str  # what its client is told (504) if the watchdog kills the worker for it


@dataclass
class _Worker:
    index: int
    process: multiprocessing.process.BaseProcess
    jobs: zmq.asyncio.Socket
    address: str
    media: bool = False  # a media worker: video and audio jobs, one at a time
    instance_id: str | None = None
    pending: set = field(default_factory=set)
    # Since when it has owed a reply without sending one (None: it owes none): the watchdog's clock.
    silent_since: float | None = None
    # A media worker's running job's budget (None: it runs none); killed_for_budget: the watchdog
    # killed it for overrunning that budget.
    budget: _JobBudget | None = None
    killed_for_budget: bool = False
    # A media worker's leases still held (request id -> segment names): adopted if it dies.
    leases: dict[str, list[str]] = field(default_factory=dict)

    def stuck(self, now: float, limit_s: float) -> bool:
        return self.silent_since is not None and now - self.silent_since > limit_s


# A worker that owes a reply this long is stuck: killed and replaced. Longer than any honest job:
# a media download is cut at MediaConfig.http_timeout_s (10 s), and a worker fetches on threads.
STUCK_AFTER_S = 60.0

# A job this large (an image chat's data URLs) goes to the worker without ZeroMQ copying it into
# its own buffer first (pyzmq keeps the bytes alive until sent); below it a copy is cheaper than
# the bookkeeping.
_ZERO_COPY_BYTES = 64 << 10


def _kind(worker: _Worker) -> str:
    return "media" if worker.media else "tokenizer"


class TokenizerPool:
    """N tokenizer workers (indices 0..N-1) and M media workers (N..N+M-1). ``await call(job)``
    runs a job on the least busy tokenizer worker, a job with video or audio on a free media worker
    when there are any (or on ``worker=...``), and returns ``(worker index, instance id, result)``;
    a client error becomes an ``InvalidRequestError`` (400), a full shm store a 503
    ``RequestError``, a media job killed for its budget a 504, anything else a 500."""

    def __init__(self, settings: WorkerSettings, num_workers: int, shm_budget_bytes: int | None,
                 on_worker_death: Callable[[int, str | None], None], shm_help: str = "",
                 stuck_after_s: float = STUCK_AFTER_S, num_media_workers: int = 0):
        if num_workers < 1:
            raise ValueError(f"--tokenizer-workers must be >= 1, got {num_workers}")
        if num_media_workers < 0:
            raise ValueError(f"--media-workers must be >= 0, got {num_media_workers}")
        self.num_workers = num_workers
        self.num_media_workers = num_media_workers
        total = num_workers + num_media_workers
        per_worker = None if shm_budget_bytes is None else max(1, shm_budget_bytes // total)
        # Cached segments count against the budget too: keep at most half of it as cache.
        cache = settings.shm_cache_bytes
        if per_worker is not None:
            cache = per_worker // 2 if cache is None else min(cache, per_worker // 2)
        self.settings = replace(settings, shm_capacity_bytes=per_worker, shm_cache_bytes=cache)
        self.shm_budget_bytes = shm_budget_bytes
        self.shm_help = shm_help
        self.on_worker_death = on_worker_death
        self._context = zmq.asyncio.Context()
        self._results = self._context.socket(zmq.PULL)
        self._results_address = processes.ipc_address("results")
        self._workers: list[_Worker | None] = [None] * total
        self._media_waiters: list[asyncio.Future] = []  # calls waiting for a free media worker
        self._futures: dict[int, tuple[asyncio.Future, int]] = {}
        self._ready: dict[int, asyncio.Future] = {}
        self._job_ids = itertools.count()
        self._reader: asyncio.Task | None = None
        self._watchdog: asyncio.Task | None = None
        self.stuck_after_s = stuck_after_s
        self._stopping = False
        # The segments of dead media workers that running requests still read (docs/architecture.md,
        # "Failure handling"), keyed by (worker index, request id) like a lease.
        self.adopted = shm.AdoptedSegments()

    @property
    def queue_depth(self) -> int:
        return len(self._futures)

    async def start(self, timeout_s: float = 300.0) -> None:
        self._results.bind(self._results_address)
        self._reader = asyncio.ensure_future(self._read_results())
        await asyncio.gather(*(self._spawn(i, timeout_s) for i in range(len(self._workers))))
        self._watchdog = asyncio.ensure_future(self._watch())

    def health_problem(self) -> str | None:
        """Why the pool cannot take a request now (for /health), or None: no worker is ready, or
        every live one owes a reply for longer than ``stuck_after_s``."""
        now = time.monotonic()
        live = self._live(media=False)  # media workers being replaced leave text requests served
        if not live:
            return "no tokenizer worker is running (one is being restarted)"
        if all(w.stuck(now, self.stuck_after_s) for w in live):
            return f"every tokenizer worker has been busy on one job for over {self.stuck_after_s:g} s"
        return None

    def _live(self, media: bool) -> list[_Worker]:
        return [w for w in self._workers if w is not None and w.media == media and w.instance_id is not None
                and w.process.is_alive()]

    async def _watch(self) -> None:
        """A tokenizer worker that owes a reply for longer than ``stuck_after_s`` is stuck (a job
        that never ends, a stopped process): it is killed, its requests fail with a 500, and it is
        replaced. A media worker past its job's budget is killed and replaced: that job fails with
        a 504."""
        while True:
            await asyncio.sleep(min(1.0, self.stuck_after_s / 4))
            now = time.monotonic()
            for worker in list(self._workers):
                if worker is None or not worker.process.is_alive():
                    continue
                if worker.media:
                    if worker.budget is not None and now > worker.budget.deadline and not worker.killed_for_budget:
                        logger.error("media worker %d is still decoding past its job's budget; killing and "
                                     "replacing it", worker.index)
                        worker.killed_for_budget = True
                        worker.process.kill()  # its exit runs _worker_ended
                    continue
                if worker.stuck(now, self.stuck_after_s):
                    logger.error("tokenizer worker %d has not answered for %.0f s; killing and replacing it",
                                 worker.index, now - worker.silent_since)
                    worker.silent_since = None
                    worker.process.kill()  # its exit runs _worker_ended

    async def _spawn(self, index: int, timeout_s: float = 300.0) -> None:
        address = processes.ipc_address(f"w{index}")
        jobs = self._context.socket(zmq.PUSH)
        jobs.bind(address)
        ready = self._ready[index] = asyncio.get_running_loop().create_future()
        media = index >= self.num_workers
        name = f"atb-media-worker-{index}" if media else f"atb-tokenizer-worker-{index}"
        process = processes.spawn(run_tokenizer_worker, name, index, self.settings, address, self._results_address)
        worker = _Worker(index, process, jobs, address, media)
        self._workers[index] = worker
        worker.instance_id = await processes.wait_started(process, ready, timeout_s)
        if worker.instance_id is None:
            raise RuntimeError(f"{_kind(worker)} worker {index} did not start (exit code {process.exitcode})")
        logger.info("%s worker %d ready, shm instance %s", _kind(worker), index, worker.instance_id)
        processes.on_exit(process, lambda: self._worker_ended(worker))
        if media:
            self._wake_media_waiters()

    async def _read_results(self) -> None:
        while True:
            message = _reply_decoder.decode(await self._results.recv())
            if isinstance(message, Ready):
                future = self._ready.pop(message.index, None)
                if future is not None and not future.done():
                    future.set_result(message.instance)
                continue
            entry = self._futures.pop(message.id, None)
            if entry is None:
                continue
            future, index = entry
            worker = self._workers[index]
            if worker is not None:
                worker.pending.discard(message.id)
                worker.silent_since = time.monotonic() if worker.pending else None
                if worker.media and not worker.pending:
                    self._media_job_ended(worker)
            if not future.done():
                future.set_result(message)

    def _worker_ended(self, worker: _Worker) -> None:
        if self._stopping:
            return
        logger.error("%s worker %d died (exit code %s); replacing it", _kind(worker), worker.index,
                     worker.process.exitcode)
        if worker.killed_for_budget and worker.budget is not None:
            error = RequestError(504, worker.budget.error)
        elif worker.media:
            error = RequestError(500, f"the media worker decoding this request's video or audio died (exit code "
                                      f"{worker.process.exitcode}); retry it, or send a smaller file")
        else:
            error = RequestError(500, f"tokenizer worker {worker.index} died while preparing this request; retry it")
        for job_id in list(worker.pending):
            future, _ = self._futures.pop(job_id, (None, None))
            if future is not None and not future.done():
                future.set_exception(error)
        worker.jobs.close(linger=0)
        processes.unlink_ipc([worker.address])  # its replacement binds a fresh one
        if worker.media and worker.instance_id is not None and worker.leases:
            # The requests it built earlier keep their media: adopted before the replacement's
            # store starts (and reaps), released here as each of them ends.
            self.adopted.adopt(worker.instance_id,
                               {(worker.index, request_id): names for request_id, names in worker.leases.items()})
        self.on_worker_death(worker.index, worker.instance_id)
        self._workers[worker.index] = None
        asyncio.ensure_future(self._replace(worker.index))

    async def _replace(self, index: int) -> None:
        try:
            await self._spawn(index)
        except Exception:
            logger.exception("could not replace tokenizer worker %d", index)

    def _pick(self) -> _Worker:
        live = self._live(media=False)
        if not live:
            raise RequestError(503, "no tokenizer worker is available (one is being restarted); retry shortly",
                           retry_after=1)
        return min(live, key=lambda w: len(w.pending))

    async def _free_media_worker(self) -> _Worker:
        """A live media worker with no job, waiting for one (its job done, its replacement up) up
        to ``stuck_after_s``: 503 beyond."""
        give_up = time.monotonic() + self.stuck_after_s
        while True:
            free = [w for w in self._live(media=True) if not w.pending]
            if free:
                return free[0]
            waiter = asyncio.get_running_loop().create_future()
            self._media_waiters.append(waiter)
            try:
                await asyncio.wait_for(waiter, max(give_up - time.monotonic(), 0.0))
            except asyncio.TimeoutError:
                raise RequestError(503, f"every media worker has been busy for {self.stuck_after_s:g} s; retry "
                                        "shortly, or start the server with more --media-workers",
                                   retry_after=1) from None
            finally:
                if waiter in self._media_waiters:
                    self._media_waiters.remove(waiter)

    def _media_job_ended(self, worker: _Worker) -> None:
        """A media worker's job is over (answered, or never sent): it is free for the next."""
        worker.budget = None
        self._wake_media_waiters()

    def _wake_media_waiters(self) -> None:
        waiters, self._media_waiters = self._media_waiters, []
        for waiter in waiters:
            if not waiter.done():
                waiter.set_result(None)

    def _media_budget(self, items: int) -> tuple[float, str]:
        """Seconds a media job of ``items`` video / audio items may keep its worker, and the 504's
        message: each item's decode budget, one more for the rest of its preparation, and its
        download's timeout."""
        config = self.settings.media_config
        per_item = config.limits.media_decode_timeout
        seconds = (items + 1) * per_item + getattr(config, "http_timeout_s", 0.0)
        return seconds, (f"preparing this request's {items} video / audio item(s) took longer than {seconds:g} s "
                         f"(--media-decode-timeout {per_item:g} s per item, plus its download and preprocessing); "
                         "its media worker was stopped. Send shorter or smaller media")

    async def call(self, job: Job, worker: _Worker | None = None) -> tuple[int, str, object]:
        items = media_items(job) if worker is None and self.num_media_workers else 0
        if items:
            worker = await self._free_media_worker()
            # Nothing awaits from here until the job is in its pending set: no other call can take it.
            seconds, error = self._media_budget(items)
            worker.budget = _JobBudget(time.monotonic() + seconds, error)
        worker = worker or self._pick()
        job_id = next(self._job_ids)
        try:
            payload = _encoder.encode(Envelope(job_id, job))
        except (UnicodeEncodeError, OverflowError, TypeError) as error:  # unpaired surrogates, huge ints
            if items:
                self._media_job_ended(worker)
            raise InvalidRequestError(f"the request holds a value that cannot be processed: {error}") from None
        future = asyncio.get_running_loop().create_future()
        self._futures[job_id] = (future, worker.index)
        worker.pending.add(job_id)
        if worker.silent_since is None:
            worker.silent_since = time.monotonic()
        await worker.jobs.send(payload, copy=len(payload) < _ZERO_COPY_BYTES)
        try:
            reply = await future
        except asyncio.CancelledError:
            # The client went away while its request was being prepared: drop the job if it has
            # not run yet, and whatever it leased if it has.
            if hasattr(job, "request_id") and worker.process.is_alive():
                worker.jobs.send(_encoder.encode(Envelope(-1, CancelJob(job_id))))
                self.release(worker.index, job.request_id)
            raise
        if reply.error is not None:
            if reply.kind == "client":
                raise InvalidRequestError(reply.error)
            if reply.kind == "busy":
                raise RequestError(503, f"{reply.error}. The shared-memory budget for images is "
                                        f"{self._budget_text()}; retry shortly, or give the service more "
                                        f"shared memory{self.shm_help}", retry_after=1)
            raise RequestError(500, reply.error)
        if worker.media and not getattr(job, "release_now", True):
            worker.leases[job.request_id] = reply.leased
        return worker.index, worker.instance_id, reply.ok

    def _budget_text(self) -> str:
        if self.shm_budget_bytes is None:
            return "what /dev/shm has free"
        return f"{self.shm_budget_bytes} bytes (--shm-budget-bytes)"

    def release(self, index: int, request_id: str) -> None:
        if self.adopted.release((index, request_id)):
            return  # built by a worker that died since: its segments are the API process's now
        worker = self._workers[index]
        if worker is not None:
            worker.leases.pop(request_id, None)
        if worker is not None and worker.process.is_alive():
            worker.jobs.send(_encoder.encode(Envelope(-1, ReleaseJob(request_id))))

    def lease_adopted(self, index: int, request_id: str) -> bool:
        """Whether the lease of ``request_id`` (built by worker ``index``, dead since) was adopted:
        its segments live on until it is released."""
        return self.adopted.holds((index, request_id))

    async def stats(self) -> dict:
        totals = {"segments": 0, "bytes": 0, "leased_segments": 0}
        for worker in list(self._workers):
            if worker is None or worker.instance_id is None:
                continue
            try:
                _, _, stats = await asyncio.wait_for(self.call(StatsJob(), worker=worker), 5)
            except (RequestError, asyncio.TimeoutError):
                continue
            totals["segments"] += stats["segments"]
            totals["bytes"] += stats["leased_bytes"] + stats["cached_bytes"]
            totals["leased_segments"] += stats["leased_segments"]
        return totals

    async def shutdown(self, timeout_s: float = 10.0) -> None:
        self._stopping = True
        for worker in self._workers:
            if worker is None:
                continue
            processes.stop_watching(worker.process)
            if worker.process.is_alive():
                await worker.jobs.send(_encoder.encode(Envelope(-1, StopJob())))
        for worker in self._workers:
            if worker is None:
                continue
            await asyncio.to_thread(worker.process.join, timeout_s)
            if worker.process.is_alive():
                worker.process.kill()  # it ignores SIGTERM
                await asyncio.to_thread(worker.process.join, 5)
            worker.jobs.close(linger=0)
        for task in (self._reader, self._watchdog):
            if task is not None:
                task.cancel()
        self._wake_media_waiters()
        self._results.close(linger=0)
        self._context.term()
        processes.unlink_ipc([self._results_address] + [w.address for w in self._workers if w is not None])
        self.adopted.close()
