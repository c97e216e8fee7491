"""input_builders.preprocess: parity with transformers' Pil image processors, smart_resize,
patch layout, config parsing and validation, cache keys.

Parity means max abs diff <= 1e-5 against ``Qwen2VLImageProcessorPil`` / ``CLIPImageProcessorPil``
with the same settings for the float32 wire form, and, for the uint8 wire form, that the device
side (``atb_plugin.multimodal.pixels``, torch on CPU) turns the uint8 image into exactly the
float32 path's values, bit for bit (same two float32 operations per element). The images are
mostly uniform noise: it exercises every value, the bicubic overshoot clipping at 0 and 255, and
makes any misplaced patch or channel show.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import fields, replace
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from PIL import Image
from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize as hf_smart_resize

from atb_plugin.multimodal.pixels import ChwImageFormat, PixelFormat, Qwen2VLPatchFormat
from input_builders.preprocess import (
    OPENAI_CLIP_MEAN,
    OPENAI_CLIP_STD,
    ClipPreprocessor,
    ImagePreprocessor,
    PreprocessedImage,
    Qwen2VLPreprocessor,
    QwenVLPreprocessor,
    smart_resize,
)

TOL = 1e-5
REPO = Path(__file__).resolve().parents[1]

# (width, height): tiny, odd, square, photo sizes, and near the 200:1 aspect limit.
SIZES = [
    (1, 1),
    (30, 17),
    (17, 30),
    (333, 501),
    (448, 448),
    (1280, 720),
    (1920, 1080),
    (1999, 10),
    (10, 1999),
]
SOURCE_MODES = ["L", "LA", "RGBA", "P", "CMYK", "YCbCr", "I;16"]

# Real checkpoint configs (preprocessor_config.json contents, trimmed to what matters).
QWEN2_VL_CONFIG = {
    "min_pixels": 3136,
    "max_pixels": 12845056,
    "patch_size": 14,
    "temporal_patch_size": 2,
    "merge_size": 2,
    "image_mean": [0.48145466, 0.4578275, 0.40821073],
    "image_std": [0.26862954, 0.26130258, 0.27577711],
    "image_processor_type": "Qwen2VLImageProcessor",
    "processor_class": "Qwen2VLProcessor",
}
LLAVA_15_CONFIG = {
    "crop_size": {"height": 336, "width": 336},
    "do_center_crop": True,
    "do_convert_rgb": True,
    "do_normalize": True,
    "do_rescale": True,
    "do_resize": True,
    "image_mean": [0.48145466, 0.4578275, 0.40821073],
    "image_processor_type": "CLIPImageProcessor",
    "image_std": [0.26862954, 0.26130258, 0.27577711],
    "processor_class": "LlavaProcessor",
    "resample": 3,
    "rescale_factor": 0.00392156862745098,
    "size": {"shortest_edge": 336},
}
QWEN_VL_VISUAL = {"heads": 16, "image_size": 448, "layers": 48, "patch_size": 14, "width": 1664}


def noise_image(width: int, height: int, seed: int = 0) -> Image.Image:
    rng = np.random.default_rng([width, height, seed])
    return Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8), "RGB")


def image_from_mode(mode: str, width: int = 123, height: int = 77) -> Image.Image:
    """A noise image created in ``mode`` and converted to RGB the way a loader would."""
    rng = np.random.default_rng([width, height, len(mode)])
    if mode == "L":
        source = Image.fromarray(rng.integers(0, 256, (height, width), dtype=np.uint8), "L")
    elif mode in ("LA", "RGBA", "CMYK"):
        channels = len(mode)
        source = Image.fromarray(rng.integers(0, 256, (height, width, channels), dtype=np.uint8), mode)
    elif mode == "P":
        source = noise_image(width, height).convert("P", palette=Image.Palette.ADAPTIVE)
    elif mode == "YCbCr":
        source = noise_image(width, height).convert("YCbCr")
    elif mode == "I;16":  # 16-bit greyscale PNGs; values past 255 clip when converted
        source = Image.fromarray(rng.integers(0, 400, (height, width), dtype=np.uint16))
    else:
        raise AssertionError(mode)
    assert source.mode == mode
    return source.convert("RGB")


def reference_qwen2(ours: Qwen2VLPreprocessor) -> Qwen2VLImageProcessorPil:
    return Qwen2VLImageProcessorPil(
        min_pixels=ours.min_pixels,
        max_pixels=ours.max_pixels,
        patch_size=ours.patch_size,
        temporal_patch_size=ours.temporal_patch_size,
        merge_size=ours.merge_size,
        image_mean=list(ours.image_mean),
        image_std=list(ours.image_std),
        rescale_factor=ours.rescale_factor,
    )


def reference_clip(ours: ClipPreprocessor) -> CLIPImageProcessorPil:
    return CLIPImageProcessorPil(
        size={"shortest_edge": ours.shortest_edge},
        crop_size={"height": ours.crop_height, "width": ours.crop_width},
        image_mean=list(ours.image_mean),
        image_std=list(ours.image_std),
        rescale_factor=ours.rescale_factor,
    )


def reference_qwen_vl(ours: QwenVLPreprocessor) -> CLIPImageProcessorPil:
    return CLIPImageProcessorPil(
        size={"height": ours.image_size, "width": ours.image_size},
        do_center_crop=False,
        image_mean=list(ours.image_mean),
        image_std=list(ours.image_std),
        rescale_factor=ours.rescale_factor,
    )


REFERENCES = {
    Qwen2VLPreprocessor: reference_qwen2,
    ClipPreprocessor: reference_clip,
    QwenVLPreprocessor: reference_qwen_vl,
}
_reference_cache: dict = {}


def device_format(ours: ImagePreprocessor) -> PixelFormat:
    """The model-side pixel format matching ``ours`` (what the family's model builds from its
    config and preprocessor_config.json)."""
    if isinstance(ours, Qwen2VLPreprocessor):
        return Qwen2VLPatchFormat(ours.normalization, ours.patch_size, ours.temporal_patch_size, ours.merge_size)
    if isinstance(ours, ClipPreprocessor):
        return ChwImageFormat(ours.normalization, ours.crop_height, ours.crop_width)
    return ChwImageFormat(ours.normalization, ours.image_size, ours.image_size)


def assert_parity(ours: ImagePreprocessor, image: Image.Image) -> PreprocessedImage:
    """Ours (float32 wire) equals the reference for this image within TOL, and the uint8 wire
    normalised by the device code equals it bit for bit; returns the float32 result."""
    ours = replace(ours, wire_dtype="float32")
    if ours not in _reference_cache:  # preprocessors are frozen, hashable dataclasses
        _reference_cache[ours] = REFERENCES[type(ours)](ours)
    expected = _reference_cache[ours](image, return_tensors="np")
    got = ours(image)
    values = got.pixel_values
    assert values.dtype == np.float32 and values.flags.c_contiguous
    assert values.shape == expected["pixel_values"].shape
    diff = float(np.max(np.abs(values - expected["pixel_values"])))
    assert diff <= TOL, f"{type(ours).__name__} {image.size}: max abs diff {diff}"
    if isinstance(ours, Qwen2VLPreprocessor):
        assert got.grid_thw == tuple(int(v) for v in expected["image_grid_thw"][0])
    else:
        assert got.grid_thw is None
    wire = replace(ours, wire_dtype="uint8")(image)
    assert wire.pixel_values.dtype == np.uint8 and wire.pixel_values.flags.c_contiguous
    assert wire.grid_thw == got.grid_thw
    on_device = device_format(ours).encoder_input(torch.tensor(wire.pixel_values), wire.grid_thw, torch.float32)
    assert on_device.shape == values.shape
    assert np.array_equal(on_device.numpy().view(np.uint32), values.view(np.uint32)), (
        f"{type(ours).__name__} {image.size}: the device's uint8 path differs from the float32 path")
    return got


QWEN2_DEFAULT = Qwen2VLPreprocessor()  # transformers' defaults: 56*56 .. 28*28*1280 pixels
LLAVA = ClipPreprocessor()  # LLaVA-1.5: 336 / 336
QWEN_VL = QwenVLPreprocessor()
FAMILIES = [QWEN2_DEFAULT, LLAVA, QWEN_VL]
FAMILY_IDS = ["qwen2_vl", "clip", "qwen_vl"]
CLASSES = (Qwen2VLPreprocessor, ClipPreprocessor, QwenVLPreprocessor)


# --- parity --------------------------------------------------------------------------------


@pytest.mark.parametrize("size", SIZES, ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("preprocessor", FAMILIES, ids=FAMILY_IDS)
def test_parity_over_sizes(preprocessor, size):
    if isinstance(preprocessor, ClipPreprocessor) and max(size) / min(size) > 100:
        # Shortest edge 336 would make a 200:1 image 67166 px long: slow for both and nothing
        # new; 50:1 (16800 px) instead.
        size = (700, 14) if size[0] > size[1] else (14, 700)
    assert_parity(preprocessor, noise_image(*size))


@pytest.mark.parametrize("mode", SOURCE_MODES)
@pytest.mark.parametrize("preprocessor", FAMILIES, ids=FAMILY_IDS)
def test_parity_over_source_modes(preprocessor, mode):
    assert_parity(preprocessor, image_from_mode(mode))


@pytest.mark.parametrize(
    "preprocessor",
    [
        Qwen2VLPreprocessor.from_config(QWEN2_VL_CONFIG),  # real max_pixels: little downscaling
        Qwen2VLPreprocessor(min_pixels=28 * 28 * 4, max_pixels=28 * 28 * 16),  # strong downscale
        Qwen2VLPreprocessor(temporal_patch_size=1),
        Qwen2VLPreprocessor(temporal_patch_size=3),
        Qwen2VLPreprocessor(patch_size=16, merge_size=2, max_pixels=32 * 32 * 300),
        Qwen2VLPreprocessor(merge_size=1),
        Qwen2VLPreprocessor(image_mean=(0.5, 0.5, 0.5), image_std=(0.5, 0.5, 0.5)),
        ClipPreprocessor(shortest_edge=56, crop_height=56, crop_width=56),  # tiny test config
        ClipPreprocessor(shortest_edge=64, crop_height=48, crop_width=60),  # non-square crop
        ClipPreprocessor(shortest_edge=56, crop_height=64, crop_width=50),  # crop > image: pads
        ClipPreprocessor(shortest_edge=224, crop_height=224, crop_width=224, rescale_factor=1 / 256),
        QwenVLPreprocessor(image_size=224),
    ],
    ids=repr,
)
@pytest.mark.parametrize("size", [(30, 17), (1280, 720), (333, 501)], ids=lambda s: f"{s[0]}x{s[1]}")
def test_parity_over_configs(preprocessor, size):
    assert_parity(preprocessor, noise_image(*size, seed=1))


def test_parity_on_a_smooth_image():
    """A photo-like gradient, not just noise: no clipping anywhere, many equal neighbours."""
    y, x = np.mgrid[0:720, 0:1280]
    rgb = np.stack([x * 255 // 1279, y * 255 // 719, (x + y) * 255 // 1998], axis=-1)
    image = Image.fromarray(rgb.astype(np.uint8), "RGB")
    for preprocessor in FAMILIES:
        assert_parity(preprocessor, image)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    width=st.integers(1, 160),
    height=st.integers(1, 160),
    shortest_edge=st.integers(1, 48),
    crop_height=st.integers(1, 56),
    crop_width=st.integers(1, 56),
)
def test_clip_parity_property(width, height, shortest_edge, crop_height, crop_width):
    """Small random geometries, both orientations, crops that fit and crops that pad: covers the
    output-size truncation rule and the crop/pad offsets."""
    preprocessor = ClipPreprocessor(
        shortest_edge=shortest_edge, crop_height=crop_height, crop_width=crop_width
    )
    assert_parity(preprocessor, noise_image(width, height))


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(width=st.integers(1, 300), height=st.integers(1, 300), t=st.sampled_from([1, 2]))
def test_qwen2_parity_property(width, height, t):
    assume(max(width, height) / min(width, height) <= 200)
    preprocessor = Qwen2VLPreprocessor(max_pixels=28 * 28 * 64, temporal_patch_size=t)
    assert_parity(preprocessor, noise_image(width, height))


# --- Qwen2-VL geometry ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("size", "grid"),
    [
        ((448, 448), (1, 32, 32)),
        ((1280, 720), (1, 52, 92)),
        ((30, 17), (1, 4, 6)),
        ((1920, 1080), (1, 52, 94)),
    ],
)
def test_qwen2_grid_and_patch_count(size, grid):
    got = replace(QWEN2_DEFAULT, wire_dtype="float32")(noise_image(*size))
    t, h, w = grid
    assert got.grid_thw == grid
    assert got.pixel_values.shape == (t * h * w, 3 * 2 * 14 * 14)
    wire = QWEN2_DEFAULT(noise_image(*size))  # the default: the resized image, 8x fewer bytes
    assert wire.grid_thw == grid and wire.pixel_values.shape == (h * 14, w * 14, 3)
    assert got.pixel_values.nbytes == 8 * wire.pixel_values.nbytes
    assert QWEN2_DEFAULT.num_image_tokens(got.grid_thw) == t * h * w // 4
    height, width = QWEN2_DEFAULT.smart_resize(size[1], size[0])
    assert (height // 14, width // 14) == (h, w)


def test_qwen2_patch_order_is_merge_window_major():
    """Independent of the reference: rows 0-3 are the 2x2 window at the top-left (row-major
    inside it), row 4 starts the next window to the right; each row is channel, time, y, x."""
    image = noise_image(56, 56)  # 56x56 is already a valid size: no resize
    got = replace(QWEN2_DEFAULT, wire_dtype="float32")(image)
    assert got.grid_thw == (1, 4, 4)
    mean = np.asarray(OPENAI_CLIP_MEAN, np.float64)
    std = np.asarray(OPENAI_CLIP_STD, np.float64)
    normalized = ((np.asarray(image) / 255.0 - mean) / std).transpose(2, 0, 1)  # CHW
    rows = got.pixel_values.reshape(16, 3, 2, 14, 14)
    for row, (y, x) in enumerate([(0, 0), (0, 14), (14, 0), (14, 14), (0, 28), (0, 42)]):
        expected = normalized[:, y : y + 14, x : x + 14]
        for frame in range(2):  # the still image is repeated over temporal_patch_size
            np.testing.assert_allclose(rows[row, :, frame], expected, atol=TOL)


# --- smart_resize --------------------------------------------------------------------------


@settings(max_examples=400, deadline=None)
@given(
    height=st.integers(1, 30000),
    width=st.integers(1, 30000),
    factor=st.sampled_from([14, 16, 28, 32]),
    min_pixels=st.integers(1, 28 * 28 * 2000),
    max_pixels=st.integers(1, 28 * 28 * 20000),
)
def test_smart_resize_matches_transformers(height, width, factor, min_pixels, max_pixels):
    assume(min_pixels <= max_pixels)
    try:
        expected = hf_smart_resize(height, width, factor, min_pixels, max_pixels)
    except ValueError:
        with pytest.raises(ValueError, match="aspect ratio"):
            smart_resize(height, width, factor, min_pixels, max_pixels)
        return
    assert smart_resize(height, width, factor, min_pixels, max_pixels) == tuple(expected)


@pytest.mark.parametrize("size", [(1, 1), (28, 28), (720, 1280), (1080, 1920), (4000, 3000), (10, 1999)])
def test_smart_resize_real_defaults(size):
    assert smart_resize(*size) == tuple(hf_smart_resize(*size))
    assert smart_resize(*size, 28, 3136, 12845056) == tuple(hf_smart_resize(*size, 28, 3136, 12845056))


def test_extreme_aspect_ratio_raises_naming_both_sides():
    assert smart_resize(10, 2000) == tuple(hf_smart_resize(10, 2000))  # exactly 200: allowed
    with pytest.raises(ValueError, match=r"aspect ratio .*height=10, width=2001"):
        smart_resize(10, 2001)
    with pytest.raises(ValueError, match=r"height=3001, width=15"):
        smart_resize(3001, 15)
    with pytest.raises(ValueError, match="aspect ratio"):
        QWEN2_DEFAULT(noise_image(2010, 10))


@pytest.mark.parametrize(("height", "width"), [(0, 10), (10, 0), (-3, 10)])
def test_smart_resize_refuses_empty_sides(height, width):
    with pytest.raises(ValueError, match="height|width"):
        smart_resize(height, width)


# --- inputs and outputs --------------------------------------------------------------------


@pytest.mark.parametrize("wire_dtype", ["uint8", "float32"])
@pytest.mark.parametrize("preprocessor", FAMILIES, ids=FAMILY_IDS)
def test_output_contract_and_determinism(preprocessor, wire_dtype):
    preprocessor = replace(preprocessor, wire_dtype=wire_dtype)
    image = noise_image(97, 61)
    first, second = preprocessor(image), preprocessor(image.copy())
    assert isinstance(first, PreprocessedImage)
    assert first.pixel_values.dtype == np.dtype(wire_dtype) and first.pixel_values.flags.c_contiguous
    assert first.pixel_values.tobytes() == second.pixel_values.tobytes()
    assert first.grid_thw == second.grid_thw
    other = preprocessor(noise_image(97, 61, seed=5))
    assert other.pixel_values.tobytes() != first.pixel_values.tobytes()


@pytest.mark.parametrize("mode", ["RGBA", "L", "P", "CMYK", "RGBX"])
def test_non_rgb_input_is_refused(mode):
    image = Image.new(mode, (20, 20))
    for preprocessor in FAMILIES:
        with pytest.raises(ValueError, match="RGB"):
            preprocessor(image)


def test_non_image_input_is_refused():
    with pytest.raises(TypeError, match="PIL"):
        LLAVA(np.zeros((20, 20, 3), np.uint8))


def test_preprocessed_image_checks_its_contract():
    PreprocessedImage(np.zeros((1, 3, 2, 2), np.float32))
    with pytest.raises(TypeError, match="float32 or uint8"):
        PreprocessedImage(np.zeros((1, 3, 2, 2), np.float64))
    PreprocessedImage(np.zeros((28, 28, 3), np.uint8), grid_thw=(1, 2, 2))  # the uint8 wire form
    with pytest.raises(ValueError, match=r"RGB image \[H, W, 3\]"):
        PreprocessedImage(np.zeros((1, 2, 2, 2), np.uint8))  # neither (H, W, 3) nor video frames (t, 3, H, W)
    with pytest.raises(ValueError, match="C-contiguous"):
        PreprocessedImage(np.zeros((4, 4), np.float32).T)
    with pytest.raises(ValueError, match="grid_thw"):
        PreprocessedImage(np.zeros((5, 8), np.float32), grid_thw=(1, 2, 2))
    assert PreprocessedImage(np.zeros((4, 8), np.float32), grid_thw=[1, 2, 2]).grid_thw == (1, 2, 2)


def test_unknown_wire_dtype_is_refused_naming_the_choices():
    for cls in CLASSES:
        with pytest.raises(ValueError, match="wire_dtype = 'float16': expected one of uint8, float32"):
            cls(wire_dtype="float16")


# --- configs -------------------------------------------------------------------------------


def test_qwen2_from_config_real_and_variants():
    ours = Qwen2VLPreprocessor.from_config(QWEN2_VL_CONFIG)
    assert (ours.min_pixels, ours.max_pixels) == (3136, 12845056)
    assert (ours.patch_size, ours.temporal_patch_size, ours.merge_size) == (14, 2, 2)
    assert ours.image_mean == OPENAI_CLIP_MEAN and ours.image_std == OPENAI_CLIP_STD
    # Newer configs keep the bounds in size; top-level keys win, as in transformers.
    newer = {k: v for k, v in QWEN2_VL_CONFIG.items() if k not in ("min_pixels", "max_pixels")}
    newer["size"] = {"shortest_edge": 1000, "longest_edge": 200000}
    from_size = Qwen2VLPreprocessor.from_config(newer)
    assert (from_size.min_pixels, from_size.max_pixels) == (1000, 200000)
    both = dict(newer, min_pixels=2000)
    assert Qwen2VLPreprocessor.from_config(both).min_pixels == 2000
    legacy_size = dict(newer, size={"min_pixels": 1234, "max_pixels": 56789})
    assert Qwen2VLPreprocessor.from_config(legacy_size).max_pixels == 56789
    assert Qwen2VLPreprocessor.from_config({}) == Qwen2VLPreprocessor()


def test_clip_from_config_dict_and_int_forms():
    ours = ClipPreprocessor.from_config(LLAVA_15_CONFIG)
    assert ours == ClipPreprocessor() == LLAVA
    older = dict(LLAVA_15_CONFIG, size=336, crop_size=336)
    assert ClipPreprocessor.from_config(older) == ours
    tiny = dict(LLAVA_15_CONFIG, size={"shortest_edge": 56}, crop_size={"height": 56, "width": 48})
    from_tiny = ClipPreprocessor.from_config(tiny)
    assert (from_tiny.shortest_edge, from_tiny.crop_height, from_tiny.crop_width) == (56, 56, 48)


def test_qwen_vl_from_config_visual_or_whole_config():
    assert QwenVLPreprocessor.from_config(QWEN_VL_VISUAL) == QwenVLPreprocessor(image_size=448)
    whole = {"model_type": "qwen", "visual": dict(QWEN_VL_VISUAL, image_size=224)}
    assert QwenVLPreprocessor.from_config(whole).image_size == 224
    assert QwenVLPreprocessor.from_config({}).image_size == 448


@pytest.mark.parametrize(
    ("cls", "kwargs", "field"),
    [
        (Qwen2VLPreprocessor, {"min_pixels": 0}, "min_pixels"),
        (Qwen2VLPreprocessor, {"max_pixels": -1}, "max_pixels"),
        (Qwen2VLPreprocessor, {"min_pixels": 5000, "max_pixels": 4000}, "min_pixels .*max_pixels"),
        (Qwen2VLPreprocessor, {"patch_size": 0}, "patch_size"),
        (Qwen2VLPreprocessor, {"temporal_patch_size": 0}, "temporal_patch_size"),
        (Qwen2VLPreprocessor, {"merge_size": 1.5}, "merge_size"),
        (Qwen2VLPreprocessor, {"patch_size": True}, "patch_size"),
        (Qwen2VLPreprocessor, {"image_mean": (0.5, 0.5)}, "image_mean"),
        (Qwen2VLPreprocessor, {"image_mean": 0.5}, "image_mean"),
        (Qwen2VLPreprocessor, {"image_mean": "abc"}, "image_mean"),
        (Qwen2VLPreprocessor, {"image_std": (0.5, 0.0, 0.5)}, "image_std"),
        (Qwen2VLPreprocessor, {"image_std": (0.5, float("nan"), 0.5)}, "image_std"),
        (Qwen2VLPreprocessor, {"rescale_factor": 0}, "rescale_factor"),
        (Qwen2VLPreprocessor, {"rescale_factor": float("inf")}, "rescale_factor"),
        (ClipPreprocessor, {"shortest_edge": 0}, "shortest_edge"),
        (ClipPreprocessor, {"crop_height": -1}, "crop_height"),
        (ClipPreprocessor, {"crop_width": 33.0}, "crop_width"),
        (ClipPreprocessor, {"image_std": [1, 2, 3, 4]}, "image_std"),
        (QwenVLPreprocessor, {"image_size": 0}, "image_size"),
        (QwenVLPreprocessor, {"image_mean": [None, 0, 0]}, "image_mean"),
    ],
)
def test_bad_parameters_raise_naming_the_field(cls, kwargs, field):
    with pytest.raises(ValueError, match=field):
        cls(**kwargs)


@pytest.mark.parametrize(
    ("cls", "config", "field"),
    [
        (Qwen2VLPreprocessor, dict(QWEN2_VL_CONFIG, do_resize=False), "do_resize"),
        (Qwen2VLPreprocessor, dict(QWEN2_VL_CONFIG, do_rescale=False), "do_rescale"),
        (Qwen2VLPreprocessor, dict(QWEN2_VL_CONFIG, do_normalize=False), "do_normalize"),
        (Qwen2VLPreprocessor, dict(QWEN2_VL_CONFIG, resample=2), "resample"),
        (Qwen2VLPreprocessor, dict(QWEN2_VL_CONFIG, max_pixels=1000), "min_pixels"),
        (Qwen2VLPreprocessor, dict(QWEN2_VL_CONFIG, merge_size=0), "merge_size"),
        (Qwen2VLPreprocessor, dict(QWEN2_VL_CONFIG, image_std=[0.2, 0.2]), "image_std"),
        (Qwen2VLPreprocessor, dict(QWEN2_VL_CONFIG, size=[1, 2]), "size"),
        (ClipPreprocessor, dict(LLAVA_15_CONFIG, do_center_crop=False), "do_center_crop"),
        (ClipPreprocessor, dict(LLAVA_15_CONFIG, size={"height": 336, "width": 336}), "size"),
        (ClipPreprocessor, dict(LLAVA_15_CONFIG, crop_size={"height": 336}), "crop_size"),
        (ClipPreprocessor, dict(LLAVA_15_CONFIG, crop_size={"height": 0, "width": 5}), "crop_height"),
        (ClipPreprocessor, dict(LLAVA_15_CONFIG, resample=0), "resample"),
        (ClipPreprocessor, dict(LLAVA_15_CONFIG, image_mean=[0.1, 0.2, "x"]), "image_mean"),
        (ClipPreprocessor, [1, 2], "preprocessor_config"),
        (QwenVLPreprocessor, {"visual": {"image_size": -448}}, "image_size"),
        (QwenVLPreprocessor, {"visual": 448}, "visual"),
    ],
)
def test_bad_configs_raise_naming_the_field(cls, config, field):
    with pytest.raises(ValueError, match=field):
        cls.from_config(config)


# --- cache keys ----------------------------------------------------------------------------

CHANGED_VALUES = {
    "image_mean": (0.5, 0.5, 0.5),
    "image_std": (0.5, 0.5, 0.5),
    "rescale_factor": 1 / 256,
    "image_size": 224,
    "min_pixels": 28 * 28 * 8,
    "max_pixels": 28 * 28 * 100,
    "patch_size": 16,
    "temporal_patch_size": 1,
    "merge_size": 1,
    "shortest_edge": 224,
    "crop_height": 224,
    "crop_width": 224,
    "wire_dtype": "float32",  # the two wire forms never share a dedup key
}


@pytest.mark.parametrize("cls", CLASSES)
def test_cache_key_changes_with_every_parameter(cls):
    base = cls()
    keys = {base.cache_key()}
    for spec in fields(cls):
        changed = replace(base, **{spec.name: CHANGED_VALUES[spec.name]})
        assert changed.cache_key() != base.cache_key(), spec.name
        keys.add(changed.cache_key())
    assert len(keys) == len(fields(cls)) + 1
    # One mean component a last-digit apart is a different key.
    nudged = replace(base, image_mean=(0.48145466, 0.4578275, 0.40821074))
    assert nudged.cache_key() != base.cache_key()


def test_cache_key_differs_between_families_with_equal_fields():
    assert QwenVLPreprocessor(image_size=336).cache_key() != ClipPreprocessor().cache_key()
    assert len({cls().cache_key() for cls in CLASSES}) == 3


def test_cache_key_is_stable():
    ours = Qwen2VLPreprocessor.from_config(QWEN2_VL_CONFIG)
    assert ours.cache_key() == ours.cache_key()
    assert ours.cache_key() == Qwen2VLPreprocessor(max_pixels=12845056).cache_key()
    # Equal values spelled differently (list vs tuple, int vs float) are one key.
    as_list = ClipPreprocessor(image_mean=[1, 0, 0])
    assert as_list.cache_key() == ClipPreprocessor(image_mean=(1.0, 0.0, 0.0)).cache_key()
    assert "0x" not in ours.cache_key()  # no object ids


def test_cache_key_is_the_same_in_another_process():
    """Nothing hash-seed or address dependent: a fresh interpreter with another hash seed agrees."""
    code = (
        "import json; from input_builders.preprocess import *; "
        "print(json.dumps([c().cache_key() for c in "
        "(Qwen2VLPreprocessor, ClipPreprocessor, QwenVLPreprocessor)]))"
    )
    env = dict(os.environ, PYTHONHASHSEED="12345")
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, check=True
    )
    assert json.loads(out.stdout) == [cls().cache_key() for cls in CLASSES]
