"""Input builders: conversation or prompt -> ``input_ids`` with shared-memory handles.

- ``base.InputBuilder``: the MindIE contract (``make_context``, ``tokenize``), chat template,
  history window, leases; ``conversation``: both content spellings;
- ``media``: loading images safely (and the source policy every kind shares); ``preprocess``: our
  image preprocessing per family; ``audio``: loading audio (PyAV: decode, 16 kHz mono);
  ``audio_features``: Whisper's log-mel features;
- one module per family (``qwen_vl``, ``qwen2_vl``, ``llava``, ``qwen2_audio``, ``text``) laying out its media
  block as docs/wire-format.md describes.
"""

from input_builders.base import InputBuilder, PreparedImage
from input_builders.conversation import (
    ContextTooLongError,
    ConversationError,
    InputBuilderError,
    TooManyImagesError,
    UnsupportedContentError,
)

__all__ = [
    "ContextTooLongError",
    "ConversationError",
    "InputBuilder",
    "InputBuilderError",
    "PreparedImage",
    "TooManyImagesError",
    "UnsupportedContentError",
]
