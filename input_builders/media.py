"""Media loading for the input builders: turn an image reference from a request into an upright RGB
``PIL.Image`` plus a digest, or refuse it with a ``MediaError`` that says what was wrong and how to fix
it (the server answers those with HTTP 400). See docs/architecture.md (request path).

What ``load_image(ref, config)`` accepts
----------------------------------------
* ``PIL.Image.Image``: already decoded; only the pixel cap, EXIF orientation and RGB conversion apply.
* ``bytes`` / ``bytearray`` / ``memoryview``: an encoded image file.
* ``os.PathLike``: a local path.
* ``str``, classified in this order (the first rule that matches wins):

  1. ``data:`` → data URL, which must be base64 (``data:image/png;base64,...``).
  2. ``file:`` → ``file:///absolute/path`` (host empty or ``localhost``) → a local path.
  3. ``http://`` / ``https://`` → fetched, only from hosts in the domain allow-list.
  4. any other ``scheme://`` → refused.
  5. **raw base64** if it is longer than PATH_MAX (4096: no path is that long) or starts with ``/9j/``.
  6. a **local path** if it starts with ``/``, ``./``, ``../`` or ``~``.
  7. **raw base64** if it consists only of the base64 alphabet ``A-Z a-z 0-9 + / =`` (and line breaks).
  8. otherwise a **local path** (``images/cat.png``: the ``.`` is not base64).

  Why ``/9j/``: base64 starts with ``/`` only when the first byte is >= 0xFC, and of the formats we
  decode only JPEG (FF D8 FF, i.e. ``/9j/``) does that. So absolute paths are paths (``/etc/passwd``),
  base64 JPEGs are base64, and the one thing given up is a top-level directory named ``9j``. The
  remaining ambiguity is a *relative* path made only of base64 characters (``images/cat``, no
  extension): it is read as base64, and the decode error says to write ``./images/cat`` instead.

Policy (each limit is a ``MediaConfig`` field and is named in the error that enforces it)
----------------------------------------------------------------------------------------
* Local files only below ``allowed_local_media_paths``, checked on the fully resolved path (``..``
  and every symlink resolved), so a symlink inside an allowed directory that points outside is refused.
* http(s) only when ``allowed_domains`` is set: exact host or a subdomain of a listed domain, every
  redirect hop checked again, ``http_timeout_s`` for the whole fetch (connect, headers, body,
  redirects): at the deadline its sockets are shut down, so a host that trickles a byte at a time or
  never answers is cut there. ``fetch_url`` is the same fetch for callers that prefetch URLs off
  their main thread (the tokenizer workers); ``prefetched`` hands its results to ``load_image``.
* ``max_image_bytes`` caps the encoded bytes of every source kind (checked before base64 decoding, and
  a download reads at most cap + 1 bytes); ``max_image_pixels`` caps width × height, checked from the
  header before the pixels are decoded.
* ``max_request_pixels`` caps the width × height of all images of one request together
  (``load_images``, or a ``PixelBudget`` handed to ``load_image``): each image is charged from its
  header, before its pixels are decoded, so the image that would pass the budget is refused
  undecoded and what the request decoded before it stays within the budget. A per-image cap alone
  lets one request hold many images just under it (eight 36 MP images are over 800 MB as RGB).
"""

from __future__ import annotations

import base64
import contextlib
import contextvars
import functools
import hashlib
import http.client
import io
import ipaddress
import math
import os
import re
import socket
import stat
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
import warnings
from dataclasses import dataclass
from typing import BinaryIO, Iterator

import numpy as np
from PIL import ExifTags, Image, ImageOps, UnidentifiedImageError

__all__ = [
    "ByteCap",
    "LoadedImage",
    "MediaConfig",
    "MediaDecodeError",
    "MediaError",
    "MediaFetchError",
    "MediaNotAllowedError",
    "MediaNotFoundError",
    "MediaTooLargeError",
    "PixelBudget",
    "default_max_request_pixels",
    "load_image",
    "load_images",
    "read_media_bytes",
]


# ----------------------------------------------------------------------------------------- errors


class MediaError(ValueError):
    """An image reference that cannot be served; the message says what is wrong and how to fix it.
    The server maps every ``MediaError`` to HTTP 400."""


class MediaNotAllowedError(MediaError):
    """Path outside the allowed directories, http(s) without (or outside) the allow-list, bad scheme."""


class MediaTooLargeError(MediaError):
    """Over ``max_image_bytes`` (encoded size), ``max_image_pixels`` (width × height) or, for all
    images of a request together, ``max_request_pixels``."""


class MediaDecodeError(MediaError):
    """Not an image, truncated or corrupt, bad base64 / data URL, unsupported mode, empty, wrong type."""


class MediaNotFoundError(MediaError):
    """An allowed path that does not exist or is not a regular file; an http(s) 404 / 410."""


class MediaFetchError(MediaError):
    """An allowed http(s) URL that could not be fetched: timeout, connection failure, HTTP error status."""


# ----------------------------------------------------------------------------------------- config

# How each limit is set, per API: an error names the knob of the API the caller is using, so the
# fix is one copy-paste away (a server flag means nothing inside the offline LLM, and vice versa).
_KNOBS = {
    "server": {"local": "start the server with --allowed-local-media-path DIR",
               "domains": "start the server with --allowed-media-domains {host}",
               "max_image_bytes": "--max-image-bytes", "max_image_pixels": "--max-image-pixels",
               "max_request_pixels": "--max-request-pixels",
               "max_video_bytes": "--max-video-bytes", "max_video_seconds": "--max-video-seconds",
               "max_video_frames": "--max-video-frames", "max_video_frame_pixels": "--max-video-frame-pixels",
               "max_audio_bytes": "--max-audio-bytes", "max_audio_seconds": "--max-audio-seconds"},
    "offline": {"local": "pass LLM(..., media_config=MediaConfig(allowed_local_media_paths=('DIR',)))",
                "domains": "pass LLM(..., media_config=MediaConfig(allowed_domains=('{host}',)))",
                "max_image_bytes": "MediaConfig.max_image_bytes", "max_image_pixels": "MediaConfig.max_image_pixels",
                "max_request_pixels": "MediaConfig.max_request_pixels",
                "max_video_bytes": "MediaConfig.max_video_bytes", "max_video_seconds": "MediaConfig.max_video_seconds",
                "max_video_frames": "MediaConfig.max_video_frames",
                "max_video_frame_pixels": "MediaConfig.max_video_frame_pixels",
                "max_audio_bytes": "MediaConfig.max_audio_bytes", "max_audio_seconds": "MediaConfig.max_audio_seconds"},
}


@dataclass(frozen=True)
class MediaConfig:
    """Where images may come from and how big they may be. Validated and normalised on construction."""

    # Directories (normalised with realpath; each must exist). Empty: local files are refused.
    allowed_local_media_paths: tuple[str, ...] = ()
    # http(s) host allow-list: bare host names or IPs; a name also admits its subdomains. Empty: refused.
    allowed_domains: tuple[str, ...] = ()
    # Encoded size. 20 MiB is OpenAI's per-image limit, so clients written for it fit.
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
    # Frames sampled from one video: Qwen's own cap (FPS_MAX_FRAMES); a request's max_frames may lower it.
    max_video_frames: int = 768
    # Width x height of the source frames, from the stream header: DCI 4K. Every kept frame is decoded
    # at this size before its resize (a 768-frame 8K video would be 25 GB of RGB while decoding).
    max_video_frame_pixels: int = 4096 * 2160
    # Videos per prompt (--limit-mm-per-prompt video=N); None: the model's own limit, which it may not exceed.
    max_videos_per_prompt: int | None = None
    # Audio (input_builders.audio), per clip. Encoded size: OpenAI's 25 MB audio upload limit.
    max_audio_bytes: int = 25 * 1024 * 1024
    # Duration: 240 s is eight 30 s windows, 6000 audio tokens, inside Qwen2-Audio's 8192-token context.
    max_audio_seconds: float = 240.0
    # Per socket operation and for the whole download.
    http_timeout_s: float = 10.0
    # Which API set these limits ("offline": LLM's media_config; "server": its flags): error
    # messages name that API's knob.
    api: str = "offline"

    def __post_init__(self) -> None:
        if self.api not in _KNOBS:
            raise ValueError(f"MediaConfig.api must be one of {', '.join(_KNOBS)}, got {self.api!r}")
        dirs = tuple(_normalise_dir(p) for p in _as_tuple(self.allowed_local_media_paths))
        domains = tuple(_normalise_domain(d) for d in _as_tuple(self.allowed_domains))
        object.__setattr__(self, "allowed_local_media_paths", tuple(dict.fromkeys(dirs)))
        object.__setattr__(self, "allowed_domains", tuple(dict.fromkeys(domains)))
        if self.max_request_pixels is None and _positive_int(self.max_image_pixels):
            object.__setattr__(self, "max_request_pixels", default_max_request_pixels(self.max_image_pixels))
        for name in ("max_image_bytes", "max_image_pixels", "max_request_pixels", "max_video_bytes",
                     "max_video_frames", "max_video_frame_pixels", "max_audio_bytes"):
            value = getattr(self, name)
            if not _positive_int(value):
                raise ValueError(f"MediaConfig.{name} must be a positive integer, got {value!r}")
        videos = self.max_videos_per_prompt
        if videos is not None and (isinstance(videos, bool) or not isinstance(videos, int) or videos < 0):
            raise ValueError(f"MediaConfig.max_videos_per_prompt must be an integer >= 0 or None, got {videos!r}")
        seconds = self.max_video_seconds
        if (isinstance(seconds, bool) or not isinstance(seconds, (int, float))
                or not math.isfinite(seconds) or seconds <= 0):
            raise ValueError(f"MediaConfig.max_video_seconds must be a positive number of seconds, got {seconds!r}")
        audio_seconds = self.max_audio_seconds
        if (isinstance(audio_seconds, bool) or not isinstance(audio_seconds, (int, float))
                or not math.isfinite(audio_seconds) or audio_seconds <= 0):
            raise ValueError(f"MediaConfig.max_audio_seconds must be a positive number of seconds, got {audio_seconds!r}")
        timeout = self.http_timeout_s
        if (isinstance(timeout, bool) or not isinstance(timeout, (int, float))
                or not math.isfinite(timeout) or timeout <= 0):
            raise ValueError(f"MediaConfig.http_timeout_s must be a positive number of seconds, got {timeout!r}")


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


def _positive_int(value) -> bool:
    return not isinstance(value, bool) and isinstance(value, int) and value > 0


def _as_tuple(value) -> tuple:
    # A lone string is one entry, not a tuple of characters (the usual CLI-wiring slip).
    if isinstance(value, (str, os.PathLike)):
        return (value,)
    return tuple(value)


def _normalise_dir(path) -> str:
    real = os.path.realpath(os.path.expanduser(os.fspath(path)))
    if not os.path.isdir(real):
        # Fail at startup: a typo here would otherwise refuse every request with a confusing message.
        raise ValueError(f"MediaConfig.allowed_local_media_paths: {path!r} is not an existing directory")
    return real


def _normalise_domain(domain) -> str:
    name = str(domain).strip().lower().strip("[]")
    if name.startswith("*."):  # "*.example.com" means what "example.com" already means here
        name = name[2:]
    name = name.strip(".")
    if not name or (not _is_ip(name) and re.search(r"[/:@?#\s]", name)):
        raise ValueError(
            f"MediaConfig.allowed_domains: {domain!r} is not a host name; give bare hosts such as "
            "'example.com' or '10.0.0.5' (no scheme, port or path)"
        )
    return name


def _is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


# ----------------------------------------------------------------------------------------- result


@dataclass(frozen=True)
class LoadedImage:
    image: Image.Image  # RGB, EXIF-transposed, fully loaded
    digest: str  # sha256 hex of the source bytes (of mode, size and pixels for a PIL input)
    source: str  # short description for messages and logs: path, "data: URL (1234 bytes)", host


# ------------------------------------------------------------------------------------- entry point

_PATH_MAX = 4096  # Linux PATH_MAX: a longer string cannot be a path
_BASE64_ONLY = re.compile(r"[A-Za-z0-9+/=\r\n]+")
_BASE64_JPEG = "/9j/"  # base64 of FF D8 FF: the only image base64 that starts with "/"
_PATH_PREFIXES = ("/", "./", "../", "~")
_OTHER_SCHEME = re.compile(r"([A-Za-z][A-Za-z0-9+.-]*)://")
_NOT_A_PATH_HINT = (
    " (a relative name made only of base64 characters is read as base64: write a local file as "
    "./name or /absolute/path)"
)


class PixelBudget:
    """The pixels all images of one request may take together (``config.max_request_pixels``).
    ``load_image`` charges each image from its header, before decoding it; an image served from
    the decoded-image cache is charged too (the request holds its pixels all the same). One per
    request, used by one thread."""

    def __init__(self, config: MediaConfig):
        self.config = config
        self.limit = config.max_request_pixels
        self.used = 0
        self.images = 0

    def charge(self, width: int, height: int, source: str) -> None:
        pixels = width * height
        if self.used + pixels > self.limit:
            flag = knob(self.config, "max_request_pixels")
            if not self.images:
                raise MediaTooLargeError(
                    f"image ({source}) is {width}x{height} = {pixels} pixels; the limit for all images of one "
                    f"request is {self.limit} ({flag}); send a smaller image")
            raise MediaTooLargeError(
                f"the request's images come to {self.used + pixels} pixels with image {self.images + 1} ({source}, "
                f"{width}x{height} = {pixels} pixels); the limit for all images of one request is {self.limit} "
                f"({flag}); send fewer or smaller images, or split them over several requests")
        self.used += pixels
        self.images += 1


def load_images(refs, config: MediaConfig) -> list[LoadedImage]:
    """Every image of one request (``load_image`` each), under one ``PixelBudget``."""
    budget = PixelBudget(config)
    return [load_image(ref, config, budget) for ref in refs]


def load_image(ref, config: MediaConfig, budget: PixelBudget | None = None) -> LoadedImage:
    """Load ``ref`` (see the module docstring) under ``config``'s policy; raise a ``MediaError`` if not.
    ``budget``: the request's pixels so far (``load_images``), charged with this image's."""
    if isinstance(ref, Image.Image):
        source = f"PIL image ({ref.mode}, {ref.width}x{ref.height})"
        with _pillow_errors(source, config):
            image = _finish(ref, source, config, owned=False, budget=budget)
        # The caller's image has no file bytes; hash what we serve. Hashing the input's tobytes() alone
        # would give two palette images with equal indices but different palettes one dedup key.
        return LoadedImage(image, _pixel_digest(image), source)

    hint, inline_key = "", None
    if isinstance(ref, (bytes, bytearray, memoryview)):
        data = bytes(ref)
        source = f"image bytes ({len(data)} bytes)"
        _check_bytes(len(data), "image bytes", config)
    elif isinstance(ref, os.PathLike):
        data, source = _read_local(os.fspath(ref), config)
    elif isinstance(ref, str):
        inline_key = _inline_key(ref)
        known = _recently_decoded.get_inline(inline_key, ref, config) if inline_key else None
        if known is not None:
            if budget is not None:
                budget.charge(*known.image.size, known.source)
            return known
        data, source, hint = _read_str(ref, config)
    else:
        unwrap = " (unwrap OpenAI {'url': ...} parts first)" if isinstance(ref, dict) else ""
        raise MediaDecodeError(
            f"unsupported image reference of type {type(ref).__name__}{unwrap}; send a path, a file://, "
            "data: or http(s) URL, a base64 string, bytes or a PIL image"
        )
    digest = hashlib.sha256(data).hexdigest()
    image = _recently_decoded.get(digest, config)
    if image is None:
        image = _decode(data, source, config, hint, budget)
        _recently_decoded.put(digest, config, image)
    elif budget is not None:
        budget.charge(*image.size, source)
    loaded = LoadedImage(image, digest, source)
    if inline_key:
        _recently_decoded.put_inline(inline_key, ref, config, loaded)
    return loaded


_FINGERPRINT_PROBE = 256  # characters sampled at each of a data URL's start, middle and end


def _inline_key(ref: str) -> tuple[int, int] | None:
    """A data: URL's fingerprint (None for any other reference): its length and a hash of three
    short samples of its text. A resent data URL is the same text; the cache confirms a hit by
    comparing the whole text with the one it kept (a memcmp, a fraction of what hashing the text
    or base64-decoding it costs: benchmarks/RESULTS.md, bench_multiturn_image's third and fifth
    rounds), so a fingerprint that collides costs a decode, never a wrong image. Paths and URLs
    are never keyed by their text: the file or the resource behind them may change."""
    if ref[:64].lstrip()[:5].lower() != "data:":
        return None
    middle = len(ref) // 2
    probe = _FINGERPRINT_PROBE
    return len(ref), hash((ref[:probe], ref[middle:middle + probe], ref[-probe:]))


class _DecodedImages:
    """The last images decoded in this process, by the digest of their source bytes: a chat
    resends its image every turn, and decoding it (base64, PNG / JPEG, RGB) was most of the
    frontend's time for it once its segment was reused. Bounded by decoded bytes; keyed by the
    policy too (the pixel cap was checked under it). Entries are never modified: everything
    downstream makes new images.

    Beside it, data URLs by their fingerprint (``_inline_key``) -> their whole text, and the
    source digest and description they gave, so that a resent data URL skips the base64 decode
    too. Those entries are bounded by the text they keep (``max_inline_bytes``) and in number
    (``max_inline``), and an image is served through one only while it is still in the
    byte-bounded image cache (they never hold an image themselves)."""

    def __init__(self, max_bytes: int, max_inline: int = 1024, max_inline_bytes: int | None = None):
        self.max_bytes, self.max_inline = max_bytes, max_inline
        self.max_inline_bytes = max_bytes // 2 if max_inline_bytes is None else max_inline_bytes
        self._images: dict[tuple, Image.Image] = {}  # insertion order = least recently used first
        self._inline: dict[tuple, tuple[str, str, str]] = {}  # the same order; (text, digest, source)
        self._bytes = self._inline_bytes = 0
        self._lock = threading.Lock()

    @staticmethod
    def _key(digest: str, config: MediaConfig) -> tuple:
        return digest, config.max_image_pixels

    @staticmethod
    def _alias_key(fingerprint: tuple, config: MediaConfig) -> tuple:
        # max_image_bytes too: the data URL's size was checked under it before it was decoded
        return fingerprint, config.max_image_pixels, config.max_image_bytes

    @staticmethod
    def _size(image: Image.Image) -> int:
        return image.width * image.height * len(image.getbands())

    def get(self, digest: str, config: MediaConfig) -> Image.Image | None:
        key = self._key(digest, config)
        with self._lock:
            image = self._images.pop(key, None)
            if image is not None:
                self._images[key] = image  # now the most recently used
            return image

    def put(self, digest: str, config: MediaConfig, image: Image.Image) -> None:
        key, size = self._key(digest, config), self._size(image)
        with self._lock:
            if size > self.max_bytes or key in self._images:
                return
            self._images[key] = image
            self._bytes += size
            while self._bytes > self.max_bytes:
                self._bytes -= self._size(self._images.pop(next(iter(self._images))))

    def get_inline(self, fingerprint: tuple, text: str, config: MediaConfig) -> LoadedImage | None:
        key = self._alias_key(fingerprint, config)
        with self._lock:
            known = self._inline.pop(key, None)
            if known is not None:
                self._inline[key] = known  # now the most recently used
        if known is None or known[0] != text:  # the whole text, not just the fingerprint
            return None
        image = self.get(known[1], config)
        return LoadedImage(image, known[1], known[2]) if image is not None else None

    def put_inline(self, fingerprint: tuple, text: str, config: MediaConfig, loaded: LoadedImage) -> None:
        key = self._alias_key(fingerprint, config)
        with self._lock:
            if len(text) > self.max_inline_bytes:
                return
            replaced = self._inline.pop(key, None)
            if replaced is not None:
                self._inline_bytes -= len(replaced[0])
            self._inline[key] = (text, loaded.digest, loaded.source)
            self._inline_bytes += len(text)
            while len(self._inline) > self.max_inline or self._inline_bytes > self.max_inline_bytes:
                self._inline_bytes -= len(self._inline.pop(next(iter(self._inline)))[0])


DECODED_CACHE_MAX_BYTES = 128 << 20
_recently_decoded = _DecodedImages(DECODED_CACHE_MAX_BYTES)


def limit_decoded_image_cache(max_bytes: int) -> None:
    """Bound this process's decoded-image cache to ``max_bytes`` of pixels (at most the default
    128 MiB): a tokenizer worker gives it no more than its shared-memory budget for images, so
    ``--shm-budget-bytes`` bounds both of the worker's image caches."""
    global _recently_decoded
    if max_bytes < 0:
        raise ValueError(f"the decoded-image cache needs max_bytes >= 0, got {max_bytes}")
    _recently_decoded = _DecodedImages(min(max_bytes, DECODED_CACHE_MAX_BYTES))


def pyav():
    """PyAV, the one decoding library of video and audio, imported on first use (a text-only
    service never loads FFmpeg), with FFmpeg's own logging off: its lines about a client's broken
    file are noise beside the error the client gets."""
    import av

    av.logging.set_level(None)
    return av


def read_media_bytes(ref, config: MediaConfig, *, kind: str, max_bytes: int) -> tuple[bytes, str]:
    """The encoded bytes of a media reference of any ``kind`` ("image", "video", "audio") and a
    short description of where they came from, under ``config``'s source policy (allowed
    directories, allowed domains, timeouts) and at most ``max_bytes`` (the kind's own limit, named
    ``max_<kind>_bytes`` in messages). Accepts what ``load_image`` accepts as encoded input: a
    ``str`` (the module docstring's rules 1–8; a data: URL must have a ``<kind>/...`` media type),
    an ``os.PathLike`` or bytes. Decoding is the caller's (each kind has its own decoder)."""
    cap = ByteCap(kind, max_bytes)
    if isinstance(ref, (bytes, bytearray, memoryview)):
        data = bytes(ref)
        _check_bytes(len(data), f"{kind} bytes", config, cap=cap)
        return data, f"{kind} bytes ({len(data)} bytes)"
    if isinstance(ref, os.PathLike):
        return _read_local(os.fspath(ref), config, cap)
    if isinstance(ref, str):
        data, source, _ = _read_str(ref, config, cap)
        return data, source
    unwrap = " (unwrap OpenAI {'url': ...} parts first)" if isinstance(ref, dict) else ""
    raise MediaDecodeError(f"unsupported {kind} reference of type {type(ref).__name__}{unwrap}; send a path, "
                           "a file://, data: or http(s) URL, a base64 string or bytes")


@dataclass(frozen=True)
class ByteCap:
    """The encoded-size limit one source is read under: the kind of media (named in messages,
    and the data: URL media type it must have) and its byte limit (knob ``max_<kind>_bytes``)."""

    kind: str
    limit: int

    def __post_init__(self):
        if not _positive_int(self.limit):
            raise ValueError(f"the {self.kind} byte limit must be a positive integer, got {self.limit!r}")

    @property
    def knob(self) -> str:
        return f"max_{self.kind}_bytes"

    @property
    def example(self) -> str:  # a data URL of this kind, for messages
        return f"data:{_MIME_EXAMPLES.get(self.kind, self.kind + '/...')};base64,<data>"


_MIME_EXAMPLES = {"image": "image/png", "video": "video/mp4", "audio": "audio/wav"}


def _image_cap(config: MediaConfig) -> ByteCap:
    return ByteCap("image", config.max_image_bytes)


def _read_str(ref: str, config: MediaConfig, cap: ByteCap | None = None) -> tuple[bytes, str, str]:
    """Classify a string reference (module docstring, rules 1–8) and return (bytes, source, hint)."""
    cap = cap or _image_cap(config)
    text = ref.strip()
    if not text:
        raise MediaDecodeError(f"the {cap.kind} reference is an empty string; send a path, URL or base64 {cap.kind}")
    head = text[:8].lower()
    if head.startswith("data:"):
        data, source = _read_data_url(text, config, cap)
        return data, source, ""
    if head.startswith("file:"):
        data, source = _read_local(_file_url_path(text), config, cap)
        return data, source, ""
    if head.startswith(("http://", "https://")):
        data, source = _fetch(text, config, cap)
        return data, source, ""
    scheme = _OTHER_SCHEME.match(text)
    if scheme:
        raise MediaNotAllowedError(
            f"URL scheme {scheme.group(1)!r} is not supported; send a path, a file://, data: or http(s):// URL, "
            f"or base64 {cap.kind} data"
        )
    if len(text) > _PATH_MAX or text.startswith(_BASE64_JPEG):
        return _read_raw_base64(text, "", config, cap)
    if text.startswith(_PATH_PREFIXES):
        data, source = _read_local(text, config, cap)
        return data, source, ""
    if _BASE64_ONLY.fullmatch(text):
        return _read_raw_base64(text, _NOT_A_PATH_HINT, config, cap)
    data, source = _read_local(text, config, cap)
    return data, source, ""


def _read_raw_base64(text: str, hint: str, config: MediaConfig,
                     cap: ByteCap | None = None) -> tuple[bytes, str, str]:
    data = _b64decode(text, "base64 string", config, hint, cap)
    return data, f"base64 string ({len(data)} bytes)", hint


# -------------------------------------------------------------------------------------- the sources


def _check_bytes(size: int, what: str, config: MediaConfig, *, at_least: bool = False,
                 cap: ByteCap | None = None) -> None:
    cap = cap or _image_cap(config)
    if size > cap.limit:
        amount = f"more than {cap.limit}" if at_least else str(size)
        raise MediaTooLargeError(
            f"{cap.kind} ({what}) is {amount} bytes; the limit is {cap.limit} "
            f"({knob(config, cap.knob)}); "
            f"send a smaller {cap.kind}"
        )


def knob(config: MediaConfig, which: str, **names) -> str:
    knobs = _KNOBS[config.api]
    if which not in knobs:  # a limit without its own entry: the MediaConfig field / server flag by its name
        return f"--{which.replace('_', '-')}" if config.api == "server" else f"MediaConfig.{which}"
    return knobs[which].format(**names)


def _clip(text: str, limit: int = 120) -> str:
    """User text echoed in a message, shortened: a 20 MB base64 string must not become the message."""
    return text if len(text) <= limit else f"{text[:limit]}…"


def _read_local(path: str, config: MediaConfig, cap: ByteCap | None = None) -> tuple[bytes, str]:
    cap = cap or _image_cap(config)
    shown = _clip(path)
    dirs = config.allowed_local_media_paths
    if not dirs:
        raise MediaNotAllowedError(
            f"path {shown} refused: reading local files is disabled (no allowed media directories); "
            f"{knob(config, 'local')}, or send the {cap.kind} inline as a data: URL"
        )
    if "\0" in path:
        raise MediaNotAllowedError(f"path {shown!r} contains a NUL byte; send a plain file path")
    # Resolve `..` and every symlink *before* the check: the target is what would be read. The check
    # comes before any existence test, so nobody can probe which files exist outside the directories.
    real = os.path.realpath(os.path.expanduser(path))
    if not any(real == d or real.startswith(d.rstrip(os.sep) + os.sep) for d in dirs):
        raise MediaNotAllowedError(
            f"path {shown} is outside the allowed media directories [{', '.join(dirs)}] (symlinks and '..' "
            f"are resolved first); put the {cap.kind} there, or allow its directory: {knob(config, 'local')}"
        )
    try:
        # O_NOFOLLOW: the resolved path must not have become a symlink since the check (a swap race);
        # O_NONBLOCK: a FIFO must not hang the worker before fstat says it is not a regular file.
        fd = os.open(real, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError:
        raise MediaNotFoundError(
            f"path {shown} does not exist (paths are read on the server, not the client); check the path"
        ) from None
    except PermissionError:
        raise MediaNotAllowedError(
            f"path {shown} cannot be read by the server (permission denied); make the file readable"
        ) from None
    except OSError as exc:
        raise MediaNotFoundError(f"path {shown} cannot be opened ({exc.strerror}); check the path") from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise MediaNotFoundError(f"path {shown} is not a regular file (a directory, device or pipe); "
                                     f"send the path of {'an' if cap.kind[0] in 'aeiou' else 'a'} {cap.kind} file")
        _check_bytes(info.st_size, f"path {shown}", config, cap=cap)
        with open(fd, "rb", closefd=False) as file:
            data = file.read(cap.limit + 1)  # the file may have grown since fstat
    finally:
        os.close(fd)
    _check_bytes(len(data), f"path {shown}", config, at_least=True, cap=cap)
    return data, shown


def _file_url_path(url: str) -> str:
    parts = urllib.parse.urlsplit(url)
    if parts.netloc not in ("", "localhost"):
        raise MediaNotAllowedError(
            f"file URL {_clip(url)} names host {parts.netloc!r}; only this server's files can be read: "
            "use file:///absolute/path (three slashes)"
        )
    path = urllib.parse.unquote(parts.path)
    if not path.startswith("/"):
        raise MediaNotAllowedError(f"file URL {_clip(url)} has no absolute path; use file:///absolute/path")
    return path


def _read_data_url(url: str, config: MediaConfig, cap: ByteCap | None = None) -> tuple[bytes, str]:
    cap = cap or _image_cap(config)
    header, comma, payload = url.partition(",")
    if not comma:
        raise MediaDecodeError(f"data: URL has no ',' before the data; send {cap.example}")
    media_type, *params = (p.strip().lower() for p in header[len("data:"):].split(";"))
    if media_type and not media_type.startswith(f"{cap.kind}/"):
        article = "an" if cap.kind[0] in "aeiou" else "a"
        raise MediaDecodeError(
            f"data: URL media type is {_clip(media_type, 40)!r}; send {article} {cap.kind}: {cap.example}"
        )
    if "base64" not in params:
        raise MediaDecodeError(f"data: URL is not base64-encoded; send {cap.example}")
    data = _b64decode(payload, "data: URL", config, cap=cap)
    return data, f"data: URL ({len(data)} bytes)"


def _b64decode(text: str, what: str, config: MediaConfig, hint: str = "", cap: ByteCap | None = None) -> bytes:
    payload = "".join(text.split()).rstrip("=")
    # Missing '=' padding is tolerated (some encoders drop it); a remainder of 1 is never valid.
    if len(payload) % 4 == 1:
        raise MediaDecodeError(f"{what} is not valid base64 (truncated: impossible length){hint}; "
                               "send standard base64 (A-Z a-z 0-9 + /)")
    # Cap the decoded size from the encoded length, before allocating anything.
    _check_bytes(len(payload) * 3 // 4, what, config, cap=cap)
    try:
        return base64.b64decode(payload + "=" * (-len(payload) % 4), validate=True)
    except ValueError as exc:  # binascii.Error, and non-ASCII text
        raise MediaDecodeError(
            f"{what} is not valid base64 ({exc}){hint}; send standard base64 (A-Z a-z 0-9 + /)"
        ) from None


# ------------------------------------------------------------------------------------------- http(s)


def _host_allowed(host: str, domains: tuple[str, ...]) -> bool:
    """Exact match, or a subdomain of a listed name ("img.example.com" under "example.com", never
    "badexample.com"). IP entries match exactly: "1.127.0.0.1" is not "under" 127.0.0.1."""
    host = host.lower().rstrip(".")
    return any(host == d or (not _is_ip(d) and host.endswith("." + d)) for d in domains)


def _allowed_host(url: str, config: MediaConfig, kind: str = "image") -> str:
    """The URL's host if fetching it is allowed; raise ``MediaNotAllowedError`` otherwise."""
    shown = _clip(url)
    try:
        parts = urllib.parse.urlsplit(url)
        host = parts.hostname  # lower-cased; user-info ("allowed.com@evil.com") is not the host
        parts.port  # noqa: B018 -- raises ValueError on a malformed port
    except ValueError as exc:
        raise MediaNotAllowedError(f"URL {shown} is malformed ({exc}); send a valid http(s) URL") from None
    if parts.scheme.lower() not in ("http", "https"):
        raise MediaNotAllowedError(f"URL {shown} is not http(s); only http(s) URLs are fetched")
    if not config.allowed_domains:
        raise MediaNotAllowedError(
            f"URL {shown} refused: fetching http(s) {kind}s is disabled (no allowed media domains); send the "
            f"{kind} inline as a data: URL, or {knob(config, 'domains', host='HOST')}"
        )
    if not host:
        raise MediaNotAllowedError(f"URL {shown} has no host; send a full http(s) URL")
    if not _host_allowed(host, config.allowed_domains):
        raise MediaNotAllowedError(
            f"host {host} is not in the allowed media domains [{', '.join(config.allowed_domains)}]; send the "
            f"{kind} inline as a data: URL, or {knob(config, 'domains', host=host)}"
        )
    return host


class _AllowListRedirects(urllib.request.HTTPRedirectHandler):
    """Follows a redirect only to an allowed host: the allow-list would mean nothing if an allowed
    host could bounce us anywhere (an internal address, say)."""

    def __init__(self, config: MediaConfig, kind: str = "image"):
        super().__init__()
        self._config, self._kind = config, kind

    def redirect_request(self, req, fp, code, msg, headers, newurl):
        try:
            _allowed_host(newurl, self._config, self._kind)
        except MediaNotAllowedError as exc:
            fp.close()
            raise MediaNotAllowedError(f"redirect from {urllib.parse.urlsplit(req.full_url).hostname} "
                                       f"refused: {exc}") from None
        return super().redirect_request(req, fp, code, msg, headers, newurl)


class _Deadline:
    """Shuts down every socket of one fetch when its time is up: a blocking connect, header or
    body read then fails at once, however slowly the host trickles (a socket timeout restarts
    with each byte, so it cannot bound a download)."""

    def __init__(self, seconds: float):
        self.expired = False
        self._sockets: list[socket.socket] = []
        self._lock = threading.Lock()
        self._timer = threading.Timer(seconds, self._expire)
        self._timer.daemon = True
        self._timer.start()

    def watch(self, sock: socket.socket) -> None:
        with self._lock:
            self._sockets.append(sock)
            expired = self.expired
        if expired:
            self._shut(sock)

    def _expire(self) -> None:
        with self._lock:
            self.expired = True
            sockets = list(self._sockets)
        for sock in sockets:
            self._shut(sock)

    @staticmethod
    def _shut(sock: socket.socket) -> None:
        with contextlib.suppress(OSError):
            sock.shutdown(socket.SHUT_RDWR)

    def cancel(self) -> None:
        self._timer.cancel()


def _watched_handlers(deadline: _Deadline) -> list:
    """urllib handlers whose connections register their sockets with ``deadline``."""

    def watched(base):
        class Connection(base):
            def connect(self):
                super().connect()
                deadline.watch(self.sock)
        return Connection

    http_connection, https_connection = watched(http.client.HTTPConnection), watched(http.client.HTTPSConnection)

    class HTTP(urllib.request.HTTPHandler):
        def http_open(self, req):
            return self.do_open(http_connection, req)

    class HTTPS(urllib.request.HTTPSHandler):
        def https_open(self, req):
            return self.do_open(https_connection, req, context=self._context)

    return [HTTP(), HTTPS()]


# URL -> (bytes, source) or the MediaError its fetch raised: results of ``fetch_url`` made ahead of
# ``load_image`` (``prefetched``), so the loader does not fetch again on the caller's thread.
_PREFETCHED: contextvars.ContextVar[dict | None] = contextvars.ContextVar("prefetched_media", default=None)


@contextlib.contextmanager
def prefetched(results: dict) -> Iterator[None]:
    """``load_image`` calls inside this block take http(s) URLs from ``results`` (``fetch_url``'s
    outcome per URL: ``(bytes, source)`` or the ``MediaError`` it raised) instead of fetching."""
    token = _PREFETCHED.set(results)
    try:
        yield
    finally:
        _PREFETCHED.reset(token)


def fetch_url(url: str, config: MediaConfig) -> tuple[bytes, str] | MediaError:
    """``url``'s bytes and source as ``load_image`` would fetch them, or the ``MediaError`` saying
    why not (returned, not raised: for a prefetch on another thread). Thread-safe."""
    try:
        return _fetch(url.strip(), config)
    except MediaError as error:
        return error


def _fetch(url: str, config: MediaConfig, cap: ByteCap | None = None) -> tuple[bytes, str]:
    cap = cap or _image_cap(config)
    # Prefetched results were fetched under the image policy (the workers prefetch image URLs
    # only): another kind is fetched here, under its own byte limit.
    done = _PREFETCHED.get() if cap.kind == "image" else None
    if done is not None and url in done:
        result = done[url]
        if isinstance(result, MediaError):
            raise result
        return result
    host = _allowed_host(url, config, cap.kind)
    source = f"URL on host {host}"
    timeout = config.http_timeout_s
    deadline = _Deadline(timeout)
    opener = urllib.request.build_opener(_AllowListRedirects(config, cap.kind), *_watched_handlers(deadline))
    request = urllib.request.Request(url, headers={"User-Agent": "atb-plugin-media/1", "Accept": f"{cap.kind}/*"})
    try:
        try:
            with opener.open(request, timeout=timeout) as response:
                length = response.headers.get("Content-Length", "")
                if length.isdigit():  # refuse early when the server tells us; never trust it as an upper bound
                    _check_bytes(int(length), source, config, cap=cap)
                data = _read_capped(response, cap.limit, deadline)
        except (OSError, http.client.HTTPException):
            if deadline.expired:  # whatever the cut socket raised: the deadline's doing
                raise _timed_out(source, timeout, cap.kind) from None
            raise
    except MediaError:
        raise
    except urllib.error.HTTPError as exc:
        exc.close()
        kind = MediaNotFoundError if exc.code in (404, 410) else MediaFetchError
        raise kind(f"{source} answered HTTP {exc.code} {exc.reason}; check the URL") from None
    except TimeoutError:
        raise _timed_out(source, timeout, cap.kind) from None
    except urllib.error.URLError as exc:
        if isinstance(exc.reason, TimeoutError):
            raise _timed_out(source, timeout, cap.kind) from None
        raise MediaFetchError(f"{source} could not be fetched ({exc.reason}); check the URL") from None
    except (OSError, http.client.HTTPException) as exc:  # reset connection, bad status line, short body
        raise MediaFetchError(
            f"{source} could not be fetched ({type(exc).__name__}: {exc}); check the URL"
        ) from None
    finally:
        deadline.cancel()
    if data is None:
        raise _timed_out(source, timeout, cap.kind)
    _check_bytes(len(data), source, config, at_least=True, cap=cap)
    return data, source


def _timed_out(source: str, timeout: float, kind: str = "image") -> MediaFetchError:
    return MediaFetchError(f"{source} timed out after {timeout:g} s (http_timeout_s), the limit for the whole "
                           f"download; try a faster host or send the {kind} inline as a data: URL")


def _read_capped(stream: BinaryIO, cap: int, deadline: _Deadline | float, chunk: int = 1 << 16) -> bytes | None:
    """At most ``cap + 1`` bytes (one more than allowed is enough to know it is too big). None when
    ``deadline`` (a ``_Deadline``, which shuts the socket down and so ends a blocked read, or a
    ``time.monotonic()`` instant) passes first."""
    def expired() -> bool:
        return deadline.expired if isinstance(deadline, _Deadline) else time.monotonic() > deadline

    read = getattr(stream, "read1", stream.read)  # read1: what has arrived, so a trickle cannot pin a read
    parts, total = [], 0
    while total <= cap:
        if expired():
            return None
        block = read(min(chunk, cap + 1 - total))
        if not block:
            break
        parts.append(block)
        total += len(block)
    if expired():  # the shut-down socket reads as the end of the body: not a whole image
        return None
    return b"".join(parts)


# ------------------------------------------------------------------------------------------ decoding

# Raster formats a client may send. Pillow can open many more, but each plugin is attack surface, and
# some are worse than that: EPS hands the file to Ghostscript. (MPO phone photos open via JPEG.)
_WANTED_FORMATS = ("PNG", "JPEG", "GIF", "WEBP", "AVIF", "BMP", "TIFF", "PPM")


@functools.cache
def _formats() -> tuple[str, ...]:
    Image.init()
    return tuple(f for f in _WANTED_FORMATS if f in Image.OPEN)  # AVIF only where Pillow has libavif


def _decode(data: bytes, source: str, config: MediaConfig, hint: str = "",
            budget: PixelBudget | None = None) -> Image.Image:
    """The one decode path of every encoded source: header → pixel caps → pixels → upright RGB."""
    if not data:
        raise MediaDecodeError(f"{source} is empty; send the image file's contents")
    with _pillow_errors(source, config, hint), Image.open(io.BytesIO(data), formats=_formats()) as image:
        finished = _finish(image, source, config, owned=True, budget=budget)  # Image.open read the header only
        # A file image keeps its source for as long as it lives (a PNG its BytesIO and chunk
        # reader: the whole encoded file). What is returned, and kept in the decoded-image cache,
        # must be the pixels alone: a plain copy when nothing above made a new image.
        return finished.copy() if finished is image else finished


def _finish(image: Image.Image, source: str, config: MediaConfig, *, owned: bool,
            budget: PixelBudget | None = None) -> Image.Image:
    """Pixel caps (from the header size, before any pixel is decoded: the image's, then the
    request's ``budget``), load, EXIF orientation, RGB. ``owned``: the image is ours to transform
    in place (not the caller's object)."""
    width, height = image.size
    if width * height > config.max_image_pixels:
        raise MediaTooLargeError(
            f"image ({source}) is {width}x{height} = {width * height} pixels; the limit is "
            f"{config.max_image_pixels} ({knob(config, 'max_image_pixels')}); send a smaller image"
        )
    if budget is not None:
        budget.charge(width, height, source)
    image.load()
    return _to_rgb(_upright(image, owned), source)


@contextlib.contextmanager
def _pillow_errors(source: str, config: MediaConfig, hint: str = "") -> Iterator[None]:
    """Turns whatever Pillow raises on bad input into a ``MediaError``."""
    try:
        with warnings.catch_warnings():
            # Pillow only *warns* between MAX_IMAGE_PIXELS and twice that; a bomb must be a refusal, not
            # a log line. (catch_warnings is process-global before Python 3.14: in a thread race the
            # filter may be dropped — our own pixel cap still refuses — or linger, which only makes
            # this one warning category an error elsewhere too. Both are safe.)
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            yield
    except MediaError:
        raise
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as exc:
        raise MediaTooLargeError(
            f"image ({source}) is too large to decode safely ({exc}); the limit is "
            f"{config.max_image_pixels} pixels ({knob(config, 'max_image_pixels')}); send a smaller image"
        ) from None
    except UnidentifiedImageError:
        raise MediaDecodeError(
            f"{source} is not an image in a supported format ({', '.join(_formats())}){hint}; "
            "send the image file's bytes"
        ) from None
    except MemoryError:
        raise
    except Exception as exc:
        # Pillow's decoders raise a zoo of types on hostile or broken input (OSError for truncation,
        # SyntaxError, ValueError, struct.error, EOFError, IndexError, zlib.error...). Any of them means
        # the client's bytes cannot be decoded: that is their 400, not our 500.
        raise MediaDecodeError(
            f"{source} could not be decoded ({type(exc).__name__}: {exc}){hint}; the file is truncated "
            "or corrupt: send the complete image file"
        ) from None


def _upright(image: Image.Image, owned: bool) -> Image.Image:
    """Applies the EXIF orientation, as every photo viewer does: phones store pixels sideways."""
    if image.getexif().get(ExifTags.Base.Orientation, 1) not in range(2, 9):
        return image  # nothing to do; exif_transpose would still copy the image
    if owned:
        ImageOps.exif_transpose(image, in_place=True)
        return image
    return ImageOps.exif_transpose(image)  # a transposed copy: never modify the caller's image


_SIXTEEN_BIT = {"I;16": "<u2", "I;16L": "<u2", "I;16B": ">u2", "I;16N": "=u2", "I": "=i4"}
_HAS_ALPHA = ("RGBA", "LA", "PA", "RGBa")
_PLAIN_TO_RGB = ("1", "L", "P", "CMYK", "YCbCr", "HSV")


def _to_rgb(image: Image.Image, source: str) -> Image.Image:
    mode = image.mode
    if mode in _HAS_ALPHA or (mode in ("P", "L", "RGB") and "transparency" in image.info):
        # Transparent pixels become white, as in vLLM's rgba_to_rgb: Pillow's plain convert("RGB")
        # would keep whatever colour hides under alpha 0 (often black) and models would see it.
        return _on_white(image.convert("RGBA"))
    if mode == "RGB":
        return image
    if mode in _PLAIN_TO_RGB:
        return image.convert("RGB")
    if mode in _SIXTEEN_BIT:
        return _sixteen_bit_to_rgb(image, source)
    raise MediaDecodeError(
        f"{source} has image mode {mode!r}, which this server does not convert to RGB; send an 8-bit or "
        "16-bit RGB / grayscale image (PNG or JPEG)"
    )


def _on_white(rgba: Image.Image) -> Image.Image:
    background = Image.new("RGB", rgba.size, (255, 255, 255))
    background.paste(rgba, mask=rgba.getchannel("A"))
    return background


def _sixteen_bit_to_rgb(image: Image.Image, source: str) -> Image.Image:
    """16-bit grayscale (PNG / TIFF give I;16, 16-bit PGM gives I) scaled to 8 bits (v / 257).
    Pillow's convert clips to 255 instead, which turns an ordinary 16-bit photo nearly white."""
    samples = np.frombuffer(image.tobytes(), dtype=_SIXTEEN_BIT[image.mode]).reshape(image.height, image.width)
    if image.mode == "I" and samples.size and (samples.min() < 0 or samples.max() > 0xFFFF):
        raise MediaDecodeError(
            f"{source} has 32-bit integer samples outside the 16-bit range; send an 8-bit or 16-bit image"
        )
    eight = ((samples.astype(np.uint32) + 128) // 257).astype(np.uint8)
    return Image.fromarray(eight).convert("RGB")


def _pixel_digest(image: Image.Image) -> str:
    digest = hashlib.sha256(f"{image.mode}:{image.width}x{image.height}:".encode())
    digest.update(image.tobytes())
    return digest.hexdigest()
