"""The executor driver every backend shares: how the engine core reaches its model's ranks.

    EngineCore ── SchedulerOutput ──► Executor.execute ──► RunnerOutput (sampled ids, pooled, ...)

A backend says where the ranks live and how a call reaches them; this driver says what is called
and what a failure means (docs/architecture.md, "Tensor parallelism"):

- **start**, in two stages called on every rank (``collective_rpc``): ``load`` (each rank loads
  its shard and reports the KV blocks its budget holds), then ``initialize`` with the smallest
  of those counts, so every rank holds the same cache;
- **steps**: ``execute`` on every rank, rank 0's answer back (every rank runs the same step);
  likewise ``propose`` where a speculative head drafts on the ranks (TP > 1). With a KV
  connector every rank answers (the others only their ``kv_connector_output``: each moves its
  own shard), merged into rank 0's by a ``KVOutputAggregator``;
- **failure**: a rank that dies or raises ends the executor: ``fail`` records why, stops every
  rank at once (the survivors wait in a collective that never ends) and raises ``RankFailed``;
  every later call raises at once with the first cause (the latch), which the core treats as its
  own death;
- **shutdown**, once, whoever asks first.

The backends (``uniproc``, ``multiproc``, ``ray``) import this module and nothing else of this
package; ``atb_plugin.engine.executor.make_executor`` picks one. The messages of the ``mp`` rank
channel are defined here too, once, for both of its ends.
"""

from __future__ import annotations

import logging
import socket
from abc import ABC, abstractmethod
from typing import NoReturn, Union

import msgspec

from atb_plugin.engine.config import EngineConfig
from atb_plugin.engine.kv_transfer.base import KVOutputAggregator
from atb_plugin.engine.model_runner import ModelRunner, RunnerOutput
from atb_plugin.engine.scheduler import SchedulerOutput
from atb_plugin.engine.worker import WorkerInfo

logger = logging.getLogger(__name__)

__all__ = ["DIST_TIMEOUT_S", "STOP_WAIT_S", "Executor", "MalformedRankMessage", "RankFailed", "free_port"]

# How long ranks may take to join the process group, and to stop when asked.
DIST_TIMEOUT_S = 120.0
STOP_WAIT_S = 5.0
# What a rank that fails in each start-up stage is said to have failed at.
LOAD_FAILED = "failed to load its shard"
INITIALIZE_FAILED = "failed to allocate its KV cache"


class RankFailed(RuntimeError):
    """A tensor-parallel rank died or failed: the engine cannot go on."""


class Executor(ABC):
    """``kv_cache_blocks``: blocks every rank holds (the null block included); ``decode_capture``:
    how decode steps run; ``weight_bytes``: each rank's weight bytes; ``runner``: the model runner
    when it runs in this process, else None; ``execute`` one step; ``shutdown`` stops whatever it
    started (idempotent).

    A backend implements ``_start_ranks`` (start the ranks, no model yet), ``_rpc`` (one call on
    every rank, ``fail`` naming the rank when one fails) and ``_stop_ranks``."""

    runner: ModelRunner | None = None  # set where the model runs in this process
    # How a rank that fails during a step is described (a backend whose ranks exit on any step
    # failure sees only their deaths).
    step_failure = "failed during a step"

    def __init__(self, config: EngineConfig):
        self.config = config
        self._closed = False
        self._kv_outputs = (KVOutputAggregator(config.tensor_parallel_size)
                            if config.kv_transfer_config is not None else None)
        self._failure: str | None = None  # why the ranks were stopped, once one failed
        try:
            self._start_ranks()
            infos: list[WorkerInfo] = self.collective_rpc("load", what=LOAD_FAILED)
            self.kv_cache_blocks = min(info.available_kv_blocks for info in infos)
            self.weight_bytes = [info.weight_bytes for info in infos]
            # One block of a rank's KV shard (for a KV connector's scheduler side).
            self.kv_block_bytes, self.kv_block_layout = infos[0].kv_block_bytes, infos[0].kv_block_layout
            self.decode_capture = self.collective_rpc("initialize", self.kv_cache_blocks, what=INITIALIZE_FAILED)[0]
        except BaseException:
            self.shutdown()  # after a rank failed (RankFailed) the ranks are stopped already
            raise
        self._started()

    def collective_rpc(self, method: str, *args, what: str, leader_only: bool = False) -> list:
        """``method(*args)`` on every rank (the methods of ``worker.Rank``: ``load``,
        ``initialize``, ``execute``, ``propose``), the answers in rank order; only rank 0's when
        ``leader_only`` (every rank computes the same). ``what``: how a rank failing in this
        call is described in ``RankFailed``."""
        if self._failure is not None:  # not the ranks this executor stopped itself: the first cause
            raise RankFailed(f"the engine already failed: {self._failure}")
        return self._rpc(method, args, what, leader_only)

    def execute(self, output: SchedulerOutput) -> RunnerOutput:
        if self._kv_outputs is None:
            return self.collective_rpc("execute", output, what=self.step_failure, leader_only=True)[0]
        results = self.collective_rpc("execute", output, what=self.step_failure)
        results[0].kv_connector_output = self._kv_outputs.aggregate([r.kv_connector_output for r in results])
        return results[0]

    def propose(self, request_ids: list[str], num_tokens: list[int], max_drafts: list[int]) -> list[list[int]]:
        """A head's drafts, made on every rank (``Rank.propose``), rank 0's back (TP > 1)."""
        return self.collective_rpc("propose", request_ids, num_tokens, max_drafts, what=self.step_failure,
                                   leader_only=True)[0]

    @property
    def failed(self) -> bool:
        return self._failure is not None

    def fail(self, why: str) -> NoReturn:
        """A rank failed: latch ``why``, stop every rank now (asking would wait on ranks left in a
        collective that never ends), raise ``RankFailed``."""
        self._failure = why
        self.shutdown(graceful=False)
        raise RankFailed(why)

    def shutdown(self, graceful: bool = True) -> None:
        """Stop the ranks: asked to (they leave the process group), killed after ``STOP_WAIT_S``;
        at once when not ``graceful``. Only the first call does anything."""
        if self._closed:
            return
        self._closed = True
        self._stop_ranks(graceful)

    @abstractmethod
    def _start_ranks(self) -> None: ...

    @abstractmethod
    def _rpc(self, method: str, args: tuple, what: str, leader_only: bool) -> list: ...

    @abstractmethod
    def _stop_ranks(self, graceful: bool) -> None: ...

    def _started(self) -> None:
        """Log what started (a backend with ranks says where they are)."""


def free_port(address: str = "127.0.0.1") -> int:
    """A TCP port free on ``address`` now (for a process group's rendezvous)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind((address, 0))
        return probe.getsockname()[1]


def weights_per_rank(weight_bytes: list[int]) -> str:
    return ", ".join(f"{b / 2**20:.1f}" for b in weight_bytes)


# -- the rank channel ----------------------------------------------------------------------------
#
# What crosses the byte channel between the core and a rank process (``multiproc``): one typed
# message per driver call and per answer, MessagePack-encoded, so each end knows what it holds and
# a stray or garbled message fails loudly, naming itself. The config, the scheduler output and the
# runner's result travel pickled inside their message: they hold the core's own Python objects
# (requests with their generators, tensors), which only pickle carries whole, and the step is
# pickled once for every rank.


class RankMessage(msgspec.Struct, tag=True, frozen=True, forbid_unknown_fields=True):
    """A message of the rank channel (tagged with its class name)."""


class Load(RankMessage):
    """Core → rank: join the process group (rendezvous ``init_method``, ``timeout_s``), load the
    shard; answered with ``Loaded``."""

    config: bytes  # the pickled EngineConfig
    init_method: str
    timeout_s: float
    log_level: int


class Initialize(RankMessage):
    """Core → rank: allocate ``num_blocks`` KV blocks and the runner; answered with ``Initialized``."""

    num_blocks: int


class Execute(RankMessage):
    """Core → rank: run one step; rank 0 answers with ``Executed``."""

    scheduler_output: bytes  # the pickled SchedulerOutput


class Propose(RankMessage):
    """Core → rank: a head's drafts for these requests (the rank reads their tokens from its
    mirror; ``num_tokens`` checks it); rank 0 answers with ``Proposed``."""

    request_ids: list[str]
    num_tokens: list[int]
    max_drafts: list[int]


class Stop(RankMessage):
    """Core → rank: leave the process group and exit."""


class Loaded(RankMessage):
    info: WorkerInfo


class Initialized(RankMessage):
    decode_capture: str


class Executed(RankMessage):
    runner_output: bytes  # the pickled RunnerOutput


class Proposed(RankMessage):
    drafts: list[list[int]]


class Failed(RankMessage):
    """Rank → core: a start-up stage raised; the rank exits."""

    traceback: str


ToRank = Union[Load, Initialize, Execute, Propose, Stop]
FromRank = Union[Loaded, Initialized, Executed, Proposed, Failed]


class MalformedRankMessage(ValueError):
    """Bytes on the rank channel that are no message of that direction."""


_encoder = msgspec.msgpack.Encoder()
_decoders = {"to a rank": msgspec.msgpack.Decoder(ToRank), "from a rank": msgspec.msgpack.Decoder(FromRank)}


def encode_message(message: RankMessage) -> bytes:
    return _encoder.encode(message)


def decode_to_rank(data: bytes) -> Load | Initialize | Execute | Propose | Stop:
    return _decode(data, "to a rank")


def decode_from_rank(data: bytes) -> Loaded | Initialized | Executed | Proposed | Failed:
    return _decode(data, "from a rank")


def _decode(data: bytes, direction: str):
    try:
        return _decoders[direction].decode(data)
    except msgspec.MsgspecError as error:
        raise MalformedRankMessage(f"a malformed rank-channel message {direction} ({len(data)} bytes): "
                                   f"{error}") from None
