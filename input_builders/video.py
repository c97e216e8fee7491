"""Video input for Qwen2-VL / Qwen2.5-VL: from a reference to the sampled, resized frames.

::

    reference ──read_media_bytes (the image policy: allowed dirs / domains, max_video_bytes)──► bytes
      ──probe (container header: a video stream, a decoder, duration, frame size; then the packet
        index, demuxed without decoding)──► VideoStream           refused here before any decode
      ──VideoSampling.plan (Qwen's rules)──► which frames, what size, second_per_grid_t
      ──decode_frames: seek to the keyframe before each kept frame only when one lies past
        what is decoded already, decode forward to it, resize it (Pillow bicubic)──► (t, 3, H, W)

Qwen's sampling rules are qwen-vl-utils' (``smart_nframes`` and ``fetch_video``), the reference
the Qwen2-VL / Qwen2.5-VL model cards point to, with its budgets (atb_plugin.multimodal.budgets,
which the model's start-up memory profile reads too):

* frames: ``total / video_fps * fps`` (fps 2.0), clamped to ``[min_frames, min(max_frames, total)]``
  (4 and 768), floored to an even count (the temporal patch is 2 frames); or a fixed ``nframes``
  rounded to even. Indices ``linspace(0, total - 1, n).round()`` (torch's float32 linspace and
  round-half-even, which is what the reference runs, so the indices are its indices exactly).
* size: ``smart_resize`` (multiples of 28) within ``[min_pixels, max_pixels]`` where
  ``max_pixels = max(min(VIDEO_MAX_PIXELS, total_pixels / n * 2), 1.05 * min_pixels)``: one
  budget of ``total_pixels`` shared by all frames, so a long video gets smaller frames.
* ``second_per_grid_t = 2 / sample_fps`` with ``sample_fps = n / total * video_fps``: the seconds
  one temporal patch spans, which Qwen2.5-VL's M-RoPE turns into time positions.

A request may override ``fps``, ``nframes``, ``min_frames``, ``max_frames``, ``min_pixels``,
``max_pixels`` and ``total_pixels`` (vLLM's ``mm_processor_kwargs``, or keys of the video part
itself as in qwen-vl-utils), each bounded (``VideoSampling.with_options``): never more frames
than ``MediaLimits.max_video_frames``, never a larger pixel budget than the defaults.

Qwen3-VL samples by transformers' ``Qwen3VLVideoProcessor`` instead (``Qwen3VideoSampling``, its
``video_preprocessor_config.json``): ``int(total / video_fps * fps)`` frames clamped to
``[min_frames, min(max_frames, total)]``, any count (an odd one is padded with its last frame to a
whole temporal patch), numpy's ``linspace(...).round()``, and one pixel budget for all frames
(``smart_resize`` of ``t·h·w`` within ``[shortest_edge, longest_edge]``); each temporal patch is
stamped with the mean time of its frames (``VideoPlan.patch_timestamps``), which the prompt shows.

Frames are resized with Pillow's bicubic, the same call as images (transformers'
``Qwen2VLImageProcessorPil``; its torch video processor needs torchvision, which this project does
not install). What is decoded is counted (``DecodedFrames.decoded``): a long video costs about
one GOP per kept frame at most, never every frame (benchmarks/bench_video.py).
"""

from __future__ import annotations

import hashlib
import io
import math
import numbers
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, fields, replace
from fractions import Fraction

import numpy as np
from PIL import Image

from atb_plugin.multimodal.budgets import (
    MAX_ASPECT_RATIO,
    VIDEO_FPS,
    VIDEO_MAX_FRAMES,
    VIDEO_MAX_PIXELS,
    VIDEO_MIN_FRAMES,
    VIDEO_MIN_PIXELS,
    VIDEO_TOTAL_PIXELS,
)
from input_builders.decode_budget import DecodeBudget
from input_builders.media_config import MediaConfig, knob
from input_builders.media_errors import MediaDecodeError, MediaError, MediaTooLargeError
from input_builders.preprocess import smart_resize
from input_builders.pyav import pyav
from input_builders.sources import read_media_bytes

__all__ = [
    "DecodedFrames",
    "LoadedVideo",
    "Qwen3VideoSampling",
    "VideoOptionError",
    "VideoPlan",
    "VideoSampling",
    "VideoStream",
    "decode_all_frames",
    "decode_frames",
    "load_video",
    "probe_video",
]

FRAME_FACTOR = 2  # the temporal patch: frames come in pairs
IMAGE_FACTOR = 28  # patch 14 x merge 2
# The most frames per second a request may ask for: above the frame rate of nearly every video
# (the count is clamped to the frames there are anyway), and 768 frames bound the cost.
MAX_REQUEST_FPS = 60.0
# The largest per-frame pixel budget a request may ask for: Qwen's image maximum (16384 tokens).
MAX_REQUEST_FRAME_PIXELS = 16384 * 28 * 28

# Bumped whenever a change alters the frames for the same bytes and parameters (shm dedup keys).
_ALGORITHM_VERSION = 1


class VideoOptionError(MediaError):
    """A sampling option of a request (``mm_processor_kwargs`` or the video part) that is unknown,
    of the wrong type or out of its bounds."""


# ------------------------------------------------------------------------------------- sampling


@dataclass(frozen=True)
class VideoPlan:
    """What will be taken from one video: frame ``indices`` (presentation order), the resized
    frame ``size`` ``(height, width)``, and the time one temporal patch spans."""

    indices: tuple[int, ...]
    size: tuple[int, int]
    sample_fps: float
    temporal_patch_size: int
    video_fps: float = 0.0  # the stream's frame rate (what a frame index means in seconds)

    @property
    def num_frames(self) -> int:
        return len(self.indices)

    @property
    def num_patches(self) -> int:
        """Temporal patches: a last, incomplete one is filled with the last frame (``resized_frames``)."""
        return -(-self.num_frames // self.temporal_patch_size)

    @property
    def patch_timestamps(self) -> tuple[float, ...]:
        """Seconds of each temporal patch, the mean of its first and last frame's time (the last
        frame repeated to fill the last patch): transformers' ``Qwen3VLProcessor._calculate_timestamps``."""
        size = self.temporal_patch_size
        padded = list(self.indices) + [self.indices[-1]] * (self.num_patches * size - self.num_frames)
        seconds = [index / self.video_fps for index in padded]
        return tuple((seconds[i] + seconds[i + size - 1]) / 2 for i in range(0, len(seconds), size))

    @property
    def second_per_grid_t(self) -> float:
        """``temporal_patch_size / sample_fps`` rounded to float32, as transformers' Qwen2.5-VL
        processor hands it to the model (a float32 tensor)."""
        return float(np.float32(self.temporal_patch_size / self.sample_fps))


@dataclass(frozen=True)
class VideoSampling:
    """Qwen's video sampling rule and its parameters (module docstring). ``nframes`` set: that
    many frames instead of ``fps``. Every field takes part in the shm dedup key."""

    fps: float = VIDEO_FPS
    nframes: int | None = None
    min_frames: int = VIDEO_MIN_FRAMES
    max_frames: int = VIDEO_MAX_FRAMES
    min_pixels: int = VIDEO_MIN_PIXELS
    max_pixels: int = VIDEO_MAX_PIXELS
    total_pixels: int = VIDEO_TOTAL_PIXELS
    frame_factor: int = FRAME_FACTOR
    image_factor: int = IMAGE_FACTOR

    def __post_init__(self):
        if not _number(self.fps) or not 0 < self.fps <= MAX_REQUEST_FPS:
            raise VideoOptionError(f"video fps = {self.fps!r}: expected a number in (0, {MAX_REQUEST_FPS:g}]")
        object.__setattr__(self, "fps", float(self.fps))
        for name in ("min_frames", "max_frames", "min_pixels", "max_pixels", "total_pixels", "frame_factor",
                     "image_factor") + (("nframes",) if self.nframes is not None else ()):
            value = getattr(self, name)
            if not _integer(value) or value < 1:
                raise VideoOptionError(f"video {name} = {value!r}: expected a positive integer")
            object.__setattr__(self, name, int(value))
        if self.min_frames > self.max_frames:
            raise VideoOptionError(f"video min_frames ({self.min_frames}) > max_frames ({self.max_frames})")
        if self.min_pixels > self.max_pixels:
            raise VideoOptionError(f"video min_pixels ({self.min_pixels}) > max_pixels ({self.max_pixels})")

    # Request overrides: Qwen's spelling, as vLLM's mm_processor_kwargs and qwen-vl-utils take them.
    OPTIONS = ("fps", "nframes", "min_frames", "max_frames", "min_pixels", "max_pixels", "total_pixels")

    def with_options(self, options: Mapping, config: MediaConfig) -> VideoSampling:
        """These parameters with a request's ``options`` applied, each checked and bounded: frames at
        most ``config.limits.max_video_frames``, pixel budgets at most the defaults' (a request can make a
        video cheaper, never dearer than the server allows)."""
        options = dict(options or {})
        unknown = sorted(set(options) - set(self.OPTIONS))
        if unknown:
            raise VideoOptionError(f"unknown video option(s) {', '.join(map(repr, unknown))}; the options are "
                                   f"{', '.join(self.OPTIONS)}")
        if "fps" in options and "nframes" in options:
            raise VideoOptionError("video options fps and nframes exclude each other: give one")
        changed = replace(self, **options)
        frames_cap = config.limits.max_video_frames
        for name in ("nframes", "min_frames"):
            value = getattr(changed, name)
            if value is not None and value > frames_cap:
                raise VideoOptionError(f"video {name} = {value}: at most {frames_cap} frames per video "
                                       f"({knob(config, 'max_video_frames')})")
        if "max_frames" in options and changed.max_frames > frames_cap:
            raise VideoOptionError(f"video max_frames = {changed.max_frames}: at most {frames_cap} frames per video "
                                   f"({knob(config, 'max_video_frames')})")
        if "max_pixels" in options and changed.max_pixels > MAX_REQUEST_FRAME_PIXELS:
            raise VideoOptionError(f"video max_pixels = {changed.max_pixels}: at most {MAX_REQUEST_FRAME_PIXELS} "
                                   "pixels per frame")
        if changed.total_pixels > self.total_pixels:
            raise VideoOptionError(f"video total_pixels = {changed.total_pixels}: at most {self.total_pixels} for "
                                   "all frames of a video")
        return replace(changed, max_frames=min(changed.max_frames, frames_cap))

    def num_frames(self, total_frames: int, video_fps: float) -> int:
        """qwen-vl-utils' ``smart_nframes``: how many frames to take from ``total_frames`` at
        ``video_fps``. Raises ``MediaDecodeError`` when the video has too few frames."""
        factor = self.frame_factor
        if self.nframes is not None:
            count = round(self.nframes / factor) * factor
        else:
            min_frames = math.ceil(self.min_frames / factor) * factor
            max_frames = math.floor(min(self.max_frames, total_frames) / factor) * factor
            count = total_frames / video_fps * self.fps
            count = min(min(max(count, min_frames), max_frames), total_frames)
            count = math.floor(count / factor) * factor
        if not factor <= count <= total_frames:
            raise MediaDecodeError(f"the video has {total_frames} frame(s); {count} would be sampled, and a video "
                                   f"needs at least {factor} frames (one temporal patch), at most all of them")
        return count

    @staticmethod
    def frame_indices(total_frames: int, count: int) -> tuple[int, ...]:
        """``torch.linspace(0, total - 1, count).round()``: the reference's float32 arithmetic
        (numpy's float64 linspace would round some halves the other way)."""
        import torch

        return tuple(torch.linspace(0, total_frames - 1, count).round().long().tolist())

    def frame_size(self, height: int, width: int, count: int) -> tuple[int, int]:
        """``(height, width)`` of every sampled frame: ``smart_resize`` within the shared budget."""
        cap = max(min(VIDEO_MAX_PIXELS, self.total_pixels / count * self.frame_factor), int(self.min_pixels * 1.05))
        max_pixels = min(self.max_pixels, cap)
        try:
            return smart_resize(height, width, self.image_factor, self.min_pixels, max_pixels)
        except ValueError as error:  # the aspect-ratio limit
            raise MediaDecodeError(f"the video's {width}x{height} frames cannot be resized: {error}") from None

    def plan(self, stream: VideoStream) -> VideoPlan:
        count = self.num_frames(stream.total_frames, stream.fps)
        indices = self.frame_indices(stream.total_frames, count)
        sample_fps = count / max(stream.total_frames, 1e-6) * stream.fps
        return VideoPlan(indices, self.frame_size(stream.height, stream.width, count), sample_fps, self.frame_factor,
                         stream.fps)

    def cache_key(self) -> str:
        values = ",".join(f"{spec.name}={getattr(self, spec.name)!r}" for spec in fields(self))
        return f"{self.rule}/v{_ALGORITHM_VERSION};{values}"

    rule = "video"  # the sampling rule's name in the dedup key


@dataclass(frozen=True)
class Qwen3VideoSampling(VideoSampling):
    """transformers' ``Qwen3VLVideoProcessor`` rule (module docstring). ``min_pixels`` and
    ``total_pixels`` are its ``size.shortest_edge`` / ``longest_edge``: bounds on the pixels of all
    frames together (even frame count x frame size); ``max_pixels`` caps one frame (by default the
    whole budget: no cap of its own, as the processor)."""

    rule = "qwen3_video"

    @classmethod
    def from_config(cls, config: Mapping, temporal_patch_size: int, image_factor: int) -> Qwen3VideoSampling:
        """From ``video_preprocessor_config.json`` (transformers' defaults where it is silent)."""
        size = config.get("size") or {}
        total = int(size.get("longest_edge", 32 * 32 * 768))
        return cls(fps=config.get("fps", VIDEO_FPS), min_frames=config.get("min_frames", VIDEO_MIN_FRAMES),
                   max_frames=config.get("max_frames", VIDEO_MAX_FRAMES),
                   min_pixels=int(size.get("shortest_edge", 32 * 32 * 128)), max_pixels=total, total_pixels=total,
                   frame_factor=temporal_patch_size, image_factor=image_factor)

    def num_frames(self, total_frames: int, video_fps: float) -> int:
        """``Qwen3VLVideoProcessor.sample_frames``' count (no rounding to whole temporal patches)."""
        if self.nframes is not None:
            count = min(self.nframes, total_frames)
        else:
            count = int(total_frames / video_fps * self.fps)
            count = min(max(count, self.min_frames), self.max_frames, total_frames)
        if count < self.frame_factor:
            raise MediaDecodeError(f"the video has {total_frames} frame(s); {count} would be sampled, and a video "
                                   f"needs at least {self.frame_factor} frames (one temporal patch)")
        return count

    def frame_indices(self, total_frames: int, count: int) -> tuple[int, ...]:
        """``np.linspace(0, total - 1, count).round()``: the processor's float64 arithmetic."""
        return tuple(int(i) for i in np.linspace(0, total_frames - 1, count).round().astype(int))

    def frame_size(self, height: int, width: int, count: int) -> tuple[int, int]:
        """The processor's video ``smart_resize``: ``t·h·w`` within ``[min_pixels, total_pixels]``
        (``t`` the count rounded to whole temporal patches), each frame at most ``max_pixels``."""
        factor, frames = self.image_factor, round(count / self.frame_factor) * self.frame_factor
        if max(height, width) / min(height, width) > MAX_ASPECT_RATIO:
            raise MediaDecodeError(f"the video's {width}x{height} frames cannot be resized: aspect ratio above "
                                   f"{MAX_ASPECT_RATIO}")
        if height < factor or width < factor:
            scale = max(factor / height, factor / width)
            height, width = int(height * scale), int(width * scale)
        max_pixels = min(self.total_pixels, self.max_pixels * frames)
        h_bar, w_bar = round(height / factor) * factor, round(width / factor) * factor
        if frames * h_bar * w_bar > max_pixels:
            beta = math.sqrt(count * height * width / max_pixels)
            h_bar = max(factor, math.floor(height / beta / factor) * factor)
            w_bar = max(factor, math.floor(width / beta / factor) * factor)
        elif frames * h_bar * w_bar < self.min_pixels:
            beta = math.sqrt(self.min_pixels / (count * height * width))
            h_bar, w_bar = math.ceil(height * beta / factor) * factor, math.ceil(width * beta / factor) * factor
        return h_bar, w_bar


def _number(value) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value)


def _integer(value) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


# ------------------------------------------------------------------------------------- decoding


@dataclass(frozen=True, eq=False)
class VideoStream:
    """The first video stream of a container, from its header and its packet index (demuxed,
    not decoded): ``pts`` of every frame in presentation order, ``keyframes`` the sorted pts of
    the frames a decode can start from."""

    width: int
    height: int
    fps: float  # average frame rate (FFmpeg's avg_frame_rate), what decord's get_avg_fps() reports
    duration: float  # seconds
    codec: str
    pts: np.ndarray
    keyframes: np.ndarray

    @property
    def total_frames(self) -> int:
        return len(self.pts)


def _open(data: bytes, source: str):
    av = pyav()
    try:
        return av.open(io.BytesIO(data), mode="r")
    except av.FFmpegError as error:
        raise MediaDecodeError(f"{source} is not a video file FFmpeg can read ({_ffmpeg_message(error)}); send "
                               "an MP4 / WebM / MKV / MOV / AVI file") from None


def _ffmpeg_message(error) -> str:
    return str(getattr(error, "strerror", None) or error)


def probe_video(data: bytes, source: str, config: MediaConfig, budget: DecodeBudget | None = None) -> VideoStream:
    """The container's first video stream, checked against ``config`` from its header (duration,
    frame size, frames to demux) before its packets are demuxed, and its packet index, demuxed under
    ``budget`` (the item's decode budget: frames and wall clock). Decodes nothing."""
    budget = budget or DecodeBudget(config, "video", source)
    with budget.running():
        return _probe(data, source, config, budget)


def _probe(data: bytes, source: str, config: MediaConfig, budget: DecodeBudget) -> VideoStream:
    if not data:
        raise MediaDecodeError(f"{source} is empty; send the video file's contents")
    av = pyav()
    with _open(data, source) as container:
        if not container.streams.video:
            kinds = ", ".join(sorted({s.type for s in container.streams})) or "no streams"
            raise MediaDecodeError(f"{source} has no video stream ({kinds}); send a video file")
        stream = container.streams.video[0]
        context = stream.codec_context
        codec = getattr(getattr(context, "codec", None), "name", None) if context is not None else None
        if codec is None:
            raise MediaDecodeError(f"{source}: its video codec cannot be decoded by this server; send H.264, "
                                   "H.265, VP8, VP9, AV1 or MPEG-4 video")
        width, height = context.width, context.height
        if width <= 0 or height <= 0:
            raise MediaDecodeError(f"{source}: its video stream has no frame size ({width}x{height}); the file is "
                                   "truncated or corrupt")
        if width * height > config.limits.max_video_frame_pixels:
            raise MediaTooLargeError(
                f"video ({source}) has {width}x{height} = {width * height}-pixel frames; the limit is "
                f"{config.limits.max_video_frame_pixels} ({knob(config, 'max_video_frame_pixels')}); send a smaller video")
        duration = _header_duration(container, stream)
        _check_duration(duration, source, config)
        rate = stream.average_rate or stream.guessed_rate
        budget.check_header(stream.frames, duration, float(rate) if rate else None)
        pts, keys = [], []
        try:
            for packet in container.demux(stream):
                stamp = packet.pts if packet.pts is not None else packet.dts
                if stamp is None or packet.size == 0:
                    continue  # the demuxer's flush packet
                budget.count()
                pts.append(stamp)
                if packet.is_keyframe:
                    keys.append(stamp)
        except av.FFmpegError as error:
            raise MediaDecodeError(f"{source} could not be read ({_ffmpeg_message(error)}); the file is truncated "
                                   "or corrupt: send the complete video file") from None
        if not pts:
            raise MediaDecodeError(f"{source} has no video frames; send a video with at least "
                                   f"{FRAME_FACTOR} frames")
        pts_sorted = np.unique(np.asarray(pts, dtype=np.int64))  # presentation order
        time_base = stream.time_base or Fraction(1, 1)
        span = float((pts_sorted[-1] - pts_sorted[0]) * time_base)
        if duration is None:  # no header duration: the timestamps say (refused still before decoding)
            duration = span
            _check_duration(duration, source, config)
        fps = float(rate) if rate else (len(pts_sorted) / duration if duration > 0 else 0.0)
        if not fps > 0:
            raise MediaDecodeError(f"{source}: its video stream has no frame rate; the file is corrupt")
        keyframes = np.unique(np.asarray(keys, dtype=np.int64)) if keys else pts_sorted[:1]
        return VideoStream(width, height, fps, duration, codec, pts_sorted, keyframes)


def _header_duration(container, stream) -> float | None:
    if stream.duration is not None and stream.time_base:
        return float(stream.duration * stream.time_base)
    if container.duration is not None:
        return container.duration / 1_000_000  # AV_TIME_BASE
    return None


def _check_duration(duration: float | None, source: str, config: MediaConfig) -> None:
    if duration is not None and duration > config.limits.max_video_seconds:
        raise MediaTooLargeError(
            f"video ({source}) is {duration:.1f} s long; the limit is {config.limits.max_video_seconds:g} s "
            f"({knob(config, 'max_video_seconds')}); send a shorter clip")


@dataclass(frozen=True, eq=False)
class DecodedFrames:
    frames: list  # RGB PIL images, original size, in the order asked for
    decoded: int  # frames the decoder produced to get them (the cost)
    seeks: int


def decode_frames(data: bytes, stream: VideoStream, indices: Sequence[int], source: str = "video",
                  keep: Callable[[int, Image.Image], object] | None = None,
                  budget: DecodeBudget | None = None) -> DecodedFrames:
    """The frames at ``indices`` (ascending, presentation order) and nothing much else: for each,
    seek to the keyframe before it when one lies past the last decoded frame (else decoding on
    from where we are is cheaper), then decode forward to it. Each kept frame becomes an RGB PIL
    image; ``keep(i, image)`` is what is kept of the i-th (the image itself by default: a caller
    that resizes at once holds one full-size frame at a time, not all of them). ``budget``: each
    decoded frame counts against it (frames and wall clock; this pass's frames counted afresh)."""
    if budget is None:
        return _decode_frames(data, stream, indices, source, keep, None)
    budget.frames = 0
    with budget.running():
        return _decode_frames(data, stream, indices, source, keep, budget)


def _decode_frames(data, stream, indices, source, keep, budget: DecodeBudget | None) -> DecodedFrames:
    av = pyav()
    targets = stream.pts[np.asarray(indices, dtype=np.int64)]
    if len(targets) and (np.diff(targets) <= 0).any():
        raise ValueError("frame indices must be strictly ascending")
    out, decoded, seeks = [], 0, 0
    with _open(data, source) as container:
        video = container.streams.video[0]
        video.thread_type = "AUTO"
        frames: Iterator | None = None
        position = None  # pts of the last decoded frame
        try:
            for target in targets:
                key = stream.keyframes[max(np.searchsorted(stream.keyframes, target, side="right") - 1, 0)]
                if frames is None or position is None or key > position:
                    container.seek(int(target), stream=video, backward=True, any_frame=False)
                    frames, seeks = container.decode(video), seeks + 1
                found = None
                for frame in frames:
                    decoded += 1
                    if budget is not None:
                        budget.count()
                    stamp = frame.pts if frame.pts is not None else frame.dts
                    if stamp is None:
                        continue
                    position = stamp
                    if stamp >= target:
                        found = frame
                        break
                if found is None:
                    raise MediaDecodeError(f"{source}: the frame at {float(target * video.time_base):.2f} s cannot "
                                           "be decoded; the file is truncated or corrupt: send the complete video")
                image = found.to_image()
                out.append(image if keep is None else keep(len(out), image))
        except av.FFmpegError as error:
            raise MediaDecodeError(f"{source} could not be decoded ({_ffmpeg_message(error)}); the file is "
                                   "truncated or corrupt: send the complete video file") from None
    return DecodedFrames(out, decoded, seeks)


def decode_all_frames(data: bytes, source: str = "video") -> list:
    """Every frame, in presentation order, as RGB PIL images: the naive way (the benchmark's
    baseline and the tests' reference for which frame an index names)."""
    with _open(data, source) as container:
        video = container.streams.video[0]
        video.thread_type = "AUTO"
        frames = sorted(((f.pts, f.to_image()) for f in container.decode(video)), key=lambda item: item[0])
    return [image for _, image in frames]


# ------------------------------------------------------------------------------------- loading


@dataclass(frozen=True, eq=False)
class LoadedVideo:
    """A video that passed every check a request can fail before decoding (its bytes, its
    stream, the plan of what to take); ``frames()`` decodes the kept frames when its segment is
    not in shared memory already."""

    data: bytes
    digest: str  # sha256 of the bytes
    source: str
    stream: VideoStream
    sampling: VideoSampling
    plan: VideoPlan
    budget: DecodeBudget | None = None  # what its probe spent of the decode budget; its decode spends the rest

    def frames(self) -> DecodedFrames:
        """The kept frames, full size (tests and the benchmark compare them with decoding everything)."""
        return decode_frames(self.data, self.stream, self.plan.indices, self.source, budget=self.budget)

    def resized_frames(self) -> np.ndarray:
        """The kept frames at the plan's size, uint8 ``(n, 3, H, W)``: each resized as soon as it is
        decoded, so at most one full-size frame is held (768 of them at 4K would be 19 GB). A last,
        incomplete temporal patch is filled with the last frame (Qwen3-VL's odd counts)."""
        height, width = self.plan.size
        out = np.empty((self.plan.num_patches * self.plan.temporal_patch_size, 3, height, width), dtype=np.uint8)

        def keep(index: int, image: Image.Image) -> None:
            out[index] = _resized_chw(image, height, width)

        decode_frames(self.data, self.stream, self.plan.indices, self.source, keep, self.budget)
        out[self.plan.num_frames:] = out[self.plan.num_frames - 1]
        return out


def load_video(ref, config: MediaConfig, sampling: VideoSampling | None = None, options: Mapping | None = None,
               ) -> LoadedVideo:
    """Read, probe and plan ``ref`` (a path, file://, data:video/...;base64, http(s) URL, base64
    string or bytes) under ``config``; ``options``: the request's sampling overrides."""
    sampling = (sampling or VideoSampling()).with_options(options or {}, config)
    data, source = read_media_bytes(ref, config, kind="video", max_bytes=config.limits.max_video_bytes)
    budget = DecodeBudget(config, "video", source)
    stream = probe_video(data, source, config, budget)
    plan = sampling.plan(stream)
    return LoadedVideo(data, hashlib.sha256(data).hexdigest(), source, stream, sampling, plan, budget)


def resize_frames(frames: Sequence[Image.Image], size: tuple[int, int]) -> np.ndarray:
    """RGB frames -> uint8 ``(t, 3, H, W)`` at ``size`` ``(H, W)``, Pillow bicubic (the image
    path's resize), written channel-first into one array (the wire layout)."""
    height, width = size
    out = np.empty((len(frames), 3, height, width), dtype=np.uint8)
    for index, frame in enumerate(frames):
        out[index] = _resized_chw(frame, height, width)
    return out


def _resized_chw(frame: Image.Image, height: int, width: int) -> np.ndarray:
    if frame.mode != "RGB":
        frame = frame.convert("RGB")
    if frame.size != (width, height):
        frame = frame.resize((width, height), Image.Resampling.BICUBIC)
    return np.asarray(frame).transpose(2, 0, 1)
