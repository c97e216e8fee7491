"""Video frontend (input_builders.video): Qwen's frame sampling, seeking decode, frame size, pixels,
limits and refusals, on videos PyAV encodes in the test (atb_plugin.testing.videos).

References, written out here so that nothing of ours checks itself:

* frame count and indices: qwen-vl-utils' ``smart_nframes`` and its readers'
  ``torch.linspace(0, total - 1, n).round()``, transcribed below (the package itself imports
  torchvision, which this project does not install);
* which frame an index names: PyAV decoding every frame of the same file (``decode_all_frames``);
  the seeking decoder must return those frames bit for bit;
* frame size: qwen-vl-utils' ``fetch_video`` budget around transformers' own ``smart_resize``;
* pixels: transformers' ``Qwen2VLImageProcessorPil`` (Pillow resize, rescale, normalise, per frame,
  with ``temporal_patch_size=1``), the frames then paired into temporal patches as transformers'
  ``Qwen2VLVideoProcessor.patchify`` orders them (that processor itself needs torchvision). Both
  our float32 frontend path and the model's uint8 device path must match it within 1e-5 (the
  image tolerance: two float32 roundings of the folded normalisation), and each other exactly.
"""

from __future__ import annotations

import dataclasses
import json
import math
from fractions import Fraction

import numpy as np
import pytest
import torch

from atb_plugin.testing.videos import video_bytes, write_video
from input_builders.media_config import MediaConfig
from input_builders.media_errors import MediaDecodeError, MediaNotAllowedError, MediaTooLargeError
from input_builders.sources import read_media_bytes
from input_builders.preprocess import Qwen2VLPreprocessor
from input_builders.video import (
    VideoOptionError,
    VideoSampling,
    decode_all_frames,
    decode_frames,
    load_video,
    probe_video,
    resize_frames,
)

av = pytest.importorskip("av")


# -- qwen-vl-utils' rules (vision_process.py), transcribed ------------------------------------------

FRAME_FACTOR, FPS, FPS_MIN_FRAMES, FPS_MAX_FRAMES = 2, 2.0, 4, 768
VIDEO_MIN_PIXELS, VIDEO_MAX_PIXELS = 128 * 28 * 28, 768 * 28 * 28
VIDEO_TOTAL_PIXELS = int(float(128000 * 28 * 28 * 0.9))


def reference_nframes(ele: dict, total_frames: int, video_fps: float) -> int:
    def round_by_factor(number, factor):
        return round(number / factor) * factor

    def ceil_by_factor(number, factor):
        return math.ceil(number / factor) * factor

    def floor_by_factor(number, factor):
        return math.floor(number / factor) * factor

    if "nframes" in ele:
        nframes = round_by_factor(ele["nframes"], FRAME_FACTOR)
    else:
        fps = ele.get("fps", FPS)
        min_frames = ceil_by_factor(ele.get("min_frames", FPS_MIN_FRAMES), FRAME_FACTOR)
        max_frames = floor_by_factor(ele.get("max_frames", min(FPS_MAX_FRAMES, total_frames)), FRAME_FACTOR)
        nframes = total_frames / video_fps * fps
        nframes = min(min(max(nframes, min_frames), max_frames), total_frames)
        nframes = floor_by_factor(nframes, FRAME_FACTOR)
    if not (FRAME_FACTOR <= nframes and nframes <= total_frames):
        raise ValueError(f"nframes should in interval [{FRAME_FACTOR}, {total_frames}], but got {nframes}.")
    return nframes


def reference_indices(total_frames: int, nframes: int) -> list[int]:
    return torch.linspace(0, total_frames - 1, nframes).round().long().tolist()


def reference_size(ele: dict, height: int, width: int, nframes: int) -> tuple[int, int]:
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize

    min_pixels = ele.get("min_pixels", VIDEO_MIN_PIXELS)
    total_pixels = ele.get("total_pixels", VIDEO_TOTAL_PIXELS)
    max_pixels = max(min(VIDEO_MAX_PIXELS, total_pixels / nframes * FRAME_FACTOR), int(min_pixels * 1.05))
    max_pixels = min(ele.get("max_pixels", max_pixels), max_pixels)
    return smart_resize(height, width, factor=28, min_pixels=min_pixels, max_pixels=max_pixels)


def reference_pixels(frames, size, preprocessor_dir) -> np.ndarray:
    """transformers' Pil image processor on each frame (temporal patch 1), then frames paired into
    temporal patches in Qwen2VLVideoProcessor.patchify's row layout (C, T, p, p)."""
    from transformers import Qwen2VLImageProcessorPil

    height, width = size
    processor = Qwen2VLImageProcessorPil.from_pretrained(preprocessor_dir)
    per_frame = processor(images=frames, size={"shortest_edge": height * width, "longest_edge": height * width},
                          temporal_patch_size=1, return_tensors="np")["pixel_values"]
    rows = (height // 14) * (width // 14)
    per_frame = per_frame.reshape(len(frames), rows, 3, 14 * 14)
    pairs = per_frame.reshape(len(frames) // 2, 2, rows, 3, 14 * 14).transpose(0, 2, 3, 1, 4)
    return pairs.reshape(len(frames) // 2 * rows, 3 * 2 * 14 * 14)


# -- fixtures -------------------------------------------------------------------------------------

# (frames, fps, (height, width), gop, codec): odd counts, fractional and NTSC rates, short and long
# GOPs; MPEG-4 Part 2 without B-frames, and H.264 with them (frames stored out of presentation order).
VIDEOS = [
    (9, 3, (64, 96), 4, "mpeg4"),
    (25, Fraction(30000, 1001), (48, 80), 12, "mpeg4"),
    (61, 24, (96, 64), 5, "mpeg4"),
    (150, 25, (72, 128), 10, "mpeg4"),
    (37, 7.5, (112, 112), 30, "mpeg4"),
    (121, 30, (64, 96), 48, "libx264"),
    (45, Fraction(24000, 1001), (80, 48), 8, "libx264"),
]


def config_for(tmp_path=None, **limits) -> MediaConfig:
    return MediaConfig(allowed_local_media_paths=(str(tmp_path),) if tmp_path else (), **limits)


@pytest.mark.parametrize("frames,fps,size,gop,codec", VIDEOS)
def test_sampled_frames_follow_qwen_and_equal_decoding_everything(frames, fps, size, gop, codec):
    data = video_bytes(frames, fps, size, gop=gop, seed=frames, codec=codec, b_frames=2 if codec == "libx264" else 0)
    stream = probe_video(data, "test video", config_for())
    assert (stream.total_frames, (stream.height, stream.width)) == (frames, size)
    assert stream.fps == pytest.approx(float(fps), rel=1e-6)
    sampling = VideoSampling()
    plan = sampling.plan(stream)
    count = reference_nframes({}, frames, stream.fps)
    assert plan.indices == tuple(reference_indices(frames, count))
    assert plan.size == reference_size({}, *size, count)
    assert plan.second_per_grid_t == pytest.approx(2 / (count / frames * stream.fps), rel=1e-6)
    decoded = decode_frames(data, stream, plan.indices)
    everything = decode_all_frames(data)
    assert len(everything) == frames
    for index, image in zip(plan.indices, decoded.frames):
        assert np.array_equal(np.asarray(image), np.asarray(everything[index])), index


@pytest.mark.parametrize("options", [{"fps": 1.0}, {"nframes": 7}, {"fps": 4.0, "max_frames": 10},
                                     {"min_frames": 12}, {"max_pixels": 28 * 28 * 8, "min_pixels": 28 * 28 * 2},
                                     {"total_pixels": 28 * 28 * 40}])
def test_request_options_follow_qwen(options):
    data = video_bytes(61, 24, (96, 64), gop=6, seed=1)
    stream = probe_video(data, "test video", config_for())
    plan = VideoSampling().with_options(options, config_for()).plan(stream)
    count = reference_nframes(options, 61, stream.fps)
    assert plan.indices == tuple(reference_indices(61, count))
    assert plan.size == reference_size(options, 96, 64, count)


def test_a_long_video_decodes_about_one_gop_per_kept_frame_not_every_frame():
    frames, gop = 600, 10  # 20 s at 30 fps: 40 kept frames
    data = video_bytes(frames, 30, (32, 48), gop=gop, seed=2)
    stream = probe_video(data, "test video", config_for())
    plan = VideoSampling().plan(stream)
    assert plan.num_frames == 40
    decoded = decode_frames(data, stream, plan.indices)
    # Each kept frame costs at most the frames from its keyframe to it (the decoder may run a few
    # frames ahead with threads); decoding everything would be 600.
    assert decoded.decoded <= plan.num_frames * (gop + 2) < frames
    everything = decode_all_frames(data)
    assert all(np.array_equal(np.asarray(a), np.asarray(everything[i])) for i, a in zip(plan.indices, decoded.frames))


@pytest.mark.parametrize("wire", ["float32", "uint8"])
def test_pixels_equal_transformers_per_frame_processing(wire):
    from atb_plugin.multimodal.pixels import Qwen2VLPatchFormat
    from atb_plugin.testing.tiny import tiny_checkpoint

    checkpoint = tiny_checkpoint("qwen2_vl")
    data = video_bytes(25, Fraction(30000, 1001), (70, 110), gop=8, seed=3)
    options = {"max_pixels": 28 * 28 * 12, "min_pixels": 28 * 28 * 4}
    video = load_video(data, config_for(), options=options)
    frames = video.frames().frames
    values = resize_frames(frames, video.plan.size)
    assert np.array_equal(video.resized_frames(), values)  # the builder's path: resized as each is decoded
    base = Qwen2VLPreprocessor.from_config(json.loads((checkpoint / "preprocessor_config.json").read_text()))
    preprocessor = dataclasses.replace(base, wire_dtype=wire)
    processed = preprocessor.preprocess_video(values)
    t, h, w = processed.grid_thw
    assert (2 * t, 14 * h, 14 * w) == (video.plan.num_frames, *video.plan.size)
    expected = reference_pixels(frames, video.plan.size, checkpoint)
    fmt = Qwen2VLPatchFormat(preprocessor.normalization, patch_size=14, temporal_patch_size=2, merge_size=2)
    if wire == "float32":
        assert processed.pixel_values.dtype == np.float32
        got = processed.pixel_values
    else:
        assert processed.pixel_values.shape == (2 * t, 3, 14 * h, 14 * w)
        got = fmt.encoder_input(torch.from_numpy(processed.pixel_values), (t, h, w), torch.float32).numpy()
        # the device's uint8 path equals the frontend's float32 path bit for bit on the CPU
        floats = dataclasses.replace(base, wire_dtype="float32").preprocess_video(values).pixel_values
        assert np.array_equal(got, floats)
    assert got.shape == expected.shape
    assert np.abs(got - expected).max() <= 1e-5


# -- limits and refusals ----------------------------------------------------------------------------


def test_video_bytes_travel_through_the_image_policy(tmp_path):
    import base64

    data = video_bytes(8, 4, seed=4)
    path = tmp_path / "clip.mp4"
    path.write_bytes(data)
    config = config_for(tmp_path)
    assert read_media_bytes(str(path), config, kind="video", max_bytes=1 << 20)[0] == data
    assert read_media_bytes(f"file://{path}", config, kind="video", max_bytes=1 << 20)[0] == data
    url = "data:video/mp4;base64," + base64.b64encode(data).decode()
    assert read_media_bytes(url, config, kind="video", max_bytes=1 << 20)[0] == data
    with pytest.raises(MediaDecodeError, match="send a video: data:video/mp4;base64"):
        read_media_bytes("data:image/png;base64," + base64.b64encode(data).decode(), config, kind="video",
                         max_bytes=1 << 20)
    with pytest.raises(MediaTooLargeError,
                       match=r"video \(path .*\) is \d+ bytes; the limit is 100 \(MediaConfig.max_video_bytes"):
        read_media_bytes(str(path), config, kind="video", max_bytes=100)
    with pytest.raises(MediaNotAllowedError, match="outside the allowed media directories"):
        read_media_bytes("/etc/passwd", config, kind="video", max_bytes=1 << 20)
    with pytest.raises(MediaNotAllowedError, match="fetching http\\(s\\) videos is disabled"):
        read_media_bytes("https://example.com/a.mp4", config, kind="video", max_bytes=1 << 20)
    with pytest.raises(MediaTooLargeError, match="MediaConfig.max_video_bytes"):
        load_video(url, config_for(tmp_path, max_video_bytes=1000))


def test_bad_videos_are_refused_with_the_problem_named(tmp_path):
    config = config_for()
    good = video_bytes(30, 10, seed=5)
    cases = [
        (b"", MediaDecodeError, "is empty"),
        (b"\x00\x00\x00\x18ftypmp42" + bytes(range(256)) * 8, MediaDecodeError, "could not|not a video file"),
        (good[: len(good) // 3], MediaDecodeError, "truncated|not a video file|could not"),
        (b"not a video at all" * 100, MediaDecodeError, "not a video file FFmpeg can read"),
        (video_bytes(0, 10, audio=True, container="mp4"), MediaDecodeError, "has no video stream"),
        (video_bytes(1, 10, seed=6), MediaDecodeError, "has 1 frame"),
        # an unknown sample entry (FourCC) in place of avc1: the container reads, no decoder exists
        (video_bytes(10, 5, codec="libx264").replace(b"avc1", b"zzzz"), MediaDecodeError, "codec cannot be decoded"),
    ]
    for data, error, message in cases:
        with pytest.raises(error, match=message):
            load_video(data, config)


def test_limits_are_checked_from_the_header_before_decoding(monkeypatch):
    import input_builders.video as video_module

    def no_decoding(*args, **kwargs):
        raise AssertionError("decoded a video that its header refuses")

    monkeypatch.setattr(video_module, "decode_frames", no_decoding)
    long = video_bytes(12, 0.1, seed=7)  # 120 s
    with pytest.raises(MediaTooLargeError,
                       match=r"is 1\d\d\.\d s long; the limit is 60 s \(MediaConfig.max_video_seconds\)"):
        load_video(long, config_for(max_video_seconds=60))
    big = video_bytes(4, 2, (256, 320), seed=8)
    with pytest.raises(MediaTooLargeError, match=r"256 = 81920-pixel frames; the limit is 10000 "
                                                 r"\(MediaConfig.max_video_frame_pixels\)"):
        load_video(big, config_for(max_video_frame_pixels=10000))
    server = MediaConfig(max_video_seconds=60, api="server")
    with pytest.raises(MediaTooLargeError, match="--max-video-seconds"):
        load_video(long, server)


def test_request_options_are_bounded():
    config = config_for(max_video_frames=32)
    sampling = VideoSampling()
    for options, message in [({"fps": 0}, "fps"), ({"fps": 1000}, "fps"), ({"nframes": 64}, "at most 32 frames"),
                             ({"max_frames": 100}, "at most 32 frames"), ({"total_pixels": 10**12}, "total_pixels"),
                             ({"max_pixels": 10**9}, "max_pixels"), ({"colour": 1}, "unknown video option"),
                             ({"fps": 1, "nframes": 4}, "exclude each other"), ({"min_pixels": "x"}, "min_pixels"),
                             ({"min_frames": 20, "max_frames": 10}, "min_frames")]:
        with pytest.raises(VideoOptionError, match=message):
            sampling.with_options(options, config)
    assert sampling.with_options({}, config).max_frames == 32  # the server's cap applies by default too


def test_every_container_and_path_form(tmp_path):
    for suffix in (".mp4", ".mkv", ".avi"):
        path = write_video(tmp_path / f"clip{suffix}", 10, 5, (48, 64), seed=9)
        video = load_video(str(path), config_for(tmp_path))
        assert video.stream.total_frames == 10 and video.plan.num_frames == 4


def test_server_flags_reach_the_media_config(capsys):
    from atb_plugin.server.cli import parse_config
    from atb_plugin.testing.tiny import tiny_checkpoint

    vl = str(tiny_checkpoint("qwen2_5_vl"))
    config = parse_config(["--model", vl, "--limit-mm-per-prompt", "image=3,video=1", "--max-video-bytes", "64M",
                           "--max-video-seconds", "90", "--max-video-frames", "64",
                           "--max-video-frame-pixels", "1000000"])
    assert config.engine.limit_mm_per_prompt == 3
    media = config.media_config()
    assert (media.max_videos_per_prompt, media.max_video_bytes, media.max_video_seconds, media.max_video_frames,
            media.max_video_frame_pixels, media.api) == (1, 64 << 20, 90.0, 64, 1000000, "server")
    only_video = parse_config(["--model", vl, "--limit-mm-per-prompt", "video=2"])
    assert only_video.engine.limit_mm_per_prompt == 16 and only_video.media_config().max_videos_per_prompt == 2
    assert parse_config(["--model", vl]).media_config().max_videos_per_prompt is None  # the model's own: 4
    for argv, message in ((["--model", vl, "--limit-mm-per-prompt", "video=5"], "takes 0 to 4 videos"),
                          (["--model", str(tiny_checkpoint("llava")), "--limit-mm-per-prompt", "video=1"], "no video"),
                          (["--model", vl, "--limit-mm-per-prompt", "video=1,video=2"], "one video entry")):
        with pytest.raises(SystemExit):
            parse_config(argv)
        assert message in capsys.readouterr().err
