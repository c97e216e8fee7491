"""``KVConnectorBase``: the one interface every KV connector implements (vLLM's
``KVConnectorBase_V1``, written for this engine). docs/kv-transfer.md has the request states and
who frees what when.

A connector is built twice from one ``KVTransferConfig``: once with ``KVConnectorRole.SCHEDULER``
in the engine core (it decides which of a request's prompt tokens come from outside and which
blocks outlive their request), and once with ``KVConnectorRole.WORKER`` in every model runner
(each tensor-parallel rank holds its own shard of the KV and moves its own bytes). The two halves
talk only through the per-step ``KVConnectorMetadata`` (scheduler → workers, inside the
``SchedulerOutput``) and ``KVConnectorOutput`` (workers → scheduler, inside the ``RunnerOutput``)::

    scheduler side (engine core)                          worker side (each rank's runner)
    ─────────────────────────────                         ────────────────────────────────
    get_num_new_matched_tokens(request, n_local)          register_kv_caches(kv_caches)  (once)
    update_state_after_alloc(request, block_ids, n_ext)
    build_connector_meta(scheduler_output) ── metadata ─► bind_connector_metadata(metadata)
                                                          start_load_kv()       before the forward
                                                          [wait_for_layer_load(i) / save_kv_layer(i)]
                                                          wait_for_save()       after the forward
    update_connector_output(output) ◄── KVConnectorOutput ─ get_finished(finished_ids),
                                                          get_block_ids_with_load_errors()
    request_finished(request, block_ids)
        -> (free blocks later?, kv_transfer_params for the client)

Both halves live in one object class (as vLLM's do); a method of the other role is never called.
"""

from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from collections import Counter
from dataclasses import dataclass, field

from atb_plugin.engine.kv_transfer.config import KVTransferConfig
from atb_plugin.engine.messages import KVTransferStats
from atb_plugin.engine.request import Request


# A step that runs no model row while KV transfers are in flight (a request waiting for its
# asynchronous load, blocks a producer still sends) waits this long before the next poll of the
# workers, rather than spinning.
KV_TRANSFER_POLL_S = 0.005


class KVConnectorRole(enum.Enum):
    SCHEDULER = "scheduler"
    WORKER = "worker"


@dataclass(frozen=True)
class ConnectorContext:
    """What a connector learns of the engine it serves. ``num_kv_blocks``: the device KV blocks
    (null block included) each rank holds; ``tensor_parallel_rank`` is 0 on the scheduler side;
    ``kv_block_bytes`` / ``kv_block_layout``: one block of one rank's shard, its bytes and its
    layout (``kv_block_layout``: what makes two engines' blocks interchangeable)."""

    model: str
    block_size: int
    num_kv_blocks: int
    tensor_parallel_size: int = 1
    tensor_parallel_rank: int = 0
    data_parallel_rank: int = 0
    kv_block_bytes: int = 0
    kv_block_layout: str = ""


def kv_block_layout(kv_caches: list) -> tuple[int, str]:
    """``(bytes, layout)`` of one block of these KV caches (``register_kv_caches``' form: per
    layer a tuple of tensors, or one tensor, block id first): the layout names every layer's
    tensors' dtype and per-block shape."""
    nbytes, parts = 0, []
    for layer in kv_caches:
        for tensor in layer if isinstance(layer, (tuple, list)) else (layer,):
            nbytes += tensor[0].numel() * tensor.element_size()
            parts.append(f"{str(tensor.dtype).removeprefix('torch.')}{list(tensor.shape[1:])}")
    return nbytes, ";".join(parts)


@dataclass
class KVConnectorMetadata:
    """One step's instructions from the scheduler side to the worker side (which blocks to
    load from where, which to save). Each connector subclasses it; it is pickled inside the
    ``SchedulerOutput`` to every rank, so it holds plain data only."""


@dataclass
class KVConnectorOutput:
    """What the worker side reports after a step. ``finished_sending``: requests whose blocks the
    connector no longer reads (their delayed free may happen now); ``finished_recving``:
    requests whose asynchronous load completed; ``invalid_block_ids``: device blocks whose load
    failed (their contents are garbage: the scheduler must neither use nor cache them);
    ``stored_block_hashes``: blocks (by prefix-cache hash) whose asynchronous save completed (a
    tier may offer them from now on). Under tensor parallelism the executor merges every rank's
    output: a request is finished, a block stored, only once every rank says so, and invalid
    blocks are the union."""

    finished_sending: set[str] = field(default_factory=set)
    finished_recving: set[str] = field(default_factory=set)
    invalid_block_ids: set[int] = field(default_factory=set)
    stored_block_hashes: set[bytes] = field(default_factory=set)
    # The worker side's transfers since its previous report (``get_stats`` of the worker role):
    # counters, and its tiers' bytes now; summed over ranks (each rank holds its own shard).
    stats: KVTransferStats | None = None

    def is_empty(self) -> bool:
        return not (self.finished_sending or self.finished_recving or self.invalid_block_ids
                    or self.stored_block_hashes)


class KVOutputAggregator:
    """Merges the ranks' ``KVConnectorOutput`` of each step into one (tensor parallelism). Ranks
    may finish a transfer in different steps, so finishes are counted across steps: a request is
    reported finished (sending / receiving), a block stored, in the step its last rank reports
    it. Invalid blocks are the union of the step's (one rank's garbage is the request's garbage);
    stats are summed."""

    def __init__(self, world_size: int):
        self.world_size = world_size
        self._sending: Counter[str] = Counter()
        self._recving: Counter[str] = Counter()
        self._stored: Counter[bytes] = Counter()

    def aggregate(self, outputs: list[KVConnectorOutput | None]) -> KVConnectorOutput:
        merged = KVConnectorOutput()
        for output in outputs:
            if output is None:
                continue
            merged.invalid_block_ids |= output.invalid_block_ids
            self._sending.update(output.finished_sending)
            self._recving.update(output.finished_recving)
            self._stored.update(output.stored_block_hashes)
            if output.stats is not None:
                merged.stats = output.stats if merged.stats is None else merged.stats.merged(output.stats, sum_gauges=True)
        for counts, done in ((self._sending, merged.finished_sending), (self._recving, merged.finished_recving),
                             (self._stored, merged.stored_block_hashes)):
            for request_id in [r for r, n in counts.items() if n >= self.world_size]:
                done.add(request_id)
                del counts[request_id]
        return merged


class KVConnectorBase(ABC):
    """Subclass, implement the abstract methods of both roles, and register the class
    (``factory.register_connector``). The defaults of the optional hooks do nothing."""

    # The device prefix cache must be on (a connector that names blocks by their prefix hash).
    requires_prefix_caching = False

    @classmethod
    def needs_prefix_caching(cls, config: KVTransferConfig) -> bool:
        """Whether this config needs the device prefix cache (``requires_prefix_caching``; a
        connector stacking others asks them)."""
        return cls.requires_prefix_caching

    @classmethod
    def check_config(cls, config: KVTransferConfig) -> None:
        """Validate ``config.kv_connector_extra_config`` (and the role) at start-up, before any
        model loads: ``ValueError`` naming the bad key. Also called when the connector is built."""

    def __init__(self, config: KVTransferConfig, role: KVConnectorRole, context: ConnectorContext):
        self.check_config(config)
        self.config = config
        self.role = role
        self.context = context
        self._metadata: KVConnectorMetadata | None = None

    # -- scheduler side ------------------------------------------------------------------------

    @abstractmethod
    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        """How many of ``request``'s tokens after its first ``num_computed_tokens`` (those the
        device prefix cache already holds) this connector can deliver, and whether the load is
        asynchronous (the request waits, holding its blocks, until ``finished_recving`` names
        it) rather than done in the step's ``start_load_kv``. ``None``: not known yet, ask again
        next step. Never counts the request's last token: its logits must be computed here."""

    @abstractmethod
    def update_state_after_alloc(self, request: Request, block_ids: list[int], num_external_tokens: int) -> None:
        """The scheduler allocated ``block_ids`` (all the request's blocks, local hits first) and
        will count ``num_external_tokens`` tokens after the local hits as computed: record which
        blocks the connector must fill."""

    @abstractmethod
    def build_connector_meta(self, scheduler_output) -> KVConnectorMetadata:
        """This step's metadata for the worker side (called once per step after scheduling);
        resets the per-step state it was built from."""

    def update_connector_output(self, output: KVConnectorOutput) -> None:
        """The workers' report of the step (merged over ranks)."""

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict | None]:
        """``request`` finished (any reason). Returns whether its blocks must stay allocated
        until ``finished_sending`` names it (a producer whose consumer has not pulled yet), and
        the ``kv_transfer_params`` to hand back with the request's final output (None: none)."""
        return False, None

    def get_stats(self) -> KVTransferStats | dict | None:
        """Counters since the previous call and gauges now (bytes moved, seconds, tier
        occupancy) as a ``KVTransferStats`` or a dict of its fields, or None: nothing to report.
        Both roles: the worker side's ride in ``KVConnectorOutput.stats`` (the runner asks after
        each step), the scheduler side's are added to them in the scheduler's stats."""
        return None

    # -- worker side ---------------------------------------------------------------------------

    @property
    def name(self) -> str:
        return self.config.kv_connector

    def register_kv_caches(self, kv_caches: list) -> None:
        """This rank's KV cache tensors, one entry per layer (as the model made them: a
        ``(key, value)`` pair of ``(num_blocks, block_size, kv_heads, head_dim)`` tensors, or
        one latent tensor for MLA), once, before the first step."""

    def bind_connector_metadata(self, metadata: KVConnectorMetadata | None) -> None:
        self._metadata = metadata

    def clear_connector_metadata(self) -> None:
        self._metadata = None

    @property
    def metadata(self) -> KVConnectorMetadata | None:
        return self._metadata

    @abstractmethod
    def start_load_kv(self) -> None:
        """Start (or, for a synchronous connector, do) the loads the bound metadata names,
        before the step's forward reads those blocks."""

    def wait_for_layer_load(self, layer_index: int) -> None:
        """Block until layer ``layer_index``'s loads are in (a layer-wise connector)."""

    def save_kv_layer(self, layer_index: int) -> None:
        """Layer ``layer_index``'s KV of this step is written: start saving it (layer-wise)."""

    @abstractmethod
    def wait_for_save(self) -> None:
        """After the forward: every save this step started is done (or safely in flight: its
        blocks stay allocated until ``finished_sending``)."""

    def get_finished(self, finished_request_ids: set[str]) -> tuple[set[str], set[str]]:
        """(finished sending, finished receiving) request ids since the previous call;
        ``finished_request_ids`` are the requests the scheduler finished since the previous step."""
        return set(), set()

    def get_block_ids_with_load_errors(self) -> set[int]:
        """Device blocks whose load failed since the previous call."""
        return set()

    def get_stored_block_hashes(self) -> set[bytes]:
        """Blocks (prefix-cache hashes) whose asynchronous save completed since the previous
        call (a disk tier's background writes): reported so the scheduler side offers a block
        only once every rank holds it."""
        return set()

    def shutdown(self) -> None:
        """Release what the connector holds (threads, registered memory, files, ports)."""
