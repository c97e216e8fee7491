"""Refuse a text too long for the model before tokenizing it.

Tokenizing costs time and memory in proportion to the text: a 60 MB string kept a tokenizer
worker busy for a minute (every request behind it waited) and left it gigabytes larger, only to
be refused for its length at the end. No token of a vocabulary spells more than
``max_chars_per_token`` characters, so a text of C characters has at least
``ceil(C / max_chars_per_token)`` tokens: when that lower bound already exceeds the context
window, the text is refused at once, with the same kind of message the exact check gives.
Texts under the bound, and any text under 64 Ki characters (cheap to tokenize), are tokenized and
checked exactly, as before; the bound never refuses a text that would fit.

Only text is counted (message contents, text parts, prompts): images and other media travel as
URLs or base64 that never become text tokens.
"""

from __future__ import annotations

import math

from atb_plugin.frontend.errors import InvalidRequestError

__all__ = ["check_text_fits", "max_chars_per_token", "text_chars"]

# Below this many characters a text is tokenized in milliseconds: it gets the exact check (and its
# exact token count in the message) rather than the estimate.
_EXACT_BELOW_CHARS = 1 << 16
_MEDIA_KEYS = frozenset({"image", "image_url", "url", "video", "video_url", "audio", "audio_url", "input_audio",
                         "data", "file"})


def max_chars_per_token(tokenizer) -> int:
    """The most characters one token of ``tokenizer`` spells: the longest vocabulary entry, raw
    (a byte-level BPE entry has one character per byte of its text, a SentencePiece one its
    text with "▁" for a space: either way at least as long as the text it decodes to). Added
    tokens count too."""
    cached = getattr(tokenizer, "_atb_max_chars_per_token", None)
    if cached is None:
        cached = max(1, max((len(token) for token in tokenizer.get_vocab()), default=1))
        try:
            tokenizer._atb_max_chars_per_token = cached
        except AttributeError:
            pass
    return cached


def text_chars(value) -> int:
    """Characters of text in a prompt, a MindIE item list or a conversation (media excluded)."""
    if isinstance(value, str):
        return len(value)
    if isinstance(value, dict):
        return sum(text_chars(v) for k, v in value.items() if k not in _MEDIA_KEYS and k != "role" and k != "type")
    if isinstance(value, (list, tuple)):
        return sum(text_chars(item) for item in value)
    return 0


def check_text_fits(chars: int, tokenizer, max_model_len: int, what: str = "The input") -> None:
    """``InvalidRequestError`` when ``chars`` characters of text must make more than
    ``max_model_len`` tokens, whatever they say."""
    if chars <= max(max_model_len, _EXACT_BELOW_CHARS):
        return  # cheap to tokenize: the exact check that follows says precisely how many tokens
    least = math.ceil(chars / max_chars_per_token(tokenizer))
    if least > max_model_len:
        raise InvalidRequestError(
            f"{what} has {chars} characters of text, at least {least} tokens; this model's maximum context "
            f"length is {max_model_len} tokens. Please reduce the length of the input.", param="input_tokens")
