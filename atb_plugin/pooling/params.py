"""``PoolingParams``: what one pooling request wants back (vLLM's names). No torch import: the
server's API process builds these and sends them to the engine core inside an
``EngineCoreRequest``.

    task            embed | token_embed | classify | token_classify | score
    dimensions      Matryoshka truncation of an embedding (embed / token_embed only)
    normalize       L2-normalise embeddings (default: the checkpoint's pooler config, usually on)
    activation      softmax / sigmoid on class logits (default: on for classify and score,
                    off for token_classify, so reward models return raw rewards)
"""

from __future__ import annotations

from dataclasses import dataclass

from atb_plugin.validation import check_bool, check_int

POOLING_TASKS = ("embed", "token_embed", "classify", "token_classify", "score")
EMBED_TASKS = ("embed", "token_embed")
TOKEN_TASKS = ("token_embed", "token_classify")  # one output row per prompt token

__all__ = ["PoolingParams", "POOLING_TASKS", "EMBED_TASKS", "TOKEN_TASKS"]


@dataclass
class PoolingParams:
    task: str = "embed"
    dimensions: int | None = None
    normalize: bool | None = None
    activation: bool | None = None

    def __post_init__(self):
        if self.task not in POOLING_TASKS:
            raise ValueError(f"task must be one of {', '.join(POOLING_TASKS)}; got {self.task!r}")
        if self.dimensions is not None:
            if self.task not in EMBED_TASKS:
                raise ValueError(f"dimensions applies to embeddings only, not to task {self.task!r}")
            self.dimensions = check_int("dimensions", self.dimensions, ">= 1")
            if self.dimensions < 1:
                raise ValueError(f"dimensions must be >= 1, got {self.dimensions}")
        for name in ("normalize", "activation"):
            if getattr(self, name) is not None:
                check_bool(name, getattr(self, name))
        if self.normalize is not None and self.task not in EMBED_TASKS:
            raise ValueError(f"normalize applies to embeddings only, not to task {self.task!r}")
        if self.activation is not None and self.task in EMBED_TASKS:
            raise ValueError(f"activation applies to classification and scores, not to task {self.task!r}")

    @property
    def use_activation(self) -> bool:
        if self.activation is not None:
            return self.activation
        return self.task != "token_classify"
