"""Incremental detokenisation with the tiny checkpoints' real byte-level BPE tokenizers: characters
split over several tokens never stream as U+FFFD, the streamed text equals ``tokenizer.decode``,
special tokens are skipped, and stop strings cut the text even across token boundaries."""

from __future__ import annotations

import functools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from atb_plugin.frontend.detokenizer import IncrementalDetokenizer, special_token_ids
from atb_plugin.engine.sampling_params import SamplingParams
from atb_plugin.testing.tiny import tiny_checkpoint

FAMILIES = ["qwen2", "llama", "llava"]  # byte-level BPE, special tokens after / before the vocabulary
TEXT = "Hello 世界! Emoji: 🎉👍🏽 and é, ß, 𝔘. The end."
PROMPT = "What is in this picture?"
REPLACEMENT = "\ufffd"


@functools.cache
def tokenizer(family: str = "qwen2"):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_checkpoint(family))


def encode(text: str, family: str = "qwen2") -> list[int]:
    return tokenizer(family)(text, add_special_tokens=False).input_ids


def stream(ids: list[int], params: SamplingParams | None = None, family: str = "qwen2",
           chunk: int = 1, prompt: list[int] | None = None) -> tuple[list[str], IncrementalDetokenizer]:
    """Feed ``ids`` ``chunk`` at a time like the engine does (stop at a stop string, else finish)."""
    tok = tokenizer(family)
    detokenizer = IncrementalDetokenizer(tok, prompt if prompt is not None else encode(PROMPT, family),
                                         params or SamplingParams())
    deltas = []
    for start in range(0, len(ids), chunk):
        deltas.append(detokenizer.update(ids[start:start + chunk]))
        if detokenizer.stopped_by is not None:
            break
    else:
        deltas.append(detokenizer.finish())
    return deltas, detokenizer


# -- multi-byte characters -----------------------------------------------------------------------------


@pytest.mark.parametrize("family", FAMILIES)
def test_characters_split_over_tokens_stream_without_replacement_characters(family):
    ids = encode(TEXT, family)
    tok = tokenizer(family)
    # The test means something: some characters really are split over several tokens.
    assert any(REPLACEMENT in tok.decode([i]) for i in ids)
    deltas, detokenizer = stream(ids, family=family)
    assert not any(REPLACEMENT in delta for delta in deltas)
    assert "".join(deltas) == detokenizer.output_text == tok.decode(ids) == TEXT
    assert "🎉" in deltas and "世" in deltas  # each arrives whole, in one delta


@pytest.mark.parametrize("chunk", [2, 3, 7, 1000])
def test_several_tokens_per_update(chunk):
    ids = encode(TEXT)
    deltas, detokenizer = stream(ids, chunk=chunk)
    assert not any(REPLACEMENT in delta for delta in deltas)
    assert detokenizer.output_text == TEXT


@settings(max_examples=60, deadline=None)
@given(text=st.text(alphabet=st.sampled_from(list("ab cd.,\n\téß世界語🎉👍🏽𝔘\u0301")), max_size=40),
       chunk=st.integers(1, 4))
def test_streaming_equals_decode_for_any_text(text, chunk):
    ids = encode(text)
    deltas, detokenizer = stream(ids, chunk=chunk)
    assert not any(REPLACEMENT in delta for delta in deltas)
    assert "".join(deltas) == detokenizer.output_text == tokenizer().decode(ids)


def test_finish_releases_an_incomplete_character():
    ids = encode("ok 🎉")[:-1]  # the emoji's last byte never comes
    deltas, detokenizer = stream(ids)
    assert deltas[-1].endswith(REPLACEMENT)  # released by finish(), not before
    assert detokenizer.output_text == tokenizer().decode(ids)


def test_first_token_decodes_in_the_prompts_context():
    """The prompt tail is context, not output; media placeholders (negative ids) are skipped."""
    ids = encode(" world")
    for prompt in (encode("Hello"), [-5, -4], encode("Hello") + [-3], [-3, *encode("Hello")]):
        assert "".join(stream(ids, prompt=prompt)[0]) == " world"


# -- special tokens ------------------------------------------------------------------------------------


@pytest.mark.parametrize("family", FAMILIES)
def test_special_tokens_are_skipped_unless_asked_for(family):
    tok = tokenizer(family)
    specials = sorted(special_token_ids(tok))
    ids = [specials[0], *encode("Hi 🎉", family), specials[-1], *encode(" there", family), tok.eos_token_id]
    deltas, detokenizer = stream(ids, family=family)
    assert detokenizer.output_text == tok.decode(ids, skip_special_tokens=True) == "Hi 🎉 there"
    kept, detokenizer = stream(ids, SamplingParams(skip_special_tokens=False), family=family)
    assert detokenizer.output_text == tok.decode(ids, skip_special_tokens=False)
    assert tok.eos_token in detokenizer.output_text


def test_special_ids_include_added_special_tokens():
    tok = tokenizer("qwen2")
    assert tok.convert_tokens_to_ids("<|im_start|>") in special_token_ids(tok)
    assert set(tok.all_special_ids) <= special_token_ids(tok)


# -- stop strings --------------------------------------------------------------------------------------


def test_stop_string_across_token_boundaries_cuts_the_text_before_it():
    ids = encode("The cat sat on the mat. Then more text.")
    stop = "on the m"
    tokens = tokenizer().convert_ids_to_tokens(ids)
    assert stop.replace(" ", "Ġ") not in tokens  # it spans several tokens
    deltas, detokenizer = stream(ids, SamplingParams(stop=[stop]))
    assert detokenizer.stopped_by == stop
    assert "".join(deltas) == detokenizer.output_text == "The cat sat "
    assert len(deltas) < len(ids)  # stopped early: the rest was never decoded


def test_text_that_may_start_a_stop_string_is_withheld_until_decided():
    ids = encode("I said the end is not the ending")
    deltas, detokenizer = stream(ids, SamplingParams(stop=["the ending"]))
    streamed = ""
    for delta in deltas:
        streamed += delta
        assert "the ending" not in streamed
    assert detokenizer.stopped_by == "the ending"
    assert detokenizer.output_text == "I said the end is not "
    # "the end" was held back while it could still become "the ending", then released:
    assert "the end is" in deltas


def test_a_withheld_prefix_is_released_by_finish():
    ids = encode("the story ends with the")
    deltas, detokenizer = stream(ids, SamplingParams(stop=["the end."]))
    assert detokenizer.stopped_by is None
    assert not "".join(deltas[:-1]).endswith("the")  # held back while streaming ...
    assert deltas[-1].endswith("the")  # ... and released at the finish
    assert detokenizer.output_text == "the story ends with the"


@pytest.mark.parametrize("chunk", [1, 100])
def test_the_earliest_stop_string_wins(chunk):
    ids = encode("a b c d e")
    # Both complete with the token "d": the one that starts first wins, whatever the list order.
    _, detokenizer = stream(ids, SamplingParams(stop=["c d", "b c d"]), chunk=chunk)
    assert detokenizer.stopped_by == "b c d" and detokenizer.output_text == "a "
    # Tokens are checked one at a time even within an update: "c" completes first.
    _, detokenizer = stream(ids, SamplingParams(stop=["b c d", "c"]), chunk=chunk)
    assert detokenizer.stopped_by == "c" and detokenizer.output_text == "a b "


def test_stop_string_inside_a_multi_byte_run():
    ids = encode("ok 世界 🎉 done")
    _, detokenizer = stream(ids, SamplingParams(stop=["界 🎉"]))
    assert detokenizer.stopped_by == "界 🎉" and detokenizer.output_text == "ok 世"


def test_stop_strings_count_only_after_min_tokens():
    ids = encode("stop here, then stop again")
    n = len(encode("stop here"))
    _, detokenizer = stream(ids, SamplingParams(stop=["stop"], min_tokens=n, max_tokens=100))
    assert detokenizer.stopped_by == "stop" and detokenizer.output_text == "stop here, then "


def test_update_after_a_stop_is_an_error():
    _, detokenizer = stream(encode("a b c"), SamplingParams(stop=["b"]))
    with pytest.raises(RuntimeError, match="finished"):
        detokenizer.update([1])
    assert detokenizer.finish() == ""
