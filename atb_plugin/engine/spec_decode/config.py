"""``SpeculativeConfig``: the validated ``speculative_config`` (vLLM's keys), torch-free.

``LLM(..., speculative_config={"method": "ngram", "num_speculative_tokens": 4})`` or
``--speculative-config '{"method": "ngram", "num_speculative_tokens": 4}'`` (``-sc``)."""

from __future__ import annotations

from dataclasses import dataclass, fields
from pathlib import Path

from atb_plugin.validation import check_int

# What this engine implements, and what vLLM names that it does not (yet): asked for, the latter
# is an error naming the former.
SUPPORTED_METHODS = ("ngram", "draft_model", "eagle", "eagle3", "mtp")
# The methods whose ``model`` is a checkpoint of their own (MTP's block is in the target's).
MODEL_METHODS = ("draft_model", "eagle", "eagle3")
KNOWN_METHODS = ("ngram", "draft_model", "eagle", "eagle3", "mtp", "suffix", "medusa", "mlp_speculator")
# One verify step is 1 + k query tokens per sequence; the NPU's fused infer attention takes at
# most 16 query tokens per sequence, so k <= 15 everywhere (one rule for every platform).
MAX_QUERY_TOKENS_PER_SEQUENCE = 16
# vLLM's default n-gram window when neither bound is given.
DEFAULT_PROMPT_LOOKUP = 5


@dataclass(frozen=True)
class SpeculativeConfig:
    """``method``: how drafts are made (``"ngram"``: prompt lookup); ``num_speculative_tokens``
    (k): drafts per decode step, 1 .. 15; ``prompt_lookup_min`` / ``prompt_lookup_max``: the
    n-gram lengths tried, longest first (one given: the other equals it; none: both 5).
    ``model``: the draft checkpoint of method ``draft_model`` (a text model with the target's
    tokenizer), or the head checkpoint of ``eagle`` / ``eagle3`` (``mtp`` reads its block from
    the target's checkpoint); ``draft_tensor_parallel_size``: ``draft_model``: 1 or unset (the
    draft runs whole, whatever the target's TP); a head: unset or the target's TP (a head runs
    on every rank, sharded as the target)."""

    method: str | None = None
    num_speculative_tokens: int | None = None
    prompt_lookup_min: int | None = None
    prompt_lookup_max: int | None = None
    model: str | None = None
    draft_tensor_parallel_size: int | None = None

    def __post_init__(self):
        set_ = object.__setattr__
        method = self.method
        if method is None and self.model in ("ngram", "[ngram]"):
            method = "ngram"  # vLLM's older spelling: model="[ngram]"
            set_(self, "model", None)
        if method is None:
            method = "ngram" if self.model is None else "draft_model"
        if method not in KNOWN_METHODS:
            raise ValueError(f"speculative_config.method = {method!r}: unknown; this engine supports "
                             f"{', '.join(SUPPORTED_METHODS)}")
        if method not in SUPPORTED_METHODS:
            raise ValueError(f"speculative_config.method = {method!r} is not supported yet; this engine supports "
                             f"{', '.join(SUPPORTED_METHODS)}")
        set_(self, "method", method)
        if method != "ngram":
            if method in MODEL_METHODS and not self.model:
                what = "draft checkpoint" if method == "draft_model" else "head checkpoint"
                raise ValueError(f"speculative_config.model: method {method!r} needs the {what}'s directory")
            if method == "mtp" and self.model is not None:
                raise ValueError("speculative_config.model: method 'mtp' reads its block from the target's checkpoint "
                                 "(config.json num_nextn_predict_layers); give no model")
            if method == "draft_model" and self.draft_tensor_parallel_size not in (None, 1):
                raise ValueError(f"speculative_config.draft_tensor_parallel_size = {self.draft_tensor_parallel_size}: "
                                 "not supported; method 'draft_model' supports 1 (or unset): the draft runs whole, "
                                 "in the engine core's process, whatever the target's tensor_parallel_size")
            for name in ("prompt_lookup_min", "prompt_lookup_max"):
                if getattr(self, name) is not None:
                    raise ValueError(f"speculative_config.{name} belongs to method 'ngram'")
        else:
            for name in ("model", "draft_tensor_parallel_size"):
                if getattr(self, name) is not None:
                    raise ValueError(f"speculative_config.{name} belongs to method "
                                     f"{' / '.join(repr(m) for m in MODEL_METHODS)}; method 'ngram' takes "
                                     "num_speculative_tokens, prompt_lookup_min and prompt_lookup_max")
        k = self.num_speculative_tokens
        if k is None:
            raise ValueError("speculative_config.num_speculative_tokens is required (e.g. 4)")
        _check_int("num_speculative_tokens", k, 1, MAX_QUERY_TOKENS_PER_SEQUENCE - 1)
        if method != "ngram":
            return
        low, high = self.prompt_lookup_min, self.prompt_lookup_max
        if low is None and high is None:
            low = high = DEFAULT_PROMPT_LOOKUP
        low = high if low is None else low
        high = low if high is None else high
        _check_int("prompt_lookup_min", low, 1)
        _check_int("prompt_lookup_max", high, 1)
        if low > high:
            raise ValueError(f"speculative_config.prompt_lookup_min = {low} exceeds prompt_lookup_max = {high}")
        set_(self, "prompt_lookup_min", low)
        set_(self, "prompt_lookup_max", high)

    def check_target(self, hf_config: dict, tensor_parallel_size: int) -> None:
        """What the method needs from the engine (``EngineConfig``, at start-up): a head runs on
        every rank, sharded as the target, so its ``draft_tensor_parallel_size`` is the target's;
        a head checkpoint has its config.json; MTP, a target checkpoint with an MTP block."""
        if self.method == "ngram":
            return
        if self.method != "draft_model" and self.draft_tensor_parallel_size not in (None, tensor_parallel_size):
            raise ValueError(f"speculative_config.draft_tensor_parallel_size = {self.draft_tensor_parallel_size}: "
                             f"not supported; method {self.method!r} runs its head on every rank, sharded as the "
                             f"target: unset or {tensor_parallel_size} (the tensor_parallel_size)")
        if self.method in ("eagle", "eagle3") and not (Path(self.model) / "config.json").is_file():
            raise ValueError(f"speculative_config.model = {self.model!r}: no config.json there (an {self.method} "
                             "head checkpoint's directory)")
        if self.method == "mtp" and not (hf_config.get("text_config") or hf_config).get("num_nextn_predict_layers"):
            raise ValueError("speculative_config: method 'mtp' needs a checkpoint with an MTP block (config.json "
                             "num_nextn_predict_layers > 0)")

    @classmethod
    def from_value(cls, value) -> "SpeculativeConfig | None":
        """A ``SpeculativeConfig`` from itself, a dict of vLLM's keys, or None (off)."""
        if value is None or isinstance(value, cls):
            return value
        if not isinstance(value, dict):
            raise ValueError(f"speculative_config must be a dict of vLLM's keys, got {type(value).__name__}")
        names = [f.name for f in fields(cls)]
        unknown = sorted(set(value) - set(names))
        if unknown:
            raise ValueError(f"speculative_config: unknown key(s) {', '.join(unknown)}; supported keys: "
                             f"{', '.join(names)}")
        return cls(**value)


def _check_int(name: str, value, low: int, high: int | None = None) -> None:
    accepted = f"in [{low}, {high}]" if high is not None else f">= {low}"
    value = check_int(f"speculative_config.{name}", value, accepted)
    if value < low or (high is not None and value > high):
        raise ValueError(f"speculative_config.{name} = {value}: must be {accepted}")
