"""The engine-core process: ``EngineCore`` in a busy loop, fed over ZeroMQ.

    API process                                     engine-core process
    ───────────                                     ───────────────────
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
dies, so an engine is never orphaned.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import traceback

import msgspec
import zmq

from atb_plugin.engine.messages import EngineCoreOutput, EngineCoreOutputs, decode_request, encode

logger = logging.getLogger("atb_plugin.engine_core")

ADD, ABORT, STOP, READY, OUT, FAILED = b"ADD", b"ABORT", b"STOP", b"READY", b"OUT", b"FAILED"
_IDLE_POLL_MS = 500  # while idle: how often to check that the parent is still alive


def run_engine_core(config, input_address: str, output_address: str, log_level: int = logging.INFO) -> None:
    """Process entry point (spawned by ``EngineClient``)."""
    logging.basicConfig(level=log_level, format="%(asctime)s %(levelname)s [engine-core] %(message)s")
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
        outbox.close(linger=500)
        inbox.close(linger=0)  # term() waits for every socket: an open inbox would hang the exit
        context.term()
        sys.exit(1)
    outbox.close(linger=2000)
    inbox.close(linger=0)
    context.term()


def _loop(core, inbox, outbox, parent: int) -> None:
    poller = zmq.Poller()
    poller.register(inbox, zmq.POLLIN)
    while True:
        timeout = 0 if core.has_unfinished_requests() else _IDLE_POLL_MS
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
        outputs = refused + (core.step() if core.has_unfinished_requests() else [])
        # Stats go out with every step, and after an abort too, so the gauges never go stale.
        if outputs or received:
            outbox.send_multipart([OUT, encode(EngineCoreOutputs(outputs, core.make_stats()))])
