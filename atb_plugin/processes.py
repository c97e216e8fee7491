"""What the engine client and the tokenizer pool both do with their child processes: spawn them,
name their ZeroMQ ipc:// endpoints, wait for a ready message or the process's death, and notice
a later death through the process sentinel (a file descriptor that becomes readable when the
process ends) on the asyncio loop."""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
import os
import tempfile
import uuid
from collections.abc import Awaitable, Callable, Iterable

logger = logging.getLogger(__name__)


def ipc_address(name: str) -> str:
    """A fresh ``ipc://`` endpoint in the temp directory, unique to this process and call."""
    base = os.path.join(tempfile.gettempdir(), f"atb-plugin-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    return f"ipc://{base}-{name}"


def unlink_ipc(addresses: Iterable[str]) -> None:
    for address in addresses:
        try:
            os.unlink(address[len("ipc://"):])
        except OSError:
            pass


def spawn(target, name: str, *args) -> multiprocessing.process.BaseProcess:
    """Start ``target(*args, log_level)`` in a fresh interpreter (spawn: no inherited event loop
    or threads), as a daemon so it never outlives a crashed parent's exit."""
    process = multiprocessing.get_context("spawn").Process(
        target=target, name=name, daemon=True, args=(*args, logging.getLogger().level or logging.INFO))
    process.start()
    logger.info("%s pid %d", name.removeprefix("atb-").replace("-", " "), process.pid)
    return process


async def wait_started(process, ready: Awaitable, timeout_s: float):
    """``ready``'s result, or None if the process died (or ``timeout_s`` passed) first."""
    loop = asyncio.get_running_loop()
    ready = asyncio.ensure_future(ready)
    died = loop.create_future()
    loop.add_reader(process.sentinel, lambda: died.done() or died.set_result(None))
    try:
        done, _ = await asyncio.wait({ready, died}, timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED)
    finally:
        loop.remove_reader(process.sentinel)
    if ready not in done:
        ready.cancel()
        await asyncio.to_thread(process.join, 1)
        return None
    return ready.result()


def on_exit(process, callback: Callable[[], None]) -> None:
    """Run ``callback`` on the loop once ``process`` has ended (reaped, so its exit code is known)."""
    loop = asyncio.get_running_loop()

    def ended():
        loop.remove_reader(process.sentinel)
        process.join(1)
        callback()

    loop.add_reader(process.sentinel, ended)


def stop_watching(process) -> None:
    try:
        asyncio.get_running_loop().remove_reader(process.sentinel)
    except (ValueError, OSError):
        pass
