"""``EngineConfig``: the one validated configuration of the engine core.

The offline ``LLM`` builds it from keyword arguments and the server's CLI from flags; every
component below takes the config (or its ``scheduler_config``), never loose values. Facts about
the checkpoint (model type, vocabulary size, declared context window) are read from its
``config.json`` here, so the core needs no tokenizer and no router.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from atb_plugin.engine.scheduler import SchedulerConfig
from atb_plugin.models import registry
from atb_plugin.platform import platform_for
from atb_plugin.platform.base import DTYPES as TORCH_DTYPES

DTYPES = ("auto", *TORCH_DTYPES)
DEVICES = ("auto", "cpu", "cuda", "npu")
DEFAULT_KV_CACHE_BYTES = 1 << 30
# When the checkpoint declares no context window (rare: tiny test checkpoints, some converts).
FALLBACK_MAX_MODEL_LEN = 4096


def _check_int(name: str, value, low: int, high: int | None = None) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"EngineConfig.{name} must be an integer, got {value!r}")
    if value < low or (high is not None and value > high):
        bound = f"[{low}, {high}]" if high is not None else f">= {low}"
        raise ValueError(f"EngineConfig.{name} = {value}: must be {bound}")


def head_size(hf_config: dict) -> int | None:
    """Attention head size of the language model: ``head_dim``, else ``hidden_size /
    num_attention_heads`` (top level first, then ``text_config``); None when not declared."""
    for scope in (hf_config, hf_config.get("text_config") or {}):
        if isinstance(scope.get("head_dim"), int) and scope["head_dim"] > 0:
            return scope["head_dim"]
        heads, hidden = scope.get("num_attention_heads"), scope.get("hidden_size")
        if isinstance(heads, int) and heads > 0 and isinstance(hidden, int) and hidden > 0:
            return hidden // heads
    return None


@dataclass(frozen=True)
class EngineConfig:
    """Everything the engine core needs, checked once.

    ``max_model_len`` (prompt + output tokens of one request) defaults to the checkpoint's
    declared window; ``kv_cache_blocks`` (including the null block) defaults to what
    ``kv_cache_bytes`` holds, capped at what ``max_num_seqs`` full-length requests need.
    ``shm_instances``: if not empty, the only shared-memory instances the core accepts handles
    from, whatever a request registers (a deployment can pin its frontends).

    ``device`` ``"auto"`` is ``current_platform()``. ``dtype`` ``"auto"`` and ``block_size`` None
    are the platform's choice (CPU: float32, 16; CUDA: bfloat16 where supported else float16, 16;
    NPU: bfloat16 on A2/A3 else float16, 128), and explicit values are checked against the
    platform's op rules here, at start-up; the resolved values are what the config holds."""

    model: str
    dtype: str = "auto"
    device: str = "auto"
    max_model_len: int | None = None
    block_size: int | None = None
    kv_cache_bytes: int = DEFAULT_KV_CACHE_BYTES
    kv_cache_blocks: int | None = None
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 64
    enable_prefix_caching: bool = True
    shm_instances: tuple[str, ...] = ()
    # Resolved from config.json in __post_init__:
    model_type: str = field(init=False)
    model_cls_path: str = field(init=False)  # "module:Class", what the engine core loads
    vocab_size: int = field(init=False)
    scheduler_config: SchedulerConfig = field(init=False)

    def __post_init__(self):
        set_ = object.__setattr__  # frozen: derived fields are written once, here
        set_(self, "model", str(self.model))
        if self.dtype not in DTYPES:
            raise ValueError(f"EngineConfig.dtype = {self.dtype!r}: expected one of {', '.join(DTYPES)}")
        if self.device not in DEVICES:
            raise ValueError(f"EngineConfig.device = {self.device!r}: expected one of {', '.join(DEVICES)}")
        if self.block_size is not None:
            _check_int("block_size", self.block_size, 1, 1024)
        _check_int("kv_cache_bytes", self.kv_cache_bytes, 1)
        if self.kv_cache_blocks is not None:
            _check_int("kv_cache_blocks", self.kv_cache_blocks, 2)  # the null block + one usable
        _check_int("max_num_batched_tokens", self.max_num_batched_tokens, 1)
        _check_int("max_num_seqs", self.max_num_seqs, 1)
        if not isinstance(self.enable_prefix_caching, bool):
            raise ValueError(f"EngineConfig.enable_prefix_caching must be a bool, got {self.enable_prefix_caching!r}")
        set_(self, "shm_instances", tuple(self.shm_instances))

        hf_config = registry.read_checkpoint_config(self.model)
        # An unsupported model_type fails here, naming the choices.
        set_(self, "model_cls_path", registry.model_class_path(hf_config))
        set_(self, "model_type", registry.registry_key(hf_config))
        if self.model_type in registry.EMBEDDING_ONLY:
            cls = self.model_cls_path.partition(":")[2]
            raise ValueError(
                f"{self.model} is an embedding model ({self.model_type}: {cls}); it produces embeddings, not "
                "text, so the generation engine (LLM, the chat/completions server) cannot run it. Load it with "
                f"{self.model_cls_path.replace(':', '.')}.from_pretrained(dir) and call it on "
                "token ids; serving embedding models is not supported yet")
        vocab_size = registry.config_value(hf_config, "vocab_size")
        if not isinstance(vocab_size, int) or vocab_size < 1:
            raise ValueError(f"{self.model}/config.json: vocab_size is {vocab_size!r}, expected a positive integer")
        set_(self, "vocab_size", vocab_size)
        declared = registry.declared_max_model_len(hf_config) or FALLBACK_MAX_MODEL_LEN
        if self.max_model_len is None:
            set_(self, "max_model_len", declared)
        else:
            _check_int("max_model_len", self.max_model_len, 2, declared)
        dtype, block_size = platform_for(self.device).check_engine_config(
            self.dtype, self.block_size, head_size(hf_config))
        set_(self, "dtype", dtype)
        set_(self, "block_size", block_size)
        if self.kv_cache_blocks is not None and (self.kv_cache_blocks - 1) * self.block_size < 2:
            raise ValueError(f"EngineConfig.kv_cache_blocks = {self.kv_cache_blocks} holds too few tokens")
        set_(self, "scheduler_config",
             SchedulerConfig(self.max_num_batched_tokens, self.max_num_seqs, self.max_model_len))

    def replace(self, **changes) -> "EngineConfig":
        """A copy with ``changes`` (re-validated; resolved dtype / block size carried over)."""
        return dataclasses.replace(self, **changes)

    def describe(self) -> str:
        """One ``name = value`` line per field, for the start-up log."""
        return "\n".join(f"{f.name} = {getattr(self, f.name)!r}" for f in dataclasses.fields(self)
                         if f.name != "scheduler_config")
