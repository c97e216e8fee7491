"""Images: a reference from a request -> an upright RGB ``PIL.Image`` plus a digest, or a
``MediaError`` that says what was wrong and how to fix it (the server answers those with HTTP 400).
See docs/architecture.md (request path).

What ``load_image(ref, config)`` accepts: a ``PIL.Image.Image`` (already decoded; only the pixel
cap, EXIF orientation and RGB conversion apply), or any reference ``input_builders.sources``
reads (bytes, a path, a data:, file:// or http(s) URL, base64 text).

Limits (``MediaConfig.limits``, each named in the error that enforces it): ``max_image_bytes``
caps the encoded bytes; ``max_image_pixels`` caps width × height, checked from the header before
the pixels are decoded; ``max_request_pixels`` caps the width × height of all images of one
request together (``load_images``, or a ``PixelBudget`` handed to ``load_image``): each image is
charged from its header, before its pixels are decoded, so the image that would pass the budget is
refused undecoded and what the request decoded before it stays within the budget. A per-image cap
alone lets one request hold many images just under it (eight 36 MP images are over 800 MB as RGB).
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import io
import os
import threading
import warnings
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
from PIL import ExifTags, Image, ImageOps, UnidentifiedImageError

from input_builders.media_config import MediaConfig, check_bytes, knob
from input_builders.media_errors import MediaDecodeError, MediaError, MediaTooLargeError
from input_builders.sources import read_local, read_str

__all__ = ["LoadedImage", "PixelBudget", "limit_decoded_image_cache", "load_image", "load_images"]


@dataclass(frozen=True)
class LoadedImage:
    image: Image.Image  # RGB, EXIF-transposed, fully loaded
    digest: str  # sha256 hex of the source bytes (of mode, size and pixels for a PIL input)
    source: str  # short description for messages and logs: path, "data: URL (1234 bytes)", host



class PixelBudget:
    """The pixels all images of one request may take together (``config.limits.max_request_pixels``).
    ``load_image`` charges each image from its header, before decoding it; an image served from
    the decoded-image cache is charged too (the request holds its pixels all the same). One per
    request, used by one thread."""

    def __init__(self, config: MediaConfig):
        self.config = config
        self.limit = config.limits.max_request_pixels
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
    """Load ``ref`` (see input_builders.sources) under ``config``'s policy; raise a ``MediaError`` if not.
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
        check_bytes(len(data), "image bytes", config)
    elif isinstance(ref, os.PathLike):
        data, source = read_local(os.fspath(ref), config)
    elif isinstance(ref, str):
        inline_key = _inline_key(ref)
        known = _recently_decoded.get_inline(inline_key, ref, config) if inline_key else None
        if known is not None:
            if budget is not None:
                budget.charge(*known.image.size, known.source)
            return known
        data, source, hint = read_str(ref, config)
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
        return digest, config.limits.max_image_pixels

    @staticmethod
    def _alias_key(fingerprint: tuple, config: MediaConfig) -> tuple:
        # max_image_bytes too: the data URL's size was checked under it before it was decoded
        return fingerprint, config.limits.max_image_pixels, config.limits.max_image_bytes

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
        # must be the pixels alone: when nothing above made a new image, a plain image over the
        # file image's own pixels (what copy() returns, without copying them: the file image is
        # dropped here, so nothing else holds or changes them; a read-only one, pixels mapped
        # from a file, is copied as before).
        if finished is not image:
            return finished
        return image.copy() if image.readonly else image._new(image.im)


def _finish(image: Image.Image, source: str, config: MediaConfig, *, owned: bool,
            budget: PixelBudget | None = None) -> Image.Image:
    """Pixel caps (from the header size, before any pixel is decoded: the image's, then the
    request's ``budget``), load, EXIF orientation, RGB. ``owned``: the image is ours to transform
    in place (not the caller's object)."""
    width, height = image.size
    if width * height > config.limits.max_image_pixels:
        raise MediaTooLargeError(
            f"image ({source}) is {width}x{height} = {width * height} pixels; the limit is "
            f"{config.limits.max_image_pixels} ({knob(config, 'max_image_pixels')}); send a smaller image"
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
            f"{config.limits.max_image_pixels} pixels ({knob(config, 'max_image_pixels')}); send a smaller image"
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
