"""``SamplingParams``: how one request's tokens are chosen and when it stops (vLLM's names).

Every field is type- and range-checked on construction; a bad one raises ``ValueError`` (never
``TypeError``: the HTTP server answers any ``ValueError`` with 400) whose message starts with
the field's name and gives the value and what is accepted. Ints must be ints (``bool`` and
``2.0`` are refused; numpy integers are taken as ints), floats take ints or floats but must be
finite, flags must be ``bool``. Accepted values are stored normalised: floats as ``float``, ints
as ``int``, ``stop`` / ``stop_token_ids`` as fresh lists.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence
from dataclasses import dataclass, field

_SEED_LIMIT = 2**64  # torch.Generator.manual_seed takes [0, 2**64) (and negatives, which we refuse)
# top_k and logprobs count vocabulary entries: anything above this is a client bug, and an
# unbounded int would overflow the int64 tensors and messages it travels in.
_COUNT_LIMIT = 2**31 - 1
_TOKEN_ID_LIMIT = 2**63  # token ids travel as int64


def _describe(value) -> str:
    return f"{value!r} ({type(value).__name__})"


def _int(name: str, value, accepted: str) -> int:
    """``value`` as an int, or ValueError naming ``name``; ``accepted`` describes the valid range."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ValueError(f"{name} must be an int {accepted}, got {_describe(value)}")
    return int(value)


def _float(name: str, value, accepted: str) -> float:
    """``value`` (an int or a float) as a finite float, or ValueError naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValueError(f"{name} must be a number {accepted}, got {_describe(value)}")
    number = float(value)
    if not math.isfinite(number):
        raise ValueError(f"{name} must be a finite number {accepted}, got {value!r}")
    return number


def _bool(name: str, value) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be a bool, got {_describe(value)}")
    return value


def _list(name: str, value, accepted: str) -> list:
    """A list or tuple (not a string, not a set: order and repeats are the caller's) as a new list."""
    if not isinstance(value, Sequence) or isinstance(value, (str, bytes)):
        raise ValueError(f"{name} must be a list {accepted}, got {_describe(value)}")
    return list(value)


@dataclass
class SamplingParams:
    n: int = 1  # only 1
    temperature: float = 1.0  # >= 0; 0: greedy
    top_p: float = 1.0  # (0, 1]
    top_k: int = 0  # 0 or -1: disabled; else >= 1
    seed: int | None = None  # [0, 2**64); per-request generator: the same seed gives the same tokens
    max_tokens: int | None = 16  # >= 1; None: up to the model's context window
    min_tokens: int = 0  # [0, max_tokens]
    stop: list[str] = field(default_factory=list)  # a string or a list of non-empty strings
    stop_token_ids: list[int] = field(default_factory=list)  # token ids >= 0
    ignore_eos: bool = False
    logprobs: int | None = None  # None: none; 0: the sampled token's; N: plus the top N
    skip_special_tokens: bool = True
    # vLLM's: keep the stop string, or the text of the EOS / stop_token_ids token that ended the
    # request, in the output text (by default both are dropped).
    include_stop_str_in_output: bool = False

    def __post_init__(self):
        n = _int("n", self.n, "(only n=1 is supported)")
        if n != 1:
            raise ValueError(f"n={n}: only n=1 is supported; send n separate requests")
        self.n = n
        self.temperature = _float("temperature", self.temperature, ">= 0 (0: greedy)")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0 (0: greedy), got {self.temperature!r}")
        self.top_p = _float("top_p", self.top_p, "in (0, 1]")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        self.top_k = _int("top_k", self.top_k, "(-1 or 0: disabled, else >= 1)")
        if not -1 <= self.top_k <= _COUNT_LIMIT:
            raise ValueError(f"top_k must be -1 or 0 (disabled) or in [1, {_COUNT_LIMIT}], got {self.top_k!r}")
        if self.seed is not None:
            self.seed = _int("seed", self.seed, "in [0, 2**64) or None")
            if not 0 <= self.seed < _SEED_LIMIT:
                raise ValueError(f"seed must be in [0, 2**64) or None, got {self.seed!r}")
        if self.max_tokens is not None:
            self.max_tokens = _int("max_tokens", self.max_tokens, ">= 1 or None")
            if not 1 <= self.max_tokens < _TOKEN_ID_LIMIT:
                raise ValueError(f"max_tokens must be >= 1 or None, got {self.max_tokens!r}")
        upper = "max_tokens" if self.max_tokens is None else f"max_tokens = {self.max_tokens}"
        self.min_tokens = _int("min_tokens", self.min_tokens, f"in [0, {upper}]")
        if self.min_tokens < 0 or (self.max_tokens is not None and self.min_tokens > self.max_tokens):
            raise ValueError(f"min_tokens must be in [0, {upper}], got {self.min_tokens!r}")
        if self.logprobs is not None:
            self.logprobs = _int("logprobs", self.logprobs, ">= 0 or None")
            if not 0 <= self.logprobs <= _COUNT_LIMIT:
                raise ValueError(f"logprobs must be in [0, {_COUNT_LIMIT}] or None, got {self.logprobs!r}")
        self.stop = self._stop(self.stop)
        self.stop_token_ids = self._stop_token_ids(self.stop_token_ids)
        self.ignore_eos = _bool("ignore_eos", self.ignore_eos)
        self.skip_special_tokens = _bool("skip_special_tokens", self.skip_special_tokens)
        self.include_stop_str_in_output = _bool("include_stop_str_in_output", self.include_stop_str_in_output)

    @staticmethod
    def _stop(value) -> list[str]:
        if value is None:
            return []
        if isinstance(value, str):
            value = [value]
        stop = _list("stop", value, "of non-empty strings (or one string)")
        for s in stop:
            if not isinstance(s, str) or not s:
                raise ValueError(f"stop must be a string or a list of non-empty strings, got {_describe(s)} "
                                 f"in {value!r}")
        return stop

    @staticmethod
    def _stop_token_ids(value) -> list[int]:
        if value is None:
            return []
        accepted = "of token ids (ints in [0, 2**63))"
        ids = _list("stop_token_ids", value, accepted)
        for t in ids:
            if isinstance(t, bool) or not isinstance(t, numbers.Integral) or not 0 <= t < _TOKEN_ID_LIMIT:
                raise ValueError(f"stop_token_ids must be a list {accepted}, got {_describe(t)} in {value!r}")
        return [int(t) for t in ids]

    @property
    def greedy(self) -> bool:
        return self.temperature == 0
