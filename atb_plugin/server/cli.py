"""``atb-plugin serve`` / ``python -m atb_plugin.server``: flags -> ServerConfig -> uvicorn.

Flags use vLLM's names where vLLM has the setting; ``--config FILE`` takes a MindIE-style
``config.json`` whose fields fill the flags they map to (a flag given on the command line wins),
and every field it cannot honour is listed at start-up.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import errno
import json
import logging
import os
import signal
import socket
import sys
import threading

from atb_plugin.engine.config import DEFAULT_KV_CACHE_BYTES, DEVICES, DTYPES, EXECUTOR_BACKENDS, EngineConfig
from atb_plugin.engine.dp_client import ROUTINGS
from atb_plugin.multimodal.budgets import VIDEO_FPS, VIDEO_MAX_FRAMES, VIDEO_MIN_FRAMES
from atb_plugin.multimodal.limits import LIMIT_FIELDS, MediaLimits
from atb_plugin.multimodal.wire import DEFAULT_WIRE_DTYPE, WIRE_DTYPES
from atb_plugin.pooling.config import CONVERT_TYPES, RUNNER_TYPES
from atb_plugin.models.quantization.config import METHODS as QUANTIZATION_METHODS
from atb_plugin.server.config import ServerConfig, default_tokenizer_workers
from atb_plugin.server.tls import CERT_REQS, TLSSettings
from atb_plugin.utils import available_cores

logger = logging.getLogger("atb_plugin.server")


def _size(text: str) -> int:
    """``1073741824``, ``512M``, ``2G``, ``1GiB``."""
    units = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}
    value = text.strip().lower().removesuffix("ib").removesuffix("b")
    try:
        if value and value[-1] in units:
            return int(float(value[:-1]) * units[value[-1]])
        return int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size (e.g. 1073741824, 512M, 2G)") from None


class _MmLimit(int):
    """``--limit-mm-per-prompt`` as given: ``N``, or vLLM's ``MODALITY=N`` (``audio=2``), an int
    that remembers the modality it named (checked against the model's once it is known)."""

    modality: str | None = None
    videos: int | None = None  # a "video=N" entry (Qwen2-VL takes images and videos): MediaLimits' videos
    unset: bool = False  # only "video=N" was given: the image (or audio) limit stays the model's


def _mm_limit(text: str) -> int:
    """``N``, ``MODALITY=N``, or comma-separated entries of which one may be ``video=N``
    (``image=4,video=1``)."""
    entries = [entry.strip() for entry in text.split(",") if entry.strip()]
    videos = [entry for entry in entries if entry.partition("=")[0].strip().lower() == "video"]
    others = [entry for entry in entries if entry not in videos]
    if len(videos) > 1 or len(others) > 1 or not entries:
        raise argparse.ArgumentTypeError(f"{text!r}: give N, MODALITY=N, or one image (or audio) entry and one "
                                         "video entry (image=4,video=1)")
    limit = _one_mm_limit(others[0]) if others else _MmLimit(0)
    limit.unset = not others
    if videos:
        try:
            limit.videos = int(videos[0].partition("=")[2])
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r}: video=N needs an integer N") from None
    return limit


def _one_mm_limit(text: str) -> "_MmLimit":
    from atb_plugin.models.interfaces import MODALITIES

    kind, _, count = text.strip().rpartition("=")
    kind = kind.strip().lower() or None
    if kind is not None and kind not in MODALITIES:
        raise argparse.ArgumentTypeError(f"{text!r}: the modality must be one of {', '.join(MODALITIES)}")
    try:
        limit = _MmLimit(int(count))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not N or MODALITY=N (e.g. 4, audio=2)") from None
    limit.modality = kind
    return limit


def _json_object(text: str, keys: str = "config.json keys", example: str = '{"is_matryoshka": true}') -> dict:
    """``--hf-overrides '{"is_matryoshka": true}'``: a JSON object of config.json keys (or of
    ``keys``, as ``example`` shows)."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as error:
        raise argparse.ArgumentTypeError(f"{text!r} is not JSON ({error}); e.g. '{example}'") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"{text!r} must be a JSON object of {keys}, "
                                         f"not {type(value).__name__}")
    return value


def _speculative_config(text: str) -> dict:
    """``--speculative-config '{"method": "ngram", "num_speculative_tokens": 4}'``: vLLM's keys
    (EngineConfig checks them)."""
    return _json_object(text, "speculative_config keys", '{"method": "ngram", "num_speculative_tokens": 4}')


def _kv_transfer_config(text: str) -> dict:
    """``--kv-transfer-config '{"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
    "kv_connector_extra_config": {"cpu_bytes_to_use": 4294967296}}'``: vLLM's keys (EngineConfig
    and the connector check them)."""
    return _json_object(text, "kv_transfer_config keys",
                        '{"kv_connector": "OffloadingConnector", "kv_role": "kv_both"}')


def _compilation_config(text: str) -> dict:
    """``-O`` / ``--compilation-config '{"cudagraph_mode": "FULL_DECODE_ONLY", "cudagraph_capture_sizes":
    [1, 2, 4, 8]}'``: vLLM's keys (EngineConfig checks them). vLLM's bare levels: ``-O0`` is no
    graphs (cudagraph_mode NONE), ``-O1`` .. ``-O3`` the defaults (nothing here is compiled)."""
    if text.strip() in ("0", "1", "2", "3"):
        return {"cudagraph_mode": "NONE"} if text.strip() == "0" else {}
    return _json_object(text, "compilation_config keys",
                        '{"cudagraph_mode": "FULL_DECODE_ONLY", "cudagraph_capture_sizes": [1, 2, 4, 8]}')


def _lora_module(text: str):
    from atb_plugin.lora.registry import LoRAModule

    try:
        return LoRAModule.parse(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def runtime_lora_updating(flag: bool) -> bool:
    """--allow-runtime-lora-updating, or vLLM's environment variable saying the same."""
    return flag or os.environ.get("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "").strip().lower() in ("1", "true")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="atb-plugin serve", description="OpenAI-compatible server (vLLM's routes).",
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add = p.add_argument
    add("--config", help="a MindIE-style config.json (ServerConfig / BackendConfig / ModelDeployConfig); "
                         "flags given here override it")
    add("--model", help="checkpoint directory (HF format); default: SmolLM2-135M-Instruct, prepared once "
                        "(with --runner pooling: all-MiniLM-L6-v2)")
    add("--runner", default="auto", choices=("auto", *RUNNER_TYPES),
        help="generate (chat / completions) or pooling (embeddings, classify, score, rerank); auto: from the "
             "checkpoint's architecture")
    add("--convert", default="auto", choices=("auto", *CONVERT_TYPES),
        help="how a generative checkpoint becomes a pooling model (embed, classify, reward); none: a native "
             "pooling model as it is; auto: from the architecture")
    add("--hf-overrides", type=_json_object, metavar="JSON",
        help="config.json keys to replace, e.g. '{\"is_matryoshka\": true}' or '{\"architectures\": [...]}'")
    add("--served-model-name",
        help="the name clients send as `model` and /v1/models lists (default: the --model directory's name, e.g. "
             "Qwen2-VL-7B-Instruct; org/name for a Hugging Face cache snapshot); the --model path is accepted too")
    add("--host", default="127.0.0.1", help="address to listen on (0.0.0.0: every interface)")
    add("--port", type=int, default=1025, help="port (MindIE's default)")
    add("--device", default="auto", choices=DEVICES, help="auto: NPU if torch_npu finds one, else CUDA, else CPU")
    add("--dtype", default="auto", choices=DTYPES,
        help="auto: the platform's choice (CPU float32, or bfloat16 where measured faster, logged at start-up; "
             "CUDA bfloat16 where supported, else float16; NPU bfloat16 on Atlas A2/A3, float16 on chips without "
             "bfloat16; float32 is refused on NPU)")
    add("--quantization", choices=QUANTIZATION_METHODS, default=None,
        help="int8 linear layers (docs/quantization.md): w8a16 (int8 weights) or w8a8 (int8 weights and "
             "activations), applied on the fly to a float checkpoint; an msModelSlim checkpoint "
             "(quant_model_description.json) is detected without it, and must agree with it when given")
    add("--quantize-lm-head", action="store_true",
        help="with --quantization on a float checkpoint: the LM head in int8 too (off by default, as in vLLM; "
             "on a small model it is the largest matrix a decode step reads)")
    add("--max-model-len", type=int, help="prompt + output tokens per request (default: the checkpoint's)")
    add("--max-num-seqs", type=int, default=64, help="requests running at once")
    add("--max-num-batched-tokens", type=int, default=2048, help="tokens per engine step (chunked prefill)")
    add("--block-size", type=int, default=None,
        help="tokens per KV block (default: the platform's, 16 on CPU/CUDA, 128 on NPU, where it must be "
             "a multiple of 16 and at most 128)")
    add("--kv-cache-memory", type=_size, default=None,
        help=f"bytes for the KV cache (512M, 2G); wins over --gpu-memory-utilization when given "
             f"(default: {DEFAULT_KV_CACHE_BYTES >> 30}G on the CPU, the memory profile's remainder on NPU / CUDA)")
    add("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True)
    add("--limit-mm-per-prompt", type=_mm_limit,
        help="media items per prompt, N or MODALITY=N (image=4, audio=2: the model's own modality), plus "
             "video=N for a model that takes video (image=4,video=1); default: "
             "the family's limit, which it may not exceed; the start-up memory profile sizes the KV cache for "
             "this many of the largest items")
    add("--num-threads", type=int, default=None,
        help="torch intra-op threads of the engine process (default: every core it may use, less one per "
             "tokenizer worker for a model that takes images); the tokenizer workers keep one each")
    add("--tensor-parallel-size", "-tp", type=int, default=1,
        help="shard the model over this many devices (ranks: one process each, torch.distributed with the "
             "platform's backend: hccl / nccl / gloo); on the CPU the engine's threads are split between the ranks")
    add("--distributed-executor-backend", choices=EXECUTOR_BACKENDS, default="mp",
        help="how the tensor-parallel ranks start: mp = processes on this node; ray = Ray actors placed by a "
             "placement group on the Ray cluster RAY_ADDRESS names (else a local one), across nodes "
             "(pip install 'atb-plugin[ray]'; README, \"Scaling out\")")
    add("--enable-expert-parallel", action="store_true",
        help="MoE models under --tensor-parallel-size: each rank holds num_experts / TP whole experts "
             "instead of a slice of every expert; the ranks' outputs are summed by the same all-reduce")
    add("--data-parallel-size", "-dp", type=int, default=1,
        help="engine cores behind this one server, each a whole copy of the model with its own "
             "--tensor-parallel-size devices (on the CPU: its own share of the cores)")
    add("--data-parallel-routing", choices=tuple(ROUTINGS), default="cache-aware",
        help="which engine core takes a request: cache-aware (back to the engine holding the prompt's prefix "
             "unless it is overloaded, else the least loaded; docs/architecture.md) or round-robin")
    add("-sc", "--speculative-config", type=_speculative_config, metavar="JSON",
        help="speculative decoding, vLLM's keys: '{\"method\": \"ngram\", \"num_speculative_tokens\": 4}' "
             "(optional prompt_lookup_min / prompt_lookup_max; docs/speculative.md)")
    add("--kv-transfer-config", type=_kv_transfer_config, metavar="JSON",
        help="a KV connector, vLLM's keys: '{\"kv_connector\": \"OffloadingConnector\", \"kv_role\": \"kv_both\", "
             "\"kv_connector_extra_config\": {\"cpu_bytes_to_use\": 4294967296}}' (docs/kv-transfer.md)")
    add("--kv-offloading-size", type=float, metavar="GiB",
        help="a host-memory tier of this many GiB under the prefix cache (the OffloadingConnector; "
             "not with --kv-transfer-config)")
    add("--enable-lora", action="store_true",
        help="serve LoRA adapters over the model (docs/lora.md): --lora-modules, or loaded at run time")
    add("--lora-modules", nargs="+", type=_lora_module, default=[], metavar="NAME=PATH",
        help="adapters served by name (a request picks one by `model`): name=path, or JSON "
             "'{\"name\": ..., \"path\": ..., \"base_model_name\": ...}'")
    add("--max-loras", type=int, default=1, help="distinct adapters in one step (their device slots)")
    add("--max-lora-rank", type=int, default=16, help="the largest adapter rank served (the slots' size)")
    add("--max-cpu-loras", type=int, default=None, help="adapters kept in host memory (default: --max-loras)")
    add("--allow-runtime-lora-updating", action="store_true",
        help="POST /v1/load_lora_adapter and /v1/unload_lora_adapter (also on with vLLM's environment "
             "variable VLLM_ALLOW_RUNTIME_LORA_UPDATING=True); paths under --allowed-lora-dir only")
    add("--allowed-lora-dir", action="append", default=[], metavar="DIR",
        help="a directory adapters may be loaded from at run time; repeatable")
    add("--enforce-eager", action="store_true",
        help="always run the eager forward: no captured decode step (NPU / CUDA: no decode graphs; on the "
             "CPU with the native kernels no captured plan; same tokens, more host time), i.e. cudagraph_mode NONE")
    add("-O", "--compilation-config", type=_compilation_config, metavar="JSON",
        help="decode graphs, vLLM's keys: '{\"cudagraph_mode\": \"FULL_DECODE_ONLY\" | \"NONE\", "
             "\"cudagraph_capture_sizes\": [1, 2, 4, 8], \"max_cudagraph_capture_size\": 8}' (docs/graph-mode.md); "
             "-O0: no graphs")
    add("--mm-wire-dtype", choices=WIRE_DTYPES, default=DEFAULT_WIRE_DTYPE,
        help="how images cross shared memory: uint8 = the resized image, normalised on the device (4x fewer "
             "bytes, 8x for Qwen2-VL); float32 = normalised pixel values, MindIE's form")
    add("--gpu-memory-utilization", type=float, default=0.9,
        help="NPU / CUDA: the share of device memory for weights, activations (profiled at start-up) and the "
             "KV cache, which gets what is left; on the CPU --kv-cache-memory sets the KV cache instead")
    add("--allowed-local-media-path", action="append", default=[], metavar="DIR",
        help="a directory images may be read from (file:// URLs and paths); repeatable")
    add("--allowed-media-domains", action="append", default=[], metavar="HOST",
        help="a host http(s) images may be fetched from (subdomains too); repeatable")
    limits = MediaLimits()  # the defaults, defined there once
    add("--max-image-bytes", type=_size, default=limits.max_image_bytes,
        help="encoded bytes per image (data: URLs too)")
    add("--max-image-pixels", type=int, default=limits.max_image_pixels, help="decoded pixels per image")
    add("--max-request-pixels", type=int, default=None,
        help="decoded pixels of all images in one request together, checked from each image's header before "
             "it is decoded (default: 4 x --max-image-pixels)")
    add("--max-video-bytes", type=_size, default=limits.max_video_bytes,
        help="encoded bytes per video (data: URLs too)")
    add("--max-video-seconds", type=float, default=limits.max_video_seconds,
        help="duration per video, read from the container before any frame is decoded")
    add("--max-video-frames", type=int, default=limits.max_video_frames,
        help=f"frames sampled from one video (Qwen's rule: {VIDEO_FPS:g} per second, {VIDEO_MIN_FRAMES} to "
             f"{VIDEO_MAX_FRAMES}, even); a request's "
             "mm_processor_kwargs may lower it; with --max-model-len it bounds the start-up memory profile's "
             "worst-case video")
    add("--max-video-frame-pixels", type=int, default=limits.max_video_frame_pixels,
        help="width x height of a video's frames, from its stream header (every kept frame is decoded at this "
             "size before its resize)")
    add("--max-video-decode-frames", type=int, default=limits.max_video_decode_frames,
        help="frames (packets) one video may make the server demux and decode, however few it samples: checked "
             "from the header (frame count, duration x frame rate) before reading, then counted while reading "
             "(a sampled frame costs every frame since its keyframe)")
    add("--max-audio-bytes", type=_size, default=limits.max_audio_bytes,
        help="encoded bytes per audio clip (base64 data too)")
    add("--max-audio-seconds", type=float, default=limits.max_audio_seconds,
        help="duration per audio clip (longer clips are cut into 30 s windows, one media block each)")
    add("--media-decode-timeout", type=float, default=limits.media_decode_timeout,
        help="wall-clock seconds to demux and decode one video or audio item (400 beyond); a media worker still "
             "busy past its request's budget is killed and replaced (504)")
    add("--media-workers", type=int, default=None,
        help="processes that decode video and audio, apart from the tokenizer workers, so a text request "
             "never waits behind a video (default: 1 for a model that takes video or audio, else 0)")
    add("--max-request-body-bytes", type=_size, default=64 << 20, help="HTTP request body limit (413 beyond)")
    add("--max-queued-requests", type=int, default=256, help="requests in flight before 429")
    add("--max-pooling-inputs", type=int, default=2048,
        help="inputs in one /v1/embeddings, /pooling or /classify request, pairs in one /score or /rerank "
             "(400 beyond; OpenAI's limit is 2048); they run a window at a time (docs/pooling.md)")
    add("--chat-template", help="a Jinja chat template (file or text) replacing the checkpoint's")
    add("--api-key", default=os.environ.get("ATB_PLUGIN_API_KEY"),
        help="require 'Authorization: Bearer KEY' on every route but /health (env ATB_PLUGIN_API_KEY)")
    add("--tokenizer-workers", type=int, default=default_tokenizer_workers(),
        help="processes that tokenize and preprocess images")
    add("--shm-budget-bytes", type=_size, help="cap on live shared-memory bytes for images (503 beyond)")
    add("--shutdown-timeout", type=float, default=30.0, help="seconds to finish in-flight requests on SIGTERM")
    add("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    add("--max-parallel-samples", type=int, default=16,
        help="the largest n (parallel samples of one prompt) a request may ask for")
    add("--enable-auto-tool-choice", action="store_true",
        help="let the model decide to call tools (tool_choice 'auto', the default with tools); needs "
             "--tool-call-parser")
    add("--tool-call-parser", choices=_tool_parsers(),
        help="how tool calls are read from the output: hermes (Qwen2 / Qwen2.5's <tool_call>{...}</tool_call>), "
             "llama3_json (Llama 3.1+ JSON calls)")
    add("--ssl-certfile", help="serve HTTPS with this certificate (PEM; the chain, server first)")
    add("--ssl-keyfile", help="the certificate's private key (PEM; omit if it is in --ssl-certfile); keep it mode 600")
    add("--ssl-keyfile-password-file", metavar="FILE", help="a file holding the key's password (plain text)")
    add("--ssl-ca-certs", action="append", default=[], metavar="FILE",
        help="CA certificates (PEM) that sign client certificates; repeatable")
    add("--ssl-cert-reqs", type=_cert_reqs, default="none",
        help="client certificates: none, optional, or required (mutual TLS); vLLM's 0 / 1 / 2 work too")
    add("--ssl-crl", action="append", default=[], metavar="FILE",
        help="certificate revocation lists (PEM) for client certificates; repeatable")
    add("--require-https", action="store_true",
        help="refuse to start without a certificate (what MindIE's httpsEnabled: true means)")
    add("--allow-insecure-http", action="store_true",
        help="with --require-https / httpsEnabled: true but no certificate, serve plain HTTP anyway (logged as "
             "an error; refused together with --api-key)")
    add("--request-timeout", type=float, metavar="SECONDS",
        help="abort a generate request running longer than this (MindIE's e2eTimeout; 504 / a stream error "
             "event); a request's own request_timeout may only lower it")
    add("--token-timeout", type=float, metavar="SECONDS",
        help="abort a generate request that waits longer than this for its first or next token (MindIE's "
             "tokenTimeout); a request's own token_timeout may only lower it")
    add("--reasoning-parser", choices=_reasoning_parsers(),
        help="split <think>...</think> into message.reasoning_content: deepseek_r1 (the opening tag may be in "
             "the prompt), qwen3 (only output that starts with <think>)")
    return p


def _cert_reqs(text: str) -> str:
    named = {"0": "none", "1": "optional", "2": "required"}.get(text, text.lower())
    if named not in CERT_REQS:
        raise argparse.ArgumentTypeError(f"{text!r}: expected none, optional or required (or 0, 1, 2)")
    return named


def _tool_parsers() -> list[str]:
    from atb_plugin.server.tool_parsers import TOOL_PARSERS

    return sorted(TOOL_PARSERS)


def _reasoning_parsers() -> list[str]:
    from atb_plugin.server.reasoning_parsers import REASONING_PARSERS

    return sorted(REASONING_PARSERS)


def _limit_value(limit) -> int | None:
    if limit is None or (isinstance(limit, _MmLimit) and limit.unset):
        return None
    return int(limit)  # a plain int crosses to the engine process


def _video_limit(parser, limit, engine) -> int | None:
    """``video=N`` of ``--limit-mm-per-prompt``: at most the model's own limit (0 for a model
    without video; ``interfaces.resolve_mm_limit``, the rule ``EngineConfig`` applies too), checked
    here so that a wrong flag is a usage error that stops the start, not a tokenizer worker."""
    videos = limit.videos if isinstance(limit, _MmLimit) else None
    if videos is None:
        return None
    from atb_plugin.models.interfaces import resolve_mm_limit
    from atb_plugin.models.registry import import_model_class

    try:
        if videos < 0:
            raise ValueError(f"--limit-mm-per-prompt video={videos}: must be an integer >= 0")
        return resolve_mm_limit(import_model_class(engine.model_cls_path), videos, "video")
    except ValueError as error:
        parser.error(str(error))


def _check_mm_modality(parser, limit, engine) -> None:
    """``audio=2`` for an image model (or the reverse) is a mistake, not a limit to apply."""
    kind = getattr(limit, "modality", None)
    if kind is None or not int(limit):
        return
    from atb_plugin.models.interfaces import model_modality
    from atb_plugin.models.registry import import_model_class

    takes = model_modality(import_model_class(engine.model_cls_path))
    if kind != takes:
        parser.error(f"--limit-mm-per-prompt {kind}={int(limit)}: this model takes {takes} input, not {kind}")


def parse_config(argv: list[str] | None = None) -> ServerConfig:
    parser = build_parser()
    args = parser.parse_args(argv)
    words = {arg.split("=", 1)[0] for arg in (argv if argv is not None else sys.argv[1:])}
    given = {a.dest for a in parser._actions if words & set(a.option_strings)}
    values = vars(args)
    if args.config:
        from atb_plugin.server.mindie_config import load_mindie_config

        mapping = load_mindie_config(args.config)
        renamed = {"kv_cache_bytes": "kv_cache_memory"}
        for key, value in mapping.flags.items():
            key = renamed.get(key, key)
            if key == "devices":
                continue  # carried by ASCEND_RT_VISIBLE_DEVICES (mapping.env)
            if key not in values and key not in ("max_input_tokens", "require_https"):
                logger.warning("--config %s: %s=%r has no equivalent here and is ignored", args.config, key, value)
            elif key not in given:
                values[key] = value
        for key, value in mapping.env.items():
            os.environ.setdefault(key, value)
        for ignored in mapping.ignored:
            logger.warning("--config %s: %s is ignored (%s)", args.config, ignored,
                           mapping.reasons.get(ignored, "not supported here"))
        for note in mapping.notes:
            logger.warning("--config %s: %s", args.config, note)
    if values["model"] is None:
        from atb_plugin.default_model import default_model_dir, embedding_model_dir

        pooling = values["runner"] == "pooling"
        values["model"] = str(embedding_model_dir() if pooling else default_model_dir())
        if values["served_model_name"] is None and pooling:
            # The package keeps the model in a directory named "model": name it as the hub does.
            from atb_plugin.default_model import EMBEDDING_MODEL_NAME

            values["served_model_name"] = EMBEDDING_MODEL_NAME
    # Every other limit is a flag of its own name (--max-image-bytes ...); the video count comes
    # with the model (_video_limit, below).
    media = MediaLimits(limit_mm_per_prompt=_limit_value(values["limit_mm_per_prompt"]),
                        **{name: values[name] for name in LIMIT_FIELDS
                           if name not in ("limit_mm_per_prompt", "limit_videos_per_prompt")})
    engine = EngineConfig(model=values["model"], dtype=values["dtype"], device=values["device"],
                          quantization=values["quantization"], quantize_lm_head=values["quantize_lm_head"],
                          max_model_len=values["max_model_len"], block_size=values["block_size"],
                          kv_cache_bytes=values["kv_cache_memory"], max_num_seqs=values["max_num_seqs"],
                          max_num_batched_tokens=values["max_num_batched_tokens"],
                          enable_prefix_caching=values["enable_prefix_caching"],
                          gpu_memory_utilization=values["gpu_memory_utilization"],
                          media=media,
                          mm_wire_dtype=values["mm_wire_dtype"],
                          num_threads=values["num_threads"], enforce_eager=values["enforce_eager"],
                          tensor_parallel_size=values["tensor_parallel_size"],
                          enable_expert_parallel=values["enable_expert_parallel"],
                          distributed_executor_backend=values["distributed_executor_backend"],
                          data_parallel_size=values["data_parallel_size"], runner=values["runner"],
                          convert=values["convert"], hf_overrides=values["hf_overrides"],
                          speculative_config=values["speculative_config"],
                          compilation_config=values["compilation_config"], enable_lora=values["enable_lora"],
                          max_loras=values["max_loras"], max_lora_rank=values["max_lora_rank"],
                          max_cpu_loras=values["max_cpu_loras"],
                          kv_transfer_config=values["kv_transfer_config"],
                          kv_offloading_size=values["kv_offloading_size"])
    _check_mm_modality(parser, values["limit_mm_per_prompt"], engine)
    changes = {}  # applied in one replace: each one validates the whole config again
    videos = _video_limit(parser, values["limit_mm_per_prompt"], engine)
    if videos is not None:  # the engine's start-up memory profile runs this many worst-case videos
        media = dataclasses.replace(media, limit_videos_per_prompt=videos)
        changes["limit_videos_per_prompt"] = videos
    if values["num_threads"] is None and engine.limit_mm_per_prompt > 0:
        # Images keep the tokenizer workers busy: leave them their cores. An OpenMP pool sharing
        # a core with a busy process stalls at every barrier (docs/architecture.md "Threads";
        # benchmarks/RESULTS.md, bench_engine first round, the --busy-frontend table).
        workers = values["tokenizer_workers"] or default_tokenizer_workers()
        changes["num_threads"] = max(1, (available_cores() - workers) // engine.data_parallel_size)
    if changes:
        engine = engine.replace(**changes)
    return ServerConfig(
        engine=engine, served_model_name=values["served_model_name"], host=values["host"], port=values["port"],
        api_key=values["api_key"], tokenizer_workers=values["tokenizer_workers"], media_workers=values["media_workers"],
        data_parallel_routing=values["data_parallel_routing"],
        max_queued_requests=values["max_queued_requests"], max_pooling_inputs=values["max_pooling_inputs"],
        allowed_local_media_paths=tuple(values["allowed_local_media_path"]),
        allowed_media_domains=tuple(values["allowed_media_domains"]), media=media,
        max_request_body_bytes=values["max_request_body_bytes"],
        max_input_tokens=values.get("max_input_tokens"), chat_template=values["chat_template"],
        shm_budget_bytes=values["shm_budget_bytes"], shutdown_timeout=values["shutdown_timeout"],
        log_level=values["log_level"], max_parallel_samples=values["max_parallel_samples"],
        enable_auto_tool_choice=values["enable_auto_tool_choice"], tool_call_parser=values["tool_call_parser"],
        reasoning_parser=values["reasoning_parser"], request_timeout=values["request_timeout"],
        token_timeout=values["token_timeout"], lora_modules=tuple(values["lora_modules"]),
        allow_runtime_lora_updating=runtime_lora_updating(values["allow_runtime_lora_updating"]),
        allowed_lora_dirs=tuple(values["allowed_lora_dir"]),
        tls=TLSSettings(certfile=values["ssl_certfile"], keyfile=values["ssl_keyfile"],
                        keyfile_password_file=values["ssl_keyfile_password_file"],
                        ca_certs=tuple(values["ssl_ca_certs"]), cert_reqs=values["ssl_cert_reqs"],
                        crl=tuple(values["ssl_crl"]), https_required=values["require_https"],
                        allow_insecure_http=values["allow_insecure_http"]))


def check_listen_address(host: str, port: int) -> None:
    """Bind ``host``:``port`` as uvicorn will (and let go at once), before the model loads: a
    port in use is a start-up error in a second, not once the whole model has loaded (vLLM binds
    its socket before starting the engine too). ``ValueError`` naming the flags."""
    try:
        addresses = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as error:
        raise ValueError(f"--host {host}: not an address this machine can listen on ({error.strerror})") from None
    unavailable = []
    for family, kind, proto, _, address in addresses:
        with socket.socket(family, kind, proto) as sock:
            # The options asyncio's create_server (uvicorn's) sets: a port left in TIME_WAIT is
            # no conflict, and an IPv6 address does not claim the IPv4 one too.
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            try:
                sock.bind(address)
            except OSError as error:
                if error.errno == errno.EADDRINUSE:
                    raise ValueError(f"--port {port}: {host}:{port}: address already in use (another server "
                                     "listens there); stop it or choose another --port") from None
                if error.errno != errno.EADDRNOTAVAIL:
                    raise ValueError(f"--host {host} --port {port}: cannot listen there ({error.strerror})") from None
                unavailable.append(error)  # asyncio skips an address family the host lacks; so do we
    if unavailable and len(unavailable) == len(addresses):
        raise ValueError(f"--host {host}: no interface of this machine has that address "
                         f"({unavailable[0].strerror})")


def _graceful_server_class():
    import uvicorn

    class GracefulServer(uvicorn.Server):
        """uvicorn re-raises SIGTERM/SIGINT after a graceful shutdown, so the process would die
        "by signal"; a drained, clean stop is a success for a supervisor: exit 0 instead."""

        @contextlib.contextmanager
        def capture_signals(self):
            if threading.current_thread() is not threading.main_thread():
                yield
                return
            handled = (signal.SIGINT, signal.SIGTERM)
            original = {sig: signal.signal(sig, self.handle_exit) for sig in handled}
            try:
                yield
            finally:
                for sig, handler in original.items():
                    signal.signal(sig, handler)

    return GracefulServer


def serve(config: ServerConfig) -> int:
    """Run until SIGTERM/SIGINT (exit 0 after draining) or the engine core dies (exit 1)."""
    import uvicorn

    from atb_plugin.server.api_server import create_app, log_shm_capacity
    from atb_plugin.server.tls import server_ssl_context
    from atb_plugin.utils import keep_request_buffers_in_heap

    keep_request_buffers_in_heap()  # request bodies of megabytes: no fresh pages per copy
    logger.info("atb-plugin server configuration:\n%s", config.describe())
    log_shm_capacity(config)
    app = create_app(config)
    # httptools, not h11: the C parser reads a multi-megabyte image body faster (benchmarks/RESULTS.md,
    # P5 "Fifth round"); an install requirement, so asked for by name: a missing one is an error,
    # not a slow server
    tls = config.tls
    if tls.https_required and not tls.enabled:  # check_tls let it through: --allow-insecure-http
        logger.error("HTTPS was asked for (httpsEnabled / --require-https) but this server has no certificate: "
                     "serving PLAIN HTTP because of --allow-insecure-http; everything on the wire is readable")
    context = server_ssl_context(tls) if tls.enabled else None
    uv_config = uvicorn.Config(app, host=config.host, port=config.port, log_level=config.log_level,
                               timeout_graceful_shutdown=config.shutdown_timeout, access_log=False,
                               http="httptools",
                               ssl_context_factory=None if context is None else lambda _config, _default: context)
    if context is not None:
        logger.info("serving HTTPS (client certificates: %s)", tls.cert_reqs)
    server = _graceful_server_class()(uv_config)
    app.state.service.uvicorn_server = server
    asyncio.run(server.serve())
    service = app.state.service
    if not service.started and service.exit_code == 0:
        return 1  # start-up failed (the log says why)
    return service.exit_code


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "proxy":  # the PD proxy (docs/kv-transfer.md)
        # Imported here, as serve() imports the app: parsing a config (tests, the launch
        # script) needs neither uvicorn nor fastapi.
        from atb_plugin.server import proxy

        return proxy.main(argv[1:])
    if argv and argv[0] == "serve":
        argv = argv[1:]
    level = next((argv[i + 1] for i, a in enumerate(argv[:-1]) if a == "--log-level"), "info")
    logging.basicConfig(level=getattr(logging, level.upper(), logging.INFO),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        config = parse_config(argv)
        check_listen_address(config.host, config.port)  # before create_app starts loading the model
    except (ValueError, RuntimeError) as error:  # bad flags, or a platform that cannot run them
        print(f"atb-plugin serve: {error}", file=sys.stderr)
        return 2
    return serve(config)


if __name__ == "__main__":
    sys.exit(main())
