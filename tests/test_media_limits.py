"""One ``MediaLimits`` (atb_plugin/multimodal/limits.py) and one set of Qwen2-VL budgets
(atb_plugin/multimodal/budgets.py): each media limit is defined once in the source tree, and a
bad limit is a ValueError that names the field and the knob that sets it."""

from __future__ import annotations

import dataclasses
import math
import re
import subprocess
import sys
from pathlib import Path

import pytest

from atb_plugin.multimodal import budgets
from atb_plugin.multimodal.limits import LIMIT_FIELDS, MediaLimits, default_max_request_pixels
from atb_plugin.testing.tiny import tiny_checkpoint
from input_builders.media_config import MediaConfig

ROOT = Path(__file__).resolve().parents[1]
# The production source: atb_plugin/testing holds test fixtures (tiny checkpoints' own configs).
SOURCE = [path for top in ("atb_plugin", "input_builders", "routers", "shm") for path in (ROOT / top).rglob("*.py")
          if "testing" not in path.relative_to(ROOT).parts]

# The family's budgets, module constants: the builders (input_builders.preprocess / video) and
# the model (atb_plugin.models.qwen2_vl, its start-up memory profile) import them.
BUDGETS = ["IMAGE_MIN_PIXELS", "IMAGE_MAX_PIXELS", "MAX_ASPECT_RATIO", "VIDEO_FPS", "VIDEO_MIN_FRAMES",
           "VIDEO_MAX_FRAMES", "VIDEO_MIN_PIXELS", "VIDEO_MAX_PIXELS", "VIDEO_TOTAL_PIXELS"]
# Their values and the limits' defaults, as written: each expression once in the source.
VALUES = ["56 * 56", "28 * 28 * 1280", "128 * 28 * 28", "768 * 28 * 28", "128000 * 28 * 28", "6000 * 6000",
          "4096 * 2160", "20 * 1024 * 1024", "512 * 1024 * 1024", "25 * 1024 * 1024"]
# The videos per prompt under any of the names it once had.
VIDEOS_PER_PROMPT = ["limit_videos_per_prompt", "max_videos_per_prompt", "videos_per_prompt"]


def _code_lines():
    for path in SOURCE:
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            if not line.lstrip().startswith("#"):
                yield f"{path.relative_to(ROOT)}:{number}", line


def _definitions(pattern: str) -> list[str]:
    found = re.compile(pattern)
    return [f"{where}: {line.strip()}" for where, line in _code_lines() if found.search(line)]


@pytest.mark.parametrize("name", BUDGETS)
def test_each_budget_is_defined_once(name):
    # A module constant: NAME = ... at the start of a line (an import or a use is not a definition).
    where = _definitions(rf"^{name}\s*(:[^=]*)?=(?!=)")
    assert len(where) == 1 and where[0].startswith(f"atb_plugin/multimodal/budgets.py:{_line_of(budgets, name)}:"), \
        f"{name} is defined {len(where)} times: {where}"


def _line_of(module, name: str) -> int:
    lines = Path(module.__file__).read_text(encoding="utf-8").splitlines()
    return next(i for i, line in enumerate(lines, 1) if line.startswith(f"{name} ="))


@pytest.mark.parametrize("name", LIMIT_FIELDS)
def test_each_limit_is_defined_once(name):
    # A field with a default (name: type = value) or a flag default written as a number.
    where = _definitions(rf"^\s+{name}\s*:[^=]*=(?!=)")
    assert len(where) == 1 and where[0].startswith("atb_plugin/multimodal/limits.py:"), \
        f"{name} is defined {len(where)} times: {where}"


def test_videos_per_prompt_has_one_definition_under_any_name():
    where = [hit for name in VIDEOS_PER_PROMPT for hit in _definitions(rf"^\s+{name}\s*:[^=]*=(?!=)")]
    assert len(where) == 1 and "limit_videos_per_prompt" in where[0], where


def test_frames_per_video_are_defined_once():
    # The limit's default is the budget (Qwen's own cap), not a second 768.
    assert MediaLimits().max_video_frames == budgets.VIDEO_MAX_FRAMES == 768
    # A frames value written as 768 (a field, a constant or a flag default), anywhere but there:
    assert _definitions(r"(FRAMES\w*|frames\w*)\s*(:[^=]*)?=\s*768\b|default=768\b") == [
        f"atb_plugin/multimodal/budgets.py:{_line_of(budgets, 'VIDEO_MAX_FRAMES')}: VIDEO_MAX_FRAMES = 768"]


@pytest.mark.parametrize("value", VALUES)
def test_each_value_is_written_once(value):
    where = _definitions(re.escape(value))
    assert len(where) == 1 and where[0].startswith("atb_plugin/multimodal/"), f"{value!r} appears {where}"


def test_the_flags_take_their_defaults_from_the_limits():
    from atb_plugin.server.cli import build_parser

    defaults = vars(build_parser().parse_args([]))
    limits = MediaLimits()
    for name in ("max_image_bytes", "max_image_pixels", "max_video_bytes", "max_video_seconds", "max_video_frames",
                 "max_video_frame_pixels", "max_audio_bytes", "max_audio_seconds", "max_video_decode_frames",
                 "media_decode_timeout"):
        assert defaults[name] == getattr(limits, name), name


def test_the_limits_and_budgets_are_torch_free():
    code = ("import sys, atb_plugin.multimodal.limits, atb_plugin.multimodal.budgets, input_builders.media_config; "
            "print('torch' in sys.modules)")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True)
    assert result.stdout.strip() == "False"


# -- MediaLimits ---------------------------------------------------------------------------------


def test_the_defaults():
    limits = MediaLimits()
    assert (limits.limit_mm_per_prompt, limits.limit_videos_per_prompt) == (None, None)  # the model's own
    assert limits.max_request_pixels == default_max_request_pixels(limits.max_image_pixels) == 4 * 36_000_000
    assert MediaLimits(max_image_pixels=100).max_request_pixels == 400
    assert MediaLimits(max_image_pixels=100, max_request_pixels=150).max_request_pixels == 150
    assert MediaLimits(limit_mm_per_prompt=0, limit_videos_per_prompt=0).limit_videos_per_prompt == 0
    assert MediaLimits(max_video_seconds=1, max_audio_seconds=0.5).max_audio_seconds == 0.5


POSITIVE_INTS = ["max_image_bytes", "max_image_pixels", "max_request_pixels", "max_video_bytes",
                 "max_video_frame_pixels", "max_video_decode_frames", "max_audio_bytes"]


@pytest.mark.parametrize("name", POSITIVE_INTS)
@pytest.mark.parametrize("bad", [0, -1, 1.5, True, "10", None])
def test_a_size_must_be_a_positive_integer(name, bad):
    if bad is None and name == "max_request_pixels":
        return  # None: the default budget
    flag = "--" + name.replace("_", "-")
    with pytest.raises(ValueError, match=rf"^MediaLimits\.{name} must be a positive integer, got {re.escape(repr(bad))}; "
                                         rf"set it with {flag} \(server\) or MediaConfig\.{name} \(offline\)$"):
        MediaLimits(**{name: bad})


@pytest.mark.parametrize("bad", [1, 0, -2, 2.0, "768", True])
def test_frames_per_video_are_at_least_one_temporal_patch(bad):
    with pytest.raises(ValueError, match=r"MediaLimits\.max_video_frames must be an integer >= 2 \(one temporal "
                                         r"patch is 2 frames\).*--max-video-frames.*MediaConfig\.max_video_frames"):
        MediaLimits(max_video_frames=bad)
    assert MediaLimits(max_video_frames=2).max_video_frames == 2


@pytest.mark.parametrize("name", ["max_video_seconds", "max_audio_seconds", "media_decode_timeout"])
@pytest.mark.parametrize("bad", [0, -1.0, math.inf, math.nan, True, "60", None])
def test_a_duration_must_be_a_positive_number_of_seconds(name, bad):
    with pytest.raises(ValueError, match=rf"MediaLimits\.{name} must be a positive number of seconds, got .*; "
                                         rf"set it with --{name.replace('_', '-')} \(server\)"):
        MediaLimits(**{name: bad})


@pytest.mark.parametrize("name, knob", [("limit_mm_per_prompt", r"--limit-mm-per-prompt N \(server\) or "
                                                                 r"LLM\(limit_mm_per_prompt=N\)"),
                                        ("limit_videos_per_prompt", r"--limit-mm-per-prompt video=N \(server\) or "
                                                                     r"LLM\(limit_videos_per_prompt=N\)")])
@pytest.mark.parametrize("bad", [-1, 1.5, True, "2"])
def test_a_count_per_prompt_is_an_integer_or_none(name, knob, bad):
    with pytest.raises(ValueError, match=rf"MediaLimits\.{name} must be an integer >= 0 or None \(the model's own "
                                         rf"limit\), got {re.escape(repr(bad))}; set it with {knob}"):
        MediaLimits(**{name: bad})


def test_the_configs_nest_one_media_limits():
    """MediaConfig, EngineConfig and ServerConfig hold a MediaLimits; their keyword arguments
    and attributes of the same names (the offline API's documented spelling) read and write it."""
    from atb_plugin.engine.config import EngineConfig
    from atb_plugin.server.cli import parse_config

    config = MediaConfig(max_image_pixels=100, max_videos_per_prompt=2)
    assert config.limits == MediaLimits(max_image_pixels=100, limit_videos_per_prompt=2)
    assert (config.max_image_pixels, config.max_request_pixels, config.max_videos_per_prompt) == (100, 400, 2)
    assert dataclasses.replace(config, max_video_frames=8).limits.max_video_frames == 8
    with pytest.raises(ValueError, match=r"MediaLimits\.max_image_bytes must be a positive integer"):
        MediaConfig(max_image_bytes=0)
    with pytest.raises(ValueError, match="MediaConfig.limits must be a MediaLimits"):
        MediaConfig(limits={"max_image_bytes": 1})
    with pytest.raises(AttributeError):
        config.max_image_count  # noqa: B018

    engine = EngineConfig(tiny_checkpoint("qwen2_vl"), kv_cache_blocks=8, max_video_frames=8, limit_mm_per_prompt=2)
    assert engine.media.max_video_frames == engine.max_video_frames == 8
    assert (engine.media.limit_mm_per_prompt, engine.media.limit_videos_per_prompt) == (2, 4)  # resolved
    assert engine.replace(limit_videos_per_prompt=1).media.limit_videos_per_prompt == 1
    assert "media.max_video_frames = 8" in engine.describe().splitlines()

    server = parse_config(["--model", str(tiny_checkpoint("qwen2_vl")), "--max-video-frames", "16",
                           "--limit-mm-per-prompt", "image=3,video=2"])
    assert server.media.max_video_frames == server.engine.media.max_video_frames == 16
    assert server.media.limit_videos_per_prompt == server.engine.limit_videos_per_prompt == 2
    assert server.media_config().limits is server.media
    assert "media.max_video_frames = 16" in server.describe().splitlines()
