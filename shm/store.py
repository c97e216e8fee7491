"""``ShmStore``: the one owner of a service instance's segments.

Lifecycle of a segment::

    put(array, key, request_id) ──► LEASED to one or more requests ──release()──► CACHED (LRU)
           ▲   key hit: no write,          │                                         │
           └── the segment is leased again ┘◄──────────── get(key) / put(key) ───────┤
                                                                                     ▼
                                              evicted when cached bytes > cache_bytes: unlinked

When shared memory runs out (``capacity_bytes`` reached, or ``ENOSPC`` from ``/dev/shm``), the
least recently used cached segments are evicted until the new one fits; ``ShmStoreFullError``
is raised only when every byte the store still holds is leased to a running request. The default
``cache_bytes`` (None) is a quarter of the ``/dev/shm`` filesystem, at most 1 GiB.

Segments are content-addressed by ``key`` (e.g. a hash of the source bytes + preprocessing
parameters), so a multi-turn chat that resends an image reuses its segment without writing it
again; reuse costs a dict lookup where a new segment costs ``ftruncate`` + a 2.4 MB write + page
allocation and, later, an unlink. ``close()`` unlinks everything the instance owns; a crashed
instance's segments are unlinked by the next store's reaper.
"""

from __future__ import annotations

import errno
import logging
import os
import threading
import weakref
from collections import OrderedDict
from dataclasses import dataclass, field, replace

import numpy as np

from shm import segment as _segment
from shm.codec import encode_shape_to_int64, encode_shm_name_to_int64
from shm.errors import ShmStoreFullError
from shm.process import ProcessIdentity
from shm.reaper import reap_orphans
from shm.segment import (
    HEADER_SIZE,
    MAX_SEGMENT_SEQUENCE,
    SegmentPayload,
    dtype_code_of,
    marker_name,
    random_instance_id,
    segment_name,
    unlink_segment,
    write_segment,
)

_MAX_NAME_ATTEMPTS = 64
_MIB = 1 << 20
AUTO_CACHE_FRACTION_PERCENT = 25  # cache_bytes=None: this share of the shm filesystem's size ...
AUTO_CACHE_MAX_BYTES = 1 << 30  # ... but no more than this
_OUT_OF_SPACE = (errno.ENOSPC, errno.ENOMEM)  # what freeing pages of our own can cure

logger = logging.getLogger("shm")


@dataclass(frozen=True)
class ShmHandle:
    """Where an array lives: what a builder embeds in ``input_ids`` (``name_value``, ``shape_value``)."""

    name: str
    shape: tuple[int, ...]
    dtype: np.dtype
    name_value: int
    shape_value: int

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * self.dtype.itemsize


@dataclass(frozen=True)
class ShmStoreConfig:
    max_segment_bytes: int = 1 << 30  # one array larger than this is refused (1 GiB)
    # Unleased segments kept for reuse, least recently used evicted first. None: "auto", resolved
    # when a store is built: 25% of the shm filesystem's size, at most 1 GiB (see resolve_cache_bytes).
    cache_bytes: int | None = None
    capacity_bytes: int | None = None  # all bytes owned (leased + cached); None: only /dev/shm limits
    reap_on_start: bool = True

    def __post_init__(self):
        if self.max_segment_bytes <= 0:
            raise ValueError(f"max_segment_bytes must be > 0, got {self.max_segment_bytes}")
        if self.cache_bytes is not None and self.cache_bytes < 0:
            raise ValueError(f"cache_bytes must be >= 0, got {self.cache_bytes}")
        if self.capacity_bytes is not None and self.capacity_bytes <= 0:
            raise ValueError(f"capacity_bytes must be > 0 or None, got {self.capacity_bytes}")


def shm_space() -> tuple[int, int] | None:
    """(free, total) bytes of the filesystem holding the segments, None if it cannot be measured."""
    try:
        stat = os.statvfs(_segment.SHM_DIR)
    except OSError:
        return None
    return stat.f_bavail * stat.f_frsize, stat.f_blocks * stat.f_frsize


def resolve_cache_bytes(cache_bytes: int | None) -> tuple[int, str]:
    """The cache size a store uses for ``ShmStoreConfig.cache_bytes``, and how it was chosen.

    An explicit value is kept. None means auto: ``AUTO_CACHE_FRACTION_PERCENT`` of the shm
    filesystem's total size, capped at ``AUTO_CACHE_MAX_BYTES`` (the cap also when the size
    cannot be read), so that cached segments leave most of a small ``/dev/shm`` (Docker's
    default is 64 MiB) to the requests in flight.
    """
    if cache_bytes is not None:
        return cache_bytes, "cache_bytes"
    space = shm_space()
    if space is None:
        return AUTO_CACHE_MAX_BYTES, f"{_segment.SHM_DIR}'s size unknown"
    total = space[1]
    share = total * AUTO_CACHE_FRACTION_PERCENT // 100
    how = f"{AUTO_CACHE_FRACTION_PERCENT}% of {_segment.SHM_DIR}'s {total // _MIB} MiB"
    if share > AUTO_CACHE_MAX_BYTES:
        return AUTO_CACHE_MAX_BYTES, how + f", capped at {AUTO_CACHE_MAX_BYTES // _MIB} MiB"
    return share, how


@dataclass
class _Segment:
    handle: ShmHandle
    key: object
    size: int  # header + payload, what it costs in /dev/shm
    leases: set = field(default_factory=set)


def _unlink_all(names: dict, marker: str, owner_pid: int) -> None:
    """Finalizer: runs on close(), garbage collection or interpreter exit; never touches self."""
    if os.getpid() != owner_pid:
        return  # a forked child exiting: the segments belong to its parent, which lives on
    for name in list(names):
        unlink_segment(name)
    names.clear()
    unlink_segment(marker)


class ShmStore:
    """Creates, leases, caches and unlinks the segments of one service instance.

    Thread-safe; segments are readable from any process of the same user (``shm.read_array``).
    """

    def __init__(self, config: ShmStoreConfig | None = None):
        config = config or ShmStoreConfig()
        self.cache_bytes, how = resolve_cache_bytes(config.cache_bytes)
        # The resolved size, so that store.config.cache_bytes is always a number.
        self.config = replace(config, cache_bytes=self.cache_bytes)
        self.owner = ProcessIdentity.current()
        self.reaped: list[str] = reap_orphans() if self.config.reap_on_start else []
        self.instance_id = self._claim_instance_id()
        self._lock = threading.Lock()
        self._segments: dict[str, _Segment] = {}
        self._by_key: dict[object, str] = {}
        self._leases: dict[str, set[str]] = {}  # request id -> names
        self._cached: OrderedDict[str, None] = OrderedDict()  # unleased names, oldest first
        self._owned_bytes = 0  # all segments, plus writes in flight
        self._cached_bytes = 0
        self._sequence = 0
        self._closed = False
        self._warned_full = False
        self._finalizer = weakref.finalize(
            self, _unlink_all, self._segments, marker_name(self.instance_id), self.owner.pid
        )
        logger.info("shm cache: %d MiB (%s)", self.cache_bytes // _MIB, how)

    def _claim_instance_id(self) -> str:
        # The O_EXCL marker makes the id unique among instances on this host and records the
        # owner (pid + start time) for the reaper.
        for _ in range(_MAX_NAME_ATTEMPTS):
            instance_id = random_instance_id()
            try:
                write_segment(marker_name(instance_id), None, instance_id, self.owner)
            except FileExistsError:
                continue
            return instance_id
        raise ShmStoreFullError("could not find a free instance id in /dev/shm")

    # -- public --------------------------------------------------------------------------------

    def put(self, array: np.ndarray | SegmentPayload, key=None, *, request_id: str | None = None) -> ShmHandle:
        """Store ``array`` (or reuse the segment already holding ``key``) and return its handle.
        ``array`` may be a ``SegmentPayload``: the bytes of an array that writes itself.

        With ``request_id`` the segment is leased to that request until :meth:`release`;
        without, it is only cached and may be evicted at any time.
        """
        if not isinstance(array, SegmentPayload):
            array = np.asarray(array)
        dtype_code_of(array.dtype)
        shape_value = encode_shape_to_int64(array.shape)  # refuses 0-d, > 5-d and oversized dims
        if not isinstance(array, SegmentPayload):
            array = np.ascontiguousarray(array)
        if array.nbytes > self.config.max_segment_bytes:
            raise ValueError(
                f"array of shape {array.shape} and dtype {array.dtype} is {array.nbytes} bytes; "
                f"a segment holds at most max_segment_bytes={self.config.max_segment_bytes}"
            )
        size = HEADER_SIZE + array.nbytes
        with self._lock:
            self._check_open()
            if key is not None and key in self._by_key:
                return self._reuse_locked(self._by_key[key], array, request_id)
            victims = self._reserve_locked(size)
        self._unlink(victims)

        try:
            name = self._write_making_room(array, size)
        except BaseException:
            with self._lock:
                self._owned_bytes -= size
            raise
        handle = ShmHandle(name, tuple(array.shape), array.dtype, encode_shm_name_to_int64(name), shape_value)

        with self._lock:
            if self._closed or (key is not None and key in self._by_key):
                # Closed meanwhile, or another thread stored the same key first: keep theirs.
                self._owned_bytes -= size
                unlink_segment(name)
                self._check_open()
                return self._reuse_locked(self._by_key[key], array, request_id)
            self._segments[name] = _Segment(handle, key, size)
            if key is not None:
                self._by_key[key] = name
            if request_id is not None:
                self._lease_locked(name, request_id)
                victims = []
            else:
                victims = self._cache_locked(name)
        self._unlink(victims)
        return handle

    def get(self, key, *, request_id: str | None = None) -> ShmHandle | None:
        """The handle of the segment holding ``key`` (leased to ``request_id`` if given), or None."""
        with self._lock:
            self._check_open()
            name = self._by_key.get(key)
            if name is None:
                return None
            if request_id is not None:
                self._lease_locked(name, request_id)
            elif name in self._cached:
                self._cached.move_to_end(name)
            return self._segments[name].handle

    def release(self, request_id: str) -> int:
        """End every lease of ``request_id``; its segments become cached. Returns how many."""
        with self._lock:
            names = self._leases.pop(request_id, set())
            victims = []
            for name in names:
                segment = self._segments[name]
                segment.leases.discard(request_id)
                if not segment.leases:
                    victims += self._cache_locked(name)
        self._unlink(victims)
        return len(names)

    def leased_names(self, request_id: str) -> list[str]:
        """The segments ``request_id`` holds a lease on (what it reads), sorted."""
        with self._lock:
            return sorted(self._leases.get(request_id, ()))

    def close(self) -> None:
        """Unlink every segment this instance owns, leased or not, and its marker. Idempotent."""
        with self._lock:
            self._closed = True
            self._by_key.clear()
            self._leases.clear()
            self._cached.clear()
            self._owned_bytes = self._cached_bytes = 0
            self._finalizer()

    def stats(self) -> dict:
        with self._lock:
            leased = sum(s.size for s in self._segments.values() if s.leases)
            return {
                "segments": len(self._segments),
                "leased_segments": sum(1 for s in self._segments.values() if s.leases),
                "leased_bytes": leased,
                "cached_segments": len(self._cached),
                "cached_bytes": self._cached_bytes,
                "requests": len(self._leases),
            }

    def names(self) -> list[str]:
        with self._lock:
            return sorted(self._segments)

    def __enter__(self) -> "ShmStore":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- internals (the *_locked ones run under self._lock) ----------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError(f"ShmStore {self.instance_id} is closed")

    def _write(self, array: np.ndarray | SegmentPayload) -> str:
        # Sequence numbers wrap after 27**7; a name still in use is skipped, never overwritten.
        for _ in range(_MAX_NAME_ATTEMPTS):
            with self._lock:
                name = segment_name(self.instance_id, self._sequence)
                self._sequence = (self._sequence + 1) % MAX_SEGMENT_SEQUENCE
            try:
                write_segment(name, array, self.instance_id, self.owner)
            except FileExistsError:
                continue
            return name
        raise ShmStoreFullError(f"{_MAX_NAME_ATTEMPTS} consecutive segment names are in use")

    def _write_making_room(self, array: np.ndarray | SegmentPayload, size: int) -> str:
        """Write a new segment; on ENOSPC evict cached segments (LRU first) and retry.

        ``size`` bytes are already reserved in ``_owned_bytes`` by the caller.
        """
        while True:
            try:
                return self._write(array)
            except ShmStoreFullError as error:
                cause = error.__cause__
                if not (isinstance(cause, OSError) and cause.errno in _OUT_OF_SPACE):
                    raise
                with self._lock:
                    self._check_open()
                    # Free at least ``size`` bytes of cache, oldest first.
                    target = self._cached_bytes - size
                    victims = self._evict_locked(lambda: self._cached_bytes > target)
                    if not victims:
                        message = self._full_message_locked(size, cause)
                if not victims:
                    raise ShmStoreFullError(message) from error
                # Once per store at WARNING: the cache (and the other users of /dev/shm) fill it.
                logger.log(logging.DEBUG if self._warned_full else logging.WARNING,
                           "shm: %s is full (%s); evicted %d cached segment(s) to make room for %d bytes. "
                           "A smaller cache_bytes (now %d) or a bigger %s avoids this",
                           _segment.SHM_DIR, cause.strerror, len(victims), size, self.cache_bytes,
                           _segment.SHM_DIR)
                self._warned_full = True
                self._unlink(victims)

    def _full_message_locked(self, size: int, cause: OSError | None = None) -> str:
        """Why a ``size``-byte segment does not fit (ENOSPC ``cause``, or capacity_bytes), and the fix."""
        shm_dir = _segment.SHM_DIR
        leased = sum(s.size for s in self._segments.values() if s.leases)
        # Reserved by other puts still writing (the failing put's own reservation excluded).
        in_flight = self._owned_bytes - leased - self._cached_bytes - (size if cause is not None else 0)
        held = (f"{leased} bytes leased to running requests and {self._cached_bytes} bytes cached"
                + (f", {in_flight} bytes being written" if in_flight > 0 else ""))
        space = shm_space()
        room = (f"{shm_dir}'s free space is unknown" if space is None
                else f"{shm_dir} has {space[0]} of {space[1]} bytes free")
        if cause is not None:
            return (
                f"a {size}-byte segment does not fit: {shm_dir} is full ({cause.strerror}; {room}) and "
                f"this store has no cached segment left to evict (it holds {held}). Retry when running "
                f"requests finish; to fix, give {shm_dir} more room (in Docker: --shm-size, e.g. --shm-size=2g) or "
                f"lower the shared-memory cache/budget of the processes using it (this store: cache_bytes="
                f"{self.cache_bytes}, capacity_bytes={self.config.capacity_bytes}; the server: "
                "--shm-budget-bytes)"
            )
        return (
            f"a {size}-byte segment does not fit in capacity_bytes={self.config.capacity_bytes}, even "
            f"with every cached segment evicted: this store holds {held}; {room}. Retry when running "
            "requests finish; to fix, raise capacity_bytes (the server's --shm-budget-bytes), with a bigger "
            f"{shm_dir} if it needs one (in Docker: --shm-size, e.g. --shm-size=2g)"
        )

    def _reuse_locked(self, name: str, array: np.ndarray | SegmentPayload, request_id: str | None) -> ShmHandle:
        handle = self._segments[name].handle
        if handle.shape != array.shape or handle.dtype != array.dtype:
            raise ValueError(
                f"key already holds an array of shape {handle.shape} and dtype {handle.dtype}, "
                f"not {array.shape} {array.dtype}: the key must identify the content"
            )
        if request_id is not None:
            self._lease_locked(name, request_id)
        elif name in self._cached:
            self._cached.move_to_end(name)
        return handle

    def _lease_locked(self, name: str, request_id: str) -> None:
        segment = self._segments[name]
        if not segment.leases and name in self._cached:
            del self._cached[name]
            self._cached_bytes -= segment.size
        segment.leases.add(request_id)
        self._leases.setdefault(request_id, set()).add(name)

    def _cache_locked(self, name: str) -> list[str]:
        self._cached[name] = None
        self._cached_bytes += self._segments[name].size
        return self._evict_locked(lambda: self._cached_bytes > self.cache_bytes)

    def _reserve_locked(self, size: int) -> list[str]:
        """Count ``size`` bytes in ``_owned_bytes``, evicting cached segments (LRU first) as far as
        ``capacity_bytes`` needs; returns the victims to unlink outside the lock."""
        capacity = self.config.capacity_bytes
        victims = []
        if capacity is not None:
            if self._owned_bytes - self._cached_bytes + size > capacity:
                # Evicting the whole cache would not do: keep it, and fail now.
                raise ShmStoreFullError(self._full_message_locked(size))
            victims = self._evict_locked(lambda: self._owned_bytes + size > capacity)
        self._owned_bytes += size
        return victims

    def _evict_locked(self, over_budget) -> list[str]:
        victims = []
        while self._cached and over_budget():
            victims.append(self._evict_oldest_locked().handle.name)
        return victims

    def _evict_oldest_locked(self) -> _Segment:
        name, _ = self._cached.popitem(last=False)
        segment = self._segments.pop(name)
        self._cached_bytes -= segment.size
        self._owned_bytes -= segment.size
        if segment.key is not None:
            del self._by_key[segment.key]
        return segment

    @staticmethod
    def _unlink(names: list[str]) -> None:
        # Outside the lock: unlinking frees pages, which is not free for large segments.
        for name in names:
            unlink_segment(name)
