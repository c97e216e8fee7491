"""How the two generate routes shape a request's outputs: one JSON body, or SSE chunks.

One engine request runs per choice (``n > 1`` fans out; ``AsyncLLM.generate``), so
the dialects work per choice index::

    RequestOutput of choice i ──► ChatDialect:
                                    [reasoning parser] <think>…</think> ─► reasoning_content
                                    [tool calls]  auto: the --tool-call-parser reads the text
                                                  forced (required / a named function): the
                                                  output is constrained JSON, read as calls
                                    ─► message (whole answer) or delta chunks (stream)
                              ──► CompletionDialect: echo (prompt text first), text, logprobs
                                  with text offsets

A stream's chunks carry only what changed; a whole answer is built from each choice's last
output. ``usage`` counts the prompt once and the completion tokens of every choice.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from atb_plugin.frontend.output_processor import RequestOutput
from atb_plugin.server import protocol
from atb_plugin.server.reasoning_parsers import get_reasoning_parser
from atb_plugin.server.tool_parsers import (ToolCall, get_tool_parser, make_tool_call_id, named_tool_choice,
                                           parse_forced_tool_calls)


def usage_of(outputs: dict[int, RequestOutput] | list[RequestOutput]) -> protocol.UsageInfo:
    """The prompt once, plus every choice's completion tokens so far."""
    outputs = list(outputs.values()) if isinstance(outputs, dict) else outputs
    first = outputs[0]
    return protocol.UsageInfo.from_counts(len(first.prompt_token_ids),
                                          sum(len(o.outputs[0].token_ids) for o in outputs),
                                          first.num_cached_tokens or None)


class _Dialect:
    """Contract: ``response(outputs)`` -> the whole answer from each choice's finished output (in
    index order); ``first_chunks()`` -> what a stream sends before any token; ``delta_chunks(index,
    output, usage)`` -> the chunks one step of choice ``index`` adds (none when it added nothing
    visible); ``usage_chunk(usage)`` -> the stream's closing usage chunk."""

    def __init__(self, request_id: str, model: str, token_text, n: int = 1):
        self.request_id, self.model, self.token_text, self.n = request_id, model, token_text, n
        self.created = int(time.time())

    def _prompt_logprobs(self, output: RequestOutput):
        entries = output.prompt_logprobs
        return protocol.prompt_logprobs(entries, self.token_text) if entries is not None else None


# -- chat ------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ChatOptions:
    """Per request: how a chat answer's text becomes content, reasoning and tool calls.

    ``tool_mode``: "none" (text is content), "auto" (``tool_parser`` finds calls in the text),
    "required" / "named" (the output was constrained to JSON calls: ``parse_forced_tool_calls``).
    ``echo``: text to put before the answer (``echo`` with an assistant message last)."""

    tool_mode: str = "none"
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None
    tool_parser: str | None = None
    reasoning_parser: str | None = None
    echo: str | None = None

    def __post_init__(self):
        if self.tool_mode not in ("none", "auto", "required", "named"):
            raise ValueError(f"tool_mode must be none, auto, required or named, got {self.tool_mode!r}")
        if self.tool_mode == "auto" and self.tool_parser is None:
            raise ValueError("tool_mode 'auto' needs a tool_parser")


def _tool_call(call: ToolCall) -> protocol.ToolCall:
    return protocol.ToolCall(id=call.id, function=protocol.FunctionCall(name=call.name, arguments=call.arguments))


@dataclass
class _ChatChoiceStream:
    """One streamed choice's parsers (reasoning first, then tool calls) and what it has sent."""

    reasoning: Any = None
    tools: Any = None
    forced_text: list[str] = field(default_factory=list)  # required / named: the JSON, read at the end
    named_started: bool = False
    tool_calls_sent: int = 0


class ChatDialect(_Dialect):
    """/v1/chat/completions: a role chunk first, then content / reasoning / tool-call deltas."""

    def __init__(self, request_id: str, model: str, token_text, n: int = 1, options: ChatOptions | None = None):
        super().__init__(request_id, model, token_text, n)
        self.options = options or ChatOptions()
        self._streams: dict[int, _ChatChoiceStream] = {}

    def _logprobs(self, entries):
        return protocol.chat_logprobs(entries, self.token_text) if entries is not None else None

    # -- whole answers -------------------------------------------------------------------------------

    def _message(self, text: str) -> tuple[protocol.ChatMessage, bool]:
        """The assistant message for a whole output text, and whether it holds tool calls."""
        options = self.options
        reasoning = None
        if options.reasoning_parser is not None:
            reasoning, text = get_reasoning_parser(options.reasoning_parser).extract(text)
            text = text or ""
        calls: list[ToolCall] = []
        content: str | None = text
        if options.tool_mode == "auto":
            extracted = get_tool_parser(options.tool_parser).extract(text)
            content, calls = extracted.content, extracted.tool_calls
        elif options.tool_mode in ("required", "named"):
            calls = self._forced_calls(text)
            content = None if calls else text
        if options.echo and content is not None:
            content = options.echo + content
        message = protocol.ChatMessage(role="assistant", content=content, reasoning_content=reasoning,
                                       tool_calls=[_tool_call(c) for c in calls])
        return message, bool(calls)

    def _forced_calls(self, text: str) -> list[ToolCall]:
        """The calls of a forced tool choice; none when the JSON array of "required" is incomplete
        (max_tokens cut it): the client then gets the text as content, with finish reason
        "length", rather than an error for a limit it set."""
        try:
            return parse_forced_tool_calls(text, self.options.tools, self.options.tool_choice)
        except ValueError:
            return []

    def _finish_reason(self, reason: str | None, has_calls: bool) -> str | None:
        # OpenAI answers a named function with "stop"; calls the model chose (auto) or had to
        # make (required) end with "tool_calls".
        if reason == "stop" and has_calls and self.options.tool_mode in ("auto", "required"):
            return "tool_calls"
        return reason

    def response(self, outputs: list[RequestOutput]) -> protocol.ChatCompletionResponse:
        choices = []
        for index, output in enumerate(outputs):
            completion = output.outputs[0]
            message, has_calls = self._message(completion.text)
            choices.append(protocol.ChatCompletionResponseChoice(
                index=index, message=message, logprobs=self._logprobs(completion.logprobs),
                finish_reason=self._finish_reason(completion.finish_reason, has_calls)))
        return protocol.ChatCompletionResponse(id=self.request_id, created=self.created, model=self.model,
                                               choices=choices, usage=usage_of(outputs),
                                               prompt_logprobs=self._prompt_logprobs(outputs[0]),
                                               kv_transfer_params=outputs[0].kv_transfer_params)

    # -- streams ---------------------------------------------------------------------------------------

    def _chunk(self, choices, usage_info=None) -> protocol.ChatCompletionStreamResponse:
        return protocol.ChatCompletionStreamResponse(id=self.request_id, created=self.created, model=self.model,
                                                     choices=choices, usage=usage_info)

    def first_chunks(self) -> list:
        chunks = []
        for index in range(self.n):
            chunks.append(self._chunk([protocol.ChatCompletionResponseStreamChoice(
                index=index, delta=protocol.DeltaMessage(role="assistant", content=""))]))
            if self.options.echo:
                chunks.append(self._chunk([protocol.ChatCompletionResponseStreamChoice(
                    index=index, delta=protocol.DeltaMessage(content=self.options.echo))]))
        return chunks

    def _stream_state(self, index: int) -> _ChatChoiceStream:
        state = self._streams.get(index)
        if state is None:
            options = self.options
            state = self._streams[index] = _ChatChoiceStream(
                reasoning=get_reasoning_parser(options.reasoning_parser).streaming()
                if options.reasoning_parser else None,
                tools=get_tool_parser(options.tool_parser).streaming() if options.tool_mode == "auto" else None)
        return state

    def _deltas(self, state: _ChatChoiceStream, text: str, final: bool) -> list[protocol.DeltaMessage]:
        """This step's text of one choice as delta messages (reasoning, content, tool calls)."""
        deltas: list[protocol.DeltaMessage] = []
        content = text
        if state.reasoning is not None:
            pieces = state.reasoning.feed(text) + (state.reasoning.finish() if final else [])
            content = ""
            for reasoning, answer in pieces:
                if reasoning:
                    deltas.append(protocol.DeltaMessage(reasoning_content=reasoning))
                content += answer or ""
        mode = self.options.tool_mode
        if mode == "auto":
            events = state.tools.feed(content) + (state.tools.finish() if final else [])
            for event in events:
                if event.content:
                    deltas.append(protocol.DeltaMessage(content=event.content))
                if event.tool_call is not None:
                    call = event.tool_call
                    state.tool_calls_sent = max(state.tool_calls_sent, call.index + 1)
                    deltas.append(protocol.DeltaMessage(tool_calls=[protocol.DeltaToolCall(
                        index=call.index, id=call.id, type="function" if call.id else None,
                        function=protocol.DeltaFunctionCall(name=call.name, arguments=call.arguments))]))
        elif mode == "named":
            # The output is exactly the arguments JSON: stream it as it comes.
            if not state.named_started:
                state.named_started, state.tool_calls_sent = True, 1
                deltas.append(protocol.DeltaMessage(tool_calls=[protocol.DeltaToolCall(
                    index=0, id=make_tool_call_id(), type="function",
                    function=protocol.DeltaFunctionCall(name=named_tool_choice(self.options.tool_choice),
                                                        arguments=""))]))
            if content:
                deltas.append(protocol.DeltaMessage(tool_calls=[protocol.DeltaToolCall(
                    index=0, function=protocol.DeltaFunctionCall(arguments=content))]))
        elif mode == "required":
            # A JSON array of calls: sent whole once it is complete.
            state.forced_text.append(content)
            if final:
                text = "".join(state.forced_text)
                calls = self._forced_calls(text)
                state.tool_calls_sent = len(calls)
                if not calls and text:
                    deltas.append(protocol.DeltaMessage(content=text))
                for index, call in enumerate(calls):
                    deltas.append(protocol.DeltaMessage(tool_calls=[protocol.DeltaToolCall(
                        index=index, id=call.id, type="function",
                        function=protocol.DeltaFunctionCall(name=call.name, arguments=call.arguments))]))
        elif content:
            deltas.append(protocol.DeltaMessage(content=content))
        return deltas

    def delta_chunks(self, index: int, output: RequestOutput, usage_info=None) -> list:
        completion = output.outputs[0]
        state = self._stream_state(index)
        final = completion.finish_reason is not None
        deltas = self._deltas(state, completion.delta_text, final)
        logprobs = self._logprobs(completion.delta_logprobs) if completion.delta_logprobs else None
        if not deltas and (logprobs is not None or final):
            deltas = [protocol.DeltaMessage(content="")]
        chunks = []
        for i, delta in enumerate(deltas):
            last = i == len(deltas) - 1
            reason = self._finish_reason(completion.finish_reason, state.tool_calls_sent > 0) if last else None
            chunks.append(self._chunk([protocol.ChatCompletionResponseStreamChoice(
                index=index, delta=delta, logprobs=logprobs if last else None, finish_reason=reason)],
                usage_info if last else None))
        return chunks

    def usage_chunk(self, usage_info):
        return self._chunk([], usage_info)


# -- completions -----------------------------------------------------------------------------------


class CompletionDialect(_Dialect):
    """/v1/completions: text deltas; logprobs with text offsets; ``echo`` puts the prompt (and,
    with logprobs, its tokens' logprobs) before the output."""

    def __init__(self, request_id: str, model: str, token_text, n: int = 1, echo: str | None = None):
        super().__init__(request_id, model, token_text, n)
        self.echo = echo
        self._offsets: dict[int, int] = {}  # per choice: text already streamed (next text_offset)

    def _logprobs(self, output: RequestOutput, entries, offset: int, with_echo: bool):
        """Completion logprobs of ``entries``, after the echoed prompt's (the engine computed them:
        echo with logprobs asks for prompt_logprobs) when ``with_echo``."""
        if entries is None:
            return None
        if not with_echo:
            return protocol.completion_logprobs(entries, self.token_text, offset)
        prompt = list(output.prompt_logprobs or [None] * len(output.prompt_token_ids))
        return protocol.completion_logprobs(prompt + list(entries), self.token_text, offset,
                                            token_ids=output.prompt_token_ids + [e.token_id for e in entries])

    def response(self, outputs: list[RequestOutput]) -> protocol.CompletionResponse:
        choices = []
        for index, output in enumerate(outputs):
            completion = output.outputs[0]
            text = (self.echo or "") + completion.text
            choices.append(protocol.CompletionResponseChoice(
                index=index, text=text, finish_reason=completion.finish_reason,
                logprobs=self._logprobs(output, completion.logprobs, 0, self.echo is not None),
                prompt_logprobs=self._prompt_logprobs(output)))
        return protocol.CompletionResponse(id=self.request_id, created=self.created, model=self.model,
                                           choices=choices, usage=usage_of(outputs),
                                           kv_transfer_params=outputs[0].kv_transfer_params)

    def _chunk(self, choices, usage_info=None) -> protocol.CompletionStreamResponse:
        return protocol.CompletionStreamResponse(id=self.request_id, created=self.created, model=self.model,
                                                 choices=choices, usage=usage_info)

    def first_chunks(self) -> list:
        return []

    def delta_chunks(self, index: int, output: RequestOutput, usage_info=None) -> list:
        completion = output.outputs[0]
        first = index not in self._offsets
        offset = self._offsets.get(index, 0)
        echo = self.echo if first and self.echo is not None else None
        text = (echo or "") + completion.delta_text
        if not (text or completion.finish_reason or completion.delta_logprobs):
            return []
        logprobs = self._logprobs(output, completion.delta_logprobs, offset, echo is not None)
        self._offsets[index] = offset + len(text)
        return [self._chunk([protocol.CompletionResponseStreamChoice(
            index=index, text=text, logprobs=logprobs, finish_reason=completion.finish_reason)], usage_info)]

    def usage_chunk(self, usage_info):
        return self._chunk([], usage_info)

