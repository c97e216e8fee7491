"""The refusals of media loading: a ``MediaError`` says what was wrong with a request's media
reference and how to fix it; the server answers every one with HTTP 400."""

from __future__ import annotations

__all__ = ["MediaDecodeError", "MediaError", "MediaFetchError", "MediaNotAllowedError", "MediaNotFoundError",
           "MediaTooLargeError"]


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

