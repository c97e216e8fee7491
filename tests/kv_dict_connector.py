"""A KV connector for the seam's tests (registered as "DictConnector" by importing this module:
``kv_connector_module_path="tests.kv_dict_connector"``). It delivers KV blocks from an
in-process dict, keyed by the prefix-cache block hash, that a test fills from a reference run
(``capture``). Extra config: ``store`` (the dict's name), ``fail_loads`` (report every block it
loads as failed, after writing zeros into it: garbage), ``delay_free_steps`` (keep a finished
request's blocks that many steps, as a producer waiting for its consumer, and hand back
``kv_transfer_params``), ``not_ready_steps`` (answer None that many times first),
``load_async_steps`` (load asynchronously: the copies happen, and finished_recving names the
request, that many steps after the load was asked for)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from atb_plugin.engine.kv_cache_manager import request_block_hashes
from atb_plugin.engine.kv_transfer.base import KVConnectorBase, KVConnectorMetadata
from atb_plugin.engine.kv_transfer.factory import register_connector

STORES: dict[str, dict[bytes, list[tuple[torch.Tensor, ...]]]] = {}
# What the worker sides did, for the tests to read: store name -> counters.
EVENTS: dict[str, dict[str, int]] = {}


def capture(store: str, kv_caches, block_ids: list[int], hashes: list[bytes]) -> None:
    """Copy blocks ``block_ids`` of an engine's KV cache into ``store`` under ``hashes``."""
    target = STORES.setdefault(store, {})
    for block_id, block_hash in zip(block_ids, hashes):
        target[block_hash] = [tuple(t[block_id].clone() for t in _tensors(layer)) for layer in kv_caches]


def _tensors(layer) -> tuple[torch.Tensor, ...]:
    return tuple(layer) if isinstance(layer, (tuple, list)) else (layer,)


@dataclass
class DictMetadata(KVConnectorMetadata):
    loads: list[tuple[str, int, bytes]] = field(default_factory=list)  # (request, device block, store key)


class DictConnector(KVConnectorBase):
    @classmethod
    def check_config(cls, config) -> None:
        extra = config.kv_connector_extra_config
        unknown = set(extra) - {"store", "fail_loads", "delay_free_steps", "not_ready_steps", "load_async_steps"}
        if unknown:
            raise ValueError(f"DictConnector: unknown kv_connector_extra_config keys {sorted(unknown)}")
        if not isinstance(extra.get("store", ""), str):
            raise ValueError("DictConnector: kv_connector_extra_config.store must be a string")

    def __init__(self, config, role, context):
        super().__init__(config, role, context)
        extra = config.kv_connector_extra_config
        self.store_name = extra.get("store", "default")
        self.store = STORES.setdefault(self.store_name, {})
        self.events = EVENTS.setdefault(self.store_name, {"loads": 0, "asked": 0, "finished": 0})
        self.fail_loads = bool(extra.get("fail_loads", False))
        self.delay_steps = int(extra.get("delay_free_steps", 0))
        self.not_ready = int(extra.get("not_ready_steps", 0))
        self.async_steps = int(extra.get("load_async_steps", 0))
        self._receiving: dict[str, list] = {}  # worker side: request -> [steps left, its loads]
        self._pending: list[tuple[int, bytes]] = []
        self._delayed: dict[str, int] = {}  # worker side: request id -> steps left
        self._errors: set[int] = set()
        self._local_blocks: dict[str, int] = {}
        self._loaded = 0
        self.kv_caches = None

    # -- scheduler side
    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        self.events["asked"] += 1
        if self.not_ready > 0:
            self.not_ready -= 1
            return None, False
        size = self.context.block_size
        hashes = request_block_hashes(request, size, request.num_tokens - 1)
        first = num_computed_tokens // size
        self._local_blocks[request.request_id] = first
        found = 0
        for block_hash in hashes[first:]:
            if block_hash not in self.store:
                break
            found += 1
        return found * size, bool(self.async_steps)

    def update_state_after_alloc(self, request, block_ids, num_external_tokens):
        # The external tokens follow the local hits (whole blocks): blocks [local, local + n).
        local = self._local_blocks.pop(request.request_id, 0)
        if not num_external_tokens:
            return
        hashes = request_block_hashes(request, self.context.block_size, request.num_tokens - 1)
        for i in range(local, local + num_external_tokens // self.context.block_size):
            self._pending.append((request.request_id, block_ids[i], hashes[i]))

    def build_connector_meta(self, scheduler_output):
        meta, self._pending = DictMetadata(self._pending), []
        return meta

    def request_finished(self, request, block_ids):
        self.events["finished"] += 1
        if self.delay_steps and block_ids:
            return True, {"remote_blocks": list(block_ids), "store": self.store_name}
        return False, None

    # -- worker side
    def register_kv_caches(self, kv_caches):
        self.kv_caches = kv_caches

    def start_load_kv(self):
        if not self.async_steps:
            self._copy(self.metadata.loads)
            return
        for load in self.metadata.loads:
            self._receiving.setdefault(load[0], [self.async_steps, []])[1].append(load)

    def _copy(self, loads):
        for _, block_id, block_hash in loads:
            source = self.store[block_hash]
            for layer, saved in zip(self.kv_caches, source):
                for tensor, value in zip(_tensors(layer), saved):
                    tensor[block_id].copy_(torch.zeros_like(value) if self.fail_loads else value)
            if self.fail_loads:
                self._errors.add(block_id)
            self.events["loads"] += 1
            self._loaded += 1

    def wait_for_save(self):
        pass

    def get_finished(self, finished_request_ids):
        if self.delay_steps:
            for request_id in finished_request_ids:
                self._delayed[request_id] = self.delay_steps
        received = set()
        for request_id, state in list(self._receiving.items()):
            state[0] -= 1
            if state[0] <= 0:
                self._copy(state[1])
                received.add(request_id)
                del self._receiving[request_id]
        done = set()
        for request_id in list(self._delayed):
            self._delayed[request_id] -= 1
            if self._delayed[request_id] <= 0:
                done.add(request_id)
                del self._delayed[request_id]
        return done, received

    def get_block_ids_with_load_errors(self):
        errors, self._errors = self._errors, set()
        return errors

    def get_stats(self):
        # A dict of KVTransferStats' fields (the form a connector may give).
        loaded, self._loaded = self._loaded, 0
        return {"num_loads": loaded} if loaded else None


register_connector("DictConnector", __name__, "DictConnector")
