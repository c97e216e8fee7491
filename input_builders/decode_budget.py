"""``DecodeBudget``: what one video or audio item may cost the server to demux and decode.

Two limits (``MediaLimits``), each refused with a ``MediaTooLargeError`` (400) that names its knob:

* ``max_video_decode_frames``: frames (packets) one video may make the server demux and decode,
  however few it keeps. Checked from the container's header first (``check_header``: the stream's
  frame count, or its duration times its frame rate), then counted per packet demuxed and per
  frame decoded (``count``), so a header that understates is caught while reading too.
* ``media_decode_timeout``: wall-clock seconds for the whole item (its probe and its decode
  together, each timed under ``running``: the time spent on the request's other items in between
  is not this one's), checked as the packets and frames go by (``tick``). The media worker pool kills a worker whose
  job overruns its items' budgets anyway (a stuck FFmpeg call: atb_plugin/frontend/tokenizer_pool.py).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager

from input_builders.media_config import MediaConfig, knob
from input_builders.media_errors import MediaTooLargeError

__all__ = ["DecodeBudget"]

_CLOCK_EVERY = 64  # packets / frames between two looks at the clock (a look costs ~50 ns; cheap either way)


class DecodeBudget:
    """The budget of one media item (``what``: "video", "audio"), from its creation on."""

    def __init__(self, config: MediaConfig, what: str, source: str):
        self.config, self.what, self.source = config, what, source
        self.timeout = config.limits.media_decode_timeout
        self.spent = 0.0  # seconds spent under ``running`` before the current run
        self._since: float | None = None
        self.max_frames = config.limits.max_video_decode_frames
        self.frames = 0  # counted by ``count`` (one counter per pass: the caller resets it)
        self._ticks = 0

    @contextmanager
    def running(self) -> Iterator[DecodeBudget]:
        """Time the work done inside against the item's wall-clock budget."""
        self._since = time.monotonic()
        try:
            yield self
        finally:
            self.spent += time.monotonic() - self._since
            self._since = None

    def check_header(self, header_frames: int | None, duration: float | None, fps: float | None) -> None:
        """Refuse before reading a packet a video whose header states more frames than the budget:
        its frame count, or its duration at its frame rate."""
        estimate = max(header_frames or 0, round(duration * fps) if duration and fps else 0)
        if estimate > self.max_frames:
            raise self._too_many(f"has {estimate} frames" + (f" ({duration:.1f} s at {fps:g} fps)"
                                                             if duration and fps else ""))

    def count(self, frames: int = 1) -> None:
        """``frames`` more demuxed or decoded; refuse past the frame budget or the deadline."""
        self.frames += frames
        if self.frames > self.max_frames:
            raise self._too_many(f"has more than {self.max_frames} frames")
        self.tick()

    def tick(self) -> None:
        """Refuse once the item's wall-clock budget is spent (looked at every few calls)."""
        self._ticks += 1
        if (self._ticks % _CLOCK_EVERY == 0 and self._since is not None
                and self.spent + time.monotonic() - self._since > self.timeout):
            raise MediaTooLargeError(
                f"{self.what} ({self.source}) takes longer than {self.timeout:g} s to decode, the limit per "
                f"{self.what} ({knob(self.config, 'media_decode_timeout')}); send a shorter or smaller {self.what}")

    def _too_many(self, what_it_has: str) -> MediaTooLargeError:
        return MediaTooLargeError(
            f"video ({self.source}) {what_it_has}; the server demuxes and decodes at most {self.max_frames} frames "
            f"per video, however few it samples ({knob(self.config, 'max_video_decode_frames')}); send a shorter "
            "video or one at a lower frame rate")
