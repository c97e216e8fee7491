"""``OutputProcessor``: the frontend's half of every request (text, stop strings, outputs).

    EngineCoreOutput (ids) ──► per request: IncrementalDetokenizer (text delta, stop strings)
                           ──► RequestOutput (cumulative text + this step's delta)
                           ──► finished? on_finish(final RequestOutput)  (releases its shm lease)

A pooling request (``PoolingParams``) has no text: its one output carries the pooled tensor
(``PoolingRequestOutput``).

A stop string is text, so the core cannot see it: when the detokenizer finds one, the request is
finished here ("stop") and its id is returned in ``ProcessedOutputs.to_abort`` for the caller to
abort in the core. ``on_finish`` runs exactly once per request, whatever ended it (finish,
stop string, abort, error).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from atb_plugin.frontend.detokenizer import IncrementalDetokenizer
from atb_plugin.engine.messages import EngineCoreOutput, LogprobsEntry
from atb_plugin.engine.sampling_params import SamplingParams
from atb_plugin.pooling.outputs import PoolingOutput, PoolingRequestOutput
from atb_plugin.pooling.params import PoolingParams

__all__ = ["CompletionOutput", "RequestOutput", "ProcessedOutputs", "OutputProcessor"]


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    logprobs: list[LogprobsEntry] | None
    finish_reason: str | None  # "stop", "length", "abort", "error"; None while running
    # What this step added (what a stream sends): text released now, tokens and logprobs sampled now.
    delta_text: str = ""
    delta_token_ids: list[int] = field(default_factory=list)
    delta_logprobs: list[LogprobsEntry] | None = None


@dataclass
class RequestOutput:
    request_id: str
    prompt: object
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    error: str | None = None
    num_cached_tokens: int = 0
    queue_time: float | None = None  # seconds from arrival to first scheduling, once known
    # SamplingParams.prompt_logprobs: one entry per prompt token (None for the first), from the
    # first output on; None when not asked for (or before the prompt has been computed).
    prompt_logprobs: list[LogprobsEntry | None] | None = None
    # On the final output, what the request's KV connector handed back (a PD producer: where the
    # consumer finds the prompt's KV; docs/kv-transfer.md); None otherwise.
    kv_transfer_params: dict | None = None


@dataclass
class ProcessedOutputs:
    request_outputs: list[RequestOutput]
    to_abort: list[str]  # finished here by a stop string: abort them in the core


@dataclass
class _RequestState:
    request_id: str
    prompt: object
    prompt_token_ids: list[int]
    params: SamplingParams
    detokenizer: IncrementalDetokenizer
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[LogprobsEntry] = field(default_factory=list)
    num_cached_tokens: int = 0
    queue_time: float | None = None
    prompt_logprobs: list[LogprobsEntry | None] | None = None
    kv_transfer_params: dict | None = None


@dataclass
class _PoolingState:
    request_id: str
    prompt_token_ids: list[int]


class OutputProcessor:
    def __init__(self, tokenizer, on_finish: Callable[[RequestOutput | PoolingRequestOutput], None] | None = None):
        self.tokenizer = tokenizer
        self.on_finish = on_finish
        self._states: dict[str, _RequestState | _PoolingState] = {}

    def add_request(self, request_id: str, prompt, prompt_token_ids: list[int],
                    params: SamplingParams | PoolingParams) -> None:
        if request_id in self._states:
            raise ValueError(f"request id {request_id!r} is already in use")
        if isinstance(params, PoolingParams):
            self._states[request_id] = _PoolingState(request_id, list(prompt_token_ids))
            return
        detokenizer = IncrementalDetokenizer(self.tokenizer, prompt_token_ids, params)
        self._states[request_id] = _RequestState(request_id, prompt, list(prompt_token_ids), params, detokenizer)

    def has_unfinished_requests(self) -> bool:
        return bool(self._states)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._states

    @property
    def request_ids(self) -> list[str]:
        return list(self._states)

    def process(self, outputs: Iterable[EngineCoreOutput]) -> ProcessedOutputs:
        results, to_abort = [], []
        for out in outputs:
            state = self._states.get(out.request_id)
            if state is None:
                continue  # aborted here while the core was still stepping it
            if isinstance(state, _PoolingState):
                results.append(self._finish_pooling(state, out.pooled.to_array() if out.pooled else None,
                                                    out.finish_reason or "stop", out.error, out.queue_time))
                continue
            text_ids = out.new_token_ids
            if out.finish_reason == "stop" and not state.params.include_stop_str_in_output:
                # The core stops with "stop" only at an EOS or stop_token_ids token: like vLLM,
                # its text is not part of the output (the token id still is).
                text_ids = text_ids[:-1]
            delta = state.detokenizer.update(text_ids) if text_ids else ""
            state.token_ids += out.new_token_ids
            delta_logprobs = None
            if state.params.logprobs is not None:
                delta_logprobs = list(out.new_logprobs or [None] * len(out.new_token_ids))
                state.logprobs += delta_logprobs
            state.num_cached_tokens = out.num_cached_tokens
            if out.queue_time is not None:
                state.queue_time = out.queue_time
            if out.prompt_logprobs is not None:
                state.prompt_logprobs = out.prompt_logprobs
            if out.kv_transfer_params is not None:
                state.kv_transfer_params = out.kv_transfer_params
            finish_reason = out.finish_reason
            if finish_reason is None and state.detokenizer.stopped_by is not None:
                finish_reason = "stop"
                to_abort.append(out.request_id)
            results.append(self._make_output(state, delta, out.new_token_ids, delta_logprobs, finish_reason,
                                             out.error))
        return ProcessedOutputs(results, to_abort)

    def abort(self, request_id: str, reason: str = "abort", error: str | None = None) -> RequestOutput | None:
        """Finish ``request_id`` here (abort, or "error" with ``error``); None if it is not ours."""
        state = self._states.get(request_id)
        if state is None:
            return None
        if isinstance(state, _PoolingState):
            return self._finish_pooling(state, None, reason, error)
        return self._make_output(state, "", [], [] if state.params.logprobs is not None else None, reason, error)

    def _finish_pooling(self, state: _PoolingState, data, finish_reason: str, error: str | None,
                        queue_time: float | None = None) -> PoolingRequestOutput:
        del self._states[state.request_id]
        output = PoolingRequestOutput(state.request_id, state.prompt_token_ids, PoolingOutput(data), True, error,
                                      finish_reason, queue_time)
        if self.on_finish is not None:
            self.on_finish(output)
        return output

    def _make_output(self, state: _RequestState, delta: str, new_ids: list[int], delta_logprobs,
                     finish_reason: str | None, error: str | None) -> RequestOutput:
        if finish_reason is not None:
            delta += state.detokenizer.finish()  # release text held back for a possible stop string
            del self._states[state.request_id]
        completion = CompletionOutput(
            0, state.detokenizer.output_text, list(state.token_ids),
            list(state.logprobs) if state.params.logprobs is not None else None, finish_reason,
            delta, list(new_ids), delta_logprobs)
        output = RequestOutput(state.request_id, state.prompt, state.prompt_token_ids, [completion],
                               finish_reason is not None, error, state.num_cached_tokens, state.queue_time,
                               state.prompt_logprobs, state.kv_transfer_params)
        if finish_reason is not None and self.on_finish is not None:
            self.on_finish(output)
        return output
