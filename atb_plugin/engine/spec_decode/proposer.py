"""The proposer contract: what any drafting method (n-gram, a draft model; EAGLE or MTP heads
later) gives the engine core. Adding a method is one file implementing ``Proposer`` and one line
in ``make_proposer``."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol

from atb_plugin.engine.spec_decode.draft_model import DraftModelProposer
from atb_plugin.engine.spec_decode.ngram import NgramProposer

if TYPE_CHECKING:
    from atb_plugin.engine.config import EngineConfig


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


def make_proposer(config: "EngineConfig", num_blocks: int) -> Proposer:
    """The proposer of ``config.speculative_config``; ``num_blocks``: the target's KV blocks
    (a draft model's cache holds as many)."""
    spec = config.speculative_config
    if spec.method == "ngram":
        return NgramProposer(spec.prompt_lookup_min, spec.prompt_lookup_max)
    if spec.method == "draft_model":
        return DraftModelProposer(config.draft_config(), num_blocks, config.vocab_size)
    raise ValueError(f"no proposer for speculative method {spec.method!r}")
