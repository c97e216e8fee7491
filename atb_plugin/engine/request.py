"""``Request``: one request (generation or pooling) as the engine tracks it."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from atb_plugin.engine.sampling_params import SamplingParams
from atb_plugin.lora.request import LoRARequest
from atb_plugin.pooling.params import PoolingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    # Holding its blocks while a KV connector loads its prompt's KV asynchronously (vLLM's
    # WAITING_FOR_REMOTE_KVS); it stays in the waiting queue until the load finished.
    WAITING_FOR_REMOTE_KVS = "waiting_for_remote_kvs"
    FINISHED_STOPPED = "stop"  # EOS, a stop token id or a stop string
    FINISHED_LENGTH = "length"  # max_tokens or the context window
    FINISHED_ABORTED = "abort"
    FINISHED_ERROR = "error"  # this request failed (e.g. a bad media block); others go on

    @property
    def is_finished(self) -> bool:
        return self.name.startswith("FINISHED")


@dataclass(eq=False)
class Request:
    """Invariants (checked by ``check``): 0 <= num_computed_tokens <= num_tokens;
    all_token_ids == prompt_token_ids + output_token_ids; a finished request holds no blocks
    (the KV cache manager frees them when it finishes)."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams | None  # None for a pooling request
    arrival_time: float = field(default_factory=time.monotonic)
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    status: RequestStatus = RequestStatus.WAITING
    num_cached_tokens: int = 0
    eos_token_ids: tuple[int, ...] = ()  # the frontend's (the core has no tokenizer)
    shm_instances: tuple[str, ...] = ()  # shared-memory instances this request may read from
    first_scheduled_time: float | None = None
    pooling_params: PoolingParams | None = None
    token_type_start: int | None = None  # cross-encoder pairs: first token of segment B
    # Logprobs of the prompt tokens computed so far (SamplingParams.prompt_logprobs): gathered
    # over the prefill chunks, handed to the first output, then dropped.
    prompt_logprobs: list | None = None
    # Draft tokens for the next step (speculative decoding: the core's proposer writes them after
    # a step, the scheduler schedules them after the last token, verification consumes them).
    # Never part of all_token_ids: only accepted tokens are, so only they are hashed for the
    # prefix cache.
    spec_token_ids: list[int] = field(default_factory=list)
    # The LoRA adapter this request runs through (None: the base model); part of its prefix-cache
    # keys, so two adapters never share KV blocks.
    lora_request: LoRARequest | None = None
    # What the client passed for KV connectors (EngineCoreRequest.kv_transfer_params).
    kv_transfer_params: dict | None = None

    def __post_init__(self):
        if not self.prompt_token_ids:
            raise ValueError(f"request {self.request_id}: the prompt is empty")
        self.all_token_ids = list(self.prompt_token_ids) + list(self.output_token_ids)

    @classmethod
    def from_engine_core_request(cls, message) -> "Request":
        return cls(message.request_id, list(message.prompt_token_ids), message.sampling_params,
                   arrival_time=message.arrival_time, eos_token_ids=tuple(message.eos_token_ids),
                   shm_instances=tuple(message.shm_instances), pooling_params=message.pooling_params,
                   token_type_start=message.token_type_start, lora_request=message.lora_request,
                   kv_transfer_params=message.kv_transfer_params)

    @property
    def is_pooling(self) -> bool:
        """Prefill only: its whole prompt runs in one step, the step's pooled output ends it."""
        return self.pooling_params is not None

    @property
    def needs_prompt_logprobs(self) -> bool:
        """It asked for prompt logprobs and has not sent them yet (they ride on its first output
        token): its prompt must be computed here, not taken from the prefix cache. Once sent, a
        recompute after preemption may use the cache like any request."""
        return (self.sampling_params is not None and self.sampling_params.prompt_logprobs is not None
                and not self.output_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)

    def check(self) -> None:
        assert 0 <= self.num_computed_tokens <= self.num_tokens, (self.request_id, self.num_computed_tokens)
        assert len(self.all_token_ids) == self.num_prompt_tokens + self.num_output_tokens
