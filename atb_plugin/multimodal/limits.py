"""``MediaLimits``: every limit a request's media can hit, defined once.

The engine config (``EngineConfig.media``: the items and frames its start-up memory profile sizes
the KV cache for), the input builders' ``MediaConfig.limits`` (what a request is refused by) and
the server's ``ServerConfig.media`` (its flags) each nest one. Torch-free: the tokenizer workers
and the CLI import it.

Per-prompt counts are None for "the model's own limit" (its class's ``supported_mm_limits``);
``EngineConfig`` resolves them against the model. Each validation error names the field and the
knob that sets it (a server flag, or the offline API's keyword).

``flat_limits`` lets a config that nests a ``MediaLimits`` also take and show its fields by their
own names (``MediaConfig(max_image_pixels=...)``, ``EngineConfig(limit_mm_per_prompt=...)``,
``config.max_video_frames``): those are the documented keywords of the offline API and what its
error messages name, so they keep working; the value lives in the nested ``MediaLimits`` only.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from atb_plugin.multimodal.budgets import VIDEO_MAX_FRAMES

__all__ = ["LIMIT_FIELDS", "MediaLimits", "REQUEST_PIXELS_IN_IMAGES", "default_max_request_pixels", "flat_limits"]

# The default request budget, in images at the per-image cap: a few full-size photos in one
# request (four at the default 36 MP: 144 MP, 432 MB as RGB), not the dozens a per-image cap
# alone admits. Several images are common (a multi-turn chat resends its earlier ones, a
# comparison sends two or three); more pixels than this add nothing a model reads, since each
# family resizes an image to at most a few megapixels (Qwen2-VL: 12.8 MP).
REQUEST_PIXELS_IN_IMAGES = 4


def default_max_request_pixels(max_image_pixels: int) -> int:
    """``max_request_pixels`` when it is not given: ``REQUEST_PIXELS_IN_IMAGES`` images at the
    per-image cap (the server's ``--max-request-pixels`` default too)."""
    return REQUEST_PIXELS_IN_IMAGES * max_image_pixels


@dataclass(frozen=True)
class MediaLimits:
    """How much media one prompt may carry and how big each item may be. Validated on construction;
    ``max_request_pixels`` None becomes ``default_max_request_pixels(max_image_pixels)``."""

    # Items of the model's own modality per prompt (images, or audio clips): --limit-mm-per-prompt N
    # (or image=N / audio=N). None: the model's own limit, which it may not exceed.
    limit_mm_per_prompt: int | None = None
    # Videos per prompt (--limit-mm-per-prompt video=N); None: the model's own limit (0 without video).
    limit_videos_per_prompt: int | None = None
    # Encoded size of an image (a data: URL's decoded bytes too). 20 MiB is OpenAI's per-image limit,
    # so clients written for it fit.
    max_image_bytes: int = 20 * 1024 * 1024
    # 36 MP: admits 8K UHD (33.2 MP) and 12–33 MP camera photos; the biggest input any family uses is
    # Qwen2-VL's 12.8 MP max_pixels, so more only costs decode time and memory (108 MB as RGB, more at
    # peak while converting: benchmarks/RESULTS.md, "Figures formerly in code comments"). It is below
    # Pillow's own bomb threshold (PIL.Image.MAX_IMAGE_PIXELS, 89.5 MP), so our check fires first with
    # our message; raising it above that needs Pillow's raised too.
    max_image_pixels: int = 6000 * 6000
    # All images of one request together; None: default_max_request_pixels(max_image_pixels).
    max_request_pixels: int | None = None
    # Video (input_builders.video). Encoded size: MindIE's 512 MB per video.
    max_video_bytes: int = 512 * 1024 * 1024
    # Duration, read from the container before any frame is decoded. 30 minutes: at Qwen's 768-frame
    # cap that is one frame per 2.3 s, already sparse for a model that reads motion.
    max_video_seconds: float = 1800.0
    # Frames sampled from one video: Qwen's own cap; a request's max_frames may lower it. With
    # max_model_len and limit_videos_per_prompt, what the engine's start-up memory profile's
    # worst-case videos are.
    max_video_frames: int = VIDEO_MAX_FRAMES
    # Width x height of the source frames, from the stream header: DCI 4K. Every kept frame is decoded
    # at this size before its resize (a 768-frame 8K video would be 25 GB of RGB while decoding).
    max_video_frame_pixels: int = 4096 * 2160
    # Frames (packets) one video may make the server demux and decode, whatever it keeps: a frame
    # sampled from a long GOP costs every frame before it since the keyframe, so the frames kept
    # bound nothing. Checked from the header (its frame count, duration x frame rate) before the
    # packets are read, then counted while demuxing and decoding. 216,000 is 30 minutes (the
    # default max_video_seconds) at 120 fps; a 16x16 video at 5,000 fps is refused.
    max_video_decode_frames: int = 216_000
    # Audio (input_builders.audio), per clip. Encoded size: OpenAI's 25 MB audio upload limit.
    max_audio_bytes: int = 25 * 1024 * 1024
    # Duration: 240 s is eight 30 s windows, 6000 audio tokens, inside Qwen2-Audio's 8192-token context.
    max_audio_seconds: float = 240.0
    # Wall-clock seconds the server spends demuxing and decoding one video or audio item (its
    # download has http_timeout_s): checked while decoding, 400 beyond. A media worker that
    # overruns its request's budget anyway (one stuck FFmpeg call) is killed: 504.
    media_decode_timeout: float = 30.0

    def __post_init__(self) -> None:
        for name in ("limit_mm_per_prompt", "limit_videos_per_prompt"):
            value = getattr(self, name)
            if value is not None and not _int_at_least(value, 0):
                raise ValueError(f"MediaLimits.{name} must be an integer >= 0 or None (the model's own limit), "
                                 f"got {value!r}; {_fix(name)}")
        if self.max_request_pixels is None and _int_at_least(self.max_image_pixels, 1):
            object.__setattr__(self, "max_request_pixels", default_max_request_pixels(self.max_image_pixels))
        for name in ("max_image_bytes", "max_image_pixels", "max_request_pixels", "max_video_bytes",
                     "max_video_frame_pixels", "max_video_decode_frames", "max_audio_bytes"):
            value = getattr(self, name)
            if not _int_at_least(value, 1):
                raise ValueError(f"MediaLimits.{name} must be a positive integer, got {value!r}; {_fix(name)}")
        if not _int_at_least(self.max_video_frames, 2):
            raise ValueError(f"MediaLimits.max_video_frames must be an integer >= 2 (one temporal patch is 2 "
                             f"frames), got {self.max_video_frames!r}; {_fix('max_video_frames')}")
        for name in ("max_video_seconds", "max_audio_seconds", "media_decode_timeout"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
                raise ValueError(f"MediaLimits.{name} must be a positive number of seconds, got {value!r}; "
                                 f"{_fix(name)}")

    def describe(self) -> list[str]:
        """``name = value`` per limit, for the start-up log."""
        return [f"{f.name} = {getattr(self, f.name)!r}" for f in dataclasses.fields(self)]


LIMIT_FIELDS = tuple(f.name for f in dataclasses.fields(MediaLimits))

# The knob of each per-prompt count, per API; every other limit is --<name> on the server and
# MediaConfig.<name> offline (input_builders.media_config.knob: the same rule).
_COUNT_KNOBS = {
    "limit_mm_per_prompt": ("--limit-mm-per-prompt N", "LLM(limit_mm_per_prompt=N)"),
    "limit_videos_per_prompt": ("--limit-mm-per-prompt video=N", "LLM(limit_videos_per_prompt=N)"),
}


def _fix(name: str) -> str:
    server, offline = _COUNT_KNOBS.get(name, (f"--{name.replace('_', '-')}", f"MediaConfig.{name}"))
    return f"set it with {server} (server) or {offline} (offline)"


def _int_at_least(value, low: int) -> bool:
    return not isinstance(value, bool) and isinstance(value, int) and value >= low


def flat_limits(attr: str, names: Iterable[str] = LIMIT_FIELDS, aliases: Mapping[str, str] | None = None):
    """Class decorator for a frozen dataclass whose field ``attr`` is a ``MediaLimits``: its
    constructor (and so ``dataclasses.replace``) also takes ``names`` (and ``aliases``: another
    name -> the field) as keywords, folded into ``attr``; reading one of them reads ``attr``'s.
    The limits are defined and validated in ``MediaLimits`` alone."""
    flat = {name: name for name in names} | dict(aliases or {})

    def decorate(cls):
        init = cls.__init__

        @functools.wraps(init)
        def __init__(self, *args, **kwargs):
            given = {flat[key]: kwargs.pop(key) for key in [key for key in kwargs if key in flat]}
            if given:
                base = kwargs.get(attr)
                # A new MediaLimits, not a replaced default: max_request_pixels then follows
                # a given max_image_pixels, as when the field is passed whole.
                kwargs[attr] = MediaLimits(**given) if base is None else dataclasses.replace(base, **given)
            init(self, *args, **kwargs)

        def __getattr__(self, name):
            if name in flat:
                return getattr(object.__getattribute__(self, attr), flat[name])
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

        cls.__init__, cls.__getattr__ = __init__, __getattr__
        return cls

    return decorate
