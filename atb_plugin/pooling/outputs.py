"""What a pooling request returns (vLLM's output classes): ``PoolingRequestOutput`` with the raw
tensor, and typed views per task that ``LLM.embed / classify / score / reward`` return."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

__all__ = ["PoolingOutput", "PoolingRequestOutput", "EmbeddingOutput", "EmbeddingRequestOutput",
           "ClassificationOutput", "ClassificationRequestOutput", "ScoringOutput", "ScoringRequestOutput"]


@dataclass
class PoolingOutput:
    data: np.ndarray | None  # float32: (D,) per sequence, (n_tokens, D) per token; None if it failed


@dataclass
class PoolingRequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    outputs: PoolingOutput
    finished: bool
    error: str | None = None
    finish_reason: str | None = None  # "stop" with a result; "abort" / "error" without
    queue_time: float | None = None


@dataclass
class EmbeddingOutput:
    embedding: list[float]

    @property
    def hidden_size(self) -> int:
        return len(self.embedding)


@dataclass
class EmbeddingRequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    outputs: EmbeddingOutput
    finished: bool = True

    @classmethod
    def from_base(cls, base: PoolingRequestOutput) -> "EmbeddingRequestOutput":
        return cls(base.request_id, base.prompt_token_ids, EmbeddingOutput(base.outputs.data.tolist()))


@dataclass
class ClassificationOutput:
    probs: list[float]  # softmax over the labels (sigmoid for one label); raw logits with activation off

    @property
    def num_classes(self) -> int:
        return len(self.probs)


@dataclass
class ClassificationRequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    outputs: ClassificationOutput
    finished: bool = True

    @classmethod
    def from_base(cls, base: PoolingRequestOutput) -> "ClassificationRequestOutput":
        return cls(base.request_id, base.prompt_token_ids, ClassificationOutput(base.outputs.data.tolist()))


@dataclass
class ScoringOutput:
    score: float


@dataclass
class ScoringRequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    outputs: ScoringOutput
    finished: bool = True
