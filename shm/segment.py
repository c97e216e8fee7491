"""One shared-memory segment: a fixed 128-byte header followed by the C-contiguous payload.

Segments live as files in ``/dev/shm`` (what ``shm_open`` uses on Linux). Writers create them
with ``O_EXCL`` and ``pwrite`` (no mapping, so a full ``/dev/shm`` is an ``ENOSPC`` error instead
of a ``SIGBUS`` on first touch); readers map them read-only. Nothing here goes through
``multiprocessing.shared_memory``, whose Python 3.11 resource tracker also registers segments a
process merely attaches to, and then unlinks them (and warns) when that process exits.

Header (little-endian)::

    offset size  field
    0      8     magic b"ATBSHM\\x00\\x01", written last: a segment without it is not committed
    8      2     format version
    10     2     dtype code (DTYPE_CODES)
    12     2     ndim (0 for an instance marker)
    14     2     header size = payload offset (128)
    16     40    shape, 5 x uint64, unused dims 0
    56     8     payload bytes
    64     16    segment name without "psm_" (ASCII, NUL padded)
    80     8     owner instance id (ASCII, NUL padded)
    88     8     owner pid
    96     8     owner process start time (clock ticks since boot)
    104    4     CRC-32 of bytes 8..103
    108    20    reserved, zero
    128    ...   payload

Names: ``psm_`` + instance id (4 chars) + segment id (7 chars), all from the codec alphabet, so a
name always fits the int64 codec (11 chars). The instance id is reserved by an O_EXCL *marker*
segment ``psm_`` + instance id, which holds the owner's identity for the reaper.
"""

from __future__ import annotations

import errno
import math
import mmap
import os
import re
import struct
import threading
import time
import zlib
from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Collection
from dataclasses import dataclass

import numpy as np

from shm.codec import (
    ALPHABET,
    MAX_NAME_CHARS,
    NAME_PREFIX,
    decode_shape_from_int64,
    decode_shm_name_from_int64,
)
from shm.errors import ShmHandleError, ShmStoreFullError
from shm.process import ProcessIdentity

SHM_DIR = "/dev/shm"
MAGIC = b"ATBSHM\x00\x01"
FORMAT_VERSION = 1
HEADER_SIZE = 128
MAX_HEADER_DIMS = 5
INSTANCE_ID_CHARS = 4
SEGMENT_ID_CHARS = MAX_NAME_CHARS - INSTANCE_ID_CHARS
MAX_SEGMENT_SEQUENCE = len(ALPHABET) ** SEGMENT_ID_CHARS

_HEADER = struct.Struct("<8sHHHH5QQ16s8sQQI20x")
assert _HEADER.size == HEADER_SIZE
_CRC_SPAN = slice(8, 104)

# Codes are part of the on-disk format: append, never renumber.
DTYPE_CODES: dict[np.dtype, int] = {
    np.dtype(np.float32): 1,
    np.dtype(np.float16): 2,
    np.dtype(np.float64): 3,
    np.dtype(np.uint8): 4,
    np.dtype(np.int8): 5,
    np.dtype(np.int16): 6,
    np.dtype(np.int32): 7,
    np.dtype(np.int64): 8,
    np.dtype(np.uint16): 9,
    np.dtype(np.uint32): 10,
    np.dtype(np.uint64): 11,
    np.dtype(np.bool_): 12,
}
_DTYPE_BY_CODE = {code: dtype for dtype, code in DTYPE_CODES.items()}

_BODY = f"[{re.escape(ALPHABET)}]"
_SEGMENT_NAME = re.compile(f"{NAME_PREFIX}({_BODY}{{{INSTANCE_ID_CHARS}}})({_BODY}{{{SEGMENT_ID_CHARS}}})")
_MARKER_NAME = re.compile(f"{NAME_PREFIX}({_BODY}{{{INSTANCE_ID_CHARS}}})")


# ---------------------------------------------------------------------------------------------
# names


def _base27(number: int, width: int) -> str:
    digits = []
    for _ in range(width):
        number, digit = divmod(number, len(ALPHABET))
        digits.append(ALPHABET[digit])
    return "".join(reversed(digits))


def random_instance_id() -> str:
    return _base27(int.from_bytes(os.urandom(4), "little"), INSTANCE_ID_CHARS)


def segment_name(instance_id: str, sequence: int) -> str:
    """``psm_`` + instance id + the sequence number in base 27 (wraps; O_EXCL guards reuse)."""
    return NAME_PREFIX + instance_id + _base27(sequence % MAX_SEGMENT_SEQUENCE, SEGMENT_ID_CHARS)


def marker_name(instance_id: str) -> str:
    return NAME_PREFIX + instance_id


def parse_name(name: str) -> tuple[str, bool] | None:
    """``(instance id, is_marker)`` for a name of ours, None for anyone else's."""
    match = _SEGMENT_NAME.fullmatch(name)
    if match:
        return match.group(1), False
    match = _MARKER_NAME.fullmatch(name)
    if match:
        return match.group(1), True
    return None


def segment_path(name: str) -> str:
    if "/" in name or not name.startswith(NAME_PREFIX):
        raise ShmHandleError(f"{name!r} is not a segment name (expected {NAME_PREFIX}...)")
    return os.path.join(SHM_DIR, name)


def list_segment_names() -> list[str]:
    """Names in /dev/shm that follow our naming scheme (markers included)."""
    try:
        entries = os.listdir(SHM_DIR)
    except FileNotFoundError:
        return []
    return sorted(entry for entry in entries if parse_name(entry) is not None)


def unlink_segment(name: str) -> bool:
    """Remove ``name``; False if it was already gone (or is not ours to remove: another user's).

    Mappings of it in other processes stay valid until they are unmapped.
    """
    try:
        os.unlink(segment_path(name))
    except (FileNotFoundError, PermissionError):
        return False
    return True


# ---------------------------------------------------------------------------------------------
# header


@dataclass(frozen=True)
class SegmentHeader:
    dtype_code: int
    shape: tuple[int, ...]
    payload_nbytes: int
    name: str  # with the psm_ prefix
    instance_id: str
    owner: ProcessIdentity
    version: int = FORMAT_VERSION

    @property
    def dtype(self) -> np.dtype | None:
        return _DTYPE_BY_CODE.get(self.dtype_code)

    def pack(self) -> bytes:
        dims = list(self.shape) + [0] * (MAX_HEADER_DIMS - len(self.shape))
        raw = bytearray(
            _HEADER.pack(
                MAGIC,
                self.version,
                self.dtype_code,
                len(self.shape),
                HEADER_SIZE,
                *dims,
                self.payload_nbytes,
                self.name[len(NAME_PREFIX):].encode("ascii"),
                self.instance_id.encode("ascii"),
                self.owner.pid,
                self.owner.start_time,
                0,
            )
        )
        struct.pack_into("<I", raw, 104, zlib.crc32(raw[_CRC_SPAN]))
        return bytes(raw)

    @classmethod
    def unpack(cls, raw: bytes, name: str) -> "SegmentHeader":
        """Parse and check a header read from segment ``name``; ShmHandleError says what is wrong."""
        if len(raw) < HEADER_SIZE:
            raise ShmHandleError(
                f"segment {name} is {len(raw)} bytes, shorter than the {HEADER_SIZE}-byte header: "
                "not an atb-plugin segment, or still being created"
            )
        (magic, version, dtype_code, ndim, header_size, *rest) = _HEADER.unpack_from(raw)
        dims, (payload_nbytes, body, instance_id, pid, start_time, crc) = rest[:5], rest[5:]
        if magic != MAGIC:
            if magic == b"\x00" * len(MAGIC):
                raise ShmHandleError(f"segment {name} is not committed: its writer has not finished (or died)")
            raise ShmHandleError(f"segment {name} is foreign: magic {magic!r}, expected {MAGIC!r}")
        if version != FORMAT_VERSION or header_size != HEADER_SIZE:
            raise ShmHandleError(
                f"segment {name} has format version {version} / header size {header_size}; "
                f"this reader understands version {FORMAT_VERSION} / {HEADER_SIZE}"
            )
        computed = zlib.crc32(raw[_CRC_SPAN])
        if computed != crc:
            raise ShmHandleError(f"segment {name} header is corrupted: CRC {crc:#010x}, computed {computed:#010x}")
        if ndim > MAX_HEADER_DIMS:
            raise ShmHandleError(f"segment {name} header declares {ndim} dims (at most {MAX_HEADER_DIMS})")
        return cls(
            dtype_code=dtype_code,
            shape=tuple(dims[:ndim]),
            payload_nbytes=payload_nbytes,
            name=NAME_PREFIX + body.rstrip(b"\x00").decode("ascii", "replace"),
            instance_id=instance_id.rstrip(b"\x00").decode("ascii", "replace"),
            owner=ProcessIdentity(pid, start_time),
            version=version,
        )


def read_header(name: str) -> SegmentHeader:
    """Read and check the header of ``name`` without mapping it (used by the reaper)."""
    try:
        fd = os.open(segment_path(name), os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        raise ShmHandleError(f"segment {name} does not exist") from None
    except PermissionError:
        raise ShmHandleError(f"segment {name} belongs to another user") from None
    try:
        return SegmentHeader.unpack(os.pread(fd, HEADER_SIZE, 0), name)
    finally:
        os.close(fd)


# ---------------------------------------------------------------------------------------------
# writing


def dtype_code_of(dtype: np.dtype) -> int:
    code = DTYPE_CODES.get(np.dtype(dtype))
    if code is None:
        supported = ", ".join(sorted(str(d) for d in DTYPE_CODES))
        raise ValueError(f"dtype {np.dtype(dtype)} cannot be stored in a segment; supported (native order): {supported}")
    return code


def pwrite_all(fd: int, data, offset: int) -> None:
    """All of ``data`` (any buffer) at ``offset`` of ``fd``, however many ``pwrite`` calls it takes."""
    view = memoryview(data).cast("B")
    while view:
        written = os.pwrite(fd, view, offset)
        view, offset = view[written:], offset + written


class SegmentPayload(ABC):
    """A payload that writes its own bytes into the segment's file: for a producer that can pack
    them there directly (an image encoder, ``input_builders.preprocess.RgbImagePayload``) instead
    of first building a numpy array for ``pwrite`` to copy. ``ShmStore.put`` and ``write_segment``
    take one wherever they take an array; the segment and its header are the same as for the array
    of ``shape`` and ``dtype`` holding those bytes in C order."""

    shape: tuple[int, ...]
    dtype: np.dtype

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize

    @abstractmethod
    def write_to(self, fd: int, offset: int) -> int:
        """Write the payload's ``nbytes`` bytes at ``offset`` of ``fd``; return how many were written
        (the segment is refused, unlinked, unless that is all of them)."""


def write_segment(name: str, array: np.ndarray | SegmentPayload | None, instance_id: str,
                  owner: ProcessIdentity) -> int:
    """Create segment ``name`` holding ``array`` (None: a header-only instance marker).

    Never overwrites: ``FileExistsError`` if the name is taken. The payload goes first and the
    magic last, so a reader never sees a half-written segment as valid. Returns the size in bytes.
    """
    if isinstance(array, np.ndarray) and not array.flags.c_contiguous:
        raise ValueError("write_segment needs a C-contiguous array")
    header = SegmentHeader(
        dtype_code=0 if array is None else dtype_code_of(array.dtype),
        shape=() if array is None else tuple(array.shape),
        payload_nbytes=0 if array is None else array.nbytes,
        name=name,
        instance_id=instance_id,
        owner=owner,
    ).pack()
    path = segment_path(name)
    total = HEADER_SIZE + (0 if array is None else array.nbytes)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        os.ftruncate(fd, total)
        if isinstance(array, SegmentPayload):
            written = array.write_to(fd, HEADER_SIZE)
            if written != array.nbytes:
                raise ValueError(f"{type(array).__name__} wrote {written} of its {array.nbytes} bytes")
        elif array is not None and array.nbytes:
            pwrite_all(fd, array, HEADER_SIZE)
        pwrite_all(fd, header[len(MAGIC):], len(MAGIC))
        pwrite_all(fd, header[: len(MAGIC)], 0)
    except BaseException as error:
        os.unlink(path)
        if isinstance(error, OSError) and error.errno in (errno.ENOSPC, errno.ENOMEM, errno.EFBIG):
            raise ShmStoreFullError(
                f"no room in {SHM_DIR} for segment {name} ({total} bytes): {error.strerror}"
            ) from error
        raise
    finally:
        os.close(fd)
    return total


def take_over_marker(instance_id: str, owner: ProcessIdentity) -> bool:
    """Make ``owner`` the owner of instance ``instance_id`` (its marker now names it), so that
    the reaper counts the instance as live and spares every segment of it while ``owner`` lives
    (a dead worker's segments that running requests still read: ``shm.adoption``). The new
    marker is written aside and renamed over the old one, so a reaper reads one or the other,
    never half of each. False when the marker is gone (the instance was reaped already)."""
    marker = marker_name(instance_id)
    path = segment_path(marker)
    if not os.path.exists(path):
        return False
    header = SegmentHeader(0, (), 0, marker, instance_id, owner).pack()
    # Not a name of our scheme: list_segment_names() and the reaper never see it.
    aside = os.path.join(SHM_DIR, f".{marker}.{os.getpid()}.{threading.get_ident()}")
    fd = os.open(aside, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        pwrite_all(fd, header, 0)
    finally:
        os.close(fd)
    os.rename(aside, path)
    return True


# ---------------------------------------------------------------------------------------------
# reading


@dataclass
class _Attached:
    mapping: mmap.mmap
    header: SegmentHeader
    inode: tuple[int, int]  # (st_dev, st_ino): a re-created name is a different inode


def _verify(header: SegmentHeader, name: str, shape: list[int], dtype, expected_instance) -> np.dtype:
    if header.name != name:
        raise ShmHandleError(f"segment {name} is foreign: its header names {header.name}")
    instance_id = parse_name(name)[0]
    if header.instance_id != instance_id:
        raise ShmHandleError(f"segment {name} is foreign: its header names instance {header.instance_id!r}")
    if expected_instance is not None:
        # One id, or the set of instances the frontend registered for this request.
        allowed = {expected_instance} if isinstance(expected_instance, str) else set(expected_instance)
        if instance_id not in allowed:
            raise ShmHandleError(
                f"segment {name} belongs to instance {instance_id!r}, not to "
                f"{' or '.join(repr(i) for i in sorted(allowed)) or 'any registered instance'} "
                "(this request's frontend)"
            )
    if list(header.shape) != list(shape):
        raise ShmHandleError(
            f"segment {name}: the handle's shape {list(shape)} does not match the segment's {list(header.shape)}"
        )
    stored = header.dtype
    if stored is None:
        raise ShmHandleError(f"segment {name}: unknown dtype code {header.dtype_code}")
    if dtype is not None and np.dtype(dtype) != stored:
        raise ShmHandleError(f"segment {name} holds {stored}, not the expected {np.dtype(dtype)}")
    expected_nbytes = math.prod(header.shape) * stored.itemsize
    if header.payload_nbytes != expected_nbytes:
        raise ShmHandleError(
            f"segment {name}: header says {header.payload_nbytes} payload bytes, "
            f"shape {list(header.shape)} of {stored} needs {expected_nbytes}"
        )
    return stored


class ShmReader:
    """Attaches segments read-only and keeps their mappings for the next read of the same handle.

    A segment's content never changes after it is committed, and a name is only reused after
    the segment is unlinked, so a cached mapping is valid while the name still points at the
    same inode (one ``stat`` per hit). A mapping keeps an unlinked segment's memory alive, so
    mappings of unlinked segments are dropped by :meth:`sweep` (call it when a request ends)
    and by a miss at most every ``sweep_interval_s``; the cache is bounded by
    ``max_cached_bytes`` and ``max_cached_segments``. Safe for concurrent use by threads.
    """

    def __init__(self, max_cached_bytes: int = 1 << 30, max_cached_segments: int = 1024,
                 sweep_interval_s: float = 1.0):
        if max_cached_bytes < 0 or max_cached_segments < 0 or sweep_interval_s < 0:
            raise ValueError("ShmReader cache limits and sweep interval must be >= 0")
        self.max_cached_bytes = max_cached_bytes
        self.max_cached_segments = max_cached_segments
        self.sweep_interval_s = sweep_interval_s
        self._last_sweep = time.monotonic()
        self._cache: OrderedDict[str, _Attached] = OrderedDict()
        self._cached_bytes = 0
        self._lock = threading.Lock()

    # -- public --------------------------------------------------------------------------------

    def read_array(self, name_value, shape_value, *, dtype=None, expected_instance: str | Collection[str] | None = None,
                   writable: bool = False) -> np.ndarray:
        """The array a handle names: a zero-copy view of the segment's payload.

        ``writable=False`` (default): a read-only view of the shared pages.
        ``writable=True``: a private copy-on-write mapping: still zero-copy until written, and
        writes never reach the segment (use it for ``torch.from_numpy``).
        """
        try:
            name = decode_shm_name_from_int64(name_value)
            shape = decode_shape_from_int64(shape_value)
        except ValueError as error:
            raise ShmHandleError(f"invalid handle: {error}") from error
        parsed = parse_name(name)
        if parsed is None or parsed[1]:
            raise ShmHandleError(f"segment {name} is foreign: not an atb-plugin data segment name")
        attached = self._map(name, private=True) if writable else self._attach(name)
        stored = _verify(attached.header, name, shape, dtype, expected_instance)
        return np.ndarray(tuple(shape), dtype=stored, buffer=attached.mapping, offset=HEADER_SIZE)

    def sweep(self) -> None:
        """Drop cached mappings whose segment has been unlinked (frees their memory)."""
        with self._lock:
            self._sweep_locked()

    def clear(self) -> None:
        with self._lock:
            for name in list(self._cache):
                self._drop(name)

    @property
    def cached_segments(self) -> int:
        return len(self._cache)

    # -- internals -----------------------------------------------------------------------------

    @staticmethod
    def _current_inode(name: str) -> tuple[int, int] | None:
        try:
            stat = os.stat(segment_path(name), follow_symlinks=False)
        except FileNotFoundError:
            return None
        return stat.st_dev, stat.st_ino

    def _attach(self, name: str) -> _Attached:
        with self._lock:
            attached = self._cache.get(name)
            if attached is not None:
                if self._current_inode(name) == attached.inode:
                    self._cache.move_to_end(name)
                    return attached
                self._drop(name)
        attached = self._map(name, private=False)
        with self._lock:
            if name not in self._cache and len(attached.mapping) <= self.max_cached_bytes:
                self._cache[name] = attached
                self._cached_bytes += len(attached.mapping)
                self._evict()
        return attached

    @staticmethod
    def _map(name: str, private: bool) -> _Attached:
        try:
            fd = os.open(segment_path(name), os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except FileNotFoundError:
            raise ShmHandleError(
                f"segment {name} does not exist: it was released, reaped, or never created"
            ) from None
        except PermissionError:
            raise ShmHandleError(f"segment {name} belongs to another user: cannot read it") from None
        try:
            stat = os.fstat(fd)
            header = SegmentHeader.unpack(os.pread(fd, HEADER_SIZE, 0), name)
            if stat.st_size < HEADER_SIZE + header.payload_nbytes:
                raise ShmHandleError(
                    f"segment {name} is truncated: {stat.st_size} bytes, header promises "
                    f"{HEADER_SIZE + header.payload_nbytes}"
                )
            if private:  # copy-on-write: writable view, the shared pages stay untouched
                mapping = mmap.mmap(fd, stat.st_size, flags=mmap.MAP_PRIVATE,
                                    prot=mmap.PROT_READ | mmap.PROT_WRITE)
            else:
                mapping = mmap.mmap(fd, stat.st_size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
        finally:
            os.close(fd)
        return _Attached(mapping, header, (stat.st_dev, stat.st_ino))

    def _drop(self, name: str) -> None:
        # The mapping is not closed: arrays handed out may still view it; it is unmapped when
        # the last of them is garbage-collected.
        attached = self._cache.pop(name)
        self._cached_bytes -= len(attached.mapping)

    def _sweep_locked(self) -> None:
        for name in [n for n, a in self._cache.items() if self._current_inode(n) != a.inode]:
            self._drop(name)
        self._last_sweep = time.monotonic()

    def _evict(self) -> None:
        # A stat per cached segment: done at most every sweep_interval_s, not on every miss.
        if time.monotonic() - self._last_sweep >= self.sweep_interval_s:
            self._sweep_locked()
        while self._cache and (
            self._cached_bytes > self.max_cached_bytes or len(self._cache) > self.max_cached_segments
        ):
            self._drop(next(iter(self._cache)))


_default_reader = ShmReader()


def read_array(name_value, shape_value, *, dtype=None, expected_instance: str | Collection[str] | None = None,
               writable: bool = False) -> np.ndarray:
    """Read-only zero-copy view of the array a (name, shape) handle pair names.

    Verifies the segment header against the decoded name and shape (and ``dtype`` /
    ``expected_instance`` when given) and raises :class:`ShmHandleError` on any disagreement.
    Uses a process-wide :class:`ShmReader`, so reading the same handle again costs no remapping.
    """
    return _default_reader.read_array(
        name_value, shape_value, dtype=dtype, expected_instance=expected_instance, writable=writable
    )
