"""The typed messages between a frontend and the engine core (in one process or over IPC).

    frontend ── EngineCoreRequest ──►  EngineCore  ── EngineCoreOutputs ──► frontend
               (ids only: no text,                  (new token ids or a pooled tensor,
                no images, no tokenizer)             finish reason, logprobs, error; stats)

They are plain dataclasses: the offline ``LLM`` passes them by reference, the server encodes them
with msgspec's MessagePack (``encode`` / ``decode_*`` below), which decodes straight into these
types and re-runs their ``__post_init__`` checks on the receiving side. This module imports no
torch, so the HTTP process stays light.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import msgspec
import numpy as np

from atb_plugin.engine.sampling_params import SamplingParams
from atb_plugin.lora.request import LoRARequest
from atb_plugin.pooling.params import PoolingParams

__all__ = ["LogprobsEntry", "PooledData", "EngineCoreRequest", "EngineCoreOutput", "SchedulerStats",
           "SpecDecodingStats", "KVTransferStats", "EngineCoreOutputs",
           "encode", "decode_request", "decode_outputs"]


@dataclass
class LogprobsEntry:
    """Log-probabilities of one sampled position, from the raw logits (before temperature,
    top-k/top-p and min_tokens: vLLM's default ``raw_logprobs``).

    ``rank`` is the sampled token's 1-based rank (1 + the number of tokens with a strictly higher
    logprob); ``top_token_ids`` / ``top_logprobs`` the N most likely tokens, most likely first
    (empty when the request asked for ``logprobs=0``)."""

    token_id: int
    logprob: float
    rank: int
    top_token_ids: list[int]
    top_logprobs: list[float]

    def __post_init__(self):
        if len(self.top_token_ids) != len(self.top_logprobs):
            raise ValueError("top_token_ids and top_logprobs must have the same length")
        if self.rank < 1:
            raise ValueError(f"rank is 1-based, got {self.rank}")


@dataclass
class PooledData:
    """A pooled result as it crosses the process boundary: float32 little-endian bytes and a
    shape (``(D,)`` per sequence, ``(n_tokens, D)`` per token). Bytes, not a list of floats: a
    384-float embedding is 1.5 KiB either way, but bytes cost no per-float encode/decode, and
    base64 output (``encoding_format="base64"``) is these very bytes."""

    shape: list[int]
    data: bytes

    def __post_init__(self):
        if int(np.prod(self.shape, dtype=np.int64)) * 4 != len(self.data):
            raise ValueError(f"pooled data of {len(self.data)} bytes does not match shape {self.shape}")

    @classmethod
    def from_array(cls, array) -> "PooledData":
        array = np.ascontiguousarray(array, dtype="<f4")
        return cls(list(array.shape), array.tobytes())

    def to_array(self) -> np.ndarray:
        return np.frombuffer(self.data, dtype="<f4").reshape(self.shape)


@dataclass
class EngineCoreRequest:
    """One request as the core sees it. ``prompt_token_ids`` may hold negative media-handle slots
    (written by the frontend's input builder); the core reads only segments of the
    ``shm_instances`` registered here. ``eos_token_ids`` come from the frontend (generation
    config, tokenizer, family rules), so the core needs no tokenizer.

    Exactly one of ``sampling_params`` (generate) and ``pooling_params`` (pooling models) is set.
    ``token_type_start``: for a sentence pair on a cross-encoder, the index of the first token of
    the second sentence (its tokens have token type 1; vLLM sends the same "compressed" form)."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams | None
    eos_token_ids: tuple[int, ...] = ()
    shm_instances: tuple[str, ...] = ()
    arrival_time: float = field(default_factory=time.monotonic)  # CLOCK_MONOTONIC: one clock for all processes
    pooling_params: PoolingParams | None = None
    token_type_start: int | None = None
    lora_request: LoRARequest | None = None  # the adapter it runs through (None: the base model)
    # KV connectors (docs/kv-transfer.md): what the client passed (a PD proxy: where the prompt's
    # KV lies on the producer, or that this instance produces it); None: nothing.
    kv_transfer_params: dict | None = None

    def __post_init__(self):
        if not isinstance(self.request_id, str) or not self.request_id:
            raise ValueError(f"request_id must be a non-empty string, got {self.request_id!r}")
        if (self.sampling_params is None) == (self.pooling_params is None):
            raise ValueError("a request has either sampling_params (generate) or pooling_params, not both or none")
        if self.token_type_start is not None and not 0 < self.token_type_start < len(self.prompt_token_ids):
            raise ValueError(f"token_type_start {self.token_type_start} is outside the prompt "
                             f"({len(self.prompt_token_ids)} tokens)")
        self.eos_token_ids = tuple(self.eos_token_ids)
        self.shm_instances = tuple(self.shm_instances)


@dataclass
class EngineCoreOutput:
    """What one step did for one request: the tokens it appended (one per step; several when it
    verified speculative drafts), or for a
    pooling request its ``pooled`` result (then it is finished, "stop"), and ``finish_reason``
    ("stop", "length", "abort", "error") once it ended, with ``error`` saying why for "error".
    ``queue_time`` (seconds from arrival to first scheduling) rides on the first output of a
    request, and so does ``prompt_logprobs`` for a request that asked for them
    (``SamplingParams.prompt_logprobs``): one entry per prompt token, None for the first
    (nothing precedes it)."""

    request_id: str
    new_token_ids: list[int] = field(default_factory=list)
    new_logprobs: list[LogprobsEntry] | None = None
    finish_reason: str | None = None
    error: str | None = None
    num_cached_tokens: int = 0
    queue_time: float | None = None
    pooled: PooledData | None = None
    prompt_logprobs: list[LogprobsEntry | None] | None = None
    # On a request's final output, what its KV connector hands back (a PD producer: where the
    # consumer finds the prompt's KV); the server returns it as the response's kv_transfer_params.
    kv_transfer_params: dict | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class SpecDecodingStats:
    """Speculative decoding since the previous stats, as vLLM counts it: verify steps that had
    drafts (``num_drafts``), draft tokens verified, drafts accepted, and accepted per draft
    position (position i counts the steps that accepted at least i + 1 drafts)."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_accepted_tokens_per_pos: list[int] = field(default_factory=list)

    def observe(self, num_draft_tokens: int, num_accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted
        per_pos = self.num_accepted_tokens_per_pos
        per_pos.extend([0] * (num_draft_tokens - len(per_pos)))
        for position in range(num_accepted):
            per_pos[position] += 1


@dataclass
class KVTransferStats:
    """KV connectors since the previous stats (docs/kv-transfer.md): loads into the device cache
    (a host / disk tier hit, a PD consumer's pull) and saves out of it, in bytes and seconds;
    requests whose load failed (recomputed or failed, by kv_load_failure_policy); and, as gauges,
    each offload tier's bytes held now (``{"cpu": ..., "disk": ...}``)."""

    num_loads: int = 0
    num_saves: int = 0
    bytes_loaded: int = 0
    bytes_saved: int = 0
    load_seconds: float = 0.0
    save_seconds: float = 0.0
    num_failed_loads: int = 0
    tier_bytes: dict[str, int] = field(default_factory=dict)

    @classmethod
    def from_value(cls, value) -> KVTransferStats | None:
        """None, a ``KVTransferStats`` or a dict of its fields (what a connector's get_stats gives)."""
        return value if value is None or isinstance(value, cls) else cls(**value)

    def merged(self, other: KVTransferStats | None, sum_gauges: bool = False) -> KVTransferStats:
        """Counters added; ``tier_bytes`` summed (``sum_gauges``: the ranks' shards of one step)
        or, per tier, ``other``'s (a later report replaces an earlier one)."""
        if other is None:
            return self
        tiers = dict(self.tier_bytes)
        for tier, nbytes in other.tier_bytes.items():
            tiers[tier] = tiers.get(tier, 0) + nbytes if sum_gauges else nbytes
        return KVTransferStats(self.num_loads + other.num_loads, self.num_saves + other.num_saves,
                               self.bytes_loaded + other.bytes_loaded, self.bytes_saved + other.bytes_saved,
                               self.load_seconds + other.load_seconds, self.save_seconds + other.save_seconds,
                               self.num_failed_loads + other.num_failed_loads, tiers)


@dataclass
class SchedulerStats:
    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0
    prefix_cache_queries: int = 0  # tokens looked up since the previous stats
    prefix_cache_hits: int = 0  # of those, tokens found cached
    num_preemptions: int = 0  # since the previous stats
    spec_decoding: SpecDecodingStats | None = None  # None: no drafts verified since the previous stats
    # Tokens KV connectors were asked for / delivered since the previous stats (vLLM's
    # external_prefix_cache_queries / _hits), and their transfers; None: no connector.
    external_prefix_cache_queries: int = 0
    external_prefix_cache_hits: int = 0
    kv_transfer: KVTransferStats | None = None


@dataclass
class EngineCoreOutputs:
    """One message from the core process: a step's outputs and, with them, its scheduler stats."""

    outputs: list[EngineCoreOutput] = field(default_factory=list)
    stats: SchedulerStats | None = None


_encoder = msgspec.msgpack.Encoder()
_request_decoder = msgspec.msgpack.Decoder(EngineCoreRequest)
_outputs_decoder = msgspec.msgpack.Decoder(EngineCoreOutputs)


def encode(message) -> bytes:
    return _encoder.encode(message)


def decode_request(data: bytes) -> EngineCoreRequest:
    return _request_decoder.decode(data)


def decode_outputs(data: bytes) -> EngineCoreOutputs:
    return _outputs_decoder.decode(data)
