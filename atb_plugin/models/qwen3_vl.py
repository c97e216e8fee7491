"""Qwen3-VL and Qwen3-VL-MoE: Qwen2-VL's design (models/qwen2_vl.py) with a new tower and the
Qwen3 decoders. What differs, and where it lives:

- **Tower**: 16-pixel patches (a biased patch embedding), a learned square grid of position
  embeddings resampled to each image's patches (bilinear, corners aligned, as transformers'
  ``get_vision_interpolation_indices_and_weights``), Qwen2-VL's LayerNorm blocks (GELU-tanh
  MLP), a merger ``norm -> fc1 -> GELU -> fc2``.
- **DeepStack**: after the tower blocks named by ``deepstack_visual_indexes`` a merger of their
  own (LayerNorm over the merged window) turns the hidden states into LLM-width features; the
  k-th of them is added to the visual positions' hidden states after decoder layer k.
  How they travel: ``get_multimodal_embeddings`` returns *wide* rows, ``[main | deep_0 | ... |
  deep_{k-1}]`` (``(n, hidden · (1 + k))``), and ``get_input_embeddings`` pads text rows with
  zeros to that width. A media block's rows then go wherever its features go (the encoder cache
  of ``MultimodalPrompt``, a prefill chunk cut anywhere inside it, the prefix cache skipping it),
  with no state of their own in the engine; ``forward`` splits them off and adds ``deep_k``
  after layer k to every position (zero for text: ``x + 0`` is ``x``, bit for bit).
- **Interleaved M-RoPE**: the rope parameters' ``mrope_interleaved`` (``ops.rotary``); the
  positions are Qwen2-VL's ``mrope_positions``.
- **Video**: the processor gives each temporal patch its own block, between timestamps
  (``<0.5 seconds><|vision_start|> ... <|vision_end|>``); the blocks of one video share one
  segment (``wire.QWEN3_VL_VIDEO_BLOCK``: a PATCH slot says which patch), and each is positioned
  like a one-frame image, as transformers splits ``video_grid_thw`` per frame.
- **Decoder**: Qwen3's (q/k norms, no biases); Qwen3-VL-MoE's sparse layers always renormalise
  their top-k and publish the experts stacked (``models/moe.py``).

Checkpoint names are transformers 5's (``model.language_model.*``, ``model.visual.*``,
``lm_head.weight``), mapped to Qwen2-VL's module tree (``_own_name``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from atb_plugin import ops
from atb_plugin.models.decoder import DecoderConfig, build_language_model
from atb_plugin.models.moe import ExpertWeightsMixin, MoeConfig
from atb_plugin.models.qwen2_vl import (
    GridTHW,
    PatchEmbed,
    Qwen2VLConfig,
    Qwen2VLForConditionalGeneration,
    VisionBlock,
    VisionConfig,
    VisionTransformer,
    checked_grids,
    frame_cu_seqlens,
)
from atb_plugin.multimodal.budgets import VIDEO_MAX_FRAMES
from atb_plugin.multimodal.wire import QWEN3_VL_VIDEO_BLOCK

__all__ = ["Qwen3VLForConditionalGeneration", "Qwen3VLMoeForConditionalGeneration", "Qwen3VisionConfig",
           "Qwen3VisionTransformer", "position_embedding_taps", "video_processor_config"]

# transformers' Qwen3VLVideoProcessor defaults, where video_preprocessor_config.json says nothing:
# the pixels of all sampled frames together (t·h·w, in pixels) and of a frame at least.
VIDEO_MAX_TOTAL_PIXELS = 32 * 32 * 768
VIDEO_MIN_TOTAL_PIXELS = 32 * 32 * 128


@dataclass(frozen=True)
class Qwen3VisionConfig(VisionConfig):
    num_position_embeddings: int = 2304  # a square grid (48 x 48 on the published checkpoints)
    deepstack_visual_indexes: tuple[int, ...] = ()

    def __post_init__(self):
        super().__post_init__()
        side = int(self.num_position_embeddings**0.5)
        if side * side != self.num_position_embeddings:
            raise ValueError(f"num_position_embeddings {self.num_position_embeddings} is not a square grid")
        if any(not 0 <= i < self.depth for i in self.deepstack_visual_indexes):
            raise ValueError(f"deepstack_visual_indexes {list(self.deepstack_visual_indexes)} must name blocks "
                             f"0 .. {self.depth - 1}")

    @property
    def grid_side(self) -> int:
        return int(self.num_position_embeddings**0.5)

    @classmethod
    def from_qwen3(cls, vision: dict) -> "Qwen3VisionConfig":
        rope = vision.get("rope_parameters") or {}
        return cls(window_attention=False, depth=vision["depth"], hidden_size=vision["hidden_size"],
                   num_heads=vision["num_heads"], intermediate_size=vision["intermediate_size"],
                   out_hidden_size=vision["out_hidden_size"], hidden_act=vision.get("hidden_act", "gelu_pytorch_tanh"),
                   patch_size=vision.get("patch_size", 16), temporal_patch_size=vision.get("temporal_patch_size", 2),
                   in_channels=vision.get("in_channels", 3), spatial_merge_size=vision.get("spatial_merge_size", 2),
                   rope_theta=float(rope.get("rope_theta", 10000.0)), patch_bias=True,
                   num_position_embeddings=vision.get("num_position_embeddings", 2304),
                   deepstack_visual_indexes=tuple(vision.get("deepstack_visual_indexes", (8, 16, 24))))


# ------------------------------------------------------------------------------------------------
# vision tower


def position_embedding_taps(height: int, width: int, side: int, merge: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(indices, weights)``, each ``(height·width, 4)``: the 4 taps into the flattened
    ``side x side`` position table (and their bilinear weights, corners aligned) of every patch of
    one frame, patches in merge-window-major order (the order the rows arrive in)."""

    def axis(size: int):
        src = torch.arange(size, dtype=torch.float32) * (side - 1) / max(size - 1, 1)
        floor = torch.floor(src)
        offsets = torch.arange(2)
        taps = (floor.long()[:, None] + offsets).clamp(0, side - 1)
        weights = (1 - (src[:, None] - floor[:, None] - offsets).abs()).clamp(min=0)
        return taps, weights

    row_taps, row_weights = axis(height)
    col_taps, col_weights = axis(width)
    indices = (row_taps[:, None, :, None] * side + col_taps[None, :, None, :]).reshape(height, width, 4)
    weights = (row_weights[:, None, :, None] * col_weights[None, :, None, :]).reshape(height, width, 4)

    def window_major(table: torch.Tensor) -> torch.Tensor:
        table = table.reshape(height // merge, merge, width // merge, merge, 4)
        return table.transpose(1, 2).reshape(height * width, 4)

    return window_major(indices), window_major(weights)


class Qwen3PatchMerger(nn.Module):
    """``norm -> view(-1, d·merge²) -> fc1 -> GELU -> fc2``; DeepStack's mergers normalise after the
    view (``postshuffle``: over the whole merge window) instead of per patch."""

    def __init__(self, config: Qwen3VisionConfig, postshuffle: bool = False):
        super().__init__()
        self.width = config.hidden_size * config.spatial_merge_size**2
        self.postshuffle = postshuffle
        self.norm = nn.LayerNorm(self.width if postshuffle else config.hidden_size, eps=1e-6)
        self.linear_fc1 = nn.Linear(self.width, self.width)
        self.linear_fc2 = nn.Linear(self.width, config.out_hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.norm(x.view(-1, self.width)) if self.postshuffle else self.norm(x).view(-1, self.width)
        return self.linear_fc2(F.gelu(self.linear_fc1(x)))


class Qwen3VisionTransformer(nn.Module):
    """Qwen2-VL's blocks (``qwen2_vl.VisionBlock``: attention per frame, axial 2-D rotary) under a
    biased patch embedding plus resampled position embeddings, with DeepStack's mergers."""

    def __init__(self, config: Qwen3VisionConfig):
        super().__init__()
        self.config = config
        self.patch_embed = PatchEmbed(config)
        self.pos_embed = nn.Embedding(config.num_position_embeddings, config.hidden_size)
        self.blocks = nn.ModuleList(VisionBlock(config) for _ in range(config.depth))
        self.merger = Qwen3PatchMerger(config)
        self.deepstack_merger_list = nn.ModuleList(Qwen3PatchMerger(config, postshuffle=True)
                                                   for _ in config.deepstack_visual_indexes)
        self.rotary = ops.RotaryEmbedding(config.head_dim // 2, {"rope_theta": config.rope_theta})

    rotary_cos_sin = VisionTransformer.rotary_cos_sin  # the axial 2-D table of Qwen2-VL's tower

    def position_embeddings(self, grid_thws, device) -> torch.Tensor:
        rows = []
        for t, h, w in grid_thws:
            indices, weights = position_embedding_taps(h, w, self.config.grid_side, self.config.spatial_merge_size)
            embeds = (self.pos_embed(indices.to(device)) * weights.to(device, self.pos_embed.weight.dtype)[..., None])
            rows.append(embeds.sum(1).repeat(t, 1))
        return torch.cat(rows)

    def forward(self, pixel_values: torch.Tensor, grid_thws) -> torch.Tensor:
        """``(sum t·h·w, C·T·P·P)`` pixels of ``grid_thws`` -> wide rows ``(sum t·h·w / merge²,
        out_hidden_size · (1 + len(deepstack_visual_indexes)))``: the merged features, then each
        DeepStack level's (module docstring)."""
        grid_thws = checked_grids(self.config, pixel_values, grid_thws)
        device = pixel_values.device
        x = self.patch_embed(pixel_values)
        x = x + self.position_embeddings(grid_thws, device).to(x.dtype)
        cos, sin = self.rotary_cos_sin(grid_thws, device)
        segments = frame_cu_seqlens(grid_thws).to(device)
        mergers, deep = dict(zip(self.config.deepstack_visual_indexes, self.deepstack_merger_list)), []
        for index, block in enumerate(self.blocks):
            x = block(x, cos, sin, segments)
            if index in mergers:
                deep.append(mergers[index](x))
        return torch.cat([self.merger(x), *deep], dim=-1)


# ------------------------------------------------------------------------------------------------
# the model


@dataclass(frozen=True)
class Qwen3VLConfig(Qwen2VLConfig):
    vision: Qwen3VisionConfig

    @property
    def deepstack_levels(self) -> int:
        return len(self.vision.deepstack_visual_indexes)


def video_processor_config(model_dir) -> dict:
    """The checkpoint's ``video_preprocessor_config.json`` (empty without one)."""
    path = Path(model_dir) / "video_preprocessor_config.json"
    return json.loads(path.read_text()) if path.is_file() else {}


class Qwen3VLForConditionalGeneration(Qwen2VLForConditionalGeneration):
    """Qwen3-VL: Qwen2-VL's model contract (M-RoPE, image and video blocks, pixel formats, the
    largest image) with the Qwen3 tower and decoder; ``forward`` takes wide ``inputs_embeds`` and
    adds their DeepStack part after the first decoder layers (module docstring)."""

    model_types = ("qwen3_vl",)

    def __init__(self, config: Qwen3VLConfig):
        super(Qwen2VLForConditionalGeneration, self).__init__(
            config, language_model=build_language_model(config.text), visual=Qwen3VisionTransformer(config.vision))

    @classmethod
    def text_config(cls, text: dict) -> DecoderConfig:
        return DecoderConfig.from_hf(text, qk_norm=True)

    @classmethod
    def config_from_hf(cls, config: dict) -> Qwen3VLConfig:
        if config.get("model_type") not in cls.model_types:
            raise ValueError(f"{cls.__name__} serves model_type {', '.join(cls.model_types)}, "
                             f"not {config.get('model_type')!r}")
        text = dict(config["text_config"])
        if "tie_word_embeddings" in config:
            text["tie_word_embeddings"] = config["tie_word_embeddings"]
        return Qwen3VLConfig(
            text=cls.text_config(text), vision=Qwen3VisionConfig.from_qwen3(config["vision_config"]),
            image_token_id=config["image_token_id"], video_token_id=config.get("video_token_id"),
            vision_start_token_id=config.get("vision_start_token_id"),
            vision_end_token_id=config.get("vision_end_token_id"))

    # -- media -----------------------------------------------------------------------------------

    video_block = QWEN3_VL_VIDEO_BLOCK  # one block per temporal patch

    def video_budget(self, model_dir, max_frames: int):
        """Qwen3VLVideoProcessor's budget (input_builders.video, ``Qwen3VideoSampling``): all
        frames together within ``size.longest_edge`` pixels (the even frame count times a frame),
        a frame at least ``size.shortest_edge`` over all frames; at most its ``max_frames``."""
        video = video_processor_config(model_dir)
        size = video.get("size") or {}
        total = int(size.get("longest_edge", VIDEO_MAX_TOTAL_PIXELS))
        least = int(size.get("shortest_edge", VIDEO_MIN_TOTAL_PIXELS))
        per_patch = self.config.vision.temporal_patch_size
        frames = min(max_frames, int(video.get("max_frames", VIDEO_MAX_FRAMES)))
        return least // per_patch, lambda t: total / (t * per_patch), frames

    def get_multimodal_embeddings(self, pixel_values: torch.Tensor, grid_thw: GridTHW | None) -> torch.Tensor:
        """One block's wide feature rows ``(t·h·w / merge², hidden · (1 + DeepStack levels))``."""
        if grid_thw is None:
            raise ValueError("Qwen3-VL needs the block's grid_thw (its THW slot)")
        return self.visual(pixel_values, [tuple(grid_thw)])

    def get_input_embeddings(self, input_ids: torch.Tensor, mm_embeds: torch.Tensor | None = None) -> torch.Tensor:
        """Wide text embeddings: the token's, then zeros for every DeepStack level; with
        ``mm_embeds`` (wide rows), those replace the image and video placeholder positions in order."""
        embeds = self.language_model.get_input_embeddings(input_ids)
        embeds = F.pad(embeds, (0, embeds.shape[-1] * self.config.deepstack_levels))
        if mm_embeds is None:
            return embeds
        mask = input_ids == self.config.image_token_id
        if self.config.video_token_id is not None:
            mask |= input_ids == self.config.video_token_id
        if int(mask.sum()) != mm_embeds.shape[0]:
            raise ValueError(f"{int(mask.sum())} image / video placeholder tokens but {mm_embeds.shape[0]} feature rows")
        return embeds.masked_scatter(mask.unsqueeze(-1), mm_embeds.to(embeds.dtype))

    def forward(self, input_ids, positions, kv_caches, attn_metadata, inputs_embeds=None):
        hidden_size = self.config.text.hidden_size
        if inputs_embeds is None or inputs_embeds.shape[-1] == hidden_size:
            return self.language_model(input_ids, positions, kv_caches, attn_metadata, inputs_embeds=inputs_embeds)
        main, *deep = inputs_embeds.split(hidden_size, dim=-1)
        decoder = self.language_model.model
        hidden = main.contiguous()
        cos, sin = decoder.rotary.cos_sin(positions, hidden.dtype)
        for index, (layer, kv_cache) in enumerate(zip(decoder.layers, kv_caches)):
            hidden = layer(hidden, cos, sin, kv_cache, attn_metadata)
            if index < len(deep):
                hidden = hidden + deep[index]
        return decoder.norm(hidden)

    # -- weights ---------------------------------------------------------------------------------

    def _own_name(self, name: str) -> str | None:
        """Qwen2-VL's mapping, and the tower blocks' ``mlp.linear_fc1/2`` -> ``mlp.fc1/2``."""
        own = super()._own_name(name)
        if own is not None and own.startswith("visual.blocks."):
            own = own.replace(".mlp.linear_fc", ".mlp.fc")
        return own


class Qwen3VLMoeForConditionalGeneration(ExpertWeightsMixin, Qwen3VLForConditionalGeneration):
    """Qwen3-VL-MoE: the Qwen3-MoE decoder (every layer sparse unless ``mlp_only_layers`` /
    ``decoder_sparse_step`` say otherwise; top-k weights always renormalised, as its router does);
    stacked experts load through ``ExpertWeightsMixin``."""

    model_types = ("qwen3_vl_moe",)

    @classmethod
    def text_config(cls, text: dict) -> DecoderConfig:
        return DecoderConfig.from_hf(text, qk_norm=True, moe=MoeConfig.from_hf({**text, "norm_topk_prob": True}))

    def expert_weight_name(self, name: str) -> str:
        own = self._own_name(name)
        return name if own is None else own
