"""The offloading connector's worker side bytes: this rank's shard of every offloaded block.

``HostStore``: one host tensor per device KV tensor, ``num_slots`` blocks long; a save / load is
one batched ``index_copy_`` per tensor. ``DiskStore``: one file per block (its shard), written by
a background thread off the step's path, read (and verified) in the step that loads it.

A file is ``MAGIC`` + the sha256 of the payload + the payload (the block's rows of every layer's
tensors, raw, in ``register_kv_caches`` order). A file whose size or checksum is wrong is
removed and reported: its block is a failed load (recomputed), never KV."""

from __future__ import annotations

import hashlib
import logging
import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import torch

from atb_plugin.engine.kv_transfer.offloading.index import block_file, remove_file

logger = logging.getLogger(__name__)

MAGIC = b"ATBKV\x00\x01\x00"
_DIGEST = 32


def flat_tensors(kv_caches: list) -> list[torch.Tensor]:
    """Every KV tensor, in layer order (a layer's key then value; one latent tensor for MLA)."""
    return [t for layer in kv_caches for t in (layer if isinstance(layer, (tuple, list)) else (layer,))]


class HostStore:
    def __init__(self, kv_caches: list, num_slots: int):
        self.device_tensors = flat_tensors(kv_caches)
        # Pinned where the device copies from host memory by DMA; plain memory on the CPU.
        pin = self.device_tensors[0].device.type not in ("cpu", "meta") and torch.cuda.is_available()
        self.tensors = [torch.empty((num_slots, *t.shape[1:]), dtype=t.dtype, pin_memory=pin)
                        for t in self.device_tensors]

    def save(self, block_ids: list[int], slots: list[int]) -> None:
        source, target = _index(block_ids, self.device_tensors[0].device), _index(slots, "cpu")
        for device, host in zip(self.device_tensors, self.tensors):
            host.index_copy_(0, target, device.index_select(0, source).to("cpu"))

    def load(self, slots: list[int], block_ids: list[int]) -> None:
        source, target = _index(slots, "cpu"), _index(block_ids, self.device_tensors[0].device)
        for device, host in zip(self.device_tensors, self.tensors):
            device.index_copy_(0, target, host.index_select(0, source).to(device.device, non_blocking=True))

    def rows(self, block_id: int) -> list[torch.Tensor]:
        """A host copy of one device block's rows (what a disk write reads after the device
        block may be reused)."""
        return [device[block_id].to("cpu", copy=True) for device in self.device_tensors]


def _index(ids: list[int], device) -> torch.Tensor:
    return torch.tensor(ids, dtype=torch.long, device=device)


class DiskStore:
    """This rank's files under the compatibility directory (``index.compatibility_directory``).
    ``write`` queues a file (one writer thread); ``read_into`` waits for a queued write of the
    same block first, then reads, verifies and copies; ``remove`` deletes."""

    def __init__(self, directory: Path, rank: int, kv_caches: list):
        self.directory, self.rank = directory, rank
        self.device_tensors = flat_tensors(kv_caches)
        self.row_bytes = [t[0].numel() * t.element_size() for t in self.device_tensors]
        self.payload_bytes = sum(self.row_bytes)
        self._writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"kv-disk-writer-{rank}")
        self._inflight: dict[bytes, Future] = {}
        self._written: list[bytes] = []  # completed writes since the last written() call
        self._lock = threading.Lock()
        self.write_errors = 0

    def write(self, block_hash: bytes, rows: list[torch.Tensor]) -> None:
        with self._lock:
            self._inflight[block_hash] = self._writer.submit(self._write, block_hash, rows)

    def _write(self, block_hash: bytes, rows: list[torch.Tensor]) -> None:
        path = block_file(self.directory, self.rank, block_hash)
        try:
            payload = b"".join(_raw_bytes(row) for row in rows)
            path.parent.mkdir(parents=True, exist_ok=True)
            temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
            with open(temporary, "wb") as file:
                file.write(MAGIC + hashlib.sha256(payload).digest() + payload)
            os.replace(temporary, path)  # readers see a whole file or none
            with self._lock:
                self._written.append(block_hash)
        except OSError as error:  # a full or read-only disk: the block is simply not on disk
            self.write_errors += 1
            logger.warning("KV offload: writing %s failed: %s", path, error)
        finally:
            with self._lock:
                self._inflight.pop(block_hash, None)

    def written(self) -> set[bytes]:
        """Blocks whose file is complete, since the previous call."""
        with self._lock:
            done, self._written = set(self._written), []
        return done

    def _wait(self, block_hash: bytes) -> None:
        with self._lock:
            pending = self._inflight.get(block_hash)
        if pending is not None:
            pending.result()

    def read_into(self, block_hash: bytes, block_id: int) -> bool:
        """Copy the block's file into device block ``block_id``; False (the file removed when it
        exists) when it is missing, truncated or fails its checksum."""
        self._wait(block_hash)
        path = block_file(self.directory, self.rank, block_hash)
        try:
            data = bytearray(path.read_bytes())  # writable: torch.frombuffer views it
        except OSError:
            return False
        head = len(MAGIC) + _DIGEST
        payload = memoryview(data)[head:]
        if (len(data) != head + self.payload_bytes or data[:len(MAGIC)] != MAGIC
                or hashlib.sha256(payload).digest() != data[len(MAGIC):head]):
            logger.warning("KV offload: %s is corrupt (size or checksum); removed, its block is recomputed", path)
            remove_file(path)
            return False
        offset = 0
        for tensor, nbytes in zip(self.device_tensors, self.row_bytes):
            raw = torch.frombuffer(payload[offset:offset + nbytes], dtype=torch.uint8)
            tensor[block_id].copy_(raw.view(tensor.dtype).view(tensor.shape[1:]))
            offset += nbytes
        return True

    def remove(self, block_hash: bytes) -> None:
        self._wait(block_hash)
        remove_file(block_file(self.directory, self.rank, block_hash))

    def close(self) -> None:
        """Finish the queued writes (a restarted engine reads them), then stop the writer."""
        self._writer.shutdown(wait=True)


def _raw_bytes(row: torch.Tensor) -> bytes:
    return row.cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes()
