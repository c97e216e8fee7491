"""``OffloadingConnector`` (vLLM's name; ``--kv-offloading-size`` is its shortcut): full prefix
blocks are copied to a host-memory LRU tier as soon as they are computed (write-through), and
through it to an optional disk tier; a later request whose prefix misses the device cache but
hits a tier loads those blocks into its new device blocks instead of recomputing them.
docs/kv-transfer.md, "OffloadingConnector", says why write-through and what each key does.

Extra config (``kv_connector_extra_config``): ``cpu_bytes_to_use`` (the host tier's bytes over all
ranks; vllm-ascend's key), ``disk_path`` (a directory: turns the disk tier on),
``disk_bytes_to_use`` (its bytes over all ranks; default: no limit). The role says which way
blocks go: a producer saves, a consumer loads, ``kv_both`` does both.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from atb_plugin.engine.block_pool import BlockHash
from atb_plugin.engine.kv_cache_manager import request_block_hashes
from atb_plugin.engine.kv_transfer.base import KVConnectorBase, KVConnectorMetadata, KVConnectorOutput, KVConnectorRole
from atb_plugin.engine.kv_transfer.config import KVTransferConfig
from atb_plugin.engine.kv_transfer.offloading.index import HostIndex, LRUIndex, compatibility_directory, scan
from atb_plugin.engine.kv_transfer.offloading.store import DiskStore, HostStore
from atb_plugin.engine.messages import KVTransferStats
from atb_plugin.engine.request import Request
from atb_plugin.utils import cdiv

EXTRA_KEYS = ("cpu_bytes_to_use", "disk_path", "disk_bytes_to_use")


@dataclass
class OffloadingMetadata(KVConnectorMetadata):
    """One step's work for every rank, in this order: loads before the forward (host slot ->
    device block, disk file -> device block), then after it saves (device block -> host slot),
    disk writes (a device block's rows -> its file, copied now, written in the background) and
    disk removals."""

    host_loads: list[tuple[int, int]] = field(default_factory=list)  # (slot, block id)
    disk_loads: list[tuple[BlockHash, int]] = field(default_factory=list)  # (hash, block id)
    host_saves: list[tuple[int, int]] = field(default_factory=list)  # (block id, slot)
    disk_writes: list[tuple[int, BlockHash]] = field(default_factory=list)  # (block id, hash)
    disk_removes: list[BlockHash] = field(default_factory=list)


def _positive_int(extra: dict, key: str) -> int:
    value = extra[key]
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"OffloadingConnector: kv_connector_extra_config.{key} = {value!r}: must be a positive "
                         "integer number of bytes")
    return value


class OffloadingConnector(KVConnectorBase):
    requires_prefix_caching = True  # blocks are named by their prefix-cache hash

    @classmethod
    def check_config(cls, config: KVTransferConfig) -> None:
        extra = config.kv_connector_extra_config
        unknown = sorted(set(extra) - set(EXTRA_KEYS))
        if unknown:
            raise ValueError(f"OffloadingConnector: unknown kv_connector_extra_config keys {unknown}; known: "
                             f"{', '.join(EXTRA_KEYS)}")
        if "cpu_bytes_to_use" not in extra:
            raise ValueError("OffloadingConnector: kv_connector_extra_config.cpu_bytes_to_use (the host tier's "
                             "bytes) is required (or give --kv-offloading-size GiB)")
        _positive_int(extra, "cpu_bytes_to_use")
        if "disk_bytes_to_use" in extra:
            _positive_int(extra, "disk_bytes_to_use")
            if "disk_path" not in extra:
                raise ValueError("OffloadingConnector: kv_connector_extra_config.disk_bytes_to_use needs disk_path")
        if "disk_path" in extra and (not isinstance(extra["disk_path"], str) or not extra["disk_path"]):
            raise ValueError(f"OffloadingConnector: kv_connector_extra_config.disk_path = {extra['disk_path']!r}: "
                             "must be a directory path")

    def __init__(self, config, role, context):
        super().__init__(config, role, context)
        extra = config.kv_connector_extra_config
        tp = context.tensor_parallel_size
        # Each tier's bytes are over all ranks: a block takes its bytes on every rank.
        block_bytes = context.kv_block_bytes * tp
        if block_bytes <= 0:
            raise ValueError("OffloadingConnector: this model keeps no KV cache to offload")
        self.num_slots = extra["cpu_bytes_to_use"] // block_bytes
        if self.num_slots < 1:
            raise ValueError(f"OffloadingConnector: kv_connector_extra_config.cpu_bytes_to_use = "
                             f"{extra['cpu_bytes_to_use']} holds no KV block; one takes {block_bytes} bytes")
        self.block_bytes = block_bytes
        self.directory = None
        if "disk_path" in extra:
            self.directory = compatibility_directory(extra["disk_path"], context.model, context.kv_block_layout,
                                                     context.block_size, tp)
        if role is KVConnectorRole.SCHEDULER:
            self._init_scheduler(extra)
        else:
            self.host = self.disk = None
            self._errors: set[int] = set()
            self._stats = KVTransferStats()

    # -- scheduler side ------------------------------------------------------------------------

    def _init_scheduler(self, extra: dict) -> None:
        self.host_index = HostIndex(self.num_slots)
        self.disk_index: LRUIndex | None = None
        self._pending = OffloadingMetadata()
        if self.directory is not None:
            capacity = extra["disk_bytes_to_use"] // self.block_bytes if "disk_bytes_to_use" in extra else None
            # Hash -> whether every rank's file of it is complete (only then is it offered).
            self.disk_index = LRUIndex(capacity)
            # A restarted engine finds the blocks an earlier one wrote (oldest first: LRU order).
            for block_hash in scan(self.directory, self.context.tensor_parallel_size):
                for evicted, _ in self.disk_index.add(block_hash, True):
                    self._pending.disk_removes.append(evicted)
        self._requests: dict[str, Request] = {}
        self._block_ids: dict[str, list[int]] = {}
        self._hashes: dict[str, list[BlockHash]] = {}
        # The loads planned for the next step, and the last step's loads and saves (block id ->
        # hash; hashes): what a failed load invalidates.
        self._planned_loads: dict[int, BlockHash] = {}
        self._step_loads: dict[int, BlockHash] = {}
        self._step_saves: list[BlockHash] = []

    def _hashes_of(self, request: Request, num_tokens: int) -> list[BlockHash]:
        hashes = request_block_hashes(request, self.context.block_size, num_tokens,
                                      self._hashes.get(request.request_id, []))
        if len(hashes) > len(self._hashes.get(request.request_id, ())):
            self._hashes[request.request_id] = hashes
        return hashes

    def _held(self, block_hash: BlockHash) -> bool:
        if block_hash in self.host_index:
            return True
        return self.disk_index is not None and self.disk_index.entries.get(block_hash, False)

    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        if not self.config.is_consumer:
            return 0, False
        size = self.context.block_size
        hashes = self._hashes_of(request, request.num_tokens - 1)  # never the last token
        found = 0
        for block_hash in hashes[num_computed_tokens // size:]:
            if not self._held(block_hash):
                break
            found += 1
        return found * size, False

    def update_state_after_alloc(self, request, block_ids, num_external_tokens):
        self._requests[request.request_id] = request
        if not num_external_tokens:
            return
        size = self.context.block_size
        local = request.num_computed_tokens - num_external_tokens
        hashes = self._hashes_of(request, request.num_computed_tokens)
        for index in range(local // size, cdiv(request.num_computed_tokens, size)):
            block_hash, block_id = hashes[index], block_ids[index]
            if block_hash in self.host_index:
                self._pending.host_loads.append((self.host_index.touch(block_hash), block_id))
            elif self._held(block_hash):  # on disk, every rank's file complete
                self.disk_index.touch(block_hash)
                self._pending.disk_loads.append((block_hash, block_id))
            else:
                raise RuntimeError(f"OffloadingConnector: request {request.request_id}'s block {index} was to come "
                                   "from a tier that does not hold it")
            self._planned_loads[block_id] = block_hash

    def build_connector_meta(self, scheduler_output) -> OffloadingMetadata:
        meta, self._pending = self._pending, OffloadingMetadata()
        for request_id in scheduler_output.preempted_request_ids:
            self._block_ids.pop(request_id, None)
        new = {request.request_id for request in scheduler_output.new_requests}
        for request_id, num_tokens in scheduler_output.num_scheduled_tokens.items():
            added = scheduler_output.new_block_ids.get(request_id, [])
            if request_id in new:
                self._block_ids[request_id] = list(added)
            else:
                self._block_ids.setdefault(request_id, []).extend(added)
            if self.config.is_producer:
                self._plan_saves(request_id, scheduler_output.computed_tokens[request_id], num_tokens, meta)
        self._step_loads, self._planned_loads = self._planned_loads, {}
        return meta

    def _plan_saves(self, request_id: str, start: int, num_tokens: int, meta: OffloadingMetadata) -> None:
        """Write-through: every full block of known tokens this step computes goes to each tier
        that lacks it; to the host tier at most its size per step (a slot is never saved twice
        in one step: the step's first blocks win, a prefix is only useful from its start)."""
        request = self._requests.get(request_id)
        if request is None:
            return
        size = self.context.block_size
        end = min(start + num_tokens, request.num_tokens)
        if end // size <= start // size:
            return
        hashes = self._hashes_of(request, end)
        block_ids = self._block_ids[request_id]
        for index in range(start // size, end // size):
            block_hash, block_id = hashes[index], block_ids[index]
            if block_hash in self.host_index:
                self.host_index.touch(block_hash)
            elif len(meta.host_saves) < self.num_slots:
                meta.host_saves.append((block_id, self.host_index.insert(block_hash)))
                self._step_saves.append(block_hash)
            if self.disk_index is None:
                continue
            if block_hash in self.disk_index:
                self.disk_index.touch(block_hash)
                continue
            for evicted, _ in self.disk_index.add(block_hash, False):  # offered once written
                meta.disk_removes.append(evicted)
            meta.disk_writes.append((block_id, block_hash))
            self._step_saves.append(block_hash)

    def update_connector_output(self, output: KVConnectorOutput) -> None:
        saves, self._step_saves = self._step_saves, []
        if self.disk_index is not None:
            for block_hash in output.stored_block_hashes:
                if block_hash in self.disk_index:
                    self.disk_index.entries[block_hash] = True
        if not output.invalid_block_ids:
            return
        # A block that failed to load is in no tier any more (a rank lacks it, or its file was
        # corrupt); the step's saves may have been computed from garbage: forgotten too.
        dropped = [self._step_loads[b] for b in output.invalid_block_ids if b in self._step_loads]
        for block_hash in dropped + saves:
            self.host_index.pop(block_hash)
            if self.disk_index is not None and block_hash in self.disk_index:
                self.disk_index.pop(block_hash)
                self._pending.disk_removes.append(block_hash)

    def request_finished(self, request, block_ids):
        self._requests.pop(request.request_id, None)
        self._block_ids.pop(request.request_id, None)
        self._hashes.pop(request.request_id, None)
        return False, None

    def get_stats(self):
        if self.role is not KVConnectorRole.SCHEDULER:
            stats, self._stats = self._stats, KVTransferStats()
            return stats
        tiers = {"cpu": len(self.host_index) * self.block_bytes}
        if self.disk_index is not None:
            tiers["disk"] = len(self.disk_index) * self.block_bytes
        return KVTransferStats(tier_bytes=tiers)

    # -- worker side ---------------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: list) -> None:
        self.host = HostStore(kv_caches, self.num_slots)
        if self.directory is not None:
            self.disk = DiskStore(self.directory, self.context.tensor_parallel_rank, kv_caches)

    def start_load_kv(self) -> None:
        meta: OffloadingMetadata = self.metadata
        if meta is None or not (meta.host_loads or meta.disk_loads):
            return
        began = time.perf_counter()
        if meta.host_loads:
            self.host.load([slot for slot, _ in meta.host_loads], [block for _, block in meta.host_loads])
        loaded = len(meta.host_loads)
        for block_hash, block_id in meta.disk_loads:
            if self.disk.read_into(block_hash, block_id):
                loaded += 1
            else:
                self._errors.add(block_id)
        shard = self.context.kv_block_bytes
        self._stats = self._stats.merged(KVTransferStats(num_loads=loaded, bytes_loaded=loaded * shard,
                                                         load_seconds=time.perf_counter() - began))

    def wait_for_save(self) -> None:
        meta: OffloadingMetadata = self.metadata
        if meta is None or not (meta.host_saves or meta.disk_writes or meta.disk_removes):
            return
        began = time.perf_counter()
        if meta.host_saves:
            self.host.save([block for block, _ in meta.host_saves], [slot for _, slot in meta.host_saves])
        for block_id, block_hash in meta.disk_writes:
            self.disk.write(block_hash, self.host.rows(block_id))  # the file is written off the step's path
        for block_hash in meta.disk_removes:
            self.disk.remove(block_hash)
        saved = len(meta.host_saves)
        self._stats = self._stats.merged(KVTransferStats(num_saves=saved, bytes_saved=saved * self.context.kv_block_bytes,
                                                         save_seconds=time.perf_counter() - began))

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors, self._errors = self._errors, set()
        return errors

    def get_stored_block_hashes(self) -> set[bytes]:
        return self.disk.written() if self.disk is not None else set()

    def shutdown(self) -> None:
        if getattr(self, "disk", None) is not None:
            self.disk.close()
