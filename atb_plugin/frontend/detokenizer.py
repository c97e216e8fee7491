"""``IncrementalDetokenizer``: a request's output token ids -> streamed text, and stop strings.

Two jobs, one per request:

1. Decode token by token without ever streaming a broken character. Byte-level BPE splits one
   UTF-8 character over several tokens (an emoji is often 4 byte tokens), and a decoder may treat
   the first token of a string specially (SentencePiece drops its leading space). So each new
   token is decoded together with a few tokens before it (vLLM's ``detokenize_incrementally``)::

        tokens:  ... t5  t6  t7 | t8  t9        (token strings, prompt tail first)
                     ^prefix    ^read           t8, t9: not streamed yet
        prefix_text = decode(tokens[prefix:read])     already streamed
        new_text    = decode(tokens[prefix:])
        new_text ends in U+FFFD (an incomplete character)? -> stream nothing, wait for more bytes
        else stream new_text[len(prefix_text):], then prefix, read = read, len(tokens)

2. Stop strings (``SamplingParams.stop``): the text is cut before the first one found
   (``include_stop_str_in_output=False``, vLLM's default), also when it spans tokens, and text that
   could still be the beginning of a stop string is withheld from the stream until the next
   tokens decide. Like vLLM, stop strings count only once the request has more than
   ``min_tokens`` output tokens, and only occurrences that end in newly decoded text.

Contract: ``update(new_token_ids)`` returns the text delta to stream; ``output_text`` is always the
concatenation of the deltas so far; ``stopped_by`` is the stop string that ended the request, else
None (the caller then finishes the request with FINISHED_STOPPED and decodes no more). When a
request finishes for another reason (EOS, stop id, length), call ``finish()`` once: it releases
the withheld text (a stop-string prefix that never completed, trailing bytes of an incomplete
character) so that ``output_text`` equals ``tokenizer.decode(output_ids, skip_special_tokens=...)``.

Works with any transformers tokenizer through ``convert_ids_to_tokens`` /
``convert_tokens_to_string`` (fast tokenizers: the Rust decoder). Special tokens are those the
Rust backend skips in ``decode`` (added tokens marked special) plus ``all_special_ids``.
"""

from __future__ import annotations

import weakref

from atb_plugin.engine.sampling_params import SamplingParams

__all__ = ["IncrementalDetokenizer", "special_token_ids"]

# Prompt tokens decoded as context before the first output token (vLLM's
# INITIAL_INCREMENTAL_DETOKENIZATION_OFFSET): enough for every decoder's start-of-text rule.
_PROMPT_CONTEXT_TOKENS = 5
_REPLACEMENT_CHARACTER = "\ufffd"

_special_ids_cache: "weakref.WeakKeyDictionary[object, frozenset[int]]" = weakref.WeakKeyDictionary()


def special_token_ids(tokenizer) -> frozenset[int]:
    """The ids ``tokenizer.decode(..., skip_special_tokens=True)`` drops (cached per tokenizer)."""
    try:
        return _special_ids_cache[tokenizer]
    except (KeyError, TypeError):
        pass
    ids = set(tokenizer.all_special_ids)
    added = getattr(tokenizer, "added_tokens_decoder", None) or {}
    ids.update(i for i, token in added.items() if getattr(token, "special", False))
    result = frozenset(ids)
    try:
        _special_ids_cache[tokenizer] = result
    except TypeError:  # not weak-referenceable: recompute next time
        pass
    return result


class IncrementalDetokenizer:
    """One request's streaming decoder (see the module docstring for the contract)."""

    def __init__(self, tokenizer, prompt_token_ids: list[int], params: SamplingParams):
        self.tokenizer = tokenizer
        self.params = params
        self._skip_ids = special_token_ids(tokenizer) if params.skip_special_tokens else frozenset()
        self._stop = list(params.stop)
        self._num_output_tokens = 0

        # Decoding context: the prompt's last few text tokens. Negative ids are media placeholders
        # (shared-memory handles), not vocabulary: context starts after the last one.
        tail = list(prompt_token_ids[-_PROMPT_CONTEXT_TOKENS:])
        while any(t < 0 for t in tail):
            tail = tail[next(i for i, t in enumerate(tail) if t < 0) + 1:]
        self._tokens: list[str] = self._to_token_strings(tail)
        self._prefix_offset = 0
        self._read_offset = len(self._tokens)

        self._text = ""  # all cleanly decoded output text (cut at a stop string)
        self._num_streamed = 0  # chars of _text already returned by update / finish
        self.stopped_by: str | None = None
        self.finished = False

    @property
    def output_text(self) -> str:
        return self._text[:self._num_streamed]

    def update(self, new_token_ids: list[int]) -> str:
        """Decode the request's newly sampled tokens; return the text to stream now."""
        if self.finished:
            raise RuntimeError("update() after the detokenizer finished (a stop string or finish())")
        for token_id in new_token_ids:
            self._num_output_tokens += 1
            old_length = len(self._text)
            self._text += self._decode_next(token_id)
            if self._stop and self._num_output_tokens > self.params.min_tokens and len(self._text) > old_length:
                self._check_stop_strings(old_length)
                if self.stopped_by is not None:
                    return self._release(len(self._text))
        return self._release(len(self._text) - self._withheld_length())

    def finish(self) -> str:
        """The request finished for a reason other than a stop string: release what was withheld
        (the prefix of a stop string that never completed, an incomplete character's bytes)."""
        if self.finished:
            return ""
        self.finished = True
        if self._read_offset < len(self._tokens):
            prefix_text = self._decode(self._tokens[self._prefix_offset:self._read_offset])
            self._text += self._decode(self._tokens[self._prefix_offset:])[len(prefix_text):]
            self._prefix_offset = self._read_offset = len(self._tokens)
        return self._release(len(self._text))

    # -- decoding --------------------------------------------------------------------------------

    def _to_token_strings(self, ids: list[int]) -> list[str]:
        kept = [i for i in ids if i not in self._skip_ids]
        return list(self.tokenizer.convert_ids_to_tokens(kept)) if kept else []

    def _decode(self, tokens: list[str]) -> str:
        return self.tokenizer.convert_tokens_to_string(tokens) if tokens else ""

    def _decode_next(self, token_id: int) -> str:
        """vLLM's detokenize_incrementally step: the clean new text, or "" while incomplete."""
        self._tokens += self._to_token_strings([token_id])
        prefix_text = self._decode(self._tokens[self._prefix_offset:self._read_offset])
        new_text = self._decode(self._tokens[self._prefix_offset:])
        if len(new_text) <= len(prefix_text) or new_text.endswith(_REPLACEMENT_CHARACTER):
            return ""
        self._prefix_offset, self._read_offset = self._read_offset, len(self._tokens)
        return new_text[len(prefix_text):]

    # -- stop strings ----------------------------------------------------------------------------

    def _check_stop_strings(self, old_length: int) -> None:
        """Cut ``_text`` before the earliest stop string that ends after ``old_length``."""
        best: tuple[int, str] | None = None
        for stop in self._stop:
            index = self._text.find(stop, max(0, old_length - len(stop) + 1))
            if index != -1 and (best is None or index < best[0]):
                best = (index, stop)
        if best is not None:
            index, self.stopped_by = best
            if self.params.include_stop_str_in_output:
                index += len(self.stopped_by)
            # Withholding guarantees index >= _num_streamed; max() only guards the contract.
            self._text = self._text[:max(index, self._num_streamed)]
            self.finished = True

    def _withheld_length(self) -> int:
        """Length of the longest end of ``_text`` that is a proper prefix of a stop string: it
        may yet become one, so it is not streamed. (Checked below min_tokens too, so that a
        string straddling the min_tokens boundary is still caught.)"""
        longest = 0
        unstreamed = len(self._text) - self._num_streamed
        for stop in self._stop:
            for length in range(min(len(stop) - 1, unstreamed), longest, -1):
                if self._text.endswith(stop[:length]):
                    longest = length
                    break
        return longest

    def _release(self, upto: int) -> str:
        upto = max(upto, self._num_streamed)
        delta = self._text[self._num_streamed:upto]
        self._num_streamed = upto
        return delta
