"""Request and response models of the pooling endpoints, in vLLM's field names.

    POST /v1/embeddings   EmbeddingRequest      -> EmbeddingResponse       (OpenAI's shape)
    POST /pooling         PoolingRequest        -> PoolingResponse
    POST /classify        ClassificationRequest -> ClassificationResponse
    POST /score           ScoreRequest          -> ScoreResponse           (also /v1/score)
    POST /rerank          RerankRequest         -> RerankResponse          (also /v1, /v2: Cohere / Jina)

``input`` takes what OpenAI's embeddings API takes: a string, a list of strings, a list of token
ids, or a list of token-id lists; the models normalise it to ``prompts`` (a list of strings or of
token-id lists), one engine request each. Like the generation models (``protocol``), unknown
fields are ignored and logged, and fields whose effect is not implemented are refused unless
neutral.
"""

from __future__ import annotations

import time
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from atb_plugin.pooling.inputs import score_pairs
from atb_plugin.server.protocol import OpenAIBaseModel, UsageInfo, _is_token_ids, _short_repr, random_uuid

__all__ = ["EmbeddingRequest", "PoolingRequest", "ClassificationRequest", "ScoreRequest", "RerankRequest",
           "EmbeddingResponseData", "EmbeddingResponse", "PoolingResponseData", "PoolingResponse",
           "ClassificationData", "ClassificationResponse", "ScoreResponseData", "ScoreResponse",
           "RerankDocument", "RerankResult", "RerankUsage", "RerankResponse", "normalize_inputs"]

_INPUT_SHAPES = "a string, a list of strings, a list of token ids, or a list of token-id lists"


def normalize_inputs(value, field: str = "input") -> list[str | list[int]]:
    """The prompts of an ``input`` value: strings, or token-id lists (ids checked later against
    the vocabulary). Empty strings pass (a BERT tokenizer still makes [CLS] [SEP]; a decoder's
    empty prompt is refused after tokenisation); an empty list does not."""
    if isinstance(value, str):
        return [value]
    if not isinstance(value, list) or not value:
        raise ValueError(f"{field} must be {_INPUT_SHAPES}, and not empty; got {_short_repr(value)}")
    if _is_token_ids(value):
        return [list(value)]
    if all(isinstance(item, str) for item in value):
        return list(value)
    if all(isinstance(item, list) and _is_token_ids(item) for item in value):
        if any(not item for item in value):
            raise ValueError(f"{field} holds an empty list of token ids")
        return [list(item) for item in value]
    raise ValueError(f"{field} must be {_INPUT_SHAPES} (not a mix); got {_short_repr(value)}")


class _PoolingInputRequest(OpenAIBaseModel):
    """What every ``input``-taking pooling request shares."""

    model: str | None = None
    input: Any
    truncate_prompt_tokens: int | None = None  # None: refuse inputs over max_model_len; -1: cut to it
    add_special_tokens: bool = True
    user: str | None = None  # accepted and unused, as in vLLM
    priority: int = 0

    @field_validator("input")
    @classmethod
    def _input(cls, value):
        return normalize_inputs(value)

    @field_validator("add_special_tokens")
    @classmethod
    def _special_tokens(cls, value):
        if value is not True:
            raise ValueError("add_special_tokens=false is not supported yet on pooling requests; only true is "
                             "accepted (a pooling model is trained on inputs with its special tokens)")
        return value

    @field_validator("priority")
    @classmethod
    def _priority(cls, value):
        if value != 0:
            raise ValueError(f"priority={value} is not supported yet; only 0 is accepted")
        return value

    @property
    def prompts(self) -> list[str | list[int]]:
        return self.input


class EmbeddingRequest(_PoolingInputRequest):
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(None, ge=1)
    normalize: bool | None = None
    messages: Any = None  # vLLM's chat-style embeddings input

    @model_validator(mode="before")
    @classmethod
    def _no_messages(cls, data):
        if isinstance(data, dict) and data.get("messages") is not None:
            raise ValueError("chat-style 'messages' input on /v1/embeddings is not supported yet; send the text "
                             "as 'input'")
        return data


class PoolingRequest(EmbeddingRequest):
    """vLLM's /pooling: any task the model serves (default: its first), raw tensors back."""

    task: str | None = None
    activation: bool | None = None


class ClassificationRequest(_PoolingInputRequest):
    activation: bool | None = None


def _texts(value, field: str) -> list[str]:
    if isinstance(value, str):
        return [value]
    if not isinstance(value, list) or not value or not all(isinstance(t, str) for t in value):
        raise ValueError(f"{field} must be a string or a non-empty list of strings; got {_short_repr(value)}")
    return list(value)


class ScoreRequest(OpenAIBaseModel):
    """``text_1`` against ``text_2``: one text against N (1 -> N) or pairwise (N -> N)."""

    model: str | None = None
    text_1: Any
    text_2: Any
    truncate_prompt_tokens: int | None = None
    activation: bool | None = None
    user: str | None = None

    @field_validator("text_1", "text_2")
    @classmethod
    def _text_lists(cls, value, info):
        return _texts(value, info.field_name)

    @model_validator(mode="after")
    def _pairing(self):
        score_pairs(self.text_1, self.text_2)  # 1 -> N or N -> N, else a ValueError (400)
        return self


class RerankRequest(OpenAIBaseModel):
    """Cohere's and Jina's rerank body: ``documents`` as strings (or ``{"text": ...}`` objects,
    Cohere v1's form); ``top_n`` 0 or absent returns every document."""

    model: str | None = None
    query: str
    documents: Any
    top_n: int | None = Field(None, ge=0)
    return_documents: bool = True  # vLLM always returns them; Cohere's clients may turn them off
    truncate_prompt_tokens: int | None = None
    activation: bool | None = None
    user: str | None = None

    @field_validator("documents")
    @classmethod
    def _documents(cls, value):
        if isinstance(value, list):
            value = [d["text"] if isinstance(d, dict) and isinstance(d.get("text"), str) and len(d) == 1 else d
                     for d in value]
        if not isinstance(value, list) or not value or not all(isinstance(d, str) for d in value):
            raise ValueError("documents must be a non-empty list of strings (or of {\"text\": ...} objects); got "
                             f"{_short_repr(value)}")
        return value


# -- responses ---------------------------------------------------------------------------------------


class EmbeddingResponseData(OpenAIBaseModel):
    index: int
    object: str = "embedding"
    embedding: list[float] | str  # str: base64 of the float32 little-endian bytes


class _ListResponse(OpenAIBaseModel):
    """The envelope vLLM's pooling responses share (the routes pass the request's id)."""

    id: str
    object: str = "list"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    usage: UsageInfo


class EmbeddingResponse(_ListResponse):
    data: list[EmbeddingResponseData]


class PoolingResponseData(OpenAIBaseModel):
    index: int
    object: str = "pooling"
    data: list[list[float]] | list[float] | str


class PoolingResponse(_ListResponse):
    data: list[PoolingResponseData]


class ClassificationData(OpenAIBaseModel):
    index: int
    label: str | None
    probs: list[float]
    num_classes: int


class ClassificationResponse(_ListResponse):
    data: list[ClassificationData]


class ScoreResponseData(OpenAIBaseModel):
    index: int
    object: str = "score"
    score: float


class ScoreResponse(_ListResponse):
    data: list[ScoreResponseData]


class RerankDocument(OpenAIBaseModel):
    text: str


class RerankResult(OpenAIBaseModel):
    index: int
    document: RerankDocument | None = None
    relevance_score: float


class RerankUsage(OpenAIBaseModel):
    total_tokens: int


class RerankResponse(OpenAIBaseModel):
    id: str = Field(default_factory=lambda: f"rerank-{random_uuid()}")
    model: str
    usage: RerankUsage
    results: list[RerankResult]
