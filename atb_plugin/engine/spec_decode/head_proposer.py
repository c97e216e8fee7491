"""Head proposers (EAGLE, EAGLE-3, MTP): a small head drafts from the target's own hidden states.

Position ``p`` of the head takes the token after it, ``t[p + 1]``, and the target's hidden state
at ``p`` (``TargetHiddenStates``), runs one decoder layer over its own one-layer KV cache and
predicts ``t[p + 2]``; a further draft feeds the head's own output hidden state back in place of
the target's. So each call:

1. catches a request up: the positions the target computed since the last call (their rows taken
   from ``TargetHiddenStates``), plus the last one again, in one chunk whose last row gives
   draft 1 (the head's KV of its own earlier drafts is overwritten: only positions with the
   target's states count as computed);
2. runs k - 1 one-row steps, each on the previous draft and the previous output hidden state.

Every request of the call goes through each forward together. The head's KV blocks come from a
``KVCacheManager`` of its own, as many blocks as the target's (the worker counted them in the KV
budget: ``loading.SpecModel``); a request it cannot fit gets no drafts. Its positions start where
the target's states start: a prefix-cache hit leaves the cached positions without states, so the
head's sequence starts after them (rotary positions are relative: only the shift changes).
Prompts with media get no drafts (the head reads text embeddings). Drafts are greedy (argmax):
the rejection sampler's one-hot rule is exact for them (docs/speculative.md).

``DraftHead`` is what the three heads share: the target's embedding and LM head unless the
head's checkpoint ships its own, a one-layer KV cache, loading from checkpoint tensors.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from atb_plugin.engine.input_batch import InputBatch
from atb_plugin.engine.kv_cache_manager import KVCacheManager
from atb_plugin.engine.prepare_inputs import prepare_inputs
from atb_plugin.engine.request import Request
from atb_plugin.engine.sampling_params import SamplingParams
from atb_plugin.engine.spec_decode.hidden_states import TargetHiddenStates
from atb_plugin.models.base import PretrainedModel
from atb_plugin.models.linear import pack_linear_layers
from atb_plugin.models.weights import WeightLoadingError

_GREEDY = SamplingParams(temperature=0)


class DraftHead(PretrainedModel):
    """A draft head over a target language model (``target``: a ``DecoderForCausalLM``), held
    outside the module tree (its weights are the target's, counted and loaded there).

    Subclasses build ``self.layer`` (whose ``self_attn`` gives the KV shape) and define
    ``forward(input_ids, positions, hidden, kv_caches, metadata) -> (logits hidden, next
    hidden)``; ``combine`` turns the target's recorded rows into the head's hidden input."""

    def __init__(self, target, own_embedding: bool, own_head: bool):
        super().__init__()
        self.__dict__["target"] = target  # not a submodule
        config = target.config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size) if own_embedding else None
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False) if own_head else None

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.embed_tokens is not None:
            return self.embed_tokens(input_ids)
        return self.target.get_input_embeddings(input_ids)

    def combine(self, features: torch.Tensor) -> torch.Tensor:
        return features

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits over the target's vocabulary."""
        return self.lm_head(hidden) if self.lm_head is not None else self.target.compute_logits(hidden)

    def make_kv_caches(self, num_blocks: int, block_size: int, dtype=None, device=None):
        attention = self.layer.self_attn
        shape = (num_blocks, block_size, attention.num_kv_heads, attention.head_dim)
        make = lambda: torch.zeros(shape, dtype=dtype or self.dtype, device=device or self.device)  # noqa: E731
        return [(make(), make())]

    @classmethod
    def load(cls, tensors: dict[str, torch.Tensor], source: str, dtype: torch.dtype, device, pack: bool,
             *args) -> "DraftHead":
        """The head ``cls(*args)`` built on the meta device, filled from ``tensors`` (checkpoint
        name -> tensor; ``source`` names them in errors), its float layers packed for the CPU
        kernels with ``pack``."""
        with torch.device("meta"):
            head = cls(*args)
        head = head.to_empty(device=device).to(dtype)
        # Its dtype and device, whatever packing does to its layers' parameters (and d2t is int64).
        head.dtype, head.device = dtype, torch.device(device)
        unexpected = [name for name in tensors if not head.accepts_weight(name)]
        loaded = head.load_weights((name, tensor) for name, tensor in tensors.items() if name not in unexpected)
        missing = sorted(set(dict(head.named_parameters())) - loaded)
        if missing or unexpected:
            raise WeightLoadingError(f"{source}: missing {', '.join(missing[:10]) or 'nothing'}; not used "
                                     f"{', '.join(sorted(unexpected)[:10]) or 'nothing'}")
        if pack:
            pack_linear_layers(head)
        return head.eval()


@dataclass
class _Shadow:
    """The head's view of one request: ``request`` holds its KV blocks (its
    ``num_computed_tokens``: head positions with the target's states); head position ``i`` is the
    target's ``origin + i``; ``last``: the target's row of the last computed position."""

    request: Request
    origin: int
    last: torch.Tensor | None = None


class HeadProposer:
    def __init__(self, head: DraftHead, hidden_states: TargetHiddenStates, config, num_blocks: int):
        self.head = head
        self.hidden_states = hidden_states
        self.device = head.device
        self.kv_caches = head.make_kv_caches(num_blocks, config.block_size)
        self.kv = KVCacheManager(num_blocks, config.block_size, enable_prefix_caching=False)
        self.batch = InputBatch(config.max_num_seqs, config.max_model_len, config.block_size)
        self.vocab_size = config.vocab_size
        self.shadows: dict[str, _Shadow] = {}

    # -- bookkeeping ---------------------------------------------------------------------------

    def _drop(self, request_id: str) -> None:
        shadow = self.shadows.pop(request_id, None)
        if shadow is not None:
            self.kv.free(shadow.request)
            self.batch.remove_request(request_id)

    def _catch_up(self, request_id: str, ids: Sequence[int]) -> tuple[_Shadow, torch.Tensor] | None:
        """The request's shadow, rolled back to where the new rows start, and the rows to feed
        (the last computed position again first); None when it has nothing to draft from."""
        shadow = self.shadows.get(request_id)
        start, rows = (shadow.origin + shadow.request.num_computed_tokens - 1, shadow.last) if shadow else (0, None)
        restart = shadow is None
        for first, chunk in self.hidden_states.take(request_id):
            if rows is None or not start <= first <= start + rows.shape[0]:
                # A gap or a step back (a prefix-cache hit, a recompute): the head starts over there.
                start, rows, restart = first, chunk, True
            else:
                rows = torch.cat([rows[:first - start], chunk])
        end = len(ids) - 1  # the target computed positions [.., end): position end - 1 gives draft 1
        if rows is None or start + rows.shape[0] != end:
            self._drop(request_id)  # the states do not reach the last token: nothing to draft from
            return None
        if restart or start < shadow.origin:
            self._drop(request_id)
            shadow = _Shadow(Request(request_id, [0], _GREEDY), origin=start)
            self.shadows[request_id] = shadow
            self.batch.add_request(request_id, [0], 0, [])
        shadow.request.num_computed_tokens = start - shadow.origin
        return shadow, rows

    # -- drafting ------------------------------------------------------------------------------

    def propose(self, request_ids: Sequence[str], token_ids: Sequence[Sequence[int]],
                max_drafts: Sequence[int]) -> list[list[int]]:
        for gone in set(self.shadows) - set(request_ids):
            self._drop(gone)
        work: list[tuple[str, int, int]] = []  # (request, drafts wanted, positions the target computed)
        counts, hidden_rows = [], []
        for request_id, ids, k in zip(request_ids, token_ids, max_drafts):
            if k <= 0 or min(ids) < 0:
                self._drop(request_id)
                self.hidden_states.take(request_id)  # no drafts: its rows are not kept either
                continue
            caught = self._catch_up(request_id, ids)
            if caught is None:
                continue
            shadow, rows = caught
            first = shadow.request.num_computed_tokens  # head positions [first, first + n)
            n = rows.shape[0]
            if not self._allocate(shadow, n):
                continue
            # Head position i reads the token after target position origin + i.
            tokens = ids[shadow.origin + first + 1:shadow.origin + first + 1 + n]
            self.batch.set_num_computed_tokens(request_id, first)
            self.batch.set_tokens(request_id, first, tokens)
            shadow.last = rows[-1:].clone()  # not a view keeping the whole chunk alive
            work.append((request_id, k, len(ids) - 1))
            counts.append(n)
            hidden_rows.append(rows)
        if not work:
            return [[] for _ in request_ids]
        drafts: dict[str, list[int]] = {request_id: [] for request_id, *_ in work}
        hidden = self.head.combine(torch.cat(hidden_rows).to(self.device, self.head.dtype))
        active = [request_id for request_id, *_ in work]
        limits = {request_id: k for request_id, k, _ in work}
        while True:
            prepared = prepare_inputs(self.batch, active, counts, device=self.device)
            logits_hidden, next_hidden = self.head(prepared.input_ids, prepared.positions, hidden, self.kv_caches,
                                                   prepared.attn_metadata)
            last = prepared.logits_indices
            tokens = self.head.compute_logits(logits_hidden[last]).argmax(dim=-1).tolist()
            next_hidden = next_hidden[last]
            keep = []
            for i, (request_id, token) in enumerate(zip(active, tokens)):
                shadow = self.shadows[request_id]
                position = int(prepared.num_computed_tokens_cpu[i] + prepared.num_scheduled_tokens[i])
                self.batch.set_num_computed_tokens(request_id, position)
                if token >= self.vocab_size:
                    continue  # outside the target's vocabulary: the drafts stop before it
                drafts[request_id].append(token)
                if len(drafts[request_id]) < limits[request_id] and self._allocate(shadow, 1, position):
                    self.batch.set_tokens(request_id, position, [token])
                    keep.append(i)
            if not keep:
                break
            active = [active[i] for i in keep]
            counts = [1] * len(active)
            hidden = next_hidden[keep]
        for request_id, _, end in work:  # only positions with the target's states count as computed
            shadow = self.shadows.get(request_id)
            if shadow is not None:
                shadow.request.num_computed_tokens = end - shadow.origin
        return [drafts.get(request_id, []) for request_id in request_ids]

    def _allocate(self, shadow: _Shadow, n: int, position: int | None = None) -> bool:
        """Blocks for ``n`` more head positions after ``position`` (default: its computed ones);
        False, and the request dropped, when the head's cache is full."""
        request = shadow.request
        computed = request.num_computed_tokens
        if position is not None:
            request.num_computed_tokens = position
        blocks = self.kv.allocate_slots(request, n)
        request.num_computed_tokens = computed
        if blocks is None:
            self._drop(request.request_id)
            return False
        self.batch.append_block_ids(request.request_id, blocks)
        return True

