"""The layers tensor parallelism splits: column- and row-parallel linear layers (this rank's
output rows, or input columns: their owner modules, ``decoder.Attention`` / ``MLP``, say which
rows or columns through ``ShardedWeights.tp_shard``), the LM head, and the vocabulary-parallel
embedding and logits.

A linear layer is built knowing how it is split (``models/linear.py``, ``LinearSpec``): the
method its model's quantization config gives it reads that (a row-parallel layer quantized on the
fly takes each row's scale over all ranks).

The vocabulary is cut into ``tp_size()`` equal runs of ``ceil(vocab / tp)`` rows; the last run is
padded with zero rows when the vocabulary does not divide (no start-up error: any vocabulary
works), and padded logits are cut off after the gather.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from atb_plugin.distributed import TPShard, all_gather, all_reduce, tp_rank, tp_size
from atb_plugin.models.linear import COLUMN, DECODER, LM_HEAD, ROW, LinearSpec, make_linear
from atb_plugin.utils import cdiv


def column_parallel_linear(in_features: int, out_features: int, bias: bool, prefix: str,
                           role: str = DECODER) -> nn.Module:
    """A linear layer over this rank's ``out_features`` output rows (every input column)."""
    return make_linear(LinearSpec(in_features, out_features, bias, COLUMN, role), prefix)


def row_parallel_linear(in_features: int, out_features: int, bias: bool, prefix: str,
                        role: str = DECODER) -> nn.Module:
    """A linear layer over this rank's ``in_features`` input columns of every output row; its
    owner all-reduces the partial products."""
    return make_linear(LinearSpec(in_features, out_features, bias, ROW, role), prefix)


def lm_head_spec(hidden_size: int, rows: int) -> LinearSpec:
    """The LM head over this rank's vocabulary rows (``VocabParallelEmbedding.num_embeddings``):
    column-parallel, its rows whole."""
    return LinearSpec(hidden_size, rows, False, COLUMN, LM_HEAD)


def lm_head_linear(hidden_size: int, rows: int, prefix: str) -> nn.Module:
    return make_linear(lm_head_spec(hidden_size, rows), prefix)


def join(prefix: str, name: str) -> str:
    """A child's module path under ``prefix`` (the model's root: "")."""
    return f"{prefix}.{name}" if prefix else name


class VocabParallelEmbedding(nn.Module):
    """``nn.Embedding`` over this rank's vocabulary rows: ids outside them look up zeros and the
    all-reduce fills in the owner rank's row. At TP = 1 a plain embedding lookup."""

    def __init__(self, vocab_size: int, hidden_size: int):
        super().__init__()
        self.vocab_size = vocab_size
        self.num_embeddings = cdiv(vocab_size, tp_size())  # rows per rank, padding included
        self.first = tp_rank() * self.num_embeddings
        self.weight = nn.Parameter(torch.empty(self.num_embeddings, hidden_size))

    def tp_shard(self) -> TPShard | None:
        """This rank's rows of the checkpoint's ``(vocab, hidden)`` tensor (embedding or LM head)."""
        if tp_size() == 1:
            return None
        return TPShard(0, self.first, max(0, min(self.num_embeddings, self.vocab_size - self.first)))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if tp_size() == 1:
            return F.embedding(input_ids, self.weight)
        local = input_ids - self.first
        outside = (local < 0) | (local >= self.num_embeddings)
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        return all_reduce(out.masked_fill_(outside.unsqueeze(-1), 0))


def gather_vocab_logits(logits: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """This rank's ``(T, vocab / tp)`` logits -> every rank's ``(T, vocab)`` (padding cut)."""
    if tp_size() == 1:
        return logits
    return all_gather(logits, dim=-1)[..., :vocab_size]
