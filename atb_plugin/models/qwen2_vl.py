"""Qwen2-VL and Qwen2.5-VL: a ViT over 14x14 patches with 2-D rotary positions, a patch merger
that turns each 2x2 group of patches into one LLM token, and the shared Qwen2 decoder with
M-RoPE (positions ``(3, T)``: temporal, height, width).

Vision tower, per image of ``grid_thw = (t, h, w)`` patches (``t·h·w`` rows of ``C·2·14·14`` values,
rows merge-window-major as the input builder / transformers' processor write them)::

    patch embed   Conv3d with kernel = stride = the whole patch, i.e. one matmul over 1176 values
    blocks        x += attn(norm1(x)); x += mlp(norm2(x))
                  Qwen2-VL:   LayerNorm, fc1 -> quick_gelu -> fc2, every block attends over its frame
                  Qwen2.5-VL: RMSNorm, SwiGLU (gate/up/down, with biases), blocks in
                              ``fullatt_block_indexes`` attend over the frame, the others within
                              windows of ``window_size`` pixels (patches reordered window by window
                              before the blocks; the merged tokens put back in raster order after)
    merger        norm -> view(-1, d·merge²) -> Linear -> GELU -> Linear  (LayerNorm / RMSNorm)

Attention in the tower is ``ops.varlen_attention`` with ``cu_seqlens`` (one segment per frame, or
per window); rotary is the axial 2-D one: the first half of each head's frequencies turn with the
patch row, the second half with the column.

M-RoPE positions (``get_mrope_positions``, transformers' ``get_rope_index``): text tokens count on
in all three rows; an image's ``t x (h/2) x (w/2)`` tokens take ``(start + t_i, start + row,
start + col)``; the text after it resumes at ``start + max(h, w) / 2``. Decoding continues with
``position + rope_delta`` in all three rows (``decode_positions``).

The model is a ``base.MultimodalModel``: the tower is ``visual.*``, the Qwen2 decoder
``language_model.*`` (a ``decoder.DecoderForCausalLM``). Checkpoint names: the published ones
(``model.layers.*``, ``visual.*``, ``lm_head.weight``) and transformers 5's
(``model.language_model.*``, ``model.visual.*``). Fused on load, as in the decoder: ``qkv_proj``
(LM) and, for Qwen2.5-VL's tower, ``mlp.gate_up_proj``.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType

import torch
import torch.nn.functional as F
from torch import nn

from atb_plugin import ops
from atb_plugin.models.base import MultimodalModel
from atb_plugin.models.decoder import DecoderConfig, DecoderModel, RMSNorm, build_language_model
from atb_plugin.models.interfaces import MultimodalProcessingInfo
from atb_plugin.models.weights import IGNORE, STACKED_QKV_GATE_UP
from atb_plugin.multimodal import MediaLayout
from atb_plugin.multimodal.budgets import (
    IMAGE_MAX_PIXELS,
    MAX_ASPECT_RATIO,
    VIDEO_MAX_PIXELS,
    VIDEO_MIN_PIXELS,
    VIDEO_TOTAL_PIXELS,
)
from atb_plugin.multimodal.pixels import Qwen2VLPatchFormat
from atb_plugin.multimodal.wire import QWEN2_VL_BLOCK, QWEN2_VL_VIDEO_BLOCK
from atb_plugin.utils import cdiv

GridTHW = tuple[int, int, int]

# Qwen2-VL's image and video budgets, the one definition the input builders resize and sample by
# (input_builders.preprocess, input_builders.video): the start-up memory profile's largest image
# and video follow them (get_processing_info, get_video_processing_info; docs/architecture.md,
# "Memory profiling and KV sizing").
DEFAULT_MAX_PIXELS = IMAGE_MAX_PIXELS  # when preprocessor_config.json says nothing

_ACTIVATIONS = {
    "quick_gelu": lambda x: x * torch.sigmoid(1.702 * x),
    "gelu": F.gelu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "silu": F.silu,
    "swish": F.silu,
}


def _activation(name: str):
    if name not in _ACTIVATIONS:
        raise ValueError(f"vision hidden_act {name!r} is not supported ({', '.join(_ACTIVATIONS)})")
    return _ACTIVATIONS[name]


# ------------------------------------------------------------------------------------------------
# configuration


@dataclass(frozen=True)
class VisionConfig:
    window_attention: bool  # Qwen2.5-VL's tower (RMSNorm, SwiGLU, windows); else Qwen2-VL's
    depth: int
    hidden_size: int  # the tower's width (Qwen2-VL calls it embed_dim)
    num_heads: int
    intermediate_size: int
    out_hidden_size: int  # the merger's output = the LM's hidden size
    hidden_act: str
    patch_size: int = 14
    temporal_patch_size: int = 2
    in_channels: int = 3
    spatial_merge_size: int = 2
    window_size: int = 0  # pixels; Qwen2.5-VL only
    fullatt_block_indexes: tuple[int, ...] = ()
    rope_theta: float = 10000.0
    # Qwen2.5-VL: M-RoPE time positions per second of video (a video block's temporal patch is
    # tokens_per_second x second_per_grid_t positions apart). None: Qwen2-VL (one position per patch).
    tokens_per_second: int | None = None
    patch_bias: bool = False  # the patch embedding's bias (Qwen3-VL has one)

    def __post_init__(self):
        if self.hidden_size % self.num_heads or (self.hidden_size // self.num_heads) % 4:
            raise ValueError(f"vision hidden_size {self.hidden_size} / num_heads {self.num_heads} must be a "
                             "head size divisible by 4 (2-D rotary)")
        if self.window_attention and self.window_size // self.spatial_merge_size // self.patch_size < 1:
            raise ValueError(f"window_size {self.window_size} is smaller than one merged token "
                             f"({self.spatial_merge_size * self.patch_size} pixels)")
        _activation(self.hidden_act)

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def patch_dim(self) -> int:
        return self.in_channels * self.temporal_patch_size * self.patch_size**2

    @classmethod
    def from_hf(cls, vision: dict, *, qwen2_5: bool) -> "VisionConfig":
        """From config.json's ``vision_config`` (published keys, or transformers 5's)."""
        rope = vision.get("rope_parameters") or {}
        common = dict(
            depth=vision["depth"],
            num_heads=vision["num_heads"],
            patch_size=vision.get("patch_size", vision.get("spatial_patch_size", 14)),
            temporal_patch_size=vision.get("temporal_patch_size", 2),
            in_channels=vision.get("in_channels", vision.get("in_chans", 3)),
            spatial_merge_size=vision.get("spatial_merge_size", 2),
            rope_theta=float(rope.get("rope_theta", 10000.0)),
        )
        if qwen2_5:
            return cls(window_attention=True, hidden_size=vision["hidden_size"],
                       intermediate_size=vision["intermediate_size"], out_hidden_size=vision["out_hidden_size"],
                       hidden_act=vision.get("hidden_act", "silu"), window_size=vision.get("window_size", 112),
                       fullatt_block_indexes=tuple(vision.get("fullatt_block_indexes", (7, 15, 23, 31))),
                       tokens_per_second=vision.get("tokens_per_second", 4), **common)
        width = vision["embed_dim"]
        return cls(window_attention=False, hidden_size=width, intermediate_size=int(width * vision.get("mlp_ratio", 4)),
                   out_hidden_size=vision["hidden_size"], hidden_act=vision.get("hidden_act", "quick_gelu"), **common)


@dataclass(frozen=True)
class Qwen2VLConfig:
    text: DecoderConfig
    vision: VisionConfig
    image_token_id: int
    video_token_id: int | None = None
    vision_start_token_id: int | None = None
    vision_end_token_id: int | None = None

    def __post_init__(self):
        if self.vision.out_hidden_size != self.text.hidden_size:
            raise ValueError(f"the vision merger outputs {self.vision.out_hidden_size} features, the language "
                             f"model's hidden size is {self.text.hidden_size}")
        if self.text.mrope_section is None:
            raise ValueError("Qwen2-VL needs rope_scaling.mrope_section (M-RoPE) in config.json")


# ------------------------------------------------------------------------------------------------
# vision tower


def vision_position_ids(grid_thws: Sequence[GridTHW], merge: int) -> torch.Tensor:
    """``(patches, 2)`` (row, col) of every patch, rows in merge-window-major order."""
    out = []
    for t, h, w in grid_thws:
        rows = torch.arange(h).view(h, 1).expand(h, w)
        cols = torch.arange(w).view(1, w).expand(h, w)
        pos = torch.stack([rows, cols], dim=-1).reshape(h // merge, merge, w // merge, merge, 2)
        out.append(pos.transpose(1, 2).reshape(-1, 2).repeat(t, 1))
    return torch.cat(out)


def frame_cu_seqlens(grid_thws: Sequence[GridTHW]) -> torch.Tensor:
    """One attention segment per frame of every image."""
    lengths = [h * w for t, h, w in grid_thws for _ in range(t)]
    return F.pad(torch.tensor(lengths, dtype=torch.int32).cumsum(0, dtype=torch.int32), (1, 0))


def window_index(grid_thws: Sequence[GridTHW], merge: int, window_size: int, patch_size: int):
    """Qwen2.5-VL's window reordering: ``(index, cu_window_seqlens)``. ``index[j]`` is the merged
    token (raster order over all images) that sits j-th when tokens are grouped window by window,
    each window ``window_size`` pixels square, row-major inside; ``cu_window_seqlens`` bounds the
    windows in patches (``merge²`` per token). Windows cut by the image edge are smaller."""
    side = window_size // merge // patch_size  # window side in merged tokens
    indices, bounds, offset = [], [torch.zeros(1, dtype=torch.int64)], 0
    for t, h, w in grid_thws:
        gh, gw = h // merge, w // merge
        grid = torch.arange(t * gh * gw).view(t, gh, gw)
        nh, nw = cdiv(gh, side), cdiv(gw, side)
        grid = F.pad(grid, (0, nw * side - gw, 0, nh * side - gh), value=-1)
        windows = grid.view(t, nh, side, nw, side).permute(0, 1, 3, 2, 4).reshape(-1, side * side)
        counts = (windows >= 0).sum(1)
        flat = windows.reshape(-1)
        indices.append(flat[flat >= 0] + offset)
        bounds.append(counts[counts > 0].cumsum(0) * merge**2 + bounds[-1][-1])
        offset += t * gh * gw
    return torch.cat(indices), torch.cat(bounds).to(torch.int32)


def checked_grids(config: VisionConfig, pixel_values: torch.Tensor, grid_thws: Sequence[GridTHW]) -> list[GridTHW]:
    """``grid_thws`` as int tuples, after checking that ``pixel_values`` holds their patches and
    that each grid's sides are whole merge windows."""
    grid_thws = [tuple(int(v) for v in grid) for grid in grid_thws]
    num_patches = sum(t * h * w for t, h, w in grid_thws)
    merge = config.spatial_merge_size
    for grid in grid_thws:
        if grid[1] % merge or grid[2] % merge:
            raise ValueError(f"grid_thw {list(grid)}: h and w must be multiples of spatial_merge_size {merge}")
    if pixel_values.dim() != 2 or pixel_values.shape != (num_patches, config.patch_dim):
        raise ValueError(f"pixel_values of shape {tuple(pixel_values.shape)} for grid_thw {grid_thws}: "
                         f"expected ({num_patches}, {config.patch_dim})")
    return grid_thws


class VisionAttention(nn.Module):
    def __init__(self, config: VisionConfig):
        super().__init__()
        self.num_heads, self.head_dim = config.num_heads, config.head_dim
        self.qkv = nn.Linear(config.hidden_size, 3 * config.hidden_size)
        self.proj = nn.Linear(config.hidden_size, config.hidden_size)
        self.scale = self.head_dim**-0.5

    def forward(self, x, cos, sin, cu_seqlens):
        q, k, v = self.qkv(x).view(-1, 3, self.num_heads, self.head_dim).unbind(1)
        # Rotary in fp32 whatever the model dtype, as transformers does.
        q = ops.apply_rotary(q.float(), cos, sin).to(x.dtype)
        k = ops.apply_rotary(k.float(), cos, sin).to(x.dtype)
        out = ops.varlen_attention(q, k, v, cu_seqlens, self.scale)
        return self.proj(out.reshape(x.shape[0], -1))


class VisionMLP(nn.Module):
    """Qwen2-VL: fc1 -> activation -> fc2."""

    def __init__(self, config: VisionConfig):
        super().__init__()
        self.fc1 = nn.Linear(config.hidden_size, config.intermediate_size)
        self.fc2 = nn.Linear(config.intermediate_size, config.hidden_size)
        self.act = _activation(config.hidden_act)

    def forward(self, x):
        return self.fc2(self.act(self.fc1(x)))


class VisionGatedMLP(nn.Module):
    """Qwen2.5-VL: down(act(gate(x)) * up(x)), biases on all three; gate/up fused on load."""

    def __init__(self, config: VisionConfig):
        super().__init__()
        self.intermediate_size = config.intermediate_size
        self.gate_up_proj = nn.Linear(config.hidden_size, 2 * config.intermediate_size)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size)
        self.act = None if config.hidden_act in ("silu", "swish") else _activation(config.hidden_act)

    def shard_sizes(self, fused: str) -> list[int]:
        return [self.intermediate_size, self.intermediate_size]

    def forward(self, x):
        gate_up = self.gate_up_proj(x)
        if self.act is None:
            return self.down_proj(ops.silu_and_mul(gate_up))
        gate, up = gate_up.chunk(2, dim=-1)
        return self.down_proj(self.act(gate) * up)


class VisionBlock(nn.Module):
    def __init__(self, config: VisionConfig):
        super().__init__()
        if config.window_attention:
            self.norm1 = RMSNorm(config.hidden_size, 1e-6)
            self.norm2 = RMSNorm(config.hidden_size, 1e-6)
            self.mlp = VisionGatedMLP(config)
        else:
            self.norm1 = nn.LayerNorm(config.hidden_size, eps=1e-6)
            self.norm2 = nn.LayerNorm(config.hidden_size, eps=1e-6)
            self.mlp = VisionMLP(config)
        self.attn = VisionAttention(config)

    def forward(self, x, cos, sin, cu_seqlens):
        x = x + self.attn(self.norm1(x), cos, sin, cu_seqlens)
        return x + self.mlp(self.norm2(x))


class PatchEmbed(nn.Module):
    """A Conv3d whose kernel and stride are the whole (temporal, 14, 14) patch: a matmul over the
    patch's ``C·T·14·14`` values. The weight keeps the checkpoint's 5-D shape."""

    def __init__(self, config: VisionConfig):
        super().__init__()
        kernel = (config.temporal_patch_size, config.patch_size, config.patch_size)
        self.proj = nn.Conv3d(config.in_channels, config.hidden_size, kernel, stride=kernel, bias=config.patch_bias)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        weight = self.proj.weight
        out = pixel_values.to(weight.dtype) @ weight.flatten(1).t()
        return out if self.proj.bias is None else out + self.proj.bias


class PatchMerger(nn.Module):
    def __init__(self, config: VisionConfig):
        super().__init__()
        width = config.hidden_size * config.spatial_merge_size**2
        self.width = width
        if config.window_attention:
            self.ln_q = RMSNorm(config.hidden_size, 1e-6)
        else:
            self.ln_q = nn.LayerNorm(config.hidden_size, eps=1e-6)
        self.mlp = nn.Sequential(nn.Linear(width, width), nn.GELU(), nn.Linear(width, config.out_hidden_size))

    def forward(self, x):
        return self.mlp(self.ln_q(x).view(-1, self.width))


class VisionTransformer(nn.Module):
    def __init__(self, config: VisionConfig):
        super().__init__()
        self.config = config
        self.patch_embed = PatchEmbed(config)
        self.blocks = nn.ModuleList(VisionBlock(config) for _ in range(config.depth))
        self.merger = PatchMerger(config)
        # The axial table: head_dim / 4 frequencies of a head_dim / 2 rotary, for rows and for columns.
        self.rotary = ops.RotaryEmbedding(config.head_dim // 2, {"rope_theta": config.rope_theta})

    def rotary_cos_sin(self, grid_thws: Sequence[GridTHW], device) -> tuple[torch.Tensor, torch.Tensor]:
        positions = vision_position_ids(grid_thws, self.config.spatial_merge_size).to(device)
        freqs = positions.float().unsqueeze(-1) * self.rotary.inv_freq.to(device)  # (patches, 2, head_dim / 4)
        freqs = freqs.flatten(1)  # row frequencies, then column frequencies
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos(), emb.sin()

    def forward(self, pixel_values: torch.Tensor, grid_thws: Sequence[GridTHW]) -> torch.Tensor:
        """``pixel_values`` ``(sum t·h·w, C·T·P·P)`` of the images ``grid_thws`` (in order) ->
        ``(sum t·h·w / merge², out_hidden_size)``, image after image, each in raster order."""
        config = self.config
        grid_thws = checked_grids(config, pixel_values, grid_thws)
        num_patches, merge = pixel_values.shape[0], config.spatial_merge_size
        device = pixel_values.device
        x = self.patch_embed(pixel_values)
        cos, sin = self.rotary_cos_sin(grid_thws, device)
        full = frame_cu_seqlens(grid_thws).to(device)
        windows = order = None
        if config.window_attention:
            order, windows = window_index(grid_thws, merge, config.window_size, config.patch_size)
            order = order.to(device)
            windows = windows.to(device)
            unit = merge**2
            x = x.view(-1, unit, x.shape[-1])[order].view(num_patches, -1)
            cos = cos.view(-1, unit, cos.shape[-1])[order].view(num_patches, -1)
            sin = sin.view(-1, unit, sin.shape[-1])[order].view(num_patches, -1)
        for i, block in enumerate(self.blocks):
            use_windows = windows is not None and i not in config.fullatt_block_indexes
            x = block(x, cos, sin, windows if use_windows else full)
        merged = self.merger(x)
        if order is not None:
            merged = merged[torch.argsort(order)]
        return merged


# ------------------------------------------------------------------------------------------------
# M-RoPE positions


def mrope_positions(token_ids: torch.Tensor, grid_thws: Sequence[GridTHW], image_token_id: int,
                    spatial_merge_size: int, *, video_token_id: int | None = None,
                    time_intervals: Sequence[torch.Tensor | int] | None = None) -> tuple[torch.Tensor, int]:
    """transformers' ``get_rope_index`` for one prompt of images and videos: ``(positions (3, L),
    rope_delta)``.

    Media blocks are the runs of ``image_token_id`` or ``video_token_id`` (metadata slots, ids < 0,
    count as block slots too, so raw prompt ids work as well as restored ones); run i must hold
    exactly ``t·h·w / merge²`` slots of ``grid_thws[i]``. ``time_intervals[i]``: how many positions
    apart block i's temporal patches are (1 for images and for Qwen2-VL's videos; Qwen2.5-VL's
    videos: ``tokens_per_second × second_per_grid_t``, a float32 0-d tensor, truncated per patch
    as transformers does)."""
    ids = torch.as_tensor(token_ids).reshape(-1).cpu()
    length = ids.shape[0]
    is_media = (ids == image_token_id) | (ids < 0)
    if video_token_id is not None:
        is_media |= ids == video_token_id
    edges = torch.diff(is_media.to(torch.int8), prepend=torch.zeros(1, dtype=torch.int8),
                       append=torch.zeros(1, dtype=torch.int8))
    starts, ends = torch.nonzero(edges == 1).flatten().tolist(), torch.nonzero(edges == -1).flatten().tolist()
    if len(starts) != len(grid_thws):
        raise ValueError(f"the prompt holds {len(starts)} image blocks, {len(grid_thws)} grid_thw were given")
    intervals = list(time_intervals) if time_intervals is not None else [1] * len(grid_thws)
    if len(intervals) != len(grid_thws):
        raise ValueError(f"{len(intervals)} time intervals for {len(grid_thws)} media blocks")
    positions = torch.empty(3, length, dtype=torch.long)
    text_from, current = 0, 0
    for index, (start, end, grid, interval) in enumerate(zip(starts, ends, grid_thws, intervals)):
        t, h, w = (int(v) for v in grid)
        gh, gw = h // spatial_merge_size, w // spatial_merge_size
        if end - start != t * gh * gw:
            raise ValueError(f"image block {index} at position {start} has {end - start} slots, grid_thw "
                             f"{[t, h, w]} needs {t * gh * gw}")
        positions[:, text_from:start] = torch.arange(current, current + start - text_from)
        current += start - text_from
        plain = isinstance(interval, int) and interval == 1
        temporal = torch.arange(t) if plain else (torch.arange(t) * interval).long()
        positions[0, start:end] = temporal.repeat_interleave(gh * gw) + current
        positions[1, start:end] = torch.arange(gh).repeat_interleave(gw).repeat(t) + current
        positions[2, start:end] = torch.arange(gw).repeat(t * gh) + current
        current += max(h, w) // spatial_merge_size
        text_from = end
    positions[:, text_from:] = torch.arange(current, current + length - text_from)
    rope_delta = int(positions.max()) + 1 - length if length else 0
    return positions, rope_delta


def decode_positions(num_computed: int, num_new: int, rope_delta: int) -> torch.Tensor:
    """``(3, num_new)`` M-RoPE positions of the tokens after the first ``num_computed`` (the
    prompt's tail or generated tokens): ``position + rope_delta`` in all three rows."""
    return torch.arange(num_computed, num_computed + num_new, dtype=torch.long).expand(3, -1) + rope_delta


# ------------------------------------------------------------------------------------------------
# the model


def largest_window_grid(windows: int) -> tuple[int, int]:
    """``(rows, cols)`` of merge windows: the most windows, at most ``windows``, in a shape
    smart_resize leaves alone (aspect ratio at most MAX_ASPECT_RATIO), squarest first."""
    return max(((a, windows // a) for a in range(1, math.isqrt(windows) + 1) if windows // a <= MAX_ASPECT_RATIO * a),
               key=lambda rc: (rc[0] * rc[1], rc[0]))


def max_pixels(model_dir) -> int:
    """``max_pixels`` of the checkpoint's image processor: top-level ``max_pixels``, else
    ``size.longest_edge`` (a pixel count for this family), else ``size.max_pixels`` (transformers'
    precedence, as the input builder reads it); the default without the file or the keys."""
    path = Path(model_dir) / "preprocessor_config.json"
    config = json.loads(path.read_text()) if path.is_file() else {}
    size = config.get("size") or {}
    for value in (config.get("max_pixels"), size.get("longest_edge"), size.get("max_pixels")):
        if value is not None:
            return int(value)
    return DEFAULT_MAX_PIXELS


_V5_PREFIXES = (("model.language_model.", "model."), ("model.visual.", "visual."))


def _published_name(name: str) -> str:
    """transformers 5 re-saves ``model.language_model.*`` / ``model.visual.*``: map back."""
    for new, old in _V5_PREFIXES:
        if name.startswith(new):
            return old + name[len(new):]
    return name


class Qwen2VLForConditionalGeneration(MultimodalModel):
    """Qwen2-VL / Qwen2.5-VL (``model_type`` picks the tower). ``forward`` takes ``positions`` of
    shape ``(3, T)`` (``get_mrope_positions`` / ``decode_positions``; ``(T,)`` means text-only
    positions, equal in all rows) and ``inputs_embeds`` with image features merged (``mm.embed``).

    Parameters: ``language_model.*`` (``decoder.DecoderForCausalLM``; ``model`` and ``lm_head``
    read through to its decoder and head) and ``visual.*`` (the tower)."""

    def __init__(self, config: Qwen2VLConfig):
        super().__init__(config, language_model=build_language_model(config.text),
                         visual=VisionTransformer(config.vision))

    @property
    def model(self) -> DecoderModel:
        """The language model's decoder (embeddings, layers, norm, M-RoPE table)."""
        return self.language_model.model

    @property
    def lm_head(self) -> nn.Linear | None:
        """The language model's output projection; None when tied to the embeddings."""
        return self.language_model.lm_head

    @classmethod
    def config_from_hf(cls, config: dict) -> Qwen2VLConfig:
        model_type = config.get("model_type")
        if model_type not in ("qwen2_vl", "qwen2_5_vl"):
            raise ValueError(f"{cls.__name__} serves model_type qwen2_vl and qwen2_5_vl, not {model_type!r}")
        # Published: text settings at the top level; transformers 5: in text_config.
        text = {**config, **(config.get("text_config") or {})}
        if "tie_word_embeddings" in config:
            text["tie_word_embeddings"] = config["tie_word_embeddings"]
        return Qwen2VLConfig(
            text=DecoderConfig.from_hf(text, qkv_bias=True),
            vision=VisionConfig.from_hf(config["vision_config"], qwen2_5=model_type == "qwen2_5_vl"),
            image_token_id=config["image_token_id"],
            video_token_id=config.get("video_token_id"),
            vision_start_token_id=config.get("vision_start_token_id"),
            vision_end_token_id=config.get("vision_end_token_id"),
        )

    # -- multimodal (interfaces.SupportsMedia, SupportsMRoPE) -------------------------------------

    # Images (and videos) one prompt may carry: the input builder's limits and the most
    # EngineConfig's limit_mm_per_prompt (MediaConfig's max_videos_per_prompt) may be (one
    # declaration, read by both).
    supported_mm_limits = MappingProxyType({"image": 16, "video": 4})

    def get_processing_info(self, model_dir) -> MultimodalProcessingInfo:
        """The largest image: ``max_pixels`` (preprocessor_config.json, read with the builder's
        precedence) cut into merge windows of ``patch x merge`` pixels; the most windows an image of
        at most ``max_pixels`` can have, squarest first (smart_resize leaves sides that are
        multiples of the window alone)."""
        vision = self.config.vision
        factor = vision.patch_size * vision.spatial_merge_size
        windows = max_pixels(model_dir) // factor**2
        if windows < 1:
            raise ValueError(f"{model_dir}/preprocessor_config.json: max_pixels is smaller than one "
                             f"{factor}x{factor} merge window")
        rows, cols = largest_window_grid(windows)
        merge = vision.spatial_merge_size
        grid = (1, rows * merge, cols * merge)
        return MultimodalProcessingInfo(
            modality="image", max_items_per_prompt=self.supported_mm_limits["image"],
            max_tokens_per_item=rows * cols, max_item_size=(rows * factor, cols * factor),
            pixel_shape=(math.prod(grid), vision.patch_dim), grid_thw=grid)

    def get_video_processing_info(self, model_dir, max_tokens: int,
                                  max_frames: int) -> MultimodalProcessingInfo | None:
        """The video with the most feature tokens, at most ``max_tokens``, that Qwen's sampling
        (input_builders.video, with its default budgets) gives from at most ``max_frames`` frames:
        for every frame count ``n`` (whole temporal patches), frames of the most merge windows
        within ``min(VIDEO_MAX_PIXELS, max(VIDEO_TOTAL_PIXELS x T / n, 1.05 x VIDEO_MIN_PIXELS))``
        (``T``: frames per temporal patch) and within ``max_tokens / (n / T)``; of equal token
        counts the larger frames win (longer attention segments: the tower attends per frame).
        None: the checkpoint has no video token, or not one temporal patch of the smallest frame
        fits ``max_tokens``. The budgets are ``video_budget``'s: here the sampler's constants, not
        the checkpoint's (only the patch and merge sizes come from it); Qwen3-VL reads its
        checkpoint's video processor config."""
        if self.config.video_token_id is None:
            return None
        vision = self.config.vision
        factor, per_patch = vision.patch_size * vision.spatial_merge_size, vision.temporal_patch_size
        min_pixels, frame_cap_of, max_frames = self.video_budget(model_dir, max_frames)
        min_windows = cdiv(min_pixels, factor**2)  # smart_resize scales smaller frames up to it
        best = None  # ((tokens, windows per frame), t, rows, cols)
        for t in range(1, max_frames // per_patch + 1):
            if max_tokens // t < min_windows:
                break  # more temporal patches only leave less per frame
            frame_cap = frame_cap_of(t)
            rows, cols = largest_window_grid(min(int(frame_cap) // factor**2, max_tokens // t))
            key = (t * rows * cols, rows * cols)
            if rows * cols >= min_windows and (best is None or key > best[0]):
                best = (key, t, rows, cols)
        if best is None:
            return None
        (tokens, _), t, rows, cols = best
        merge = vision.spatial_merge_size
        grid = (t, rows * merge, cols * merge)
        return MultimodalProcessingInfo(
            modality="video", max_items_per_prompt=self.supported_mm_limits["video"], max_tokens_per_item=tokens,
            max_item_size=(rows * factor, cols * factor), pixel_shape=(math.prod(grid), vision.patch_dim),
            grid_thw=grid, frames=t * per_patch)

    def video_budget(self, model_dir, max_frames: int):
        """``(min_pixels per frame, frame_cap(t): the most pixels a frame of a video of t
        temporal patches may have, max_frames)``: qwen-vl-utils' budgets (module constants)."""
        per_patch = self.config.vision.temporal_patch_size

        def frame_cap(t: int) -> float:
            return min(VIDEO_MAX_PIXELS, max(VIDEO_TOTAL_PIXELS / (t * per_patch) * per_patch,
                                             int(VIDEO_MIN_PIXELS * 1.05)))

        return VIDEO_MIN_PIXELS, frame_cap, max_frames

    video_block = QWEN2_VL_VIDEO_BLOCK  # the family's video block (Qwen3-VL: one per temporal patch)

    @property
    def media_layout(self) -> MediaLayout:
        return MediaLayout(placeholder_id=self.config.image_token_id, num_metadata_slots=QWEN2_VL_BLOCK.metadata_slots,
                           tokens_per_block=QWEN2_VL_BLOCK.tokens_per_block,
                           merge_size=self.config.vision.spatial_merge_size)

    @property
    def media_layouts(self) -> tuple[MediaLayout, ...]:
        """The image block, and the video block where the checkpoint has a video token."""
        if self.config.video_token_id is None:
            return (self.media_layout,)
        video = MediaLayout(placeholder_id=self.config.video_token_id,
                            num_metadata_slots=self.video_block.metadata_slots,
                            merge_size=self.config.vision.spatial_merge_size, modality="video",
                            per_temporal_patch=self.video_block.per_temporal_patch)
        return self.media_layout, video

    @property
    def pixel_format(self) -> Qwen2VLPatchFormat:
        vision = self.config.vision
        return Qwen2VLPatchFormat(self.pixel_normalization, patch_size=vision.patch_size,
                                  temporal_patch_size=vision.temporal_patch_size, merge_size=vision.spatial_merge_size)

    def get_multimodal_embeddings(self, pixel_values: torch.Tensor, grid_thw: GridTHW | None) -> torch.Tensor:
        """The ``t·h·w / merge²`` LLM-token features of one image, in block order."""
        if grid_thw is None:
            raise ValueError("Qwen2-VL needs the image's grid_thw (the block's THW slot)")
        return self.visual(pixel_values, [tuple(grid_thw)])

    def get_mrope_positions(self, token_ids: torch.Tensor, grid_thws: Sequence[GridTHW],
                            second_per_grid_ts: Sequence[float | None] | None = None) -> tuple[torch.Tensor, int]:
        """``(positions (3, L), rope_delta)`` of a prompt whose media blocks have ``grid_thws``;
        ``second_per_grid_ts``: per block, a video's ``second_per_grid_t`` (None for an image).
        Qwen2.5-VL spaces a video's temporal patches ``tokens_per_second × second_per_grid_t``
        positions apart, computed in float32 as transformers does; Qwen2-VL one apart."""
        vision = self.config.vision
        intervals = None
        if second_per_grid_ts is not None and vision.tokens_per_second is not None:
            intervals = [1 if seconds is None else vision.tokens_per_second * torch.tensor(seconds, dtype=torch.float32)
                         for seconds in second_per_grid_ts]
        return mrope_positions(token_ids, grid_thws, self.config.image_token_id, vision.spatial_merge_size,
                               video_token_id=self.config.video_token_id, time_intervals=intervals)

    decode_positions = staticmethod(decode_positions)

    # -- weights ---------------------------------------------------------------------------------

    stacked_params = STACKED_QKV_GATE_UP  # the LM's qkv_proj / gate_up_proj, the Qwen2.5 tower's gate_up_proj

    def _own_name(self, name: str) -> str | None:
        """Checkpoint ``model.* / lm_head.*`` -> ``language_model.model.* / language_model.lm_head.*``,
        ``visual.*`` as is (transformers 5's names mapped back first); ``IGNORE`` for rotary
        buffers and a tied head; None for anything else."""
        name = _published_name(name)
        own = self.language_model._own_name(name)
        if own == IGNORE or name.startswith("visual."):
            return own
        if name.startswith(("model.", "lm_head.")):
            return "language_model." + own
        return None
