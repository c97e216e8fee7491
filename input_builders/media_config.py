"""``MediaConfig``: where a request's media may come from (the source policy) and how big it may be
(its ``MediaLimits``), and how an error names the knob that changes a limit.

Policy (each limit is a ``MediaLimits`` field, named in the error that enforces it)
-----------------------------------------------------------------------------------
* Local files only below ``allowed_local_media_paths``, checked on the fully resolved path (``..``
  and every symlink resolved), so a symlink inside an allowed directory that points outside is refused.
* http(s) only when ``allowed_domains`` is set: exact host or a subdomain of a listed domain, every
  redirect hop checked again, ``http_timeout_s`` for the whole fetch (input_builders.fetch).
* ``max_image_bytes`` caps the encoded bytes of every source kind (checked before base64 decoding, and
  a download reads at most cap + 1 bytes); ``max_image_pixels`` caps width × height, checked from the
  header before the pixels are decoded; ``max_request_pixels`` caps all images of one request together
  (input_builders.image). Video and audio have their own byte caps (``ByteCap``) and limits.
"""

from __future__ import annotations

import ipaddress
import math
import os
import re
from dataclasses import dataclass, field

from atb_plugin.multimodal.limits import LIMIT_FIELDS, MediaLimits, flat_limits
from input_builders.media_errors import MediaTooLargeError

__all__ = ["ByteCap", "MediaConfig", "check_bytes", "clip", "image_cap", "is_ip", "knob"]

# How the source policy is set, per API: an error names the knob of the API the caller is using, so
# the fix is one copy-paste away (a server flag means nothing inside the offline LLM, and vice
# versa). A limit is --<name> on the server and MediaConfig.<name> offline (``knob``).
_KNOBS = {
    "server": {"local": "start the server with --allowed-local-media-path DIR",
               "domains": "start the server with --allowed-media-domains {host}"},
    "offline": {"local": "pass LLM(..., media_config=MediaConfig(allowed_local_media_paths=('DIR',)))",
                "domains": "pass LLM(..., media_config=MediaConfig(allowed_domains=('{host}',)))"},
}


@flat_limits("limits", LIMIT_FIELDS, aliases={"max_videos_per_prompt": "limit_videos_per_prompt"})
@dataclass(frozen=True)
class MediaConfig:
    """Where media may come from and how big it may be. Validated and normalised on construction.
    The limits are ``limits`` (a ``MediaLimits``); each may be given and read by its own name too
    (``MediaConfig(max_image_pixels=...)``, ``max_videos_per_prompt`` for ``limit_videos_per_prompt``)."""

    # Directories (normalised with realpath; each must exist). Empty: local files are refused.
    allowed_local_media_paths: tuple[str, ...] = ()
    # http(s) host allow-list: bare host names or IPs; a name also admits its subdomains. Empty: refused.
    allowed_domains: tuple[str, ...] = ()
    limits: MediaLimits = field(default_factory=MediaLimits)
    # Per socket operation and for the whole download.
    http_timeout_s: float = 10.0
    # Which API set these limits ("offline": LLM's media_config; "server": its flags): error
    # messages name that API's knob.
    api: str = "offline"

    def __post_init__(self) -> None:
        if self.api not in _KNOBS:
            raise ValueError(f"MediaConfig.api must be one of {', '.join(_KNOBS)}, got {self.api!r}")
        if not isinstance(self.limits, MediaLimits):
            raise ValueError(f"MediaConfig.limits must be a MediaLimits, got {type(self.limits).__name__}")
        dirs = tuple(_normalise_dir(p) for p in _as_tuple(self.allowed_local_media_paths))
        domains = tuple(_normalise_domain(d) for d in _as_tuple(self.allowed_domains))
        object.__setattr__(self, "allowed_local_media_paths", tuple(dict.fromkeys(dirs)))
        object.__setattr__(self, "allowed_domains", tuple(dict.fromkeys(domains)))
        timeout = self.http_timeout_s
        if (isinstance(timeout, bool) or not isinstance(timeout, (int, float))
                or not math.isfinite(timeout) or timeout <= 0):
            raise ValueError(f"MediaConfig.http_timeout_s must be a positive number of seconds, got {timeout!r}")


def knob(config: MediaConfig, which: str, **names) -> str:
    knobs = _KNOBS[config.api]
    if which not in knobs:  # a limit: the MediaConfig field / server flag by its name
        return f"--{which.replace('_', '-')}" if config.api == "server" else f"MediaConfig.{which}"
    return knobs[which].format(**names)


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
    if not name or (not is_ip(name) and re.search(r"[/:@?#\s]", name)):
        raise ValueError(
            f"MediaConfig.allowed_domains: {domain!r} is not a host name; give bare hosts such as "
            "'example.com' or '10.0.0.5' (no scheme, port or path)"
        )
    return name


def is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


@dataclass(frozen=True)
class ByteCap:
    """The encoded-size limit one source is read under: the kind of media (named in messages,
    and the data: URL media type it must have) and its byte limit (knob ``max_<kind>_bytes``)."""

    kind: str
    limit: int

    def __post_init__(self):
        if isinstance(self.limit, bool) or not isinstance(self.limit, int) or self.limit <= 0:
            raise ValueError(f"the {self.kind} byte limit must be a positive integer, got {self.limit!r}")

    @property
    def knob(self) -> str:
        return f"max_{self.kind}_bytes"

    @property
    def example(self) -> str:  # a data URL of this kind, for messages
        return f"data:{_MIME_EXAMPLES.get(self.kind, self.kind + '/...')};base64,<data>"


_MIME_EXAMPLES = {"image": "image/png", "video": "video/mp4", "audio": "audio/wav"}


def image_cap(config: MediaConfig) -> ByteCap:
    return ByteCap("image", config.limits.max_image_bytes)


def check_bytes(size: int, what: str, config: MediaConfig, *, at_least: bool = False,
                cap: ByteCap | None = None) -> None:
    cap = cap or image_cap(config)
    if size > cap.limit:
        amount = f"more than {cap.limit}" if at_least else str(size)
        raise MediaTooLargeError(
            f"{cap.kind} ({what}) is {amount} bytes; the limit is {cap.limit} "
            f"({knob(config, cap.knob)}); "
            f"send a smaller {cap.kind}"
        )


def clip(text: str, limit: int = 120) -> str:
    """User text echoed in a message, shortened: a 20 MB base64 string must not become the message."""
    return text if len(text) <= limit else f"{text[:limit]}…"

