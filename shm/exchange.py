"""A shared-memory exchange between the processes of one node: each publishes a buffer, then
reads everyone's. It is what CPU tensor-parallel ranks all-reduce and all-gather through
(``atb_plugin.distributed``): a gloo collective over loopback TCP costs a millisecond or more
per call on a small busy machine, a decode step makes two per layer, and here a round costs a
copy and a few cache-line reads (the numbers are in benchmarks/RESULTS.md, "Tensor parallelism").

Layout of the segment (one per group, mapped read-write by every member)::

    member r's control line, 64 bytes each:   int64 round published, int64 pid, int64 aborted
    2 x size slots of slot_bytes:             [parity][member] payload

A round: write the payload into this round's parity slot, publish the round number, wait until
every other member has published it too, read the slots. Two parities are enough: a member can
be at most one round ahead of another (it waits for everyone's current round before leaving it),
so the slots of the round a member is reading are not written again until it has published the
next round itself. The payload is written before the round number, and x86-64 keeps stores in
program order for other cores to see (TSO); on weaker memory models a fence would be needed
that Python cannot issue, so ``supported()`` is false there and callers keep their collective.

Members wait by spinning, yielding the core each turn; every half second of waiting they check
that the others' processes still exist (a dead member is an error naming its pid, not a hang),
that none has set its abort flag, and whether ``timeout_s`` has passed.

The captured decode step's all-reduce (atb_plugin/ops/csrc/tp_allreduce.c) runs the same rounds
from C on the same segment (``address``): each member's round lives in its control line, not in
this object, so the rounds of Python and C calls form one sequence. A member whose native step
fails sets its abort flag there, so that the others stop waiting for it at once. The segment file is unlinked once every member has mapped
it (``unlink``), so nothing is left in ``/dev/shm`` whatever happens to the processes later.
"""

from __future__ import annotations

import mmap
import os
import platform
import secrets
import time

import numpy as np

__all__ = ["ShmExchange", "supported"]

_LINE = 64  # bytes of one member's control line: its own cache line
_PREFIX = "atbx_"  # not "psm_": the media store's listing and reaper never see these


def supported() -> bool:
    """Whether this CPU's memory model lets the exchange order its payload before its flag."""
    return platform.machine().lower() in ("x86_64", "amd64")


class ShmExchange:
    """One member's handle on a group's exchange segment (``create`` by one member, ``attach``
    by the others with the name it gives them)."""

    def __init__(self, name: str, rank: int, size: int, slot_bytes: int, fd: int):
        self.name, self.rank, self.size, self.slot_bytes = name, rank, size, slot_bytes
        total = _segment_bytes(size, slot_bytes)
        try:
            self._map = mmap.mmap(fd, total, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        control = np.frombuffer(self._map, dtype=np.int64, count=size * _LINE // 8).reshape(size, _LINE // 8)
        self._rounds = control[:, 0]
        self._pids = control[:, 1]
        self._aborted = control[:, 2]
        self._slots = np.frombuffer(self._map, dtype=np.uint8, offset=size * _LINE).reshape(2, size, slot_bytes)
        self._pids[rank] = os.getpid()
        #: The segment's address in this process, for the native all-reduce (valid until ``close``).
        self.address = control.ctypes.data

    @classmethod
    def create(cls, rank: int, size: int, slot_bytes: int) -> "ShmExchange":
        """A new segment, its space reserved now (a full ``/dev/shm`` is an ``OSError`` here,
        not a ``SIGBUS`` on a later write)."""
        if size < 2 or not 0 <= rank < size or slot_bytes <= 0 or slot_bytes % _LINE:
            raise ValueError(f"an exchange needs size >= 2, 0 <= rank < size and slot_bytes a positive multiple of "
                             f"{_LINE}; got rank {rank}, size {size}, slot_bytes {slot_bytes}")
        name = _PREFIX + secrets.token_hex(8)
        fd = os.open(_path(name), os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.posix_fallocate(fd, 0, _segment_bytes(size, slot_bytes))
        except BaseException:
            os.close(fd)
            os.unlink(_path(name))
            raise
        return cls(name, rank, size, slot_bytes, fd)

    @classmethod
    def attach(cls, name: str, rank: int, size: int, slot_bytes: int) -> "ShmExchange":
        if not name.startswith(_PREFIX):
            raise ValueError(f"{name!r} is not an exchange segment name")
        fd = os.open(_path(name), os.O_RDWR)
        if os.fstat(fd).st_size != _segment_bytes(size, slot_bytes):
            os.close(fd)
            raise ValueError(f"exchange segment {name} does not have the size of {size} members x {slot_bytes} bytes")
        return cls(name, rank, size, slot_bytes, fd)

    def unlink(self) -> None:
        """Remove the segment's name (every member has mapped it; the mappings stay valid)."""
        try:
            os.unlink(_path(self.name))
        except FileNotFoundError:
            pass

    def exchange(self, payload: np.ndarray, timeout_s: float) -> list[np.ndarray]:
        """Publish ``payload`` (uint8, at most ``slot_bytes``) and return every member's payload
        of this round, in rank order: views into the segment, valid until this member's next
        call, that the caller reads and never writes."""
        n = payload.nbytes
        if n > self.slot_bytes:
            raise ValueError(f"a payload of {n} bytes does not fit a slot of {self.slot_bytes}")
        round_ = int(self._rounds[self.rank]) + 1  # only this member writes it (here or from C)
        slots = self._slots[round_ & 1]
        slots[self.rank, :n] = payload.reshape(-1).view(np.uint8)
        self._rounds[self.rank] = round_  # after the payload: the flag the others wait for
        for peer in range(self.size):
            if peer != self.rank and self._rounds[peer] < round_:
                self._wait(peer, round_, timeout_s)
        return [slots[member, :n] for member in range(self.size)]

    def _wait(self, peer: int, round_: int, timeout_s: float) -> None:
        rounds = self._rounds
        start = check = time.monotonic()
        spins = 0
        while rounds[peer] < round_:
            os.sched_yield()
            spins += 1
            if spins & 1023 == 0 and (now := time.monotonic()) - check > 0.5:
                check = now
                pid = int(self._pids[peer])
                if pid and not _alive(pid):
                    raise RuntimeError(f"tensor-parallel rank {peer} (pid {pid}) exited while rank {self.rank} "
                                       f"waited for it in a collective")
                if self._aborted[peer]:
                    raise RuntimeError(f"tensor-parallel rank {peer} (pid {pid}) failed its step while rank "
                                       f"{self.rank} waited for it in a collective")
                if now - start > timeout_s:
                    raise TimeoutError(f"tensor-parallel rank {peer} did not reach the collective within "
                                       f"{timeout_s:.0f} s (rank {self.rank} waited)")

    def close(self) -> None:
        self._rounds = self._pids = self._aborted = self._slots = None
        try:
            self._map.close()
        except BufferError:  # a caller still holds a view; the mapping goes with the process
            pass


def _segment_bytes(size: int, slot_bytes: int) -> int:
    return size * _LINE + 2 * size * slot_bytes


def _path(name: str) -> str:
    return os.path.join("/dev/shm", name)


def _alive(pid: int) -> bool:
    """The process exists and is not a zombie (a dead child its parent has not reaped yet)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            return stat.read().rsplit(b")", 1)[1].split()[0] not in (b"Z", b"X")
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False
