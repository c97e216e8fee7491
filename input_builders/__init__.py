"""Input builders: conversation or prompt -> ``input_ids`` with shared-memory handles.

- ``base.InputBuilder``: the MindIE contract (``make_context``, ``tokenize``), chat template,
  history window, leases; ``conversation``: both content spellings;
- media loading, by job: ``media_config`` (the source policy and the ``MediaLimits`` every kind
  shares), ``media_errors`` (its refusals), ``sources`` (a reference -> encoded bytes), ``fetch``
  (http(s) under the allow-list), ``image`` (decoding images safely), ``video`` (sampling and
  decoding frames), ``audio`` (PyAV: decode, 16 kHz mono), ``pyav`` (importing PyAV);
  ``preprocess``: our image preprocessing per family; ``audio_features``: Whisper's log-mel features;
- one module per family (``qwen_vl``, ``qwen2_vl``, ``qwen3_vl``, ``llava``, ``qwen2_audio``, ``text``) laying out its media
  block as docs/wire-format.md describes.
"""

from input_builders.base import InputBuilder, PreparedImage
from input_builders.conversation import (
    ContextTooLongError,
    ConversationError,
    InputBuilderError,
    TooManyAudiosError,
    TooManyImagesError,
    TooManyMediaError,
    TooManyVideosError,
    UnsupportedContentError,
)

__all__ = [
    "ContextTooLongError",
    "ConversationError",
    "InputBuilder",
    "InputBuilderError",
    "PreparedImage",
    "TooManyAudiosError",
    "TooManyImagesError",
    "TooManyMediaError",
    "TooManyVideosError",
    "UnsupportedContentError",
]
