"""Poolers: the last hidden states of a step's flattened batch -> one output per request.

A pooling step runs whole prompts (no chunking), packed one after another::

    hidden  (T, H)   [ r0 t0 .. t4 | r1 t0 .. t2 | r2 t0 .. t6 ]
    starts           [ 0,            5,            8          ]   (query_start_loc[:-1])
    lengths          [ 5,            3,            7          ]

A ``Pooler`` is a pooling method (which rows: CLS = first, LAST, MEAN, ALL, STEP = the rows at a
step-tag token) followed by a head (embeddings: Matryoshka ``dimensions`` then L2-normalise;
classification: a classifier then softmax / sigmoid). ``DispatchPooler`` holds one pooler per
task and runs each task's requests as one group, so a batch may mix tasks. Everything is
vectorised over the group's requests; only ALL/STEP return ragged per-request tensors.
Outputs are float32 (what the client receives), whatever the model's dtype.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from atb_plugin.pooling.config import PoolerConfig
from atb_plugin.pooling.params import PoolingParams

__all__ = ["PoolingBatch", "Pooler", "DispatchPooler", "pool_rows", "embedding_pooler", "classifier_pooler"]


@dataclass
class PoolingBatch:
    """The requests of one step to pool (see the module diagram). ``token_ids`` ``(T,)`` are
    the step's input ids (STEP pooling looks for its tag there)."""

    starts: torch.Tensor  # (B,) int64, on the hidden states' device
    lengths: torch.Tensor  # (B,) int64
    params: list[PoolingParams]
    token_ids: torch.Tensor | None = None

    def __post_init__(self):
        if self.starts.shape != self.lengths.shape or self.starts.shape[0] != len(self.params):
            raise ValueError("starts, lengths and params must have one entry per request")

    @classmethod
    def from_query_start_loc(cls, query_start_loc: torch.Tensor, params: list[PoolingParams],
                             token_ids: torch.Tensor | None = None) -> "PoolingBatch":
        qsl = query_start_loc.to(torch.long)
        return cls(qsl[:-1], qsl[1:] - qsl[:-1], params, token_ids)

    def subset(self, indices: Sequence[int]) -> "PoolingBatch":
        index = torch.as_tensor(indices, dtype=torch.long, device=self.starts.device)
        return PoolingBatch(self.starts[index], self.lengths[index], [self.params[i] for i in indices],
                            self.token_ids)


def pool_rows(hidden: torch.Tensor, batch: PoolingBatch, pooling_type: str,
              step_tag_id: int | None = None) -> torch.Tensor | list[torch.Tensor]:
    """The pooling methods. CLS / LAST / MEAN -> ``(B, H)``; ALL / STEP -> B tensors ``(n_i, H)``."""
    if pooling_type == "CLS":
        return hidden[batch.starts]
    if pooling_type == "LAST":
        return hidden[batch.starts + batch.lengths - 1]
    if pooling_type == "MEAN":
        # Segment sums with one index_add over the group's rows, in float32 (sentence-transformers
        # averages in float32 too), divided by each segment's length.
        # rows: each segment's hidden-state rows, concatenated (the group's requests need not be
        # adjacent in the step): row k of the concatenation is start[seg] + (k - offset[seg]),
        # offset = where the segment begins in the concatenation (exclusive cumsum of lengths).
        segment = torch.repeat_interleave(torch.arange(len(batch.params), device=hidden.device), batch.lengths)
        offsets = torch.cumsum(batch.lengths, 0) - batch.lengths
        rows = torch.repeat_interleave(batch.starts - offsets, batch.lengths)
        rows = rows + torch.arange(rows.numel(), device=hidden.device)
        sums = torch.zeros(len(batch.params), hidden.shape[-1], dtype=torch.float32, device=hidden.device)
        sums.index_add_(0, segment, hidden[rows].float())
        return sums / batch.lengths.unsqueeze(1).to(torch.float32)
    if pooling_type == "ALL":
        return [hidden[s:s + n] for s, n in zip(batch.starts.tolist(), batch.lengths.tolist())]
    if pooling_type == "STEP":
        if batch.token_ids is None:
            raise RuntimeError("STEP pooling needs the step's token ids")
        out = []
        for s, n in zip(batch.starts.tolist(), batch.lengths.tolist()):
            rows = hidden[s:s + n]
            if step_tag_id is not None:
                rows = rows[batch.token_ids[s:s + n] == step_tag_id]
            out.append(rows)
        return out
    raise ValueError(f"unknown pooling type {pooling_type!r}")


class Pooler:
    """Contract: ``pooler(hidden, batch)`` -> one float32 tensor per request of ``batch``, in order:
    ``(D,)`` for sequence tasks, ``(n_tokens, D)`` for token tasks. ``head(x, params)`` maps pooled
    rows (all requests sharing ``params``' settings, or one request's token rows) to outputs."""

    def __init__(self, pooling_type: str, head: Callable[[torch.Tensor, PoolingParams], torch.Tensor],
                 step_tag_id: int | None = None):
        self.pooling_type = pooling_type
        self.head = head
        self.step_tag_id = step_tag_id

    def __call__(self, hidden: torch.Tensor, batch: PoolingBatch) -> list[torch.Tensor]:
        pooled = pool_rows(hidden, batch, self.pooling_type, self.step_tag_id)
        if not isinstance(pooled, torch.Tensor):  # token level: one head call per request
            return [self.head(rows, params) for rows, params in zip(pooled, batch.params)]
        # Sequence level: one head call per distinct setting (usually one for the whole group).
        groups: dict[tuple, list[int]] = {}
        for i, params in enumerate(batch.params):
            groups.setdefault((params.dimensions, params.normalize, params.activation), []).append(i)
        out: list[torch.Tensor | None] = [None] * len(batch.params)
        for indices in groups.values():
            rows = pooled[indices[0]:indices[0] + 1] if len(indices) == 1 else pooled[indices]
            for i, value in zip(indices, self.head(rows, batch.params[indices[0]]).unbind(0)):
                out[i] = value
        return out


def _embedding_head(normalize_default: bool):
    def head(pooled: torch.Tensor, params: PoolingParams) -> torch.Tensor:
        out = pooled.float()
        if params.dimensions is not None:  # Matryoshka: the first d dimensions, then normalise
            out = out[..., :params.dimensions]
        normalize = normalize_default if params.normalize is None else params.normalize
        return F.normalize(out, p=2, dim=-1) if normalize else out
    return head


def _classifier_head(classifier: Callable[[torch.Tensor], torch.Tensor]):
    def head(pooled: torch.Tensor, params: PoolingParams) -> torch.Tensor:
        logits = classifier(pooled).float()
        if not params.use_activation:
            return logits
        # One label: a score (sigmoid); several: a distribution over them (softmax). vLLM's rule.
        return torch.sigmoid(logits) if logits.shape[-1] == 1 else torch.softmax(logits, dim=-1)
    return head


def embedding_pooler(config: PoolerConfig, token_level: bool = False) -> Pooler:
    return Pooler("ALL" if token_level else config.pooling_type, _embedding_head(config.normalize))


def classifier_pooler(config: PoolerConfig, classifier: Callable[[torch.Tensor], torch.Tensor],
                      token_level: bool = False) -> Pooler:
    pooling_type = ("STEP" if config.pooling_type == "STEP" else "ALL") if token_level else config.pooling_type
    return Pooler(pooling_type, _classifier_head(classifier), config.step_tag_id)


class DispatchPooler:
    """One ``Pooler`` per task; each task's requests in a batch are pooled as one group and the
    results put back in batch order."""

    def __init__(self, poolers_by_task: dict[str, Pooler]):
        self.poolers_by_task = dict(poolers_by_task)

    @property
    def tasks(self) -> tuple[str, ...]:
        return tuple(self.poolers_by_task)

    def __call__(self, hidden: torch.Tensor, batch: PoolingBatch) -> list[torch.Tensor]:
        groups: dict[str, list[int]] = {}
        for i, params in enumerate(batch.params):
            groups.setdefault(params.task, []).append(i)
        out: list[torch.Tensor | None] = [None] * len(batch.params)
        for task, indices in groups.items():
            pooler = self.poolers_by_task.get(task)
            if pooler is None:
                raise ValueError(f"this model does not serve task {task!r} (it serves {', '.join(self.tasks)})")
            for i, value in zip(indices, pooler(hidden, batch.subset(indices))):
                out[i] = value
        return out
