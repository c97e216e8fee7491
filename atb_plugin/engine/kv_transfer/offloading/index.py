"""The offloading connector's scheduler side bookkeeping: which block hashes each tier holds, in
least-recently-used order, and where. One index serves every tensor-parallel rank: the ranks
store exactly what the step's metadata names, so their tiers hold the same blocks (each its own
shard of them). Torch-free.

The disk tier's files live under ``<disk_path>/<compatibility key>/rank<r>/<xx>/<hash>.kv``: the
key names what makes KV interchangeable (the model, the KV block layout, block size, tensor
parallel size), so engines of other models or layouts never read each other's files, and a
restarted engine of the same kind finds its blocks again (``scan``)."""

from __future__ import annotations

import hashlib
import json
import os
from collections import OrderedDict
from pathlib import Path

from atb_plugin.engine.block_pool import BlockHash

FILE_SUFFIX = ".kv"


class LRUIndex:
    """Block hash -> value, least recently used first; ``capacity`` entries at most (None:
    unbounded). ``add`` returns the entries it evicted to make room."""

    def __init__(self, capacity: int | None):
        self.capacity = capacity
        self.entries: OrderedDict[BlockHash, object] = OrderedDict()

    def __contains__(self, block_hash: BlockHash) -> bool:
        return block_hash in self.entries

    def __len__(self) -> int:
        return len(self.entries)

    def touch(self, block_hash: BlockHash):
        """The entry's value, now the most recently used."""
        self.entries.move_to_end(block_hash)
        return self.entries[block_hash]

    def add(self, block_hash: BlockHash, value=None) -> list[tuple[BlockHash, object]]:
        evicted = []
        while self.capacity is not None and len(self.entries) >= self.capacity:
            evicted.append(self.entries.popitem(last=False))
        self.entries[block_hash] = value
        return evicted

    def pop(self, block_hash: BlockHash):
        return self.entries.pop(block_hash, None)


class HostIndex(LRUIndex):
    """The host tier: ``num_slots`` slots of one block each (every rank holds the same slots)."""

    def __init__(self, num_slots: int):
        super().__init__(num_slots)
        self.free_slots = list(range(num_slots - 1, -1, -1))

    def insert(self, block_hash: BlockHash) -> int:
        """A slot for ``block_hash``: a free one, else the least recently used block's."""
        if self.free_slots:
            slot = self.free_slots.pop()
        else:
            _, slot = self.entries.popitem(last=False)
        self.entries[block_hash] = slot
        return slot

    def pop(self, block_hash: BlockHash):
        slot = super().pop(block_hash)
        if slot is not None:
            self.free_slots.append(slot)
        return slot


def model_identity(model: str) -> str:
    """The checkpoint's resolved path and its config.json's digest (a changed config, e.g. another
    number of layers, is another model)."""
    path = Path(model)
    config = path / "config.json"
    digest = hashlib.sha256(config.read_bytes()).hexdigest() if config.is_file() else ""
    return f"{path.resolve()}#{digest}"


def compatibility_directory(disk_path: str, model: str, kv_block_layout: str, block_size: int,
                            tensor_parallel_size: int) -> Path:
    """The directory of the files this engine may read and write (created, with a
    ``layout.json`` saying what it is for people)."""
    what = {"model": model_identity(model), "kv_block_layout": kv_block_layout, "block_size": block_size,
            "tensor_parallel_size": tensor_parallel_size, "format": 1}
    key = hashlib.sha256(json.dumps(what, sort_keys=True).encode()).hexdigest()[:24]
    directory = Path(disk_path) / key
    directory.mkdir(parents=True, exist_ok=True)
    description = directory / "layout.json"
    if not description.exists():
        description.write_text(json.dumps(what, indent=1, sort_keys=True))
    return directory


def block_file(directory: Path, rank: int, block_hash: BlockHash) -> Path:
    name = block_hash.hex()
    return directory / f"rank{rank}" / name[:2] / (name + FILE_SUFFIX)


def scan(directory: Path, tensor_parallel_size: int) -> list[BlockHash]:
    """The blocks every rank has a file of (a block is usable only whole), oldest first (by the
    files' modification time: the LRU order a restarted engine starts from)."""
    per_rank: list[dict[BlockHash, float]] = []
    for rank in range(tensor_parallel_size):
        found = {}
        root = directory / f"rank{rank}"
        if root.is_dir():
            for entry in root.glob(f"*/*{FILE_SUFFIX}"):
                try:
                    found[bytes.fromhex(entry.name[:-len(FILE_SUFFIX)])] = entry.stat().st_mtime
                except (ValueError, OSError):
                    continue  # a stray name, or removed meanwhile
        per_rank.append(found)
    common = set(per_rank[0]).intersection(*per_rank[1:]) if per_rank else set()
    return sorted(common, key=lambda h: per_rank[0][h])


def remove_file(path: Path) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
