"""``MooncakeTransfer``: the Mooncake Transfer Engine (``mooncake.engine.TransferEngine``) with its
sharp edges turned into Python errors. docs/kv-transfer.md ("The Mooncake wrapper") lists what was
measured on this package (mooncake-transfer-engine-non-cuda 0.3.13.post1):

- every failure is a ``-1`` (or another negative) return, never an exception: each call here
  checks it and raises ``MooncakeError`` naming the call;
- a frozen peer blocks a transfer for 30 s unless ``MC_TCP_PROGRESS_TIMEOUT_SEC`` is set before
  ``initialize``: the constructor sets it from ``timeout_s``;
- over TCP a *local* buffer outside registered memory is accepted silently (the remote side is
  checked by the peer): every local range is checked here against what this object registered;
- ``get_batch_transfer_status`` called twice on one batch id crashes the process: only the
  synchronous reads are used;
- a batch of more than ~2048 ranges fails (the TCP lane's queue is full: "queue-full
  rejection", then ``-1``): ``read`` splits its ranges into batches of ``MAX_BATCH_RANGES``.

Its two listeners bind every interface whatever ``initialize`` is told: run it on a host (or in a
network namespace) where that is acceptable.
"""

from __future__ import annotations

import bisect
import os

# Read by the engine's TCP transport when it is initialized (not later).
_TIMEOUT_ENV = "MC_TCP_PROGRESS_TIMEOUT_SEC"
# Ranges per batch: 2048 passed and 3000 failed on 0.3.13.post1; half the measured limit.
MAX_BATCH_RANGES = 1024


class MooncakeError(RuntimeError):
    """A Mooncake call failed (its negative return code, and the call, are in the message)."""


def _transfer_engine_class():
    try:
        from mooncake.engine import TransferEngine
    except ImportError as error:
        raise ImportError("the MooncakeConnector needs the Mooncake Transfer Engine: pip install "
                          "'atb-plugin[kv]' (mooncake-transfer-engine-non-cuda; on Ascend "
                          f"mooncake-transfer-engine-npu) and Debian's libibverbs1 ({error})") from error
    return TransferEngine


class MooncakeTransfer:
    """One Transfer Engine on ``host`` ("P2PHANDSHAKE": no metadata server; peers address it as
    ``session`` = "host:rpc_port"), reading from peers' registered memory into its own."""

    def __init__(self, host: str = "127.0.0.1", protocol: str = "tcp", timeout_s: float = 5.0, device_name: str = ""):
        if timeout_s <= 0:
            raise ValueError(f"the Mooncake transfer timeout must be > 0 s, got {timeout_s}")
        # Whole seconds: the transport parses an integer.
        os.environ[_TIMEOUT_ENV] = str(max(1, int(round(timeout_s))))
        self._engine = _transfer_engine_class()()
        self._check("initialize", self._engine.initialize(host, "P2PHANDSHAKE", protocol, device_name))
        self.session = f"{host}:{self._engine.get_rpc_port()}"
        # Registered local ranges, sorted by start: (start, end).
        self._starts: list[int] = []
        self._ends: list[int] = []

    @staticmethod
    def _check(call: str, code) -> None:
        if not isinstance(code, int) or code < 0:
            raise MooncakeError(f"Mooncake TransferEngine.{call} failed (returned {code})")

    def register(self, address: int, length: int) -> None:
        """Register ``length`` bytes at ``address`` (a tensor's storage that outlives the
        registration) for transfers in and out."""
        if length <= 0:
            raise ValueError(f"cannot register {length} bytes")
        if self._overlaps(address, address + length):
            raise MooncakeError(f"register_memory: [{address:#x}, +{length}) overlaps a registered range")
        self._check("register_memory", self._engine.register_memory(address, length))
        index = bisect.bisect(self._starts, address)
        self._starts.insert(index, address)
        self._ends.insert(index, address + length)

    def register_tensor(self, tensor) -> None:
        if not tensor.is_contiguous():
            raise ValueError("a tensor registered for transfer must be contiguous (one byte range)")
        self.register(tensor.data_ptr(), tensor.numel() * tensor.element_size())

    def unregister_all(self) -> None:
        starts, self._starts, self._ends = self._starts, [], []
        for address in starts:
            self._check("unregister_memory", self._engine.unregister_memory(address))

    def _overlaps(self, start: int, end: int) -> bool:
        index = bisect.bisect(self._starts, start)
        return (index > 0 and self._ends[index - 1] > start) or (index < len(self._starts)
                                                                  and self._starts[index] < end)

    def is_registered(self, address: int, length: int) -> bool:
        index = bisect.bisect(self._starts, address) - 1
        return index >= 0 and address + length <= self._ends[index]

    def read(self, peer_session: str, local: list[int], remote: list[int], lengths: list[int]) -> None:
        """Copy ``lengths[i]`` bytes at the peer's ``remote[i]`` into our ``local[i]``, in
        synchronous batches of at most ``MAX_BATCH_RANGES`` ranges (one when it fits). Every local
        range must lie in memory this object registered."""
        if not (len(local) == len(remote) == len(lengths)):
            raise ValueError("read: local, remote and lengths differ in length")
        if not local:
            return
        for address, length in zip(local, lengths):
            if length <= 0 or not self.is_registered(address, length):
                raise MooncakeError(f"read: the local buffer [{address:#x}, +{length}) is not in registered memory")
        for start in range(0, len(local), MAX_BATCH_RANGES):
            end = start + MAX_BATCH_RANGES
            self._check(f"batch_transfer_sync_read from {peer_session}",
                        self._engine.batch_transfer_sync_read(peer_session, local[start:end], remote[start:end],
                                                              lengths[start:end]))

    def close(self) -> None:
        self.unregister_all()
        self._engine = None
