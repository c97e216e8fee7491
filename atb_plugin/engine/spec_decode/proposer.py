"""The proposer contract: what any drafting method (n-gram, a draft model, EAGLE / EAGLE-3 / MTP
heads) gives the engine core. Adding a method is one file implementing ``Proposer`` and one line
in ``make_proposer`` (a method with weights: one more in ``loading.load_spec_model``)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol

from atb_plugin.engine.spec_decode.draft_model import DraftModelProposer
from atb_plugin.engine.spec_decode.head_proposer import HeadProposer
from atb_plugin.engine.spec_decode.loading import HEAD_METHODS
from atb_plugin.engine.spec_decode.ngram import NgramProposer

if TYPE_CHECKING:
    from atb_plugin.engine.config import EngineConfig
    from atb_plugin.engine.model_runner import ModelRunner


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


def make_proposer(config: "EngineConfig", num_blocks: int, runner: "ModelRunner | None") -> Proposer:
    """The proposer of ``config.speculative_config``; ``num_blocks``: the target's KV blocks
    (a draft's cache holds as many); ``runner``: the target's, in this process (TP = 1), which
    holds what the worker loaded for the method (``ModelRunner.spec_model``)."""
    spec = config.speculative_config
    if spec.method == "ngram":
        return NgramProposer(spec.prompt_lookup_min, spec.prompt_lookup_max)
    if runner is None or runner.spec_model is None:
        raise ValueError(f"speculative method {spec.method!r} runs next to the target in the engine core's "
                         "process (tensor_parallel_size 1)")
    if spec.method == "draft_model":
        return DraftModelProposer(config.draft_config(), num_blocks, config.vocab_size, runner.spec_model.module)
    if spec.method in HEAD_METHODS:
        return HeadProposer(runner.spec_model.module, runner.spec_model.hidden_states, config, num_blocks)
    raise ValueError(f"no proposer for speculative method {spec.method!r}")
