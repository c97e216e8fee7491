"""The content part types a chat message may hold, by modality: the one list the request schema
(atb_plugin/server/protocol.py), the input builders' parser (input_builders/conversation.py) and
the tokenizer pool's routing (video and audio go to the media workers) read. Torch-free.

OpenAI's and vLLM's ``{"type": ...}`` spellings first, then MindIE's, whose key names the kind."""

from __future__ import annotations

__all__ = ["AUDIO_PART_TYPES", "IMAGE_PART_TYPES", "PART_TYPES", "TEXT_PART_TYPES", "VIDEO_PART_TYPES",
           "accepted_part_types", "unknown_part_keys", "unknown_part_type"]

TEXT_PART_TYPES = ("text",)
IMAGE_PART_TYPES = ("image_url", "image")
VIDEO_PART_TYPES = ("video_url", "video")
AUDIO_PART_TYPES = ("input_audio", "audio_url", "audio")
PART_TYPES = TEXT_PART_TYPES + IMAGE_PART_TYPES + VIDEO_PART_TYPES + AUDIO_PART_TYPES


def accepted_part_types() -> str:
    """Every accepted type, for the message of an unknown one."""
    return ", ".join(repr(kind) for kind in PART_TYPES)


def unknown_part_type(kind_repr: str) -> str:
    """What is wrong with a part whose ``type`` is unknown (``kind_repr``: how to show it)."""
    return f"unknown content type {kind_repr}; the accepted types are {accepted_part_types()}"


def unknown_part_keys(keys, noun: str = "part") -> str:
    """What is wrong with a part that has no ``type`` and no key naming a kind."""
    return (f"unknown content {noun} with keys {sorted(keys)}; expected {{\"type\": <one of {accepted_part_types()}>, "
            '...} or MindIE\'s {"text": ...} / {"image": ...} / {"video": ...} / {"audio": ...}')
