"""The start-up memory profile with videos (atb_plugin.engine.memory_profile, Qwen2-VL / Qwen2.5-VL's
``get_video_processing_info``): the worst-case prompt adds ``limit_videos_per_prompt`` copies of the
video with the most feature tokens that Qwen's sampling budgets give from at most
``max_video_frames`` frames, bounded by ``max_model_len``; the profile runs it through the video
encoder path (``encode_pixels``: the uint8 frames ``(t, 3, H, W)`` or float32 patches).

Memory is read from ``MeterPlatform``: the live bytes of the tensor storages made during the
profile, exact and deterministic (the process's resident memory is neither). No timing."""

from __future__ import annotations

import logging

import pytest
import torch

from atb_plugin.engine.config import EngineConfig
from atb_plugin.engine.core import EngineCore
from atb_plugin.engine.memory_profile import dummy_inputs, kv_cache_budget, profile_run
from atb_plugin.models import qwen2_vl, registry
from atb_plugin.models.interfaces import MultimodalProcessingInfo, SupportsVideo
from atb_plugin.server.cli import parse_config
from atb_plugin.testing.tiny import tiny_checkpoint
from tests.test_memory_profiling import AllocationMeter

VIDEO_FAMILIES = ["qwen2_vl", "qwen2_5_vl"]
MiB = 1 << 20


def _config(family, **kwargs) -> EngineConfig:
    return EngineConfig(tiny_checkpoint(family), kv_cache_blocks=8, device="cpu", **kwargs)


class MeterPlatform:
    """A device of ``total`` bytes whose memory stats are an ``AllocationMeter`` running from
    ``reset_peak_memory`` to ``peak_memory`` (the profile's calls)."""

    def __init__(self, total: int | None = 256 * MiB):
        self.total = total
        self.meter: AllocationMeter | None = None

    def total_memory(self):
        return self.total

    def device_graphs(self):  # a meter, not a device: no decode graphs to count (engine/graph_runner.py)
        return None

    def reset_peak_memory(self):
        self.meter = AllocationMeter()
        self.meter.__enter__()

    def memory_in_use(self):
        return self.meter.now

    def peak_memory(self):
        self.meter.__exit__(None, None, None)
        return self.meter.peak


@pytest.fixture
def encoder_calls(monkeypatch):
    """Every block the profile hands the encoder path: ``(pixels shape, pixels dtype, grid_thw)``
    as ``encoder_input`` receives them (what the runner passes for a shm segment)."""
    calls = []
    original = qwen2_vl.Qwen2VLForConditionalGeneration.encoder_input

    def recording(self, pixels, grid_thw=None):
        calls.append((tuple(pixels.shape), pixels.dtype, tuple(grid_thw)))
        return original(self, pixels, grid_thw)

    monkeypatch.setattr(qwen2_vl.Qwen2VLForConditionalGeneration, "encoder_input", recording)
    return calls


# -- the worst-case video ------------------------------------------------------------------------


def test_the_budgets_are_the_input_builder_s_and_its_sampler_makes_the_worst_case_video(models):
    from input_builders import video

    # The budgets are defined once (atb_plugin.multimodal.budgets: tests/test_media_limits.py).
    model = models("qwen2_vl")
    vision = model.config.vision
    sampling = video.VideoSampling(frame_factor=vision.temporal_patch_size,
                                   image_factor=vision.patch_size * vision.spatial_merge_size)
    for max_tokens, max_frames in ((4096, 768), (512, 768), (4096, 8), (32768, 768), (32768, 64), (10**6, 768)):
        info = model.get_video_processing_info(tiny_checkpoint("qwen2_vl"), max_tokens, max_frames)
        t, h, w = info.grid_thw
        assert info.modality == "video" and info.frames == t * vision.temporal_patch_size <= max_frames
        assert info.max_tokens_per_item == t * h * w // vision.spatial_merge_size**2 <= max_tokens
        # A clip of that many frames at 2 fps and that frame size is sampled to exactly this video.
        assert sampling.num_frames(info.frames, 2.0) == info.frames
        assert sampling.frame_size(*info.max_item_size, info.frames) == info.max_item_size
        assert info.max_item_size == (h * vision.patch_size, w * vision.patch_size)
    # Qwen's default budgets: VIDEO_TOTAL_PIXELS is 115200 windows of 28² over all frames (x 2 per
    # temporal patch of 2 frames): 115200 feature tokens at most, whatever max_model_len allows.
    assert model.get_video_processing_info(None, 10**6, 768).max_tokens_per_item == 115200
    # max_video_frames bounds it below max_model_len: 64 frames of at most 768 windows.
    assert model.get_video_processing_info(None, 32768, 64).max_tokens_per_item == 32 * 768
    assert model.get_video_processing_info(None, 100, 768) is None  # not one 128-window frame fits


def test_video_processing_info_is_validated():
    with pytest.raises(ValueError, match="frames"):
        MultimodalProcessingInfo("video", 4, 512, (448, 896), (2048, 1176), grid_thw=(1, 32, 64))
    with pytest.raises(ValueError, match="frames"):
        MultimodalProcessingInfo("video", 4, 512, (448, 896), (2048, 1176), grid_thw=(1, 32, 64), frames=0)
    with pytest.raises(ValueError, match="grid_thw"):
        MultimodalProcessingInfo("video", 4, 512, (448, 896), (2047, 1176), grid_thw=(1, 32, 64), frames=2)
    with pytest.raises(ValueError, match="frames"):
        MultimodalProcessingInfo("image", 4, 512, (448, 896), (2048, 1176), grid_thw=(1, 32, 64), frames=2)


@pytest.mark.parametrize("wire_dtype", ["uint8", "float32"])
@pytest.mark.parametrize("family", VIDEO_FAMILIES)
def test_the_profile_runs_the_worst_case_video_through_the_video_encoder(models, encoder_calls, family, wire_dtype):
    model = models(family)
    assert isinstance(model, SupportsVideo)
    # max_model_len 4096 (the tiny checkpoint's): 8 temporal patches of 16 x 32 windows = 4096 tokens;
    # more frames would leave fewer windows each, larger frames fit fewer patches in the budget.
    config = _config(family, mm_wire_dtype=wire_dtype, limit_mm_per_prompt=2)
    assert config.limit_videos_per_prompt == 4 and config.max_video_frames == 768 and config.max_model_len == 4096
    profile = profile_run(model, config, MeterPlatform())
    assert (profile.num_items, profile.num_videos, profile.video_tokens) == (2, 1, 4096)  # one fills the context
    assert (profile.video_frames, profile.video_frame_size, profile.video_grid_thw) == (16, (448, 896), (8, 32, 64))
    frames = (16, 3, 448, 896) if wire_dtype == "uint8" else (8 * 32 * 64, 3 * 2 * 14 * 14)
    video_calls = [call for call in encoder_calls if call[2] == (8, 32, 64)]
    assert video_calls == [(frames, getattr(torch, wire_dtype), (8, 32, 64))]
    image_calls = [call for call in encoder_calls if call[2] != (8, 32, 64)]
    assert len(image_calls) == 2 and all(call[2] == (1, 32, 32) for call in image_calls)
    assert "1 video(s) of 16 frames 896x448 (grid_thw (8, 32, 64)) = 4096 feature tokens" in profile.describe()
    # The LM forward's ids: the images' placeholders, then the video's, as far as the step reaches.
    inputs = dummy_inputs(model, config)
    video_id = model.config.video_token_id
    assert int((inputs.input_ids == model.config.image_token_id).sum()) == 512
    assert int((inputs.input_ids == video_id).sum()) == inputs.num_tokens - 512 == 2048 - 512


def test_max_model_len_and_max_video_frames_bound_the_video(models, encoder_calls):
    model = models("qwen2_vl")
    small = profile_run(model, _config("qwen2_vl", max_model_len=512, limit_mm_per_prompt=0), MeterPlatform())
    assert (small.num_items, small.num_videos, small.video_grid_thw, small.video_frames) == (0, 1, (1, 32, 64), 2)
    assert encoder_calls == [((2, 3, 448, 896), torch.uint8, (1, 32, 64))]  # the video, alone
    few_frames = dummy_inputs(model, _config("qwen2_vl", max_video_frames=8))
    assert few_frames.video_frames == 8 and few_frames.video.grid_thw == (4, 48, 64)  # 4 x 768 windows
    # The largest video fills max_model_len: one copy, whatever the limit.
    assert dummy_inputs(model, _config("qwen2_vl", max_model_len=2048)).num_videos == 1
    # Two-frame videos (768 tokens) fit max_model_len 2048 twice: two held, the encoder run twice.
    encoder_calls.clear()
    two = profile_run(model, _config("qwen2_vl", max_model_len=2048, max_video_frames=2, limit_mm_per_prompt=0),
                      MeterPlatform())
    assert (two.num_videos, two.video_tokens, two.video_grid_thw) == (2, 2 * 768, (1, 48, 64))
    assert encoder_calls == [((2, 3, 672, 896), torch.uint8, (1, 48, 64))] * 2
    assert dummy_inputs(model, _config("qwen2_vl", max_model_len=100)).video is None  # no video fits 100 tokens


def test_allowing_videos_raises_the_peak_and_lowers_the_kv_budget(models):
    model = models("qwen2_5_vl")
    config = _config("qwen2_5_vl", max_model_len=1024, limit_mm_per_prompt=1)
    with_video = profile_run(model, config, MeterPlatform())
    without = profile_run(model, config.replace(limit_videos_per_prompt=0), MeterPlatform())
    assert with_video.num_videos == 1 and without.num_videos == 0 and without.video_grid_thw is None
    assert with_video.peak_bytes >= without.peak_bytes
    # The video's rows (1024 x hidden 64, float32) are held through the language model's forward.
    assert with_video.peak_bytes - without.peak_bytes >= 1024 * 64 * 4
    budget = {videos: kv_cache_budget(model, config.replace(limit_videos_per_prompt=videos), MeterPlatform()).bytes
              for videos in (0, 1)}
    assert budget[1] < budget[0]


def test_a_video_limit_of_zero_or_a_model_without_video_skips_videos(models, encoder_calls):
    model = models("qwen2_vl")
    config = _config("qwen2_vl", limit_videos_per_prompt=0, limit_mm_per_prompt=1)
    inputs = dummy_inputs(model, config)
    assert inputs.video is None and inputs.num_videos == inputs.video_tokens == 0
    assert int((inputs.input_ids == model.config.video_token_id).sum()) == 0
    profile = profile_run(model, config, MeterPlatform())
    assert profile.num_videos == 0 and "video" not in profile.describe()
    assert [call[2] for call in encoder_calls] == [(1, 32, 32)]  # the one image, no video
    llava = _config("llava")
    assert llava.limit_videos_per_prompt == 0  # the model's own: it takes none
    llava_model = registry.import_model_class(llava.model_cls_path).from_pretrained(llava.model)
    assert not isinstance(llava_model, SupportsVideo) and dummy_inputs(llava_model, llava).video is None
    assert _config("qwen2").limit_videos_per_prompt == 0


def test_a_bad_video_config_is_a_clear_error(capsys):
    with pytest.raises(ValueError, match=r"limit_videos_per_prompt = 5 \(--limit-mm-per-prompt video=5\): "
                                         r"Qwen2VLForConditionalGeneration takes 0 to 4 videos per prompt"):
        _config("qwen2_vl", limit_videos_per_prompt=5)
    with pytest.raises(ValueError, match=r"limit_videos_per_prompt = 1 .*takes no video"):
        _config("llava", limit_videos_per_prompt=1)
    for bad in (-1, 1.5, True):
        with pytest.raises(ValueError, match="limit_videos_per_prompt"):
            _config("qwen2_vl", limit_videos_per_prompt=bad)
    for bad in (1, 0, "768"):
        with pytest.raises(ValueError, match="max_video_frames"):
            _config("qwen2_vl", max_video_frames=bad)
    vl = str(tiny_checkpoint("qwen2_5_vl"))
    for argv, message in ((["--limit-mm-per-prompt", "video=5"], "takes 0 to 4 videos"),
                          (["--limit-mm-per-prompt", "video=-1"], "must be an integer >= 0")):
        with pytest.raises(SystemExit):
            parse_config(["--model", vl, *argv])
        assert message in capsys.readouterr().err


def test_the_server_s_video_flags_reach_the_engine_config():
    vl = str(tiny_checkpoint("qwen2_5_vl"))
    server = parse_config(["--model", vl, "--limit-mm-per-prompt", "image=3,video=2", "--max-video-frames", "64"])
    assert (server.engine.limit_mm_per_prompt, server.engine.limit_videos_per_prompt) == (3, 2)
    assert server.engine.max_video_frames == server.media_config().max_video_frames == 64
    assert server.media_config().max_videos_per_prompt == 2
    default = parse_config(["--model", vl])
    assert (default.engine.limit_videos_per_prompt, default.engine.max_video_frames) == (4, 768)
    assert parse_config(["--model", vl, "--limit-mm-per-prompt", "video=0"]).engine.limit_videos_per_prompt == 0
    assert parse_config(["--model", str(tiny_checkpoint("llava"))]).engine.limit_videos_per_prompt == 0


def test_the_start_up_log_names_the_worst_case_video(caplog):
    caplog.set_level(logging.INFO)
    core = EngineCore(EngineConfig(tiny_checkpoint("qwen2_vl"), device="cpu", max_model_len=512,
                                   limit_mm_per_prompt=1, kv_cache_bytes=4 * MiB))
    try:
        assert "memory profile" in caplog.text
        assert "1 image(s) = 256 feature tokens, 1 video(s) of 2 frames 896x448 (grid_thw (1, 32, 64)) = 512 " \
               "feature tokens" in caplog.text
    finally:
        core.shutdown()
