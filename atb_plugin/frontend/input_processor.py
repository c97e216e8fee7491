"""``InputProcessor``: from what a user sends to the ``EngineCoreRequest``s the core runs, once for both doors.

    prompt kinds ──► ids (+ media segments leased to the request)     prompt_ids / chat_ids /
                     text, token ids, MindIE items, a conversation,      pooling_ids / pair_ids
                     pooling texts, cross-encoder pairs                   (in process: LLM, and each
                                                                          tokenizer worker for the server)
    params       ──► check_prompt + finalize: the context window, max_tokens, the KV capacity,
                     n's cap, the vocabulary (generate); lengths and capacity (pooling)
    ids + params ──► make_requests: one EngineCoreRequest, or n children sharing one lease (n > 1)

The offline ``LLM`` calls all of it in its own process. The server calls the id-making half in
its tokenizer workers (``tokenizer_pool``: a job names the method, the worker runs it on its own
``InputProcessor``) and the rest in the API process, so a rule written here holds for both.

Sampling defaults come from the checkpoint's ``generation_config.json`` the way vLLM reads it
(``generation_defaults_from_config``): the server applies them to the fields a request leaves
unset; the offline ``LLM`` uses ``default_sampling_params()`` when it is given no params.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from atb_plugin.engine.config import EngineConfig
from atb_plugin.engine.messages import EngineCoreRequest
from atb_plugin.engine.sampling_params import SamplingParams
from atb_plugin.frontend.errors import InvalidRequestError, RequestError
from atb_plugin.frontend.input_bounds import check_text_fits, text_chars
from atb_plugin.frontend.parallel_sampling import ParentRequest, fans_out
from atb_plugin.lora.peft import LoRAError, inspect_adapter
from atb_plugin.lora.request import LoRARequest
from atb_plugin.pooling import inputs as pooling_inputs
from atb_plugin.pooling.params import PoolingParams

__all__ = ["InputLimits", "InputProcessor", "Lease", "PreparedPrompt", "check_context_length",
           "generation_defaults_from_config", "load_router", "pooled_data", "validate_client_token_ids"]


# -- the rules, each once -----------------------------------------------------------------------

def validate_client_token_ids(token_ids, vocab_size: int, param: str = "prompt") -> list[int]:
    """Token ids a client sent: ints in ``[0, vocab_size)``. Negative ids are reserved for the
    media handles only our input builders write, so a client can never forge one."""
    if not isinstance(token_ids, list) or not token_ids:
        raise InvalidRequestError("a token-id prompt must be a non-empty list of integers", param=param)
    if any(isinstance(t, bool) or not isinstance(t, int) for t in token_ids):
        raise InvalidRequestError("a token-id prompt must hold integers only", param=param)
    bad = [t for t in token_ids if not 0 <= t < vocab_size]
    if bad:
        raise InvalidRequestError(f"token ids {bad[:5]} are outside the vocabulary [0, {vocab_size}) "
                                  "(negative ids are reserved for media handles)", param=param)
    return list(token_ids)


def check_context_length(prompt_len: int, max_model_len: int, max_tokens: int | None = None, *,
                         max_input_tokens: int | None = None, max_tokens_param: str = "max_tokens") -> None:
    """vLLM's context-window checks, with vLLM's messages: the prompt must leave room for one
    token, and prompt + an explicit ``max_tokens`` must fit ``max_model_len``. With
    ``max_input_tokens`` (MindIE's maxInputTokenLen) the prompt must also fit that."""
    if max_input_tokens is not None and prompt_len > max_input_tokens:
        raise InvalidRequestError(
            f"The input has {prompt_len} tokens, more than this server's limit of {max_input_tokens} "
            "input tokens. Please reduce the length of the input.", param="input_tokens")
    if prompt_len >= max_model_len:
        raise InvalidRequestError(
            f"This model's maximum context length is {max_model_len} tokens. However, your request has "
            f"{prompt_len} input tokens. Please reduce the length of the input messages.", param="input_tokens")
    fit_max_tokens(max_tokens, max_model_len - prompt_len, explicit=True, param=max_tokens_param,
                   context=(max_model_len, prompt_len))


def fit_max_tokens(requested: int | None, room: int, *, explicit: bool, cap: int | None = None,
                   param: str = "max_tokens", context: tuple[int, int] | None = None) -> int:
    """The output limit of a request with ``room`` tokens left after its prompt: an explicit
    ``requested`` above the room is refused (vLLM refuses it), an implicit one (a default) is
    clamped to it, None means all of it; ``cap`` (generation_config's ``max_new_tokens``) caps the
    result. ``context``: ``(max_model_len, prompt_len)`` for vLLM's message."""
    if room < 1:
        raise InvalidRequestError("The prompt fills the model's context window; no room is left for output.",
                                  param="input_tokens")
    if explicit and requested is not None and requested > room:
        detail = (f"This model's maximum context length is {context[0]} tokens and your request has {context[1]} "
                  f"input tokens ({requested} > {context[0]} - {context[1]})." if context is not None else
                  f"Only {room} tokens are left in the model's context window after the prompt.")
        what = "'max_tokens' or 'max_completion_tokens'" if context is not None else f"'{param}'"
        raise InvalidRequestError(f"{what} is too large: {requested}. {detail}", param=param)
    max_tokens = room if requested is None else min(requested, room)
    return max_tokens if cap is None else min(max_tokens, cap)


# generation_config.json keys vLLM takes sampling defaults from, and transformers' defaults for
# them: vLLM reads ``GenerationConfig.to_diff_dict()``, which drops values equal to these.
_HF_GENERATION_DEFAULTS: dict[str, Any] = {"temperature": 1.0, "top_p": 1.0, "top_k": 50,
                                           "repetition_penalty": 1.0, "min_p": None, "max_new_tokens": None}
_SUPPORTED_DEFAULTS = {"temperature": float, "top_p": float, "top_k": int, "max_tokens": int,
                       "repetition_penalty": float, "min_p": float}


def generation_defaults_from_config(config: Mapping[str, Any] | None) -> tuple[dict[str, Any], list[str]]:
    """Sampling defaults from a checkpoint's ``generation_config.json`` contents, as vLLM derives
    them: ``({"temperature", "top_p", "top_k", "repetition_penalty", "min_p", "max_tokens"} that
    are set, [unusable])``. ``max_new_tokens`` becomes ``max_tokens`` (a cap on every request's
    output, as in vLLM); values equal to transformers' defaults are dropped. The second item
    lists, as ``"name=value"``, values that are not numbers of the right kind, for a startup
    warning."""
    defaults: dict[str, Any] = {}
    unsupported: list[str] = []
    for key, value in (config or {}).items():
        if value is None or value == _HF_GENERATION_DEFAULTS.get(key, object()):
            continue
        name = "max_tokens" if key == "max_new_tokens" else key
        if name in _SUPPORTED_DEFAULTS:
            kind = _SUPPORTED_DEFAULTS[name]
            if isinstance(value, bool) or not isinstance(value, (int, float)) or (kind is int and value != int(value)):
                unsupported.append(f"{key}={value!r}")
            else:
                defaults[name] = kind(value)
    return defaults, unsupported


def load_router(config: EngineConfig, shm_store=None, media_config=None, chat_template: str | None = None):
    """The family's router for ``config``: its builders write the engine's wire dtype;
    ``chat_template`` replaces the checkpoint's (--chat-template). Items and videos per prompt and
    frames per video are the tighter of the engine's media limits and ``media_config``'s: the
    engine's start-up memory profile sized the KV cache for its own, so the builders may never
    accept more (an offline ``LLM(limit_videos_per_prompt=1)`` without a media config included)."""
    from input_builders.media_config import MediaConfig
    from routers import get_router

    media = media_config or MediaConfig()
    engine, limits = config.media, media.limits  # the engine's counts are resolved to ints
    limits = dataclasses.replace(
        limits, limit_mm_per_prompt=_tighter(engine.limit_mm_per_prompt, limits.limit_mm_per_prompt),
        limit_videos_per_prompt=_tighter(engine.limit_videos_per_prompt, limits.limit_videos_per_prompt),
        max_video_frames=min(limits.max_video_frames, engine.max_video_frames))
    router = get_router(config.model, shm_store=shm_store, media_config=dataclasses.replace(media, limits=limits),
                        mm_wire_dtype=config.mm_wire_dtype)
    if chat_template is not None:
        router.tokenizer.chat_template = chat_template
    return router


def _tighter(limit: int, other: int | None) -> int:
    return limit if other is None else min(limit, other)


# -- what input processing hands on -------------------------------------------------------------

@dataclass(frozen=True)
class Lease:
    """Media segments held for a request: released once, by ``owner`` (the offline ``LLM``'s
    store: None; the server: the tokenizer worker's index), when the last request holding it ends."""

    lease_id: str
    owner: int | None = None


@dataclass(frozen=True)
class PreparedPrompt:
    """One prompt as input processing made it: ids (media handles included), the lease of its
    segments (None: it holds none) and the shm instance the core may read them from."""

    ids: list[int]
    lease: Lease | None = None
    shm_instance: str | None = None
    token_type_start: int | None = None


@dataclass(frozen=True)
class InputLimits:
    """The frontend's own limits, beyond the engine's (the server's flags; the offline ``LLM``
    sets none): ``max_input_tokens`` (MindIE's maxInputTokenLen), ``max_parallel_samples`` (n's
    cap), ``max_tokens_per_request`` (the KV cache's capacity for one request, known once the
    engine core has sized its cache)."""

    max_input_tokens: int | None = None
    max_parallel_samples: int | None = None
    max_tokens_per_request: int | None = None


class InputProcessor:
    """One engine's input rules. ``router`` is ``routers.get_router(config.model, ...)``, made by
    ``load_router``: with ``shm_store`` where this processor builds media prompts (the offline
    ``LLM``, a tokenizer worker), without one where it only checks and assembles (the server's
    API process, which never calls the id-making methods)."""

    def __init__(self, config: EngineConfig, router, limits: InputLimits = InputLimits(), shm_store=None):
        self.config = config
        self.router = router
        self.shm_store = shm_store  # the store the router's builder writes to; None: this one builds no media
        self.limits = limits
        self.eos_token_ids = tuple(router.eos_token_ids)
        self.generation_defaults, self.unusable_generation_defaults = \
            generation_defaults_from_config(router.generation_config)
        self._checked_loras: set[tuple[int, str]] = set()  # adapters found servable (check_lora)

    @property
    def tokenizer(self):
        return self.router.tokenizer

    # -- prompts -> ids (in the process that owns the store) -------------------------------------

    def prompt_ids(self, prompt, request_id: str, add_special_tokens: bool = True) -> list[int]:
        """A text, a client's token ids, or MindIE's list of ``{"image": ...}`` / ``{"text": ...}``
        items; media go to shared memory, leased to ``request_id``. A text far too long for the
        context window is refused before it is tokenized (``input_bounds``)."""
        if isinstance(prompt, (str, list)) and not (prompt and all(isinstance(t, int) for t in prompt)):
            check_text_fits(text_chars(prompt), self.tokenizer, self.config.max_model_len, "The prompt")
        if isinstance(prompt, str):
            return self.router.input_builder.tokenize(prompt, request_id=request_id,
                                                      add_special_tokens=add_special_tokens)
        if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
            return validate_client_token_ids(prompt, self.config.vocab_size)
        if isinstance(prompt, list) and prompt and all(isinstance(item, dict) for item in prompt):
            return self.router.input_builder.tokenize(prompt, request_id=request_id,
                                                      add_special_tokens=add_special_tokens,
                                                      check_length=self.check_media_prompt)
        raise InvalidRequestError(f"a prompt must be a string, a non-empty list of token ids or of MindIE items "
                                  f"({{'image': ...}} / {{'text': ...}}); got {prompt!r:.80}", param="prompt")

    def chat_ids(self, messages, request_id: str, *, add_generation_prompt: bool = True,
                 chat_template_kwargs: dict | None = None, tools: list | None = None,
                 mm_processor_kwargs: dict | None = None) -> list[int]:
        """A conversation through the checkpoint's chat template; media leased to ``request_id``;
        ``mm_processor_kwargs``: a video family's sampling overrides (others take none)."""
        check_text_fits(text_chars(messages), self.tokenizer, self.config.max_model_len, "The conversation")
        return self.router.input_builder.make_context(
            0, messages, add_generation_prompt=add_generation_prompt, request_id=request_id,
            chat_template_kwargs=chat_template_kwargs, tools=tools, check_length=self.check_media_prompt,
            **({"mm_processor_kwargs": mm_processor_kwargs} if mm_processor_kwargs else {}))

    def check_media_prompt(self, num_prompt_tokens: int) -> None:
        """A prompt with media, measured before its media are decoded and written to shared memory
        (a video's tokens follow from its header and packet index): one over the context window is
        refused now, with the 400 ``check_prompt`` would give it after all that work."""
        check_context_length(num_prompt_tokens, self.config.max_model_len,
                             max_input_tokens=self.limits.max_input_tokens)

    def pooling_ids(self, prompts: Sequence, truncate_to: int | None = None, label: str = "input") -> list[list[int]]:
        """Each pooling prompt's ids: texts tokenised with the tokenizer's special tokens, a
        client's token ids checked against the vocabulary; truncation keeps each one's start
        (``atb_plugin.pooling.inputs``). An input over ``max_model_len`` is refused, named
        ``label[i]`` when there are several."""
        max_model_len = self.config.max_model_len

        def ids_of(prompt):
            if isinstance(prompt, str):
                if truncate_to is None:  # truncation asked for: the text may be long, it is cut
                    check_text_fits(len(prompt), self.tokenizer, max_model_len)
                return pooling_inputs.text_ids(self.tokenizer, prompt, max_model_len, truncate_to)
            ids = validate_client_token_ids(prompt, self.config.vocab_size, label)
            return pooling_inputs.token_ids(ids, max_model_len, truncate_to)

        return self._each(prompts, ids_of, label)

    def pair_ids(self, pairs: Sequence, truncate_to: int | None = None,
                 label: str = "input") -> list[tuple[list[int], int | None]]:
        """``(ids, token_type_start)`` of each ``(first, second)`` text pair, for a cross-encoder."""
        max_model_len = self.config.max_model_len

        def ids_of(pair):
            if truncate_to is None:
                check_text_fits(text_chars(list(pair)), self.tokenizer, max_model_len, "The pair")
            return pooling_inputs.pair_ids(self.tokenizer, pair[0], pair[1], max_model_len, truncate_to)

        return self._each(pairs, ids_of, label)

    @staticmethod
    def _each(items: Sequence, ids_of, label: str) -> list:
        results = []
        for i, item in enumerate(items):
            try:
                results.append(ids_of(item))
            except ValueError as error:
                message = f"{label}[{i}]: {error}" if len(items) > 1 else str(error)
                raise InvalidRequestError(message, param=label) from None
        return results

    def release(self, request_id: str) -> None:
        """Drop the segments leased to ``request_id`` (a prompt that failed half-way, /tokenize)."""
        if self.shm_store is not None:
            self.shm_store.release(request_id)

    # -- sampling params -------------------------------------------------------------------------

    def default_sampling_params(self) -> SamplingParams:
        """``SamplingParams()`` with the checkpoint's generation_config.json defaults (vLLM's
        ``LLM.get_default_sampling_params``): what a request that sets nothing gets."""
        return SamplingParams(**self.generation_defaults)

    def check_prompt(self, num_prompt_tokens: int, requested_max_tokens: int | None = None,
                     max_tokens_param: str = "max_tokens") -> None:
        """The prompt fits the context window (and the server's input limit), and so does an
        output limit the client set explicitly."""
        check_context_length(num_prompt_tokens, self.config.max_model_len, requested_max_tokens,
                             max_input_tokens=self.limits.max_input_tokens, max_tokens_param=max_tokens_param)

    def room(self, num_prompt_tokens: int) -> int:
        """Output tokens the context window leaves after a prompt."""
        return self.config.max_model_len - num_prompt_tokens

    def finalize(self, num_prompt_tokens: int, params: SamplingParams, *, explicit_max_tokens: bool = False,
                 max_tokens_param: str = "max_tokens") -> SamplingParams:
        """``params`` as the engine will run them, for a prompt ``check_prompt`` accepted:
        ``max_tokens`` fitted to the context window (None: all of it), then to the KV cache's
        capacity for one request (refused when the client set it explicitly, clamped
        otherwise); n within the server's cap; every token id inside the vocabulary. Returns a
        copy: the caller's object is never modified."""
        max_tokens = fit_max_tokens(params.max_tokens, self.room(num_prompt_tokens), explicit=False)
        capacity = self.limits.max_tokens_per_request
        if capacity is not None and num_prompt_tokens + max_tokens > capacity:
            if explicit_max_tokens:
                raise InvalidRequestError(
                    f"the prompt ({num_prompt_tokens} tokens) plus max_tokens ({max_tokens}) exceeds the {capacity} "
                    "tokens the KV cache can hold for one request (--kv-cache-memory / --max-model-len); lower "
                    "max_tokens", param=max_tokens_param)
            max_tokens = capacity - num_prompt_tokens
            if max_tokens < 1:
                raise InvalidRequestError(f"the prompt ({num_prompt_tokens} tokens) fills the {capacity} tokens the KV "
                                          "cache can hold for one request", param="input_tokens")
        cap = self.limits.max_parallel_samples
        if cap is not None and params.n > cap:
            raise InvalidRequestError(f"n={params.n} is above this server's limit of {cap} parallel samples "
                                      "(--max-parallel-samples)", param="n")
        try:
            params = dataclasses.replace(params, max_tokens=max_tokens)
            params.check_vocabulary(self.config.vocab_size)
        except InvalidRequestError:
            raise
        except ValueError as error:
            raise InvalidRequestError(str(error), param=str(error).split()[0]) from None
        return params

    def bad_words_token_ids(self, words: list[str]) -> list[list[int]]:
        """Each bad word as the tokens it is written with, alone and after a space (vLLM's two
        spellings: a word mid-sentence is usually tokenised with its leading space)."""
        sequences: list[list[int]] = []
        for word in words:
            for text in (word.lstrip(), " " + word.lstrip()):
                ids = self.tokenizer.encode(text, add_special_tokens=False)
                if ids and ids not in sequences:
                    sequences.append(ids)
        return sequences

    # -- pooling params --------------------------------------------------------------------------

    def pooling_params(self, task: str, **fields) -> PoolingParams:
        """The request's ``PoolingParams`` (fields left None take the task's defaults), refused
        unless the model serves the task (naming the tasks it serves)."""
        try:
            params = PoolingParams(task, **{k: v for k, v in fields.items() if v is not None})
            self.config.check_task(params)
        except InvalidRequestError:
            raise
        except ValueError as error:
            raise InvalidRequestError(str(error)) from None
        return params

    def truncation(self, truncate_prompt_tokens: int | None) -> int | None:
        try:
            return pooling_inputs.truncation_length(truncate_prompt_tokens, self.config.max_model_len)
        except ValueError as error:
            raise InvalidRequestError(str(error), param="truncate_prompt_tokens") from None

    @staticmethod
    def check_pooling_count(count: int, max_inputs: int | None, label: str = "input") -> None:
        """At most ``max_inputs`` pooling inputs in one request (the server's --max-pooling-inputs:
        texts or token-id lists, or the pairs a score / rerank request scores, counted by ``label``,
        its second side); checked before anything is tokenised."""
        if max_inputs is not None and count > max_inputs:
            raise InvalidRequestError(f"the request has {count} inputs ({label}); this server takes at most {max_inputs} "
                                      "in one request (--max-pooling-inputs): split it into smaller requests",
                                      param=label)

    def check_pooling_prompts(self, ids: Sequence[Sequence[int]], max_inputs: int | None = None) -> None:
        """Every pooling input fits the KV cache's capacity for one request; at most
        ``max_inputs`` of them (``check_pooling_count``) in one call."""
        self.check_pooling_count(len(ids), max_inputs)
        capacity = self.limits.max_tokens_per_request
        longest = max(len(i) for i in ids)
        if capacity is not None and longest > capacity:
            raise InvalidRequestError(f"an input has {longest} tokens; the KV cache holds at most {capacity} tokens per "
                                      "request (--kv-cache-memory); shorten it or set truncate_prompt_tokens")

    # -- EngineCoreRequests ----------------------------------------------------------------------

    def check_lora(self, lora_request: LoRARequest | None) -> None:
        """``InvalidRequestError`` unless the engine serves LoRA and the adapter fits the base
        model (``lora.peft.inspect_adapter``: its files, ranks, target modules, shapes); an
        adapter is read once per id and path."""
        if lora_request is None:
            return
        if not isinstance(lora_request, LoRARequest):
            raise InvalidRequestError(f"lora_request must be a LoRARequest, got {type(lora_request).__name__}",
                                      param="lora_request")
        if not self.config.enable_lora:
            raise InvalidRequestError("this engine serves no LoRA adapters: start it with enable_lora=True "
                                      "(--enable-lora)", param="lora_request")
        if lora_request.key not in self._checked_loras:
            try:
                inspect_adapter(lora_request.lora_path, self.config.checkpoint_config(), self.config.max_lora_rank)
            except LoRAError as error:
                raise InvalidRequestError(f"LoRA adapter {lora_request.lora_name!r}: {error}",
                                          param="lora_request") from None
            self._checked_loras.add(lora_request.key)

    def make_requests(self, request_id: str, prompt: PreparedPrompt, params: SamplingParams | PoolingParams,
                      lora_request: LoRARequest | None = None,
                      kv_transfer_params: dict | None = None) -> tuple[list[EngineCoreRequest], ParentRequest | None]:
        """The engine requests of one prompt: one, or with n > 1 one per choice (ids
        ``parallel_sampling.child_request_id``, seeds seed + i), all reading the prompt's
        segments and running through ``lora_request``'s adapter (checked: ``check_lora``), with
        ``kv_transfer_params`` for its KV connector (docs/kv-transfer.md); the
        ``ParentRequest`` merges the choices back (None without fan-out)."""
        self.check_lora(lora_request)
        if kv_transfer_params is not None:
            if not isinstance(kv_transfer_params, dict):
                raise InvalidRequestError(f"kv_transfer_params must be a JSON object, got "
                                          f"{type(kv_transfer_params).__name__}", param="kv_transfer_params")
            if fans_out(params):
                # n choices would pull (or hand out) one prompt's remote blocks n times: the
                # producer frees them at the first acknowledgement.
                raise InvalidRequestError("kv_transfer_params with n > 1 is not supported", param="kv_transfer_params")
        parent = ParentRequest(request_id, params) if fans_out(params) else None
        children = parent.children if parent is not None else [(request_id, params)]
        instances = (prompt.shm_instance,) if prompt.shm_instance else ()
        pooling = isinstance(params, PoolingParams)
        return [EngineCoreRequest(child_id, list(prompt.ids), None if pooling else child_params, self.eos_token_ids,
                                  instances, pooling_params=child_params if pooling else None,
                                  token_type_start=prompt.token_type_start, lora_request=lora_request,
                                  kv_transfer_params=kv_transfer_params)
                for child_id, child_params in children], parent

    def score_mode(self, activation: bool | None = None) -> tuple[str, PoolingParams]:
        """How this model scores a pair (``LLM.score``, /score, /rerank): a cross-encoder (a model
        serving "score") reads each pair together ("pair"); an embedding model scores by the
        cosine similarity of the two embeddings ("cosine", no activation); anything else is
        refused naming what it serves."""
        tasks = self.config.tasks
        if "score" in tasks:
            return "pair", self.pooling_params("score", activation=activation)
        if "embed" in tasks:
            if activation is not None:
                raise InvalidRequestError(f"{self.config.model} is an embedding model: it scores by cosine "
                                          "similarity, which has no activation; leave activation out",
                                          param="activation")
            return "cosine", self.pooling_params("embed")
        if self.config.runner != "pooling":
            self.pooling_params("score")  # refused: the config's message for a generative model
        raise InvalidRequestError(f"{self.config.model} serves {', '.join(tasks)}: scoring needs a cross-encoder "
                                  "(score) or an embedding model (embed)")


def pooled_data(output):
    """A finished pooling output's tensor; its failure as the error both doors report."""
    if output.outputs.data is not None:
        return output.outputs.data
    if output.finish_reason == "abort":
        raise RequestError(503, "the request was aborted (the service is shutting down); retry it", retry_after=5)
    raise RequestError(500, f"request {output.request_id} failed: {output.error or output.finish_reason}")
