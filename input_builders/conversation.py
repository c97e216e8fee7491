"""Conversations in either spelling, normalised into one small model.

Accepted, and freely mixed within one conversation or one message:

    MindIE:  {"role": "user", "content": [{"image": "/data/cat.png"}, {"text": "What is this?"}]}
    OpenAI:  {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:..."}},
                                          {"type": "text", "text": "What is this?"}]}
    text:    {"role": "user", "content": "What is this?"}

Everything else is refused with a ``ConversationError`` that says which message and part is wrong.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Union

ROLES = ("system", "user", "assistant")


class InputBuilderError(ValueError):
    """Base of the input builders' own errors (media errors come from ``input_builders.media``)."""


class ConversationError(InputBuilderError):
    """The conversation or prompt is malformed."""


class UnsupportedContentError(InputBuilderError):
    """The content is well-formed but this model family cannot take it (images on a text model, video...)."""


class TooManyImagesError(InputBuilderError):
    """More images in one prompt than the family's limit."""


class ContextTooLongError(InputBuilderError):
    """The prompt does not fit ``max_length`` even after dropping history."""


@dataclass(frozen=True)
class TextPart:
    text: str


@dataclass(frozen=True)
class ImagePart:
    ref: object  # str (path / file:// / data: / http(s) URL / base64), bytes or PIL image


Part = Union[TextPart, ImagePart]


@dataclass(frozen=True)
class Message:
    role: str
    parts: tuple[Part, ...]

    @property
    def images(self) -> list[ImagePart]:
        return [p for p in self.parts if isinstance(p, ImagePart)]

    @property
    def text(self) -> str:
        return "".join(p.text for p in self.parts if isinstance(p, TextPart))


_UNSUPPORTED_KINDS = ("video", "audio", "video_url", "audio_url", "input_audio")


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
            kind = next((k for k in item if k in _UNSUPPORTED_KINDS), None)
            if kind is None:
                raise ConversationError(
                    f"{where}: unknown content item with keys {sorted(item)}; "
                    'use {"text": ...} / {"image": ...} or {"type": "text" | "image_url", ...}'
                )
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
    if kind in _UNSUPPORTED_KINDS:
        raise UnsupportedContentError(f"{where}: {kind} content is not supported; only text and images are")
    raise ConversationError(f"{where}: unknown content type {kind!r}; expected 'text' or 'image_url'")


def parse_content(content, where: str) -> tuple[Part, ...]:
    if isinstance(content, str):
        return (TextPart(content),)
    if isinstance(content, dict):  # a single item, as some clients send
        return (parse_part(content, where),)
    if isinstance(content, (list, tuple)):
        return tuple(parse_part(item, f"{where}, part {index}") for index, item in enumerate(content))
    raise ConversationError(f"{where}: content must be a string or a list of parts, got {type(content).__name__}")


def parse_conversation(conversation) -> list[Message]:
    """Normalise and validate a chat: roles known, content parsed, at least one message."""
    if not isinstance(conversation, (list, tuple)) or not conversation:
        raise ConversationError("the conversation must be a non-empty list of {'role': ..., 'content': ...} messages")
    messages = []
    for index, message in enumerate(conversation):
        where = f"message {index}"
        if not isinstance(message, dict) or "role" not in message or "content" not in message:
            raise ConversationError(f"{where}: expected a dict with 'role' and 'content'")
        role = message["role"]
        if role not in ROLES:
            raise ConversationError(f"{where}: role {role!r} is not one of {', '.join(ROLES)}")
        messages.append(Message(role, parse_content(message["content"], where)))
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
