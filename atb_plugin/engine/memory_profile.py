"""Memory profiling at start-up (vLLM's "dummy inputs for memory profiling") and the KV budget.

The engine core's (``Worker._blocks_for_budget``, per rank), for text and multimodal models alike; what a
multimodal family declares for it (its limit, its largest item) is
``atb_plugin.models.interfaces.MultimodalProcessingInfo``, and a family that takes video
(``SupportsVideo``) its largest video too.

Before the KV cache exists, the engine core runs the most memory-hungry step it will ever run, on
inputs made here, and measures what it takes; the KV cache gets what is left::

    worst-case prompt   min(the model's limit, limit_mm_per_prompt) images, each of the size that
                        gives the most feature tokens (the model's MultimodalProcessingInfo), then
                        min(the model's limit, limit_videos_per_prompt) videos, each the one with
                        the most feature tokens that Qwen's sampling budgets (VIDEO_MAX_PIXELS a
                        frame, VIDEO_TOTAL_PIXELS all frames) give from at most max_video_frames
                        frames within max_model_len, and no more videos than fit in max_model_len
                        together (get_video_processing_info); pixel tensors made here in the
                        encoder's layout, in the wire dtype (uint8 images [H, W, 3] and frames
                        [t, 3, H, W], or float32 values; no preprocessing, no shared memory)
    encoder             encode_pixels per image, then per video, as the model runner calls it,
                        every item's rows kept (the runner keeps them until the prefill ends)
    language model      one forward over min(max_num_batched_tokens, max_model_len) tokens (the
                        most one step runs) with the image and video rows merged, through a
                        temporary KV cache just large enough, then logits for min(max_num_seqs,
                        tokens) rows

    KV budget   kv_cache_bytes (--kv-cache-memory) when given: an explicit budget wins everywhere
                NPU / CUDA: gpu_memory_utilization x total device memory
                            - (peak memory in use during the profile - the temporary KV cache)
                            - the decode graphs' pool (graph_pool_bytes: one decode forward at the
                              largest capture size; the graphs are captured after the KV cache)
                CPU (and the simulated NPU): DEFAULT_KV_CACHE_BYTES (1 GiB); the profile still
                            runs for multimodal models, so its numbers are in the start-up log

The peak includes the weights (loaded before): it is all the process holds at its worst moment
except the KV cache. Device platforms read torch's allocator, the CPU the process's resident
memory (VmHWM, reset first: a lower bound where the allocator reuses pages it freed earlier,
which is fine, the CPU numbers are only logged). Not counted: several requests' image rows held at once (each request
keeps its own from its first step to the end of its prefill), and device memory outside torch's
allocator (runtime workspaces, other processes): ``gpu_memory_utilization`` leaves room for those.
Counted more than one prompt can hold: the images' rows (not bounded by max_model_len) stay held
while the videos are encoded, which errs on the safe side and runs every encoder the model has
(docs/architecture.md, "Memory profiling and KV sizing").
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch

from atb_plugin.models.interfaces import (
    GridTHW,
    MultimodalProcessingInfo,
    SupportsMedia,
    SupportsMRoPE,
    SupportsVideo,
)
from atb_plugin.multimodal.prompt import encode_pixels
from atb_plugin.ops import AttentionMetadata
from atb_plugin.utils import cdiv

logger = logging.getLogger(__name__)

MiB = 1 << 20
# The KV budget where no device memory can be profiled (the CPU) and none was given.
DEFAULT_KV_CACHE_BYTES = 1 << 30


# ------------------------------------------------------------------------------------------------
# dummy inputs


@dataclass(frozen=True)
class DummyItem:
    """The worst-case item as the model runner reads it: pixels as the block's shm segment holds
    them in the configured wire dtype (a uint8 image or video frames, or float32 pixel values), on
    the model's device (where the runner moves them before ``encoder_input``)."""

    pixel_values: torch.Tensor
    grid_thw: GridTHW | None
    num_tokens: int  # its block length = the encoder's feature rows


@dataclass(frozen=True)
class DummyInputs:
    """The worst-case prompt: ``num_items`` copies of ``item`` (the model's own modality: images,
    or audio clips; None for a text-only model), ``num_videos`` copies of ``video`` (None where
    the model takes none or the limit is 0) and the ids of the language model's forward: the
    first ``min(num_tokens, feature_tokens)`` of them image placeholders, video placeholders
    after them as far as the forward reaches."""

    item: DummyItem | None
    num_items: int
    input_ids: torch.Tensor
    video: DummyItem | None = None
    num_videos: int = 0
    video_frames: int = 0  # frames of each video (the uint8 wire form's first dim)
    video_frame_size: tuple[int, int] | None = None  # (height, width) in pixels

    @property
    def feature_tokens(self) -> int:
        """The images' (or audio clips') feature tokens."""
        return self.num_items * self.item.num_tokens if self.item is not None else 0

    @property
    def video_tokens(self) -> int:
        """The videos' feature tokens, all of them together."""
        return self.num_videos * self.video.num_tokens if self.video is not None else 0

    @property
    def num_tokens(self) -> int:
        return self.input_ids.shape[0]


def dummy_inputs(model, config) -> DummyInputs:
    """The worst-case prompt of ``config`` (an ``EngineConfig``) for ``model``: the model's largest
    item, ``min(model's limit, config.media.limit_mm_per_prompt)`` times, then its largest video
    (``_dummy_video``), built directly as tensors (no preprocessing, no shared memory), and a
    forward of ``min(max_num_batched_tokens, max_model_len)`` tokens: the scheduler never runs more
    in one step (a prefill longer than the budget runs in chunks, cutting media blocks anywhere),
    as vLLM's profile run does."""
    weight = next(model.parameters())
    num_tokens = min(config.max_num_batched_tokens, config.max_model_len)
    input_ids = torch.zeros(num_tokens, dtype=torch.long, device=weight.device)  # 0: any text token
    if not isinstance(model, SupportsMedia):
        return DummyInputs(None, 0, input_ids)
    item, num_items = None, 0
    if config.media.limit_mm_per_prompt > 0:
        info = model.get_processing_info(config.model)
        item = DummyItem(_zero_pixels(info, config.mm_wire_dtype, weight.device), info.grid_thw,
                         info.max_tokens_per_item)
        num_items = min(config.media.limit_mm_per_prompt, info.max_items_per_prompt)
        input_ids[:min(num_tokens, num_items * item.num_tokens)] = model.media_layout.placeholder_id
    inputs = DummyInputs(item, num_items, input_ids)
    video, num_videos, info = _dummy_video(model, config, weight.device)
    if video is not None:
        start = min(num_tokens, inputs.feature_tokens)
        video_id = next(layout.placeholder_id for layout in model.media_layouts if layout.modality == "video")
        input_ids[start:min(num_tokens, start + num_videos * video.num_tokens)] = video_id
        inputs = DummyInputs(item, num_items, input_ids, video, num_videos, info.frames, info.max_item_size)
    return inputs


def _dummy_video(model, config, device) -> tuple[DummyItem | None, int, MultimodalProcessingInfo | None]:
    """``(the worst-case video, how many, its info)`` of ``config``, or ``(None, 0, None)``. Its
    feature tokens are bounded by ``max_model_len`` (no prompt holds more; it also keeps a tiny
    test engine's video tiny) and its frames by ``max_video_frames``; as many copies as the limit
    allows and fit in ``max_model_len`` together, at least one, so that the video encoder runs."""
    limit = config.media.limit_videos_per_prompt
    if not limit or not isinstance(model, SupportsVideo):
        return None, 0, None
    info = model.get_video_processing_info(config.model, config.max_model_len, config.media.max_video_frames)
    if info is None:  # not one temporal patch of the smallest frame fits max_model_len: no video can
        logger.info("memory profile: no video fits max_model_len %d; profiling without one", config.max_model_len)
        return None, 0, None
    count = min(limit, info.max_items_per_prompt, max(1, config.max_model_len // info.max_tokens_per_item))
    video = DummyItem(_zero_pixels(info, config.mm_wire_dtype, device), info.grid_thw, info.max_tokens_per_item)
    return video, count, info


def _zero_pixels(info: MultimodalProcessingInfo, wire_dtype: str, device) -> torch.Tensor:
    """``info``'s largest item as the wire carries it, in zeros (the values do not change the memory
    a step takes, and zeros are cheap to make): uint8 images ``[H, W, 3]`` and video frames
    ``[frames, 3, H, W]`` as the builders write them (patchified on the device); float32 pixels
    otherwise (audio crosses as float32 features only)."""
    if wire_dtype == "uint8" and info.modality == "image":
        return torch.zeros((*info.max_item_size, 3), dtype=torch.uint8, device=device)
    if wire_dtype == "uint8" and info.modality == "video":
        return torch.zeros((info.frames, 3, *info.max_item_size), dtype=torch.uint8, device=device)
    return torch.zeros(info.pixel_shape, dtype=torch.float32, device=device)


def _prefill_metadata(num_tokens: int, block_size: int, device) -> AttentionMetadata:
    """One request prefilling ``num_tokens`` from an empty cache whose blocks are 1, 2, ... (block 0
    is the null block, as in the real cache)."""
    num_blocks = cdiv(num_tokens, block_size)
    query_start_loc = torch.tensor([0, num_tokens], dtype=torch.int32)
    seq_lens = torch.tensor([num_tokens], dtype=torch.int32)
    return AttentionMetadata(
        query_start_loc=query_start_loc.to(device),
        seq_lens=seq_lens.to(device),
        block_tables=torch.arange(1, num_blocks + 1, dtype=torch.int32).view(1, -1).to(device),
        slot_mapping=torch.arange(block_size, block_size + num_tokens, dtype=torch.int64).to(device),
        max_query_len=num_tokens,
        max_seq_len=num_tokens,
        query_start_loc_cpu=query_start_loc,
        seq_lens_cpu=seq_lens,
    )


def _kv_bytes(kv_caches) -> int:
    return sum(t.numel() * t.element_size() for layer in kv_caches for t in layer)


def kv_bytes_per_block(model, block_size: int) -> int:
    """Bytes one KV block of ``block_size`` tokens takes over all layers. The layout is the
    model's (``make_kv_caches``: keys and values per KV head for the GQA decoder, one latent row
    per token for DeepSeek's MLA, ``ops/mla.py``), so the budget follows whatever it keeps."""
    return _kv_bytes(model.make_kv_caches(1, block_size))


# ------------------------------------------------------------------------------------------------
# the profile


@dataclass(frozen=True)
class MemoryProfile:
    """What the worst-case step took. ``peak_bytes``: the most memory in use during it, the
    temporary KV cache left out (weights included); ``baseline_bytes``: in use before it."""

    num_items: int
    feature_tokens: int
    num_tokens: int  # the language model's forward
    baseline_bytes: int
    peak_bytes: int
    seconds: float
    # The worst-case videos: how many, their feature tokens together, each one's frames,
    # frame size (height, width) and patch grid.
    num_videos: int = 0
    video_tokens: int = 0
    video_frames: int = 0
    video_frame_size: tuple[int, int] | None = None
    video_grid_thw: GridTHW | None = None

    @property
    def activation_bytes(self) -> int:
        """What the step adds on top of what was resident before (weights)."""
        return max(0, self.peak_bytes - self.baseline_bytes)

    def describe(self) -> str:
        videos = ""
        if self.num_videos:
            height, width = self.video_frame_size
            videos = (f", {self.num_videos} video(s) of {self.video_frames} frames {width}x{height} (grid_thw "
                      f"{tuple(self.video_grid_thw)}) = {self.video_tokens} feature tokens")
        return (f"{self.num_items} image(s) = {self.feature_tokens} feature tokens{videos}, LM forward over "
                f"{self.num_tokens} tokens: peak {self.peak_bytes / MiB:.1f} MiB in use "
                f"({self.baseline_bytes / MiB:.1f} MiB before, +{self.activation_bytes / MiB:.1f} MiB), "
                f"{self.seconds * 1000:.0f} ms")


def _encode_all(model, item: DummyItem, count: int, features: list[torch.Tensor]) -> None:
    """Append the rows of ``count`` copies of ``item`` to ``features`` (the rows already held), as
    ``MultimodalPrompt.features`` leaves them: encoded one by one, all kept. The copies are
    identical, so the peak is the last one's encoding while the others' rows are held: encode once
    (for the rows' size), hold copies, encode once more. Two encoder runs measure what ``count``
    runs would (16 images would cost 16)."""
    first = encode_pixels(model, item.pixel_values, item.grid_thw)
    features.append(first)
    features += [first.clone() for _ in range(count - 2)]
    if count > 1:
        features.append(encode_pixels(model, item.pixel_values, item.grid_thw))


@torch.no_grad()
def profile_run(model, config, platform) -> MemoryProfile:
    """Run the worst-case step of ``config`` (an ``EngineConfig``) on ``model`` and measure it with
    ``platform``'s memory stats (``reset_peak_memory``, ``memory_in_use``, ``peak_memory``)."""
    started = time.perf_counter()
    platform.reset_peak_memory()
    baseline = platform.memory_in_use()
    inputs = dummy_inputs(model, config)
    device, num_tokens = inputs.input_ids.device, inputs.num_tokens
    # Made first, so it is in use at the peak wherever that falls, and left out of it exactly.
    kv_caches = model.make_kv_caches(1 + cdiv(num_tokens, config.block_size), config.block_size)
    features: list[torch.Tensor] = []
    if inputs.item is not None:
        _encode_all(model, inputs.item, inputs.num_items, features)
    if inputs.video is not None:  # after the images, whose rows stay held (module docstring)
        _encode_all(model, inputs.video, inputs.num_videos, features)
    inputs_embeds = None
    if features:
        inputs_embeds = model.get_input_embeddings(inputs.input_ids)
        # The rows that fall in the step, merged as MultimodalPrompt.embed merges them.
        merged = torch.cat(features)[:num_tokens]
        inputs_embeds[:merged.shape[0]] = merged.to(inputs_embeds.dtype)
        del merged
    if isinstance(model, SupportsMRoPE):
        # The values do not change memory; the shape is the model's: (3, T).
        positions = model.decode_positions(0, num_tokens, 0).to(device)
    else:
        positions = torch.arange(num_tokens, device=device)
    hidden = model(inputs.input_ids, positions, kv_caches, _prefill_metadata(num_tokens, config.block_size, device),
                   inputs_embeds=inputs_embeds)
    if config.runner != "pooling":  # the sampler's logits: at most one row per request in a step
        model.compute_logits(hidden[-min(config.max_num_seqs, num_tokens):])
    peak = platform.peak_memory() - _kv_bytes(kv_caches)  # the temporary KV cache is not activation memory
    video = inputs.video
    return MemoryProfile(num_items=inputs.num_items, feature_tokens=inputs.feature_tokens, num_tokens=num_tokens,
                         baseline_bytes=baseline, peak_bytes=max(peak, baseline),
                         seconds=time.perf_counter() - started, num_videos=inputs.num_videos,
                         video_tokens=inputs.video_tokens, video_frames=inputs.video_frames,
                         video_frame_size=inputs.video_frame_size,
                         video_grid_thw=video.grid_thw if video is not None else None)


def graph_pool_bytes(model, config, platform) -> int:
    """What the decode graphs will hold (engine/graph_runner.py), measured before the KV cache
    exists: the graphs share one memory pool, which the largest capture size fills, so one eager
    decode forward at that size, its activations' peak above what was in use before. 0 where no
    device graphs are captured."""
    compilation = config.compilation_config
    if not compilation.captures or platform.device_graphs() is None or config.runner == "pooling":
        return 0
    size, q = compilation.max_cudagraph_capture_size, compilation.uniform_decode_len
    requests, device = size // q, next(model.parameters()).device
    kv_caches = model.make_kv_caches(1 + cdiv(size, config.block_size), config.block_size)
    platform.reset_peak_memory()
    baseline = platform.memory_in_use()
    starts = torch.arange(0, size + 1, q, dtype=torch.int32)
    seq_lens = torch.full((requests,), q, dtype=torch.int32)
    metadata = AttentionMetadata(
        query_start_loc=starts.to(device), seq_lens=seq_lens.to(device),
        block_tables=torch.zeros(requests, 1, dtype=torch.int32, device=device),
        slot_mapping=torch.arange(config.block_size, config.block_size + size, dtype=torch.int64, device=device),
        max_query_len=q, max_seq_len=q, query_start_loc_cpu=starts, seq_lens_cpu=seq_lens)
    ids = torch.zeros(size, dtype=torch.int64, device=device)
    positions = (model.decode_positions(0, size, 0).to(device) if isinstance(model, SupportsMRoPE)
                 else torch.zeros(size, dtype=torch.int64, device=device))
    model(ids, positions, kv_caches, metadata)
    return max(0, platform.peak_memory() - baseline)


# ------------------------------------------------------------------------------------------------
# the KV budget


def weight_bytes(model) -> int:
    """Bytes of the model's parameters and buffers (what loading it put in memory)."""
    tensors = [*model.parameters(), *model.buffers()]
    return sum(t.numel() * t.element_size() for t in tensors)


@dataclass(frozen=True)
class KVBudget:
    """Bytes the KV cache may take; ``flag``: the setting that raises them; ``profile``: the
    start-up profile (None where none ran); ``total_memory``: the device's, None on the CPU."""

    bytes: int
    flag: str
    weight_bytes: int
    profile: MemoryProfile | None = None
    total_memory: int | None = None
    utilization: float = 1.0
    graph_bytes: int = 0  # the decode graphs' pool (graph_pool_bytes), held beside the KV cache

    def describe(self) -> str:
        """How the budget was reached, for the start-up log and errors."""
        if self.total_memory is None:
            return f"{self.bytes / MiB:.1f} MiB set by {self.flag}"
        graphs = f" - {self.graph_bytes / MiB:.1f} MiB decode graphs" if self.graph_bytes else ""
        return (f"{self.utilization:g} x {self.total_memory / MiB:.0f} MiB device memory - "
                f"{self.profile.peak_bytes / MiB:.1f} MiB profiled peak{graphs} = {self.bytes / MiB:.1f} MiB")


def kv_cache_budget(model, config, platform) -> KVBudget:
    """The KV budget of ``config`` (an ``EngineConfig``) on ``platform`` (module docstring). A
    text-only model on a platform without device memory is not profiled: its budget is explicit
    there, and the profile would only add start-up time, which every test starting an engine pays
    (benchmarks/RESULTS.md, "Figures formerly in code comments")."""
    total = platform.total_memory()
    weights = weight_bytes(model)
    profile = None
    if (total is not None and config.kv_cache_bytes is None) or isinstance(model, SupportsMedia):
        profile = profile_run(model, config, platform)
        logger.info("memory profile (weights %.1f MiB): %s", weights / MiB, profile.describe())
    if total is None or config.kv_cache_bytes is not None:
        explicit = config.kv_cache_bytes if config.kv_cache_bytes is not None else DEFAULT_KV_CACHE_BYTES
        return KVBudget(explicit, "--kv-cache-memory (LLM: kv_cache_bytes)", weights, profile)
    graphs = graph_pool_bytes(model, config, platform)
    budget = int(config.gpu_memory_utilization * total) - profile.peak_bytes - graphs
    return KVBudget(max(0, budget), "--gpu-memory-utilization", weights, profile, total,
                    config.gpu_memory_utilization, graphs)
