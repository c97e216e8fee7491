"""The proposer contract: what any drafting method (n-gram, a draft model, EAGLE / EAGLE-3 / MTP
heads) gives the engine core. Adding a method is one file implementing ``Proposer`` and one line
in ``make_proposer`` (a method with weights: one more in ``loading.load_spec_model``)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Protocol

from atb_plugin.engine.spec_decode.draft_model import DraftModelProposer
from atb_plugin.engine.spec_decode.head_proposer import HeadProposer
from atb_plugin.engine.spec_decode.loading import HEAD_METHODS
from atb_plugin.engine.spec_decode.ngram import NgramProposer
from atb_plugin.engine.worker import load_model
from atb_plugin.platform import platform_for

if TYPE_CHECKING:
    from atb_plugin.engine.config import EngineConfig
    from atb_plugin.engine.executor.base import Executor


class Proposer(Protocol):
    """``propose(request_ids, token_ids, max_drafts)``: for each sequence (request
    ``request_ids[i]``, its prompt and output token ids so far, negative ids being media
    handles) at most ``max_drafts[i]`` draft tokens that are likely to follow it, possibly none.
    A proposer with per-request state (a draft model's KV) forgets the requests a call does not
    name. Drafts are only guesses: the rejection sampler keeps exactly the tokens the target
    model would have produced, so a proposer affects speed, never output. A draft is never
    negative (a media handle) nor outside the target's vocabulary."""

    def propose(self, request_ids: Sequence[str], token_ids: Sequence[Sequence[int]],
                max_drafts: Sequence[int]) -> list[list[int]]: ...


class RankProposer:
    """A head's proposer under tensor parallelism: the head runs on every rank, sharded as the
    target and next to the hidden states each rank's runner recorded (``Worker.propose``); the
    ranks draft in lockstep (the head's collectives) and rank 0's drafts come back
    (``executor.propose``: request ids, lengths and limits out, drafts back; the ranks read the
    token ids from their request mirrors)."""

    def __init__(self, propose: Callable[[list[str], list[int], list[int]], list[list[int]]]):
        self._propose = propose

    def propose(self, request_ids: Sequence[str], token_ids: Sequence[Sequence[int]],
                max_drafts: Sequence[int]) -> list[list[int]]:
        return self._propose(list(request_ids), [len(ids) for ids in token_ids], list(max_drafts))


def make_proposer(config: "EngineConfig", num_blocks: int, executor: "Executor") -> Proposer:
    """The proposer of ``config.speculative_config``; ``num_blocks``: the target's KV blocks
    (a draft's cache holds as many). At TP = 1 the target's runner is in this process
    (``executor.runner``) and holds what the worker loaded for the method
    (``ModelRunner.spec_model``); under TP a draft model is loaded here, whole, and a head
    drafts on the ranks (``RankProposer``; docs/speculative.md, "Tensor parallelism")."""
    spec = config.speculative_config
    if spec.method == "ngram":
        return NgramProposer(spec.prompt_lookup_min, spec.prompt_lookup_max)
    runner = executor.runner
    if spec.method == "draft_model":
        draft_config = config.draft_config()
        if runner is not None:
            draft = runner.spec_model.module
        else:  # the ranks hold the target alone (loading.load_spec_model)
            draft = load_model(draft_config, platform_for(config.device).device(config.rank_device(0)))[0]
        return DraftModelProposer(draft_config, num_blocks, config.vocab_size, draft)
    if spec.method in HEAD_METHODS:
        if runner is None:
            return RankProposer(executor.propose)
        return HeadProposer(runner.spec_model.module, runner.spec_model.hidden_states, config, num_blocks)
    raise ValueError(f"no proposer for speculative method {spec.method!r}")
