"""Qwen2-VL / Qwen2.5-VL's preprocessing budgets: the one definition the input builders
(input_builders.preprocess, input_builders.video) resize and sample by and the model
(atb_plugin.models.qwen2_vl: the start-up memory profile's largest image and video) sizes by.

Torch-free: the builders import it in the tokenizer workers.

Images are transformers' ``Qwen2VLImageProcessor`` defaults (preprocessor_config.json may
override min / max pixels); videos are qwen-vl-utils' (``vision_process.py``), the reference the
Qwen2-VL / Qwen2.5-VL model cards point to: each frame between ``VIDEO_MIN_PIXELS`` and
``VIDEO_MAX_PIXELS``, all n frames of a video sharing ``VIDEO_TOTAL_PIXELS`` (a frame at most
``VIDEO_TOTAL_PIXELS x 2 / n``), ``VIDEO_FPS`` frames a second clamped to
``[VIDEO_MIN_FRAMES, VIDEO_MAX_FRAMES]`` (docs/architecture.md, "Memory profiling and KV sizing").
"""

from __future__ import annotations

__all__ = [
    "IMAGE_MAX_PIXELS",
    "IMAGE_MIN_PIXELS",
    "MAX_ASPECT_RATIO",
    "VIDEO_FPS",
    "VIDEO_MAX_FRAMES",
    "VIDEO_MAX_PIXELS",
    "VIDEO_MIN_FRAMES",
    "VIDEO_MIN_PIXELS",
    "VIDEO_TOTAL_PIXELS",
]

IMAGE_MIN_PIXELS = 56 * 56
IMAGE_MAX_PIXELS = 28 * 28 * 1280
MAX_ASPECT_RATIO = 200  # smart_resize refuses longer images

VIDEO_FPS = 2.0
VIDEO_MIN_FRAMES = 4
VIDEO_MAX_FRAMES = 768
VIDEO_MIN_PIXELS = 128 * 28 * 28
VIDEO_MAX_PIXELS = 768 * 28 * 28
VIDEO_TOTAL_PIXELS = int(128000 * 28 * 28 * 0.9)
