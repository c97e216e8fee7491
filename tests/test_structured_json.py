"""json_schema / json_object outputs are RFC 8259 JSON (issue 30, item 5): every string-producing
construct (plain, minLength / maxLength, pattern, format, enum / const, property names, items)
refuses raw U+0000-U+001F, a raw quote or backslash, invalid escapes and bytes that are not UTF-8,
and takes the escapes its strings may hold (a bounded-length one counting each as one character).
Checked on the grammars themselves, on random documents drawn byte by byte from them, and on 1,000
outputs of the engine with random weights: each finished one parses (strict) and validates, each
one cut by max_tokens is the start of an RFC 8259 document (an independent prefix checker)."""

from __future__ import annotations

import json
import random

import jsonschema
import numpy as np
import pytest

from atb_plugin import LLM, SamplingParams
from atb_plugin.engine.sampling_params import StructuredOutputsParams
from atb_plugin.engine.structured_output import check, to_grammar
from atb_plugin.testing.tiny import tiny_checkpoint

xgr = pytest.importorskip("xgrammar")
from xgrammar.testing import _is_grammar_accept_string  # noqa: E402 - after the importorskip

FORMAT_CHECKER = jsonschema.Draft202012Validator.FORMAT_CHECKER


def grammar_of(schema):
    if schema is None:
        return to_grammar(StructuredOutputsParams(json_object=True))
    return to_grammar(StructuredOutputsParams(json=schema))


def accepts(schema, text: str) -> bool:
    return _is_grammar_accept_string(grammar_of(schema), text)


def validate(schema, text: str):
    value = json.loads(text)  # strict: no raw control character in a string
    jsonschema.validate(value, {"type": "object"} if schema is None else schema, format_checker=FORMAT_CHECKER)
    return value


BOUNDED = {"type": "string", "maxLength": 3}

# (construct, schema, documents it must accept, documents it must refuse). Each refused document
# is invalid JSON, valid JSON the schema refuses, or (a surrogate escape in a bounded-length
# string, which would count two characters for one) a spelling the grammar never writes.
CONSTRUCTS = [
    ("plain", {"type": "string"},
     ['"a\\"\\\\\\/\\b\\f\\n\\r\\t\\u0001z"', '"\x7f\u2028😀"'], ['"\x01"', '"\x1f"', '"\t"', '"\\x"', '"\\u12"']),
    ("maxLength", BOUNDED,
     ['""', '"abc"', '"\\n\\t\\""', '"\\u0001\\\\\\/"', '"😀é\x7f"', '"\\uD7FFa"'],
     ['"abcd"', '"\\n\\n\\n\\n"', '"\x00"', '"a\x01"', '"\x1f"', '"\t"', '"\\q"', '"\\ud83d\\ude00"', '"\\uDC00"']),
    ("minLength", {"type": "string", "minLength": 2},
     ['"ab"', '"\\n\\u0000"', '"\\"\\\\ and more"'], ['"a"', '"\\n"', '"ab\x02"', '"\x03\x04"']),
    ("exact length", {"type": "string", "minLength": 1, "maxLength": 1},
     ['"a"', '"\\n"', '"\\u001f"', '"😀"'], ['""', '"ab"', '"\x01"', '"\\ud83d\\ude00"']),
    ("maxLength 1", {"type": "string", "maxLength": 1}, ['""', '"\\t"', '"x"'], ['"\t"', '"xy"']),
    ("pattern", {"type": "string", "pattern": "^[a-z]+\\d{2}$"}, ['"ab12"'], ['"ab1"', '"a\x01b12"']),
    ("pattern dot", {"type": "string", "pattern": "^.{1,3}$"},
     ['"a\\"\\\\"', '"\\t\\u0001"', '"é"'], ['"\x01"', '"a"b"', '"\\n"', '"abcd"']),
    ("pattern negated class", {"type": "string", "pattern": "^[^x]{2}$"},
     ['"\\n\\""', '"ab"'], ['"\n\t"', '"ax"', '"\\""']),
    ("pattern quote literal", {"type": "string", "pattern": '^say "(hi|yo)"$'},
     ['"say \\"hi\\""'], ['"say "hi""']),
    ("pattern backslash literal", {"type": "string", "pattern": "^a\\\\b$"}, ['"a\\\\b"'], ['"a\\b"']),
    ("pattern control escape", {"type": "string", "pattern": "^\\w+\\n\\t\\x01$"},
     ['"ab\\n\\t\\u0001"'], ['"ab\n\t\x01"']),
    ("pattern non-ASCII", {"type": "string", "pattern": "^é.[à-ü]$"},
     ['"éaü"', '"é\\"à"'], ['"é\x01à"', '"é"à"', '"é\\à"']),
    ("pattern whitespace class", {"type": "string", "pattern": "^\\s\\S$"},
     ['"\\ta"', '" \\""', '"\u00a0b"'], ['"\ta"', '"\na"', '"a "']),
    ("email", {"type": "string", "format": "email"},
     ['"a.b@c.io"', '"\\"x\\\\\\"y\\"@c.io"'], ['"\\"x\\q\\"@c.io"', '"\\"x"@c.io"']),
    ("json-pointer", {"type": "string", "format": "json-pointer"},
     ['"/a~1b/\\"\\\\/\\u0001"', '""'], ['"/\x01"', '"/a"b"', '"/a\\q"']),
    ("relative-json-pointer", {"type": "string", "format": "relative-json-pointer"},
     ['"0#"', '"1/\\n"'], ['"1/\n"', '"1/\\"']),
    ("date-time", {"type": "string", "format": "date-time"}, ['"2024-01-02T03:04:05Z"'], ['"2024-01-02"']),
    ("enum", {"enum": ['a"b', "c\\d", "e\x01f", "\n", "ü€😀", "\u2028", 1, None]},
     ['"a\\"b"', '"c\\\\d"', '"e\\u0001f"', '"\\n"', '"ü€😀"', '"\u2028"', "1", "null"],
     ['"a"b"', '"e\x01f"', '"\n"', '"c\\d"']),
    ("const", {"const": "tab\there"}, ['"tab\\there"'], ['"tab\there"']),
    ("required odd names", {"type": "object", "properties": {'q"\x01': {"type": "integer"}}, "required": ['q"\x01']},
     ['{"q\\"\\u0001": 1}'], ['{"q"\x01": 1}', '{"q\\"\x01": 1}']),
    ("additionalProperties", {"type": "object", "additionalProperties": {"type": "integer"}},
     ['{"\\n\\"": 1}'], ['{"\n": 1}', '{"\x01": 1}']),
    ("propertyNames maxLength", {"type": "object", "propertyNames": {"maxLength": 2}, "additionalProperties": True},
     ['{"\\n\\t": 1}', '{"ab": "\\u0001"}'], ['{"\x01": 1}', '{"abc": 1}', '{"a\t": 1}']),
    ("propertyNames pattern", {"type": "object", "propertyNames": {"pattern": "^k.$"}, "additionalProperties": True},
     ['{"k\\"": 1}'], ['{"k\x01": 1}', '{"k"": 1}']),
    ("patternProperties", {"type": "object", "patternProperties": {"^x.?$": {"type": "string", "maxLength": 1}}},
     ['{"x\\\\": "\\n"}'], ['{"x\x01": "a"}', '{"x": "\x01"}']),
    ("array items", {"type": "array", "items": BOUNDED},
     ['["\\n", "abc", ""]'], ['["\x01"]', '["abcd"]']),
    ("prefixItems", {"type": "array", "prefixItems": [BOUNDED], "items": False},
     ['["\\u0000"]'], ['["\x00"]']),
    ("nullable", {"type": ["string", "null"], "maxLength": 2}, ['"\\r\\n"', "null"], ['"\r\n"']),
    ("anyOf", {"anyOf": [BOUNDED, {"type": "integer"}]}, ['"\\b"', "3"], ['"\x08"']),
    ("$defs", {"$defs": {"s": {"type": "string", "pattern": "^\\\\?$"}}, "type": "object",
               "properties": {"p": {"$ref": "#/$defs/s"}}, "required": ["p"]},
     ['{"p": "\\\\"}', '{"p": ""}'], ['{"p": "\\"}']),
    ("json_object", None, ['{"\\u0001": ["\\n", {"\\"": "\\\\"}]}'], ['{"\x01": 1}', '{"a": "\n"}']),
]


@pytest.mark.parametrize("schema, valid, invalid", [c[1:] for c in CONSTRUCTS], ids=[c[0] for c in CONSTRUCTS])
def test_each_string_construct_takes_escapes_and_refuses_raw_control_characters(schema, valid, invalid):
    grammar = grammar_of(schema)
    for text in valid:
        validate(schema, text)  # the case itself is right
        assert _is_grammar_accept_string(grammar, text), text
    for text in invalid:
        assert not _is_grammar_accept_string(grammar, text), text


@pytest.mark.parametrize("max_length", [0, 1, 2, 5, 40])
def test_max_length_counts_each_escape_as_one_character(max_length):
    schema = {"type": "string", "maxLength": max_length}
    grammar = grammar_of(schema)
    for text in ["a", "\n", '"', "\\", "\x00", "\x1f", "é", "😀", "\u2028"]:
        for n in (max_length, max_length + 1):
            document = json.dumps(text * n, ensure_ascii=False)
            assert _is_grammar_accept_string(grammar, document) == (n <= max_length), document
            escaped = json.dumps(text * n)  # \uXXXX for non-ASCII, a surrogate pair for 😀: never written
            expected = n <= max_length and (text != "😀" or n == 0)
            assert _is_grammar_accept_string(grammar, escaped) == expected, escaped


def test_a_string_bounded_beyond_128_characters_takes_no_escape_but_stays_json():
    # xgrammar compiles its class repetition fast; a regex with escapes that large it would not.
    schema = {"type": "string", "minLength": 2, "maxLength": 500}
    grammar = grammar_of(schema)
    assert _is_grammar_accept_string(grammar, json.dumps("é" * 500, ensure_ascii=False))
    for text in ['"' + "a" * 501 + '"', '"a"', '"a\\nb"', '"a\\u0041"', '"a\x01b"', '"a\tb"']:
        assert not _is_grammar_accept_string(grammar, text), text
    assert _is_grammar_accept_string(grammar_of({"type": "string", "maxLength": 128}), json.dumps("\n" * 128))


@pytest.mark.parametrize("schema, message", [
    ({"type": "string", "pattern": "[a-"}, "unterminated character class"),
    ({"type": "string", "pattern": "[z-a]"}, "out of order"),
    ({"type": "string", "pattern": "a\\"}, "ends with a backslash"),
    ({"type": "string", "pattern": "^\\ud800$"}, "no JSON text can hold"),
    ({"type": "string", "pattern": "^(?=a)b$"}, "Lookahead is not supported"),  # xgrammar's own refusal, up front
])
def test_a_pattern_that_cannot_be_rewritten_is_a_400_naming_it(schema, message):
    with pytest.raises(ValueError, match=message) as error:
        check(StructuredOutputsParams(json=schema))
    assert str(error.value).startswith("structured_outputs.json: invalid JSON schema: pattern ")


def test_enum_values_that_look_like_patterns_are_data():
    schema = {"enum": [{"pattern": "^\n$", "patternProperties": {"\x01": 1}}]}
    assert accepts(schema, '{"pattern":"^\\n$","patternProperties":{"\\u0001":1}}')  # compact, as xgrammar writes it


# -- a JSON prefix checker, independent of xgrammar ------------------------------------------------


class _End(Exception):
    """The text ended where the document could go on."""


def is_json_prefix(text: str) -> bool:
    """Whether ``text`` is the start of some RFC 8259 document (a whole one included): no raw
    control character in a string, no bad escape, nothing out of place."""
    i = 0

    def peek() -> str:
        if i >= len(text):
            raise _End
        return text[i]

    def take(chars: str) -> str:
        nonlocal i
        char = peek()
        if char not in chars:
            raise ValueError(f"{char!r} at {i}")
        i += 1
        return char

    def space():
        nonlocal i
        while peek() in " \t\n\r":
            i += 1

    def digits(at_least: int):
        nonlocal i
        for _ in range(at_least):
            take("0123456789")
        while peek() in "0123456789":
            i += 1

    def string():
        nonlocal i
        take('"')
        while True:
            char = peek()
            if ord(char) < 0x20:
                raise ValueError(f"raw control character {char!r} at {i}")
            i += 1
            if char == '"':
                return
            if char == "\\":
                if take('"\\/bfnrtu') == "u":
                    for _ in range(4):
                        take("0123456789abcdefABCDEF")

    def number():
        nonlocal i
        if peek() == "-":
            i += 1
        if take("0123456789") != "0":
            digits(0)
        if peek() == ".":
            i += 1
            digits(1)
        if peek() in "eE":
            i += 1
            if peek() in "+-":
                i += 1
            digits(1)

    def value():
        nonlocal i
        space()
        char = peek()
        if char == "{":
            i += 1
            space()
            if peek() == "}":
                i += 1
                return
            while True:
                space()
                string()
                space()
                take(":")
                value()
                space()
                if take(",}") == "}":
                    return
        elif char == "[":
            i += 1
            space()
            if peek() == "]":
                i += 1
                return
            while True:
                value()
                space()
                if take(",]") == "]":
                    return
        elif char == '"':
            string()
        elif char in "-0123456789":
            number()
        else:
            for word in ("true", "false", "null"):
                if word.startswith(text[i:i + len(word)]):
                    for letter in word:
                        take(letter)
                    return
            raise ValueError(f"{char!r} at {i}")

    try:
        value()
        while i < len(text):  # a number may end the text: what follows must be whitespace
            if text[i] not in " \t\n\r":
                return False
            i += 1
        return True
    except _End:
        return True
    except ValueError:
        return False


def test_the_prefix_checker():
    for text in ['{"a": [1, -2.5e+3, "x\\u00', "-", "tr", '{"k', '"\\', "[", "", "0", '{"a": nu', '["\u2028']:
        assert is_json_prefix(text), text
    for text in ['"\x01', '"a\x1f"', '"\\q', '{"a" 1', "[1,]", "01", "-a", "nul1", "tx", '{"a": 1}}', '"\\u00g']:
        assert not is_json_prefix(text), text


# -- UTF-8: the bytes after a lead byte ---------------------------------------------------------

BYTES = xgr.TokenizerInfo([bytes([b]) for b in range(256)] + [b"<eos>"], stop_token_ids=[256])
EOS = 256


def allowed_bytes(matcher, bitmask) -> list[int]:
    matcher.fill_next_token_bitmask(bitmask)
    return np.unpackbits(bitmask.numpy().view(np.uint8), bitorder="little")[:257].nonzero()[0].tolist()


def second_bytes(lead: int) -> set[int]:
    """The bytes UTF-8 allows after ``lead`` (RFC 3629: no overlong form, surrogate, or beyond U+10FFFF)."""
    special = {0xE0: (0xA0, 0xBF), 0xED: (0x80, 0x9F), 0xF0: (0x90, 0xBF), 0xF4: (0x80, 0x8F)}
    if lead in special:
        return set(range(special[lead][0], special[lead][1] + 1))
    return set(range(0x80, 0xC0)) if 0xC2 <= lead <= 0xF3 else set()


def utf8_violations(schema, opener: bytes) -> list:
    """Where the grammar of ``schema``, after ``opener`` (which leaves it inside a string), lets a
    byte through that no UTF-8 text has there (a lead byte, the byte after it, the one after that)."""
    compiled = xgr.GrammarCompiler(BYTES, cache_enabled=False).compile_grammar(grammar_of(schema))
    matcher, bitmask = xgr.GrammarMatcher(compiled), xgr.allocate_token_bitmask(1, 257)
    assert all(matcher.accept_token(b) for b in opener)
    bad = []
    for lead in [b for b in allowed_bytes(matcher, bitmask) if 0x80 <= b <= 0xFF]:
        valid = second_bytes(lead)
        if not valid:
            bad.append(bytes([lead]))
            continue
        assert matcher.accept_token(lead)
        seconds = {b for b in allowed_bytes(matcher, bitmask) if b >= 0x80}
        bad += [bytes([lead, b]) for b in sorted(seconds - valid)]
        if lead >= 0xE0:
            for second in sorted(seconds & valid)[::8]:
                assert matcher.accept_token(second)
                thirds = {b for b in allowed_bytes(matcher, bitmask) if b >= 0x80}
                bad += [bytes([lead, second, b]) for b in sorted(thirds - set(range(0x80, 0xC0)))]
                matcher.rollback(1)
        matcher.rollback(1)
    return bad


@pytest.mark.parametrize("schema, opener", [
    (None, b'{"'),
    (None, b'{"k": ["'),
    ({"type": "string"}, b'"'),
    ({"type": "string", "maxLength": 4}, b'"'),
    ({"type": "object", "propertyNames": {"minLength": 1}, "additionalProperties": True}, b'{"'),
    ({"type": "object", "properties": {"a": {"type": "integer"}}, "additionalProperties": True}, b'{"'),
    ({"type": "string", "pattern": "^.+$"}, b'"'),
    ({"type": "string", "pattern": "^[^a]+$"}, b'"'),
    ({"type": "string", "pattern": "^\\S+$"}, b'"'),
    ({"type": "string", "pattern": "^[\\u00e0-\\u{10FFFF}]+$"}, b'"'),
    ({"type": "string", "format": "json-pointer"}, b'"/'),
], ids=lambda value: value.decode() if isinstance(value, bytes) else json.dumps(value)[:40])
def test_strings_hold_utf8_only(schema, opener):
    """No overlong form or surrogate (which the detokenizer would turn into U+FFFD, breaking
    maxLength and patterns): xgrammar lets ED A0-BF through in a negated class and E0 80-9F /
    F0 80-8F in a regex class that crosses them."""
    assert utf8_violations(schema, opener) == []


# -- random documents, drawn byte by byte from the grammar ----------------------------------------

FAVOURED = [ord(c) for c in '"\\}],:'] + [EOS]  # a walk picks among these (when allowed) 30% of the time

SAMPLED = [
    None,
    {"type": "string", "maxLength": 6},
    {"type": "object", "properties": {"a": {"type": "string", "minLength": 1, "maxLength": 4},
                                      "b": {"type": "array", "items": {"type": "string", "maxLength": 2}, "maxItems": 3}},
     "required": ["a", "b"]},
    {"type": "string", "pattern": '^(\\w|[."\\\\\\n\\x00-\\x1f])+$'},
    {"type": "string", "pattern": "^.{0,5}[^a-z]?$"},
    {"type": "object", "propertyNames": {"maxLength": 3}, "additionalProperties": {"type": "string"}, "maxProperties": 3},
    {"type": "object", "patternProperties": {'^"\\w?$': {"type": "string", "pattern": "^\\S{0,3}$"}}, "maxProperties": 3},
    {"type": "object", "properties": {"e": {"type": "string", "format": "email"},
                                      "p": {"type": "string", "format": "json-pointer"}}, "required": ["e", "p"]},
    {"enum": ['a"b', "c\\d", "\x00", "\x1f\t", "ü€😀", {"k\n": ["\x02"]}]},
]


def draw(compiled, rng: random.Random, max_bytes: int) -> tuple[bytes, bool]:
    """A random walk through ``compiled`` (one token per byte): (the bytes, whether it finished)."""
    matcher = xgr.GrammarMatcher(compiled)
    bitmask = xgr.allocate_token_bitmask(1, 257)
    out = bytearray()
    while len(out) < max_bytes:
        tokens = allowed_bytes(matcher, bitmask)
        favoured = [t for t in tokens if t in FAVOURED]
        token = rng.choice(favoured if favoured and rng.random() < 0.3 else tokens)
        assert matcher.accept_token(token)
        if token == EOS:
            return bytes(out), True
        out.append(token)
    return bytes(out), False


@pytest.mark.parametrize("schema", SAMPLED, ids=lambda s: "json_object" if s is None else json.dumps(s)[:40])
def test_random_documents_of_each_grammar_are_json_and_valid(schema):
    compiled = xgr.GrammarCompiler(BYTES, cache_enabled=False).compile_grammar(grammar_of(schema))
    rng = random.Random(0)
    finished = 0
    for _ in range(200):
        document, done = draw(compiled, rng, max_bytes=60)
        text = document.decode("utf-8", errors="ignore" if not done else "strict")  # a cut may split a character
        if done:
            finished += 1
            validate(schema, text)
        else:
            assert is_json_prefix(text), text
    assert finished >= 20


# -- the engine: 1,000 outputs of random weights -------------------------------------------------

ODD = ['a"b', "back\\slash", "tab\there", "nul\x00", "\x1f", "café ☕", "line\nbreak", "😀", "\u2028", 7, None]
ACCEPTANCE = [
    {"type": "object", "properties": {"n": {"type": "string", "maxLength": 6},
                                      "c": {"type": "string", "minLength": 1, "maxLength": 2}}, "required": ["n", "c"]},
    {"type": "string", "pattern": "^[a-z]{1,3}-\\d{2}$"},
    {"type": "object", "properties": {"q": {"type": "string", "pattern": '^"[^"]{0,3}"$'},
                                      "d": {"type": "string", "pattern": "^.{0,4}$"}}, "required": ["q"]},
    {"type": "array", "items": {"enum": ODD}, "maxItems": 3},
    {"type": "object", "properties": {"o": {"type": "object", "properties": {"s": {"type": "string", "maxLength": 3}},
                                            "required": ["s"]},
                                      "l": {"type": "array", "items": {"type": "string", "maxLength": 2}, "maxItems": 2}},
     "required": ["o"]},
    {"type": "array", "items": {"type": "string", "minLength": 1, "maxLength": 3}, "minItems": 1, "maxItems": 3},
    {"type": "object", "propertyNames": {"maxLength": 2}, "additionalProperties": {"type": "string", "maxLength": 2},
     "maxProperties": 2},
    {"type": "object", "properties": {"p": {"type": "string", "format": "json-pointer"},
                                      "e": {"type": "string", "format": "email"},
                                      "w": {"type": "string", "pattern": "^\\S\\\\?$"}}, "required": ["p"]},
    None,  # json_object
]


@pytest.mark.slow
def test_1000_sampled_outputs_are_valid_json_or_prefixes_of_it():
    prompts = ["hello world", "a", "the cat sat on the mat", "{"]
    params = [SamplingParams(temperature=1.0, seed=i, max_tokens=64, structured_outputs=(
        StructuredOutputsParams(json_object=True) if ACCEPTANCE[i % len(ACCEPTANCE)] is None
        else StructuredOutputsParams(json=ACCEPTANCE[i % len(ACCEPTANCE)]))) for i in range(1000)]
    # One wave of 1,000 (random weights favour whitespace: 64 tokens finish about half of them).
    with LLM(tiny_checkpoint("qwen2"), block_size=16, max_num_seqs=1000) as llm:
        outputs = [o.outputs[0] for o in llm.generate([prompts[i % len(prompts)] for i in range(1000)], params)]
    finished = cut = 0
    for i, out in enumerate(outputs):
        schema = ACCEPTANCE[i % len(ACCEPTANCE)]
        if out.finish_reason == "stop":
            finished += 1
            validate(schema, out.text)
        else:
            assert out.finish_reason == "length", (out.finish_reason, out.text)
            cut += 1
            assert is_json_prefix(out.text), out.text
    assert finished >= 300 and finished + cut == 1000, (finished, cut)
