"""Data parallelism: several engine cores behind one frontend, and which one takes a request.

``DPClient`` holds one ``MPClient`` per engine (``--data-parallel-size N``; engine i runs with
``EngineConfig.for_data_parallel_rank(i)``: its own TP ranks, devices and CPU cores) and offers
the frontend the same interface as one ``MPClient``. ``make_client`` picks one or the other.

Routing (``CacheAwareRouting``, the default; rule and thresholds in docs/architecture.md, "Data
parallelism"): a request goes back to the engine that most recently took the longest prefix of
its prompt, in whole KV blocks — the engine whose prefix cache most likely still holds it —
when that prefix is more than half the prompt, unless that engine has more than
``affinity_slack`` requests in flight beyond the least-loaded one; otherwise, and for a prompt seen nowhere, to the least-loaded engine (requests in flight as
this client counts them, which is current, unlike the cores' stats from their last step; ties by
KV-cache usage, then by the fewest requests taken so far, so idle traffic spreads too). ``RoundRobinRouting`` is the baseline the benchmark compares.

A dying engine ends the service, as one engine's death does today: ``on_death`` is called with
its exit code and the other engines are stopped by the frontend's shutdown.
"""

from __future__ import annotations

import asyncio
import itertools
from collections import OrderedDict
from collections.abc import Callable
from typing import Protocol

from atb_plugin.engine.client import MPClient
from atb_plugin.engine.config import EngineConfig
from atb_plugin.engine.messages import EngineCoreOutputs, EngineCoreRequest

__all__ = ["CacheAwareRouting", "DPClient", "ROUTINGS", "RoundRobinRouting", "make_client"]

#: Prompt blocks the affinity index hashes per request: the first 64 blocks identify a
#: conversation; hashing all of a very long prompt would cost more than it tells.
MAX_INDEXED_BLOCKS = 64
#: The share of a prompt its cached prefix must exceed to pull it to that prefix's engine: a
#: conversation's next turn (most of it is the previous turns) goes back; a new prompt that
#: shares only a system prompt with earlier ones is placed by load (SGLang's router has the
#: same kind of threshold).
AFFINITY_MIN_SHARE = 0.5


class Routing(Protocol):
    def choose(self, request: EngineCoreRequest, in_flight: list[int], kv_usage: list[float]) -> int: ...


class RoundRobinRouting:
    """Engines in turn, blind to load and to prefixes."""

    def __init__(self, engines: int, block_size: int):
        self._next = itertools.cycle(range(engines))

    def choose(self, request: EngineCoreRequest, in_flight: list[int], kv_usage: list[float]) -> int:
        return next(self._next)


class CacheAwareRouting:
    """Prefix affinity bounded by load (module docstring). ``capacity``: block hashes remembered
    (least recently routed forgotten first)."""

    def __init__(self, engines: int, block_size: int, affinity_slack: int = 8, capacity: int = 1 << 18):
        if affinity_slack < 0:
            raise ValueError(f"affinity_slack must be >= 0, got {affinity_slack}")
        self.engines, self.block_size, self.affinity_slack, self.capacity = engines, block_size, affinity_slack, capacity
        self._owner: OrderedDict[int, int] = OrderedDict()  # block-chain hash -> engine that last took it
        self._taken = [0] * engines  # requests each engine took: the last tie-break spreads idle traffic

    def _chain(self, token_ids: list[int]) -> list[int]:
        """One hash per whole block, each covering every block before it (as the prefix cache's)."""
        hashes, previous = [], 0
        size = self.block_size
        for start in range(0, min(len(token_ids) // size, MAX_INDEXED_BLOCKS) * size, size):
            previous = hash((previous, tuple(token_ids[start:start + size])))
            hashes.append(previous)
        return hashes

    def choose(self, request: EngineCoreRequest, in_flight: list[int], kv_usage: list[float]) -> int:
        chain = self._chain(request.prompt_token_ids)
        least = min(range(self.engines), key=lambda i: (in_flight[i], kv_usage[i], self._taken[i], i))
        chosen = least
        for depth in range(len(chain), 0, -1):  # the longest prefix some engine took
            owner = self._owner.get(chain[depth - 1])
            if owner is not None:
                # Only a prefix that is most of the prompt binds it (a conversation's earlier turns,
                # not just a system prompt it shares with everything), and only within the slack.
                if depth * self.block_size > AFFINITY_MIN_SHARE * len(request.prompt_token_ids) \
                        and in_flight[owner] <= in_flight[least] + self.affinity_slack:
                    chosen = owner
                break
        for block_hash in chain:
            self._owner[block_hash] = chosen
            self._owner.move_to_end(block_hash)
        while len(self._owner) > self.capacity:
            self._owner.popitem(last=False)
        self._taken[chosen] += 1
        return chosen


ROUTINGS = {"cache-aware": CacheAwareRouting, "round-robin": RoundRobinRouting}


class DPClient:
    """N engine cores as one client (module docstring). ``on_outputs(outputs, engine)``."""

    def __init__(self, config: EngineConfig, on_outputs: Callable[[EngineCoreOutputs, int], None],
                 on_death: Callable[[int | None], None], routing: str = "cache-aware"):
        if routing not in ROUTINGS:
            raise ValueError(f"data-parallel routing {routing!r}: expected one of {', '.join(ROUTINGS)}")
        self.config = config
        size = config.data_parallel_size
        self.engines = [MPClient(config.for_data_parallel_rank(i), on_outputs=self._receiver(i), on_death=on_death)
                        for i in range(size)]
        self.routing = ROUTINGS[routing](size, config.block_size)
        self._on_outputs = on_outputs
        self._owner: dict[str, int] = {}  # request id -> its engine, until it finishes or is aborted
        self._kv_usage = [0.0] * size

    def _receiver(self, index: int) -> Callable[[EngineCoreOutputs], None]:
        def receive(outputs: EngineCoreOutputs) -> None:
            if outputs.stats is not None:
                self._kv_usage[index] = outputs.stats.kv_cache_usage
            for out in outputs.outputs:
                if out.finished:
                    self._owner.pop(out.request_id, None)
            self._on_outputs(outputs, index)

        return receive

    async def start(self, timeout_s: float = 600.0) -> None:
        """Every engine, concurrently; the first failure is raised once all have finished starting
        (so that shutdown never races a half-started one)."""
        results = await asyncio.gather(*(engine.start(timeout_s) for engine in self.engines), return_exceptions=True)
        for result in results:
            if isinstance(result, BaseException):
                raise result

    @property
    def alive(self) -> bool:
        return all(engine.alive for engine in self.engines)

    @property
    def max_tokens_per_request(self) -> int:
        return min(engine.max_tokens_per_request for engine in self.engines)

    @property
    def info(self) -> dict:
        """What every engine can do (the smallest of each figure the engines reported)."""
        return {key: min(engine.info[key] for engine in self.engines) for key in self.engines[0].info}

    @property
    def in_flight(self) -> list[int]:
        """Requests each engine holds, as this client counts them (at most --max-queued-requests)."""
        counts = [0] * len(self.engines)
        for index in self._owner.values():
            counts[index] += 1
        return counts

    def add_request(self, request: EngineCoreRequest) -> None:
        index = self.routing.choose(request, self.in_flight, self._kv_usage)
        self.engines[index].add_request(request)
        self._owner[request.request_id] = index

    def abort(self, request_ids: list[str]) -> None:
        by_engine: dict[int, list[str]] = {}
        for request_id in request_ids:
            index = self._owner.pop(request_id, None)
            if index is not None:
                by_engine.setdefault(index, []).append(request_id)
        for index, ids in by_engine.items():
            self.engines[index].abort(ids)

    async def shutdown(self, timeout_s: float = 10.0) -> None:
        await asyncio.gather(*(engine.shutdown(timeout_s) for engine in self.engines))


def make_client(config: EngineConfig, on_outputs: Callable[[EngineCoreOutputs, int], None],
                on_death: Callable[[int | None], None], routing: str = "cache-aware") -> MPClient | DPClient:
    """The frontend's client: one engine-core process, or ``data_parallel_size`` of them."""
    if config.data_parallel_size == 1:
        return MPClient(config, on_outputs=lambda outputs: on_outputs(outputs, 0), on_death=on_death)
    return DPClient(config, on_outputs, on_death, routing)
