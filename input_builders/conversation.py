"""Conversations in either spelling, normalised into one small model.

Accepted, and freely mixed within one conversation or one message:

    MindIE:  {"role": "user", "content": [{"image": "/data/cat.png"}, {"text": "What is this?"}]}
    OpenAI:  {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:..."}},
                                          {"type": "text", "text": "What is this?"}]}
    text:    {"role": "user", "content": "What is this?"}
    audio:   {"type": "input_audio", "input_audio": {"data": <base64>, "format": "wav"}} (OpenAI),
             {"type": "audio_url", "audio_url": {"url": ...}} (vLLM), {"audio": "/data/clip.flac"} (MindIE)
    video:   {"type": "video_url", "video_url": {"url": ...}} (vLLM), {"video": "/data/clip.mp4", "fps": 1.0} (MindIE,
             with Qwen's per-video sampling options)

and OpenAI's tool calling: an assistant message may carry ``tool_calls`` (``[{"id", "type":
"function", "function": {"name", "arguments": <JSON text>}}]``) with null or empty content; a
``{"role": "tool", "tool_call_id": ..., "content": <text or text parts>}`` message answers one.

Everything else is refused with a ``ConversationError`` that says which message and part is wrong.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import ClassVar, Union

from atb_plugin.multimodal.parts import AUDIO_PART_TYPES, VIDEO_PART_TYPES, unknown_part_keys, unknown_part_type

ROLES = ("system", "user", "assistant", "tool")


class InputBuilderError(ValueError):
    """Base of the input builders' own errors (media errors come from ``input_builders.media_errors``)."""


class ConversationError(InputBuilderError):
    """The conversation or prompt is malformed."""


class UnsupportedContentError(InputBuilderError):
    """The content is well-formed but this model family cannot take it (images on a text model, video...)."""


class TooManyMediaError(InputBuilderError):
    """More media items of one kind in a prompt than the family's (or the server's) limit for it."""


class TooManyImagesError(TooManyMediaError):
    """More images in one prompt than the family's limit."""


class TooManyVideosError(TooManyMediaError):
    """More videos in one prompt than the family's (or the server's) limit."""


class TooManyAudiosError(TooManyMediaError):
    """More audio clips in one prompt than the family's limit (``--limit-mm-per-prompt audio=N``)."""


class ContextTooLongError(InputBuilderError):
    """The prompt does not fit ``max_length`` even after dropping history."""


class ChatTemplateError(InputBuilderError):
    """The checkpoint's chat template refused the conversation (its ``raise_exception``)."""


@dataclass(frozen=True)
class TextPart:
    text: str


@dataclass(frozen=True)
class ImagePart:
    ref: object  # str (path / file:// / data: / http(s) URL / base64), bytes or PIL image
    kind: ClassVar[str] = "image"


@dataclass(frozen=True)
class AudioPart:
    """An audio clip: ``input_audio`` (base64 ``data`` + its declared ``format``), ``audio_url``
    or MindIE's ``{"audio": ...}`` (``format`` None: the container says)."""

    ref: object  # str (path / file:// / data: / http(s) URL / base64) or bytes
    format: str | None = None
    kind: ClassVar[str] = "audio"


@dataclass(frozen=True)
class VideoPart:
    """A video: vLLM's ``{"type": "video_url", "video_url": {"url": ...}}`` or MindIE's
    ``{"video": ...}``. ``options``: sampling overrides given in the part itself, Qwen's spelling
    (``{"video": ..., "fps": 1.0, "max_pixels": ...}``), checked by ``input_builders.video``."""

    ref: object  # str (path / file:// / data: / http(s) URL / base64) or bytes
    options: tuple[tuple[str, object], ...] = ()
    kind: ClassVar[str] = "video"


Part = Union[TextPart, ImagePart, AudioPart, VideoPart]


@dataclass(frozen=True)
class AssistantToolCall:
    """One call an assistant message made. ``arguments`` is the JSON text of an object, as OpenAI
    sends it; ``arguments_object`` is the mapping chat templates render (Qwen2.5's with ``tojson``)."""

    name: str
    arguments: str = "{}"
    id: str | None = None

    def __post_init__(self):
        if not isinstance(self.name, str) or not self.name:
            raise ConversationError("a tool call needs a non-empty function name")
        if self.id is not None and not isinstance(self.id, str):
            raise ConversationError(f"a tool call's id must be a string, got {type(self.id).__name__}")
        _json_object(self.arguments, self.name)  # refused here, not when the template renders it

    @property
    def arguments_object(self) -> dict:
        return _json_object(self.arguments, self.name)


def _json_object(arguments, name: str) -> dict:
    try:
        value = json.loads(arguments)
    except (TypeError, ValueError, RecursionError):
        value = None
    if not isinstance(value, dict):
        raise ConversationError(
            f"the arguments of the call to {name!r} must be the JSON text of an object, got {_short(arguments)}"
        )
    return value


@dataclass(frozen=True)
class Message:
    role: str
    parts: tuple[Part, ...]
    tool_calls: tuple[AssistantToolCall, ...] = ()  # an assistant message's calls
    tool_call_id: str | None = None  # a tool message: the call it answers

    def __post_init__(self):
        if self.role not in ROLES:
            raise ConversationError(f"role {self.role!r} is not one of {', '.join(ROLES)}")
        if self.tool_calls and self.role != "assistant":
            raise ConversationError(f"only an assistant message can have tool_calls, not a {self.role!r} one")
        if self.tool_call_id is not None and self.role != "tool":
            raise ConversationError(f"only a tool message can have a tool_call_id, not a {self.role!r} one")
        if self.role == "tool" and self.images:
            raise UnsupportedContentError("a tool message's content must be text; it has image parts")

    @property
    def images(self) -> list[ImagePart]:
        return [p for p in self.parts if isinstance(p, ImagePart)]

    @property
    def text(self) -> str:
        return "".join(p.text for p in self.parts if isinstance(p, TextPart))


def _short(value, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def parse_part(item, where: str) -> Part:
    """One content item in either spelling."""
    if isinstance(item, str):
        return TextPart(item)
    if not isinstance(item, dict):
        raise ConversationError(f"{where}: expected a dict or a string, got {type(item).__name__}")
    kind = item.get("type")
    if kind is None:  # MindIE spelling: the key names the kind
        if "text" in item:
            kind = "text"
        elif "image" in item:
            kind = "image"
        else:
            kind = next((k for k in item if k in VIDEO_PART_TYPES + AUDIO_PART_TYPES), None)
            if kind is None:
                raise ConversationError(f"{where}: {unknown_part_keys(item, 'item')}")
    if kind == "text":
        text = item.get("text")
        if not isinstance(text, str):
            raise ConversationError(f"{where}: a text part needs a string 'text', got {type(text).__name__}")
        return TextPart(text)
    if kind == "image_url":
        image_url = item.get("image_url")
        url = image_url.get("url") if isinstance(image_url, dict) else image_url
        if not isinstance(url, str) or not url:
            raise ConversationError(f'{where}: an image_url part needs {{"image_url": {{"url": "..."}}}}')
        return ImagePart(url)
    if kind == "image":
        ref = item.get("image")
        if ref is None or (isinstance(ref, str) and not ref):
            raise ConversationError(f'{where}: an image part needs {{"image": <path, URL or base64>}}')
        return ImagePart(ref)
    if kind in AUDIO_PART_TYPES:
        return parse_audio_part(item, kind, where)
    if kind in VIDEO_PART_TYPES:
        return parse_video_part(item, kind, where)
    raise ConversationError(f"{where}: {unknown_part_type(_short(kind))}")


def parse_audio_part(item: dict, kind: str, where: str) -> AudioPart:
    """``{"type": "input_audio", "input_audio": {"data": <base64>, "format": "wav"}}`` (OpenAI),
    ``{"type": "audio_url", "audio_url": {"url": ...}}`` (vLLM) or ``{"audio": <path or URL>}``
    (MindIE; ``{"type": "audio", "audio": ...}`` too)."""
    if kind == "input_audio":
        body = item.get("input_audio")
        data = body.get("data") if isinstance(body, dict) else None
        audio_format = body.get("format") if isinstance(body, dict) else None
        if not isinstance(data, str) or not data or not isinstance(audio_format, str):
            raise ConversationError(f'{where}: an input_audio part needs {{"input_audio": {{"data": "<base64>", '
                                    '"format": "wav" | "mp3" | "flac" | "ogg"}}')
        return AudioPart(data, audio_format.lower())
    if kind == "audio_url":
        audio_url = item.get("audio_url")
        url = audio_url.get("url") if isinstance(audio_url, dict) else audio_url
        if not isinstance(url, str) or not url:
            raise ConversationError(f'{where}: an audio_url part needs {{"audio_url": {{"url": "..."}}}}')
        return AudioPart(url)
    ref = item.get("audio")
    if ref is None or (isinstance(ref, str) and not ref):
        raise ConversationError(f'{where}: an audio part needs {{"audio": <path, URL or base64>}}')
    return AudioPart(ref)


_VIDEO_PART_KEYS = ("type", "video", "video_url")


def parse_video_part(item: dict, kind: str, where: str) -> VideoPart:
    """``{"type": "video_url", "video_url": {"url": ...}}`` (vLLM) or ``{"video": <path or URL>}``
    (MindIE; ``{"type": "video", "video": ...}`` too); any other key of the item is a sampling option."""
    if kind == "video_url":
        video_url = item.get("video_url")
        ref = video_url.get("url") if isinstance(video_url, dict) else video_url
        if not isinstance(ref, str) or not ref:
            raise ConversationError(f'{where}: a video_url part needs {{"video_url": {{"url": "..."}}}}')
    else:
        ref = item.get("video")
        if ref is None or (isinstance(ref, str) and not ref):
            raise ConversationError(f'{where}: a video part needs {{"video": <path, URL or base64>}}')
        if isinstance(ref, (list, tuple)):
            raise UnsupportedContentError(f"{where}: a video given as a list of frames is not supported; send "
                                          "the video file (or the frames as image parts)")
    options = tuple(sorted((key, value) for key, value in item.items() if key not in _VIDEO_PART_KEYS))
    return VideoPart(ref, options)


def parse_content(content, where: str) -> tuple[Part, ...]:
    if isinstance(content, str):
        return (TextPart(content),)
    if isinstance(content, dict):  # a single item, as some clients send
        return (parse_part(content, where),)
    if isinstance(content, (list, tuple)):
        return tuple(parse_part(item, f"{where}, part {index}") for index, item in enumerate(content))
    raise ConversationError(f"{where}: content must be a string or a list of parts, got {type(content).__name__}")


def parse_tool_call(item, where: str) -> AssistantToolCall:
    """One entry of an assistant's ``tool_calls`` in OpenAI's shape. ``arguments`` may also be a
    mapping (some clients send one); null or empty means no arguments."""
    if not isinstance(item, dict) or not isinstance(item.get("function"), dict):
        raise ConversationError(
            f'{where}: expected {{"id": ..., "type": "function", "function": {{"name": ..., "arguments": "<JSON>"}}}}'
        )
    if item.get("type", "function") != "function":
        raise ConversationError(f"{where}: type must be 'function', got {_short(item.get('type'))}")
    function = item["function"]
    arguments = function.get("arguments")
    if isinstance(arguments, dict):
        arguments = json.dumps(arguments, ensure_ascii=False)
    elif arguments is None or arguments == "":
        arguments = "{}"  # as vLLM: a call without arguments renders as {}
    elif not isinstance(arguments, str):
        raise ConversationError(f"{where}: function.arguments must be JSON text, got {type(arguments).__name__}")
    try:
        return AssistantToolCall(function.get("name"), arguments, item.get("id"))
    except ConversationError as error:
        raise ConversationError(f"{where}: {error}") from None


def parse_message(message, where: str) -> Message:
    """One message: ``role`` and ``content`` (null or absent only for an assistant), plus an
    assistant's ``tool_calls`` or a tool message's ``tool_call_id``."""
    if not isinstance(message, dict) or "role" not in message:
        raise ConversationError(f"{where}: expected a dict with 'role' and 'content'")
    role, content = message["role"], message.get("content")
    if content is None and role != "assistant":
        raise ConversationError(f"{where}: expected a dict with 'role' and 'content' (null or absent "
                                "content only on an assistant message)")
    parts = () if content is None else parse_content(content, where)
    tool_calls = message.get("tool_calls") or ()
    if not isinstance(tool_calls, (list, tuple)):
        raise ConversationError(f"{where}: tool_calls must be a list, got {type(tool_calls).__name__}")
    calls = tuple(parse_tool_call(call, f"{where}, tool call {i}") for i, call in enumerate(tool_calls))
    tool_call_id = message.get("tool_call_id")
    if tool_call_id is not None and not isinstance(tool_call_id, str):
        raise ConversationError(f"{where}: tool_call_id must be a string, got {type(tool_call_id).__name__}")
    try:
        return Message(role, parts, calls, tool_call_id)
    except InputBuilderError as error:  # the same kind of error, now saying which message
        raise type(error)(f"{where}: {error}") from None


def parse_conversation(conversation) -> list[Message]:
    """Normalise and validate a chat: roles known, content parsed, at least one message."""
    if not isinstance(conversation, (list, tuple)) or not conversation:
        raise ConversationError("the conversation must be a non-empty list of {'role': ..., 'content': ...} messages")
    messages = [parse_message(message, f"message {index}") for index, message in enumerate(conversation)]
    if messages[-1].role == "system":
        raise ConversationError("the conversation has only system messages at its end; add a user message")
    return messages


def parse_prompt(inputs) -> tuple[Part, ...]:
    """The non-chat form: a string, or MindIE's list of {"text": ...} / {"image": ...} items."""
    if isinstance(inputs, str):
        return (TextPart(inputs),)
    if isinstance(inputs, (list, tuple)) and inputs:
        return parse_content(list(inputs), "prompt")
    raise ConversationError("a prompt must be a string or a non-empty list of {'text': ...} / {'image': ...} items")
