"""Reasoning parsers (deepseek_r1, qwen3) on whole outputs and on the same outputs streamed in
every way of cutting them (tags split across deltas included)."""

from __future__ import annotations


import pytest

from atb_plugin.server.reasoning_parsers import REASONING_PARSERS, ReasoningDelta, get_reasoning_parser
from tests.helpers import chunkings

# (output text, deepseek_r1's (reasoning, content), qwen3's (reasoning, content))
CASES = {
    "opening tag in the output": (
        "<think>\nThe user greets me.\n</think>\n\nHello!",
        ("\nThe user greets me.\n", "\n\nHello!"),
        ("\nThe user greets me.\n", "\n\nHello!"),
    ),
    "opening tag in the prompt": (
        "The user greets me.\n</think>\n\nHello!",
        ("The user greets me.\n", "\n\nHello!"),
        (None, "The user greets me.\n</think>\n\nHello!"),
    ),
    "no tags at all": ("Hello!", ("Hello!", None), (None, "Hello!")),
    "cut short while thinking": ("<think>Let me see, 2 + 2", ("Let me see, 2 + 2", None), ("Let me see, 2 + 2", None)),
    "stops right after thinking": ("<think>done</think>", ("done", None), ("done", None)),
    "empty think block": ("<think></think>Answer", (None, "Answer"), (None, "Answer")),
    "closing tag twice": ("a</think>b</think>c", ("a", "b</think>c"), (None, "a</think>b</think>c")),
    "a partial closing tag at the end": ("<think>hmm </thi", ("hmm </thi", None), ("hmm </thi", None)),
    "a partial opening tag alone": ("<thi", ("<thi", None), (None, "<thi")),
    "the tag later in the text": ("I <think> so", ("I <think> so", None), (None, "I <think> so")),
    "look-alike tags": ("<thinking>x</thinker>", ("<thinking>x</thinker>", None), (None, "<thinking>x</thinker>")),
}

PARAMS = [(name, text, expected[index], label) for label, (text, *expected) in CASES.items()
          for index, name in enumerate(["deepseek_r1", "qwen3"])]
IDS = [f"{name}: {label}" for name, _, _, label in PARAMS]


def streamed(name: str, pieces) -> tuple[str | None, str | None]:
    parser = get_reasoning_parser(name).streaming()
    deltas = [delta for piece in pieces for delta in parser.feed(piece)] + parser.finish()
    for reasoning, content in deltas:
        assert (reasoning is None) != (content is None) and (reasoning or content)
    reasoning = "".join(d.reasoning for d in deltas if d.reasoning is not None)
    content = "".join(d.content for d in deltas if d.content is not None)
    return reasoning or None, content or None


@pytest.mark.parametrize("name, text, expected, label", PARAMS, ids=IDS)
def test_extract(name, text, expected, label):
    assert get_reasoning_parser(name).extract(text) == expected


@pytest.mark.parametrize("name, text, expected, label", PARAMS, ids=IDS)
def test_streamed_deltas_reassemble_to_extract(name, text, expected, label):
    for pieces in chunkings(text):
        assert streamed(name, pieces) == expected, pieces


def test_closing_tag_split_across_deltas_is_held():
    parser = get_reasoning_parser("deepseek_r1").streaming()
    assert parser.feed("Thinking</th") == [ReasoningDelta("Thinking", None)]
    assert parser.feed("ink>\n\nAnswer") == [ReasoningDelta(None, "\n\nAnswer")]
    assert parser.finish() == []


def test_opening_tag_split_across_deltas_is_held():
    parser = get_reasoning_parser("qwen3").streaming()
    assert parser.feed("<th") == []
    assert parser.feed("ink>Hmm") == [ReasoningDelta("Hmm", None)]
    parser = get_reasoning_parser("qwen3").streaming()
    assert parser.feed("<th") == []
    assert parser.feed("e answer") == [ReasoningDelta(None, "<the answer")]


def test_deltas_unpack_as_reasoning_then_content():
    parser = get_reasoning_parser("deepseek_r1").streaming()
    [(reasoning, content)] = parser.feed("why")
    assert (reasoning, content) == ("why", None)


def test_a_stream_parser_serves_one_output():
    parser = get_reasoning_parser("qwen3").streaming()
    parser.finish()
    with pytest.raises(RuntimeError):
        parser.feed("x")


def test_registry_and_unknown_parser():
    assert set(REASONING_PARSERS) == {"deepseek_r1", "qwen3"}
    with pytest.raises(ValueError, match=r"unknown reasoning parser 'granite'; known: deepseek_r1, qwen3"):
        get_reasoning_parser("granite")
