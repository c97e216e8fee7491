"""Reasoning ("thinking") text in a model's output, as vLLM's ``--reasoning-parser`` separates it.

    get_reasoning_parser("deepseek_r1").extract(text)  -> (reasoning_content, content), None when empty
    stream = get_reasoning_parser("deepseek_r1").streaming()   one per streamed output
    stream.feed(delta_text) -> [ReasoningDelta(reasoning, content)]
    stream.finish()         -> [ReasoningDelta(reasoning, content)]

Formats (both ``<think>`` ... ``</think>``):

- ``deepseek_r1``: the output may lack the opening ``<think>`` (DeepSeek-R1's template, and newer
  Qwen3 thinking templates, put it in the prompt): everything up to ``</think>`` is reasoning, and
  with no ``</think>`` at all (cut short) the whole output is.
- ``qwen3``: reasoning only if the output starts with ``<think>``; otherwise it is all content
  (``enable_thinking=False`` puts an empty think block in the prompt, so the output has none).
  Started but never closed: all reasoning, as for deepseek_r1.

A leading ``<think>`` and the first ``</think>`` are removed; nothing else is (the content keeps
the blank line the models write after ``</think>``, as vLLM's does).
"""

from __future__ import annotations

from typing import NamedTuple

from atb_plugin.server.tool_parsers import split_partial_tag
from atb_plugin.utils import lookup

__all__ = ["REASONING_PARSERS", "ReasoningDelta", "ReasoningParser", "ReasoningStream", "get_reasoning_parser"]


class ReasoningDelta(NamedTuple):
    """One piece of a streamed output: reasoning text or content text (the other is None)."""

    reasoning: str | None
    content: str | None


class ReasoningParser:
    """One reasoning format.

    Contract: ``extract(text) -> (reasoning | None, content | None)`` for a whole output (an
    empty part is None); ``streaming() -> ReasoningStream``, a new parser for each streamed
    output, whose deltas joined give exactly what ``extract`` returns for the whole text, however
    it was cut into deltas.
    """

    name: str = ""
    start_tag = "<think>"
    end_tag = "</think>"
    # Whether an output that does not open with start_tag is reasoning (until end_tag) or content.
    reasoning_without_start_tag: bool = False

    def extract(self, text: str) -> tuple[str | None, str | None]:
        if text.startswith(self.start_tag):
            text = text[len(self.start_tag):]
        elif not self.reasoning_without_start_tag:
            return None, text or None
        reasoning, _, content = text.partition(self.end_tag)
        return reasoning or None, content or None

    def streaming(self) -> ReasoningStream:
        return ReasoningStream(self)


class ReasoningStream:
    """The parser of one streamed output: ``feed(delta_text)`` for each new piece of the output
    text, then ``finish()`` once; each returns the ``ReasoningDelta``\\ s that text settled. Text
    that may be the start of a tag cut by a delta boundary is held until the next delta."""

    def __init__(self, parser: ReasoningParser):
        self._parser = parser
        self._state = "start"  # start (is there a leading start tag?) -> reasoning -> content
        self._buffer = ""
        self._finished = False

    def feed(self, delta_text: str) -> list[ReasoningDelta]:
        if self._finished:
            raise RuntimeError("feed() after finish(): a stream parser serves one output")
        self._buffer += delta_text
        out: list[ReasoningDelta] = []
        parser = self._parser
        while True:
            if self._state == "start":
                if self._buffer.startswith(parser.start_tag):
                    self._buffer = self._buffer[len(parser.start_tag):]
                    self._state = "reasoning"
                elif parser.start_tag.startswith(self._buffer):
                    return out  # still possibly the start tag
                else:
                    self._state = "reasoning" if parser.reasoning_without_start_tag else "content"
            elif self._state == "reasoning":
                end = self._buffer.find(parser.end_tag)
                if end < 0:
                    ready, self._buffer = split_partial_tag(self._buffer, parser.end_tag)
                    self._emit(out, ready, reasoning=True)
                    return out
                self._emit(out, self._buffer[:end], reasoning=True)
                self._buffer = self._buffer[end + len(parser.end_tag):]
                self._state = "content"
            else:
                self._emit(out, self._buffer, reasoning=False)
                self._buffer = ""
                return out

    def finish(self) -> list[ReasoningDelta]:
        if self._finished:
            raise RuntimeError("finish() called twice")
        self._finished = True
        out: list[ReasoningDelta] = []
        # What is held is never a whole tag: it is text of the part it would have been in.
        if self._state == "start":
            self._emit(out, self._buffer, reasoning=self._parser.reasoning_without_start_tag)
        else:
            self._emit(out, self._buffer, reasoning=self._state == "reasoning")
        self._buffer = ""
        return out

    @staticmethod
    def _emit(out: list[ReasoningDelta], text: str, reasoning: bool) -> None:
        if text:
            out.append(ReasoningDelta(text, None) if reasoning else ReasoningDelta(None, text))


class DeepSeekR1ReasoningParser(ReasoningParser):
    name = "deepseek_r1"
    reasoning_without_start_tag = True


class Qwen3ReasoningParser(ReasoningParser):
    name = "qwen3"
    reasoning_without_start_tag = False


REASONING_PARSERS: dict[str, type[ReasoningParser]] = {
    DeepSeekR1ReasoningParser.name: DeepSeekR1ReasoningParser,
    Qwen3ReasoningParser.name: Qwen3ReasoningParser,
}


def get_reasoning_parser(name: str) -> ReasoningParser:
    return lookup(REASONING_PARSERS, name, "reasoning parser")()
