"""What a pooling request returns (vLLM's output classes): ``PoolingRequestOutput`` with the raw
tensor, and typed views per task that ``LLM.embed / classify / score / reward`` return."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

__all__ = ["cosine_similarity", "PoolingOutput", "PoolingRequestOutput", "EmbeddingOutput", "EmbeddingRequestOutput",
           "ClassificationOutput", "ClassificationRequestOutput", "ScoringOutput", "ScoringRequestOutput"]


def cosine_similarity(u, v) -> float:
    """How an embedding model scores a pair (``LLM.score``, ``/score``, ``/rerank``): in float64,
    0 for a zero vector."""
    u, v = np.asarray(u, dtype=np.float64), np.asarray(v, dtype=np.float64)
    norm = float(np.linalg.norm(u) * np.linalg.norm(v))
    return float(np.dot(u, v) / norm) if norm else 0.0


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
class ClassificationOutput:
    probs: list[float]  # softmax over the labels (sigmoid for one label); raw logits with activation off

    @property
    def num_classes(self) -> int:
        return len(self.probs)


@dataclass
class ScoringOutput:
    score: float


@dataclass
class _TaskRequestOutput:
    """A finished pooling request with its result in the task's type (``outputs``)."""

    request_id: str
    prompt_token_ids: list[int]
    outputs: object
    finished: bool = True

    output_type = None  # set by each subclass: the class ``outputs`` is built with

    @classmethod
    def from_base(cls, base: PoolingRequestOutput):
        return cls(base.request_id, base.prompt_token_ids, cls.output_type(base.outputs.data.tolist()))


class EmbeddingRequestOutput(_TaskRequestOutput):
    outputs: EmbeddingOutput
    output_type = EmbeddingOutput


class ClassificationRequestOutput(_TaskRequestOutput):
    outputs: ClassificationOutput
    output_type = ClassificationOutput


class ScoringRequestOutput(_TaskRequestOutput):
    outputs: ScoringOutput
    output_type = ScoringOutput
