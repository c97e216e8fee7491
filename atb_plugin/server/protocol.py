"""Request and response models of the OpenAI-compatible API, spelled as vLLM's OpenAI server spells them.

Requests (``ChatCompletionRequest``, ``CompletionRequest``, ``TokenizeRequest``,
``DetokenizeRequest``) validate what a client sends and turn it into a ``SamplingParams``;
responses (``ChatCompletionResponse``, ``ChatCompletionStreamResponse``, ``CompletionResponse``,
``CompletionStreamResponse``, ``ModelList``, ``ErrorResponse``...) carry vLLM's field names, so
a client written against vLLM (or the OpenAI SDK) reads them unchanged.

Policies, each for a reason:

- Unknown request fields are ignored and logged (vLLM does the same), so clients that send
  OpenAI-only extras (``store``, ``metadata``...) keep working.
- Fields vLLM or OpenAI define whose effect this backend does not implement (``_NEUTRAL_ONLY``:
  beam search, ``length_penalty``, ``best_of``, ``suffix``, priorities, KV transfer...) are
  accepted only with their neutral value; any other value is refused with "<field>=<value> is
  not supported yet". Ignoring them would return output the client did not ask for, with
  nothing to tell it so. Penalties, ``logit_bias``, tools, structured output, logprobs and
  prompt logprobs are implemented.
- Sampling defaults from the checkpoint's ``generation_config.json`` apply only to fields the
  request leaves unset, as in vLLM (``to_sampling_params``, with the frontend's
  ``generation_defaults_from_config``); the context-window rules are the frontend's
  (``atb_plugin.frontend.input_processor``), the same for the offline ``LLM``.
"""

from __future__ import annotations

import logging
import math
import re
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from http import HTTPStatus
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

from atb_plugin.engine.sampling_params import SamplingParams, StructuredOutputsParams
from atb_plugin.frontend.errors import InvalidRequestError
from atb_plugin.frontend.input_processor import fit_max_tokens, generation_defaults_from_config
from atb_plugin.multimodal.parts import AUDIO_PART_TYPES, VIDEO_PART_TYPES, unknown_part_keys, unknown_part_type

if TYPE_CHECKING:  # annotations only: the HTTP process need not import the sampler (torch)
    from atb_plugin.engine.messages import LogprobsEntry

logger = logging.getLogger(__name__)

__all__ = [
    "MAX_TOP_LOGPROBS",
    "OpenAIBaseModel",
    "ErrorInfo",
    "ErrorResponse",
    "error_response",
    "format_validation_error",
    "StreamOptions",
    "ChatMessageParam",
    "ChatCompletionRequest",
    "CompletionRequest",
    "TokenizeRequest",
    "TokenizeResponse",
    "DetokenizeRequest",
    "DetokenizeResponse",
    "PromptTokenUsageInfo",
    "UsageInfo",
    "ChatMessage",
    "DeltaMessage",
    "ChatCompletionLogProb",
    "ChatCompletionLogProbsContent",
    "ChatCompletionLogProbs",
    "ChatCompletionResponseChoice",
    "ChatCompletionResponse",
    "ChatCompletionResponseStreamChoice",
    "ChatCompletionStreamResponse",
    "CompletionLogProbs",
    "CompletionResponseChoice",
    "CompletionResponse",
    "CompletionResponseStreamChoice",
    "CompletionStreamResponse",
    "ModelPermission",
    "ModelCard",
    "ModelList",
    "chat_logprobs",
    "completion_logprobs",
    "prompt_logprobs",
    "ResponseFormat",
    "ToolParam",
    "ToolCall",
    "FunctionCall",
    "DeltaToolCall",
    "DeltaFunctionCall",
    "PromptLogprob",
    "random_uuid",
]

# OpenAI's limit for top_logprobs, and vLLM's default --max-logprobs.
MAX_TOP_LOGPROBS = 20

# SamplingParams takes seeds in [0, 2**64) (torch.Generator's range); checked here so the error
# names the field before any work is done.
_SEED_MAX = 2**64 - 1

# JSON has no -inf: vLLM reports impossible tokens with this floor instead.
_LOGPROB_FLOOR = -9999.0


def random_uuid() -> str:
    return uuid.uuid4().hex


# -- base ------------------------------------------------------------------------------------------

_FIELD_NAMES: dict[type, frozenset[str]] = {}


def _field_names(cls: type[BaseModel]) -> frozenset[str]:
    names = _FIELD_NAMES.get(cls)
    if names is None:
        names = set(cls.model_fields)
        names.update(f.alias for f in cls.model_fields.values() if f.alias)
        names = _FIELD_NAMES[cls] = frozenset(names)
    return names


class OpenAIBaseModel(BaseModel):
    # Unknown fields are dropped (and logged below), as vLLM does: OpenAI clients send extras
    # (store, metadata, service_tier...) that must not fail the request.
    model_config = ConfigDict(extra="ignore")

    @model_validator(mode="wrap")
    @classmethod
    def _log_ignored_fields(cls, data, handler):
        result = handler(data)
        if isinstance(data, dict):
            ignored = sorted(str(k) for k in data.keys() - _field_names(cls))
            if ignored:
                logger.warning("%s: ignoring unknown fields %s", cls.__name__, ", ".join(ignored))
        return result


# -- errors ----------------------------------------------------------------------------------------


class ErrorInfo(OpenAIBaseModel):
    message: str
    type: str
    param: str | None = None
    code: int


class ErrorResponse(OpenAIBaseModel):
    error: ErrorInfo


# The error "type" per status: vLLM's names where it has one, the OpenAI SDK's exception names
# otherwise (the same table as atb_plugin.server.errors); other statuses get the phrase.
_ERROR_TYPES = {400: "BadRequestError", 401: "AuthenticationError", 404: "NotFoundError", 405: "MethodNotAllowed",
                413: "RequestEntityTooLarge", 429: "RateLimitError", 500: "InternalServerError",
                501: "NotImplementedError", 503: "ServiceUnavailableError"}


def error_response(
    message: str,
    status_code: int | HTTPStatus = HTTPStatus.BAD_REQUEST,
    err_type: str | None = None,
    param: str | None = None,
) -> ErrorResponse:
    """``{"error": {"message", "type", "param", "code"}}`` as vLLM builds it: ``code`` is the HTTP
    status, ``type`` defaults to the name for that status (400 -> "BadRequestError")."""
    status = HTTPStatus(int(status_code))
    if err_type is None:
        err_type = _ERROR_TYPES.get(status.value) or status.phrase.replace(" ", "")
    return ErrorResponse(error=ErrorInfo(message=message, type=err_type, param=param, code=status.value))


def _short_repr(value: Any, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


# Tags pydantic inserts into ``loc`` for union members and wrapped validators; not field names.
_LOC_TAGS = {"str", "int", "float", "bool", "list", "dict", "none", "bytes"}
_NO_GOT = {"missing", "value_error", "assertion_error", "json_invalid", "extra_forbidden"}
_MAX_REPORTED_ERRORS = 5


def format_validation_error(exc) -> tuple[str, str | None]:
    """``(message, param)`` for a pydantic ``ValidationError`` (or FastAPI's
    ``RequestValidationError``, whose locations start with "body"): one line per problem, each
    naming its field, e.g. ``messages.0.role: Input should be 'system', ... (got 'robot')``;
    ``param`` is the first problem's dotted field path (None for a whole-body problem)."""
    lines: list[str] = []
    param: str | None = None
    errors = list(exc.errors())
    for err in errors[:_MAX_REPORTED_ERRORS]:
        loc = list(err.get("loc", ()))
        if loc and loc[0] == "body":
            loc = loc[1:]
        loc = [p for p in loc if not (isinstance(p, str) and ("[" in p or p in _LOC_TAGS))]
        path = ".".join(str(p) for p in loc)
        kind = err.get("type", "")
        msg = str(err.get("msg", ""))
        if kind == "json_invalid":
            path = ""
            detail = (err.get("ctx") or {}).get("error")
            msg = f"Invalid JSON body: {detail}" if detail else "Invalid JSON body"
        elif kind == "value_error":
            msg = msg.removeprefix("Value error, ")
        elif kind == "assertion_error":
            msg = msg.removeprefix("Assertion failed, ")
        elif kind == "missing":
            msg = "Field required"
        elif kind in ("model_type", "model_attributes_type", "dict_type"):
            msg = "Input should be a JSON object"
        if kind not in _NO_GOT and "input" in err:
            msg = f"{msg} (got {_short_repr(err['input'])})"
        if param is None and path:
            param = path
        named = path and re.match(re.escape(path) + r"(?![\w.])", msg)
        lines.append(msg if not path or named else f"{path}: {msg}")
    if len(errors) > _MAX_REPORTED_ERRORS:
        lines.append(f"and {len(errors) - _MAX_REPORTED_ERRORS} more")
    return "; ".join(lines) or "Invalid request", param


# -- shared request pieces ---------------------------------------------------------------------------


def _none(v) -> bool:
    return v is None


def _falsy(v) -> bool:
    return v is None or v is False


def _empty(v) -> bool:
    return v is None or (isinstance(v, (list, dict, str)) and not v)


def _zero(v) -> bool:
    return v is None or v == 0


def _one(v) -> bool:
    return v is None or v == 1


# Fields vLLM / OpenAI define whose effect this backend does not implement: (is neutral, what is).
_NEUTRAL_ONLY: dict[str, tuple[Callable[[Any], bool], str]] = {
    "use_beam_search": (_falsy, "false"),
    "length_penalty": (_one, "1.0"),
    "truncate_prompt_tokens": (_none, "null"),
    "spaces_between_special_tokens": (lambda v: v is None or v is True, "true"),
    "logits_processors": (_empty, "null"),
    "priority": (_zero, "0"),
    "cache_salt": (_none, "null"),
    "vllm_xargs": (_empty, "null"),
    "return_tokens_as_token_ids": (_falsy, "false"),
    "return_token_ids": (_falsy, "false"),
    # chat
    "functions": (_empty, "null (use tools)"),
    "function_call": (lambda v: v in (None, "none", "auto"), '"none" (use tool_choice)'),
    "continue_final_message": (_falsy, "false"),
    "chat_template": (_none, "null"),
    "documents": (_empty, "null"),
    "reasoning_effort": (_none, "null"),
    # completions
    "suffix": (_none, "null"),
    "best_of": (_one, "1"),
    "prompt_embeds": (_none, "null"),
}

# SamplingParams's error messages start with the field they are about.
_SAMPLING_FIELDS = {"n", "temperature", "top_p", "top_k", "max_tokens", "min_tokens", "logprobs", "stop",
                    "stop_token_ids", "seed", "presence_penalty", "frequency_penalty", "repetition_penalty",
                    "logit_bias", "min_p", "allowed_token_ids", "prompt_logprobs"}


class StreamOptions(OpenAIBaseModel):
    include_usage: bool | None = True
    continuous_usage_stats: bool | None = False


class ResponseFormat(OpenAIBaseModel):
    """OpenAI's ``response_format``: ``{"type": "text"}``, ``{"type": "json_object"}`` or
    ``{"type": "json_schema", "json_schema": {"name", "schema", "strict"?, "description"?}}``."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _schema_given(self):
        if self.type == "json_schema":
            schema = (self.json_schema or {}).get("schema")
            if not isinstance(schema, dict):
                raise ValueError('response_format of type "json_schema" needs {"json_schema": {"name": ..., '
                                 '"schema": {...}}} with the schema as an object')
        return self

    def structured_outputs(self) -> dict[str, Any]:
        """As ``StructuredOutputsParams`` keyword arguments (type "json_object" or "json_schema")."""
        if self.type == "json_object":
            return {"json_object": True}
        return {"json": self.json_schema["schema"]}


class _GenerationRequest(OpenAIBaseModel):
    """Fields and ``to_sampling_params`` shared by chat and text completions (vLLM's names)."""

    model: str | None = None
    n: int | None = 1
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = Field(None, ge=0, le=_SEED_MAX)
    stop: list[str] = Field(default_factory=list)
    stop_token_ids: list[int] = Field(default_factory=list)
    ignore_eos: bool = False
    min_tokens: int = Field(0, ge=0)
    skip_special_tokens: bool = True
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    user: str | None = None  # accepted and unused, as in vLLM
    include_stop_str_in_output: bool = False
    echo: bool | None = False

    # Penalties and biases (SamplingParams checks the ranges; unset: the checkpoint's
    # generation_config.json default, else off).
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    min_p: float | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    prompt_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    # Time limits in seconds (MindIE's e2eTimeout / tokenTimeout per request): they may lower the
    # server's --request-timeout / --token-timeout, not raise them.
    request_timeout: float | None = Field(None, gt=0, allow_inf_nan=False)
    token_timeout: float | None = Field(None, gt=0, allow_inf_nan=False)

    # Structured output: at most one of these (structured_outputs_params()).
    response_format: ResponseFormat | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: str | dict[str, Any] | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None

    # Accepted only with their neutral value (_NEUTRAL_ONLY).
    use_beam_search: bool | None = False
    length_penalty: float | None = 1.0
    truncate_prompt_tokens: Any = None
    spaces_between_special_tokens: bool | None = True
    logits_processors: Any = None
    priority: int | None = 0
    cache_salt: Any = None
    # KV connectors (docs/kv-transfer.md): a PD proxy's {"do_remote_decode": true} to a producer,
    # or the producer's answer to a consumer; handed to the engine request as given.
    kv_transfer_params: dict[str, Any] | None = None
    vllm_xargs: Any = None
    return_tokens_as_token_ids: bool | None = None
    return_token_ids: bool | None = None

    @field_validator(*_NEUTRAL_ONLY, check_fields=False)
    @classmethod
    def _neutral_only(cls, value, info: ValidationInfo):
        is_neutral, neutral = _NEUTRAL_ONLY[info.field_name]
        if not is_neutral(value):
            raise ValueError(f"{info.field_name}={_short_repr(value)} is not supported yet; only {neutral} is accepted")
        return value

    @field_validator("stop", mode="before")
    @classmethod
    def _stop(cls, value):
        if value is None:
            return []
        if isinstance(value, str):
            value = [value]
        if not isinstance(value, list) or not all(isinstance(s, str) for s in value):
            raise ValueError(f"stop must be a string or a list of strings, got {_short_repr(value)}")
        if any(not s for s in value):
            raise ValueError("stop cannot contain an empty string")
        return value

    @field_validator("stop_token_ids", mode="before")
    @classmethod
    def _stop_token_ids(cls, value):
        return [] if value is None else value

    @field_validator("stop_token_ids")
    @classmethod
    def _stop_token_ids_non_negative(cls, value):
        if any(t < 0 for t in value):
            raise ValueError(f"stop_token_ids must be token ids >= 0, got {_short_repr(value)}")
        return value

    @field_validator("bad_words")
    @classmethod
    def _bad_words(cls, value):
        if value is not None and any(not w.strip() for w in value):
            raise ValueError("bad_words cannot contain an empty or blank string")
        return value

    @field_validator("prompt_logprobs")
    @classmethod
    def _prompt_logprobs_not_streamed(cls, value, info: ValidationInfo):
        # vLLM refuses it too: the prompt's logprobs would have no chunk of their own.
        if value is not None and info.data.get("stream"):
            raise ValueError("prompt_logprobs is not available when stream is enabled")
        return value

    @field_validator("stream_options")
    @classmethod
    def _stream_options_need_stream(cls, value, info: ValidationInfo):
        # As vLLM: an empty object is as good as none.
        if value is not None and value.model_fields_set and not info.data.get("stream"):
            raise ValueError("Stream options can only be defined when `stream=True`.")
        return value

    # -- for the server --------------------------------------------------------------------------

    @property
    def include_usage(self) -> bool:
        """Whether a stream ends with a usage chunk (OpenAI's ``stream_options.include_usage``)."""
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage_stats(self) -> bool:
        """Whether every stream chunk carries usage (vLLM's ``continuous_usage_stats``)."""
        return bool(self.include_usage and self.stream_options.continuous_usage_stats)

    def _max_tokens_param(self) -> str:
        return "max_tokens"

    def _requested_max_tokens(self) -> int | None:
        raise NotImplementedError

    def _max_tokens_explicit(self) -> bool:
        raise NotImplementedError

    def _logprobs_k(self) -> int | None:
        raise NotImplementedError

    @property
    def requested_max_tokens(self) -> int | None:
        """The output limit the client set explicitly (None: unset), for
        ``check_context_length(prompt_len, max_model_len, request.requested_max_tokens,
        max_tokens_param=request.max_tokens_param)``."""
        return self._requested_max_tokens() if self._max_tokens_explicit() else None

    @property
    def max_tokens_param(self) -> str:
        """The name of the field that set the output limit, for error messages."""
        return self._max_tokens_param()

    def structured_outputs_params(self) -> tuple[StructuredOutputsParams, str] | None:
        """What the output must match and the field that asked for it, from whichever one of
        ``structured_outputs``, vLLM's older ``guided_*`` fields or ``response_format`` (json_object /
        json_schema) the request sets; None when it sets none (or ``response_format`` "text").
        Two of them at once is an ``InvalidRequestError``: which one should win is not ours to guess."""
        asked: list[tuple[str, dict[str, Any]]] = []
        if self.structured_outputs is not None:
            asked.append(("structured_outputs", dict(self.structured_outputs)))
        for name, key in (("guided_json", "json"), ("guided_regex", "regex"), ("guided_choice", "choice"),
                          ("guided_grammar", "grammar")):
            if getattr(self, name) is not None:
                asked.append((name, {key: getattr(self, name)}))
        if self.response_format is not None and self.response_format.type != "text":
            asked.append(("response_format", self.response_format.structured_outputs()))
        if not asked:
            return None
        if len(asked) > 1:
            raise InvalidRequestError(f"{' and '.join(name for name, _ in asked)} both constrain the output; "
                                      "send only one of them", param=asked[1][0])
        name, spec = asked[0]
        try:
            return StructuredOutputsParams(**spec), name
        except TypeError:
            raise InvalidRequestError(f"{name}: unknown keys {sorted(spec)}; expected one of json, regex, choice, "
                                      "grammar, json_object", param=name) from None
        except ValueError as error:
            raise InvalidRequestError(f"{name}: {error}", param=name) from None

    def to_sampling_params(self, default_max_tokens: int,
                           generation_defaults: Mapping[str, Any] | None = None) -> SamplingParams:
        """The engine's ``SamplingParams`` for this request.

        ``default_max_tokens`` is what fits the context window after the prompt
        (max_model_len - prompt length). An explicit ``max_tokens`` above it is refused (vLLM
        refuses it too; ``check_context_length`` gives vLLM's exact message); an implicit one
        (completions' default 16) is clamped to it. ``generation_defaults`` is the checkpoint's
        ``generation_config.json`` contents (raw, or as ``generation_defaults_from_config``
        returns them): its temperature / top_p / top_k apply where the request leaves the field
        unset, its ``max_new_tokens`` caps the output; neither set: temperature 1.0, top_p 1.0,
        top_k off. Raises ``InvalidRequestError`` (a ValueError) naming the field at fault."""
        defaults, _ = generation_defaults_from_config(generation_defaults)
        max_tokens = fit_max_tokens(self._requested_max_tokens(), default_max_tokens,
                                    explicit=self._max_tokens_explicit(), cap=defaults.get("max_tokens"),
                                    param=self._max_tokens_param())

        def pick(name: str, neutral):
            value = getattr(self, name)
            return value if value is not None else defaults.get(name, neutral)

        try:
            return SamplingParams(
                n=1 if self.n is None else self.n,
                temperature=pick("temperature", 1.0),
                top_p=pick("top_p", 1.0),
                top_k=pick("top_k", 0),
                seed=self.seed,
                max_tokens=max_tokens,
                min_tokens=self.min_tokens,
                stop=list(self.stop),
                stop_token_ids=list(self.stop_token_ids),
                ignore_eos=self.ignore_eos,
                logprobs=self._logprobs_k(),
                skip_special_tokens=self.skip_special_tokens,
                include_stop_str_in_output=self.include_stop_str_in_output,
                presence_penalty=0.0 if self.presence_penalty is None else self.presence_penalty,
                frequency_penalty=0.0 if self.frequency_penalty is None else self.frequency_penalty,
                repetition_penalty=pick("repetition_penalty", 1.0),
                min_p=pick("min_p", 0.0),
                logit_bias=self.logit_bias or {},
                allowed_token_ids=self.allowed_token_ids,
                prompt_logprobs=self.prompt_logprobs,
            )
        except ValueError as exc:
            match = re.match(r"[a-z_]+", str(exc))
            param = match.group(0) if match and match.group(0) in _SAMPLING_FIELDS else None
            if param == "max_tokens":
                param = self._max_tokens_param()
            raise InvalidRequestError(str(exc), param=param) from exc


# -- chat completions --------------------------------------------------------------------------------

Role = Literal["system", "user", "assistant", "tool", "developer"]

_UNSUPPORTED_PART_TYPES = ("file",)
_IMAGE_DETAILS = ("auto", "low", "high")


def _check_part(item, where: str):
    """One content part, in OpenAI's or MindIE's spelling; returned unchanged (the input
    builders read both), except that a bare string becomes a text part."""
    if isinstance(item, str):
        return {"type": "text", "text": item}
    if not isinstance(item, dict):
        raise ValueError(f"{where}: a content part must be an object, got {type(item).__name__}")
    kind = item.get("type")
    if kind is None:  # MindIE's spelling: the key names the kind
        kind = "text" if "text" in item else "image" if "image" in item else "audio" if "audio" in item else \
            "video" if "video" in item else None
        if kind is None:
            raise ValueError(f"{where}: {unknown_part_keys(item)}")
    if kind == "text":
        if not isinstance(item.get("text"), str):
            raise ValueError(f"{where}: a text part needs a string 'text'")
    elif kind == "image_url":
        image_url = item.get("image_url")
        url = image_url.get("url") if isinstance(image_url, dict) else image_url
        if not isinstance(url, str) or not url:
            raise ValueError(f'{where}: an image_url part needs {{"image_url": {{"url": "..."}}}}')
        detail = image_url.get("detail") if isinstance(image_url, dict) else None
        if detail is not None and detail not in _IMAGE_DETAILS:
            raise ValueError(f"{where}: image_url.detail must be one of {', '.join(_IMAGE_DETAILS)}, got {detail!r}")
    elif kind == "image":
        ref = item.get("image")
        if not isinstance(ref, str) or not ref:
            raise ValueError(f'{where}: an image part needs {{"image": "<path, URL or base64>"}}')
    elif kind in AUDIO_PART_TYPES or kind in VIDEO_PART_TYPES:
        pass  # input_builders.conversation checks it (parse_audio_part, parse_video_part), with the model's own
        # refusal if it takes none
    elif kind in _UNSUPPORTED_PART_TYPES:
        raise ValueError(f"{where}: content type {kind!r} is not supported; only text, images, video and audio are")
    else:
        raise ValueError(f"{where}: {unknown_part_type(_short_repr(kind))}")
    return item


class ChatMessageParam(OpenAIBaseModel):
    """One message: ``content`` is a string or a list of parts (``{"type": "text", "text"}``,
    ``{"type": "image_url", "image_url": {"url", "detail"?}}``, MindIE's ``{"text": ...}`` /
    ``{"image": ...}``); null only on an assistant message."""

    role: Role
    content: Any = None
    name: str | None = None
    tool_calls: list[ToolCallParam] | None = None  # an assistant message's calls
    tool_call_id: str | None = None  # a tool message: the call it answers

    @field_validator("content")
    @classmethod
    def _content(cls, value):
        if value is None or isinstance(value, str):
            return value
        if isinstance(value, dict):  # a single part, as some clients send
            value = [value]
        if not isinstance(value, list):
            raise ValueError(f"content must be a string or a list of content parts, got {type(value).__name__}")
        return [_check_part(item, f"part {index}") for index, item in enumerate(value)]

    @model_validator(mode="after")
    def _content_required(self):
        if self.content is None and self.role != "assistant":
            raise ValueError(f"content is required for a {self.role!r} message")
        if self.tool_calls and self.role != "assistant":
            raise ValueError(f"only an assistant message can have tool_calls, not a {self.role!r} one")
        return self

    def to_dict(self) -> dict[str, Any]:
        """As the input builders take it (``tool_calls`` / ``tool_call_id`` / ``name`` only when set)."""
        message: dict[str, Any] = {"role": "system" if self.role == "developer" else self.role,
                                   "content": "" if self.content is None else self.content}
        if self.tool_calls:
            message["tool_calls"] = [call.model_dump() for call in self.tool_calls]
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        if self.name is not None:
            message["name"] = self.name
        return message


class FunctionCallParam(OpenAIBaseModel):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCallParam(OpenAIBaseModel):
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCallParam


class FunctionDefinition(OpenAIBaseModel):
    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolParam(OpenAIBaseModel):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class ChatCompletionRequest(_GenerationRequest):
    messages: list[ChatMessageParam]
    max_tokens: int | None = Field(None, ge=1)  # deprecated by OpenAI in favour of max_completion_tokens
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool | None = False
    top_logprobs: int | None = Field(0, ge=0, le=MAX_TOP_LOGPROBS)
    add_generation_prompt: bool = True
    add_special_tokens: bool = False  # the chat template adds them (vLLM's default)
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[ToolParam] | None = None
    # "none" | "auto" | "required" | {"type": "function", "function": {"name": ...}}; unset: "auto"
    # with tools, else "none" (OpenAI's default).
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None

    # Accepted only with their neutral value (_NEUTRAL_ONLY).
    functions: Any = None
    function_call: Any = None
    continue_final_message: bool | None = False
    chat_template: Any = None
    documents: Any = None
    reasoning_effort: Any = None
    # vLLM's per-request preprocessing overrides: the video sampling options (fps, nframes,
    # min_frames, max_frames, min_pixels, max_pixels, total_pixels; input_builders.video), bounded there.
    mm_processor_kwargs: dict[str, Any] | None = None

    @field_validator("messages")
    @classmethod
    def _messages_non_empty(cls, value):
        if not value:
            raise ValueError("messages must contain at least one message")
        return value

    @field_validator("top_logprobs")
    @classmethod
    def _top_logprobs_need_logprobs(cls, value, info: ValidationInfo):
        if value and not info.data.get("logprobs"):
            raise ValueError("when using `top_logprobs`, `logprobs` must be set to true.")
        return value

    def _max_tokens_param(self) -> str:
        return "max_completion_tokens" if self.max_completion_tokens is not None else "max_tokens"

    def _requested_max_tokens(self) -> int | None:
        # max_completion_tokens is OpenAI's current name; it wins when both are sent.
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens
        return self.max_tokens

    def _max_tokens_explicit(self) -> bool:
        return self._requested_max_tokens() is not None

    def _logprobs_k(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    @property
    def effective_tool_choice(self) -> str | dict[str, Any]:
        """OpenAI's default when unset: "auto" with tools, "none" without."""
        if self.tool_choice is not None:
            return self.tool_choice
        return "auto" if self.tools else "none"

    @property
    def tool_dicts(self) -> list[dict[str, Any]] | None:
        return [tool.model_dump(exclude_none=True) for tool in self.tools] if self.tools else None

    def to_conversation(self) -> list[dict[str, Any]]:
        """The messages as dicts for the input builders: ``{"role", "content"}`` plus
        ``tool_calls`` / ``tool_call_id`` / ``name`` where set. "developer" becomes "system"
        (OpenAI's newer name for it; chat templates know only "system"); a null assistant content
        becomes ""."""
        return [message.to_dict() for message in self.messages]


# -- text completions --------------------------------------------------------------------------------


def _is_token_ids(value) -> bool:
    return isinstance(value, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in value)


class CompletionRequest(_GenerationRequest):
    """``prompt`` is normalised to one prompt: a string or a list of token ids."""

    prompt: str | list[int]
    max_tokens: int | None = Field(16, ge=1)  # OpenAI's and vLLM's default for completions
    logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    add_special_tokens: bool = True

    # Accepted only with their neutral value (_NEUTRAL_ONLY).
    suffix: Any = None
    best_of: int | None = None
    prompt_embeds: Any = None
    mm_processor_kwargs: Any = None  # a completion prompt has no media: only null or {} is accepted

    @field_validator("mm_processor_kwargs")
    @classmethod
    def _no_media_options(cls, value):
        if not _empty(value):
            raise ValueError(f"mm_processor_kwargs={_short_repr(value)} is not supported yet; only null is accepted")
        return value

    @field_validator("prompt", mode="before")
    @classmethod
    def _one_prompt(cls, value):
        if isinstance(value, str):
            if not value:
                raise ValueError("prompt must not be empty")
            return value
        if not isinstance(value, list) or not value:
            raise ValueError("prompt must be a non-empty string, a list of token ids, or a list holding one of them")
        if _is_token_ids(value):
            prompts = [value]
        elif all(isinstance(p, str) for p in value) or all(_is_token_ids(p) for p in value):
            prompts = value
        else:
            raise ValueError("prompt must be a string, a list of strings, a list of token ids "
                             "or a list of token-id lists")
        # One engine request per HTTP request keeps streaming, usage and cancellation per request.
        if len(prompts) != 1:
            raise ValueError(f"got {len(prompts)} prompts; only one prompt per request is supported "
                             "(send one request per prompt)")
        prompt = prompts[0]
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt must not be empty")
            return prompt
        if not prompt:
            raise ValueError("prompt must not be an empty list of token ids")
        if any(t < 0 for t in prompt):
            raise ValueError("prompt token ids must be >= 0")
        return prompt

    def _requested_max_tokens(self) -> int | None:
        return self.max_tokens

    def _max_tokens_explicit(self) -> bool:
        return "max_tokens" in self.model_fields_set and self.max_tokens is not None

    def _logprobs_k(self) -> int | None:
        return self.logprobs


# -- tokenize / detokenize ---------------------------------------------------------------------------


class TokenizeRequest(OpenAIBaseModel):
    """vLLM's two forms in one model: ``prompt`` (+ ``add_special_tokens``, default true) or
    ``messages`` (+ ``add_generation_prompt``, ``chat_template_kwargs``; ``add_special_tokens``
    default false, as the chat template adds them)."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessageParam] | None = None
    add_special_tokens: bool | None = None
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None
    return_token_strs: bool | None = False
    continue_final_message: bool = False
    chat_template: Any = None

    @field_validator("continue_final_message", "chat_template")
    @classmethod
    def _neutral_only(cls, value, info: ValidationInfo):
        is_neutral, neutral = _NEUTRAL_ONLY[info.field_name]
        if not is_neutral(value):
            raise ValueError(f"{info.field_name}={_short_repr(value)} is not supported yet; only {neutral} is accepted")
        return value

    @model_validator(mode="after")
    def _one_form(self):
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of 'prompt' (text) or 'messages' (a chat)")
        if self.messages is not None and not self.messages:
            raise ValueError("messages must contain at least one message")
        return self

    @property
    def is_chat(self) -> bool:
        return self.messages is not None

    @property
    def effective_add_special_tokens(self) -> bool:
        if self.add_special_tokens is not None:
            return self.add_special_tokens
        return not self.is_chat

    def to_conversation(self) -> list[dict[str, Any]]:
        """As ``ChatCompletionRequest.to_conversation``."""
        if self.messages is None:
            raise ValueError("not a chat tokenize request")
        return [{"role": "system" if m.role == "developer" else m.role,
                 "content": "" if m.content is None else m.content} for m in self.messages]


class TokenizeResponse(OpenAIBaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(OpenAIBaseModel):
    model: str | None = None
    tokens: list[int]

    @field_validator("tokens")
    @classmethod
    def _non_negative(cls, value):
        if any(t < 0 for t in value):
            raise ValueError("tokens must be token ids >= 0")
        return value


class DetokenizeResponse(OpenAIBaseModel):
    prompt: str


# -- responses ---------------------------------------------------------------------------------------


class PromptTokenUsageInfo(OpenAIBaseModel):
    cached_tokens: int | None = None


class UsageInfo(OpenAIBaseModel):
    prompt_tokens: int = 0
    total_tokens: int = 0
    completion_tokens: int | None = 0
    prompt_tokens_details: PromptTokenUsageInfo | None = None

    @classmethod
    def from_counts(cls, prompt_tokens: int, completion_tokens: int, cached_tokens: int | None = None) -> UsageInfo:
        details = None if cached_tokens is None else PromptTokenUsageInfo(cached_tokens=cached_tokens)
        return cls(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                   total_tokens=prompt_tokens + completion_tokens, prompt_tokens_details=details)


class ChatCompletionLogProb(OpenAIBaseModel):
    token: str
    logprob: float = _LOGPROB_FLOOR
    bytes: list[int] | None = None


class ChatCompletionLogProbsContent(ChatCompletionLogProb):
    top_logprobs: list[ChatCompletionLogProb] = Field(default_factory=list)


class ChatCompletionLogProbs(OpenAIBaseModel):
    content: list[ChatCompletionLogProbsContent] | None = None


class FunctionCall(OpenAIBaseModel):
    name: str
    arguments: str


class ToolCall(OpenAIBaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class DeltaFunctionCall(OpenAIBaseModel):
    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(OpenAIBaseModel):
    """A piece of a streamed tool call: the first one of a call carries ``id``, ``type`` and the
    function's name; later ones add to its ``arguments``."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall | None = None


class ChatMessage(OpenAIBaseModel):
    role: str
    content: str | None = None
    refusal: str | None = None
    tool_calls: list[ToolCall] = Field(default_factory=list)
    reasoning_content: str | None = None


class DeltaMessage(OpenAIBaseModel):
    role: str | None = None
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[DeltaToolCall] = Field(default_factory=list)


class ChatCompletionResponseChoice(OpenAIBaseModel):
    index: int
    message: ChatMessage
    logprobs: ChatCompletionLogProbs | None = None
    finish_reason: str | None = "stop"
    stop_reason: int | str | None = None  # vLLM's: the stop string or token id that ended it


class ChatCompletionResponse(OpenAIBaseModel):
    id: str = Field(default_factory=lambda: f"chatcmpl-{random_uuid()}")
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatCompletionResponseChoice]
    system_fingerprint: str | None = None
    usage: UsageInfo
    prompt_logprobs: list[dict[str, PromptLogprob] | None] | None = None
    kv_transfer_params: dict[str, Any] | None = None  # a PD producer's: where its KV lies


class ChatCompletionResponseStreamChoice(OpenAIBaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatCompletionLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionStreamResponse(OpenAIBaseModel):
    """One SSE chunk. vLLM serialises chunks with ``model_dump_json(exclude_unset=True)``, so a
    delta carries only the fields set on it."""

    id: str = Field(default_factory=lambda: f"chatcmpl-{random_uuid()}")
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatCompletionResponseStreamChoice]
    usage: UsageInfo | None = None


class CompletionLogProbs(OpenAIBaseModel):
    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class PromptLogprob(OpenAIBaseModel):
    """One entry of vLLM's ``prompt_logprobs``: per prompt position, a map of token id (as a
    string: JSON keys) -> this; the prompt's own token first, then the top N."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


class CompletionResponseChoice(OpenAIBaseModel):
    index: int
    text: str
    logprobs: CompletionLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    prompt_logprobs: list[dict[str, PromptLogprob] | None] | None = None


class CompletionResponse(OpenAIBaseModel):
    id: str = Field(default_factory=lambda: f"cmpl-{random_uuid()}")
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionResponseChoice]
    system_fingerprint: str | None = None
    usage: UsageInfo
    kv_transfer_params: dict[str, Any] | None = None  # a PD producer's: where its KV lies


class CompletionResponseStreamChoice(OpenAIBaseModel):
    index: int
    text: str
    logprobs: CompletionLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class CompletionStreamResponse(OpenAIBaseModel):
    id: str = Field(default_factory=lambda: f"cmpl-{random_uuid()}")
    object: str = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionResponseStreamChoice]
    usage: UsageInfo | None = None


class ModelPermission(OpenAIBaseModel):
    id: str = Field(default_factory=lambda: f"modelperm-{random_uuid()}")
    object: str = "model_permission"
    created: int = Field(default_factory=lambda: int(time.time()))
    allow_create_engine: bool = False
    allow_sampling: bool = True
    allow_logprobs: bool = True
    allow_search_indices: bool = False
    allow_view: bool = True
    allow_fine_tuning: bool = False
    organization: str = "*"
    group: str | None = None
    is_blocking: bool = False


class ModelCard(OpenAIBaseModel):
    id: str
    object: str = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "atb-plugin"
    root: str | None = None
    parent: str | None = None
    max_model_len: int | None = None
    permission: list[ModelPermission] = Field(default_factory=list)


class LoadLoRAAdapterRequest(OpenAIBaseModel):
    """vLLM's POST /v1/load_lora_adapter body (docs/lora.md)."""

    lora_name: str = Field(min_length=1)
    lora_path: str = Field(min_length=1)
    base_model_name: str | None = None
    model: str | None = None


class UnloadLoRAAdapterRequest(OpenAIBaseModel):
    lora_name: str = Field(min_length=1)
    lora_int_id: int | None = None
    model: str | None = None


class ModelList(OpenAIBaseModel):
    object: str = "list"
    data: list[ModelCard] = Field(default_factory=list)


# -- logprobs ----------------------------------------------------------------------------------------


def _clamp(logprob: float) -> float:
    return _LOGPROB_FLOOR if math.isnan(logprob) else max(float(logprob), _LOGPROB_FLOOR)


def _chat_logprob(text: str, logprob: float) -> ChatCompletionLogProb:
    return ChatCompletionLogProb(token=text, logprob=_clamp(logprob),
                                 bytes=list(text.encode("utf-8", errors="replace")))


def chat_logprobs(entries: Sequence[LogprobsEntry], token_to_text: Callable[[int], str]) -> ChatCompletionLogProbs:
    """Chat's ``{"content": [{"token", "logprob", "bytes", "top_logprobs": [...]}]}`` for the
    sampled tokens ``entries`` (one per token, in order). ``top_logprobs`` lists the N most likely
    tokens, most likely first (OpenAI's meaning; vLLM's list starts with the sampled token, which
    is the same list whenever the sampled token is among the N). -inf becomes -9999.0."""
    content = []
    for entry in entries:
        text = token_to_text(entry.token_id)
        content.append(ChatCompletionLogProbsContent(
            token=text, logprob=_clamp(entry.logprob), bytes=list(text.encode("utf-8", errors="replace")),
            top_logprobs=[_chat_logprob(token_to_text(t), lp)
                          for t, lp in zip(entry.top_token_ids, entry.top_logprobs)],
        ))
    return ChatCompletionLogProbs(content=content)


def prompt_logprobs(entries: Sequence[LogprobsEntry | None],
                    token_to_text: Callable[[int], str]) -> list[dict[str, PromptLogprob] | None]:
    """vLLM's ``prompt_logprobs``: None for the first prompt token, then per position
    ``{token id: {"logprob", "rank", "decoded_token"}}`` for the prompt's token and the top N."""
    result: list[dict[str, PromptLogprob] | None] = []
    for entry in entries:
        if entry is None:
            result.append(None)
            continue
        position = {str(entry.token_id): PromptLogprob(logprob=_clamp(entry.logprob), rank=entry.rank,
                                                       decoded_token=token_to_text(entry.token_id))}
        for rank, (token_id, logprob) in enumerate(zip(entry.top_token_ids, entry.top_logprobs), start=1):
            position.setdefault(str(token_id), PromptLogprob(logprob=_clamp(logprob), rank=rank,
                                                             decoded_token=token_to_text(token_id)))
        result.append(position)
    return result


def completion_logprobs(entries: Sequence[LogprobsEntry | None], token_to_text: Callable[[int], str],
                        initial_text_offset: int = 0, token_ids: Sequence[int] | None = None) -> CompletionLogProbs:
    """Completions' ``{"tokens", "token_logprobs", "top_logprobs", "text_offset"}`` as vLLM
    builds it: each ``top_logprobs`` dict holds the sampled token first, then the N most likely
    (keyed by text, so a token already present is not repeated); ``text_offset`` counts
    characters from ``initial_text_offset`` (for a stream chunk: the length of the text already
    sent). A None entry (an echoed prompt's first token, which nothing predicts) has null
    logprobs; its token is ``token_ids[i]``."""
    result = CompletionLogProbs()
    offset = initial_text_offset
    for i, entry in enumerate(entries):
        if entry is None:
            text = token_to_text(token_ids[i])
            result.tokens.append(text)
            result.token_logprobs.append(None)
            result.top_logprobs.append(None)
        else:
            text = token_to_text(entry.token_id)
            top = {text: _clamp(entry.logprob)}
            for token_id, logprob in zip(entry.top_token_ids, entry.top_logprobs):
                top.setdefault(token_to_text(token_id), _clamp(logprob))
            result.tokens.append(text)
            result.token_logprobs.append(_clamp(entry.logprob))
            result.top_logprobs.append(top)
        result.text_offset.append(offset)
        offset += len(text)
    return result
