"""Media references -> encoded bytes, under ``MediaConfig``'s source policy: the one reader of
every kind (images: input_builders.image; video and audio decode what ``read_media_bytes`` reads).

What a reference may be
-----------------------
* ``bytes`` / ``bytearray`` / ``memoryview``: the encoded file.
* ``os.PathLike``: a local path.
* ``str``, classified in this order (the first rule that matches wins):

  1. ``data:`` → data URL, which must be base64 (``data:image/png;base64,...``).
  2. ``file:`` → ``file:///absolute/path`` (host empty or ``localhost``) → a local path.
  3. ``http://`` / ``https://`` → fetched, only from hosts in the domain allow-list (input_builders.fetch).
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

Local files are read only below ``allowed_local_media_paths``, checked on the fully resolved path
(``..`` and every symlink resolved); every source kind is capped at its kind's encoded bytes
(``ByteCap``), before base64 decoding.
"""

from __future__ import annotations

import base64
import os
import re
import stat
import urllib.parse

from input_builders.fetch import fetch_bytes
from input_builders.media_config import ByteCap, MediaConfig, check_bytes, clip, image_cap, knob
from input_builders.media_errors import MediaDecodeError, MediaNotAllowedError, MediaNotFoundError

__all__ = ["read_base64", "read_local", "read_media_bytes", "read_str"]

_PATH_MAX = 4096  # Linux PATH_MAX: a longer string cannot be a path
_BASE64_ONLY = re.compile(r"[A-Za-z0-9+/=\r\n]+")
_BASE64_JPEG = "/9j/"  # base64 of FF D8 FF: the only image base64 that starts with "/"
_PATH_PREFIXES = ("/", "./", "../", "~")
_OTHER_SCHEME = re.compile(r"([A-Za-z][A-Za-z0-9+.-]*)://")
_NOT_A_PATH_HINT = (
    " (a relative name made only of base64 characters is read as base64: write a local file as "
    "./name or /absolute/path)"
)



def read_media_bytes(ref, config: MediaConfig, *, kind: str, max_bytes: int) -> tuple[bytes, str]:
    """The encoded bytes of a media reference of any ``kind`` ("image", "video", "audio") and a
    short description of where they came from, under ``config``'s source policy (allowed
    directories, allowed domains, timeouts) and at most ``max_bytes`` (the kind's own limit, named
    ``max_<kind>_bytes`` in messages). Accepts what ``load_image`` accepts as encoded input: a
    ``str`` (the rules above 1–8; a data: URL must have a ``<kind>/...`` media type),
    an ``os.PathLike`` or bytes. Decoding is the caller's (each kind has its own decoder)."""
    cap = ByteCap(kind, max_bytes)
    if isinstance(ref, (bytes, bytearray, memoryview)):
        data = bytes(ref)
        check_bytes(len(data), f"{kind} bytes", config, cap=cap)
        return data, f"{kind} bytes ({len(data)} bytes)"
    if isinstance(ref, os.PathLike):
        return read_local(os.fspath(ref), config, cap)
    if isinstance(ref, str):
        data, source, _ = read_str(ref, config, cap)
        return data, source
    unwrap = " (unwrap OpenAI {'url': ...} parts first)" if isinstance(ref, dict) else ""
    raise MediaDecodeError(f"unsupported {kind} reference of type {type(ref).__name__}{unwrap}; send a path, "
                           "a file://, data: or http(s) URL, a base64 string or bytes")



def read_base64(text, what: str, config: MediaConfig, *, kind: str, max_bytes: int, hint: str = "") -> bytes:
    """The bytes of ``text``, which must be standard base64 and nothing else: no path, no file://,
    data: or http(s) URL (OpenAI's ``input_audio.data``). ``what`` names the field in messages;
    ``hint`` says where the other spellings go."""
    if not isinstance(text, str):
        raise MediaDecodeError(f"{what} must be a base64 string, got {type(text).__name__}{hint}")
    head = text.strip()[:8].lower()
    if head.startswith(("data:", "file:")) or _OTHER_SCHEME.match(text.strip()):
        raise MediaDecodeError(f"{what} must be base64-encoded {kind} bytes, not a URL ({clip(text, 40)!r}){hint}")
    return _b64decode(text, what, config, hint, ByteCap(kind, max_bytes))


def read_str(ref: str, config: MediaConfig, cap: ByteCap | None = None) -> tuple[bytes, str, str]:
    """Classify a string reference (module docstring, rules 1–8) and return (bytes, source, hint)."""
    cap = cap or image_cap(config)
    text = ref.strip()
    if not text:
        raise MediaDecodeError(f"the {cap.kind} reference is an empty string; send a path, URL or base64 {cap.kind}")
    head = text[:8].lower()
    if head.startswith("data:"):
        data, source = _read_data_url(text, config, cap)
        return data, source, ""
    if head.startswith("file:"):
        data, source = read_local(_file_url_path(text), config, cap)
        return data, source, ""
    if head.startswith(("http://", "https://")):
        data, source = fetch_bytes(text, config, cap)
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
        data, source = read_local(text, config, cap)
        return data, source, ""
    if _BASE64_ONLY.fullmatch(text):
        return _read_raw_base64(text, _NOT_A_PATH_HINT, config, cap)
    data, source = read_local(text, config, cap)
    return data, source, ""


def _read_raw_base64(text: str, hint: str, config: MediaConfig,
                     cap: ByteCap | None = None) -> tuple[bytes, str, str]:
    data = _b64decode(text, "base64 string", config, hint, cap)
    return data, f"base64 string ({len(data)} bytes)", hint



def read_local(path: str, config: MediaConfig, cap: ByteCap | None = None) -> tuple[bytes, str]:
    cap = cap or image_cap(config)
    shown = clip(path)
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
        check_bytes(info.st_size, f"path {shown}", config, cap=cap)
        with open(fd, "rb", closefd=False) as file:
            data = file.read(cap.limit + 1)  # the file may have grown since fstat
    finally:
        os.close(fd)
    check_bytes(len(data), f"path {shown}", config, at_least=True, cap=cap)
    return data, shown


def _file_url_path(url: str) -> str:
    parts = urllib.parse.urlsplit(url)
    if parts.netloc not in ("", "localhost"):
        raise MediaNotAllowedError(
            f"file URL {clip(url)} names host {parts.netloc!r}; only this server's files can be read: "
            "use file:///absolute/path (three slashes)"
        )
    path = urllib.parse.unquote(parts.path)
    if not path.startswith("/"):
        raise MediaNotAllowedError(f"file URL {clip(url)} has no absolute path; use file:///absolute/path")
    return path


def _read_data_url(url: str, config: MediaConfig, cap: ByteCap | None = None) -> tuple[bytes, str]:
    cap = cap or image_cap(config)
    header, comma, payload = url.partition(",")
    if not comma:
        raise MediaDecodeError(f"data: URL has no ',' before the data; send {cap.example}")
    media_type, *params = (p.strip().lower() for p in header[len("data:"):].split(";"))
    if media_type and not media_type.startswith(f"{cap.kind}/"):
        article = "an" if cap.kind[0] in "aeiou" else "a"
        raise MediaDecodeError(
            f"data: URL media type is {clip(media_type, 40)!r}; send {article} {cap.kind}: {cap.example}"
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
    check_bytes(len(payload) * 3 // 4, what, config, cap=cap)
    try:
        return base64.b64decode(payload + "=" * (-len(payload) % 4), validate=True)
    except ValueError as exc:  # binascii.Error, and non-ASCII text
        raise MediaDecodeError(
            f"{what} is not valid base64 ({exc}){hint}; send standard base64 (A-Z a-z 0-9 + /)"
        ) from None

