"""Model capabilities, as runtime-checkable protocols, and what a multimodal family declares.

The engine asks what a model can do with ``isinstance(model, SupportsMedia)`` /
``isinstance(model, SupportsMRoPE)`` instead of probing single attributes with ``hasattr``: a
capability is the whole set of members below, and a model that has only part of one does not
have it. These add to the generative models' base contract (``decoder.DecoderForCausalLM``:
``forward``, ``compute_logits``, ``make_kv_caches``, weights).

Which family has what::

    Qwen2, Llama                   none of them
    LLaVA, Qwen-VL                 SupportsMedia
    Qwen2-VL, Qwen2.5-VL, Qwen3-VL SupportsMedia, SupportsMRoPE, SupportsVideo
    pooling models                 SupportsPooling (BERT also SupportsTokenTypes): native ones
                                   (BERT, Qwen2ForRewardModel) and generative classes adapted
                                   by ``atb_plugin.models.pooling_adapters``

``isinstance`` against a protocol checks that the members exist, not their signatures. On
Python < 3.12 it reads ``media_layout`` to do so: keep that property cheap and free of side
effects.

A multimodal family also declares its per-prompt limit and its largest item
(``MultimodalProcessingInfo``, ``supported_mm_limit``, ``resolve_mm_limit``): the input builders,
``EngineConfig.limit_mm_per_prompt`` / ``limit_videos_per_prompt`` and the start-up memory profile
(``atb_plugin.engine.memory_profile``) read them; a family that takes video also declares its
largest video (``SupportsVideo``). This module imports no torch.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, runtime_checkable

if TYPE_CHECKING:
    import torch

    from atb_plugin.models.poolers import DispatchPooler
    from atb_plugin.multimodal import MediaLayout
    from atb_plugin.pooling.config import PoolerConfig

GridTHW = tuple[int, int, int]  # an image's patch grid (temporal, height, width)
MODALITIES = ("image", "audio", "video")

__all__ = ["GridTHW", "MODALITIES", "MultimodalProcessingInfo", "SupportsMRoPE", "SupportsMedia", "SupportsPooling",
           "SupportsTokenTypes", "SupportsVideo", "model_modality", "resolve_mm_limit", "supported_mm_limit"]


@runtime_checkable
class SupportsMedia(Protocol):
    """A model that takes images through media blocks in the prompt (``atb_plugin.multimodal``).

    - ``media_layout``: the ``MediaLayout`` of this model's blocks (placeholder id, number of
      metadata slots, block length). Fixed for the model's lifetime.
    - ``media_layouts``: every layout the model reads, ``media_layout`` first (Qwen2-VL adds its
      video block); ``MultimodalPrompt.from_ids`` tells them apart by their metadata slots.
    - ``encoder_input(pixels, grid_thw=None)``: ONE block's pixels as its shm segment holds them
      (a uint8 ``[H, W, 3]`` resized image or float32 pixel values, on the model's device) -> the
      encoder's input in the model's dtype (``atb_plugin.multimodal.pixels``); raises
      ``PixelFormatError`` for a dtype or shape the model does not read.
    - ``get_multimodal_embeddings(pixel_values, grid_thw=None)``: the encoder for ONE block's
      encoder input -> ``(block length, hidden)`` feature rows in
      block order, in the model's dtype. ``grid_thw`` is the block's ``(t, h, w)`` patch grid for
      layouts with a THW slot (required there), None otherwise (a model without grids refuses
      one). Raises ``ValueError`` on pixels that do not fit the model.
    - ``get_input_embeddings(input_ids, mm_embeds=None)``: text embeddings ``(T, hidden)`` of
      ``input_ids`` (restored ids: no metadata slot < 0). With ``mm_embeds``, those rows replace
      the placeholder positions in order; a model may refuse ``mm_embeds`` (NotImplementedError)
      and leave the merge to ``MultimodalPrompt.embed``.
    - ``get_processing_info(model_dir)``: the family's per-prompt limit and its largest item
      (``MultimodalProcessingInfo`` below), for the start-up memory
      profile. The class also declares ``supported_mm_limits`` (``{"image": N}``), which the input
      builders and ``EngineConfig.limit_mm_per_prompt`` read.
    """

    @property
    def media_layout(self) -> MediaLayout: ...

    @property
    def media_layouts(self) -> tuple[MediaLayout, ...]: ...

    def encoder_input(self, pixels: torch.Tensor, grid_thw: GridTHW | None = None) -> torch.Tensor: ...

    def get_multimodal_embeddings(self, pixel_values: torch.Tensor, grid_thw: GridTHW | None = None) -> torch.Tensor: ...

    def get_input_embeddings(self, input_ids: torch.Tensor, mm_embeds: torch.Tensor | None = None) -> torch.Tensor: ...

    def get_processing_info(self, model_dir) -> MultimodalProcessingInfo: ...


@runtime_checkable
class SupportsVideo(Protocol):
    """A ``SupportsMedia`` model that also takes videos (its ``media_layouts`` has a video block).

    - ``get_video_processing_info(model_dir, max_tokens, max_frames)``: the video with the most
      feature tokens the family's sampling rules can produce from at most ``max_frames`` sampled
      frames, within ``max_tokens`` (a ``MultimodalProcessingInfo`` of modality "video", its
      ``frames`` set), or None when no video fits or the checkpoint reads none. The start-up
      memory profile runs it ``EngineConfig.limit_videos_per_prompt`` times at most.

    A method only, so ``issubclass(cls, SupportsVideo)`` works on classes too."""

    def get_video_processing_info(self, model_dir, max_tokens: int,
                                  max_frames: int) -> MultimodalProcessingInfo | None: ...


@runtime_checkable
class SupportsMRoPE(Protocol):
    """A model with multimodal rotary positions (M-RoPE): ``forward`` takes ``positions`` of shape
    ``(3, T)`` (temporal, height, width rows) instead of ``(T,)``.

    - ``get_mrope_positions(token_ids, grid_thws)`` -> ``(positions (3, L), rope_delta)`` for a
      whole prompt of ``L`` ids whose media blocks, in order, have the patch grids ``grid_thws``
      (metadata slots < 0 count as block slots; a text-only prompt has ``grid_thws == []``).
      ``second_per_grid_ts``: per block, a video's ``second_per_grid_t`` (None for an image), for
      models whose time positions follow the clock (Qwen2.5-VL).
      ``rope_delta`` is ``max position + 1 - L``, an int. Raises ``ValueError`` when the blocks
      and the grids disagree. Computed once per prompt; chunks of a chunked prefill take slices.
    - ``decode_positions(num_computed, num_new, rope_delta)`` -> ``(3, num_new)`` positions of the
      tokens after the first ``num_computed`` of the sequence, for the tokens past the prompt
      (generated ones, also when recomputed after a preemption): ``position + rope_delta`` in
      all three rows. Depends on its arguments only.
    """

    def get_mrope_positions(self, token_ids: torch.Tensor, grid_thws: Sequence[GridTHW],
                            second_per_grid_ts: Sequence[float | None] | None = None) -> tuple[torch.Tensor, int]: ...

    def decode_positions(self, num_computed: int, num_new: int, rope_delta: int) -> torch.Tensor: ...


@runtime_checkable
class SupportsPooling(Protocol):
    """A model whose outputs are pooled hidden states (embeddings, class scores, rewards), not
    tokens: the engine runs it with ``runner="pooling"``.

    - ``build_pooler(pooler_config)`` -> the ``DispatchPooler`` for the tasks this model serves
      (its keys are the tasks); the model's hidden states from ``forward`` are its input.
    - ``compute_logits`` may refuse (no LM head). A class attribute ``default_pooling_type``
      names the pooling used when the checkpoint's files do not say.

    Methods only, so ``issubclass(cls, SupportsPooling)`` works on classes too."""

    def build_pooler(self, pooler_config: PoolerConfig) -> DispatchPooler: ...


@runtime_checkable
class SupportsTokenTypes(Protocol):
    """An encoder with segment (token type) embeddings, e.g. a BERT cross-encoder scoring a pair
    ``[CLS] a [SEP] b [SEP]`` whose ``b`` part has token type 1.

    - ``forward_with_token_types(input_ids, positions, kv_caches, attn_metadata, token_type_ids)``:
      ``forward`` with a ``(T,)`` token-type row (0 or 1 per token)."""

    def forward_with_token_types(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches,
                                 attn_metadata, token_type_ids: torch.Tensor) -> torch.Tensor: ...


# ------------------------------------------------------------------------------------------------
# what a multimodal family declares


@dataclass(frozen=True)
class MultimodalProcessingInfo:
    """What a multimodal family takes per prompt, and its largest item (vLLM's
    ``BaseProcessingInfo``: supported limits, tokens per item, the size with the most features).

    ``max_tokens_per_item``: the media block of the largest item, i.e. the encoder's feature rows
    for it; ``max_item_size``: ``(height, width)`` in pixels, after preprocessing, of that item
    (its uint8 wire form is ``[height, width, 3]``; a video's is one frame's, its uint8 wire form
    ``[frames, 3, height, width]``); ``pixel_shape`` / ``grid_thw``: that item as the encoder
    takes it (the float32 wire form and the block's THW slot, None for layouts without one);
    ``frames``: a video's sampled frames (``grid_thw[0]`` temporal patches), None otherwise."""

    modality: str
    max_items_per_prompt: int
    max_tokens_per_item: int
    max_item_size: tuple[int, int]
    pixel_shape: tuple[int, ...]
    grid_thw: GridTHW | None = None
    frames: int | None = None

    def __post_init__(self):
        if self.modality not in MODALITIES:
            raise ValueError(f"MultimodalProcessingInfo.modality = {self.modality!r}: expected one of {MODALITIES}")
        for name in ("max_items_per_prompt", "max_tokens_per_item"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"MultimodalProcessingInfo.{name} = {value!r}: must be an integer >= 1")
        for name in ("max_item_size", "pixel_shape") + (("grid_thw",) if self.grid_thw is not None else ()):
            value = tuple(getattr(self, name))
            if not value or any(isinstance(v, bool) or not isinstance(v, int) or v < 1 for v in value):
                raise ValueError(f"MultimodalProcessingInfo.{name} = {value!r}: must be positive integers")
            object.__setattr__(self, name, value)
        if len(self.max_item_size) != 2:
            raise ValueError(f"MultimodalProcessingInfo.max_item_size = {self.max_item_size}: expected (height, width)")
        if self.modality in ("image", "video") and self.grid_thw is not None and (
                len(self.grid_thw) != 3 or math.prod(self.grid_thw) != self.pixel_shape[0]):
            raise ValueError(f"MultimodalProcessingInfo: grid_thw {self.grid_thw} does not match the "
                             f"{self.pixel_shape[0]} patch rows of pixel_shape {self.pixel_shape}")
        if (self.modality == "video") != (self.frames is not None):
            raise ValueError(f"MultimodalProcessingInfo.frames = {self.frames!r}: a video's sampled frames, "
                             f"and only a video's (modality {self.modality!r})")
        if self.frames is not None:
            frames = self.frames
            if (isinstance(frames, bool) or not isinstance(frames, int) or self.grid_thw is None
                    or frames < 1 or frames % self.grid_thw[0]):
                raise ValueError(f"MultimodalProcessingInfo.frames = {frames!r}: must be a positive multiple of "
                                 f"the video's {self.grid_thw[0] if self.grid_thw else None} temporal patches "
                                 "(grid_thw is required for a video)")


def supported_mm_limit(model_cls: type, modality: str | None = None) -> int:
    """The most items of ``modality`` one prompt may carry, as the model class declares it
    (``supported_mm_limits``); 0 for a model that takes none (text-only models declare nothing).
    None: the model's own modality (each family here takes one kind: images, or audio clips)."""
    limits = getattr(model_cls, "supported_mm_limits", {})
    if modality is None:
        return int(next(iter(limits.values()), 0))
    return int(limits.get(modality, 0))


def model_modality(model_cls: type) -> str:
    """The kind of media a model takes ("image" for text-only models: what their refusals name)."""
    return next(iter(getattr(model_cls, "supported_mm_limits", {})), "image")


def resolve_mm_limit(model_cls: type, requested: int | None, modality: str | None = None) -> int:
    """``limit_mm_per_prompt`` (``modality`` None: the model's own) or ``limit_videos_per_prompt``
    (``modality="video"``): the model's own limit when None, else ``requested``, which may not
    exceed it (ValueError naming both: a limit silently lowered would refuse requests the operator
    believes allowed; vLLM refuses it at start-up too). One rule for the engine's config and the
    server's flags (the CLI turns the error into a usage error)."""
    supported = supported_mm_limit(model_cls, modality)
    if requested is None:
        return supported
    if modality == "video":
        if requested > supported:
            what = f"0 to {supported} videos per prompt" if supported else "no video"
            raise ValueError(f"EngineConfig.limit_videos_per_prompt = {requested} (--limit-mm-per-prompt "
                             f"video={requested}): {model_cls.__name__} takes {what}")
        return requested
    if requested > supported:
        items = "images" if model_modality(model_cls) == "image" else "audio clips"
        what = f"at most {supported} {items} per prompt" if supported else f"no {items}"
        fix = f"set it to {supported} or less, or leave it unset" if supported else "leave it unset (or 0)"
        raise ValueError(f"EngineConfig.limit_mm_per_prompt = {requested} (--limit-mm-per-prompt): "
                         f"{model_cls.__name__} takes {what}; {fix}")
    return requested
