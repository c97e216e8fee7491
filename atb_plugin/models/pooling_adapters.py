"""Adapters: a generative family's class turned into a pooling model without editing it.

    Qwen2ForCausalLM ──as_embedding_model──►      Qwen2ForCausalLMForEmbedding
                     ──as_classification_model──► Qwen2ForCausalLMForClassification (+ ``score``)
                     ──as_reward_model──►         Qwen2ForCausalLMForReward        (+ ``score``)

Each adapted class drops ``lm_head`` (its checkpoint tensors are skipped on load), keeps every
other weight name, and answers ``build_pooler(pooler_config)`` with a ``DispatchPooler`` for the
tasks of its convert type (``config.CONVERT_TASKS``). Native pooling models (BERT, reward models
such as ``Qwen2ForRewardModel``) implement the same ``SupportsPooling`` contract themselves and
are used as they are.

A reranker can also be made from a plain causal LM: with ``classifier_from_token`` (two token
ids ``[false, true]`` in the config, e.g. through ``hf_overrides``) the classification head is
built at load time from two rows of the LM head, ``score = lm_head[true] − lm_head[false]`` with
one label, so ``sigmoid(score · h_last)`` is the model's P(true) against P(false).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from atb_plugin.models.interfaces import SupportsPooling
from atb_plugin.models.poolers import DispatchPooler, classifier_pooler, embedding_pooler
from atb_plugin.models.weights import IGNORE
from atb_plugin.pooling.config import CONVERT_TASKS, PoolerConfig

__all__ = ["PoolingModelMixin", "as_pooling_model", "as_embedding_model", "as_classification_model",
           "as_reward_model", "num_labels", "classification_poolers"]


def num_labels(hf_config: dict, default: int = 2) -> int:
    """Labels of a classification checkpoint: ``num_labels``, else ``id2label``'s size (what
    transformers saves), else ``default``."""
    if isinstance(hf_config.get("num_labels"), int):
        return hf_config["num_labels"]
    if isinstance(hf_config.get("id2label"), dict) and hf_config["id2label"]:
        return len(hf_config["id2label"])
    return default


def classification_poolers(config: PoolerConfig, classifier, tasks: Iterable[str]) -> DispatchPooler:
    """The poolers of a classifier model for ``tasks`` (classify, score: one row per request;
    token_classify: one row per token)."""
    return DispatchPooler({task: classifier_pooler(config, classifier, token_level=task == "token_classify")
                           for task in tasks})


class PoolingModelMixin:
    """Put first in the bases of a pooling model built on a generative class: no LM head (its
    checkpoint tensors are known and skipped), ``compute_logits`` refuses."""

    default_pooling_type = "LAST"  # a causal model's last token has seen the whole prompt

    def _drop_lm_head(self) -> None:
        self.get_language_model().lm_head = None  # a VL model's head lives in its language model

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        raise RuntimeError(f"{type(self).__name__} is a pooling model: it has no LM head")

    def _own_name(self, name: str) -> str | None:
        own = super()._own_name(name)
        if own and (own.startswith("lm_head.") or ".lm_head." in own):
            return IGNORE  # the dropped head's tensors: known, deliberately unused
        return own


def as_embedding_model(cls: type) -> type:
    class ForEmbedding(PoolingModelMixin, cls):
        def __init__(self, config):
            super().__init__(config)
            self._drop_lm_head()

        def build_pooler(self, pooler_config: PoolerConfig) -> DispatchPooler:
            return DispatchPooler({"embed": embedding_pooler(pooler_config),
                                   "token_embed": embedding_pooler(pooler_config, token_level=True)})

    ForEmbedding.__name__ = ForEmbedding.__qualname__ = f"{cls.__name__}ForEmbedding"
    return ForEmbedding


def as_classification_model(cls: type, labels: int, from_token_ids: tuple[int, int] | None = None,
                            tasks: tuple[str, ...] = CONVERT_TASKS["classify"], suffix: str = "ForClassification",
                            pooling_type: str = "LAST") -> type:
    """``score``: ``Linear(hidden, labels, bias=False)`` on the pooled hidden state (the
    ``*ForSequenceClassification`` checkpoints' head, loaded from ``score.weight``), or built from
    two LM-head rows when ``from_token_ids`` is given (then ``labels`` must be 1)."""
    if from_token_ids is not None and labels != 1:
        raise ValueError(f"a classifier built from two tokens has 1 label, not {labels}")

    class ForClassification(PoolingModelMixin, cls):
        default_pooling_type = pooling_type

        def __init__(self, config):
            super().__init__(config)
            if from_token_ids is None:
                self._drop_lm_head()  # a checkpoint head replaces it; otherwise it is read at load
            self.score = nn.Linear(config.hidden_size, labels, bias=False)

        def build_pooler(self, pooler_config: PoolerConfig) -> DispatchPooler:
            return classification_poolers(pooler_config, self.score, tasks)

        if from_token_ids is not None:
            def _own_name(self, name: str) -> str | None:
                return cls._own_name(self, name)  # lm_head is read, not skipped

            def load_weights(self, weights):
                rows: dict[str, torch.Tensor] = {}

                def tap(pairs):
                    for name, tensor in pairs:
                        if name in ("lm_head.weight", "model.embed_tokens.weight"):
                            rows[name] = tensor[list(from_token_ids)].clone()
                        yield name, tensor

                loaded = super().load_weights(tap(weights))
                head = rows.get("lm_head.weight", rows.get("model.embed_tokens.weight"))
                if head is None:
                    raise ValueError("classifier_from_token needs the LM head (lm_head.weight or tied embeddings)")
                with torch.no_grad():
                    self.score.weight.copy_((head[1] - head[0]).unsqueeze(0))
                self.lm_head = None  # only its two rows were needed
                return (loaded | {"score.weight"}) - {"lm_head.weight"}

    ForClassification.__name__ = ForClassification.__qualname__ = f"{cls.__name__}{suffix}"
    return ForClassification


def as_reward_model(cls: type, labels: int) -> type:
    """A per-token reward head (``score``, ``labels`` outputs, raw by default) over ALL tokens."""
    return as_classification_model(cls, labels, tasks=CONVERT_TASKS["reward"], suffix="ForReward", pooling_type="ALL")


def _from_token_ids(hf_config: dict) -> tuple[int, int] | None:
    ids = hf_config.get("classifier_from_token")
    if ids is None:
        return None
    if not (isinstance(ids, (list, tuple)) and len(ids) == 2 and all(isinstance(i, int) and i >= 0 for i in ids)):
        raise ValueError(f"classifier_from_token must be two token ids [false_id, true_id], got {ids!r}")
    vocab = hf_config.get("vocab_size")
    if isinstance(vocab, int) and any(i >= vocab for i in ids):
        raise ValueError(f"classifier_from_token {list(ids)} is outside the vocabulary (size {vocab})")
    return tuple(ids)


def as_pooling_model(cls: type, convert: str, hf_config: dict) -> type:
    """The class serving ``convert`` for a checkpoint whose registry class is ``cls``: native
    pooling classes as they are, generative ones through the adapter of ``convert``."""
    if issubclass(cls, SupportsPooling):
        return cls
    if convert == "embed":
        return as_embedding_model(cls)
    if convert == "classify":
        from_tokens = _from_token_ids(hf_config)
        return as_classification_model(cls, 1 if from_tokens else num_labels(hf_config), from_tokens)
    if convert == "reward":
        return as_reward_model(cls, num_labels(hf_config, default=1))
    raise ValueError(f"no pooling adapter for convert={convert!r}")
