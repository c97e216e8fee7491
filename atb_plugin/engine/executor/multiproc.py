"""``MultiprocExecutor`` (``mp``, TP > 1): one rank process per device on this node.

    engine core ── Execute (the step, pickled once) ──► every rank's Unix socket pair
                ◄── Executed (rank 0's RunnerOutput) ──
                ── Propose (request ids; a speculative head drafts on the ranks) ──►
                ◄── Proposed (rank 0's drafts) ──

Each rank (``python -m atb_plugin.engine.executor.multiproc FD RANK``, ``run_rank``) holds its
model shard and KV-cache shard in a ``torch.distributed`` group of the platform's backend. The
core encodes each call once (the typed messages of ``base``) and writes the same bytes to every
rank; every rank runs it, rank 0 answers the step. A rank that dies or fails is seen at once (its
socket reads end-of-file, or it sends its traceback): the driver stops the other ranks and
raises ``RankFailed`` (docs/architecture.md, "Tensor parallelism", has the failure table).
"""

from __future__ import annotations

import collections
import logging
import os
import pickle
import signal
import socket
import subprocess
import sys
import threading
import time
import traceback
from multiprocessing.connection import Connection, wait

from atb_plugin.engine.config import EngineConfig
from atb_plugin.engine.executor.base import (
    DIST_TIMEOUT_S, STOP_WAIT_S, Execute, Executed, Executor, Failed, Initialize, Initialized, Load, Loaded,
    MalformedRankMessage, Propose, Proposed, RankMessage, Stop, decode_from_rank, decode_to_rank, encode_message,
    free_port, weights_per_rank)
from atb_plugin.engine.worker import Rank, RankPlacement

logger = logging.getLogger(__name__)

__all__ = ["MultiprocExecutor", "run_rank"]

_LOG_TAIL_LINES = 30
# Each call of the driver as the message a rank receives; the answer it expects back.
_ANSWERS = {"load": Loaded, "initialize": Initialized, "execute": Executed, "propose": Proposed}


class _RankProcess:
    """One rank process, its socket and the tail of its log (stderr, forwarded to ours)."""

    def __init__(self, rank: int, env: dict):
        ours, theirs = socket.socketpair()
        self.rank = rank
        self.process = subprocess.Popen(
            [sys.executable, "-m", "atb_plugin.engine.executor.multiproc", str(theirs.fileno()), str(rank)],
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

    def receive(self, expected: type, what: str):
        """The rank's answer, of type ``expected``; ``_RankFailure`` describing its traceback or a
        stray message instead; ``EOFError`` when its socket closed (the caller names the cause)."""
        try:
            message = decode_from_rank(self.conn.recv_bytes())
        except OSError:
            raise EOFError from None
        except MalformedRankMessage as error:
            raise _RankFailure(f"tensor-parallel rank {self.rank} {what}: {error}") from None
        if isinstance(message, Failed):
            raise _RankFailure(f"tensor-parallel rank {self.rank} {what}:\n{message.traceback}")
        if not isinstance(message, expected):
            raise _RankFailure(f"tensor-parallel rank {self.rank} {what}: it sent {type(message).__name__}, "
                               f"expected {expected.__name__}")
        return message

    def describe_failure(self, what: str) -> str:
        try:
            code = self.process.wait(timeout=2)
        except subprocess.TimeoutExpired:
            code = None
        status = "is still running" if code is None else (
            f"was killed by signal {-code}" if code < 0 else f"exited with code {code}")
        tail = "".join(self.tail).rstrip() or "(no output)"
        return f"tensor-parallel rank {self.rank} {what}; it {status}. Its log ends:\n{tail}"


class _RankFailure(Exception):
    """Why one rank failed (the driver's ``fail`` turns it into ``RankFailed``)."""


class MultiprocExecutor(Executor):
    """TP > 1: ``tensor_parallel_size`` rank processes; the core keeps scheduling."""

    # A rank that fails in a step exits (its traceback in its log): the core sees it die.
    step_failure = "died during a step"

    def __init__(self, config: EngineConfig):
        self.ranks: list[_RankProcess] = []
        super().__init__(config)

    def _start_ranks(self) -> None:
        env = dict(os.environ)
        # One node: the rendezvous and gloo's sockets stay on loopback (gloo otherwise binds the
        # interface the host name resolves to).
        env.setdefault("GLOO_SOCKET_IFNAME", "lo")
        env.setdefault("PYTHONPATH", os.pathsep.join(p for p in sys.path if p))
        self.init_method = f"tcp://127.0.0.1:{free_port()}"
        self.ranks = [_RankProcess(rank, env) for rank in range(self.config.tensor_parallel_size)]

    def _started(self) -> None:
        logger.info("tensor parallel: %d ranks (%s), weights per rank %s MiB", len(self.ranks), self.config.device,
                    weights_per_rank(self.weight_bytes))

    def _message(self, method: str, args: tuple) -> RankMessage:
        if method == "load":
            level = logging.getLogger().level or logging.INFO
            return Load(pickle.dumps(self.config), self.init_method, DIST_TIMEOUT_S, level)
        if method == "initialize":
            return Initialize(*args)
        if method == "propose":
            return Propose(*args)
        return Execute(pickle.dumps(args[0], protocol=pickle.HIGHEST_PROTOCOL))

    def _rpc(self, method: str, args: tuple, what: str, leader_only: bool) -> list:
        payload = encode_message(self._message(method, args))  # encoded once, the same bytes to every rank
        try:
            for rank in self.ranks:
                rank.conn.send_bytes(payload)
        except OSError:
            self._fail_with_first_dead(what)
        expected = _ANSWERS[method]
        if leader_only:
            return [self._leader_answer(expected, what)]
        answers: dict[int, object] = {}
        pending = {rank.conn: rank for rank in self.ranks}
        while pending:
            for conn in wait(list(pending)):
                rank = pending.pop(conn)
                try:
                    answers[rank.rank] = _unwrap(rank.receive(expected, what))
                except EOFError:
                    self.fail(rank.describe_failure(what))
                except _RankFailure as failure:
                    self.fail(str(failure))
        return [answers[r] for r in range(len(self.ranks))]

    def _leader_answer(self, expected: type, what: str):
        """Rank 0's answer, or any rank's end-of-file: a dead rank leaves the others waiting in a
        collective, so its death must be seen here, not after a timeout."""
        leader = self.ranks[0].conn
        if leader not in wait([rank.conn for rank in self.ranks]):
            self._fail_with_first_dead(what)
        try:
            return _unwrap(self.ranks[0].receive(expected, what))
        except EOFError:
            self._fail_with_first_dead(what)
        except _RankFailure as failure:
            self.fail(str(failure))

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
        self.fail(dead.describe_failure(what))

    def _stop_ranks(self, graceful: bool) -> None:
        stop = encode_message(Stop())
        for rank in self.ranks:
            try:
                rank.conn.send_bytes(stop) if graceful else rank.process.kill()
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


def _unwrap(message: RankMessage):
    """What an answer carries: the rank's ``WorkerInfo``, its decode mode, the step's result, a
    head's drafts."""
    if isinstance(message, Loaded):
        return message.info
    if isinstance(message, Initialized):
        return message.decode_capture
    if isinstance(message, Proposed):
        return message.drafts
    return pickle.loads(message.runner_output)


# -- the rank process ----------------------------------------------------------------------------

def _die_with_parent() -> None:
    """End this rank when the engine core (its parent) is gone, however it went: a daemon thread
    notices the rank being re-parented within half a second, whatever the main thread is doing.
    Not ``PR_SET_PDEATHSIG``: that fires when the *thread* that started the rank exits, which
    killed the ranks of an offline ``LLM`` built in a short-lived thread."""
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(0.5)
        try:  # stderr is a pipe to the core: it may be broken now
            print(f"the engine core (pid {parent}) is gone; rank pid {os.getpid()} exits", file=sys.stderr, flush=True)
        finally:
            os._exit(1)  # not sys.exit: the main thread may be inside a collective that never returns

    threading.Thread(target=watch, name="engine-core-watch", daemon=True).start()


def run_rank(fd: int, rank: int) -> None:
    """A rank process (``python -m atb_plugin.engine.executor.multiproc FD RANK``, started by the
    core's ``MultiprocExecutor`` with one end of a socket pair as ``FD``): on ``Load`` join the
    process group and load the shard, on ``Initialize`` allocate the KV cache, then run steps
    until told to stop or the core is gone."""
    _die_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the core decides when ranks stop
    conn = Connection(fd)
    try:
        session = _start(conn, rank)
    except BaseException:
        conn.send_bytes(encode_message(Failed(traceback.format_exc())))
        raise
    if session is None:  # stopped before it started (another rank failed)
        return
    try:
        while (call := _expect(conn, (Execute, Propose))) is not None:
            if isinstance(call, Propose):
                drafts = session.propose(call.request_ids, call.num_tokens, call.max_drafts)
                if rank == 0:
                    conn.send_bytes(encode_message(Proposed(drafts)))
                continue
            answer = session.answer(session.execute(pickle.loads(call.scheduler_output)))
            if answer is not None:
                conn.send_bytes(encode_message(Executed(pickle.dumps(answer, protocol=pickle.HIGHEST_PROTOCOL))))
    except EOFError:
        logger.error("the engine core is gone; rank %d exits", rank)
    except BaseException:
        logger.exception("rank %d failed", rank)
        sys.exit(1)
    finally:
        session.close()


def _start(conn: Connection, rank: int) -> Rank | None:
    """The two start-up stages, each answered; None when the core says stop instead."""
    load = _expect(conn, Load)
    if load is None:
        return None
    logging.basicConfig(level=load.log_level, format=f"%(asctime)s %(levelname)s [rank {rank}] %(message)s")
    config = pickle.loads(load.config)
    session = Rank(config, RankPlacement.on_one_node(rank, config.tensor_parallel_size), load.init_method,
                   load.timeout_s)
    conn.send_bytes(encode_message(Loaded(session.load())))
    initialize = _expect(conn, Initialize)
    if initialize is None:
        session.close()
        return None
    conn.send_bytes(encode_message(Initialized(session.initialize(initialize.num_blocks))))
    return session


def _expect(conn: Connection, kind: type | tuple[type, ...]):
    """The core's next message, which must be a ``kind`` (one of them); None when it is ``Stop``."""
    message = decode_to_rank(conn.recv_bytes())
    if isinstance(message, Stop):
        return None
    if not isinstance(message, kind):
        names = " or ".join(k.__name__ for k in (kind if isinstance(kind, tuple) else (kind,)))
        raise MalformedRankMessage(f"the rank expected {names} from the core, got {type(message).__name__}")
    return message


if __name__ == "__main__":
    # What crosses the channel is defined in other modules (base, the engine's), never in this
    # one, so running it as __main__ pickles nothing under that name.
    run_rank(int(sys.argv[1]), int(sys.argv[2]))
