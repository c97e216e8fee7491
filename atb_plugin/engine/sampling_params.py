"""``SamplingParams``: how one request's tokens are chosen and when it stops (vLLM's names).

Every field is type- and range-checked on construction; a bad one raises ``ValueError`` (never
``TypeError``: the HTTP server answers any ``ValueError`` with 400) whose message starts with
the field's name and gives the value and what is accepted. Ints must be ints (``bool`` and
``2.0`` are refused; numpy integers are taken as ints), floats take ints or floats but must be
finite, flags must be ``bool`` (the checks: ``atb_plugin.validation``, shared with
``PoolingParams``). Accepted values are stored normalised: floats as ``float``, ints as ``int``,
``stop`` / ``stop_token_ids`` as fresh lists.
"""

from __future__ import annotations

import json
import numbers
from collections.abc import Mapping
from dataclasses import dataclass, field

from atb_plugin.validation import check_bool, check_float, check_int, check_list, describe

_SEED_LIMIT = 2**64  # torch.Generator.manual_seed takes [0, 2**64) (and negatives, which we refuse)
# top_k and logprobs count vocabulary entries: anything above this is a client bug, and an
# unbounded int would overflow the int64 tensors and messages it travels in.
_COUNT_LIMIT = 2**31 - 1
_TOKEN_ID_LIMIT = 2**63  # token ids travel as int64


_BIAS_LIMIT = 100.0  # OpenAI's range for a logit_bias value


@dataclass
class StructuredOutputsParams:
    """What the output must match (vLLM's ``StructuredOutputsParams``): exactly one of

    - ``json``: a JSON schema, as JSON text (a dict is serialised on construction);
    - ``json_object``: any JSON object (``response_format={"type": "json_object"}``);
    - ``regex``: a regular expression the whole output matches;
    - ``choice``: one of these strings, verbatim;
    - ``grammar``: an EBNF grammar (xgrammar's dialect, root rule ``root``).

    Only the shape is checked here (no grammar engine in this module): the server compiles the
    grammar without a tokenizer before it admits the request (``structured_output.check``), the
    engine core compiles it against the vocabulary when the request arrives.
    """

    json: str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None

    def __post_init__(self):
        if isinstance(self.json, Mapping):
            self.json = json.dumps(self.json)
        if self.json is not None and not isinstance(self.json, str):
            raise ValueError(f"structured_outputs.json must be a JSON schema (an object), got {describe(self.json)}")
        self.json_object = check_bool("structured_outputs.json_object", self.json_object)
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"structured_outputs.{name} must be a non-empty string, got {describe(value)}")
        if self.choice is not None:
            choice = check_list("structured_outputs.choice", self.choice, "of non-empty strings")
            if not choice or not all(isinstance(c, str) and c for c in choice):
                raise ValueError(f"structured_outputs.choice must be a non-empty list of non-empty strings, "
                                 f"got {self.choice!r}")
            self.choice = choice
        kinds = self.kinds
        if len(kinds) != 1:
            raise ValueError("structured_outputs must set exactly one of json, json_object, regex, choice, grammar; "
                             f"got {', '.join(kinds) if kinds else 'none'}")

    @property
    def kinds(self) -> list[str]:
        return [name for name in ("json", "regex", "choice", "grammar") if getattr(self, name) is not None] + (
            ["json_object"] if self.json_object else [])

    @property
    def key(self) -> tuple[str, str]:
        """(kind, spec): equal keys compile to the same grammar (the compile cache's key)."""
        kind = self.kinds[0]
        if kind == "json_object":
            return kind, ""
        value = getattr(self, kind)
        return kind, json.dumps(value) if kind == "choice" else value


@dataclass
class SamplingParams:
    n: int = 1  # parallel samples of one prompt: the frontend runs n requests (seeds seed, seed+1, ...)
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
    # Penalties and biases, vLLM's semantics and ranges (applied by the sampler, in this order:
    # allowed_token_ids, bad words, logit_bias, min_tokens, penalties, temperature, min_p, top-k/p).
    presence_penalty: float = 0.0  # [-2, 2]: - penalty once for every token already in the output
    frequency_penalty: float = 0.0  # [-2, 2]: - penalty x the token's count in the output
    repetition_penalty: float = 1.0  # (0, 2]: tokens in the prompt or output: logit / p if > 0 else * p
    logit_bias: dict[int, float] = field(default_factory=dict)  # token id -> added to its logit, [-100, 100]
    min_p: float = 0.0  # [0, 1]: drop tokens whose probability is below min_p x the top one's
    allowed_token_ids: list[int] | None = None  # only these may be sampled (non-empty)
    # Token sequences that may not be generated: the last token of each is blocked when the output
    # ends with the rest (the frontend tokenises the request's bad_words strings into these).
    bad_words_token_ids: list[list[int]] = field(default_factory=list)
    prompt_logprobs: int | None = None  # None: none; 0: each prompt token's; N: plus the top N
    structured_outputs: StructuredOutputsParams | None = None

    def __post_init__(self):
        self.n = check_int("n", self.n, ">= 1")
        if self.n < 1:
            raise ValueError(f"n must be >= 1, got {self.n!r}")
        self.temperature = check_float("temperature", self.temperature, ">= 0 (0: greedy)")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0 (0: greedy), got {self.temperature!r}")
        self.top_p = check_float("top_p", self.top_p, "in (0, 1]")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        self.top_k = check_int("top_k", self.top_k, "(-1 or 0: disabled, else >= 1)")
        if not -1 <= self.top_k <= _COUNT_LIMIT:
            raise ValueError(f"top_k must be -1 or 0 (disabled) or in [1, {_COUNT_LIMIT}], got {self.top_k!r}")
        if self.seed is not None:
            self.seed = check_int("seed", self.seed, "in [0, 2**64) or None")
            if not 0 <= self.seed < _SEED_LIMIT:
                raise ValueError(f"seed must be in [0, 2**64) or None, got {self.seed!r}")
        if self.max_tokens is not None:
            self.max_tokens = check_int("max_tokens", self.max_tokens, ">= 1 or None")
            if not 1 <= self.max_tokens < _TOKEN_ID_LIMIT:
                raise ValueError(f"max_tokens must be >= 1 or None, got {self.max_tokens!r}")
        upper = "max_tokens" if self.max_tokens is None else f"max_tokens = {self.max_tokens}"
        self.min_tokens = check_int("min_tokens", self.min_tokens, f"in [0, {upper}]")
        if self.min_tokens < 0 or (self.max_tokens is not None and self.min_tokens > self.max_tokens):
            raise ValueError(f"min_tokens must be in [0, {upper}], got {self.min_tokens!r}")
        if self.logprobs is not None:
            self.logprobs = check_int("logprobs", self.logprobs, ">= 0 or None")
            if not 0 <= self.logprobs <= _COUNT_LIMIT:
                raise ValueError(f"logprobs must be in [0, {_COUNT_LIMIT}] or None, got {self.logprobs!r}")
        self.stop = self._stop(self.stop)
        self.stop_token_ids = self._stop_token_ids(self.stop_token_ids)
        self.ignore_eos = check_bool("ignore_eos", self.ignore_eos)
        self.skip_special_tokens = check_bool("skip_special_tokens", self.skip_special_tokens)
        self.include_stop_str_in_output = check_bool("include_stop_str_in_output", self.include_stop_str_in_output)
        self._check_penalties()
        self.logit_bias = self._logit_bias(self.logit_bias)
        if self.allowed_token_ids is not None:
            self.allowed_token_ids = self._token_ids("allowed_token_ids", self.allowed_token_ids)
            if not self.allowed_token_ids:
                raise ValueError("allowed_token_ids must not be empty (null: every token is allowed)")
        bad_words = check_list("bad_words_token_ids", self.bad_words_token_ids or [], "of token-id lists")
        self.bad_words_token_ids = [self._token_ids("bad_words_token_ids", ids) for ids in bad_words]
        if any(not ids for ids in self.bad_words_token_ids):
            raise ValueError("bad_words_token_ids must not hold an empty list")
        if self.prompt_logprobs is not None:
            self.prompt_logprobs = check_int("prompt_logprobs", self.prompt_logprobs, ">= 0 or None")
            if not 0 <= self.prompt_logprobs <= _COUNT_LIMIT:
                raise ValueError(f"prompt_logprobs must be in [0, {_COUNT_LIMIT}] or None, got {self.prompt_logprobs!r}")
        if isinstance(self.structured_outputs, Mapping):
            self.structured_outputs = StructuredOutputsParams(**self.structured_outputs)
        if self.structured_outputs is not None and not isinstance(self.structured_outputs, StructuredOutputsParams):
            raise ValueError(f"structured_outputs must be a StructuredOutputsParams, got "
                             f"{describe(self.structured_outputs)}")

    def _check_penalties(self) -> None:
        for name in ("presence_penalty", "frequency_penalty"):
            value = check_float(name, getattr(self, name), "in [-2, 2]")
            if not -2.0 <= value <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2], got {value!r}")
            setattr(self, name, value)
        self.repetition_penalty = check_float("repetition_penalty", self.repetition_penalty, "in (0, 2]")
        if not 0.0 < self.repetition_penalty <= 2.0:
            raise ValueError(f"repetition_penalty must be in (0, 2] (1: off), got {self.repetition_penalty!r}")
        self.min_p = check_float("min_p", self.min_p, "in [0, 1]")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p!r}")

    @staticmethod
    def _logit_bias(value) -> dict[int, float]:
        if value is None:
            return {}
        if not isinstance(value, Mapping):
            raise ValueError(f"logit_bias must be a map of token id -> bias, got {describe(value)}")
        bias = {}
        for token, amount in value.items():
            if isinstance(token, str) and token.lstrip("-").isdigit():
                token = int(token)  # JSON object keys are strings
            if isinstance(token, bool) or not isinstance(token, numbers.Integral) or not 0 <= token < _TOKEN_ID_LIMIT:
                raise ValueError(f"logit_bias keys must be token ids (ints >= 0), got {describe(token)}")
            amount = check_float("logit_bias", amount, f"in [-{_BIAS_LIMIT:g}, {_BIAS_LIMIT:g}]")
            if not -_BIAS_LIMIT <= amount <= _BIAS_LIMIT:
                raise ValueError(f"logit_bias values must be in [-{_BIAS_LIMIT:g}, {_BIAS_LIMIT:g}], "
                                 f"got {amount!r} for token {token}")
            bias[int(token)] = amount
        return bias

    @staticmethod
    def _token_ids(name: str, value) -> list[int]:
        accepted = "of token ids (ints in [0, 2**63))"
        ids = check_list(name, value, accepted)
        for t in ids:
            if isinstance(t, bool) or not isinstance(t, numbers.Integral) or not 0 <= t < _TOKEN_ID_LIMIT:
                raise ValueError(f"{name} must be a list {accepted}, got {describe(t)} in {value!r}")
        return [int(t) for t in ids]

    def check_vocabulary(self, vocab_size: int) -> None:
        """ValueError, starting with the field's name, for a token id this request names
        (logit_bias, allowed / bad-word / stop ids) outside ``[0, vocab_size)``: the sampler would
        index past the logits, or silently never match."""
        named = {"logit_bias": self.logit_bias, "allowed_token_ids": self.allowed_token_ids or (),
                 "bad_words": [t for word in self.bad_words_token_ids for t in word],
                 "stop_token_ids": self.stop_token_ids}
        for name, ids in named.items():
            bad = sorted({t for t in ids if t >= vocab_size})
            if bad:
                raise ValueError(f"{name} names token ids {bad[:5]} outside the vocabulary (size {vocab_size}: ids 0..{vocab_size - 1})")

    @property
    def uses_penalties(self) -> bool:
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1

    @staticmethod
    def _stop(value) -> list[str]:
        if value is None:
            return []
        if isinstance(value, str):
            value = [value]
        stop = check_list("stop", value, "of non-empty strings (or one string)")
        for s in stop:
            if not isinstance(s, str) or not s:
                raise ValueError(f"stop must be a string or a list of non-empty strings, got {describe(s)} "
                                 f"in {value!r}")
        return stop

    @classmethod
    def _stop_token_ids(cls, value) -> list[int]:
        return [] if value is None else cls._token_ids("stop_token_ids", value)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0
