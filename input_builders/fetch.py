"""http(s) media: fetched only from hosts in ``MediaConfig.allowed_domains`` (a host or a
subdomain of a listed one; every redirect hop checked again), ``http_timeout_s`` for the whole
fetch (connect, headers, body, redirects): at the deadline its sockets are shut down, so a host
that trickles a byte at a time or never answers is cut there. A download reads at most its
kind's byte cap + 1 bytes.

``fetch_url`` is the same fetch for callers that prefetch URLs off their main thread (the
tokenizer workers); ``prefetched`` hands its results to ``load_image`` (input_builders.image).
"""

from __future__ import annotations

import contextlib
import contextvars
import http.client
import socket
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from typing import BinaryIO

from input_builders.media_config import ByteCap, MediaConfig, check_bytes, clip, image_cap, is_ip, knob
from input_builders.media_errors import MediaError, MediaFetchError, MediaNotAllowedError, MediaNotFoundError

__all__ = ["fetch_bytes", "fetch_url", "prefetched"]


def _host_allowed(host: str, domains: tuple[str, ...]) -> bool:
    """Exact match, or a subdomain of a listed name ("img.example.com" under "example.com", never
    "badexample.com"). IP entries match exactly: "1.127.0.0.1" is not "under" 127.0.0.1."""
    host = host.lower().rstrip(".")
    return any(host == d or (not is_ip(d) and host.endswith("." + d)) for d in domains)


def _allowed_host(url: str, config: MediaConfig, kind: str = "image") -> str:
    """The URL's host if fetching it is allowed; raise ``MediaNotAllowedError`` otherwise."""
    shown = clip(url)
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
        return fetch_bytes(url.strip(), config)
    except MediaError as error:
        return error


def fetch_bytes(url: str, config: MediaConfig, cap: ByteCap | None = None) -> tuple[bytes, str]:
    """``url``'s bytes (at most ``cap``, the image cap by default) and a description of its source."""
    cap = cap or image_cap(config)
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
                    check_bytes(int(length), source, config, cap=cap)
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
    check_bytes(len(data), source, config, at_least=True, cap=cap)
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

