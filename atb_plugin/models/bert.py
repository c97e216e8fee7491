"""BERT encoders (sentence-transformers/all-MiniLM-L6-v2 and the like): a batch of sequences
packed into one ``(T,)`` token row, segments given by ``cu_seqlens``::

    input_ids  = [s0 t0 .. t4 | s1 t0 .. t2 | s2 t0 .. t6]     cu_seqlens = [0, 5, 8, 15]

Embeddings = word + position (restarting at 0 in every sequence) + token type, then LayerNorm;
each layer is post-norm: ``LN(x + attn(x))`` with bidirectional attention inside each sequence
(``ops.varlen_attention``), then ``LN(h + W2·gelu(W1·h))``. ``forward`` returns the last hidden
states ``(T, hidden)``; pooling (mean, CLS, ...) is the caller's, ``pooled_output`` gives BERT's
own pooler (``tanh(dense(h[CLS]))``) where the checkpoint has one.

Parameter names are the checkpoint's (``embeddings.word_embeddings.weight``,
``encoder.layer.N.attention.self.query.weight`` ...; an optional ``bert.`` prefix is stripped) except
one fused projection, filled from the three separate ones::

    encoder.layer.N.attention.self.qkv = [query; key; value]   (weights and biases)

The legacy ``embeddings.position_ids`` buffer (transformers 4.x checkpoints) is accepted and
ignored. A checkpoint without ``pooler.*`` loads too: the model then has no pooler.

Served by the engine (``runner="pooling"``) as ``BertEmbeddingModel`` (``BertModel``
checkpoints: embed / token_embed) or ``BertForSequenceClassification`` (cross-encoders:
classify / score / token_classify, ``classifier(tanh(pooler(h[CLS])))``). Both take the engine's
model contract: a pooling step holds whole prompts, so its ``query_start_loc`` is ``cu_seqlens``,
and they keep no KV cache.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import nn

from atb_plugin import ops
from atb_plugin.distributed import TPShard, all_reduce, divide, tp_size
from atb_plugin.models.base import PretrainedModel
from atb_plugin.models.clip import HeadsSplitHidden, activation
from atb_plugin.models.linear import OTHER
from atb_plugin.models.parallel_layers import column_parallel_linear, join, row_parallel_linear
from atb_plugin.models.poolers import DispatchPooler, embedding_pooler
from atb_plugin.models.pooling_adapters import classification_poolers, num_labels
from atb_plugin.models.weights import IGNORE
from atb_plugin.pooling.config import CONVERT_TASKS, PoolerConfig

_QKV = {"query": ("qkv", 0), "key": ("qkv", 1), "value": ("qkv", 2)}
_BUFFERS = {"embeddings.position_ids"}  # known checkpoint tensors that are not parameters


@dataclass(frozen=True)
class BertConfig(HeadsSplitHidden):
    vocab_size: int
    hidden_size: int = 768
    num_hidden_layers: int = 12
    num_attention_heads: int = 12
    intermediate_size: int = 3072
    hidden_act: str = "gelu"
    max_position_embeddings: int = 512
    type_vocab_size: int = 2
    layer_norm_eps: float = 1e-12
    position_embedding_type: str = "absolute"
    num_labels: int = 2  # cross-encoders (BertForSequenceClassification) only

    def __post_init__(self):
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(f"BERT hidden_size {self.hidden_size} is not a multiple of "
                             f"num_attention_heads {self.num_attention_heads}")
        if self.position_embedding_type != "absolute":
            raise ValueError(f"position_embedding_type {self.position_embedding_type!r} is not supported (absolute)")
        activation(self.hidden_act)

    @classmethod
    def from_hf(cls, config: dict) -> "BertConfig":
        """From config.json (missing keys take transformers' BertConfig defaults)."""
        fields = {key: config[key] for key in cls.__dataclass_fields__ if key in config}
        fields["num_labels"] = num_labels(config)
        return cls(**fields)


class BertEmbeddings(nn.Module):
    def __init__(self, config: BertConfig):
        super().__init__()
        self.word_embeddings = nn.Embedding(config.vocab_size, config.hidden_size)
        self.position_embeddings = nn.Embedding(config.max_position_embeddings, config.hidden_size)
        self.token_type_embeddings = nn.Embedding(config.type_vocab_size, config.hidden_size)
        self.LayerNorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)

    def forward(self, input_ids, positions, token_type_ids):
        hidden = self.word_embeddings(input_ids) + self.token_type_embeddings(token_type_ids)
        return self.LayerNorm(hidden + self.position_embeddings(positions))


class BertSelfAttention(nn.Module):
    """Under tensor parallelism: this rank's heads (column-parallel ``qkv``); its output is this
    rank's slice of the context, which the row-parallel ``BertDenseNorm`` after it reduces."""

    def __init__(self, config: BertConfig, prefix: str):
        super().__init__()
        self.num_heads, self.head_dim = divide(config.num_attention_heads, tp_size(), "num_attention_heads"), config.head_dim
        self.total_hidden_size = config.hidden_size
        self.hidden_size = self.num_heads * self.head_dim
        self.qkv = column_parallel_linear(config.hidden_size, 3 * self.hidden_size, True, join(prefix, "qkv"), OTHER)
        self.scale = self.head_dim**-0.5

    def shard_sizes(self, fused: str) -> list[int]:
        return [self.hidden_size] * 3

    def checkpoint_shard_sizes(self, fused: str) -> list[int]:
        return [self.total_hidden_size] * 3

    def tp_shard(self, leaf: str, kind: str, shard: int | None) -> TPShard | None:
        return TPShard.column(self.hidden_size)

    def forward(self, hidden: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(hidden).view(-1, 3, self.num_heads, self.head_dim).unbind(1)
        return ops.varlen_attention(q, k, v, cu_seqlens, self.scale).reshape(-1, self.hidden_size)


class BertDenseNorm(nn.Module):
    """``LayerNorm(residual + dense(x))`` (BertSelfOutput and BertOutput); ``dense`` is
    row-parallel under tensor parallelism (``in_features`` is this rank's share)."""

    def __init__(self, in_features: int, config: BertConfig, prefix: str):
        super().__init__()
        self.in_features, self.hidden_size = in_features, config.hidden_size
        self.dense = row_parallel_linear(in_features, config.hidden_size, True, join(prefix, "dense"), OTHER)
        self.LayerNorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)

    def tp_shard(self, leaf: str, kind: str, shard: int | None) -> TPShard | None:
        return TPShard.row(kind, self.in_features, self.hidden_size) if leaf == "dense" else None

    def forward(self, hidden: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        return self.LayerNorm(residual + all_reduce(self.dense(hidden)))


class BertAttention(nn.Module):
    def __init__(self, config: BertConfig, prefix: str):
        super().__init__()
        self.self = BertSelfAttention(config, join(prefix, "self"))
        self.output = BertDenseNorm(self.self.hidden_size, config, join(prefix, "output"))

    def forward(self, hidden, cu_seqlens):
        return self.output(self.self(hidden, cu_seqlens), hidden)


class BertIntermediate(nn.Module):
    """Column-parallel under tensor parallelism: this rank's intermediate features."""

    def __init__(self, config: BertConfig, prefix: str):
        super().__init__()
        self.intermediate_size = divide(config.intermediate_size, tp_size(), "intermediate_size")
        self.dense = column_parallel_linear(config.hidden_size, self.intermediate_size, True, join(prefix, "dense"),
                                            OTHER)
        self.act = activation(config.hidden_act)

    def tp_shard(self, leaf: str, kind: str, shard: int | None) -> TPShard | None:
        return TPShard.column(self.intermediate_size)

    def forward(self, hidden):
        return self.act(self.dense(hidden))


class BertLayer(nn.Module):
    def __init__(self, config: BertConfig, prefix: str):
        super().__init__()
        self.attention = BertAttention(config, join(prefix, "attention"))
        self.intermediate = BertIntermediate(config, join(prefix, "intermediate"))
        self.output = BertDenseNorm(self.intermediate.intermediate_size, config, join(prefix, "output"))

    def forward(self, hidden, cu_seqlens):
        attended = self.attention(hidden, cu_seqlens)
        return self.output(self.intermediate(attended), attended)


class BertEncoder(nn.Module):
    def __init__(self, config: BertConfig, prefix: str = "encoder"):
        super().__init__()
        self.layer = nn.ModuleList(BertLayer(config, join(prefix, f"layer.{index}"))
                                   for index in range(config.num_hidden_layers))


class BertPooler(nn.Module):
    def __init__(self, config: BertConfig):
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.hidden_size)

    def forward(self, first_tokens):
        return torch.tanh(self.dense(first_tokens))


class BertModel(PretrainedModel):
    def __init__(self, config: BertConfig):
        super().__init__()
        self.config = config
        self.embeddings = BertEmbeddings(config)
        self.encoder = BertEncoder(config)
        self.pooler: BertPooler | None = BertPooler(config)

    @classmethod
    def config_from_hf(cls, config: dict) -> BertConfig:
        return BertConfig.from_hf(config)

    @staticmethod
    def positions(cu_seqlens: torch.Tensor) -> torch.Tensor:
        """0, 1, ... within each segment of ``cu_seqlens``."""
        cu = cu_seqlens.to(torch.long)
        lengths = cu[1:] - cu[:-1]
        starts = torch.repeat_interleave(cu[:-1], lengths)
        return torch.arange(int(cu[-1]), device=cu.device) - starts

    def forward(self, input_ids: torch.Tensor, cu_seqlens: torch.Tensor,
                token_type_ids: torch.Tensor | None = None) -> torch.Tensor:
        """``input_ids`` ``(T,)`` of the packed sequences -> last hidden states ``(T, hidden)``."""
        cu_seqlens = cu_seqlens.to(device=input_ids.device, dtype=torch.int32)
        if input_ids.dim() != 1 or cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2 \
                or int(cu_seqlens[0]) != 0 or int(cu_seqlens[-1]) != input_ids.numel():
            raise ValueError(f"input_ids must be (T,) with cu_seqlens [0, ..., T]; got {list(input_ids.shape)} "
                             f"and {cu_seqlens.tolist()}")
        positions = self.positions(cu_seqlens)
        longest = int((cu_seqlens[1:] - cu_seqlens[:-1]).max())
        if longest > self.config.max_position_embeddings:
            raise ValueError(f"a sequence of {longest} tokens exceeds max_position_embeddings "
                             f"{self.config.max_position_embeddings}")
        if token_type_ids is None:
            token_type_ids = torch.zeros_like(input_ids)
        hidden = self.embeddings(input_ids, positions, token_type_ids)
        for layer in self.encoder.layer:
            hidden = layer(hidden, cu_seqlens)
        return hidden

    def pooled_output(self, hidden: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
        """BERT's pooler on each sequence's first token: ``(num_seqs, hidden)``."""
        if self.pooler is None:
            raise ValueError("this checkpoint has no pooler")
        return self.pooler(hidden[cu_seqlens[:-1].to(torch.long)])

    # -- weights ---------------------------------------------------------------------------------

    stacked_params = _QKV

    def _own_name(self, name: str) -> str | None:
        name = name.removeprefix("bert.")
        return IGNORE if name in _BUFFERS else name

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        loaded = super().load_weights(weights)
        if self.pooler is not None and not any(name.startswith("pooler.") for name in loaded):
            self.pooler = None  # the checkpoint has none (e.g. saved with add_pooling_layer=False)
            self.__dict__.pop("_fused", None)
        return loaded


class BertEmbeddingModel(BertModel):
    """A ``BertModel`` checkpoint served as an embedding model (sentence-transformers style)."""

    default_pooling_type = "CLS"

    def forward_with_token_types(self, input_ids, positions, kv_caches, attn_metadata, token_type_ids):
        # A pooling step is never chunked: each request's tokens are one whole sequence.
        return BertModel.forward(self, input_ids, attn_metadata.query_start_loc, token_type_ids)

    def forward(self, input_ids, positions, kv_caches, attn_metadata, inputs_embeds=None):
        return self.forward_with_token_types(input_ids, positions, kv_caches, attn_metadata, None)

    def make_kv_caches(self, num_blocks: int, block_size: int, dtype=None, device=None) -> list:
        return []  # bidirectional encoder over whole prompts: nothing to cache

    def build_pooler(self, pooler_config: PoolerConfig) -> DispatchPooler:
        return DispatchPooler({"embed": embedding_pooler(pooler_config),
                               "token_embed": embedding_pooler(pooler_config, token_level=True)})


class BertForSequenceClassification(BertEmbeddingModel):
    """A cross-encoder (``BertForSequenceClassification`` checkpoints): ``classifier`` on BERT's
    pooler output of the [CLS] token; one label gives a relevance score."""

    def __init__(self, config: BertConfig):
        super().__init__(config)
        self.classifier = nn.Linear(config.hidden_size, config.num_labels)

    def _classify(self, first_tokens: torch.Tensor) -> torch.Tensor:
        if self.pooler is None:
            raise ValueError("a BertForSequenceClassification checkpoint needs its pooler (pooler.dense.*)")
        return self.classifier(self.pooler(first_tokens))

    def build_pooler(self, pooler_config: PoolerConfig) -> DispatchPooler:
        return classification_poolers(pooler_config, self._classify, CONVERT_TASKS["classify"])
