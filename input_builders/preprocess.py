"""Image preprocessing for the vision-language families we serve (no torchvision).

Every preprocessor maps a decoded RGB ``PIL.Image.Image`` to what crosses shared memory, in one
of two wire dtypes (``atb_plugin.multimodal.wire``; the preprocessor's ``wire_dtype``):

* ``"uint8"`` (default): the image after the family's resize (and CLIP's centre crop), RGB,
  ``[H, W, 3]``. The model normalises (and for Qwen2-VL patchifies) on its device, with the same
  arithmetic as the float32 path below, so the encoder sees the same values bit for bit.
* ``"float32"``: C-contiguous pixel values equal (max abs diff <= 1e-5) to transformers'
  ``*ImageProcessorPil`` output for the same image and settings (MindIE's wire form):

  * Qwen-VL: bicubic resize to image_size x image_size, rescale, normalise (CLIP mean/std)
    -> ``[1, 3, S, S]``.
  * Qwen2-VL / Qwen2.5-VL: ``smart_resize`` to multiples of patch_size * merge_size within
    [min_pixels, max_pixels], bicubic, rescale, normalise, patchify in merge-window-major order
    -> ``[t*h*w, 3*T*p*p]`` plus ``grid_thw = (t, h, w)``.
  * LLaVA-1.5 / CLIP: bicubic resize so the shortest edge is shortest_edge, centre crop to
    crop_size, rescale, normalise -> ``[1, 3, crop_h, crop_w]``.

Video (Qwen2-VL / Qwen2.5-VL, ``Qwen2VLPreprocessor.preprocess_video``): frames sampled and resized
by ``input_builders.video``, uint8 ``(n, 3, H, W)`` as they are, or float32 patches in
transformers' ``Qwen2VLVideoProcessor`` layout ``[n/2*h*w, 3*2*p*p]`` (the two frames of a temporal
patch side by side in each row instead of one frame repeated).

Where the time goes, and why the code looks the way it does: the resize is Pillow's own bicubic
``Image.resize`` on the uint8 image, exactly what the Pil processors call, because only that
reproduces their output bit for bit (one uint8 step off is 1/255/std ~ 0.015, far beyond 1e-5).
At photo sizes it is a large share of the reference's time and most of the float32 path's
(benchmarks/RESULTS.md, bench_preprocess), which is why the uint8 wire (nothing after the resize
but the segment write, which Pillow packs straight into the segment: ``RgbImagePayload``) is the
default. Everything else, which the reference does as a chain
of full-size copies (RGB convert, HWC->CHW, back to PIL, float64 rescale, float32 normalise,
strided float layout), is one vectorised pass here: layout gathers on uint8, then uint8 ->
float32 with a per-channel ``x * scale + offset`` (``PixelNormalization``, folded once per
preprocessor) straight into the output layout.
``benchmarks/bench_preprocess.py`` times both wire dtypes, the reference and the resize alone.
"""

from __future__ import annotations

import math
import numbers
from abc import ABC, abstractmethod
from dataclasses import dataclass, fields
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np
import PIL
from PIL import Image

from atb_plugin.multimodal.budgets import IMAGE_MAX_PIXELS, IMAGE_MIN_PIXELS, MAX_ASPECT_RATIO
from atb_plugin.multimodal.wire import (
    DEFAULT_WIRE_DTYPE,
    OPENAI_CLIP_MEAN,
    OPENAI_CLIP_STD,
    PixelNormalization,
    check_wire_dtype,
)
from shm.segment import SegmentPayload, pwrite_all

if TYPE_CHECKING:  # annotations are strings at runtime; typing.Self needs 3.11
    from typing_extensions import Self

__all__ = [
    "OPENAI_CLIP_MEAN",
    "OPENAI_CLIP_STD",
    "ClipPreprocessor",
    "ImagePreprocessor",
    "MAX_ASPECT_RATIO",
    "PreprocessedImage",
    "Qwen2VLPreprocessor",
    "QwenVLPreprocessor",
    "RgbImagePayload",
    "smart_resize",
]

# Bumped whenever a code change alters any output for the same parameters, so that cache keys
# (the shm dedup key) of an older build never match arrays of a newer one.
_ALGORITHM_VERSION = 1

# The aspect-ratio limit of transformers' smart_resize (and of Qwen2-VL's vision tower),
# MAX_ASPECT_RATIO, and the image pixel budgets are Qwen2-VL's (atb_plugin.multimodal.budgets).

_BICUBIC = Image.Resampling.BICUBIC

# Working-set size for blocked passes: fits the L2 of the CPUs we run on (512 KiB - 2 MiB).
_BLOCK_BYTES = 1 << 20


@dataclass(frozen=True, eq=False)  # eq=False: comparing arrays field-wise is ambiguous
class PreprocessedImage:
    """What a preprocessor returns for one image, as it is written to shm (one C-contiguous block).

    ``pixel_values`` is the wire form: float32 pixel values, or the uint8 ``[H, W, 3]`` resized
    image; ``grid_thw`` is ``(grid_t, grid_h, grid_w)`` in patches for Qwen2-VL and None otherwise.
    """

    pixel_values: np.ndarray
    grid_thw: tuple[int, int, int] | None = None

    def __post_init__(self) -> None:
        values = self.pixel_values
        if not isinstance(values, np.ndarray) or values.dtype not in (np.float32, np.uint8):
            raise TypeError(f"pixel_values must be a float32 or uint8 numpy array, got {_describe(values)}")
        if not values.flags.c_contiguous:
            raise ValueError("pixel_values must be C-contiguous")
        if values.dtype == np.uint8 and not ((values.ndim == 3 and values.shape[2] == 3)
                                             or (values.ndim == 4 and values.shape[1] == 3)):
            raise ValueError(f"uint8 pixel_values must be an RGB image [H, W, 3] or video frames [t, 3, H, W], "
                             f"got shape {values.shape}")
        if self.grid_thw is not None:
            grid = tuple(self.grid_thw)
            if len(grid) != 3 or not all(_is_int(v) and v > 0 for v in grid):
                raise ValueError(f"grid_thw must be three positive ints, got {self.grid_thw!r}")
            t, h, w = (int(v) for v in grid)
            if values.dtype == np.float32 and (values.ndim != 2 or values.shape[0] != t * h * w):
                raise ValueError(
                    f"pixel_values shape {values.shape} does not hold grid_thw {grid}: "
                    f"expected {t * h * w} rows of patches"
                )
            object.__setattr__(self, "grid_thw", (t, h, w))


@dataclass(frozen=True, kw_only=True)
class ImagePreprocessor(ABC):
    """Turns one decoded image into model-ready pixel values.

    Contract:

    * input: a ``PIL.Image.Image`` in mode ``"RGB"`` (decoding, EXIF handling and alpha
      compositing belong to the media loader; any other mode is refused rather than converted
      here with a rule that may differ from the loader's);
    * output: a :class:`PreprocessedImage` in ``wire_dtype``: for ``"float32"``, pixel values
      equal to transformers' ``*ImageProcessorPil`` output for the same settings within 1e-5;
      for ``"uint8"``, the resized (cropped) RGB image those values are computed from;
    * deterministic: the same image and parameters give the same bytes, in any process;
    * immutable and thread-safe: instances hold no mutable state, so one instance can serve
      concurrent requests (Pillow releases the GIL while resizing).

    Subclasses are frozen dataclasses: every dataclass field is a parameter that affects the
    output, which is what :meth:`cache_key` relies on. A subclass implements
    :meth:`_preprocess` and :meth:`from_config`, reusing the shared resize and normalise helpers.
    """

    family: ClassVar[str]

    image_mean: tuple[float, float, float] = OPENAI_CLIP_MEAN
    image_std: tuple[float, float, float] = OPENAI_CLIP_STD
    rescale_factor: float = 1 / 255
    # What crosses shm (part of the cache key, so the two forms never share a segment).
    wire_dtype: str = DEFAULT_WIRE_DTYPE

    def __post_init__(self) -> None:
        check_wire_dtype(self.wire_dtype, "wire_dtype")
        # The rule the device applies to uint8 images too (one definition: PixelNormalization).
        norm = PixelNormalization(self.image_mean, self.image_std, self.rescale_factor)
        for name in ("image_mean", "image_std", "rescale_factor"):
            object.__setattr__(self, name, getattr(norm, name))
        object.__setattr__(self, "_normalization", norm)

    def __call__(self, image: Image.Image) -> PreprocessedImage:
        return self._preprocess(self._checked(image))

    def shm_payload(self, image: Image.Image) -> tuple[np.ndarray | SegmentPayload, tuple[int, int, int] | None]:
        """What crosses shared memory for ``image`` (for ``ShmStore.put``) and its ``grid_thw``:
        ``self(image)``'s pixel values and grid. A family whose uint8 wire form is the resized
        image as it is overrides this to hand that image over unpacked (``RgbImagePayload``), the
        segment's bytes the same."""
        processed = self(image)
        return processed.pixel_values, processed.grid_thw

    def _checked(self, image: Image.Image) -> Image.Image:
        """``image`` if it is what every preprocessor takes (the class docstring's contract)."""
        if not isinstance(image, Image.Image):
            raise TypeError(f"expected a PIL.Image.Image, got {_describe(image)}")
        if image.mode != "RGB":
            raise ValueError(
                f"expected an RGB image, got mode {image.mode!r}: convert it in the media loader "
                "(transformers composites transparency onto white before preprocessing)"
            )
        width, height = image.size
        if width < 1 or height < 1:
            raise ValueError(f"image has no pixels: {width}x{height}")
        return image

    @abstractmethod
    def _preprocess(self, image: Image.Image) -> PreprocessedImage:
        """The family's steps, for a validated RGB image."""

    def cache_key(self) -> str:
        """A stable string of every parameter that affects the output (part of the shm dedup key).

        Built from the dataclass fields in declaration order with ``repr`` of each value (floats
        print their shortest round-trip form), plus the family, the algorithm version and the
        Pillow version (the resize is Pillow's). Nothing in it depends on hash seeds or ids, so
        two processes with the same parameters agree.
        """
        parts = [f"{self.family}/v{_ALGORITHM_VERSION}"]
        for spec in fields(self):
            value = getattr(self, spec.name)
            text = ",".join(repr(v) for v in value) if isinstance(value, tuple) else repr(value)
            parts.append(f"{spec.name}={text}")
        parts.append(f"pillow={PIL.__version__}")
        return ";".join(parts)

    @classmethod
    @abstractmethod
    def from_config(cls, preprocessor_config: Mapping[str, Any]) -> Self:
        """Build from the contents of the checkpoint's preprocessing config."""

    # Shared steps -------------------------------------------------------------------------

    def _normalize(self, pixels: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
        """uint8 ``[..., 3, rows, cols]`` (any strides) -> float32 ``x * scale + offset``.

        The cast happens inside the multiply's buffered loop, so a strided uint8 view (a crop,
        a transposed layout) is read once and written once in the destination layout.
        """
        scale = self._normalization.scale[:, None, None]
        offset = self._normalization.offset[:, None, None]
        out = np.multiply(pixels, scale, out=out, dtype=np.float32)
        out += offset
        return out

    @property
    def normalization(self) -> PixelNormalization:
        """The rescale + normalise rule (the model side of the uint8 wire applies the same)."""
        return self._normalization

    def _chw_output(self, hwc: np.ndarray) -> PreprocessedImage:
        """uint8 HWC (possibly a crop view) -> the uint8 image, or float32 ``[1, 3, H, W]``."""
        if self.wire_dtype == "uint8":
            return PreprocessedImage(np.ascontiguousarray(hwc))
        height, width, _ = hwc.shape
        out = np.empty((1, 3, height, width), dtype=np.float32)
        self._normalize(hwc.transpose(2, 0, 1), out=out[0])
        return PreprocessedImage(out)


@dataclass(frozen=True, kw_only=True)
class QwenVLPreprocessor(ImagePreprocessor):
    """Qwen-VL (the first one): bicubic resize to ``image_size`` x ``image_size``, no crop.

    Qwen-VL's own code is torchvision ``Resize((448, 448), BICUBIC)`` on the PIL image, ToTensor,
    Normalize(OpenAI CLIP mean/std), i.e. ``CLIPImageProcessorPil`` with
    ``size={"height": 448, "width": 448}`` and ``do_center_crop=False``, which is what the
    parity tests compare against.
    """

    family: ClassVar[str] = "qwen_vl"

    image_size: int = 448

    def __post_init__(self) -> None:
        _check_positive_int("image_size", self.image_size)
        super().__post_init__()

    def _preprocess(self, image: Image.Image) -> PreprocessedImage:
        resized = _resize_bicubic(image, self.image_size, self.image_size)
        return self._chw_output(np.asarray(resized))

    @classmethod
    def from_config(cls, preprocessor_config: Mapping[str, Any]) -> Self:
        """From the ``"visual"`` dict of Qwen-VL's ``config.json`` (the whole config.json is
        accepted too). Only ``image_size`` is read: mean, std and the 1/255 rescale are fixed in
        Qwen-VL's code, not in the checkpoint."""
        if not isinstance(preprocessor_config, Mapping):
            raise ValueError(
                f"preprocessor_config must be a dict, got {_describe(preprocessor_config)}"
            )
        visual = preprocessor_config.get("visual", preprocessor_config)
        if not isinstance(visual, Mapping):
            raise ValueError(f"visual must be a dict, got {_describe(visual)}")
        return cls(image_size=visual.get("image_size", cls.image_size))


@dataclass(frozen=True, kw_only=True)
class Qwen2VLPreprocessor(ImagePreprocessor):
    """Qwen2-VL / Qwen2.5-VL: ``smart_resize``, bicubic, normalise, patchify.

    ``pixel_values`` has one row per ``patch_size`` x ``patch_size`` patch, rows ordered
    merge-window-major (the ``merge_size`` x ``merge_size`` patches the vision tower merges into
    one LLM token are consecutive), each row ``channel, temporal, patch_row, patch_col``. A still
    image is one frame repeated ``temporal_patch_size`` times, so ``grid_t == 1``.

    Defaults are transformers' ``Qwen2VLImageProcessor`` defaults (note: real checkpoints ship
    ``max_pixels = 12845056``; use :meth:`from_config`).
    """

    family: ClassVar[str] = "qwen2_vl"

    min_pixels: int = IMAGE_MIN_PIXELS
    max_pixels: int = IMAGE_MAX_PIXELS
    patch_size: int = 14
    temporal_patch_size: int = 2
    merge_size: int = 2

    def __post_init__(self) -> None:
        for name in ("min_pixels", "max_pixels", "patch_size", "temporal_patch_size", "merge_size"):
            _check_positive_int(name, getattr(self, name))
        if self.min_pixels > self.max_pixels:
            raise ValueError(
                f"min_pixels ({self.min_pixels}) must be <= max_pixels ({self.max_pixels})"
            )
        super().__post_init__()

    @property
    def factor(self) -> int:
        """Resized sides are multiples of this: one merge window of patches."""
        return self.patch_size * self.merge_size

    def smart_resize(self, height: int, width: int) -> tuple[int, int]:
        """``(resized_height, resized_width)`` for an image of this size, with our parameters."""
        return smart_resize(height, width, self.factor, self.min_pixels, self.max_pixels)

    def num_image_tokens(self, grid_thw: tuple[int, int, int]) -> int:
        """LLM tokens for an image of ``grid_thw`` patches: a merge window is one token."""
        t, h, w = grid_thw
        return t * h * w // self.merge_size**2

    def _resized(self, image: Image.Image) -> tuple[Image.Image, tuple[int, int, int]]:
        """The image resized by ``smart_resize``, and its ``grid_thw``."""
        width, height = image.size
        resized_height, resized_width = self.smart_resize(height, width)
        grid = (1, resized_height // self.patch_size, resized_width // self.patch_size)
        return _resize_bicubic(image, resized_width, resized_height), grid

    def shm_payload(self, image: Image.Image) -> tuple[np.ndarray | SegmentPayload, tuple[int, int, int] | None]:
        if self.wire_dtype != "uint8":
            return super().shm_payload(image)
        # The uint8 wire is the resized image alone: Pillow packs it into the segment itself
        # (benchmarks/RESULTS.md, bench_qwen3_vl.py's second round).
        resized, grid = self._resized(self._checked(image))
        return RgbImagePayload(resized), grid

    def _preprocess(self, image: Image.Image) -> PreprocessedImage:
        resized, (_, grid_h, grid_w) = self._resized(image)
        hwc = np.asarray(resized)
        p, m, t = self.patch_size, self.merge_size, self.temporal_patch_size
        if self.wire_dtype == "uint8":  # the device patchifies (atb_plugin.multimodal.pixels)
            return PreprocessedImage(np.ascontiguousarray(hwc), grid_thw=(1, grid_h, grid_w))
        num_patches = grid_h * grid_w
        # transformers reshapes CHW to (C, gh/m, m, p, gw/m, m, p) and transposes to
        # (gh/m, gw/m, m, m, C, p, p). We start from HWC, hence the different axis numbers for
        # the same target order. The gather runs on uint8 (4x fewer bytes than float32, and a
        # strided float gather is the slowest step of the reference), so every float pass
        # below reads and writes contiguously.
        window_rows = grid_h // m  # rows of merge windows
        windows = hwc.reshape(window_rows, m, p, grid_w // m, m, p, 3).transpose(0, 3, 1, 4, 6, 2, 5)
        patches = np.ascontiguousarray(windows).reshape(window_rows, -1, 3, p, p)
        if t == 1:
            pixel_values = self._normalize(patches)
        else:
            # The temporal repeat sits between channel and patch rows, so the normalised frame
            # is written t times. Done a few window rows at a time so the frame (half the output
            # at t=2) stays in L2 between its normalise and its copies instead of going through
            # memory (a measurable share of this step at photo sizes: benchmarks/RESULTS.md,
            # bench_preprocess).
            pixel_values = np.empty((*patches.shape[:3], t, p, p), dtype=np.float32)
            row_bytes = patches[0].size * 4
            step = max(1, _BLOCK_BYTES // row_bytes)
            frame = np.empty((min(step, window_rows), *patches.shape[1:]), dtype=np.float32)
            for start in range(0, window_rows, step):
                block = frame[: min(step, window_rows - start)]
                self._normalize(patches[start : start + len(block)], out=block)
                pixel_values[start : start + len(block)] = block[:, :, :, None]
        pixel_values = pixel_values.reshape(num_patches, 3 * t * p * p)
        return PreprocessedImage(pixel_values, grid_thw=(1, grid_h, grid_w))

    def preprocess_video(self, frames: np.ndarray) -> PreprocessedImage:
        """Video frames, already sampled and resized (``input_builders.video``), uint8
        ``(n, 3, H, W)`` with ``n`` a multiple of ``temporal_patch_size`` -> the wire form with
        ``grid_thw = (n / T, H / p, W / p)``: the frames as they are (uint8; the device patchifies)
        or float32 patches in transformers' ``Qwen2VLVideoProcessor.patchify`` order, rows
        ``(t, window row, window col, row in window, col in window)``, each row
        ``(channel, frame in the temporal patch, pixel row, pixel col)``."""
        if not isinstance(frames, np.ndarray) or frames.dtype != np.uint8 or frames.ndim != 4 or frames.shape[1] != 3:
            raise ValueError(f"expected uint8 video frames [n, 3, H, W], got {_describe(frames)} "
                             f"{getattr(frames, 'shape', '')}")
        count, _, height, width = frames.shape
        p, m, t = self.patch_size, self.merge_size, self.temporal_patch_size
        if count % t or height % (p * m) or width % (p * m) or not count:
            raise ValueError(f"video frames {frames.shape}: need a multiple of {t} frames and sides that are "
                             f"multiples of {p * m}")
        grid = (count // t, height // p, width // p)
        if self.wire_dtype == "uint8":
            return PreprocessedImage(np.ascontiguousarray(frames), grid_thw=grid)
        grid_t, grid_h, grid_w = grid
        # (n, 3, H, W) -> (gt, T, 3, gh/m, m, p, gw/m, m, p) -> (gt, gh/m, gw/m, m, m, 3, T, p, p):
        # the gather on uint8, then one normalising pass into the float32 output.
        patches = frames.reshape(grid_t, t, 3, grid_h // m, m, p, grid_w // m, m, p)
        patches = np.ascontiguousarray(patches.transpose(0, 3, 6, 4, 7, 2, 1, 5, 8))
        flat = patches.reshape(-1, 3, t * p, p)  # rows x channel x (frame, pixel row) x pixel col
        values = self._normalize(flat)
        return PreprocessedImage(values.reshape(grid_t * grid_h * grid_w, 3 * t * p * p), grid_thw=grid)

    @classmethod
    def from_config(cls, preprocessor_config: Mapping[str, Any]) -> Self:
        """From ``preprocessor_config.json``. Pixel bounds follow transformers' precedence:
        top-level ``min_pixels``/``max_pixels``, then ``size.shortest_edge``/``longest_edge``
        (which hold pixel counts for this family), then ``size.min_pixels``/``max_pixels``."""
        config = _check_common_config(preprocessor_config, cls.family)
        size = config.get("size") or {}
        if not isinstance(size, Mapping):
            raise ValueError(f"size must be a dict for {cls.family}, got {_describe(size)}")
        kwargs = _common_kwargs(config)
        for key, size_keys in (
            ("min_pixels", ("shortest_edge", "min_pixels")),
            ("max_pixels", ("longest_edge", "max_pixels")),
        ):
            value = config.get(key)
            for size_key in size_keys:
                if value is None:
                    value = size.get(size_key)
            if value is not None:
                kwargs[key] = value
        for key in ("patch_size", "temporal_patch_size", "merge_size"):
            if config.get(key) is not None:
                kwargs[key] = config[key]
        return cls(**kwargs)


@dataclass(frozen=True, kw_only=True)
class ClipPreprocessor(ImagePreprocessor):
    """LLaVA-1.5 / CLIP: bicubic resize so the shortest edge is ``shortest_edge``, centre crop.

    Defaults are LLaVA-1.5's (CLIP ViT-L/14-336): shortest edge 336, crop 336 x 336.
    """

    family: ClassVar[str] = "clip"

    shortest_edge: int = 336
    crop_height: int = 336
    crop_width: int = 336

    def __post_init__(self) -> None:
        for name in ("shortest_edge", "crop_height", "crop_width"):
            _check_positive_int(name, getattr(self, name))
        super().__post_init__()

    def resized_size(self, height: int, width: int) -> tuple[int, int]:
        """``(height, width)`` after the shortest-edge resize: transformers'
        ``get_resize_output_image_size(default_to_square=False)`` rule, truncation included."""
        short, long = (width, height) if width <= height else (height, width)
        new_short, new_long = self.shortest_edge, int(self.shortest_edge * long / short)
        return (new_long, new_short) if width <= height else (new_short, new_long)

    def _preprocess(self, image: Image.Image) -> PreprocessedImage:
        width, height = image.size
        resized_height, resized_width = self.resized_size(height, width)
        # The whole image is resized, then cropped, as the reference does. Resizing only the
        # columns the crop keeps would be cheaper but is not bit-identical: Pillow's two resize
        # passes do not round-trip through uint8 (splitting them into two calls differs by one
        # step on many random geometries: benchmarks/RESULTS.md, bench_preprocess).
        hwc = np.asarray(_resize_bicubic(image, resized_width, resized_height))
        return self._chw_output(_center_crop(hwc, self.crop_height, self.crop_width))

    @classmethod
    def from_config(cls, preprocessor_config: Mapping[str, Any]) -> Self:
        """From ``preprocessor_config.json``: ``size`` as ``{"shortest_edge": n}`` or an int,
        ``crop_size`` as ``{"height": h, "width": w}`` or an int (older configs)."""
        config = _check_common_config(preprocessor_config, cls.family)
        if config.get("do_center_crop", True) is not True:
            raise ValueError("do_center_crop must be true for clip: the crop is part of the family")
        kwargs = _common_kwargs(config)
        size = config.get("size")
        if size is not None:
            if isinstance(size, Mapping):
                if set(size) != {"shortest_edge"}:
                    raise ValueError(
                        f"size must be {{'shortest_edge': n}} for clip, got {dict(size)!r}"
                    )
                size = size["shortest_edge"]
            kwargs["shortest_edge"] = size
        crop = config.get("crop_size")
        if crop is not None:
            if isinstance(crop, Mapping):
                if set(crop) != {"height", "width"}:
                    raise ValueError(
                        f"crop_size must be {{'height': h, 'width': w}}, got {dict(crop)!r}"
                    )
                kwargs["crop_height"], kwargs["crop_width"] = crop["height"], crop["width"]
            else:
                kwargs["crop_height"] = kwargs["crop_width"] = crop
        return cls(**kwargs)


def smart_resize(
    height: int,
    width: int,
    factor: int = 28,
    min_pixels: int = IMAGE_MIN_PIXELS,
    max_pixels: int = IMAGE_MAX_PIXELS,
) -> tuple[int, int]:
    """``(height, width)`` rounded to multiples of ``factor``, scaled into
    ``[min_pixels, max_pixels]`` keeping the aspect ratio as well as the rounding allows.

    The same rule, float expressions and Python ``round`` (half to even) as transformers'
    ``qwen2_vl`` ``smart_resize``, so the two agree on every input; ours also refuses
    non-positive sides and says which image it refuses.
    """
    for name, value in (("height", height), ("width", width), ("factor", factor)):
        _check_positive_int(name, value)
    ratio = max(height, width) / min(height, width)
    if ratio > MAX_ASPECT_RATIO:
        raise ValueError(
            f"image aspect ratio must be at most {MAX_ASPECT_RATIO}, got {ratio:.1f} "
            f"(height={height}, width={width})"
        )
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt((height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


class RgbImagePayload(SegmentPayload):
    """An RGB ``PIL.Image`` as a uint8 ``[H, W, 3]`` segment payload: Pillow's raw encoder packs
    the rows (its pixels are 4 bytes wide inside) a block at a time, each block written to the
    segment at once, so the bytes ``np.asarray(image)`` would hold reach the segment without that
    image-sized array, its join and its copy."""

    dtype = np.dtype(np.uint8)

    def __init__(self, image: Image.Image):
        if image.mode != "RGB":
            raise ValueError(f"RgbImagePayload takes an RGB image, got mode {image.mode!r}")
        self.image = image
        self.shape = (image.height, image.width, 3)

    def write_to(self, fd: int, offset: int) -> int:
        self.image.load()
        # What Image.tobytes() does, block by block (its encoder, its block floor of 4 bytes per
        # pixel of a row: RawEncode.c packs whole rows only).
        encoder = Image._getencoder("RGB", "raw", "RGB")
        start = offset
        try:
            encoder.setimage(self.image.im, (0, 0, *self.image.size))
            while True:
                _, status, block = encoder.encode(max(_BLOCK_BYTES, self.image.width * 4))
                pwrite_all(fd, block, offset)
                offset += len(block)
                if status:
                    break
        finally:
            encoder.cleanup()
        if status < 0:
            raise RuntimeError(f"Pillow's raw encoder failed (error {status}) packing a {self.image.size} image")
        return offset - start


# Helpers ------------------------------------------------------------------------------------


def _resize_bicubic(image: Image.Image, width: int, height: int) -> Image.Image:
    """Pillow bicubic on the uint8 image: the very call the Pil processors make (they turn their
    CHW uint8 array back into a PIL image, resize, and take the array again)."""
    if image.size == (width, height):
        return image  # Pillow would return an identical copy
    return image.resize((width, height), _BICUBIC)


def _center_crop(hwc: np.ndarray, crop_h: int, crop_w: int) -> np.ndarray:
    """transformers' ``center_crop`` on uint8 HWC, returning a view when the crop fits.

    When the crop is larger than the image, the image is centred on zeros exactly as
    transformers pads (before normalising, so padding becomes ``-mean/std``); no shipped config
    does this (crop_size <= shortest_edge), but the rule is cheap to keep identical.
    """
    height, width, _ = hwc.shape
    top = (height - crop_h) // 2
    left = (width - crop_w) // 2
    if top >= 0 and left >= 0 and top + crop_h <= height and left + crop_w <= width:
        return hwc[top : top + crop_h, left : left + crop_w]
    new_h, new_w = max(crop_h, height), max(crop_w, width)
    top_pad, left_pad = math.ceil((new_h - height) / 2), math.ceil((new_w - width) / 2)
    canvas = np.zeros((new_h, new_w, 3), dtype=np.uint8)
    canvas[top_pad : top_pad + height, left_pad : left_pad + width] = hwc
    top, left = top + top_pad, left + left_pad
    return canvas[max(0, top) : min(new_h, top + crop_h), max(0, left) : min(new_w, left + crop_w)]


def _check_common_config(config: Mapping[str, Any], family: str) -> Mapping[str, Any]:
    """Refuse settings we do not implement instead of silently preprocessing differently."""
    if not isinstance(config, Mapping):
        raise ValueError(f"preprocessor_config must be a dict, got {_describe(config)}")
    for flag in ("do_resize", "do_rescale", "do_normalize"):
        if config.get(flag, True) is not True:
            raise ValueError(f"{flag} must be true for {family} (got {config[flag]!r})")
    resample = config.get("resample", int(_BICUBIC))
    if resample != int(_BICUBIC) or isinstance(resample, bool):
        raise ValueError(
            f"resample must be {int(_BICUBIC)} (bicubic) for {family}, got {resample!r}"
        )
    return config


def _common_kwargs(config: Mapping[str, Any]) -> dict[str, Any]:
    norm = PixelNormalization.from_preprocessor_config(config)  # the keys the device reads too
    return {"image_mean": norm.image_mean, "image_std": norm.image_std, "rescale_factor": norm.rescale_factor}


def _check_positive_int(name: str, value: Any) -> None:
    if not _is_int(value) or value <= 0:
        raise ValueError(f"{name} must be a positive int, got {value!r}")


def _is_int(value: Any) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _describe(value: Any) -> str:
    if isinstance(value, np.ndarray):
        return f"ndarray of {value.dtype}"
    return type(value).__name__
