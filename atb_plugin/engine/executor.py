"""Executors: how the engine core runs its model, on one device or on tensor-parallel ranks.

    EngineCore ── SchedulerOutput ──► Executor.execute ──► RunnerOutput (sampled ids, pooled, ...)

``UniprocExecutor`` (TP = 1): the ``Worker`` in the core's own process, called directly — no
extra process, no copy. ``MultiprocExecutor`` (TP > 1): one rank process per device
(``python -m atb_plugin.engine.worker``), each with its model shard and KV-cache shard, joined in
a ``torch.distributed`` group of the platform's backend. Per step the core pickles the scheduler
output once and writes the same bytes to every rank over a Unix socket pair; every rank runs the
step, rank 0 sends the result back. A rank that dies or fails is seen at once (its socket reads
end-of-file, or it sends its traceback): the executor kills the other ranks and raises
``RankFailed``, which the core treats as its own death (docs/architecture.md, "Tensor
parallelism", has the failure table).
"""

from __future__ import annotations

import collections
import logging
import os
import pickle
import socket
import subprocess
import sys
import threading
import time
from multiprocessing.connection import Connection, wait
from typing import Protocol

import torch

from atb_plugin.engine.config import EngineConfig
from atb_plugin.engine.model_runner import ModelRunner, RunnerOutput
from atb_plugin.engine.scheduler import SchedulerOutput
from atb_plugin.engine.worker import Worker, WorkerInfo

logger = logging.getLogger(__name__)

__all__ = ["Executor", "MultiprocExecutor", "RankFailed", "UniprocExecutor", "make_executor"]

# How long ranks may take to join the process group, and to stop when asked.
DIST_TIMEOUT_S = 120.0
STOP_WAIT_S = 5.0
_LOG_TAIL_LINES = 30


class RankFailed(RuntimeError):
    """A tensor-parallel rank died or failed: the engine cannot go on."""


class Executor(Protocol):
    """``kv_cache_blocks``: blocks every rank holds (the null block included); ``decode_capture``:
    how decode steps run; ``weight_bytes``: each rank's weight bytes; ``runner``: the model
    runner when it runs in this process, else None; ``execute`` one step; ``shutdown`` stops
    whatever it started (idempotent)."""

    kv_cache_blocks: int
    decode_capture: str
    weight_bytes: list[int]
    runner: ModelRunner | None

    def execute(self, output: SchedulerOutput) -> RunnerOutput: ...

    def shutdown(self) -> None: ...


def make_executor(config: EngineConfig) -> Executor:
    if config.distributed_executor_backend == "ray":
        from atb_plugin.engine.ray_executor import RayExecutor  # Ray is an optional dependency

        return RayExecutor(config)
    return UniprocExecutor(config) if config.tensor_parallel_size == 1 else MultiprocExecutor(config)


class UniprocExecutor:
    """TP = 1: the worker lives here; the runner reads the scheduler's own request objects."""

    def __init__(self, config: EngineConfig):
        torch.set_num_threads(config.num_threads)  # the engine owns the intra-op threads
        self.worker = Worker(config)
        info = self.worker.load()
        self.kv_cache_blocks = info.available_kv_blocks
        self.weight_bytes = [info.weight_bytes]
        self.decode_capture = self.worker.initialize(self.kv_cache_blocks)
        self.runner = self.worker.runner

    def execute(self, output: SchedulerOutput) -> RunnerOutput:
        return self.worker.execute(output)

    def shutdown(self) -> None:
        pass


class _Rank:
    """One rank process, its socket and the tail of its log (stderr, forwarded to ours)."""

    def __init__(self, rank: int, env: dict):
        ours, theirs = socket.socketpair()
        self.rank = rank
        self.process = subprocess.Popen(
            [sys.executable, "-m", "atb_plugin.engine.worker", str(theirs.fileno()), str(rank)],
            pass_fds=(theirs.fileno(),), stderr=subprocess.PIPE, env=env)
        theirs.close()
        logger.info("tensor-parallel rank %d pid %d", rank, self.process.pid)
        self.conn = Connection(ours.detach())
        self.tail: collections.deque[str] = collections.deque(maxlen=_LOG_TAIL_LINES)
        threading.Thread(target=self._forward_log, name=f"rank-{rank}-log", daemon=True).start()

    def _forward_log(self) -> None:
        for line in iter(self.process.stderr.readline, b""):
            text = line.decode(errors="replace")
            self.tail.append(text)
            sys.stderr.write(text)

    def describe_failure(self, what: str) -> str:
        try:
            code = self.process.wait(timeout=2)
        except subprocess.TimeoutExpired:
            code = None
        status = "is still running" if code is None else (
            f"was killed by signal {-code}" if code < 0 else f"exited with code {code}")
        tail = "".join(self.tail).rstrip() or "(no output)"
        return f"tensor-parallel rank {self.rank} {what}; it {status}. Its log ends:\n{tail}"


class MultiprocExecutor:
    """TP > 1: ``tensor_parallel_size`` rank processes; the core keeps scheduling."""

    runner = None  # it runs on the ranks

    def __init__(self, config: EngineConfig):
        self.config = config
        size = config.tensor_parallel_size
        env = dict(os.environ)
        # One node: the rendezvous and gloo's sockets stay on loopback (gloo otherwise binds the
        # interface the host name resolves to).
        env.setdefault("GLOO_SOCKET_IFNAME", "lo")
        env.setdefault("PYTHONPATH", os.pathsep.join(p for p in sys.path if p))
        init_method = f"tcp://127.0.0.1:{free_port()}"
        self.ranks = [_Rank(rank, env) for rank in range(size)]
        self._closed = False
        self._failure: str | None = None  # why the ranks were stopped, once one failed
        try:
            level = logging.getLogger().level or logging.INFO
            for rank in self.ranks:
                rank.conn.send((config, init_method, DIST_TIMEOUT_S, level))
            infos: list[WorkerInfo] = self._gather("READY", "failed to load its shard")
            self.kv_cache_blocks = min(info.available_kv_blocks for info in infos)
            self.weight_bytes = [info.weight_bytes for info in infos]
            for rank in self.ranks:
                rank.conn.send(("INIT", self.kv_cache_blocks))
            self.decode_capture = self._gather("INITIALIZED", "failed to allocate its KV cache")[0]
        except BaseException:
            self.shutdown()
            raise
        logger.info("tensor parallel: %d ranks (%s), weights per rank %s MiB", size, config.device,
                    ", ".join(f"{b / 2**20:.1f}" for b in self.weight_bytes))

    def _gather(self, expected: str, what: str) -> list:
        """Each rank's answer to a start-up stage, in rank order; RankFailed naming the first that
        failed (its traceback, or its exit status and log tail)."""
        answers: dict[int, object] = {}
        pending = {rank.conn: rank for rank in self.ranks}
        while pending:
            for conn in wait(list(pending)):
                rank = pending.pop(conn)
                try:
                    kind, payload = conn.recv()
                except (EOFError, OSError):
                    raise RankFailed(rank.describe_failure(what)) from None
                if kind != expected:
                    raise RankFailed(f"tensor-parallel rank {rank.rank} {what}:\n{payload}")
                answers[rank.rank] = payload
        return [answers[r] for r in range(len(self.ranks))]

    def execute(self, output: SchedulerOutput) -> RunnerOutput:
        if self._failure is not None:  # not the ranks this executor killed itself: the first cause
            raise RankFailed(f"the engine already failed: {self._failure}")
        payload = pickle.dumps(output, protocol=pickle.HIGHEST_PROTOCOL)
        try:
            for rank in self.ranks:
                rank.conn.send_bytes(payload)
        except OSError:
            self._fail_with_first_dead("died")
        leader = self.ranks[0].conn
        # Rank 0's answer, or any rank's end-of-file: a dead rank leaves the others waiting in a
        # collective, so its death must be seen here, not after a timeout.
        while True:
            ready = wait([rank.conn for rank in self.ranks])
            if leader in ready:
                try:
                    return leader.recv()
                except (EOFError, OSError):
                    self._fail_with_first_dead("died")
            self._fail_with_first_dead("died")

    def _fail_with_first_dead(self, what: str):
        # The rank that died first is the cause; a peer it left in a collective may exit too (gloo
        # reports the closed connection), moments later and with an exit code rather than a
        # signal. Let exits settle briefly, then name a rank killed by a signal before one that
        # exited by itself.
        deadline = time.monotonic() + 1.0
        while time.monotonic() < deadline and all(r.process.poll() is None for r in self.ranks):
            time.sleep(0.02)
        time.sleep(0.1)
        dead = [r for r in self.ranks if r.process.poll() is not None]
        dead.sort(key=lambda r: r.process.returncode >= 0)  # signalled first, rank order kept
        dead = dead[0] if dead else self.ranks[0]  # a socket closed under a live process: name rank 0
        self._failure = dead.describe_failure(what + " during a step")
        self.shutdown(graceful=False)  # the survivors wait in a collective that never ends
        raise RankFailed(self._failure)

    def shutdown(self, graceful: bool = True) -> None:
        """Stop the ranks: asked to (they leave the process group and exit), killed after
        ``STOP_WAIT_S``; at once when not ``graceful``."""
        if self._closed:
            return
        self._closed = True
        for rank in self.ranks:
            try:
                rank.conn.send(None) if graceful else rank.process.kill()
            except (OSError, ValueError):
                pass
        for rank in self.ranks:
            try:
                rank.process.wait(timeout=STOP_WAIT_S)
            except subprocess.TimeoutExpired:
                rank.process.kill()
                rank.process.wait()
            rank.conn.close()

    def __del__(self):
        if not getattr(self, "_closed", True):
            for rank in self.ranks:
                if rank.process.poll() is None:
                    rank.process.kill()


def free_port(address: str = "127.0.0.1") -> int:
    """A TCP port free on ``address`` now (for a process group's rendezvous)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind((address, 0))
        return probe.getsockname()[1]
