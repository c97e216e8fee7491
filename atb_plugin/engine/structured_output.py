"""Structured output: sampling constrained to a grammar (JSON schema, JSON object, regex, choice,
EBNF), with xgrammar.

    server  check(params)               the grammar without a tokenizer: a bad spec is a 400
    core    StructuredOutputManager
              register(request)         compile against the vocabulary on a background thread
              is_ready(request)         the scheduler admits a structured request once compiled
              apply_bitmask(logits, requests)   before sampling: -inf for the tokens each
                                        request's grammar forbids next
              accept(request, token)    after sampling: advance the request's matcher
              validate_drafts(request, drafts)  speculative decoding: the drafts the grammar
                                        allows; grammar_bitmask then masks every position
              remove(request_id)        when the request ends

The engine core has no tokenizer otherwise: the manager loads the checkpoint's on the first
structured request (on the compile thread), so a deployment that never asks for structured
output never imports transformers in the core. xgrammar itself is imported on first use for the
same reason (it imports transformers).
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from atb_plugin.engine.request import Request
from atb_plugin.engine.sampling_params import StructuredOutputsParams
from atb_plugin.utils import json_object

if TYPE_CHECKING:
    import xgrammar

__all__ = ["check", "to_grammar", "GrammarViolation", "StructuredOutputManager", "StructuredOutputUnavailable"]

# OpenAI's json_object mode promises an object; xgrammar's builtin JSON grammar also allows a
# top-level array, so json_object is this schema (vLLM's choice too).
_JSON_OBJECT_SCHEMA = '{"type": "object"}'
# Whitespace between JSON tokens: any (vLLM's default), but at most this many characters in a row.
# Unbounded, a model that favours whitespace (small or weak ones, a known failure with vLLM) emits
# it until max_tokens; 16 still fits pretty-printing (a newline and 7 levels of 2-space indent).
_MAX_JSON_WHITESPACE = 16
# xgrammar prefixes its C++ errors with "[hh:mm:ss] /path/file.cc:123: " and sometimes a failed
# check's expression: noise to a client.
_XGRAMMAR_NOISE = re.compile(r"\[[\d:]+\] \S+:\d+: |Check failed: \(.*?\) is false: ")
# xgrammar's compiled-grammar cache, bounded in bytes (vLLM's default; a compiled grammar of a
# 150k vocabulary is a few MB).
_COMPILE_CACHE_BYTES = 512 * 2**20
_WHAT = {"json": "JSON schema", "regex": "regex", "choice": "choice", "grammar": "EBNF grammar",
         "json_object": "JSON object grammar"}


class StructuredOutputUnavailable(ImportError):
    """xgrammar is not installed: this installation cannot constrain output to a grammar. Not
    the client's mistake and not a crash: the server answers 501 with this message, which names
    the install line (the extra ``structured`` in setup.py holds xgrammar's pin)."""

    def __init__(self):
        super().__init__("structured output (response_format json_object / json_schema, tool_choice \"required\" "
                         "or a named function, structured_outputs) needs the xgrammar package, which this "
                         "installation lacks: pip install 'atb-plugin[structured]' (on a CPU-only host, without "
                         "its triton dependency: pip install --no-deps xgrammar, at setup.py's pin)",
                         name="xgrammar")


def _xgrammar():
    try:
        import xgrammar  # noqa: PLC0415 - on first use: it imports transformers (module docstring)
    except ModuleNotFoundError as error:
        if error.name != "xgrammar":
            raise  # xgrammar is there but broken (one of its own imports): a real 500, with its cause
        raise StructuredOutputUnavailable() from error

    return xgrammar


def to_grammar(params: StructuredOutputsParams) -> "xgrammar.Grammar":
    """The xgrammar ``Grammar`` of ``params`` (no tokenizer needed). ``ValueError`` naming the
    kind (``structured_outputs.regex: invalid regex: ...``) for a spec xgrammar refuses."""
    xgr = _xgrammar()
    kind, spec = params.kinds[0], getattr(params, params.kinds[0])
    try:
        if kind == "json":
            # strict_mode: no properties or items beyond the schema's (vLLM's default). An object
            # only: xgrammar also takes ``true``, but clients mean a schema.
            return _json_schema_grammar(json_object(spec), strict_mode=True)
        if kind == "json_object":
            return _json_schema_grammar(json.loads(_JSON_OBJECT_SCHEMA), strict_mode=True)
        if kind == "regex":
            return xgr.Grammar.from_regex(spec)
        if kind == "choice":
            # Each choice a JSON-escaped EBNF literal; ensure_ascii=False because xgrammar reads a
            # "\ud83d\ude00" surrogate pair as two code points, not the emoji.
            return xgr.Grammar.from_ebnf("root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in spec))
        return xgr.Grammar.from_ebnf(spec)
    except (RuntimeError, ValueError) as error:
        message = _XGRAMMAR_NOISE.sub("", str(error)).strip()
        raise ValueError(f"structured_outputs.{kind}: invalid {_WHAT[kind]}: {message}") from None


# -- JSON strings, RFC 8259-exact ----------------------------------------------------------------
#
# xgrammar 0.2.8's JSON schema grammar writes some strings outside RFC 8259 (issue 30, item 5):
#
# - a string with minLength / maxLength (a value, an array item, propertyNames) is
#   "[^"\\\r\n]{m,n}": raw U+0000-U+001F (but \r, \n) and no escape at all;
# - a pattern with a literal JSON must escape ('"', '\', a control character: "a\"b", "\n") or
#   with any non-ASCII character falls back to a grammar with no JSON escaping at all: raw
#   quotes, backslashes and control characters;
# - format "email" writes '\' + any printable character in a quoted local part ("\q" is no JSON
#   escape), "json-pointer" / "relative-json-pointer" raw control characters, '"' and '\';
# - every string may hold the UTF-8 bytes of a surrogate (ED A0 80 - ED BF BF), and a pattern's
#   classes overlong forms (E0 80 80): not UTF-8, which RFC 8259 requires (and the detokenizer
#   turns each byte into a U+FFFD, so maxLength and patterns no longer hold).
#
# So each json_schema / json_object grammar goes through here, whatever xgrammar does:
#
# - every pattern (and the regex of those formats) is rewritten into a regex over the JSON text
#   of the string (``_json_string_regex``), and a length-bounded string (bounds up to
#   ``_MAX_ESCAPED_LENGTH``) becomes such a regex too, in which each character is unescaped or any
#   RFC 8259 escape and counts one (JSON Schema counts decoded characters; "\uD800"-"\uDFFF" are
#   left out, so that each escape is exactly one character). xgrammar sees each regex only as a
#   placeholder pattern;
# - in the EBNF xgrammar then prints, each placeholder becomes its regex, and each character
#   class of a JSON string also excludes U+0000-U+001F and the surrogates. A string with larger
#   bounds keeps xgrammar's class repetition, so fixed it takes no escape: it never writes '"',
#   '\' or a control character (a regex that large is no longer precompiled by xgrammar, and
#   costs tens of milliseconds a token);
# - the grammar is compiled from that EBNF.

_MAX_CODEPOINT = 0x10FFFF
_Ranges = list[tuple[int, int]]  # inclusive code point ranges


def _merged(ranges) -> _Ranges:
    out: _Ranges = []
    for lo, hi in sorted(r for r in ranges if r[0] <= r[1]):
        if out and lo <= out[-1][1] + 1:
            out[-1] = (out[-1][0], max(out[-1][1], hi))
        else:
            out.append((lo, hi))
    return out


def _complement(ranges) -> _Ranges:
    out, start = [], 0
    for lo, hi in _merged(ranges):
        if lo > start:
            out.append((start, lo - 1))
        start = hi + 1
    if start <= _MAX_CODEPOINT:
        out.append((start, _MAX_CODEPOINT))
    return out


def _intersection(a, b) -> _Ranges:
    return _complement(_complement(a) + _complement(b))


# What a JSON string carries only escaped (RFC 8259 section 7), and those escapes' short forms.
_MUST_ESCAPE = [(0x00, 0x1F), (0x22, 0x22), (0x5C, 0x5C)]
_SHORT_ESCAPES = {0x22: '"', 0x5C: "\\", 0x08: "b", 0x0C: "f", 0x0A: "n", 0x0D: "r", 0x09: "t"}
# Unicode scalar values: what UTF-8 text can carry (no surrogates).
_SCALARS = [(0, 0xD7FF), (0xE000, _MAX_CODEPOINT)]
# What a character class of a JSON string must exclude (a negated class of xgrammar's takes the
# surrogates' bytes).
_NOT_IN_STRINGS = [(0x00, 0x1F), (0xD800, 0xDFFF)]
# xgrammar 0.2.8 compiles a regex class to UTF-8 bytes without the second-byte limits of the lead
# bytes E0, ED, F0 and F4 when a range crosses them: "[\u{800}-\u{FFFF}]" takes the overlong E0 80 80
# and the surrogates ED A0 80. A class within one of these segments compiles exactly, so a class
# is written as one class per segment.
_UTF8_SEGMENTS = [(0x00, 0x7F), (0x80, 0x7FF), (0x800, 0xFFF), (0x1000, 0xCFFF), (0xD000, 0xD7FF), (0xE000, 0xFFFF),
                  (0x10000, 0x3FFFF), (0x40000, 0xFFFFF), (0x100000, _MAX_CODEPOINT)]
# Any RFC 8259 escape but "\uD800"-"\uDFFF", as a regex over JSON text.
_ANY_ESCAPE = r'\\(?:["\\/bfnrt]|u(?:[0-9a-cA-Ce-fE-F][0-9a-fA-F]{3}|[dD][0-7][0-9a-fA-F]{2}))'
# The largest minLength / maxLength whose string takes escapes (see above; a regex of 128
# characters compiles in about as long as xgrammar's own class repetition of 128).
_MAX_ESCAPED_LENGTH = 128
# ECMA-262 (the pattern dialect of JSON Schema) classes.
_DIGIT = [(0x30, 0x39)]
_WORD = [(0x30, 0x39), (0x41, 0x5A), (0x5F, 0x5F), (0x61, 0x7A)]
_SPACE = [(0x09, 0x0D), (0x20, 0x20), (0xA0, 0xA0), (0x1680, 0x1680), (0x2000, 0x200A), (0x2028, 0x2029),
          (0x202F, 0x202F), (0x205F, 0x205F), (0x3000, 0x3000), (0xFEFF, 0xFEFF)]
_CLASS_ESCAPES = {"d": _DIGIT, "w": _WORD, "s": _SPACE,
                  "D": _complement(_DIGIT), "W": _complement(_WORD), "S": _complement(_SPACE)}
_DOT = _complement([(0x0A, 0x0A), (0x0D, 0x0D), (0x2028, 0x2029)])  # no line terminator
_CHARACTER_ESCAPES = {"n": 0x0A, "r": 0x0D, "t": 0x09, "f": 0x0C, "v": 0x0B}
_HEX = "0123456789abcdefABCDEF"


def _regex_char(codepoint: int, in_class: bool) -> str:
    """One code point as an xgrammar regex literal (ASCII only)."""
    char = chr(codepoint)
    if 0x20 <= codepoint <= 0x7E:
        special = "\\]^-[" if in_class else "\\^$.|?*+()[]{}"
        return "\\" + char if char in special else char
    return "\\u{%X}" % codepoint


def _plain_classes(ranges) -> list[str]:
    """Regex classes, one per UTF-8 segment, of the characters of ``ranges`` a JSON string holds
    unescaped."""
    plain = _intersection(_intersection(ranges, _SCALARS), _complement(_MUST_ESCAPE))
    classes = []
    for segment in _UTF8_SEGMENTS:
        part = _intersection(plain, [segment])
        if part:
            classes.append("[" + "".join(_regex_char(lo, True) + ("" if lo == hi else "-" + _regex_char(hi, True))
                                         for lo, hi in part) + "]")
    return classes


def _set_regex(ranges) -> str:
    """A regex matching, over JSON text, one of the characters ``ranges`` as a JSON string writes it:
    unescaped where it may be, else its escape (the short one where there is one, like json.dumps)."""
    ranges = _intersection(ranges, _SCALARS)
    escaped = [c for lo, hi in _intersection(ranges, _MUST_ESCAPE) for c in range(lo, hi + 1)]
    if len(ranges) == 1 and ranges[0][0] == ranges[0][1] and not escaped:
        return _regex_char(ranges[0][0], in_class=False)
    parts = _plain_classes(ranges)
    short = [_SHORT_ESCAPES[c] for c in escaped if c in _SHORT_ESCAPES]
    if short:
        parts.append("\\\\[" + "".join("\\\\" if c == "\\" else c for c in short) + "]")
    long = [c for c in escaped if c not in _SHORT_ESCAPES]  # controls without a short escape: \u00XX
    if long:
        nibbles = {high: "".join("%x" % (c & 0xF) for c in long if c >> 4 == high) for high in (0, 1)}
        parts.append("\\\\u00(?:" + "|".join(f"{high}[{low}]" for high, low in nibbles.items() if low) + ")")
    if not parts:
        raise ValueError("a character class or character that no JSON text can hold")
    return parts[0] if len(parts) == 1 and not escaped else "(?:" + "|".join(parts) + ")"  # one atom


def _regex_escape(pattern: str, i: int, in_class: bool) -> tuple[str, object, int]:
    """The escape after the backslash at ``pattern[i - 1]``: ("set", ranges, next index), or ("raw",
    text, next index) for an assertion or reference passed to xgrammar as is."""
    if i >= len(pattern):
        raise ValueError("ends with a backslash")
    char = pattern[i]
    if char in _CLASS_ESCAPES:
        return "set", _CLASS_ESCAPES[char], i + 1
    if char == "b" and in_class:
        return "set", [(0x08, 0x08)], i + 1
    if char in "bBkpP" or char in "123456789":
        if in_class:
            raise ValueError(f"unsupported escape \\{char} in a character class")
        return "raw", "\\" + char, i + 1  # \b \B \1 \k<name> \p{...}: xgrammar accepts or refuses them
    codepoint, end = ord(char), i + 1
    if char in _CHARACTER_ESCAPES:
        codepoint = _CHARACTER_ESCAPES[char]
    elif char == "0":
        codepoint = 0
    elif char == "c" and i + 1 < len(pattern) and pattern[i + 1].isascii() and pattern[i + 1].isalpha():
        codepoint, end = ord(pattern[i + 1]) % 32, i + 2
    elif char == "x" and len(pattern) >= i + 3 and all(c in _HEX for c in pattern[i + 1:i + 3]):
        codepoint, end = int(pattern[i + 1:i + 3], 16), i + 3
    elif char == "u" and pattern.startswith("{", i + 1) and "}" in pattern[i + 2:]:
        digits = pattern[i + 2:pattern.index("}", i + 2)]
        if not digits or not all(c in _HEX for c in digits) or int(digits, 16) > _MAX_CODEPOINT:
            raise ValueError(f"bad escape \\u{{{digits}}}")
        codepoint, end = int(digits, 16), i + 3 + len(digits)
    elif char == "u" and len(pattern) >= i + 5 and all(c in _HEX for c in pattern[i + 1:i + 5]):
        codepoint, end = int(pattern[i + 1:i + 5], 16), i + 5
        low = pattern[end + 2:end + 6]
        if (0xD800 <= codepoint <= 0xDBFF and pattern.startswith("\\u", end) and len(low) == 4
                and all(c in _HEX for c in low) and 0xDC00 <= int(low, 16) <= 0xDFFF):
            codepoint, end = 0x10000 + ((codepoint - 0xD800) << 10) + int(low, 16) - 0xDC00, end + 6
    return "set", [(codepoint, codepoint)], end  # anything else escaped means itself: \. \\ \" \/


def _regex_class(pattern: str, i: int) -> tuple[_Ranges, int]:
    """The code points of the class whose "[" is at ``pattern[i - 1]``, and the index after it."""
    negated = pattern.startswith("^", i)
    i += negated
    items: _Ranges = []

    def atom(i: int) -> tuple[_Ranges, bool, int]:  # (ranges, is one character, next index)
        if pattern[i] == "\\":
            _, ranges, end = _regex_escape(pattern, i + 1, in_class=True)
            return ranges, pattern[i + 1] not in _CLASS_ESCAPES, end
        return [(ord(pattern[i]), ord(pattern[i]))], True, i + 1

    while True:
        if i >= len(pattern):
            raise ValueError("unterminated character class")
        if pattern[i] == "]":
            break
        first, single, i = atom(i)
        if single and pattern.startswith("-", i) and i + 1 < len(pattern) and pattern[i + 1] != "]":
            last, last_single, end = atom(i + 1)
            if last_single:
                if last[0][0] < first[0][0]:
                    raise ValueError("character class range out of order")
                items.append((first[0][0], last[0][0]))
                i = end
                continue
        items.extend(first)  # a '-' next to \d and the like means itself (ECMA-262 Annex B)
    return (_complement(items) if negated else _merged(items)), i + 1


def _json_string_regex(pattern: str) -> str:
    """``pattern`` (a JSON Schema pattern: it applies to the decoded string) as an ASCII regex over
    the JSON text of the string: each literal, class or "." matches its characters unescaped where
    RFC 8259 allows it, else escaped (``"`` as ``\\"``, a newline as ``\\n``, U+0001 as ``\\u0001``).
    Groups, alternation, quantifiers and anchors pass through to xgrammar as they are. Other JSON
    spellings of a character (``\\/``, ``\\u0041``) are valid JSON too but never generated."""
    out, i = [], 0
    while i < len(pattern):
        char = pattern[i]
        if char == "\\":
            kind, value, i = _regex_escape(pattern, i + 1, in_class=False)
            out.append(value if kind == "raw" else _set_regex(value))
        elif char == "[":
            ranges, i = _regex_class(pattern, i + 1)
            out.append(_set_regex(ranges))
        elif char == ".":
            out.append(_set_regex(_DOT))
            i += 1
        elif 0x20 <= ord(char) <= 0x7E and char != '"':
            out.append(char)  # structure ( ) | * + ? { } ^ $, or a literal that writes itself
            i += 1
        else:
            out.append(_set_regex([(ord(char), ord(char))]))
            i += 1
    return "".join(out)


def _bounded_string_regex(min_length, max_length) -> str | None:
    """The JSON-text regex of a string of ``min_length`` to ``max_length`` (None: any) characters,
    each unescaped or any escape; None for bounds it leaves to xgrammar (too large, or not bounds)."""
    if type(min_length) is not int or not 0 <= min_length <= _MAX_ESCAPED_LENGTH:
        return None
    if max_length is not None and (type(max_length) is not int or not min_length <= max_length <= _MAX_ESCAPED_LENGTH):
        return None
    character = "(?:" + "|".join(_plain_classes(_SCALARS) + [_ANY_ESCAPE]) + ")"
    return f"^{character}{{{min_length},{'' if max_length is None else max_length}}}$"


# The formats whose xgrammar 0.2.8 grammar is not JSON-safe (above), as patterns on the decoded
# string, accepting what xgrammar's accept.
_FORMAT_PATTERNS = {
    "email": ("^([\\w!#$%&'*+/=?^`{|}~-]+(\\.[\\w!#$%&'*+/=?^`{|}~-]+)*"
              '|"(\\\\[\\x20-\\x7E]|[\\x20\\x21\\x23-\\x5B\\x5D-\\x7E])*")'
              "@([A-Za-z0-9]([\\-A-Za-z0-9]*[A-Za-z0-9])?)((\\.[A-Za-z0-9][\\-A-Za-z0-9]*[A-Za-z0-9])*)$"),
    "json-pointer": "^(/([^/~]|~[01])*)*$",
    "relative-json-pointer": "^(0|[1-9][0-9]*)(#|(/([^/~]|~[01])*)*)$",
}
# The formats xgrammar 0.2.8 writes with a regex of its own (and then ignores the lengths).
_XGRAMMAR_FORMATS = frozenset({"email", "date", "time", "date-time", "duration", "ipv4", "ipv6", "hostname", "uuid",
                               "uri", "uri-reference", "uri-template", "json-pointer", "relative-json-pointer"})
# Keywords whose value is data (or a name), never a schema.
_DATA_KEYWORDS = frozenset({"enum", "const", "default", "examples", "required", "dependentRequired", "type",
                            "format", "title", "description", "$comment", "$id", "$schema", "$ref", "$anchor"})
# Keywords whose value maps names to schemas.
_NAMED_SCHEMAS = frozenset({"properties", "$defs", "definitions", "dependentSchemas"})


def _rewrite_strings(node, placeholder, property_names: bool = False):
    """``node`` (a schema, or anything inside one) with each pattern, patternProperties key, unsafe
    format and small length bounds replaced by a pattern ``placeholder(json_text_regex)`` returns.
    ``property_names``: ``node`` is a propertyNames schema (a string schema without a type)."""
    if isinstance(node, list):
        return [_rewrite_strings(item, placeholder) for item in node]
    if not isinstance(node, dict):
        return node

    def pattern(regex: str) -> str:
        try:
            safe = _json_string_regex(regex)
            # xgrammar sees a placeholder: what its regex engine refuses is a 400 here, not a failed compile later.
            _xgrammar().Grammar.from_regex(safe)
        except (RuntimeError, ValueError) as error:
            raise ValueError(f"pattern {regex!r}: {error}") from None
        return placeholder(safe)

    out = {}
    for key, value in node.items():
        if key in _DATA_KEYWORDS:
            out[key] = value
        elif key == "pattern" and isinstance(value, str):
            out[key] = pattern(value)
        elif key == "patternProperties" and isinstance(value, dict):
            out[key] = {pattern(name): _rewrite_strings(schema, placeholder) for name, schema in value.items()}
        elif key in _NAMED_SCHEMAS and isinstance(value, dict):
            out[key] = {name: _rewrite_strings(schema, placeholder) for name, schema in value.items()}
        else:
            out[key] = _rewrite_strings(value, placeholder, property_names=key == "propertyNames")
    types, format_ = node.get("type"), node.get("format")
    if not (types == "string" or isinstance(types, list) and "string" in types or property_names and types is None):
        return out
    if isinstance(format_, str) and format_ in _FORMAT_PATTERNS:
        del out["format"]  # xgrammar prefers a format to a pattern: so does this
        out["pattern"] = pattern(_FORMAT_PATTERNS[format_])
    elif ("pattern" not in out and format_ not in _XGRAMMAR_FORMATS and "enum" not in node and "const" not in node
          and ("minLength" in node or "maxLength" in node)):
        regex = _bounded_string_regex(node.get("minLength", 0), node.get("maxLength"))
        if regex is not None:
            out.pop("minLength", None)  # with a pattern, xgrammar would ignore them (and say so)
            out.pop("maxLength", None)
            out["pattern"] = placeholder(regex)
    return out


# How xgrammar prints one character in an EBNF string or class.
_EBNF_ESCAPES = {"a": 0x07, "b": 0x08, "f": 0x0C, "n": 0x0A, "r": 0x0D, "t": 0x09, "v": 0x0B, "0": 0x00, "e": 0x1B}
_EBNF_HEX_WIDTH = {"x": 2, "u": 4, "U": 8}
_EBNF_PLAIN = re.compile(r'[^"\[R]+')  # what _json_safe_ebnf copies as it is


def _ebnf_char(text: str, i: int) -> tuple[int, int]:
    """The code point xgrammar's printer wrote at ``text[i]``, and the index after it."""
    if text[i] != "\\":
        return ord(text[i]), i + 1
    char = text[i + 1]
    if char in _EBNF_HEX_WIDTH:
        width = _EBNF_HEX_WIDTH[char]
        return int(text[i + 2:i + 2 + width], 16), i + 2 + width
    return _EBNF_ESCAPES.get(char, ord(char)), i + 2


def _ebnf_token_end(text: str, i: int, close: str) -> int:
    """The index after the string (``close`` '"') or class (']') that opens at ``text[i]``."""
    i += 1
    while text[i] != close:
        i += 2 if text[i] == "\\" else 1
    return i + 1


def _ebnf_class_char(codepoint: int) -> str:
    char = chr(codepoint)
    if char in '\\"]-^':
        return "\\" + char
    if 0x20 <= codepoint <= 0x7E:
        return char
    return "\\x%02x" % codepoint if codepoint <= 0xFF else "\\u%04x" % codepoint if codepoint <= 0xFFFF else "\\U%08x" % codepoint


def _json_safe_ebnf(ebnf: str, patterns: dict[str, str]) -> str:
    """``ebnf`` (xgrammar's print of a JSON schema grammar) with each placeholder regex replaced by
    its JSON-text regex (any other JSON string regex rewritten by ``_json_string_regex``), and each
    character class of a JSON string (one that excludes '"' and '\\') excluding ``_NOT_IN_STRINGS``."""
    out, i = [], 0
    while i < len(ebnf):
        plain = _EBNF_PLAIN.match(ebnf, i)
        if plain:
            out.append(plain.group())
            i = plain.end()
            continue
        char = ebnf[i]
        if char == '"':
            end = _ebnf_token_end(ebnf, i, '"')
            out.append(ebnf[i:end])
        elif char == "[":
            end = _ebnf_token_end(ebnf, i, "]")
            negated = ebnf.startswith("[^", i)
            j, ranges = i + 1 + negated, []
            while j < end - 1:
                lo, j = _ebnf_char(ebnf, j)
                hi = lo
                if ebnf[j] == "-" and j < end - 2:
                    hi, j = _ebnf_char(ebnf, j + 1)
                ranges.append((lo, hi))
            excluded = _merged(ranges)
            if (not negated or not _intersection(excluded, [(0x22, 0x22)]) or not _intersection(excluded, [(0x5C, 0x5C)])
                    or _intersection(excluded, _NOT_IN_STRINGS) == _NOT_IN_STRINGS):
                out.append(ebnf[i:end])  # not a JSON string character (whitespace, digits, ...), or a safe one
            else:
                out.append("[^" + "".join(_ebnf_class_char(lo) + ("" if lo == hi else "-" + _ebnf_class_char(hi))
                                          for lo, hi in _merged(excluded + _NOT_IN_STRINGS)) + "]")
        elif ebnf.startswith("Regex(", i) and not (i and (ebnf[i - 1].isalnum() or ebnf[i - 1] == "_")):
            end = _ebnf_token_end(ebnf, i + 6, '"')
            literal = ebnf[i + 6:end]
            json_string = ebnf.startswith(", json_string=true)", end)
            end = ebnf.index(")", end) + 1
            if not json_string:  # not a string: the regex of a number range
                out.append(ebnf[i:end])
            else:
                regex, j, chars = literal[1:-1], 0, []
                while j < len(regex):
                    codepoint, j = _ebnf_char(regex, j)
                    chars.append(chr(codepoint))
                regex = "".join(chars)
                safe = patterns[regex] if regex in patterns else _json_string_regex(regex)
                out.append('Regex("' + safe.replace("\\", "\\\\").replace('"', '\\"') + '")')
        else:
            end = i + 1  # an 'R' that starts no Regex(
            out.append(char)
        i = end
    return "".join(out)


def _json_schema_grammar(schema: dict, strict_mode: bool) -> "xgrammar.Grammar":
    """xgrammar's grammar of ``schema``, with every JSON string RFC 8259-exact (above)."""
    xgr = _xgrammar()
    text = json.dumps(schema)
    prefix = "atbpattern"
    while prefix in text:
        prefix += "x"
    patterns: dict[str, str] = {}  # placeholder -> its JSON-text regex
    names: dict[str, str] = {}  # JSON-text regex -> its placeholder

    def placeholder(regex: str) -> str:
        if regex not in names:
            names[regex] = f"{prefix}{len(names)}z"
            patterns[names[regex]] = regex
        return names[regex]

    rewritten = _rewrite_strings(schema, placeholder)
    ebnf = str(xgr.Grammar.from_json_schema(json.dumps(rewritten), strict_mode=strict_mode,
                                            max_whitespace_cnt=_MAX_JSON_WHITESPACE))
    fixed = _json_safe_ebnf(ebnf, patterns)
    if prefix in fixed:
        raise RuntimeError(f"a pattern placeholder survived in the grammar: {fixed}")
    return xgr.Grammar.from_ebnf(fixed)


def check(params: StructuredOutputsParams) -> None:
    """Refuse (``ValueError``) what can never compile, before the request is admitted. The engine
    core compiles the same ``to_grammar`` against the vocabulary later."""
    to_grammar(params)


class GrammarViolation(RuntimeError):
    """The sampled token is one the request's grammar refuses. With the bitmask applied this
    means the other constraints left no token the grammar allows (min_tokens holding back the
    EOS that ends the grammar, allowed_token_ids or bad words disjoint from it): the runner fails
    that request alone."""


@dataclass
class GrammarBitmask:
    """One step's grammar masks: row i of ``bitmask`` (int32, a bit per token, xgrammar's
    layout) is what ``request_ids[i]`` may sample at its position ``positions[i]`` of the step
    (0 but for speculative decoding, where position i follows the request's first i drafts;
    None: every row at 0)."""

    request_ids: list[str]
    bitmask: torch.Tensor
    vocab_size: int
    positions: list[int] | None = None

    def apply(self, logits: torch.Tensor, request_ids: Sequence[str], positions: Sequence[int] | None = None) -> None:
        """Row j of ``logits`` belongs to ``request_ids[j]`` at position ``positions[j]`` (None:
        0): -inf, in place, for every token the grammar of that request forbids there; rows of
        other requests are untouched."""
        index = {key: i for i, key in enumerate(zip(self.request_ids, self.positions or [0] * len(self.request_ids)))}
        keys = list(zip(request_ids, positions or [0] * len(request_ids)))
        rows = [j for j, key in enumerate(keys) if key in index]
        if not rows:
            return
        aligned = torch.full((len(request_ids), self.bitmask.shape[1]), -1, dtype=torch.int32)
        aligned[rows] = self.bitmask[[index[keys[j]] for j in rows]]
        if aligned.device != logits.device:
            aligned = aligned.to(logits.device, non_blocking=True)
        _xgrammar().apply_token_bitmask_inplace(logits, aligned, vocab_size=self.vocab_size, indices=rows)


class StructuredOutputManager:
    """Contract: one per engine core, driven from the engine loop's thread only (compiles run on
    one background thread). ``register(request)`` starts compiling a structured request's grammar
    (no-op for others; equal ``params.key`` compile once: an in-flight compile is shared, a done
    one is in xgrammar's compiler cache). ``is_ready(request)`` is True for an unstructured
    request and, once its grammar compiled, for a structured one, which then has a matcher;
    ``pop_compile_errors()`` hands the requests whose compile failed to the core (each fails
    alone, "error"). ``grammar_bitmask(requests)`` gives the masks of the step's sampling
    requests (the runner applies them: ``GrammarBitmask.apply``);
    ``accept(request, token)`` advances its matcher (``GrammarViolation`` if the grammar refuses
    the token); ``remove(request_id)`` forgets a finished request. A matcher that reached its
    stop token (a request that goes on after EOS: ignore_eos) no longer constrains the request.

    Preemption recomputes a request but keeps its output tokens, which its matcher has already
    accepted: the matcher needs no rollback."""

    def __init__(self, tokenizer_path: str, vocab_size: int, compile_threads: int = 8):
        self.tokenizer_path = tokenizer_path
        self.vocab_size = vocab_size
        self.compile_threads = compile_threads
        self._compiler = None  # made on the compile thread by the first structured request
        # One thread: compiles queue behind each other (xgrammar parallelises each one inside)
        # while the engine loop keeps stepping the other requests (xgrammar releases the GIL).
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar-compile")
        self._in_flight: dict[tuple[str, str], Future] = {}  # params.key -> its compile, until it ends
        self._pending: dict[str, Future] = {}  # request id -> its compile, until it has a matcher
        self._matchers: dict[str, "xgrammar.GrammarMatcher"] = {}
        self._bitmask: torch.Tensor | None = None  # int32 (rows, ceil(vocab / 32)), grown as needed
        self._batch_matcher = None  # fills the rows of a step's matchers on several threads

    # -- requests --------------------------------------------------------------------------------

    @staticmethod
    def _params(request: Request) -> StructuredOutputsParams | None:
        params = request.sampling_params
        return None if params is None else params.structured_outputs

    def register(self, request: Request) -> None:
        params = self._params(request)
        if params is None:
            return
        key = params.key
        future = self._in_flight.get(key)
        if future is None:
            future = self._executor.submit(self._compile, params)
            self._in_flight[key] = future
            # After the insert, so the entry always goes (at once if the compile already ended).
            # Dict operations are atomic under the GIL: the compile thread may run this any time.
            future.add_done_callback(lambda _: self._in_flight.pop(key, None))
        self._pending[request.request_id] = future

    def is_ready(self, request: Request) -> bool:
        if request.request_id in self._matchers or self._params(request) is None:
            return True
        future = self._pending.get(request.request_id)
        if future is None or not future.done() or future.exception() is not None:
            return False  # compiling, or failed (pop_compile_errors reports it)
        del self._pending[request.request_id]
        params = request.sampling_params
        # A finished grammar allows only this request's own stop tokens (the tokenizer's default
        # EOS may not be what the frontend told the core).
        stop = [t for t in dict.fromkeys([*request.eos_token_ids, *params.stop_token_ids]) if t < self.vocab_size]
        self._matchers[request.request_id] = _xgrammar().GrammarMatcher(future.result(),
                                                                         override_stop_tokens=stop or None)
        return True

    def pop_compile_errors(self) -> dict[str, str]:
        """Request id -> why, for each request whose grammar failed to compile since the last call."""
        errors = {}
        for request_id, future in list(self._pending.items()):
            if future.done() and future.exception() is not None:
                del self._pending[request_id]
                errors[request_id] = str(future.exception())
        return errors

    def wait_for_compile(self, timeout: float) -> None:
        """Block until a pending compile finishes, at most ``timeout`` seconds: the engine calls
        it when a step had nothing to run, instead of spinning while the compile thread works."""
        futures = list(self._pending.values())
        if futures and not any(future.done() for future in futures):
            wait(futures, timeout=timeout, return_when=FIRST_COMPLETED)

    def remove(self, request_id: str) -> None:
        self._pending.pop(request_id, None)
        self._matchers.pop(request_id, None)

    # -- sampling --------------------------------------------------------------------------------

    def grammar_bitmask(self, requests: Sequence[Request],
                        drafts: dict[str, list[int]] | None = None) -> GrammarBitmask | None:
        """The masks of the structured ``requests`` (those that sample this step) whose grammar
        still constrains them; None when none does. Made in the core, applied by every rank.
        A request verifying ``drafts`` (speculative decoding; ``validate_drafts`` made them
        acceptable) gets one row per position: its matcher advanced through the drafts one by
        one and rolled back after."""
        drafts = drafts or {}
        constrained = [request for request in requests if self._constrains(request.request_id)]
        if not constrained:
            return None
        plain = [r for r in constrained if not drafts.get(r.request_id)]
        verifying = [r for r in constrained if drafts.get(r.request_id)]
        num_rows = len(plain) + sum(len(drafts[r.request_id]) + 1 for r in verifying)
        bitmask = self._bitmask_rows(num_rows)
        if plain:
            if self._batch_matcher is None:
                self._batch_matcher = _xgrammar().BatchGrammarMatcher()
            self._batch_matcher.batch_fill_next_token_bitmask([self._matchers[r.request_id] for r in plain],
                                                              bitmask, indices=list(range(len(plain))))
        request_ids, positions = [r.request_id for r in plain], [0] * len(plain)
        for request in verifying:
            matcher, tokens = self._matchers[request.request_id], drafts[request.request_id]
            for position in range(len(tokens) + 1):
                row = len(request_ids)
                if matcher.is_terminated():
                    bitmask[row] = -1  # past its stop token the grammar no longer constrains it
                else:
                    matcher.fill_next_token_bitmask(bitmask, row)
                request_ids.append(request.request_id)
                positions.append(position)
                if position < len(tokens) and not matcher.accept_token(tokens[position]):
                    raise RuntimeError(f"request {request.request_id}: draft {tokens[position]} was not validated")
            matcher.rollback(len(tokens))
        return GrammarBitmask(request_ids, bitmask[:num_rows].clone(), self.vocab_size, positions)

    def validate_drafts(self, request: Request, drafts: list[int]) -> list[int]:
        """The longest prefix of ``drafts`` that ``request``'s grammar accepts (all of them for
        an unconstrained request); its matcher is left as it was."""
        if not drafts or not self._constrains(request.request_id):
            return drafts
        matcher = self._matchers[request.request_id]
        accepted = 0
        for token in drafts:
            if matcher.is_terminated() or not matcher.accept_token(token):
                break
            accepted += 1
        if accepted:
            matcher.rollback(accepted)
        return drafts[:accepted]

    def accept(self, request: Request, token_id: int) -> None:
        if not self._constrains(request.request_id):
            return
        if not self._matchers[request.request_id].accept_token(token_id):
            raise GrammarViolation(
                f"structured output: the grammar does not allow token {token_id} here: min_tokens, "
                "allowed_token_ids or bad_words left no token the grammar allows")

    def _constrains(self, request_id: str) -> bool:
        matcher = self._matchers.get(request_id)
        return matcher is not None and not matcher.is_terminated()

    def _bitmask_rows(self, rows: int) -> torch.Tensor:
        if self._bitmask is None or self._bitmask.shape[0] < rows:
            grown = max(rows, 2 * self._bitmask.shape[0] if self._bitmask is not None else 8)
            self._bitmask = _xgrammar().allocate_token_bitmask(grown, self.vocab_size)
        return self._bitmask

    # -- the compile thread ----------------------------------------------------------------------

    def _compile(self, params: StructuredOutputsParams) -> "xgrammar.CompiledGrammar":
        return self._grammar_compiler().compile_grammar(to_grammar(params))

    def _grammar_compiler(self) -> "xgrammar.GrammarCompiler":
        if self._compiler is None:
            from transformers import AutoTokenizer  # noqa: PLC0415 - the first structured request only

            xgr = _xgrammar()
            try:
                tokenizer = AutoTokenizer.from_pretrained(self.tokenizer_path)
            except (OSError, ValueError) as error:
                raise RuntimeError(f"structured output needs the tokenizer of {self.tokenizer_path}: {error}") from None
            info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=self.vocab_size)
            self._compiler = xgr.GrammarCompiler(info, max_threads=self.compile_threads,
                                                 cache_limit_bytes=_COMPILE_CACHE_BYTES)
        return self._compiler
