"""Parallel sampling (``SamplingParams.n > 1``) the way vLLM v1 does it: in the frontend.

    request "r" (n = 3) ──► ParentRequest ──► engine requests "0_r", "1_r", "2_r" (n = 1 each;
                                              seeds seed, seed + 1, seed + 2 when seeded)
    each child's RequestOutput ──► add_child_output ──► that child's choice, index i (a stream sends it)
    every child finished ──► make_request_output ──► one RequestOutput "r" with choices 0..n-1

The engine core never sees ``n``: the children are ordinary requests with the same prompt, so
the prefix cache lets them share the prompt's KV blocks (the first child admitted publishes
them, the others hit them, in the same step even). Shared by the offline ``LLM`` and the HTTP
server. No torch: the API process imports it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from atb_plugin.frontend.output_processor import CompletionOutput, RequestOutput
from atb_plugin.engine.sampling_params import SamplingParams

__all__ = ["ParentRequest", "child_request_id", "child_sampling_params", "fans_out"]

_SEED_LIMIT = 2**64  # seeds live in [0, 2**64): seed + i wraps around


def fans_out(params) -> bool:
    """Whether a request with these params runs as several engine requests (n > 1)."""
    return isinstance(params, SamplingParams) and params.n > 1


def child_request_id(index: int, parent_request_id: str) -> str:
    """The engine request id of choice ``index`` (vLLM's ``f"{index}_{parent_id}"``)."""
    return f"{index}_{parent_request_id}"


def child_sampling_params(params: SamplingParams, index: int) -> SamplingParams:
    """Choice ``index``'s params: one sample, seeded ``seed + index`` (mod 2**64) when the parent
    is seeded, so choice i equals an n = 1 request with seed + i. Only choice 0 computes the prompt
    logprobs: they are the prompt's, the same for every choice, and a request computing them may
    not take prefix-cache hits, so the other choices keep sharing the prompt's KV blocks."""
    seed = None if params.seed is None else (params.seed + index) % _SEED_LIMIT
    return dataclasses.replace(params, n=1, seed=seed,
                               prompt_logprobs=params.prompt_logprobs if index == 0 else None)


@dataclass
class ParentRequest:
    """One request with ``params.n`` choices, run as that many child requests. Contract:

    - ``children``: (child request id, params) of each choice, in index order: add each to the
      engine (same prompt); ``index_of(child id)`` maps back; ``child_ids`` for an abort.
    - ``add_child_output(child's RequestOutput)`` records it and returns its choice (a copy of the
      child's ``CompletionOutput`` with ``index`` set: the per-choice deltas a stream sends).
    - ``make_request_output()``: one ``RequestOutput`` under the parent's id, ``outputs`` = the n
      choices in index order (a child not heard from yet: an empty, unfinished choice), finished
      once every child is. Prompt-level fields (prompt, prompt ids, prompt logprobs, cached
      tokens, queue time) are choice 0's when it has reported (prompt logprobs: only its), else
      the lowest reporting index's; ``error`` is the first child error.

    The children's own ``RequestOutput``s are never modified."""

    request_id: str
    params: SamplingParams
    children: list[tuple[str, SamplingParams]] = field(init=False)

    def __post_init__(self):
        if not isinstance(self.request_id, str) or not self.request_id:
            raise ValueError(f"request_id must be a non-empty string, got {self.request_id!r}")
        if not isinstance(self.params, SamplingParams):
            raise ValueError(f"params must be SamplingParams, got {type(self.params).__name__}")
        self.children = [(child_request_id(i, self.request_id), child_sampling_params(self.params, i))
                         for i in range(self.params.n)]
        self._index_of = {child_id: i for i, (child_id, _) in enumerate(self.children)}
        self._latest: list[RequestOutput | None] = [None] * self.params.n

    @property
    def n(self) -> int:
        return self.params.n

    @property
    def child_ids(self) -> list[str]:
        return [child_id for child_id, _ in self.children]

    def index_of(self, child_request_id: str) -> int:
        try:
            return self._index_of[child_request_id]
        except KeyError:
            raise ValueError(f"{child_request_id!r} is not a child of request {self.request_id!r}") from None

    @property
    def finished(self) -> bool:
        return all(output is not None and output.finished for output in self._latest)

    def add_child_output(self, output: RequestOutput) -> CompletionOutput:
        """Record a child's latest output; returns its choice: its completion with ``index`` set."""
        index = self.index_of(output.request_id)
        if len(output.outputs) != 1:
            raise ValueError(f"child {output.request_id!r} has {len(output.outputs)} completions, expected 1")
        self._latest[index] = output
        return dataclasses.replace(output.outputs[0], index=index)

    def make_request_output(self) -> RequestOutput:
        """The choices so far merged into one ``RequestOutput`` (each choice's delta fields are
        its latest step's: a stream sends ``add_child_output``'s choices instead)."""
        reported = [output for output in self._latest if output is not None]
        if not reported:
            raise RuntimeError(f"request {self.request_id}: no child has reported an output yet")
        first = reported[0]
        choices = [self._empty_choice(i) if output is None else dataclasses.replace(output.outputs[0], index=i)
                   for i, output in enumerate(self._latest)]
        error = next((output.error for output in reported if output.error is not None), None)
        prompt_logprobs = self._latest[0].prompt_logprobs if self._latest[0] is not None else None
        return RequestOutput(self.request_id, first.prompt, first.prompt_token_ids, choices, self.finished, error,
                             first.num_cached_tokens, first.queue_time, prompt_logprobs)

    def _empty_choice(self, index: int) -> CompletionOutput:
        return CompletionOutput(index, "", [], [] if self.params.logprobs is not None else None, None)
