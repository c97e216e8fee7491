"""The engine core loop and the offline ``LLM`` API (vLLM's, which users know).

    LLM.generate / LLM.chat ──► input builder (ids with media handles, leased per request)
        ──► LLMEngine.add_request ──► loop: Scheduler.schedule ─► ModelRunner.execute
                                            ─► Scheduler.update_from_output ─► detokenize, stop checks
        ──► RequestOutput per prompt; a finished request's shared memory lease is released
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field

import torch

from atb_plugin.engine.detokenizer import IncrementalDetokenizer
from atb_plugin.engine.kv_cache_manager import KVCacheManager
from atb_plugin.engine.model_runner import ModelRunner
from atb_plugin.engine.request import Request, RequestStatus
from atb_plugin.engine.sampler import check_stop
from atb_plugin.engine.sampling_params import SamplingParams
from atb_plugin.engine.scheduler import Scheduler, SchedulerConfig
from atb_plugin.platform import current_platform
from routers import get_router
from shm import ShmStore

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
DEFAULT_KV_CACHE_BYTES = 1 << 30


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    logprobs: list | None
    finish_reason: str | None  # "stop", "length", "abort", "error"; None while running


@dataclass
class RequestOutput:
    request_id: str
    prompt: object
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    error: str | None = None
    num_cached_tokens: int = 0


@dataclass
class _Tracked:
    request: Request
    prompt: object
    detokenizer: IncrementalDetokenizer
    logprobs: list = field(default_factory=list)
    error: str | None = None


class LLMEngine:
    """Requests in, ``RequestOutput`` per step out. Owns the model, the KV cache, the scheduler."""

    def __init__(self, model, *, device: str = "auto", dtype: str = "float32", max_model_len: int | None = None,
                 block_size: int = 16, kv_cache_blocks: int | None = None,
                 kv_cache_bytes: int = DEFAULT_KV_CACHE_BYTES, max_num_batched_tokens: int = 2048,
                 max_num_seqs: int = 64, enable_prefix_caching: bool = True, shm_store=None, media_config=None):
        if dtype not in _DTYPES:
            raise ValueError(f"dtype {dtype!r}: expected one of {', '.join(_DTYPES)}")
        # Our own store unless one is given: close() must not pull segments from under others.
        self.owns_store = shm_store is None
        self.shm_store = shm_store if shm_store is not None else ShmStore()
        self.router = get_router(model, shm_store=self.shm_store, media_config=media_config)
        self.tokenizer = self.router.tokenizer
        torch_device = current_platform().device() if device == "auto" else torch.device(device)
        self.model = self.router.model_cls.from_pretrained(model, dtype=_DTYPES[dtype], device=torch_device)
        declared = self.router.max_model_len or 4096
        if max_model_len is not None and max_model_len > declared:
            raise ValueError(f"max_model_len {max_model_len} exceeds the model's {declared}")
        self.max_model_len = max_model_len or declared
        if kv_cache_blocks is None:
            kv_cache_blocks = self._blocks_for(kv_cache_bytes, block_size, max_num_seqs)
        self.kv_cache_manager = KVCacheManager(kv_cache_blocks, block_size, enable_prefix_caching)
        self.scheduler = Scheduler(SchedulerConfig(max_num_batched_tokens, max_num_seqs, self.max_model_len),
                                   self.kv_cache_manager)
        self.eos_token_ids = set(self.router.eos_token_ids)
        self.vocab_size = self.router.config_value("vocab_size")
        self.runner = ModelRunner(self.model, num_blocks=kv_cache_blocks, block_size=block_size,
                                  max_num_reqs=max_num_seqs, max_model_len=self.max_model_len,
                                  eos_token_ids=self.eos_token_ids, expected_instance=self.shm_store.instance_id)
        self._tracked: dict[str, _Tracked] = {}

    def _blocks_for(self, budget: int, block_size: int, max_num_seqs: int) -> int:
        """Blocks that fit ``budget`` bytes, but no more than every sequence at full length needs."""
        probe = self.model.make_kv_caches(1, block_size)
        bytes_per_block = sum(k.numel() * k.element_size() + v.numel() * v.element_size() for k, v in probe)
        needed = max_num_seqs * math.ceil(self.max_model_len / block_size)
        return 1 + max(1, min(budget // bytes_per_block, needed))  # + the null block

    # -- requests --------------------------------------------------------------------------------

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, prompt=None) -> None:
        vocab = self.vocab_size
        bad = [t for t in prompt_token_ids if t >= vocab]
        if bad:
            raise ValueError(f"token ids {bad[:5]} are outside the vocabulary (size {vocab})")
        request = Request(request_id, list(prompt_token_ids), params)
        self.scheduler.add_request(request)
        detokenizer = IncrementalDetokenizer(self.tokenizer, [t for t in prompt_token_ids if t >= 0], params)
        self._tracked[request_id] = _Tracked(request, prompt, detokenizer)

    def abort_request(self, request_id: str) -> RequestOutput | None:
        return self._finish(request_id, RequestStatus.FINISHED_ABORTED)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    # -- the loop --------------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        scheduled = self.scheduler.schedule()
        result = self.runner.execute(scheduled)
        outputs = []
        for request_id, why in result.failed.items():
            self._tracked[request_id].error = why
            outputs.append(self._finish(request_id, RequestStatus.FINISHED_ERROR))
        for request in self.scheduler.update_from_output(scheduled, result.sampled):
            tracked = self._tracked[request.request_id]
            token = request.output_token_ids[-1]
            tracked.detokenizer.update([token])
            if request.sampling_params.logprobs is not None:
                tracked.logprobs.append(result.logprobs.get(request.request_id))
            status = self._stop_status(request, tracked.detokenizer)
            outputs.append(self._finish(request.request_id, status) if status else self._output(tracked))
        return outputs

    def _stop_status(self, request: Request, detokenizer) -> RequestStatus | None:
        # Stop strings are text: the detokenizer finds them (it waits for min_tokens itself);
        # EOS, stop ids, max_tokens and the context window are the sampler module's check_stop.
        if detokenizer.stopped_by is not None:
            return RequestStatus.FINISHED_STOPPED
        if check_stop(request, self.eos_token_ids, self.max_model_len):
            return request.status
        return None

    def _finish(self, request_id: str, status: RequestStatus) -> RequestOutput | None:
        tracked = self._tracked.pop(request_id, None)
        if tracked is None:
            return None
        self.scheduler.finish(request_id, status)
        tracked.request.status = status
        tracked.detokenizer.finish()  # release text held back for a possible stop string
        self.shm_store.release(request_id)  # its images are no longer needed
        return self._output(tracked)

    def _output(self, tracked: _Tracked) -> RequestOutput:
        request = tracked.request
        finished = request.status.is_finished
        reason = request.status.value if finished else None
        completion = CompletionOutput(0, tracked.detokenizer.output_text, list(request.output_token_ids),
                                      tracked.logprobs if request.sampling_params.logprobs is not None else None,
                                      reason)
        return RequestOutput(request.request_id, tracked.prompt, list(request.prompt_token_ids), [completion],
                             finished, tracked.error, request.num_cached_tokens)


class LLM:
    """``LLM(model_dir).generate(prompts, params)`` / ``.chat(conversations, params)``.

    A prompt is a string, a list of token ids, or MindIE's list of ``{"image": ...}`` /
    ``{"text": ...}`` items; a conversation is a list of OpenAI/MindIE messages. Use as a context
    manager (or call ``close``) to release every shared-memory segment."""

    def __init__(self, model, **engine_kwargs):
        self.engine = LLMEngine(model, **engine_kwargs)
        self.router = self.engine.router
        self._ids = itertools.count()

    def generate(self, prompts, sampling_params: SamplingParams | list[SamplingParams] | None = None) -> list[RequestOutput]:
        single = isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], (int, dict)))
        prompts = [prompts] if single else list(prompts)
        return self._run(prompts, sampling_params, self._prompt_ids)

    def chat(self, messages, sampling_params: SamplingParams | list[SamplingParams] | None = None) -> list[RequestOutput]:
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        builder = self.router.input_builder
        return self._run(conversations, sampling_params,
                         lambda conversation, request_id: builder.make_context(0, conversation, request_id=request_id))

    def _prompt_ids(self, prompt, request_id: str) -> list[int]:
        if isinstance(prompt, str):
            return self.router.tokenize(prompt)
        if isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            if any(t < 0 for t in prompt):
                raise ValueError("token ids must be >= 0 (negative ids are reserved for media handles)")
            return list(prompt)
        return self.router.input_builder.tokenize(prompt, request_id=request_id)

    def _run(self, prompts, sampling_params, to_ids) -> list[RequestOutput]:
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            sampling_params = [sampling_params or SamplingParams()] * len(prompts)
        if len(sampling_params) != len(prompts):
            raise ValueError(f"{len(sampling_params)} sampling params for {len(prompts)} prompts")
        order = []
        for prompt, params in zip(prompts, sampling_params):
            request_id = str(next(self._ids))
            try:
                ids = to_ids(prompt, request_id)
                self.engine.add_request(request_id, ids, params, prompt)
            except BaseException:
                self.engine.shm_store.release(request_id)
                for earlier in order:
                    self.engine.abort_request(earlier)
                raise
            order.append(request_id)
        finished: dict[str, RequestOutput] = {}
        while self.engine.has_unfinished_requests():
            for output in self.engine.step():
                if output is not None and output.finished:
                    finished[output.request_id] = output
        return [finished[request_id] for request_id in order]

    def close(self) -> None:
        if self.engine.owns_store:
            self.engine.shm_store.close()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
