"""What an image is on the shm wire, as both sides must agree (docs/wire-format.md, section 3).

Each family's media block shape (``MediaBlockShape``: metadata slots, a fixed length or none):
its input builder writes blocks of that shape, its model's ``media_layout`` reads them.

Two wire dtypes, told apart by the segment header's dtype code, never by convention:

* ``uint8`` (the default): the decoded image after the family's resize (and CLIP's centre crop),
  RGB, ``(height, width, 3)``: what the frontend has the moment Pillow's resize returns. The
  model rescales, normalises (and for Qwen2-VL patchifies and repeats the frame over time) on its
  device (``atb_plugin.multimodal.pixels``).
* ``float32``: the encoder's input as transformers' image processors give it (normalised,
  patchified), which is what MindIE-LLM's builders write. Four times the bytes for CHW families,
  eight for Qwen2-VL (the temporal repeat).

This module is torch-free: the input builders import it for the one normalisation rule both
sides apply, so the frontend's float32 path and the device's uint8 path give the same values, and
for the block shapes.
"""

from __future__ import annotations

import functools
import math
import numbers
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from shm.codec import decode_shape_from_int64, encode_shape_to_int64

__all__ = ["DEFAULT_WIRE_DTYPE", "LLAVA_BLOCK", "MediaBlockShape", "OPENAI_CLIP_MEAN", "OPENAI_CLIP_STD",
           "PixelNormalization", "QWEN2_AUDIO_BLOCK", "QWEN2_VL_BLOCK", "QWEN2_VL_VIDEO_BLOCK",
           "QWEN3_VL_VIDEO_BLOCK",
           "decode_second_per_grid_t", "encode_second_per_grid_t",
           "qwen2_audio_tokens", "QWEN_VL_BLOCK", "WIRE_DTYPES", "check_wire_dtype"]

WIRE_DTYPES = ("uint8", "float32")
DEFAULT_WIRE_DTYPE = "uint8"

OPENAI_CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
OPENAI_CLIP_STD = (0.26862954, 0.26130258, 0.27577711)


@dataclass(frozen=True)
class MediaBlockShape:
    """One family's media block in the prompt ids (docs/wire-format.md, section 3), the one
    declaration its input builder (which writes the block) and its model (whose ``MediaLayout``
    reads it) share: ``metadata_slots`` ids < 0 first (NAME, SHAPE (2) or NAME, SHAPE, THW (3)),
    placeholders after them. ``tokens_per_block``: the block's length where the family fixes it
    (Qwen-VL: one slot per resampler query); None where the checkpoint sets it (LLaVA: the vision
    tower's patches) or each image's THW slot does (Qwen2-VL: ``t·h·w / merge²``)."""

    metadata_slots: int
    tokens_per_block: int | None = None
    # The block holds one temporal patch of its segment's video: its fourth slot is PATCH, the
    # patch's index (QWEN3_VL_VIDEO_BLOCK), not SPG.
    per_temporal_patch: bool = False

    def __post_init__(self):
        if self.per_temporal_patch and (self.metadata_slots != 4 or self.tokens_per_block is not None):
            raise ValueError("a per-temporal-patch block has 4 metadata slots (NAME, SHAPE, THW, PATCH), sized by THW")
        if self.metadata_slots not in (2, 3, 4):
            raise ValueError(f"metadata_slots must be 2, 3 or 4, got {self.metadata_slots}")
        if self.tokens_per_block is not None and self.tokens_per_block < self.metadata_slots:
            raise ValueError(f"tokens_per_block {self.tokens_per_block} < {self.metadata_slots} metadata slots")


LLAVA_BLOCK = MediaBlockShape(metadata_slots=2)  # NAME, SHAPE; (image_size / patch_size)² (+1 "full") slots
QWEN_VL_BLOCK = MediaBlockShape(metadata_slots=2, tokens_per_block=256)  # NAME, SHAPE; 256 resampler queries
QWEN2_VL_BLOCK = MediaBlockShape(metadata_slots=3)  # NAME, SHAPE, THW; t·h·w / merge² slots (Qwen2.5-VL too)
# A video: NAME, SHAPE, THW, SPG (second_per_grid_t: encode_second_per_grid_t); t·h·w / merge² slots
QWEN2_VL_VIDEO_BLOCK = MediaBlockShape(metadata_slots=4)
# A Qwen3-VL video is one segment and one block per temporal patch (its frames are separated by
# timestamp text): NAME, SHAPE, THW (the whole video's grid), PATCH (the temporal patch's index, a
# 1-d shape); h·w / merge² slots. Its image block is QWEN2_VL_BLOCK.
QWEN3_VL_VIDEO_BLOCK = MediaBlockShape(metadata_slots=4, per_temporal_patch=True)
# NAME, SHAPE, FRAMES (valid mel frames F, as a 1-d shape); ((F - 1) // 2 + 1 - 2) // 2 + 1 slots per 30 s window
QWEN2_AUDIO_BLOCK = MediaBlockShape(metadata_slots=3)


def qwen2_audio_tokens(num_frames: int) -> int:
    """Qwen2-Audio's block length for a window of ``num_frames`` valid mel frames: the encoder's
    output rows (conv2 halves the frames, the average pooling halves again; transformers'
    ``_get_feat_extract_output_lengths``, and what its processor expands ``<|AUDIO|>`` to)."""
    after_conv = (num_frames - 1) // 2 + 1
    return (after_conv - 2) // 2 + 1


def encode_second_per_grid_t(seconds: float) -> int:
    """A video block's SPG slot: ``second_per_grid_t`` rounded to float32 (what the model computes
    with, as transformers does), its 32 bits as the two dims ``(high 16 bits, low 16 bits)`` of the
    shape codec, so the slot is negative and checksummed like the others and the value exact."""
    value = float(seconds)
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"second_per_grid_t must be a positive number of seconds, got {seconds!r}")
    bits = int(np.float32(value).view(np.uint32))
    return encode_shape_to_int64((bits >> 16, bits & 0xFFFF))


def decode_second_per_grid_t(value: int) -> float:
    """The SPG slot back to seconds (a float32 value); ValueError when the slot is not one."""
    dims = tuple(decode_shape_from_int64(value))
    if len(dims) != 2 or dims[0] > 0xFFFF or dims[1] > 0xFFFF:
        raise ValueError(f"an SPG slot holds two 16-bit halves of a float32, got dims {list(dims)}")
    seconds = float(np.uint32((dims[0] << 16) | dims[1]).view(np.float32))
    if not (math.isfinite(seconds) and seconds > 0):
        raise ValueError(f"the SPG slot decodes to {seconds!r}, not a positive number of seconds")
    return seconds


def check_wire_dtype(value: Any, knob: str = "mm_wire_dtype") -> str:
    """``value`` if it names a wire dtype, else a ValueError naming ``knob`` and the choices."""
    if value not in WIRE_DTYPES:
        raise ValueError(f"{knob} = {value!r}: expected one of {', '.join(WIRE_DTYPES)} (uint8: resized images, "
                         "normalised on the device; float32: normalised pixel values, MindIE's form)")
    return value


@dataclass(frozen=True)
class PixelNormalization:
    """``(x * rescale_factor - mean) / std`` per RGB channel, folded to ``x * scale + offset``.

    The fold is computed once, in float64, and rounded to float32 (``scale = rescale / std``,
    ``offset = -mean / std``), so each value is two float32 roundings of the exact result and stays
    within a few ulps (~5e-7) of transformers' step-by-step float32 arithmetic. Both sides apply
    exactly these two float32 operations, a multiply and then an add (never fused), which is why
    the device's result on CPU equals the frontend's bit for bit.
    """

    image_mean: tuple[float, float, float] = OPENAI_CLIP_MEAN
    image_std: tuple[float, float, float] = OPENAI_CLIP_STD
    rescale_factor: float = 1 / 255

    def __post_init__(self) -> None:
        object.__setattr__(self, "image_mean", _three_floats("image_mean", self.image_mean))
        std = _three_floats("image_std", self.image_std)
        if min(std) <= 0:
            raise ValueError(f"image_std entries must be > 0, got {std}")
        object.__setattr__(self, "image_std", std)
        factor = self.rescale_factor
        if isinstance(factor, bool) or not isinstance(factor, numbers.Real):
            raise ValueError(f"rescale_factor must be a number, got {type(factor).__name__}")
        if not (math.isfinite(factor) and factor > 0):
            raise ValueError(f"rescale_factor must be finite and > 0, got {factor!r}")
        object.__setattr__(self, "rescale_factor", float(factor))

    # Computed once per instance (cached_property writes the instance dict, frozen or not), and
    # read-only: every caller shares the same arrays.
    @functools.cached_property
    def scale(self) -> np.ndarray:
        """float32 ``(3,)``: ``rescale_factor / std``."""
        return _frozen((self.rescale_factor / np.asarray(self.image_std, dtype=np.float64)).astype(np.float32))

    @functools.cached_property
    def offset(self) -> np.ndarray:
        """float32 ``(3,)``: ``-mean / std``."""
        mean, std = np.asarray(self.image_mean, dtype=np.float64), np.asarray(self.image_std, dtype=np.float64)
        return _frozen((-mean / std).astype(np.float32))

    @classmethod
    def from_preprocessor_config(cls, config: Mapping[str, Any]) -> PixelNormalization:
        """From a checkpoint's ``preprocessor_config.json``: ``image_mean``, ``image_std``,
        ``rescale_factor`` where present, the CLIP constants and 1/255 where not."""
        if not isinstance(config, Mapping):
            raise ValueError(f"preprocessor_config must be a dict, got {type(config).__name__}")
        keys = ("image_mean", "image_std", "rescale_factor")
        return cls(**{key: config[key] for key in keys if config.get(key) is not None})


def _frozen(array: np.ndarray) -> np.ndarray:
    array.flags.writeable = False
    return array


def _three_floats(name: str, value: Any) -> tuple[float, float, float]:
    if isinstance(value, (str, bytes)) or not hasattr(value, "__len__") or len(value) != 3:
        raise ValueError(f"{name} must have 3 elements (one per RGB channel), got {value!r}")
    out = []
    for item in value:
        if isinstance(item, bool) or not isinstance(item, numbers.Real) or not math.isfinite(item):
            raise ValueError(f"{name} must hold 3 finite numbers, got {value!r}")
        out.append(float(item))
    return tuple(out)
