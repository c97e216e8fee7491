"""``ServerConfig``: the service's one validated configuration (the HTTP fields + an EngineConfig).

The CLI (``atb_plugin.server.cli``) fills it from flags (and a MindIE ``config.json``); the API
process hands ``engine`` to the engine-core process and the worker settings to the tokenizer
pool. Every limit a request can hit is here, named as its flag so error messages can say which
flag raises it.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field

from atb_plugin.engine.config import EngineConfig
from atb_plugin.multimodal.limits import LIMIT_FIELDS, MediaLimits, flat_limits
from atb_plugin.server.tls import TLSSettings, check_tls
from atb_plugin.utils import available_cores


def default_served_model_name(model: str) -> str:
    """The public name of a checkpoint served without --served-model-name: its directory's name
    (``/models/Qwen2-VL-7B-Instruct`` -> ``Qwen2-VL-7B-Instruct``), or the repository's
    ``org/name`` for a Hugging Face cache snapshot (``.../models--Qwen--Qwen2-VL-2B-Instruct/
    snapshots/<revision>``), what a client of the hub would call it. vLLM's default is the --model
    value itself, but that is a path on this machine, which clients have no business knowing
    (requests naming it are still accepted: ``http.parse``)."""
    path = os.path.abspath(model)
    parent, name = os.path.split(path)
    grandparent, parent_name = os.path.split(parent)
    repository = os.path.basename(grandparent)
    if parent_name == "snapshots" and repository.startswith("models--") and len(repository) > len("models--"):
        return repository[len("models--"):].replace("--", "/")
    return name or path


def default_tokenizer_workers() -> int:
    # One core stays with the engine core's busy loop; preprocessing images is the workers' job.
    return max(1, min(4, available_cores() - 1))


def takes_video_or_audio(engine: EngineConfig) -> bool:
    """Whether the model's requests may carry video or audio (what the media workers decode)."""
    from atb_plugin.models.interfaces import model_modality
    from atb_plugin.models.registry import import_model_class

    return engine.limit_videos_per_prompt > 0 or (
        engine.limit_mm_per_prompt > 0 and model_modality(import_model_class(engine.model_cls_path)) == "audio")


# limit_mm_per_prompt by name is the engine's, resolved (the property below).
@flat_limits("media", [name for name in LIMIT_FIELDS if name != "limit_mm_per_prompt"])
@dataclass(frozen=True)
class ServerConfig:
    engine: EngineConfig
    served_model_name: str | None = None  # None: default_served_model_name(the --model value)
    host: str = "127.0.0.1"
    port: int = 1025  # MindIE's default
    api_key: str | None = None
    tokenizer_workers: int = field(default_factory=default_tokenizer_workers)
    # Processes that decode video and audio (the same worker code as the tokenizer workers, apart
    # from them): a text request never waits behind a video. None: one for a model that takes
    # video or audio, none otherwise (its requests cannot carry any).
    media_workers: int | None = None
    max_queued_requests: int = 256
    # Which engine core takes a request under data parallelism (engine/dp_client.py).
    data_parallel_routing: str = "cache-aware"
    # Inputs of one pooling request (/score, /rerank: pairs); OpenAI's limit for /v1/embeddings.
    max_pooling_inputs: int = 2048
    allowed_local_media_paths: tuple[str, ...] = ()
    allowed_media_domains: tuple[str, ...] = ()
    # Every media limit (--max-image-bytes ... --max-audio-seconds, --limit-mm-per-prompt video=N),
    # as the flags give them: per-prompt counts None are the model's own (the engine resolves its
    # copy, engine.media).
    media: MediaLimits = field(default_factory=MediaLimits)
    max_request_body_bytes: int = 64 * 1024 * 1024  # three 20 MiB images as base64 data URLs fit
    max_input_tokens: int | None = None  # MindIE's maxInputTokenLen
    chat_template: str | None = None  # a file path or the template text
    shm_budget_bytes: int | None = None
    shutdown_timeout: float = 30.0
    log_level: str = "info"
    # n > 1 runs n engine requests: the cap keeps one HTTP request from filling --max-num-seqs.
    max_parallel_samples: int = 16
    # Tool calling and reasoning output (vLLM's flags): a parser turns the model's own call /
    # thinking syntax into message.tool_calls / message.reasoning_content.
    enable_auto_tool_choice: bool = False
    tool_call_parser: str | None = None
    reasoning_parser: str | None = None
    # HTTPS / mutual TLS (server/tls.py) and MindIE's timeouts: seconds for a whole generate
    # request (e2eTimeout) and to its first token / between tokens (tokenTimeout); None: no limit.
    tls: TLSSettings = field(default_factory=TLSSettings)
    request_timeout: float | None = None
    token_timeout: float | None = None
    # LoRA adapters served by name (--lora-modules: lora.registry.LoRAModule), runtime loading and
    # unloading (--allow-runtime-lora-updating / VLLM_ALLOW_RUNTIME_LORA_UPDATING), and the
    # directories runtime loads may read (docs/lora.md).
    lora_modules: tuple = ()
    allow_runtime_lora_updating: bool = False
    allowed_lora_dirs: tuple[str, ...] = ()

    def __post_init__(self):
        if self.served_model_name is None:
            object.__setattr__(self, "served_model_name", default_served_model_name(self.engine.model))
        if not isinstance(self.media, MediaLimits):
            raise ValueError(f"ServerConfig.media must be a MediaLimits, got {type(self.media).__name__}")
        if self.media_workers is None:
            object.__setattr__(self, "media_workers", 1 if takes_video_or_audio(self.engine) else 0)
        for name, low in (("port", 0), ("tokenizer_workers", 1), ("media_workers", 0), ("max_queued_requests", 1), ("max_parallel_samples", 1),
                          ("max_pooling_inputs", 1), ("max_request_body_bytes", 1)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"--{name.replace('_', '-')} = {value!r}: must be an integer >= {low}")
        if self.port > 65535:
            raise ValueError(f"--port = {self.port}: must be <= 65535")
        for name in ("shm_budget_bytes", "max_input_tokens"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
                raise ValueError(f"--{name.replace('_', '-')} = {value!r}: must be an integer >= 0")
        self._check_parsers()
        for name in ("request_timeout", "token_timeout"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))
                                      or not 0 < value < float("inf")):
                raise ValueError(f"--{name.replace('_', '-')} = {value!r}: must be a number of seconds > 0")
        check_tls(self.tls, self.api_key)
        if (self.lora_modules or self.allow_runtime_lora_updating) and not self.engine.enable_lora:
            raise ValueError("--lora-modules / runtime LoRA updating need --enable-lora")
        if self.shutdown_timeout < 0:
            raise ValueError(f"--shutdown-timeout = {self.shutdown_timeout}: must be >= 0")
        object.__setattr__(self, "allowed_local_media_paths", tuple(self.allowed_local_media_paths))
        object.__setattr__(self, "allowed_media_domains", tuple(self.allowed_media_domains))
        if self.chat_template is not None and os.path.isfile(self.chat_template):
            with open(self.chat_template, encoding="utf-8") as file:
                object.__setattr__(self, "chat_template", file.read())

    def _check_parsers(self) -> None:
        from atb_plugin.server.reasoning_parsers import REASONING_PARSERS
        from atb_plugin.server.tool_parsers import TOOL_PARSERS

        if self.enable_auto_tool_choice and self.tool_call_parser is None:
            raise ValueError("--enable-auto-tool-choice needs --tool-call-parser (one of "
                             f"{', '.join(sorted(TOOL_PARSERS))})")
        if self.tool_call_parser is not None and self.tool_call_parser not in TOOL_PARSERS:
            raise ValueError(f"--tool-call-parser = {self.tool_call_parser!r}: must be one of "
                             f"{', '.join(sorted(TOOL_PARSERS))}")
        if self.reasoning_parser is not None and self.reasoning_parser not in REASONING_PARSERS:
            raise ValueError(f"--reasoning-parser = {self.reasoning_parser!r}: must be one of "
                             f"{', '.join(sorted(REASONING_PARSERS))}")

    @property
    def limit_mm_per_prompt(self) -> int:
        """Images per prompt: the engine's (resolved from --limit-mm-per-prompt and the model's own
        limit there), which the tokenizer workers' input builders enforce per request."""
        return self.engine.limit_mm_per_prompt

    def media_config(self):
        from input_builders.media_config import MediaConfig

        return MediaConfig(allowed_local_media_paths=self.allowed_local_media_paths,
                           allowed_domains=self.allowed_media_domains, limits=self.media, api="server")

    def describe(self) -> str:
        lines = [f"{f.name} = {getattr(self, f.name)!r}" for f in dataclasses.fields(self)
                 if f.name not in ("engine", "api_key", "chat_template", "tls", "media")]
        lines += ["media." + line for line in self.media.describe()]
        lines += [f"tls.{f.name} = {getattr(self.tls, f.name)!r}" for f in dataclasses.fields(self.tls)]
        lines.append(f"api_key = {'<set>' if self.api_key else None}")
        lines.append(f"chat_template = {'<custom>' if self.chat_template else None}")
        return "\n".join(lines + ["engine." + line for line in self.engine.describe().splitlines()])
