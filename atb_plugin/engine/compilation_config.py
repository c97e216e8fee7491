"""``CompilationConfig``: how decode steps are captured (vLLM's ``compilation_config``), torch-free.

``LLM(..., compilation_config={"cudagraph_mode": "FULL_DECODE_ONLY", "cudagraph_capture_sizes":
[1, 2, 4, 8], "max_cudagraph_capture_size": 8})``, ``--compilation-config '<json>'`` (``-O``) and
``enforce_eager`` / ``--enforce-eager`` take the same settings; ``EngineConfig`` resolves them
once (docs/graph-mode.md):

- ``cudagraph_mode``: ``FULL_DECODE_ONLY`` (the default: NPU / CUDA capture a device graph per
  batch size, the CPU its native decode plan, which needs no sizes) or ``NONE`` (the default on
  the simulated NPU only, where a replay costs what the eager step does and a capture seconds).
  vLLM's ``PIECEWISE``, ``FULL`` and ``FULL_AND_PIECEWISE`` need a compiled, split model (or
  graphs over prefill) that this engine does not build: asked for, they are an error naming the
  two that work. ``enforce_eager`` turns every mode into ``NONE`` (vLLM's rule), the CPU's plan too.
- ``cudagraph_capture_sizes``: the batch sizes captured, in tokens (a decode step holds one token
  per request, a speculative verify step ``1 + num_speculative_tokens``); default vLLM's
  ``1, 2, 4, 8, 16, ..., 248, 256, 272, ...`` up to ``max_cudagraph_capture_size`` (default
  ``min(max_num_seqs x tokens per request, 512)``). With speculative decoding every size is
  rounded up to a multiple of ``1 + num_speculative_tokens`` (a verify batch of n requests is
  n times that), and sizes no step can reach (more than ``max_num_seqs`` requests or
  ``max_num_batched_tokens`` tokens) are dropped.
- A step is padded up to the nearest size (``graph_size``); above the largest it runs eager.
- ``explicit``: whether ``cudagraph_mode`` was given; a capture failure at start-up is then an
  error, otherwise a warning and eager decode (a server that starts beats one that does not).
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, fields, replace

from atb_plugin.utils import json_object
from atb_plugin.validation import check_int

MODES = ("NONE", "FULL_DECODE_ONLY")
# vLLM's other modes: known, refused with the two above named.
UNSUPPORTED_MODES = ("PIECEWISE", "FULL", "FULL_AND_PIECEWISE")
DEFAULT_MODE = "FULL_DECODE_ONLY"
MAX_DEFAULT_CAPTURE_SIZE = 512
# vLLM's compile levels / modes: accepted for compatibility, nothing here is compiled.
IGNORED_KEYS = ("level", "mode", "use_inductor", "backend", "compile_sizes", "custom_ops", "splitting_ops",
                "use_cudagraph", "cudagraph_num_of_warmups", "pass_config", "inductor_compile_config")


def _check_int(name: str, value, low: int) -> None:
    check_int(name, value, f">= {low}")
    if value < low:
        raise ValueError(f"{name} = {value}: must be >= {low}")


def default_capture_sizes(max_size: int) -> list[int]:
    """vLLM's list: 1, 2, 4, then every 8 up to 256, then every 16, up to ``max_size``."""
    sizes = [1, 2, 4] + list(range(8, 256, 8)) + list(range(256, max_size + 1, 16))
    return [s for s in sizes if s <= max_size] or [max_size]


@dataclass(frozen=True)
class CompilationConfig:
    """The user's settings, then (``resolve``) what the engine runs. Contract of a resolved one:
    ``cudagraph_mode`` in ``MODES``; ``cudagraph_capture_sizes`` sorted, distinct, multiples of
    ``uniform_decode_len``; ``max_cudagraph_capture_size`` their largest (0 with mode NONE)."""

    cudagraph_mode: str | None = None
    cudagraph_capture_sizes: tuple[int, ...] | None = None
    max_cudagraph_capture_size: int | None = None
    explicit: bool | None = None  # set by resolve: was cudagraph_mode given
    uniform_decode_len: int = 1  # set by resolve: query tokens per request of a captured step

    def __post_init__(self):
        mode = self.cudagraph_mode
        if mode is not None:
            if not isinstance(mode, str):
                raise ValueError(f"compilation_config.cudagraph_mode = {mode!r}: expected one of {', '.join(MODES)}")
            mode = mode.strip().upper()
            if mode in UNSUPPORTED_MODES:
                raise ValueError(f"compilation_config.cudagraph_mode = {mode!r} is not supported: this engine "
                                 f"captures whole decode steps only; use FULL_DECODE_ONLY (the default) or NONE")
            if mode not in MODES:
                raise ValueError(f"compilation_config.cudagraph_mode = {self.cudagraph_mode!r}: expected one of "
                                 f"{', '.join(MODES)}")
            object.__setattr__(self, "cudagraph_mode", mode)
        sizes = self.cudagraph_capture_sizes
        if sizes is not None:
            if isinstance(sizes, (str, bytes)) or not hasattr(sizes, "__iter__"):
                raise ValueError(f"compilation_config.cudagraph_capture_sizes = {sizes!r}: expected a list of "
                                 "batch sizes")
            sizes = tuple(sizes)
            for size in sizes:
                _check_int("compilation_config.cudagraph_capture_sizes[]", size, 1)
            object.__setattr__(self, "cudagraph_capture_sizes", tuple(sorted(set(sizes))))
        if self.max_cudagraph_capture_size is not None:
            _check_int("compilation_config.max_cudagraph_capture_size", self.max_cudagraph_capture_size, 0)
        _check_int("compilation_config.uniform_decode_len", self.uniform_decode_len, 1)

    @classmethod
    def from_value(cls, value) -> "CompilationConfig":
        """A ``CompilationConfig``, a dict of vLLM's keys, a JSON object string, or None (defaults)."""
        if value is None:
            return cls()
        if isinstance(value, cls):
            return value
        if isinstance(value, str):
            try:
                value = json_object(value)
            except ValueError as error:
                raise ValueError(f"compilation_config: {error}") from None
        if not isinstance(value, dict):
            raise ValueError(f"compilation_config must be a dict (vLLM's keys) or a JSON object, got {value!r}")
        known = {f.name for f in fields(cls)} - {"explicit", "uniform_decode_len"}
        unknown = set(value) - known - set(IGNORED_KEYS)
        if unknown:
            raise ValueError(f"compilation_config: unknown key(s) {', '.join(sorted(unknown))}; this engine reads "
                             f"{', '.join(sorted(known))}")
        return cls(**{k: v for k, v in value.items() if k in known})

    def resolve(self, *, enforce_eager: bool, max_num_seqs: int, max_num_batched_tokens: int,
                uniform_decode_len: int = 1, default_mode: str = DEFAULT_MODE) -> "CompilationConfig":
        """What the engine runs (class docstring); ``default_mode``: the platform's
        (``Platform.default_cudagraph_mode``). Resolving a resolved config changes nothing."""
        explicit = self.explicit if self.explicit is not None else self.cudagraph_mode is not None
        mode = "NONE" if enforce_eager else (self.cudagraph_mode or default_mode)
        q = uniform_decode_len
        reachable = min(max_num_seqs * q, max_num_batched_tokens)
        given, limit = self.cudagraph_capture_sizes, self.max_cudagraph_capture_size
        if limit is None:  # vLLM: the largest size given, else min(what a step reaches, 512)
            limit = reachable if given is not None else min(reachable, MAX_DEFAULT_CAPTURE_SIZE)
        if mode == "NONE" or limit == 0:
            return replace(self, cudagraph_mode="NONE", cudagraph_capture_sizes=(), max_cudagraph_capture_size=0,
                           explicit=explicit, uniform_decode_len=q)
        sizes = default_capture_sizes(limit) if given is None else given
        rounded = sorted({-(-size // q) * q for size in sizes})
        kept = [s for s in rounded if s <= min(limit, reachable)]
        if not kept:
            raise ValueError(f"compilation_config.cudagraph_capture_sizes {list(sizes)}: no size is reachable "
                             f"(a step holds at most {reachable} tokens: max_num_seqs {max_num_seqs} x {q} "
                             f"token(s) per request, max_num_batched_tokens {max_num_batched_tokens}"
                             f"{', max_cudagraph_capture_size ' + str(limit) if limit < reachable else ''})")
        return replace(self, cudagraph_mode=mode, cudagraph_capture_sizes=tuple(kept),
                       max_cudagraph_capture_size=kept[-1], explicit=explicit, uniform_decode_len=q)

    @property
    def captures(self) -> bool:
        return self.cudagraph_mode == "FULL_DECODE_ONLY"

    def graph_size(self, num_tokens: int) -> int | None:
        """The captured size a step of ``num_tokens`` tokens pads up to; None above the largest."""
        sizes = self.cudagraph_capture_sizes or ()
        index = bisect.bisect_left(sizes, num_tokens)
        return sizes[index] if index < len(sizes) else None

    def describe(self) -> str:
        if not self.captures:
            return "cudagraph_mode NONE"
        sizes = self.cudagraph_capture_sizes
        shown = ", ".join(map(str, sizes)) if len(sizes) <= 8 else f"{sizes[0]}, {sizes[1]}, ... {sizes[-1]}"
        return f"cudagraph_mode {self.cudagraph_mode}, {len(sizes)} capture sizes [{shown}] (tokens)"


__all__ = ["CompilationConfig", "DEFAULT_MODE", "MODES", "UNSUPPORTED_MODES", "default_capture_sizes"]
