"""``EngineConfig``: the one validated configuration of the engine core.

The offline ``LLM`` builds it from keyword arguments and the server's CLI from flags; every
component below takes the config (or its ``scheduler_config``), never loose values. Facts about
the checkpoint (model type, vocabulary size, declared context window) are read from its
``config.json`` here, so the core needs no tokenizer and no router.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field

from atb_plugin.distributed import divide, kv_heads_per_rank
from atb_plugin.engine.compilation_config import CompilationConfig
from atb_plugin.engine.kv_transfer.config import KVTransferConfig, resolve_kv_transfer_config
from atb_plugin.engine.kv_transfer.factory import connector_class
from atb_plugin.engine.memory_profile import DEFAULT_KV_CACHE_BYTES
from atb_plugin.engine.scheduler import SchedulerConfig
from atb_plugin.engine.spec_decode.config import SpeculativeConfig
from atb_plugin.models import registry
from atb_plugin.models.interfaces import resolve_mm_limit
from atb_plugin.multimodal.limits import MediaLimits, flat_limits
from atb_plugin.multimodal.wire import DEFAULT_WIRE_DTYPE, check_wire_dtype
from atb_plugin.pooling.config import resolve_runner, sentence_transformers_max_len
from atb_plugin.platform import platform_for
from atb_plugin.platform.base import DTYPES as TORCH_DTYPES
from atb_plugin.utils import available_cores, cdiv

logger = logging.getLogger(__name__)

__all__ = ["DEFAULT_KV_CACHE_BYTES", "DEVICES", "DTYPES", "EngineConfig", "FALLBACK_MAX_MODEL_LEN", "head_size"]

DTYPES = ("auto", *TORCH_DTYPES)
# The media limits the engine itself sizes for (the start-up memory profile), which its keyword
# arguments and attributes name directly (the offline LLM's keywords too).
ENGINE_MEDIA_LIMITS = ("limit_mm_per_prompt", "limit_videos_per_prompt", "max_video_frames")
DEVICES = ("auto", "cpu", "cuda", "npu")
# When the checkpoint declares no context window (rare: tiny test checkpoints, some converts).
FALLBACK_MAX_MODEL_LEN = 4096


EXECUTOR_BACKENDS = ("mp", "ray")


def check_executor_backend(backend: str) -> None:
    if backend not in EXECUTOR_BACKENDS:
        raise ValueError(f"EngineConfig.distributed_executor_backend = {backend!r} (--distributed-executor-backend): "
                         f"expected one of {', '.join(EXECUTOR_BACKENDS)}")
    if backend == "ray" and importlib.util.find_spec("ray") is None:
        raise ValueError("--distributed-executor-backend ray needs Ray, an optional dependency: "
                         "pip install 'atb-plugin[ray]'")


def _check_int(name: str, value, low: int, high: int | None = None) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"EngineConfig.{name} must be an integer, got {value!r}")
    if value < low or (high is not None and value > high):
        bound = f"[{low}, {high}]" if high is not None else f">= {low}"
        raise ValueError(f"EngineConfig.{name} = {value}: must be {bound}")


def decoder_linear_layers(hf_config: dict, tensor_parallel_size: int = 1) -> list[tuple[int, int]]:
    """``(out, in)`` of a decoder's linear layers as its config.json sizes them: per layer the fused
    QKV, O, fused gate-up and down projections, then the LM head (empty where it does not say);
    with tensor parallelism, one rank's shard of each (column-parallel layers split their outputs,
    row-parallel ones their inputs). What ``dtype="auto"`` is measured on
    (``Platform.measured_dtype``): the sizes, not the biases or an MoE's routing, decide which
    dtype runs faster."""
    def size(key: str, default=None):
        value = registry.config_value(hf_config, key, default)
        return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None

    hidden, inter, heads = size("hidden_size"), size("intermediate_size"), size("num_attention_heads")
    layers, vocab = size("num_hidden_layers"), size("vocab_size")
    if None in (hidden, inter, heads, layers, vocab):
        return []
    head_dim = size("head_dim") or hidden // heads
    q, kv = heads * head_dim, (size("num_key_value_heads") or heads) * head_dim
    tp = tensor_parallel_size
    return ([(cdiv(q + 2 * kv, tp), hidden), (hidden, cdiv(q, tp)), (cdiv(2 * inter, tp), hidden),
             (hidden, cdiv(inter, tp))] * layers + [(cdiv(vocab, tp), hidden)])


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


def check_tensor_parallel(hf_config: dict, tp: int, expert_parallel: bool = False) -> None:
    """ValueError, naming the numbers and the fix, when the language model's attention heads do
    not split over ``tp`` ranks (KV heads: split evenly, or replicated when fewer than the ranks
    and dividing them), nor an MoE model's experts (``expert_parallel``: the expert count; else
    each expert's ``moe_intermediate_size``). The layers check the rest (intermediate size) when
    they are built."""
    if tp == 1:
        return
    experts = registry.config_value(hf_config, "num_experts", registry.config_value(hf_config, "num_local_experts"))
    if isinstance(experts, int) and experts > 0:
        if expert_parallel:
            divide(experts, tp, "num_experts")
        elif isinstance(size := registry.config_value(hf_config, "moe_intermediate_size"), int) and size % tp:
            try:
                divide(size, tp, "moe_intermediate_size")
            except ValueError as error:
                raise ValueError(f"{error}; or split whole experts over the ranks (--enable-expert-parallel)") from None
    heads = registry.config_value(hf_config, "num_attention_heads")
    if isinstance(heads, int):
        divide(heads, tp, "num_attention_heads")
    kv_heads = registry.config_value(hf_config, "num_key_value_heads")
    if isinstance(kv_heads, int):
        kv_heads_per_rank(kv_heads, tp)


@flat_limits("media", ENGINE_MEDIA_LIMITS)
@dataclass(frozen=True)
class EngineConfig:
    """Everything the engine core needs, checked once.

    ``max_model_len`` (prompt + output tokens of one request) defaults to the checkpoint's
    declared window; ``kv_cache_blocks`` (including the null block) defaults to what the KV budget
    holds (``kv_cache_bytes`` when given; else on the CPU ``DEFAULT_KV_CACHE_BYTES``, on NPU / CUDA
    ``gpu_memory_utilization`` of the device memory less the start-up memory profile,
    ``atb_plugin.engine.memory_profile``), capped at what
    ``max_num_seqs`` full-length requests need. ``media`` (a ``MediaLimits``): its
    ``limit_mm_per_prompt`` (items of the model's own modality per prompt) and
    ``limit_videos_per_prompt`` are resolved to the model's own limits when None and may not exceed
    them; those two and ``max_video_frames`` may be given and read by name too
    (``EngineConfig(model, limit_mm_per_prompt=2)``, ``config.max_video_frames``).
    ``shm_instances``: if not empty, the only shared-memory instances the core accepts handles
    from, whatever a request registers (a deployment can pin its frontends).

    ``device`` ``"auto"`` is ``current_platform()``. ``dtype`` ``"auto"`` and ``block_size`` None
    are the platform's choice (CPU: float32, 16, or bfloat16 for a generative float model packed
    for the native kernels where this CPU measured it faster: ``Platform.measured_dtype``, logged;
    CUDA: bfloat16 where supported else float16, 16; NPU: bfloat16 on A2/A3 else float16, 128), and
    explicit values are checked against the platform's op rules here, at start-up; the resolved
    values are what the config holds.

    ``runner`` / ``convert`` ("auto": from the checkpoint's architecture, ``atb_plugin.pooling.
    config``) choose generation or pooling; ``hf_overrides`` are config.json keys replaced before
    anything reads it (e.g. ``architectures``, ``classifier_from_token``, ``is_matryoshka``,
    ``pooler_config``). A pooling config runs whole prompts in one step, so its token budget is
    at least ``max_model_len``, and caches no prefixes (every token's hidden state is pooled)."""

    model: str
    dtype: str = "auto"
    device: str = "auto"
    max_model_len: int | None = None
    block_size: int | None = None
    kv_cache_bytes: int | None = None  # None: DEFAULT_KV_CACHE_BYTES on the CPU, the profile on devices
    kv_cache_blocks: int | None = None
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 64
    enable_prefix_caching: bool = True
    shm_instances: tuple[str, ...] = ()
    gpu_memory_utilization: float = 0.9  # NPU / CUDA: the share of device memory this engine may use
    # Media per prompt (images or audio clips, videos) and frames per video at most: with
    # max_model_len, what the start-up memory profile's worst-case prompt is (docs/architecture.md,
    # "Memory profiling and KV sizing"). The input builders enforce the same values per request.
    media: MediaLimits = field(default_factory=MediaLimits)
    # torch intra-op threads of the engine (the process that runs the model); None: every core
    # this process may use. The frontend processes keep one each (docs/architecture.md, Threads).
    num_threads: int | None = None
    # How the frontends ship images through shm (atb_plugin.multimodal.wire): "uint8" resized
    # images normalised on the device, or "float32" pixel values (MindIE's form). The model reads
    # either (the segment header says which); this picks what the builders write and what the
    # start-up memory profile feeds the encoder.
    mm_wire_dtype: str = DEFAULT_WIRE_DTYPE
    # CPU: linear weights re-laid once at load (atb_plugin.ops.packed_linear): the native kernels'
    # column panels, or oneDNN's packed layout where those do not build; faster GEMMs, same results
    # up to float32 summation order. Off: the checkpoint's layout.
    pack_weights: bool = True
    # Off (the default): decode-only steps replay a captured decode step (NPU / CUDA: a device graph
    # per batch size, engine/graph_runner.py; the CPU with the native kernels: its native plan,
    # models/native_decode.py). On: always the eager forward (cudagraph_mode NONE).
    enforce_eager: bool = False
    # vLLM's compilation_config (docs/graph-mode.md): cudagraph_mode FULL_DECODE_ONLY | NONE,
    # cudagraph_capture_sizes, max_cudagraph_capture_size; a CompilationConfig, a dict or a JSON
    # string. Resolved in __post_init__ (enforce_eager, speculative width, batch limits).
    compilation_config: CompilationConfig | None = None
    runner: str = "auto"
    convert: str = "auto"
    hf_overrides: dict | None = None
    # Ranks one model is sharded over (atb_plugin.engine.executor; docs/architecture.md, "Tensor
    # parallelism"); 1 runs it in the engine core's own process.
    tensor_parallel_size: int = 1
    # MoE models under TP: each rank holds num_experts / TP whole experts instead of a slice of
    # every expert (models/moe.py says why the outputs are combined by the existing all-reduce).
    enable_expert_parallel: bool = False
    # The device index each rank uses (MindIE's npuDeviceIds); None: ranks 0 .. TP-1 (with data
    # parallelism, engine i's ranks take devices i*TP .. (i+1)*TP-1).
    device_ids: tuple[int, ...] | None = None
    # Engine cores behind one API server, each a whole engine with its own ranks, devices and (on
    # the CPU) cores (docs/architecture.md, "Data parallelism"); this engine's index among them.
    data_parallel_size: int = 1
    data_parallel_rank: int = 0
    # How the ranks are started (atb_plugin/engine/executor/): "mp", processes of this node;
    # "ray", Ray actors in a placement group, on any node of the cluster (engine/executor/ray.py).
    distributed_executor_backend: str = "mp"
    # Low-precision linear layers (docs/quantization.md): None, "w8a16" or "w8a8". An msModelSlim
    # checkpoint (quant_model_description*.json beside its weights) sets it; a float checkpoint
    # is quantized on the fly at load. Resolved: the method the engine runs.
    quantization: str | None = None
    # The LM head in int8 too (on-the-fly quantization only): off by default, as in vLLM and
    # msModelSlim; it is the largest matrix of a small model (docs/quantization.md, "The LM head").
    quantize_lm_head: bool = False
    # Speculative decoding (docs/speculative.md): a SpeculativeConfig, or a dict of vLLM's keys
    # (``{"method": "ngram", "num_speculative_tokens": 4}``, --speculative-config); None: off.
    speculative_config: SpeculativeConfig | None = None
    # Multi-LoRA (docs/lora.md; vLLM's flags): adapters served over this model, at most max_loras
    # of them in one step (device slots of rank up to max_lora_rank, allocated before the KV cache
    # is sized) and max_cpu_loras (None: max_loras) kept in host memory.
    enable_lora: bool = False
    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None
    # KV connectors (docs/kv-transfer.md; vLLM's keys): a KVTransferConfig, a dict or a JSON
    # string (--kv-transfer-config); kv_offloading_size (GiB, --kv-offloading-size) is the
    # shortcut for the OffloadingConnector's host tier (resolved into kv_transfer_config).
    kv_transfer_config: KVTransferConfig | None = None
    kv_offloading_size: float | None = None
    # Resolved from config.json in __post_init__:
    architecture: str = field(init=False)
    tasks: tuple[str, ...] = field(init=False)  # what the model serves: ("generate",) or pooling tasks
    hidden_size: int | None = field(init=False)
    is_matryoshka: bool = field(init=False)  # embeddings may be cut to fewer ``dimensions``
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
        if self.kv_cache_bytes is not None:
            _check_int("kv_cache_bytes", self.kv_cache_bytes, 1)
        if self.kv_cache_blocks is not None:
            _check_int("kv_cache_blocks", self.kv_cache_blocks, 2)  # the null block + one usable
        _check_int("max_num_batched_tokens", self.max_num_batched_tokens, 1)
        _check_int("max_num_seqs", self.max_num_seqs, 1)
        if not isinstance(self.enable_prefix_caching, bool):
            raise ValueError(f"EngineConfig.enable_prefix_caching must be a bool, got {self.enable_prefix_caching!r}")
        for flag in ("pack_weights", "enforce_eager", "enable_expert_parallel", "enable_lora"):
            if not isinstance(getattr(self, flag), bool):
                raise ValueError(f"EngineConfig.{flag} must be a bool, got {getattr(self, flag)!r}")
        set_(self, "shm_instances", tuple(self.shm_instances))
        set_(self, "speculative_config", SpeculativeConfig.from_value(self.speculative_config))
        utilization = self.gpu_memory_utilization
        if isinstance(utilization, bool) or not isinstance(utilization, (int, float)) or not 0 < utilization <= 1:
            raise ValueError(f"EngineConfig.gpu_memory_utilization = {utilization!r} (--gpu-memory-utilization): "
                             "must be a fraction in (0, 1]")
        if not isinstance(self.media, MediaLimits):
            raise ValueError(f"EngineConfig.media must be a MediaLimits, got {type(self.media).__name__}")
        check_wire_dtype(self.mm_wire_dtype, "EngineConfig.mm_wire_dtype (--mm-wire-dtype)")
        _check_int("data_parallel_size", self.data_parallel_size, 1, 64)
        _check_int("data_parallel_rank", self.data_parallel_rank, 0, self.data_parallel_size - 1)
        if self.num_threads is None:  # the cores this process may use, shared out among the engines
            set_(self, "num_threads", max(1, available_cores() // self.data_parallel_size))
        else:
            _check_int("num_threads", self.num_threads, 1)
        _check_int("tensor_parallel_size", self.tensor_parallel_size, 1, 64)
        check_executor_backend(self.distributed_executor_backend)
        if self.data_parallel_size > 1 and self.device_ids is not None:
            raise ValueError("EngineConfig.device_ids with data_parallel_size > 1: each engine takes the next "
                             "tensor_parallel_size devices; choose the devices with ASCEND_RT_VISIBLE_DEVICES "
                             "(MindIE: npuDeviceIds) instead")
        if self.device_ids is not None:
            set_(self, "device_ids", tuple(self.device_ids))
            for index in self.device_ids:
                _check_int("device_ids[]", index, 0)
            if len(self.device_ids) != self.tensor_parallel_size or len(set(self.device_ids)) != len(self.device_ids):
                raise ValueError(f"EngineConfig.device_ids = {list(self.device_ids)}: give {self.tensor_parallel_size} "
                                 "distinct device indices, one per tensor-parallel rank (MindIE: npuDeviceIds has "
                                 "worldSize entries)")

        if self.hf_overrides is not None and not isinstance(self.hf_overrides, dict):
            raise ValueError(f"EngineConfig.hf_overrides must be a dict of config.json keys, got {self.hf_overrides!r}")
        hf_config = self.checkpoint_config()
        set_(self, "architecture", registry.architecture(hf_config))
        choice = resolve_runner(self.architecture, self.runner, self.convert)
        set_(self, "runner", choice.runner)
        set_(self, "convert", choice.convert)
        set_(self, "tasks", choice.tasks)
        from atb_plugin.models.quantization import resolve_quantization  # reads the checkpoint's description

        set_(self, "quantization", resolve_quantization(self.model, self.quantization, self.quantize_lm_head)[0])
        if self.quantization is not None and self.runner == "pooling":
            raise ValueError(f"EngineConfig.quantization = {self.quantization!r}: quantized layers serve generative "
                             "models only (the pooling runner keeps float weights)")
        # An unsupported model_type fails here, naming the choices.
        set_(self, "model_cls_path", registry.model_class_path(hf_config, self.runner))
        set_(self, "model_type", registry.registry_key(hf_config))
        hidden = registry.config_value(hf_config, "hidden_size")
        set_(self, "hidden_size", hidden if isinstance(hidden, int) else None)
        set_(self, "is_matryoshka", bool(hf_config.get("is_matryoshka") or hf_config.get("matryoshka_dimensions")))
        vocab_size = registry.config_value(hf_config, "vocab_size")
        if not isinstance(vocab_size, int) or vocab_size < 1:
            raise ValueError(f"{self.model}/config.json: vocab_size is {vocab_size!r}, expected a positive integer")
        set_(self, "vocab_size", vocab_size)
        declared = registry.declared_max_model_len(hf_config) or FALLBACK_MAX_MODEL_LEN
        declared = min(declared, sentence_transformers_max_len(self.model) or declared)
        if self.max_model_len is None:
            set_(self, "max_model_len", declared)
        else:
            _check_int("max_model_len", self.max_model_len, 2, declared)
        platform = platform_for(self.device)
        dtype, block_size = platform.check_engine_config(self.dtype, self.block_size, head_size(hf_config))
        if self.dtype == "auto" and self.runner == "generate" and self.quantization is None and self.pack_weights:
            declared = registry.config_value(hf_config, "torch_dtype") or registry.config_value(hf_config, "dtype")
            # Measured as one rank runs: its shard of each layer, on its share of the threads
            # (engine/worker.py gives each of the TP ranks num_threads // TP).
            tp = self.tensor_parallel_size
            dtype, why = platform.measured_dtype(dtype, decoder_linear_layers(hf_config, tp), declared,
                                                 max(1, self.num_threads // tp))
            logger.info("dtype auto: %s (%s)", dtype, why)
        check_tensor_parallel(hf_config, self.tensor_parallel_size, self.enable_expert_parallel)
        devices = platform.device_count()
        engines = self.tensor_parallel_size * self.data_parallel_size
        needed = max(self.device_ids) + 1 if self.device_ids else engines
        if devices is not None and needed > devices:
            engines_part = f" x data_parallel_size {self.data_parallel_size}" if self.data_parallel_size > 1 else ""
            raise ValueError(f"tensor_parallel_size {self.tensor_parallel_size}{engines_part} (device ids "
                             f"{list(self.device_ids or range(needed))}) needs {needed} {platform.name} devices, "
                             f"this machine has {devices}: lower --tensor-parallel-size"
                             f"{' / --data-parallel-size' if engines_part else ''} or fix the device ids")
        set_(self, "dtype", dtype)
        set_(self, "block_size", block_size)
        if self.kv_cache_blocks is not None and (self.kv_cache_blocks - 1) * self.block_size < 2:
            raise ValueError(f"EngineConfig.kv_cache_blocks = {self.kv_cache_blocks} holds too few tokens")
        # The model class (imported, not loaded: the core loads weights) declares its image limit.
        model_cls = registry.import_model_class(self.model_cls_path)
        set_(self, "media", dataclasses.replace(
            self.media, limit_mm_per_prompt=resolve_mm_limit(model_cls, self.media.limit_mm_per_prompt),
            limit_videos_per_prompt=resolve_mm_limit(model_cls, self.media.limit_videos_per_prompt, "video")))
        if self.runner == "pooling" and self.speculative_config is not None:
            raise ValueError("EngineConfig.speculative_config: speculative decoding drafts generated tokens; a "
                             "pooling model generates none")
        if self.speculative_config is not None:
            self.speculative_config.check_target(hf_config, self.tensor_parallel_size)
            if self.speculative_config.method == "draft_model":
                self.draft_config()  # its checkpoint checked now, at start-up
        if self.runner == "pooling":
            # Pooling needs each prompt's hidden states in one step (no chunked prefill) and all of
            # them (a cached prefix would be skipped): raise the budget, turn prefix caching off.
            set_(self, "max_num_batched_tokens", max(self.max_num_batched_tokens, self.max_model_len))
            set_(self, "enable_prefix_caching", False)
        spec = self.speculative_config
        set_(self, "compilation_config", CompilationConfig.from_value(self.compilation_config).resolve(
            enforce_eager=self.enforce_eager, max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=self.max_num_batched_tokens,
            uniform_decode_len=1 + spec.num_speculative_tokens if spec is not None else 1,
            default_mode=platform.default_cudagraph_mode()))
        self._check_lora(hf_config)
        self._check_kv_transfer()
        set_(self, "scheduler_config",
             SchedulerConfig(self.max_num_batched_tokens, self.max_num_seqs, self.max_model_len,
                             self.max_loras if self.enable_lora else 0))

    def _check_kv_transfer(self) -> None:
        """Resolve the KV connector's config (the offloading shortcut included: afterwards only
        ``kv_transfer_config`` says it, so ``replace`` validates again cleanly), check the
        connector's own keys, and refuse what cannot work with a connector."""
        kv = resolve_kv_transfer_config(self.kv_transfer_config, self.kv_offloading_size)
        object.__setattr__(self, "kv_transfer_config", kv)
        object.__setattr__(self, "kv_offloading_size", None)
        if kv is None:
            return
        cls = connector_class(kv)
        cls.check_config(kv)
        if self.runner == "pooling":
            raise ValueError(f"kv_transfer_config ({kv.kv_connector}): KV connectors serve generative models; a "
                             "pooling model keeps no KV between requests")
        spec = self.speculative_config
        if spec is not None and spec.method != "ngram":
            # A draft model or head keeps KV / hidden states of its own for every position; the
            # connector loads only the target's, so its drafts would read nothing for them.
            raise ValueError(f"kv_transfer_config ({kv.kv_connector}) with speculative method {spec.method!r}: the "
                             "draft's own KV is not transferred; use method 'ngram' or no speculative decoding")
        if cls.needs_prefix_caching(kv) and not self.enable_prefix_caching:
            raise ValueError(f"kv_transfer_config ({kv.kv_connector}) names KV blocks by their prefix hash: it needs "
                             "enable_prefix_caching=True (drop --no-enable-prefix-caching)")

    def _check_lora(self, hf_config: dict) -> None:
        _check_int("max_loras", self.max_loras, 1, 256)
        _check_int("max_lora_rank", self.max_lora_rank, 1, 512)
        if self.max_cpu_loras is None:
            object.__setattr__(self, "max_cpu_loras", self.max_loras)
        _check_int("max_cpu_loras", self.max_cpu_loras, self.max_loras)
        if self.enable_lora and self.runner != "generate":
            raise ValueError("EngineConfig.enable_lora: LoRA adapters serve generative models (the pooling runner "
                             "keeps its base weights)")
        if self.enable_lora and registry.config_value(hf_config, "kv_lora_rank") is not None:
            # The adapters' layers (lora/layers.py) are the GQA decoder's qkv / o / gate_up / down;
            # MLA's low-rank projections and its absorbed kv_b_proj have no adapter path yet.
            raise ValueError(f"EngineConfig.enable_lora: LoRA on multi-head latent attention ({self.architecture}: "
                             "q_a_proj / q_b_proj / kv_a_proj_with_mqa / kv_b_proj) is not supported yet "
                             "(docs/lora.md)")

    def draft_config(self) -> "EngineConfig":
        """The draft checkpoint's config (speculative method ``draft_model``): this engine's
        device, dtype, block size, context window and batch limits; no prefix cache, no drafts."""
        spec = self.speculative_config
        try:
            return EngineConfig(spec.model, dtype=self.dtype, device=self.device, max_model_len=self.max_model_len,
                                block_size=self.block_size, kv_cache_blocks=self.kv_cache_blocks,
                                max_num_batched_tokens=self.max_num_batched_tokens, max_num_seqs=self.max_num_seqs,
                                enable_prefix_caching=False, num_threads=self.num_threads,
                                pack_weights=self.pack_weights, enforce_eager=self.enforce_eager, runner="generate")
        except ValueError as error:
            raise ValueError(f"speculative_config.model = {spec.model!r}: {error}") from None

    def rank_device(self, rank: int) -> int:
        """The device index of tensor-parallel ``rank`` of this engine."""
        if self.device_ids:
            return self.device_ids[rank]
        return self.data_parallel_rank * self.tensor_parallel_size + rank

    def for_data_parallel_rank(self, rank: int) -> "EngineConfig":
        """Engine ``rank``'s own config: the same settings, its index (which picks its devices)."""
        return self.replace(data_parallel_rank=rank)

    def engine_cores(self, cores: Sequence[int]) -> list[int] | None:
        """The CPU cores engine ``data_parallel_rank`` may use out of ``cores`` (this process's):
        its own ``num_threads`` of them, or None (no pinning) with one engine or too few cores."""
        if self.data_parallel_size == 1 or len(cores) < self.num_threads * self.data_parallel_size:
            return None
        start = self.data_parallel_rank * self.num_threads
        return sorted(cores)[start:start + self.num_threads]

    def checkpoint_config(self) -> dict:
        """The checkpoint's config.json with ``hf_overrides`` applied (top-level keys replaced)."""
        return {**registry.read_checkpoint_config(self.model), **(self.hf_overrides or {})}

    def check_task(self, pooling_params) -> None:
        """ValueError unless the model serves what the request asks: generation on a generate
        runner, a task of its pooler on a pooling runner, ``dimensions`` only where the checkpoint
        was trained for them (Matryoshka) and no larger than the embedding. The frontends call it
        before queueing (a 400, naming what the model serves); the core calls it again."""
        if pooling_params is None:
            if self.runner != "generate":
                raise ValueError(f"{self.model} is a pooling model (tasks: {', '.join(self.tasks)}); it does not "
                                 "generate text. Use the embeddings / pooling / classify / score endpoints")
            return
        if pooling_params.task not in self.tasks:
            if self.runner == "generate":
                raise ValueError(f"{self.model} is a generative model; task {pooling_params.task!r} needs a pooling "
                                 "model (start it with --runner pooling, or LLM(..., runner='pooling'))")
            raise ValueError(f"{self.model} does not serve task {pooling_params.task!r}; it serves "
                             f"{', '.join(self.tasks)}")
        dimensions = pooling_params.dimensions
        if dimensions is not None:
            if not self.is_matryoshka:
                raise ValueError(f"{self.model} does not support matryoshka representation (dimensions): its "
                                 "config.json declares no is_matryoshka / matryoshka_dimensions")
            if self.hidden_size is not None and dimensions > self.hidden_size:
                raise ValueError(f"dimensions = {dimensions} exceeds the embedding size {self.hidden_size}")

    def replace(self, **changes) -> "EngineConfig":
        """A copy with ``changes`` (re-validated; resolved dtype / block size carried over)."""
        return dataclasses.replace(self, **changes)

    def describe(self) -> str:
        """One ``name = value`` line per field, for the start-up log."""
        lines = [f"{f.name} = {getattr(self, f.name)!r}" for f in dataclasses.fields(self)
                 if f.name not in ("scheduler_config", "media")]
        return "\n".join(lines + ["media." + line for line in self.media.describe()])
