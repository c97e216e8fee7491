"""Vocabulary-parallel embedding and logits: the layers tensor parallelism needs beyond plain
``nn.Linear`` shards (those are split by their owner modules: ``decoder.Attention`` / ``MLP``).

The vocabulary is cut into ``tp_size()`` equal runs of ``ceil(vocab / tp)`` rows; the last run is
padded with zero rows when the vocabulary does not divide (no start-up error: any vocabulary
works), and padded logits are cut off after the gather.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from atb_plugin.distributed import TPShard, all_gather, all_reduce, tp_rank, tp_size
from atb_plugin.utils import cdiv


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
