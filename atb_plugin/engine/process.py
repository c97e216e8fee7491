"""The engine-core process: ``EngineCore`` in a busy loop, fed over ZeroMQ.

    frontend (MPClient, engine/client.py)           engine-core process
    ─────────────────────────────────────           ───────────────────
    PUSH  ipc://…-in  ── [b"ADD", msgpack EngineCoreRequest] ──►  PULL
                      ── [b"ABORT", msgpack [ids]]            ──►
                      ── [b"STOP"]                             ──►
    PULL  ipc://…-out ◄── [b"READY", msgpack {kv blocks, …}]  ──  PUSH
                      ◄── [b"OUT", msgpack EngineCoreOutputs]  ──
                      ◄── [b"FAILED", traceback text]          ──  (start-up failed)

The loop drains every queued message (blocking only while idle), runs one step, sends its
outputs with the scheduler stats. A request the core refuses (``ValueError`` from
``add_request``) comes back as an "error" output for that request alone. Any other exception is
a bug: it is logged and the process exits non-zero, which the API process sees (process
sentinel) and reports as 5xx + an unhealthy ``/health``. The process also exits when its parent
dies, so an engine is never orphaned. Every ``_TRIM_INTERVAL_S`` the loop hands the heap's free
pages back to the OS (``HeapTrimmer``).
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import sys
import time
import traceback

import msgspec
import zmq

from atb_plugin.engine.messages import EngineCoreOutput, EngineCoreOutputs, decode_request, encode

logger = logging.getLogger("atb_plugin.engine_core")

ADD, ABORT, STOP, READY, OUT, FAILED = b"ADD", b"ABORT", b"STOP", b"READY", b"OUT", b"FAILED"
_IDLE_POLL_MS = 500  # while idle: how often to check that the parent is still alive
_TRIM_INTERVAL_S = 10.0


class HeapTrimmer:
    """Returns the free pages of glibc's heap to the OS every ``interval_s`` (``malloc_trim(0)``).

    Why: every step allocates and frees tensors of sizes that change with the batch, below
    glibc's mmap threshold, so they come from the main heap; glibc keeps what is freed there and
    re-uses it only for allocations that fit the holes. Under a 64-client soak the engine's RSS
    grew steadily while the bytes it actually had allocated stayed flat (mallinfo2; gc objects,
    tensors and every per-request table flat too), and one ``malloc_trim(0)`` gave most of the
    growth back; a trim costs about a millisecond, so once per interval is nothing next to a step
    (benchmarks/RESULTS.md, soak.py: "The engine's +24 MiB/min traced"). A no-op where the C
    library is not glibc."""

    def __init__(self, interval_s: float = _TRIM_INTERVAL_S):
        try:
            self._malloc_trim = ctypes.CDLL("libc.so.6").malloc_trim
        except (OSError, AttributeError):
            self._malloc_trim = None
        self.interval_s = interval_s
        self._due = time.monotonic() + interval_s

    def maybe_trim(self) -> bool:
        """Trim if the interval has passed; True when it did."""
        now = time.monotonic()
        if self._malloc_trim is None or now < self._due:
            return False
        self._malloc_trim(0)
        self._due = now + self.interval_s
        return True


def run_engine_core(config, input_address: str, output_address: str, log_level: int = logging.INFO) -> None:
    """Process entry point (spawned by ``MPClient``)."""
    name = "engine-core" if config.data_parallel_size == 1 else f"engine-core {config.data_parallel_rank}"
    logging.basicConfig(level=log_level, format=f"%(asctime)s %(levelname)s [{name}] %(message)s")
    # Ctrl-C (SIGINT) and a supervisor's SIGTERM often reach the whole process group: the API
    # process decides when the core stops (after draining), so the core ignores both. It still
    # exits when the API process is gone (see _loop), so it is never orphaned.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    parent = os.getppid()
    context = zmq.Context()
    inbox = context.socket(zmq.PULL)
    inbox.connect(input_address)
    outbox = context.socket(zmq.PUSH)
    outbox.setsockopt(zmq.LINGER, 2000)
    outbox.connect(output_address)
    cores = config.engine_cores(sorted(os.sched_getaffinity(0)))
    if cores is not None:  # data parallelism on the CPU: this engine's own cores, inherited by its ranks
        os.sched_setaffinity(0, cores)
    try:
        from atb_plugin.engine.core import EngineCore

        core = EngineCore(config)
    except BaseException:
        outbox.send_multipart([FAILED, traceback.format_exc().encode()])
        raise
    outbox.send_multipart([READY, encode({"kv_cache_blocks": core.kv_cache_blocks,
                                           "max_tokens_per_request": core.max_tokens_per_request})])
    try:
        _loop(core, inbox, outbox, parent)
    except BaseException:
        logger.exception("engine core crashed")
        core.shutdown()  # no rank outlives the core
        outbox.close(linger=500)
        inbox.close(linger=0)  # term() waits for every socket: an open inbox would hang the exit
        context.term()
        sys.exit(1)
    core.shutdown()
    outbox.close(linger=2000)
    inbox.close(linger=0)
    context.term()


def _loop(core, inbox, outbox, parent: int) -> None:
    poller = zmq.Poller()
    poller.register(inbox, zmq.POLLIN)
    trimmer = HeapTrimmer()
    while True:
        # Finished requests whose blocks a KV connector still sends keep the loop stepping (an
        # empty step polls the workers; EngineCore.step paces such steps).
        busy = core.has_unfinished_requests() or core.has_pending_kv_transfers()
        timeout = 0 if busy else _IDLE_POLL_MS
        refused: list[EngineCoreOutput] = []
        received = False
        while poller.poll(timeout):
            kind, *payload = inbox.recv_multipart()
            received = True
            if kind == STOP:
                return
            if kind == ABORT:
                core.abort(msgspec.msgpack.decode(payload[0]))
            elif kind == ADD:
                request = decode_request(payload[0])
                try:
                    core.add_request(request)
                except ValueError as error:
                    refused.append(EngineCoreOutput(request.request_id, finish_reason="error", error=str(error)))
            timeout = 0
        if os.getppid() != parent:
            logger.error("the API process is gone; the engine core exits")
            return
        busy = core.has_unfinished_requests() or core.has_pending_kv_transfers()  # (new requests may have come)
        outputs = refused + (core.step() if busy else [])
        # Stats go out with every step, and after an abort too, so the gauges never go stale.
        if outputs or received:
            outbox.send_multipart([OUT, encode(EngineCoreOutputs(outputs, core.make_stats()))])
        trimmer.maybe_trim()
