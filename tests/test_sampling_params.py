"""``SamplingParams`` validation: every field type- and range-checked, always ``ValueError`` (the
HTTP server maps it to 400) with a message naming the field and the offending value."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest

from atb_plugin.engine.sampling_params import SamplingParams

NAN, INF = float("nan"), float("inf")

BAD = [
    # (field, value, extra fields)
    ("n", 0, {}),
    ("n", 1.0, {}),
    ("n", True, {}),
    ("n", "1", {}),
    ("temperature", -0.1, {}),
    ("temperature", NAN, {}),
    ("temperature", INF, {}),
    ("temperature", -INF, {}),
    ("temperature", "0.5", {}),
    ("temperature", None, {}),
    ("temperature", True, {}),
    ("temperature", [0.5], {}),
    ("top_p", 0, {}),
    ("top_p", 0.0, {}),
    ("top_p", -0.5, {}),
    ("top_p", 1.0001, {}),
    ("top_p", NAN, {}),
    ("top_p", INF, {}),
    ("top_p", "1", {}),
    ("top_p", None, {}),
    ("top_k", -2, {}),
    ("top_k", 0.5, {}),
    ("top_k", 5.0, {}),
    ("top_k", False, {}),
    ("top_k", "5", {}),
    ("top_k", None, {}),
    ("seed", -1, {}),
    ("seed", 2**64, {}),
    ("seed", 1.5, {}),
    ("seed", 7.0, {}),
    ("seed", True, {}),
    ("seed", "7", {}),
    ("max_tokens", 0, {}),
    ("max_tokens", -3, {}),
    ("max_tokens", 2.5, {}),
    ("max_tokens", 16.0, {}),
    ("max_tokens", True, {}),
    ("max_tokens", "16", {}),
    ("max_tokens", NAN, {}),
    ("min_tokens", -1, {}),
    ("min_tokens", 17, {}),  # > the default max_tokens 16
    ("min_tokens", 5, {"max_tokens": 4}),
    ("min_tokens", 1.0, {}),
    ("min_tokens", None, {}),
    ("min_tokens", True, {}),
    ("logprobs", -1, {}),
    ("logprobs", 1.5, {}),
    ("logprobs", True, {}),
    ("logprobs", "2", {}),
    ("stop", "", {}),
    ("stop", [""], {}),
    ("stop", ["ok", ""], {}),
    ("stop", ["ok", 3], {}),
    ("stop", [None], {}),
    ("stop", 5, {}),
    ("stop", b"end", {}),
    ("stop", {"end"}, {}),  # unordered: not a list
    ("stop_token_ids", [-1], {}),
    ("stop_token_ids", [1, 2.0], {}),
    ("stop_token_ids", [True], {}),
    ("stop_token_ids", ["7"], {}),
    ("stop_token_ids", [None], {}),
    ("stop_token_ids", 7, {}),
    ("stop_token_ids", "7", {}),
    ("stop_token_ids", {1, 2}, {}),
    ("ignore_eos", 1, {}),
    ("ignore_eos", "true", {}),
    ("ignore_eos", None, {}),
    ("skip_special_tokens", 0, {}),
    ("skip_special_tokens", "false", {}),
    ("skip_special_tokens", None, {}),
]


@pytest.mark.parametrize("name, value, extra", BAD, ids=[f"{n}={v!r}" for n, v, _ in BAD])
def test_bad_values_raise_value_error_naming_the_field(name, value, extra):
    with pytest.raises(ValueError) as info:
        SamplingParams(**{name: value, **extra})
    assert type(info.value) is ValueError  # not a TypeError, not a subclass the server might map differently
    message = str(info.value)
    assert message.startswith(name), message
    shown = repr(value) if not isinstance(value, (list, set)) else None
    if shown is not None and name != "stop":
        assert shown in message, message


GOOD = [
    # (fields, expected normalised values)
    ({}, {"n": 1, "temperature": 1.0, "top_p": 1.0, "top_k": 0, "seed": None, "max_tokens": 16,
          "min_tokens": 0, "stop": [], "stop_token_ids": [], "ignore_eos": False, "logprobs": None,
          "skip_special_tokens": True}),
    ({"temperature": 0}, {"temperature": 0.0}),
    ({"temperature": 2}, {"temperature": 2.0}),
    ({"temperature": 1e-7}, {"temperature": 1e-7}),
    ({"temperature": 100.0}, {"temperature": 100.0}),
    ({"temperature": np.float32(0.5)}, {"temperature": 0.5}),
    ({"top_p": 1}, {"top_p": 1.0}),
    ({"top_p": 1e-6}, {"top_p": 1e-6}),
    ({"top_k": -1}, {"top_k": -1}),
    ({"top_k": 1}, {"top_k": 1}),
    ({"top_k": 100000}, {"top_k": 100000}),
    ({"top_k": np.int64(40)}, {"top_k": 40}),
    ({"seed": 0}, {"seed": 0}),
    ({"seed": 2**64 - 1}, {"seed": 2**64 - 1}),
    ({"seed": None}, {"seed": None}),
    ({"max_tokens": None}, {"max_tokens": None}),
    ({"max_tokens": 1}, {"max_tokens": 1}),
    ({"max_tokens": None, "min_tokens": 1000}, {"min_tokens": 1000}),
    ({"max_tokens": 4, "min_tokens": 4}, {"min_tokens": 4}),
    ({"logprobs": 0}, {"logprobs": 0}),
    ({"logprobs": 20}, {"logprobs": 20}),
    ({"stop": "end"}, {"stop": ["end"]}),
    ({"stop": ["a", "b c"]}, {"stop": ["a", "b c"]}),
    ({"stop": ("a",)}, {"stop": ["a"]}),
    ({"stop": None}, {"stop": []}),
    ({"stop_token_ids": [0, 7, 7]}, {"stop_token_ids": [0, 7, 7]}),
    ({"stop_token_ids": (3,)}, {"stop_token_ids": [3]}),
    ({"stop_token_ids": [np.int32(9)]}, {"stop_token_ids": [9]}),
    ({"stop_token_ids": None}, {"stop_token_ids": []}),
    ({"ignore_eos": True, "skip_special_tokens": False}, {"ignore_eos": True, "skip_special_tokens": False}),
]


@pytest.mark.parametrize("fields, expected", GOOD, ids=[repr(f) for f, _ in GOOD])
def test_good_values_are_accepted_and_normalised(fields, expected):
    params = SamplingParams(**fields)
    for name, value in expected.items():
        got = getattr(params, name)
        assert got == value and type(got) is type(value), (name, got)


def test_greedy_and_replace_revalidates():
    assert SamplingParams(temperature=0).greedy and not SamplingParams(temperature=1e-7).greedy
    params = SamplingParams(stop=["x"], stop_token_ids=[1])
    with pytest.raises(ValueError, match="^temperature"):
        dataclasses.replace(params, temperature=math.nan)


def test_lists_are_copied():
    stop, ids = ["a"], [1]
    params = SamplingParams(stop=stop, stop_token_ids=ids)
    stop.append("b")
    ids.append(2)
    assert params.stop == ["a"] and params.stop_token_ids == [1]


def test_messages_give_the_range():
    with pytest.raises(ValueError, match=r"top_p must be in \(0, 1\], got 1.5"):
        SamplingParams(top_p=1.5)
    with pytest.raises(ValueError, match=r"seed must be in \[0, 2\*\*64\) or None, got -1"):
        SamplingParams(seed=-1)
    with pytest.raises(ValueError, match=r"min_tokens must be in \[0, max_tokens = 4\], got 5"):
        SamplingParams(max_tokens=4, min_tokens=5)
    with pytest.raises(ValueError, match=r"max_tokens must be an int >= 1 or None, got 2.5 \(float\)"):
        SamplingParams(max_tokens=2.5)
    with pytest.raises(ValueError, match=r"temperature must be a number >= 0 .*got '0.5' \(str\)"):
        SamplingParams(temperature="0.5")
    with pytest.raises(ValueError, match=r"n must be >= 1, got 0"):
        SamplingParams(n=0)
