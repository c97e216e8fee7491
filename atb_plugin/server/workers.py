"""The tokenizer worker pool: processes that turn requests into token ids (with media handles).

Each worker owns a router (tokenizer, chat template, input builder) and its own ``ShmStore``, so
the shared-memory segments of a request belong to the worker that built it::

    API process ── [msgpack job] ──► worker i (PULL ipc://…-w<i>)
        ▲                             router.input_builder.make_context / tokenize
        │                             images: load → preprocess → store_i.put(…, request_id)
        └──── [msgpack result] ◄───── PUSH ipc://…-results (shared by all workers)

A request's lease ends when the API process sends ``release`` to the worker that built it (the
OutputProcessor's on_finish, whatever ended the request). Ownership is per worker so no store is
shared across processes, and a worker that dies takes nothing with it: the replacement's
``ShmStore()`` reaps the dead instance's segments on start, and the API process fails the
requests that were using them.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import multiprocessing
import os
import signal
import sys
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import msgspec
import zmq
import zmq.asyncio

from atb_plugin.multimodal.wire import DEFAULT_WIRE_DTYPE
from atb_plugin.server import processes
from atb_plugin.server.errors import APIError

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class WorkerSettings:
    """What a worker needs to build a router (picklable: it crosses the spawn)."""

    model: str
    media_config: object
    max_images_per_prompt: int | None = None
    mm_wire_dtype: str = DEFAULT_WIRE_DTYPE  # what the builders write to shm (EngineConfig.mm_wire_dtype)
    chat_template: str | None = None
    shm_capacity_bytes: int | None = None
    shm_cache_bytes: int | None = None  # None: the store's own default (a quarter of /dev/shm, <= 1 GiB)


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
    from routers import get_router

    parent = os.getppid()
    if settings.shm_capacity_bytes is not None:
        from input_builders.media import limit_decoded_image_cache

        limit_decoded_image_cache(settings.shm_capacity_bytes)
    store = shm.ShmStore(shm.ShmStoreConfig(capacity_bytes=settings.shm_capacity_bytes,
                                            cache_bytes=settings.shm_cache_bytes))
    router = get_router(settings.model, shm_store=store, media_config=settings.media_config,
                        max_images_per_prompt=settings.max_images_per_prompt, mm_wire_dtype=settings.mm_wire_dtype)
    if settings.chat_template is not None:
        router.tokenizer.chat_template = settings.chat_template
    builder = router.input_builder
    context = zmq.Context()
    jobs = context.socket(zmq.PULL)
    jobs.connect(job_address)
    results = context.socket(zmq.PUSH)
    results.connect(result_address)
    results.send(msgspec.msgpack.encode({"ready": index, "instance": store.instance_id}))
    try:
        while True:
            if not jobs.poll(500):
                if os.getppid() != parent:
                    return
                continue
            job = msgspec.msgpack.decode(jobs.recv())
            op = job["op"]
            if op == "stop":
                return
            if op == "release":
                store.release(job["request_id"])
                continue
            results.send(msgspec.msgpack.encode(_run_job(job, router, builder, store)))
    finally:
        store.close()
        results.close(linger=1000)
        jobs.close(linger=0)
        context.term()


def _run_job(job: dict, router, builder, store) -> dict:
    import shm

    reply = {"id": job["id"]}
    try:
        op = job["op"]
        if op == "chat":
            reply["ok"] = builder.make_context(
                0, job["messages"], add_generation_prompt=job.get("add_generation_prompt", True),
                request_id=job["request_id"], chat_template_kwargs=job.get("chat_template_kwargs"),
                tools=job.get("tools"))
        elif op == "prompt":
            prompt = job["prompt"]
            reply["ok"] = builder.tokenize(prompt, request_id=job["request_id"],
                                           add_special_tokens=job.get("add_special_tokens", True))
        elif op in ("pool", "pair"):
            reply["ok"] = _pooling_ids(router.tokenizer, job)
        elif op == "detokenize":
            reply["ok"] = router.tokenizer.decode(job["tokens"])
        elif op == "stats":
            torch = sys.modules.get("torch")
            threads = torch.get_num_threads() if torch is not None else int(os.environ["OMP_NUM_THREADS"])
            reply["ok"] = {**store.stats(), "compute_threads": threads}
        else:
            raise RuntimeError(f"unknown job {op!r}")
        if op in ("chat", "prompt") and job.get("release_now"):
            store.release(job["request_id"])  # /tokenize: the ids are all the caller wants
    except shm.ShmStoreFullError as error:
        store.release(job.get("request_id", ""))
        reply.update(error=str(error), kind="busy")
    except RecursionError:
        store.release(job.get("request_id", ""))
        reply.update(error="the request is nested too deeply to render", kind="client")
    except ValueError as error:  # the builders' and media loaders' contract: bad input
        store.release(job.get("request_id", ""))
        reply.update(error=str(error), kind="client")
    except Exception as error:  # noqa: BLE001 - reported as a 500 with the traceback logged here
        logger.error("job %s failed:\n%s", job.get("op"), traceback.format_exc())
        store.release(job.get("request_id", ""))
        reply.update(error=f"{type(error).__name__}: {error}", kind="internal")
    return reply


def _pooling_ids(tokenizer, job: dict) -> list:
    """Prompts of a pooling request: ``pool`` -> the ids of each text in ``items``; ``pair`` ->
    ``[ids, token_type_start]`` of each ``[first, second]`` pair (cross-encoders). Truncation
    keeps each text's start (``atb_plugin.pooling.inputs``); an input over ``max_model_len`` is a
    client error naming it (``label[i]``) and the limit. No shared memory: nothing to release."""
    from atb_plugin.pooling import inputs

    max_model_len, truncate_to, items = job["max_model_len"], job.get("truncate_to"), job["items"]
    results = []
    for i, item in enumerate(items):
        try:
            if job["op"] == "pool":
                results.append(inputs.text_ids(tokenizer, item, max_model_len, truncate_to))
            else:
                results.append(list(inputs.pair_ids(tokenizer, item[0], item[1], max_model_len, truncate_to)))
        except ValueError as error:
            raise ValueError(f"{job.get('label', 'input')}[{i}]: {error}" if len(items) > 1 else str(error)) from None
    return results


@dataclass
class _Worker:
    index: int
    process: multiprocessing.process.BaseProcess
    jobs: zmq.asyncio.Socket
    address: str
    instance_id: str | None = None
    pending: set = field(default_factory=set)


# A job this large (an image chat's data URLs) goes to the worker without ZeroMQ copying it into
# its own buffer first (pyzmq keeps the bytes alive until sent); below it a copy is cheaper than
# the bookkeeping.
_ZERO_COPY_BYTES = 64 << 10


class TokenizerPool:
    """N tokenizer workers. ``await call(op, **fields)`` runs a job on the least busy worker (or
    ``worker=i``) and returns ``(worker index, instance id, result)``; a client error becomes a
    400 ``APIError``, a full shm store a 503, anything else a 500."""

    def __init__(self, settings: WorkerSettings, num_workers: int, shm_budget_bytes: int | None,
                 on_worker_death: Callable[[int, str | None], None], shm_help: str = ""):
        if num_workers < 1:
            raise ValueError(f"--tokenizer-workers must be >= 1, got {num_workers}")
        self.num_workers = num_workers
        per_worker = None if shm_budget_bytes is None else max(1, shm_budget_bytes // num_workers)
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
        self._workers: list[_Worker | None] = [None] * num_workers
        self._futures: dict[int, tuple[asyncio.Future, int]] = {}
        self._ready: dict[int, asyncio.Future] = {}
        self._job_ids = itertools.count()
        self._reader: asyncio.Task | None = None
        self._stopping = False

    @property
    def queue_depth(self) -> int:
        return len(self._futures)

    async def start(self, timeout_s: float = 300.0) -> None:
        self._results.bind(self._results_address)
        self._reader = asyncio.ensure_future(self._read_results())
        await asyncio.gather(*(self._spawn(i, timeout_s) for i in range(self.num_workers)))

    async def _spawn(self, index: int, timeout_s: float = 300.0) -> None:
        address = processes.ipc_address(f"w{index}")
        jobs = self._context.socket(zmq.PUSH)
        jobs.bind(address)
        ready = self._ready[index] = asyncio.get_running_loop().create_future()
        process = processes.spawn(run_tokenizer_worker, f"atb-tokenizer-worker-{index}", index, self.settings,
                                  address, self._results_address)
        worker = _Worker(index, process, jobs, address)
        self._workers[index] = worker
        worker.instance_id = await processes.wait_started(process, ready, timeout_s)
        if worker.instance_id is None:
            raise RuntimeError(f"tokenizer worker {index} did not start (exit code {process.exitcode})")
        logger.info("tokenizer worker %d ready, shm instance %s", index, worker.instance_id)
        processes.on_exit(process, lambda: self._worker_ended(worker))

    async def _read_results(self) -> None:
        while True:
            message = msgspec.msgpack.decode(await self._results.recv())
            if "ready" in message:
                future = self._ready.pop(message["ready"], None)
                if future is not None and not future.done():
                    future.set_result(message["instance"])
                continue
            entry = self._futures.pop(message["id"], None)
            if entry is None:
                continue
            future, index = entry
            worker = self._workers[index]
            if worker is not None:
                worker.pending.discard(message["id"])
            if not future.done():
                future.set_result(message)

    def _worker_ended(self, worker: _Worker) -> None:
        if self._stopping:
            return
        logger.error("tokenizer worker %d died (exit code %s); replacing it", worker.index, worker.process.exitcode)
        for job_id in list(worker.pending):
            future, _ = self._futures.pop(job_id, (None, None))
            if future is not None and not future.done():
                future.set_exception(APIError(500, f"tokenizer worker {worker.index} died while preparing "
                                                   "this request; retry it"))
        worker.jobs.close(linger=0)
        processes.unlink_ipc([worker.address])  # its replacement binds a fresh one
        self.on_worker_death(worker.index, worker.instance_id)
        self._workers[worker.index] = None
        asyncio.ensure_future(self._replace(worker.index))

    async def _replace(self, index: int) -> None:
        try:
            await self._spawn(index)
        except Exception:
            logger.exception("could not replace tokenizer worker %d", index)

    def _pick(self) -> _Worker:
        live = [w for w in self._workers if w is not None and w.instance_id is not None and w.process.is_alive()]
        if not live:
            raise APIError(503, "no tokenizer worker is available (one is being restarted); retry shortly",
                           retry_after=1)
        return min(live, key=lambda w: len(w.pending))

    async def call(self, op: str, worker: _Worker | None = None, **fields) -> tuple[int, str, object]:
        worker = worker or self._pick()
        job_id = next(self._job_ids)
        try:
            payload = msgspec.msgpack.encode({"id": job_id, "op": op, **fields})
        except (UnicodeEncodeError, OverflowError, TypeError) as error:  # unpaired surrogates, huge ints
            raise APIError(400, f"the request holds a value that cannot be processed: {error}") from None
        future = asyncio.get_running_loop().create_future()
        self._futures[job_id] = (future, worker.index)
        worker.pending.add(job_id)
        await worker.jobs.send(payload, copy=len(payload) < _ZERO_COPY_BYTES)
        try:
            reply = await future
        except asyncio.CancelledError:
            # The client went away while its request was being prepared: drop its leases.
            if "request_id" in fields:
                self.release(worker.index, fields["request_id"])
            raise
        if "error" in reply:
            if reply["kind"] == "client":
                raise APIError(400, reply["error"])
            if reply["kind"] == "busy":
                raise APIError(503, f"{reply['error']}. The shared-memory budget for images is "
                                    f"{self._budget_text()}; retry shortly, or give the service more "
                                    f"shared memory{self.shm_help}", retry_after=1)
            raise APIError(500, reply["error"])
        return worker.index, worker.instance_id, reply["ok"]

    def _budget_text(self) -> str:
        if self.shm_budget_bytes is None:
            return "what /dev/shm has free"
        return f"{self.shm_budget_bytes} bytes (--shm-budget-bytes)"

    def release(self, index: int, request_id: str) -> None:
        worker = self._workers[index]
        if worker is not None and worker.process.is_alive():
            worker.jobs.send(msgspec.msgpack.encode({"op": "release", "request_id": request_id}))

    async def stats(self) -> dict:
        totals = {"segments": 0, "bytes": 0, "leased_segments": 0}
        for worker in list(self._workers):
            if worker is None or worker.instance_id is None:
                continue
            try:
                _, _, stats = await asyncio.wait_for(self.call("stats", worker=worker), 5)
            except (APIError, asyncio.TimeoutError):
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
                await worker.jobs.send(msgspec.msgpack.encode({"op": "stop"}))
        for worker in self._workers:
            if worker is None:
                continue
            await asyncio.to_thread(worker.process.join, timeout_s)
            if worker.process.is_alive():
                worker.process.kill()  # it ignores SIGTERM
                await asyncio.to_thread(worker.process.join, 5)
            worker.jobs.close(linger=0)
        if self._reader is not None:
            self._reader.cancel()
        self._results.close(linger=0)
        self._context.term()
        processes.unlink_ipc([self._results_address] + [w.address for w in self._workers if w is not None])
