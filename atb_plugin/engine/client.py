"""The frontend's handle on the engine core: ``EngineCoreClient``, in this process or in its own.

    InprocClient   the core in the caller's process (the offline ``LLM``): ``step()`` runs one
                   step and returns its outputs; requests and aborts are plain calls
    MPClient       the core in its own process (the server, ``engine/process.py``), over ZeroMQ:
                   outputs arrive on the asyncio loop through ``on_outputs``

Both take ``add_request(EngineCoreRequest)`` and ``abort(request ids)``: the frontend's request
tracker needs nothing else. ``MPClient``: starts the process (spawn: a clean interpreter, no inherited event loop or threads), waits for
READY, then sends requests/aborts and receives ``EngineCoreOutputs`` on the asyncio loop. Death
of the process is noticed through its sentinel (a file descriptor that becomes readable when
the process ends), not by a timeout: ``on_death`` runs at once.
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
from collections.abc import Callable

import msgspec
import zmq
import zmq.asyncio

from typing import Protocol, runtime_checkable

from atb_plugin import processes
from atb_plugin.engine.config import EngineConfig
from atb_plugin.engine.messages import EngineCoreOutput, EngineCoreOutputs, EngineCoreRequest, decode_outputs, encode
from atb_plugin.engine.process import ABORT, ADD, FAILED, OUT, READY, STOP, run_engine_core

logger = logging.getLogger(__name__)

__all__ = ["EngineCoreClient", "EngineStartError", "InprocClient", "MPClient"]


@runtime_checkable
class EngineCoreClient(Protocol):
    """What a frontend sends the core. ``add_request`` raises ``ValueError`` for a request the
    core refuses where it can tell at once (in process); across processes the refusal comes back
    as that request's "error" output."""

    def add_request(self, request: EngineCoreRequest) -> None: ...

    def abort(self, request_ids: list[str]) -> None: ...


class EngineStartError(RuntimeError):
    pass


class InprocClient:
    """The engine core in this process (torch is imported here, not at module import)."""

    def __init__(self, config: EngineConfig):
        from atb_plugin.engine.core import EngineCore

        self.core = EngineCore(config)

    @property
    def max_tokens_per_request(self) -> int:
        return self.core.max_tokens_per_request

    def add_request(self, request: EngineCoreRequest) -> None:
        self.core.add_request(request)

    def abort(self, request_ids: list[str]) -> None:
        self.core.abort(request_ids)

    def has_unfinished_requests(self) -> bool:
        return self.core.has_unfinished_requests()

    def step(self) -> list[EngineCoreOutput]:
        return self.core.step()

    def shutdown(self) -> None:
        self.core.shutdown()


class MPClient:
    def __init__(self, config: EngineConfig, on_outputs: Callable[[EngineCoreOutputs], None],
                 on_death: Callable[[int | None], None]):
        self.config = config
        self.on_outputs = on_outputs
        self.on_death = on_death
        self.process: multiprocessing.process.BaseProcess | None = None
        self.info: dict = {}
        self.alive = False
        self._stopping = False
        self._addresses = (processes.ipc_address("in"), processes.ipc_address("out"))
        self._context = zmq.asyncio.Context()
        self._inbox = self._context.socket(zmq.PUSH)  # to the core
        self._outbox = self._context.socket(zmq.PULL)  # from the core
        self._reader: asyncio.Task | None = None

    async def start(self, timeout_s: float = 600.0) -> None:
        self._inbox.bind(self._addresses[0])
        self._outbox.bind(self._addresses[1])
        name = "atb-engine-core" + ("" if self.config.data_parallel_size == 1 else f"-{self.config.data_parallel_rank}")
        self.process = processes.spawn(run_engine_core, name, self.config, *self._addresses)
        message = await processes.wait_started(self.process, self._outbox.recv_multipart(), timeout_s)
        if message is None:
            raise EngineStartError(f"the engine core did not start (exit code {self.process.exitcode}); "
                                   "see its log above")
        kind, *payload = message
        if kind == FAILED:
            self.process.join(10)
            raise EngineStartError("the engine core failed to start:\n" + payload[0].decode(errors="replace"))
        assert kind == READY, kind
        self.info = msgspec.msgpack.decode(payload[0])
        self.alive = True
        processes.on_exit(self.process, self._process_ended)
        self._reader = asyncio.ensure_future(self._read_outputs())

    async def _read_outputs(self) -> None:
        while True:
            kind, *payload = await self._outbox.recv_multipart()
            if kind == OUT:
                try:
                    self.on_outputs(decode_outputs(payload[0]))
                except Exception:  # a frontend bug must not stop the reader: it is logged, requests go on
                    logger.exception("processing engine outputs failed")

    def _process_ended(self) -> None:
        self.alive = False
        if not self._stopping:
            logger.error("the engine-core process died (exit code %s)", self.process.exitcode)
            self.on_death(self.process.exitcode)

    @property
    def max_tokens_per_request(self) -> int:
        return self.info["max_tokens_per_request"]

    def add_request(self, request: EngineCoreRequest) -> None:
        self._inbox.send_multipart([ADD, encode(request)])

    def abort(self, request_ids: list[str]) -> None:
        if request_ids and self.alive:
            self._inbox.send_multipart([ABORT, encode(list(request_ids))])

    async def shutdown(self, timeout_s: float = 10.0) -> None:
        self._stopping = True
        if self.process is not None and self.process.is_alive():
            processes.stop_watching(self.process)
            await self._inbox.send_multipart([STOP])
            await asyncio.to_thread(self.process.join, timeout_s)
            if self.process.is_alive():
                self.process.kill()  # it ignores SIGTERM (see engine/process.py)
                await asyncio.to_thread(self.process.join, 5)
        if self._reader is not None:
            self._reader.cancel()
        self.alive = False
        self._inbox.close(linger=0)
        self._outbox.close(linger=0)
        self._context.term()
        processes.unlink_ipc(self._addresses)
