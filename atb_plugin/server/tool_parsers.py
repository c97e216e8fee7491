"""Tool calls in a model's output text, as vLLM's OpenAI server finds them (``--tool-call-parser``).

    get_tool_parser("hermes").extract(text)      -> ExtractedToolCalls(content, tool_calls)
    stream = get_tool_parser("hermes").streaming()   one per streamed output
    stream.feed(delta_text) -> [StreamDelta]         content text, or a piece of a tool call
    stream.finish()         -> [StreamDelta]         what the end of the output decides

Formats:

- ``hermes`` (Hermes-2-Pro, Qwen2.5): ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``,
  one or more, whitespace around; text before (or between) the blocks is content.
- ``llama3_json`` (Llama 3.x JSON tool calling): the output is ``{"name": ..., "parameters": {...}}``,
  or several separated by ``;``, optionally after ``<|python_tag|>``; an output that does not
  start with ``{`` is all content.

A call whose text is malformed (invalid JSON, no name, arguments not an object) is plain content,
as in vLLM, never an error. ``extract`` runs the streaming parser over the whole text, so a
streamed output reassembles to exactly what ``extract`` returns, however it was cut into deltas.

For the forced modes (``tool_choice`` "required" or a named function) the output is constrained
to JSON instead: ``tool_choice_schema`` gives the schema, ``parse_forced_tool_calls`` reads the
result; ``check_tools`` validates a request's ``tools`` / ``tool_choice`` first.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from atb_plugin.utils import lookup

__all__ = [
    "TOOL_PARSERS",
    "ExtractedToolCalls",
    "StreamDelta",
    "ToolCall",
    "ToolCallDelta",
    "ToolCallStream",
    "ToolParser",
    "assemble_deltas",
    "check_tools",
    "get_tool_parser",
    "make_tool_call_id",
    "named_tool_choice",
    "parse_forced_tool_calls",
    "split_partial_tag",
    "tool_choice_schema",
]


def make_tool_call_id() -> str:
    """vLLM's id for a call the server found: ``chatcmpl-tool-`` + 32 random hex digits."""
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


# -- results -----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ToolCall:
    """A whole call: ``arguments`` is JSON text (of an object, for the calls a parser finds)."""

    id: str
    name: str
    arguments: str

    def __post_init__(self):
        if not isinstance(self.name, str) or not self.name:
            raise ValueError("a tool call needs a non-empty function name")
        if not isinstance(self.id, str) or not self.id:
            raise ValueError("a tool call needs a non-empty id")
        if not isinstance(self.arguments, str):
            raise ValueError(f"a tool call's arguments are JSON text, got {type(self.arguments).__name__}")


@dataclass(frozen=True)
class ExtractedToolCalls:
    """What a whole output holds: the text outside the calls (None when there is none) and the calls."""

    content: str | None
    tool_calls: list[ToolCall] = field(default_factory=list)

    @property
    def tools_called(self) -> bool:
        return bool(self.tool_calls)


@dataclass(frozen=True)
class ToolCallDelta:
    """A piece of call ``index`` (0, 1, ... in output order): the first piece of a call carries its
    ``id`` and ``name``; every piece's ``arguments`` is appended to the call's arguments text."""

    index: int
    arguments: str = ""
    id: str | None = None
    name: str | None = None

    def __post_init__(self):
        if self.index < 0:
            raise ValueError(f"a tool call's index counts from 0, got {self.index}")
        if (self.id is None) != (self.name is None):
            raise ValueError("the first piece of a tool call carries both its id and its name")


@dataclass(frozen=True)
class StreamDelta:
    """One event of a streamed output: either ``content`` text (never empty) or a ``tool_call`` piece."""

    content: str | None = None
    tool_call: ToolCallDelta | None = None

    def __post_init__(self):
        if (self.content is None) == (self.tool_call is None):
            raise ValueError("a stream delta is either content or a tool-call piece, exactly one of them")
        if self.content == "":
            raise ValueError("a content delta is never empty")


def assemble_deltas(deltas: Iterable[StreamDelta]) -> ExtractedToolCalls:
    """The whole answer a client rebuilds from streamed deltas."""
    content: list[str] = []
    calls: list[dict[str, Any]] = []
    for delta in deltas:
        if delta.content is not None:
            content.append(delta.content)
            continue
        piece = delta.tool_call
        if piece.id is not None:
            if piece.index != len(calls):
                raise ValueError(f"tool call {piece.index} starts after {len(calls)} calls")
            calls.append({"id": piece.id, "name": piece.name, "arguments": piece.arguments})
        elif piece.index >= len(calls):
            raise ValueError(f"a piece of tool call {piece.index} came before its first piece")
        else:
            calls[piece.index]["arguments"] += piece.arguments
    return ExtractedToolCalls("".join(content) or None, [ToolCall(**call) for call in calls])


# -- parsers -----------------------------------------------------------------------------------------


def split_partial_tag(text: str, tag: str) -> tuple[str, str]:
    """``(ready, held)``: ``held`` is the longest end of ``text`` that could be the start of ``tag``
    (a tag cut in two by a delta boundary), ``ready`` the rest. Held text waits for the next delta."""
    for length in range(min(len(text), len(tag) - 1), 0, -1):
        if text.endswith(tag[:length]):
            return text[:-length], text[-length:]
    return text, ""


def _call_from_json(text: str) -> tuple[str, str] | None:
    """``(name, arguments JSON)`` if ``text`` is one call object — ``{"name": str, "arguments":
    {...}}``, or ``"parameters"`` as Llama 3 writes it — else None (the text stays content)."""
    try:
        value = json.loads(text)
    except (ValueError, RecursionError):
        return None
    if not isinstance(value, dict) or not isinstance(value.get("name"), str) or not value["name"]:
        return None
    arguments = value["arguments"] if "arguments" in value else value.get("parameters")
    if not isinstance(arguments, dict):
        return None
    # Re-serialised as vLLM does, so the arguments are canonical JSON whatever spacing the model used.
    return value["name"], json.dumps(arguments, ensure_ascii=False)


class ToolCallStream:
    """The parser of one streamed output.

    Contract: ``feed(delta_text)`` for each new piece of the output text, in order, then
    ``finish()`` once; each returns the ``StreamDelta``\\ s that text settled, in output order.

    - Content before a call streams as soon as it cannot be the start of a call's opening tag
      (a possible partial tag is held back until the next delta).
    - The text of a call never streams as content. A call is sent as ONE tool-call delta (id,
      name and the whole arguments) the moment its text closes and parses: at ``</tool_call>``
      (hermes) or the object's closing brace (llama3_json). Why not the name earlier: a call
      cannot be taken back once announced, and one whose JSON turns out malformed must come out
      as content, exactly as ``extract`` returns it.
    - A malformed call comes out as content when it closes; an unclosed one at ``finish``.
    - Whitespace that only separates calls from each other or from the end of the output is dropped.
    """

    def __init__(self):
        self._buffer = ""  # text received but not yet settled
        self._calls = 0
        self._finished = False

    def feed(self, delta_text: str) -> list[StreamDelta]:
        if self._finished:
            raise RuntimeError("feed() after finish(): a stream parser serves one output")
        self._buffer += delta_text
        out: list[StreamDelta] = []
        self._consume(out)
        return out

    def finish(self) -> list[StreamDelta]:
        if self._finished:
            raise RuntimeError("finish() called twice")
        self._finished = True
        out: list[StreamDelta] = []
        self._settle_end(out)
        self._buffer = ""
        return out

    # -- for the formats -------------------------------------------------------------------------

    def _consume(self, out: list[StreamDelta]) -> None:
        """Settle what the buffer decides; leave the undecided rest in it."""
        raise NotImplementedError

    def _settle_end(self, out: list[StreamDelta]) -> None:
        """The output ended: settle the rest of the buffer."""
        raise NotImplementedError

    @staticmethod
    def _content(out: list[StreamDelta], text: str) -> None:
        if text:
            out.append(StreamDelta(content=text))

    def _call(self, out: list[StreamDelta], name: str, arguments: str) -> None:
        out.append(StreamDelta(tool_call=ToolCallDelta(self._calls, arguments, make_tool_call_id(), name)))
        self._calls += 1


class ToolParser:
    """One tool-call format.

    Contract: ``extract(text) -> ExtractedToolCalls`` for a whole output (content None when the
    text outside the calls is empty); ``streaming() -> ToolCallStream``, a new parser for each
    streamed output. Both find the same calls and content for the same text (``extract`` runs the
    streaming parser). Malformed call text is content, never an error.
    """

    name: str = ""
    stream_class: type[ToolCallStream] = ToolCallStream

    def streaming(self) -> ToolCallStream:
        return self.stream_class()

    def extract(self, text: str) -> ExtractedToolCalls:
        stream = self.streaming()
        return assemble_deltas(stream.feed(text) + stream.finish())


# -- hermes ------------------------------------------------------------------------------------------


class _HermesStream(ToolCallStream):
    START, END = "<tool_call>", "</tool_call>"

    def __init__(self):
        super().__init__()
        self._in_call = False
        self._searched = 0  # in a call: how far the buffer has been searched for END
        self._after_call = False  # whitespace from here is dropped if a call or the end follows

    def _consume(self, out):
        while True:
            if self._in_call:
                end = self._buffer.find(self.END, self._searched)
                if end < 0:
                    self._searched = max(0, len(self._buffer) - len(self.END) + 1)
                    return
                body, self._buffer = self._buffer[:end], self._buffer[end + len(self.END):]
                self._close_call(out, body, closed=True)
                continue
            start = self._buffer.find(self.START)
            if start >= 0:
                self._text(out, self._buffer[:start], call_follows=True)
                self._buffer = self._buffer[start + len(self.START):]
                self._in_call, self._searched = True, 0
                continue
            ready, held = split_partial_tag(self._buffer, self.START)
            if self._after_call and not ready.strip():
                return  # only whitespace so far: it depends on what follows
            self._text(out, ready, call_follows=False)
            self._buffer = held
            return

    def _settle_end(self, out):
        if self._in_call:  # unclosed at the end: judged like a closed one (vLLM's "<tool_call>(.*)")
            self._close_call(out, self._buffer, closed=False)
        else:
            self._text(out, self._buffer, call_follows=True)

    def _text(self, out, text: str, call_follows: bool) -> None:
        if self._after_call and call_follows and not text.strip():
            return
        self._content(out, text)
        if text:
            self._after_call = False

    def _close_call(self, out, body: str, closed: bool) -> None:
        self._in_call = False
        call = _call_from_json(body)
        if call is None:
            self._text(out, self.START + body + (self.END if closed else ""), call_follows=False)
        else:
            self._call(out, *call)
            self._after_call = True


class HermesToolParser(ToolParser):
    name = "hermes"
    stream_class = _HermesStream


# -- llama3_json -------------------------------------------------------------------------------------


class _Llama3JsonStream(ToolCallStream):
    PYTHON_TAG = "<|python_tag|>"

    def __init__(self):
        super().__init__()
        self._state = "start"  # start -> call <-> between; any -> content
        self._prefix = ""  # the python tag and whitespace before the first call: content if it fails
        self._depth = 0  # brace / bracket depth of the call object scanned so far
        self._scanned = 0
        self._in_string = self._escaped = False

    def _consume(self, out):
        while True:
            if self._state == "start":
                text = self._buffer
                if text.startswith(self.PYTHON_TAG):
                    body = text[len(self.PYTHON_TAG):]
                elif self.PYTHON_TAG.startswith(text):
                    return  # still possibly the tag
                else:
                    body = text
                stripped = body.lstrip()
                if not stripped:
                    return
                if stripped[0] != "{":
                    self._state = "content"
                    continue
                self._prefix, self._buffer = text[: len(text) - len(stripped)], stripped
                self._start_object()
            elif self._state == "call":
                end = self._object_end()
                if end is None:
                    return
                text, self._buffer = self._buffer[:end], self._buffer[end:]
                call = _call_from_json(text)
                if call is None:
                    self._content(out, self._prefix + text)
                    self._state = "content"
                    continue
                self._call(out, *call)
                self._prefix, self._state = "", "between"
            elif self._state == "between":
                separator = len(self._buffer) - len(self._buffer.lstrip())
                if separator < len(self._buffer) and self._buffer[separator] == ";":
                    rest = self._buffer[separator + 1:]
                    separator = len(self._buffer) - len(rest.lstrip())
                if separator == len(self._buffer):
                    return  # only separator so far: dropped if a call or the end follows
                if self._buffer[separator] == "{":
                    self._buffer = self._buffer[separator:]
                    self._start_object()
                else:
                    self._state = "content"  # keeps the separator: nothing written is lost
            else:  # content: everything from here on
                self._content(out, self._buffer)
                self._buffer = ""
                return

    def _settle_end(self, out):
        if self._state in ("start", "content"):
            self._content(out, self._buffer)
        elif self._state == "call":  # an unclosed object
            self._content(out, self._prefix + self._buffer)

    def _start_object(self) -> None:
        self._state, self._depth, self._scanned = "call", 0, 0
        self._in_string = self._escaped = False

    def _object_end(self) -> int | None:
        """Where the JSON value at the start of the buffer ends (just past its closing brace), or
        None if it has not ended yet. Brackets are matched outside strings only; whether the text
        is valid JSON is for json.loads to say."""
        text = self._buffer
        for position in range(self._scanned, len(text)):
            char = text[position]
            if self._in_string:
                if self._escaped:
                    self._escaped = False
                elif char == "\\":
                    self._escaped = True
                elif char == '"':
                    self._in_string = False
            elif char == '"':
                self._in_string = True
            elif char in "{[":
                self._depth += 1
            elif char in "}]":
                self._depth -= 1
                if self._depth == 0:
                    return position + 1
        self._scanned = len(text)
        return None


class Llama3JsonToolParser(ToolParser):
    name = "llama3_json"
    stream_class = _Llama3JsonStream


TOOL_PARSERS: dict[str, type[ToolParser]] = {
    HermesToolParser.name: HermesToolParser,
    Llama3JsonToolParser.name: Llama3JsonToolParser,
}


def get_tool_parser(name: str) -> ToolParser:
    return lookup(TOOL_PARSERS, name, "tool call parser")()


# -- request checks and the forced modes ---------------------------------------------------------------

_TOOL_SHAPE = '{"type": "function", "function": {"name": ..., "description"?: ..., "parameters"?: {...}}}'
_CHOICES = ("none", "auto", "required")


def _tool_functions(tools) -> dict[str, dict]:
    """name -> function definition, checking each tool's shape."""
    if tools is None:
        return {}
    if not isinstance(tools, (list, tuple)):
        raise ValueError(f"tools must be a list of {_TOOL_SHAPE} objects, got {type(tools).__name__}")
    functions: dict[str, dict] = {}
    for index, tool in enumerate(tools):
        where = f"tools[{index}]"
        if not isinstance(tool, dict) or not isinstance(tool.get("function"), dict):
            raise ValueError(f"{where} must be {_TOOL_SHAPE}")
        if tool.get("type", "function") != "function":
            raise ValueError(f"{where}.type must be 'function', got {tool.get('type')!r}")
        function = tool["function"]
        name = function.get("name")
        if not isinstance(name, str) or not name:
            raise ValueError(f"{where}.function.name is missing: every tool needs a function name")
        parameters = function.get("parameters")
        if parameters is not None and not isinstance(parameters, dict):
            raise ValueError(f"{where}.function.parameters must be a JSON Schema object, got "
                             f"{type(parameters).__name__}")
        if name in functions:
            raise ValueError(f"{where}.function.name {name!r} is used by another tool too: names must be unique")
        functions[name] = function
    return functions


def named_tool_choice(tool_choice) -> str | None:
    """The function name of ``{"type": "function", "function": {"name": ...}}``, None for the string choices."""
    if tool_choice is None or tool_choice in _CHOICES:
        return None
    if isinstance(tool_choice, dict) and isinstance(tool_choice.get("function"), dict):
        name = tool_choice["function"].get("name")
        if tool_choice.get("type", "function") == "function" and isinstance(name, str) and name:
            return name
    raise ValueError('tool_choice must be "none", "auto", "required" or '
                     '{"type": "function", "function": {"name": ...}}, got ' + repr(tool_choice)[:80])


def check_tools(tools, tool_choice) -> None:
    """Refuse a request's ``tools`` / ``tool_choice`` (OpenAI's shapes, as dicts) that cannot be served."""
    functions = _tool_functions(tools)
    name = named_tool_choice(tool_choice)
    if tool_choice in ("auto", "required") and not functions:
        # As OpenAI and vLLM: a tool_choice other than "none" only makes sense with tools.
        raise ValueError(f"tool_choice {tool_choice!r} needs tools; the request has none")
    if name is not None and not functions:
        raise ValueError(f"tool_choice names function {name!r}, but the request has no tools")
    if name is not None and name not in functions:
        raise ValueError(f"tool_choice names function {name!r}, which is not in tools "
                         f"(known: {', '.join(functions)})")


_NO_PARAMETERS = {"type": "object", "properties": {}}


def tool_choice_schema(tools, tool_choice, parallel_tool_calls: bool = True) -> str | None:
    """The JSON schema (as text) the output must follow for a forced ``tool_choice``; None for
    "none" / "auto" / unset (the output is free text).

    - a named function: that function's ``parameters`` (the output IS the arguments);
    - "required": an array (at least one item; exactly one when ``parallel_tool_calls`` is
      false, OpenAI's meaning of that flag) of ``{"name": <one tool's name>, "parameters":
      <that tool's parameters>}``, one ``anyOf`` branch per tool, with the tools' ``$defs``
      lifted to the top (vLLM's ``_get_json_schema_from_tool``).
    A tool without parameters takes an empty object.
    """
    check_tools(tools, tool_choice)
    functions = _tool_functions(tools)
    name = named_tool_choice(tool_choice)
    if name is not None:
        return json.dumps(functions[name].get("parameters") or _NO_PARAMETERS, ensure_ascii=False)
    if tool_choice != "required":
        return None
    branches, defs = [], {}
    for tool_name, function in functions.items():
        parameters = dict(function.get("parameters") or _NO_PARAMETERS)  # a copy: $defs move out
        for def_name, schema in parameters.pop("$defs", {}).items():
            if defs.setdefault(def_name, schema) != schema:
                raise ValueError(f"tools define $defs {def_name!r} differently; with tool_choice \"required\" "
                                 "they share one namespace: rename one")
        branches.append({"properties": {"name": {"type": "string", "enum": [tool_name]}, "parameters": parameters},
                         "required": ["name", "parameters"]})
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"type": "object", "anyOf": branches}}
    if not parallel_tool_calls:
        schema["maxItems"] = 1
    if defs:
        schema["$defs"] = defs
    return json.dumps(schema, ensure_ascii=False)


def parse_forced_tool_calls(text: str, tools, tool_choice) -> list[ToolCall]:
    """The calls in an output constrained by ``tool_choice_schema``.

    A named function: one call whose arguments are the output text as it is (vLLM's choice: with
    the output cut short by max_tokens, the client sees what was written, as OpenAI does).
    "required": the JSON array, each item one call; raises ValueError if the text is not such an
    array (cut short, or not generated under the schema)."""
    check_tools(tools, tool_choice)
    name = named_tool_choice(tool_choice)
    if name is not None:
        return [ToolCall(make_tool_call_id(), name, text)]
    if tool_choice != "required":
        raise ValueError(f"tool_choice {tool_choice!r} does not constrain the output: read it with a tool parser")
    try:
        items = json.loads(text)
    except (ValueError, RecursionError) as error:
        raise ValueError(f'the output for tool_choice "required" is not JSON ({error}); was it cut short by '
                         "max_tokens?") from None
    functions = _tool_functions(tools)
    if not isinstance(items, list) or not items:
        raise ValueError('the output for tool_choice "required" is not a non-empty JSON array of calls')
    calls = []
    for index, item in enumerate(items):
        if (not isinstance(item, dict) or item.get("name") not in functions
                or not isinstance(item.get("parameters"), dict)):
            raise ValueError(f'the output for tool_choice "required": item {index} is not '
                             '{"name": <one of the tools>, "parameters": {...}}')
        calls.append(ToolCall(make_tool_call_id(), item["name"], json.dumps(item["parameters"], ensure_ascii=False)))
    return calls
