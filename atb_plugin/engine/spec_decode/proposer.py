"""The proposer contract: what any drafting method (n-gram today; a draft model, EAGLE or MTP
head later) gives the engine core. Adding a method is one file implementing ``Proposer`` and one
line in ``make_proposer``."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from atb_plugin.engine.spec_decode.config import SpeculativeConfig
from atb_plugin.engine.spec_decode.ngram import NgramProposer


class Proposer(Protocol):
    """``propose(token_ids, max_drafts)``: for each sequence (its prompt and output token ids so
    far, negative ids being media handles) at most ``max_drafts[i]`` draft tokens that are
    likely to follow it, possibly none. Drafts are only guesses: the rejection sampler keeps
    exactly the tokens the target model would have produced, so a proposer affects speed, never
    output. A draft is never negative (a media handle) nor outside the vocabulary."""

    def propose(self, token_ids: Sequence[Sequence[int]], max_drafts: Sequence[int]) -> list[list[int]]: ...


def make_proposer(config: SpeculativeConfig) -> Proposer:
    if config.method == "ngram":
        return NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max)
    raise ValueError(f"no proposer for speculative method {config.method!r}")
