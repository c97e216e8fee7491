"""The offline ``LLM`` API (vLLM's, which users know), and ``LLMEngine``: the frontend and the core in one process.

    LLM.generate / LLM.chat (and on pooling models LLM.embed / classify / score / reward / encode)
    ──► InputProcessor: prompt -> ids (images -> shm segments leased to the request), the
        checkpoint's sampling defaults, the context-window rules, n > 1 fan-out
    ──► RequestTracker.add: OutputProcessor + lease + InprocClient.add_request(EngineCoreRequest)
    ──► loop: InprocClient.step ─► [EngineCoreOutput] ─► RequestTracker.process ─► RequestOutput
    ──► a finished request's lease is released when the last request holding it ends

The server runs the same pieces (``async_llm.AsyncLLM``), with the id-making half of the input
processor in tokenizer workers and the engine core in its own process: the same request gives
the same answer through either door.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools

from atb_plugin.engine.client import InprocClient
from atb_plugin.engine.config import ENGINE_MEDIA_LIMITS, EngineConfig
from atb_plugin.engine.sampling_params import SamplingParams
from atb_plugin.frontend.input_processor import (InputLimits, InputProcessor, Lease, PreparedPrompt, load_router,
                                                 pooled_data)
from atb_plugin.frontend.output_processor import CompletionOutput, RequestOutput
from atb_plugin.frontend.request_tracker import RequestTracker
from atb_plugin.lora.request import LoRARequest
from atb_plugin.pooling import inputs as pooling_inputs
from atb_plugin.pooling.outputs import (ClassificationRequestOutput, EmbeddingRequestOutput, PoolingRequestOutput,
                                        ScoringOutput, ScoringRequestOutput, cosine_similarity)
from atb_plugin.pooling.params import PoolingParams
from shm import ShmStore, ShmStoreConfig

__all__ = ["LLM", "LLMEngine", "RequestOutput", "CompletionOutput"]

# EngineConfig's fields, and the media limits it takes by name (limit_mm_per_prompt=...).
_CONFIG_FIELDS = ({f.name for f in dataclasses.fields(EngineConfig) if f.init} | set(ENGINE_MEDIA_LIMITS)) - {"model"}


class LLMEngine:
    """The frontend and the engine core in one process: what ``LLM`` drives (tests step it by hand).

    ``add_request`` takes a prepared prompt (``input_processor``'s ids, media handles included)
    and finalized params; ``step`` returns the ``RequestOutput`` of every request that progressed."""

    def __init__(self, config: EngineConfig, *, shm_store: ShmStore | None = None, media_config=None,
                 owns_store: bool | None = None):
        self.config = config
        # Our own store unless one is given (or one made for us is handed over with
        # owns_store=True): close() must not pull segments from under others.
        self.owns_store = shm_store is None if owns_store is None else owns_store
        self.shm_store = shm_store if shm_store is not None else ShmStore()
        try:
            self.router = load_router(config, self.shm_store, media_config)
            self.client = InprocClient(config)
        except BaseException:
            if self.owns_store:  # a failed start (bad checkpoint, kernels refused) leaves no segment
                self.shm_store.close()
            raise
        self.tokenizer = self.router.tokenizer
        self.input_processor = InputProcessor(
            config, self.router, InputLimits(max_tokens_per_request=self.client.max_tokens_per_request),
            shm_store=self.shm_store)
        self.tracker = RequestTracker(self.client, self.tokenizer,
                                      release=lambda lease: self.shm_store.release(lease.lease_id))

    # The core's parts, for tests and benchmarks.
    core = property(lambda self: self.client.core)
    scheduler = property(lambda self: self.client.core.scheduler)
    kv_cache_manager = property(lambda self: self.client.core.kv_cache_manager)
    runner = property(lambda self: self.client.core.runner)
    output_processor = property(lambda self: self.tracker.output_processor)

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return self.input_processor.eos_token_ids

    @eos_token_ids.setter
    def eos_token_ids(self, ids) -> None:  # tests pretend a token is the model's EOS
        self.input_processor.eos_token_ids = tuple(ids)

    def prepared(self, request_id: str, ids: list[int], token_type_start: int | None = None) -> PreparedPrompt:
        """Ids made for ``request_id`` by this engine's input processor, with their lease."""
        return PreparedPrompt(list(ids), Lease(request_id), self.shm_store.instance_id, token_type_start)

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams | PoolingParams,
                    prompt=None, token_type_start: int | None = None, lora_request: LoRARequest | None = None,
                    kv_transfer_params: dict | None = None):
        """Queue one prompt's request(s) (n > 1: its children), through ``lora_request``'s adapter
        when given, with ``kv_transfer_params`` for the KV connector; returns the
        ``ParentRequest`` that merges their choices, or None. The prompt's segments (leased to
        ``request_id``) are released when the last of them ends."""
        requests, parent = self.input_processor.make_requests(
            request_id, self.prepared(request_id, prompt_token_ids, token_type_start), params, lora_request,
            kv_transfer_params)
        self.tracker.add(requests, prompt, Lease(request_id))
        return parent

    def abort_request(self, request_id: str) -> RequestOutput | None:
        return self.tracker.abort(request_id)

    def has_unfinished_requests(self) -> bool:
        return self.client.has_unfinished_requests()

    def step(self) -> list[RequestOutput]:
        return self.tracker.process(self.client.step())

    def close(self) -> None:
        self.client.shutdown()  # tensor-parallel ranks stop here
        if self.owns_store:
            self.shm_store.close()


class LLM:
    """``LLM(model_dir).generate(prompts, params)`` / ``.chat(conversations, params)``.

    Keyword arguments are ``EngineConfig`` fields (``dtype``, ``max_model_len``, ``block_size``,
    ``kv_cache_blocks``, ...) plus ``shm_store`` (or ``shm_cache_bytes`` for a store of its own
    with that cache size) and ``media_config``; or pass a whole
    ``EngineConfig`` as ``model``. A prompt is a string, a list of token ids, or MindIE's list of
    ``{"image": ...}`` / ``{"text": ...}`` items; a conversation is a list of OpenAI/MindIE
    messages. Use as a context manager (or call ``close``) to release every shared-memory segment.

    Without ``sampling_params`` a request samples with ``get_default_sampling_params()``: the
    checkpoint's ``generation_config.json`` defaults, as the server applies them (vLLM's rule).

    A pooling model (``runner="pooling"``, or a checkpoint whose architecture is one: BERT,
    ``*ForSequenceClassification``, reward models) answers ``embed``, ``classify``, ``score``,
    ``reward`` and ``encode`` instead of ``generate``; texts longer than ``max_model_len`` are an
    error unless ``truncate_prompt_tokens`` (-1 or k) cuts them, keeping their start."""

    def __init__(self, model, *, shm_store: ShmStore | None = None, media_config=None,
                 shm_cache_bytes: int | None = None, **config_fields):
        unknown = sorted(set(config_fields) - _CONFIG_FIELDS)
        if unknown:
            raise ValueError(f"LLM(): unknown argument(s) {', '.join(unknown)}; "
                             f"engine settings are: {', '.join(sorted(_CONFIG_FIELDS))}")
        if isinstance(model, EngineConfig):
            config = model.replace(**config_fields) if config_fields else model
        else:
            config = EngineConfig(model=model, **config_fields)
        if shm_cache_bytes is not None:
            if shm_store is not None:
                raise ValueError("LLM(): pass shm_cache_bytes or shm_store, not both")
            shm_store = ShmStore(ShmStoreConfig(cache_bytes=shm_cache_bytes))
            owned = True
        else:
            owned = shm_store is None
        self.engine = LLMEngine(config, shm_store=shm_store, media_config=media_config, owns_store=owned)
        self.router = self.engine.router
        self.input_processor = self.engine.input_processor
        self._ids = itertools.count()

    def get_default_sampling_params(self) -> SamplingParams:
        return self.input_processor.default_sampling_params()

    def generate(self, prompts, sampling_params: SamplingParams | list[SamplingParams] | None = None, *,
                 lora_request: LoRARequest | list[LoRARequest | None] | None = None,
                 kv_transfer_params: dict | list[dict | None] | None = None) -> list[RequestOutput]:
        """``lora_request``: one adapter for every prompt, or a list of them (None: the base
        model), one per prompt (the engine needs ``enable_lora=True``). ``kv_transfer_params``:
        for the engine's KV connector (docs/kv-transfer.md), one dict for every prompt or a list;
        a request's final output carries what the connector hands back
        (``RequestOutput.kv_transfer_params``)."""
        single = isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], (int, dict)))
        if not single and not (isinstance(prompts, (list, tuple)) and prompts):
            raise ValueError(f"prompts must be a string, a list of token ids, a list of MindIE items, or a "
                             f"non-empty list of those; got {type(prompts).__name__}")
        prompts = [prompts] if single else list(prompts)
        return self._run(prompts, sampling_params, self.input_processor.prompt_ids, lora_request, kv_transfer_params)

    def chat(self, messages, sampling_params: SamplingParams | list[SamplingParams] | None = None, *,
             add_generation_prompt: bool = True, chat_template_kwargs: dict | None = None,
             tools: list | None = None, mm_processor_kwargs: dict | None = None,
             lora_request: LoRARequest | list[LoRARequest | None] | None = None,
             kv_transfer_params: dict | list[dict | None] | None = None) -> list[RequestOutput]:
        """One conversation or a list of them, through the checkpoint's chat template (with
        ``chat_template_kwargs`` and ``tools`` as the server's chat route passes them);
        ``lora_request`` and ``kv_transfer_params`` as ``generate`` takes them."""
        if not isinstance(messages, (list, tuple)) or not messages:
            raise ValueError(f"messages must be a conversation (a non-empty list of message dicts) or a list of "
                             f"conversations; got {type(messages).__name__}")
        conversations = [messages] if isinstance(messages[0], dict) else list(messages)
        if not all(isinstance(c, list) and c for c in conversations):
            raise ValueError("each conversation must be a non-empty list of message dicts")
        return self._run(conversations, sampling_params, functools.partial(
            self.input_processor.chat_ids, add_generation_prompt=add_generation_prompt,
            chat_template_kwargs=chat_template_kwargs, tools=tools, mm_processor_kwargs=mm_processor_kwargs),
            lora_request, kv_transfer_params)

    # -- pooling ---------------------------------------------------------------------------------

    def encode(self, prompts, pooling_params: PoolingParams | list[PoolingParams] | None = None, *,
               task: str | None = None, truncate_prompt_tokens: int | None = None) -> list[PoolingRequestOutput]:
        """The raw pooled tensor per prompt (``outputs.data``) for ``task`` (or ``pooling_params``)."""
        if pooling_params is None:
            pooling_params = PoolingParams(task=task or self.engine.config.tasks[0])
        elif task is not None:
            raise ValueError("pass task or pooling_params, not both")
        return self._pool(prompts, pooling_params, truncate_prompt_tokens)

    def embed(self, prompts, *, dimensions: int | None = None, normalize: bool | None = None,
              truncate_prompt_tokens: int | None = None) -> list[EmbeddingRequestOutput]:
        params = PoolingParams("embed", dimensions=dimensions, normalize=normalize)
        return [EmbeddingRequestOutput.from_base(o) for o in self._pool(prompts, params, truncate_prompt_tokens)]

    def classify(self, prompts, *, activation: bool | None = None,
                 truncate_prompt_tokens: int | None = None) -> list[ClassificationRequestOutput]:
        params = PoolingParams("classify", activation=activation)
        return [ClassificationRequestOutput.from_base(o) for o in self._pool(prompts, params, truncate_prompt_tokens)]

    def reward(self, prompts, *, activation: bool | None = None,
               truncate_prompt_tokens: int | None = None) -> list[PoolingRequestOutput]:
        """Per-token rewards ``(n_tokens, labels)`` (raw unless ``activation``) of a reward model."""
        params = PoolingParams("token_classify", activation=activation)
        return self._pool(prompts, params, truncate_prompt_tokens)

    def score(self, data_1, data_2, *, truncate_prompt_tokens: int | None = None) -> list[ScoringRequestOutput]:
        """Relevance of each (data_1, data_2) pair: 1 -> N (one text against many) or N -> N
        (pairwise), scored as ``InputProcessor.score_mode`` says (a cross-encoder reads each pair
        together; an embedding model scores by cosine similarity)."""
        first = [data_1] if isinstance(data_1, str) else list(data_1)
        second = [data_2] if isinstance(data_2, str) else list(data_2)
        pairs = pooling_inputs.score_pairs(first, second, ("data_1", "data_2"))
        mode, params = self.input_processor.score_mode()
        if mode == "pair":
            truncate_to = self.input_processor.truncation(truncate_prompt_tokens)
            outputs = self._run(pairs, [params] * len(pairs),
                                lambda pair, _: self.input_processor.pair_ids([pair], truncate_to)[0])
            results = []
            for output in outputs:
                data = pooled_data(output)
                if data.shape != (1,):
                    raise ValueError(f"{self.engine.config.model} has {data.shape[-1]} labels; scoring needs "
                                     "a one-label cross-encoder")
                results.append(ScoringRequestOutput(output.request_id, output.prompt_token_ids,
                                                    ScoringOutput(float(data[0]))))
            return results
        # Each side's texts embedded once (1 -> N embeds the one text a single time).
        embeddings = self.embed(first + second, truncate_prompt_tokens=truncate_prompt_tokens)
        return [ScoringRequestOutput(a.request_id, a.prompt_token_ids + b.prompt_token_ids,
                                     ScoringOutput(cosine_similarity(a.outputs.embedding, b.outputs.embedding)))
                for a, b in pooling_inputs.score_pairs(embeddings[:len(first)], embeddings[len(first):])]

    def _pool(self, prompts, params: PoolingParams | list[PoolingParams], truncate_prompt_tokens) -> list[PoolingRequestOutput]:
        single = isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int))
        if not single and not (isinstance(prompts, (list, tuple)) and prompts):
            raise ValueError(f"prompts must be a string, a list of token ids, or a non-empty list of those; "
                             f"got {type(prompts).__name__}")
        prompts = [prompts] if single else list(prompts)
        params = [params] * len(prompts) if isinstance(params, PoolingParams) else params
        truncate_to = self.input_processor.truncation(truncate_prompt_tokens)
        outputs = self._run(prompts, params, lambda prompt, _: self.input_processor.pooling_ids([prompt], truncate_to)[0])
        for output in outputs:
            pooled_data(output)  # a failed one raises
        return outputs

    def _run(self, prompts, params_list, to_ids, lora_requests=None, kv_transfer_params=None) -> list:
        """Add every prompt (``to_ids(prompt, request_id)`` -> ids, or ``(ids, token_type_start)``)
        with its params (and adapter) and step until all finished; returns their final outputs in
        order. A prompt with ``n > 1`` runs as n child requests merged into one output
        (parallel_sampling)."""
        if params_list is None or isinstance(params_list, SamplingParams):
            params_list = [params_list or self.get_default_sampling_params()] * len(prompts)
        if not isinstance(params_list, (list, tuple)) or len(params_list) != len(prompts):
            raise ValueError(f"params must be one SamplingParams / PoolingParams or a list of them, one per "
                             f"prompt ({len(prompts)})")
        lora_requests = _per_prompt(lora_requests, len(prompts), "lora_request", "LoRARequest")
        kv_transfer_params = _per_prompt(kv_transfer_params, len(prompts), "kv_transfer_params", "dict")
        for lora in dict.fromkeys(lora_requests):  # each adapter checked before anything is queued
            self.input_processor.check_lora(lora)
        kind = PoolingParams if isinstance(params_list[0], PoolingParams) else SamplingParams
        if not all(isinstance(p, kind) for p in params_list):
            raise ValueError(f"params must all be {kind.__name__}s, one per prompt")
        # Whether the model serves this kind of request at all, before anything is queued (the core
        # checks each request again).
        self.engine.config.check_task(params_list[0] if kind is PoolingParams else None)
        engine, processor = self.engine, self.input_processor
        order: list[str] = []  # one request id per prompt
        parents = {}  # the prompts with n > 1
        added: list[str] = []  # the engine's request ids (a parent's children in its place)
        finished: dict[str, RequestOutput] = {}
        try:
            for prompt, params, lora, kv_params in zip(prompts, params_list, lora_requests, kv_transfer_params):
                request_id = str(next(self._ids))
                try:
                    ids = to_ids(prompt, request_id)
                    ids, token_type_start = ids if isinstance(ids, tuple) else (ids, None)
                    if kind is SamplingParams:
                        processor.check_prompt(len(ids))
                        params = processor.finalize(len(ids), params)
                    else:
                        processor.check_pooling_prompts([ids])
                except BaseException:
                    processor.release(request_id)  # segments the builder made before failing
                    raise
                order.append(request_id)
                parent = engine.add_request(request_id, ids, params, prompt, token_type_start, lora, kv_params)
                if parent is not None:
                    parents[request_id] = parent
                added += parent.child_ids if parent is not None else [request_id]
            while engine.has_unfinished_requests():
                for output in engine.step():
                    if output.finished:
                        finished[output.request_id] = output
        finally:
            # An exception (or Ctrl-C) mid-call must not leave requests behind for the next call.
            for request_id in added:
                if request_id not in finished:
                    engine.abort_request(request_id)
        for parent in parents.values():
            for child_id in parent.child_ids:
                parent.add_child_output(finished[child_id])
        return [parents[request_id].make_request_output() if request_id in parents else finished[request_id]
                for request_id in order]

    def close(self) -> None:
        self.engine.close()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _per_prompt(value, count: int, name: str, kind: str) -> list:
    """One value for every prompt, or a list of them, one per prompt."""
    if not isinstance(value, (list, tuple)):
        return [value] * count
    if len(value) != count:
        raise ValueError(f"{name} must be one {kind} or a list of them, one per prompt ({count})")
    return list(value)
