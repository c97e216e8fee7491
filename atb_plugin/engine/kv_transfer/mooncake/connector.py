"""``MooncakeConnector``: prefill/decode disaggregation over the Mooncake Transfer Engine
(``"kv_connector": "MooncakeConnector"``, vLLM's and vllm-ascend's name). docs/kv-transfer.md
("Prefill/decode disaggregation") has the request flow, the keys and the failure policy.

The consumer *pulls*: it learns its own block ids only when it allocates them, and a producer
that pushes would have to know its consumers (vllm-ascend's MooncakeConnector pulls too). So:

- producer (``kv_producer`` / ``kv_both``): a request with ``{"do_remote_decode": true}`` runs its
  prompt; when it finishes its blocks stay allocated and its final output carries
  ``{"do_remote_prefill": true, "remote_block_ids", "remote_host", "remote_port", ...}``; each rank
  frees them (``finished_sending``) when its consumer rank acknowledges, or after
  ``abort_timeout_s``;
- consumer (``kv_consumer`` / ``kv_both``): a request with ``{"do_remote_prefill": true, ...}``
  reports every prompt token but the last (minus its local prefix hits) as external; the step's
  ``start_load_kv`` reads those blocks from the producer rank of the same TP rank in one batch,
  then acknowledges. A failed read reports the blocks (``get_block_ids_with_load_errors``): the
  engine recomputes or fails the request (``kv_load_failure_policy``).
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, field

from atb_plugin.engine.kv_transfer.base import (ConnectorContext, KVConnectorBase, KVConnectorMetadata,
                                               KVConnectorRole)
from atb_plugin.engine.kv_transfer.config import KVTransferConfig
from atb_plugin.engine.kv_transfer.mooncake.side_channel import (KVLayout, SideChannelClient,
                                                                SideChannelServer)
from atb_plugin.engine.kv_transfer.mooncake.transfer import MooncakeError, MooncakeTransfer
from atb_plugin.engine.request import Request, RequestStatus

logger = logging.getLogger(__name__)

# kv_connector_extra_config keys and their defaults. "host": the address the Transfer Engine and
# the side channel advertise (and the side channel binds); "protocol" / "device_name": the Transfer
# Engine's transport ("tcp"; "ascend" with mooncake-transfer-engine-npu) and its device filter
# (initialize's last argument; "" for all); "side_channel_port": rank r of data-
# parallel rank d listens on port + d * tp_size + r (vLLM's VLLM_NIXL_SIDE_CHANNEL_PORT default);
# "transfer_timeout_s": a transfer or a side-channel query that makes no progress for this long
# fails (MC_TCP_PROGRESS_TIMEOUT_SEC); "abort_timeout_s": a producer frees blocks no consumer
# acknowledged after this long (vLLM's VLLM_NIXL_ABORT_REQUEST_TIMEOUT).
EXTRA_CONFIG_DEFAULTS = {"host": "127.0.0.1", "protocol": "tcp", "device_name": "", "side_channel_port": 5600,
                         "transfer_timeout_s": 5.0, "abort_timeout_s": 120.0}


def _extra_config(config: KVTransferConfig) -> dict:
    extra = config.kv_connector_extra_config
    unknown = sorted(set(extra) - set(EXTRA_CONFIG_DEFAULTS))
    if unknown:
        raise ValueError(f"MooncakeConnector: unknown kv_connector_extra_config keys {unknown}; known: "
                         f"{', '.join(EXTRA_CONFIG_DEFAULTS)}")
    merged = {**EXTRA_CONFIG_DEFAULTS, **extra}
    for key in ("transfer_timeout_s", "abort_timeout_s"):
        if not isinstance(merged[key], (int, float)) or merged[key] <= 0:
            raise ValueError(f"MooncakeConnector: kv_connector_extra_config.{key} must be a number > 0, "
                             f"got {merged[key]!r}")
    if not isinstance(merged["side_channel_port"], int) or not 0 < merged["side_channel_port"] < 65536:
        raise ValueError("MooncakeConnector: kv_connector_extra_config.side_channel_port must be a port number, "
                         f"got {merged['side_channel_port']!r}")
    return merged


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _params_problem(params: dict) -> str | None:
    """Why a consumer's ``kv_transfer_params`` cannot be used (None: they can)."""
    for key in ("remote_request_id", "remote_engine_id", "remote_host"):
        if not isinstance(params.get(key), str) or not params[key]:
            return f"lack a string {key}"
    if not _is_int(params.get("remote_port")) or not 0 < params["remote_port"] < 65536:
        return "lack a port number remote_port"
    blocks = params.get("remote_block_ids")
    if not isinstance(blocks, list) or not blocks or not all(_is_int(b) and b >= 0 for b in blocks):
        return "lack remote_block_ids (a non-empty list of block ids)"
    for key in ("remote_tp_size", "num_prompt_tokens"):
        if key in params and (not _is_int(params[key]) or params[key] < 1):
            return f"have an invalid {key} {params[key]!r}"
    return None


@dataclass
class RecvSpec:
    """Read ``remote_block_ids[i]`` of the producer into ``local_block_ids[i]`` (empty: nothing
    to read, only acknowledge), then acknowledge ``request_id``."""

    request_id: str
    remote_request_id: str  # the producer's name of it (what the acknowledgement names)
    local_block_ids: list[int]
    remote_block_ids: list[int]
    remote_engine_id: str
    remote_host: str
    remote_port: int  # the producer's rank 0 side channel (rank r: + r)
    remote_tp_size: int


@dataclass
class MooncakeConnectorMetadata(KVConnectorMetadata):
    recv: list[RecvSpec] = field(default_factory=list)
    # Requests whose blocks a consumer may now read (the worker starts their abort timeout).
    send: list[str] = field(default_factory=list)


def _coalesce(local: list[int], remote: list[int]) -> list[tuple[int, int, int]]:
    """(local first block, remote first block, count) runs where both sides are consecutive:
    one transfer entry per run rather than per block."""
    runs: list[tuple[int, int, int]] = []
    for a, b in zip(local, remote):
        if runs and runs[-1][0] + runs[-1][2] == a and runs[-1][1] + runs[-1][2] == b:
            runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + 1)
        else:
            runs.append((a, b, 1))
    return runs


class MooncakeConnector(KVConnectorBase):
    @classmethod
    def check_config(cls, config: KVTransferConfig) -> None:
        _extra_config(config)

    def __init__(self, config: KVTransferConfig, role: KVConnectorRole, context: ConnectorContext):
        super().__init__(config, role, context)
        self.extra = _extra_config(config)
        # The port of this data-parallel rank's TP rank 0; rank r adds r.
        self.base_port = self.extra["side_channel_port"] + context.data_parallel_rank * context.tensor_parallel_size
        # scheduler side
        self._local_hits: dict[str, int] = {}
        self._pending_recv: list[RecvSpec] = []
        self._pending_send: list[str] = []
        # worker side
        self.transfer: MooncakeTransfer | None = None
        self.layout: KVLayout | None = None
        self._server: SideChannelServer | None = None
        self._client: SideChannelClient | None = None
        self._peer_layouts: dict[tuple[str, int], KVLayout] = {}
        self._sending: dict[str, float] = {}  # request id -> when its blocks are freed unacknowledged
        self._early_acks: dict[str, float] = {}  # acknowledged before this rank learned of the request
        self._load_errors: set[int] = set()
        # Failed loads are counted by the scheduler (once per request, whatever the ranks say).
        self._stats = {"num_loads": 0, "bytes_loaded": 0, "load_seconds": 0.0}

    # -- scheduler side ------------------------------------------------------------------------

    def _remote_prefill(self, request: Request) -> dict | None:
        """The request's valid remote-prefill params, or None (it computes its prompt here)."""
        params = request.kv_transfer_params
        if not self.config.is_consumer or not params or not params.get("do_remote_prefill"):
            return None
        problem = _params_problem(params)
        if problem is not None:
            # The client's (or the proxy's) own data: never trusted to index memory.
            logger.warning("request %s: kv_transfer_params %s; computing its prompt here", request.request_id, problem)
            return None
        expected = params.get("num_prompt_tokens")
        if expected is not None and expected != request.num_prompt_tokens:
            # Another tokenization than the producer's: its KV belongs to other tokens. Nothing is
            # read; the producer hears at once that it may free its blocks.
            logger.warning("request %s: the producer ran %s prompt tokens, this instance has %d; computing here",
                           request.request_id, expected, request.num_prompt_tokens)
            request.kv_transfer_params = {**params, "do_remote_prefill": False}
            self._pending_recv.append(self._recv_spec(request, params, [], []))
            return None
        return params

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        params = self._remote_prefill(request)
        if params is None:
            return 0, False
        self._local_hits[request.request_id] = num_computed_tokens
        available = len(params["remote_block_ids"]) * self.context.block_size
        # The last prompt token is computed here: its logits give the first decoded token.
        wanted = min(request.num_prompt_tokens - 1, available)
        return max(0, wanted - num_computed_tokens), False

    def update_state_after_alloc(self, request: Request, block_ids: list[int], num_external_tokens: int) -> None:
        params = self._remote_prefill(request)
        if params is None:
            return
        # Pulled once: a recompute after preemption or a load failure must not read it again
        # (the producer frees the blocks once acknowledged).
        request.kv_transfer_params = {**params, "do_remote_prefill": False}
        local_hits = self._local_hits.pop(request.request_id, 0)
        block_size = self.context.block_size
        first = local_hits // block_size
        end = math.ceil((local_hits + num_external_tokens) / block_size) if num_external_tokens else first
        self._pending_recv.append(self._recv_spec(request, params, list(block_ids[first:end]),
                                                  list(params["remote_block_ids"][first:end])))

    @staticmethod
    def _recv_spec(request: Request, params: dict, local_block_ids: list[int], remote_block_ids: list[int]) -> RecvSpec:
        return RecvSpec(request.request_id, params["remote_request_id"], local_block_ids, remote_block_ids,
                        params["remote_engine_id"], params["remote_host"], params["remote_port"],
                        params.get("remote_tp_size", 1))

    def build_connector_meta(self, scheduler_output) -> MooncakeConnectorMetadata:
        metadata = MooncakeConnectorMetadata(recv=self._pending_recv, send=self._pending_send)
        self._pending_recv, self._pending_send = [], []
        return metadata

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict | None]:
        self._local_hits.pop(request.request_id, None)
        unpulled = self._remote_prefill(request)
        if unpulled is not None:
            # Ended before it was ever scheduled (aborted while waiting): tell the producer to
            # free its blocks now rather than after abort_timeout_s.
            self._pending_recv.append(self._recv_spec(request, unpulled, [], []))
        params = request.kv_transfer_params
        if not self.config.is_producer or not params or not params.get("do_remote_decode"):
            return False, None
        if request.status not in (RequestStatus.FINISHED_LENGTH, RequestStatus.FINISHED_STOPPED) or not block_ids:
            return False, None  # aborted or failed: no consumer will get these blocks' address
        num_blocks = math.ceil(request.num_prompt_tokens / self.context.block_size)
        self._pending_send.append(request.request_id)
        return True, {"do_remote_prefill": True, "do_remote_decode": False,
                      "remote_request_id": request.request_id, "remote_engine_id": self.config.engine_id, "remote_block_ids": list(block_ids[:num_blocks]),
                      "remote_host": self.extra["host"], "remote_port": self.base_port,
                      "remote_tp_size": self.context.tensor_parallel_size,
                      "num_prompt_tokens": request.num_prompt_tokens}

    # -- worker side ---------------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: list) -> None:
        tensors = []
        for entry in kv_caches:
            tensors.extend(entry if isinstance(entry, (tuple, list)) else [entry])
        if not tensors:
            raise ValueError("MooncakeConnector: the model made no KV cache tensors")
        block_bytes = {t.stride(0) * t.element_size() for t in tensors}
        if len(block_bytes) != 1 or any(not t.is_contiguous() for t in tensors):
            raise ValueError("MooncakeConnector: every KV tensor must be contiguous with one block size in bytes, "
                             f"got {sorted(block_bytes)}")
        num_blocks = {t.shape[0] for t in tensors}
        if len(num_blocks) != 1:
            raise ValueError(f"MooncakeConnector: KV tensors of different block counts {sorted(num_blocks)}")
        self.transfer = MooncakeTransfer(self.extra["host"], self.extra["protocol"], self.extra["transfer_timeout_s"],
                                         self.extra["device_name"])
        for tensor in tensors:
            self.transfer.register_tensor(tensor)
        self.layout = KVLayout(
            engine_id=self.config.engine_id, session=self.transfer.session,
            tp_rank=self.context.tensor_parallel_rank, tp_size=self.context.tensor_parallel_size,
            dtype=str(tensors[0].dtype), block_size=self.context.block_size, num_blocks=num_blocks.pop(),
            block_bytes=block_bytes.pop(), tensor_shapes=[list(t.shape) for t in tensors],
            base_addresses=[t.data_ptr() for t in tensors])
        if self.config.is_producer:
            self._server = SideChannelServer(self.extra["host"], self.base_port + self.context.tensor_parallel_rank,
                                             self.layout)
        if self.config.is_consumer:
            self._client = SideChannelClient(self.extra["transfer_timeout_s"])

    def start_load_kv(self) -> None:
        metadata = self.metadata
        if not isinstance(metadata, MooncakeConnectorMetadata):
            return
        deadline = time.monotonic() + self.extra["abort_timeout_s"]
        for request_id in metadata.send:
            self._sending[request_id] = deadline
        by_peer: dict[tuple[str, int], list[RecvSpec]] = {}
        for spec in metadata.recv:
            peer = (spec.remote_host, spec.remote_port + self.context.tensor_parallel_rank)
            by_peer.setdefault(peer, []).append(spec)
        for peer, specs in by_peer.items():
            self._pull(peer, specs)

    def _peer_layout(self, peer: tuple[str, int], spec: RecvSpec) -> KVLayout:
        layout = self._peer_layouts.get(peer)
        if layout is None or layout.engine_id != spec.remote_engine_id:
            layout = self._peer_layouts[peer] = self._client.query_layout(*peer)
        if layout.engine_id != spec.remote_engine_id:
            raise RuntimeError(f"the producer at {peer[0]}:{peer[1]} is engine {layout.engine_id}, "
                               f"the request names {spec.remote_engine_id} (restarted?)")
        if spec.remote_tp_size != self.context.tensor_parallel_size:
            raise RuntimeError(f"the producer runs tensor_parallel_size={spec.remote_tp_size}, this consumer "
                               f"{self.context.tensor_parallel_size}: both sides must match")
        why = self.layout.mismatch(layout)
        if why is not None:
            raise RuntimeError(f"the producer's KV layout does not match this consumer's: {why}")
        return layout

    def _pull(self, peer: tuple[str, int], specs: list[RecvSpec]) -> None:
        """One batch read for every request of this step from one producer rank, then the acks."""
        wanted = [spec for spec in specs if spec.local_block_ids]
        started = time.perf_counter()
        try:
            if wanted:
                layout = self._peer_layout(peer, wanted[0])
                local, remote, lengths = [], [], []
                for spec in wanted:
                    if spec.remote_engine_id != layout.engine_id:
                        raise RuntimeError("one step's requests name two engines behind one side channel")
                    if max(spec.remote_block_ids) >= layout.num_blocks or len(spec.remote_block_ids) != len(
                            spec.local_block_ids):
                        raise RuntimeError(f"request {spec.request_id}: remote block ids out of the producer's range")
                    self._add_reads(layout, spec, local, remote, lengths)
                self.transfer.read(layout.session, local, remote, lengths)
                self._stats["num_loads"] += len(wanted)
                self._stats["bytes_loaded"] += sum(lengths)
        except (MooncakeError, RuntimeError, TimeoutError, ValueError) as error:
            self._peer_layouts.pop(peer, None)  # ask again next time: the producer may have restarted
            for spec in wanted:
                self._load_errors.update(spec.local_block_ids)
            logger.error("MooncakeConnector: pulling the KV of %s from %s:%d failed: %s",
                         ", ".join(spec.request_id for spec in wanted), peer[0], peer[1], error)
        self._stats["load_seconds"] += time.perf_counter() - started
        # Acknowledged whatever happened: the producer frees its blocks (a failed request is
        # recomputed or failed here, never read again).
        self._client.ack(*peer, [spec.remote_request_id for spec in specs])

    def _add_reads(self, remote_layout: KVLayout, spec: RecvSpec, local: list, remote: list, lengths: list) -> None:
        stride = self.layout.block_bytes
        for local_first, remote_first, count in _coalesce(spec.local_block_ids, spec.remote_block_ids):
            for local_base, remote_base in zip(self.layout.base_addresses, remote_layout.base_addresses):
                local.append(local_base + local_first * stride)
                remote.append(remote_base + remote_first * stride)
                lengths.append(count * stride)

    def wait_for_save(self) -> None:
        """Nothing: the producer's blocks are read by the consumer, never written out here."""

    def get_finished(self, finished_request_ids: set[str]) -> tuple[set[str], set[str]]:
        if self._server is None:
            return set(), set()
        now = time.monotonic()
        for request_id in self._server.take_acked():
            self._early_acks[request_id] = now + self.extra["abort_timeout_s"]
        done = set()
        for request_id, deadline in list(self._sending.items()):
            if request_id in self._early_acks or deadline <= now:
                if deadline <= now and request_id not in self._early_acks:
                    logger.warning("MooncakeConnector: request %s was not pulled within %g s: freeing its blocks",
                                   request_id, self.extra["abort_timeout_s"])
                self._early_acks.pop(request_id, None)
                del self._sending[request_id]
                done.add(request_id)
        # An ack for a request this rank never heard of (aborted, or a stray) must not pile up.
        for request_id, deadline in list(self._early_acks.items()):
            if deadline <= now:
                del self._early_acks[request_id]
        return done, set()

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    def get_stats(self) -> dict | None:
        if self.role is KVConnectorRole.SCHEDULER:
            return None
        stats = dict(self._stats)
        for key in self._stats:
            self._stats[key] = 0
        return stats

    def shutdown(self) -> None:
        if self._server is not None:
            self._server.close()
            self._server = None
        if self._client is not None:
            self._client.close()
            self._client = None
        if self.transfer is not None:
            self.transfer.close()
            self.transfer = None
