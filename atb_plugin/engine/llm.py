"""The offline ``LLM`` API (vLLM's, which users know), and ``LLMEngine``: frontend + core in one process.

    LLM.generate / LLM.chat (and on pooling models LLM.embed / classify / score / reward / encode)
    ──► input processing: router's input builder (text -> ids, images ->
        shm segments leased to the request), client token ids checked
    ──► LLMEngine.add_request ──► OutputProcessor.add_request + EngineCore.add_request(EngineCoreRequest)
    ──► loop: EngineCore.step ─► [EngineCoreOutput] ─► OutputProcessor.process ─► RequestOutput
    ──► a finished request's shm lease is released by the OutputProcessor's on_finish

The server runs the same pieces, with the engine core in its own process (``atb_plugin.server``).
"""

from __future__ import annotations

import dataclasses
import itertools

from atb_plugin.engine.config import EngineConfig
from atb_plugin.engine.core import EngineCore
from atb_plugin.engine.messages import EngineCoreRequest
from atb_plugin.engine.output_processor import CompletionOutput, OutputProcessor, RequestOutput
from atb_plugin.engine.parallel_sampling import ParentRequest, fans_out
from atb_plugin.engine.sampling_params import SamplingParams
from atb_plugin.pooling import inputs as pooling_inputs
from atb_plugin.pooling.outputs import (ClassificationRequestOutput, EmbeddingRequestOutput, PoolingRequestOutput,
                                        ScoringOutput, ScoringRequestOutput, cosine_similarity)
from atb_plugin.pooling.params import PoolingParams
from routers import get_router
from shm import ShmStore, ShmStoreConfig

__all__ = ["LLM", "LLMEngine", "RequestOutput", "CompletionOutput", "validate_client_token_ids"]

_CONFIG_FIELDS = {f.name for f in dataclasses.fields(EngineConfig) if f.init} - {"model"}


def validate_client_token_ids(token_ids, vocab_size: int) -> list[int]:
    """Token ids a client sent: ints in ``[0, vocab_size)``. Negative ids are reserved for the
    media handles only our input builders write, so a client can never forge one."""
    if not isinstance(token_ids, list) or not token_ids:
        raise ValueError("a token-id prompt must be a non-empty list of integers")
    if any(isinstance(t, bool) or not isinstance(t, int) for t in token_ids):
        raise ValueError("a token-id prompt must hold integers only")
    bad = [t for t in token_ids if not 0 <= t < vocab_size]
    if bad:
        raise ValueError(f"token ids {bad[:5]} are outside the vocabulary [0, {vocab_size}) "
                         "(negative ids are reserved for media handles)")
    return list(token_ids)


class LLMEngine:
    """The frontend and the engine core in one process: what ``LLM`` drives (tests step it by hand).

    ``add_request`` takes ids as the input builder made them (media handles included);
    ``step`` returns the ``RequestOutput`` of every request that progressed."""

    def __init__(self, config: EngineConfig, *, shm_store: ShmStore | None = None, media_config=None,
                 owns_store: bool | None = None):
        self.config = config
        # Our own store unless one is given (or one made for us is handed over with
        # owns_store=True): close() must not pull segments from under others.
        self.owns_store = shm_store is None if owns_store is None else owns_store
        self.shm_store = shm_store if shm_store is not None else ShmStore()
        try:
            self.router = get_router(config.model, shm_store=self.shm_store, media_config=media_config,
                                     max_images_per_prompt=config.limit_mm_per_prompt,
                                     mm_wire_dtype=config.mm_wire_dtype)
            self.core = EngineCore(config)
        except BaseException:
            if self.owns_store:  # a failed start (bad checkpoint, kernels refused) leaves no segment
                self.shm_store.close()
            raise
        self.tokenizer = self.router.tokenizer
        self.eos_token_ids = tuple(self.router.eos_token_ids)
        self.output_processor = OutputProcessor(self.tokenizer, on_finish=self._release)

    def _release(self, output: RequestOutput) -> None:
        self.shm_store.release(output.request_id)  # its images are no longer needed

    # The core's parts, for tests and benchmarks.
    scheduler = property(lambda self: self.core.scheduler)
    kv_cache_manager = property(lambda self: self.core.kv_cache_manager)
    runner = property(lambda self: self.core.runner)

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams | PoolingParams,
                    prompt=None, token_type_start: int | None = None) -> None:
        self.output_processor.add_request(request_id, prompt, prompt_token_ids, params)
        pooling = isinstance(params, PoolingParams)
        try:
            self.core.add_request(EngineCoreRequest(
                request_id, list(prompt_token_ids), None if pooling else params, self.eos_token_ids,
                (self.shm_store.instance_id,), pooling_params=params if pooling else None,
                token_type_start=token_type_start))
        except BaseException:
            self.output_processor.abort(request_id)  # releases its lease
            raise

    def abort_request(self, request_id: str) -> RequestOutput | None:
        self.core.abort([request_id])
        return self.output_processor.abort(request_id)

    def has_unfinished_requests(self) -> bool:
        return self.core.has_unfinished_requests()

    def step(self) -> list[RequestOutput]:
        processed = self.output_processor.process(self.core.step())
        if processed.to_abort:
            self.core.abort(processed.to_abort)
        return processed.request_outputs

    def close(self) -> None:
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
        self._ids = itertools.count()

    def generate(self, prompts, sampling_params: SamplingParams | list[SamplingParams] | None = None) -> list[RequestOutput]:
        single = isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], (int, dict)))
        if not single and not (isinstance(prompts, (list, tuple)) and prompts):
            raise ValueError(f"prompts must be a string, a list of token ids, a list of MindIE items, or a "
                             f"non-empty list of those; got {type(prompts).__name__}")
        prompts = [prompts] if single else list(prompts)
        return self._run(prompts, sampling_params, self._prompt_ids)

    def chat(self, messages, sampling_params: SamplingParams | list[SamplingParams] | None = None) -> list[RequestOutput]:
        if not isinstance(messages, (list, tuple)) or not messages:
            raise ValueError(f"messages must be a conversation (a non-empty list of message dicts) or a list of "
                             f"conversations; got {type(messages).__name__}")
        conversations = [messages] if isinstance(messages[0], dict) else list(messages)
        if not all(isinstance(c, list) and c for c in conversations):
            raise ValueError("each conversation must be a non-empty list of message dicts")
        builder = self.router.input_builder
        return self._run(conversations, sampling_params,
                         lambda conversation, request_id: builder.make_context(0, conversation, request_id=request_id))

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
        """Relevance of each (data_1, data_2) pair: 1 -> N (one text against many) or N -> N (pairwise).
        A cross-encoder (a model serving "score") reads each pair together; an embedding model
        scores by the cosine similarity of the two embeddings."""
        first = [data_1] if isinstance(data_1, str) else list(data_1)
        second = [data_2] if isinstance(data_2, str) else list(data_2)
        pairs = pooling_inputs.score_pairs(first, second, ("data_1", "data_2"))
        config = self.engine.config
        if "score" in config.tasks:
            truncate_to = pooling_inputs.truncation_length(truncate_prompt_tokens, config.max_model_len)
            tokenizer = self.engine.tokenizer
            outputs = self._run(pairs, [PoolingParams("score")] * len(pairs),
                                lambda pair, _: pooling_inputs.pair_ids(tokenizer, *pair, config.max_model_len,
                                                                        truncate_to))
            results = []
            for output in self._checked(outputs):
                if output.outputs.data.shape != (1,):
                    raise ValueError(f"{config.model} has {output.outputs.data.shape[-1]} labels; scoring needs "
                                     "a one-label cross-encoder")
                results.append(ScoringRequestOutput(output.request_id, output.prompt_token_ids,
                                                    ScoringOutput(float(output.outputs.data[0]))))
            return results
        if "embed" not in config.tasks:
            raise ValueError(f"{config.model} serves {', '.join(config.tasks)}: scoring needs a cross-encoder "
                             "(score) or an embedding model (embed)")
        # Each side's texts embedded once (1 -> N embeds the one text a single time).
        embeddings = self.embed(first + second, truncate_prompt_tokens=truncate_prompt_tokens)
        left, right = embeddings[:len(first)], embeddings[len(first):]
        results = []
        for a, b in zip(left * len(right) if len(left) == 1 else left, right):
            results.append(ScoringRequestOutput(a.request_id, a.prompt_token_ids + b.prompt_token_ids, ScoringOutput(
                cosine_similarity(a.outputs.embedding, b.outputs.embedding))))
        return results

    def _pool(self, prompts, params: PoolingParams | list[PoolingParams], truncate_prompt_tokens) -> list[PoolingRequestOutput]:
        single = isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int))
        if not single and not (isinstance(prompts, (list, tuple)) and prompts):
            raise ValueError(f"prompts must be a string, a list of token ids, or a non-empty list of those; "
                             f"got {type(prompts).__name__}")
        prompts = [prompts] if single else list(prompts)
        params = [params] * len(prompts) if isinstance(params, PoolingParams) else params
        config = self.engine.config
        truncate_to = pooling_inputs.truncation_length(truncate_prompt_tokens, config.max_model_len)
        tokenizer = self.engine.tokenizer

        def to_ids(prompt, _):
            if isinstance(prompt, str):
                return pooling_inputs.text_ids(tokenizer, prompt, config.max_model_len, truncate_to)
            ids = validate_client_token_ids(prompt, config.vocab_size)
            return pooling_inputs.token_ids(ids, config.max_model_len, truncate_to)

        return self._checked(self._run(prompts, params, to_ids))

    @staticmethod
    def _checked(outputs: list[PoolingRequestOutput]) -> list[PoolingRequestOutput]:
        for output in outputs:
            if output.outputs.data is None:
                raise RuntimeError(f"request {output.request_id} failed: {output.error or output.finish_reason}")
        return outputs

    def _prompt_ids(self, prompt, request_id: str) -> list[int]:
        if isinstance(prompt, str):
            return self.router.tokenize(prompt)
        if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
            return validate_client_token_ids(prompt, self.engine.config.vocab_size)
        if isinstance(prompt, list) and prompt and all(isinstance(item, dict) for item in prompt):
            return self.router.input_builder.tokenize(prompt, request_id=request_id)
        raise ValueError(f"a prompt must be a string, a non-empty list of token ids or of MindIE items "
                         f"({{'image': ...}} / {{'text': ...}}); got {prompt!r:.80}")

    def _run(self, prompts, sampling_params, to_ids) -> list:
        """Add every prompt (``to_ids(prompt, request_id)`` -> ids, or ``(ids, token_type_start)``)
        with its params and step until all finished; returns their final outputs in order. A
        prompt with ``n > 1`` runs as n child requests merged into one output (parallel_sampling)."""
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            sampling_params = [sampling_params or SamplingParams()] * len(prompts)
        if not isinstance(sampling_params, (list, tuple)) or len(sampling_params) != len(prompts):
            raise ValueError(f"params must be one SamplingParams / PoolingParams or a list of them, one per "
                             f"prompt ({len(prompts)})")
        kind = PoolingParams if isinstance(sampling_params[0], PoolingParams) else SamplingParams
        if not all(isinstance(p, kind) for p in sampling_params):
            raise ValueError(f"params must all be {kind.__name__}s, one per prompt")
        # Whether the model serves this kind of request at all, before anything is queued (the core
        # checks each request again).
        self.engine.config.check_task(sampling_params[0] if kind is PoolingParams else None)
        engine = self.engine
        order: list[str] = []  # one request id per prompt
        parents: dict[str, ParentRequest] = {}  # the prompts with n > 1
        added: list[str] = []  # the engine's request ids (a parent's children in its place)
        finished: dict[str, RequestOutput] = {}
        try:
            for prompt, params in zip(prompts, sampling_params):
                request_id = str(next(self._ids))
                try:
                    ids = to_ids(prompt, request_id)
                except BaseException:
                    engine.shm_store.release(request_id)  # segments the builder made before failing
                    raise
                ids, token_type_start = ids if isinstance(ids, tuple) else (ids, None)
                order.append(request_id)
                if fans_out(params):
                    parents[request_id] = parent = ParentRequest(request_id, params)
                    for child_id, child_params in parent.children:
                        engine.add_request(child_id, ids, child_params, prompt, token_type_start)
                        added.append(child_id)
                else:
                    engine.add_request(request_id, ids, params, prompt, token_type_start)
                    added.append(request_id)
            while engine.has_unfinished_requests():
                for output in engine.step():
                    if output.finished:
                        finished[output.request_id] = output
        finally:
            # An exception (or Ctrl-C) mid-call must not leave requests behind for the next call.
            for request_id in added:
                if request_id not in finished:
                    engine.abort_request(request_id)
            # The prompt's images are leased to the parent's id (its children finish under their
            # own ids, which hold no lease): released once all of them are done.
            for request_id in parents:
                engine.shm_store.release(request_id)
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
