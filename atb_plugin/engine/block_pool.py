"""``BlockPool``: the KV cache's physical blocks, their free queue and the prefix-cache map.

Follows vLLM v1's ``BlockPool`` / ``FreeKVCacheBlockQueue`` (one KV cache group, no sliding
window), written plainly. The pool knows nothing about requests: ``KVCacheManager`` decides which
blocks a request holds and which of them are full enough to cache.
"""

from __future__ import annotations

import hashlib
import pickle
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

# A block hash is the sha256 digest of (parent hash, the block's token ids, extra keys).
BlockHash = bytes

# The parent of a request's first block. A constant rather than a random seed so hashes are
# stable across processes and runs (Python's ``hash()`` is salted per process).
ROOT_BLOCK_HASH: BlockHash = hashlib.sha256(b"atb-plugin prefix cache root").digest()

# Pickle protocol 4 serialises ints, bytes, str and tuples deterministically; pinning it keeps
# hashes stable when Python's default protocol changes.
_PICKLE_PROTOCOL = 4


def hash_block_tokens(
    parent_block_hash: BlockHash | None, token_ids: Sequence[int], extra_keys: object = None
) -> BlockHash:
    """The hash of one FULL block. Chaining on the parent hash makes a block's hash name its
    whole prefix: two blocks with equal tokens after different prefixes never collide.
    ``token_ids`` includes the negative media-handle slots, so a block of another image's
    placeholders hashes differently even though its placeholder ids are the same.
    ``extra_keys`` must be picklable and deterministic (str, int, bytes, tuples of them)."""
    parent = ROOT_BLOCK_HASH if parent_block_hash is None else parent_block_hash
    payload = pickle.dumps((parent, tuple(int(t) for t in token_ids), extra_keys), protocol=_PICKLE_PROTOCOL)
    return hashlib.sha256(payload).digest()


def hash_request_tokens(
    token_ids: Sequence[int],
    block_size: int,
    extra_keys: object = None,
    parent_hashes: Sequence[BlockHash] = (),
) -> list[BlockHash]:
    """Hashes of every full block of ``token_ids`` (a trailing partial block gets none).
    ``parent_hashes``: hashes already computed for the leading blocks; only the blocks after
    them are hashed, so a growing request pays for each block once."""
    hashes = list(parent_hashes)
    for start in range(len(hashes) * block_size, len(token_ids) - block_size + 1, block_size):
        parent = hashes[-1] if hashes else None
        hashes.append(hash_block_tokens(parent, token_ids[start : start + block_size], extra_keys))
    return hashes


@dataclass(eq=False, slots=True)
class KVCacheBlock:
    """One physical block. ``ref_cnt`` counts the requests holding it; a block with
    ``ref_cnt == 0`` (other than the null block) is in the free queue. ``block_hash`` is set
    while the block is in the prefix-cache map, and survives freeing until the block is handed
    out again. ``prev_free_block`` / ``next_free_block`` are the free queue's links (None when
    the block is not in the queue)."""

    block_id: int
    ref_cnt: int = 0
    block_hash: BlockHash | None = None
    prev_free_block: KVCacheBlock | None = None
    next_free_block: KVCacheBlock | None = None
    is_null: bool = False

    def __repr__(self) -> str:
        # The links would recurse through the whole queue.
        digest = self.block_hash.hex()[:8] if self.block_hash is not None else None
        return f"KVCacheBlock(id={self.block_id}, ref_cnt={self.ref_cnt}, hash={digest})"


class FreeKVCacheBlockQueue:
    """The free blocks in eviction order, as a doubly linked list threaded through the blocks
    themselves, so every operation is O(1) — including ``remove`` of a block in the middle, which
    a prefix-cache hit on a freed block needs (a ``collections.deque`` would make that O(n))::

        fake_head <-> [b7] <-> [b3] <-> [b9] <-> ... <-> [b4] <-> fake_tail
                      ^ popleft(): next to be                     ^ append(): freed last,
                        handed out (least                           evicted last
                        recently freed)
                               remove(b3): b7 <-> b9, O(1) (a cache hit on a free block)

    The two sentinels are never handed out; they spare every operation its edge cases."""

    def __init__(self, blocks: Iterable[KVCacheBlock]):
        self.fake_head = KVCacheBlock(block_id=-1)
        self.fake_tail = KVCacheBlock(block_id=-1)
        self.fake_head.next_free_block = self.fake_tail
        self.fake_tail.prev_free_block = self.fake_head
        self.num_free_blocks = 0
        for block in blocks:
            self.append(block)

    def popleft(self) -> KVCacheBlock:
        block = self.fake_head.next_free_block
        if block is self.fake_tail:
            raise RuntimeError("no free blocks left")
        self.remove(block)
        return block

    def remove(self, block: KVCacheBlock) -> None:
        prev_block, next_block = block.prev_free_block, block.next_free_block
        if prev_block is None or next_block is None:
            raise RuntimeError(f"{block!r} is not in the free queue")
        prev_block.next_free_block = next_block
        next_block.prev_free_block = prev_block
        block.prev_free_block = block.next_free_block = None
        self.num_free_blocks -= 1

    def append(self, block: KVCacheBlock) -> None:
        if block.prev_free_block is not None or block.next_free_block is not None:
            raise RuntimeError(f"{block!r} is already in the free queue")
        last = self.fake_tail.prev_free_block
        last.next_free_block = block
        block.prev_free_block = last
        block.next_free_block = self.fake_tail
        self.fake_tail.prev_free_block = block
        self.num_free_blocks += 1

    def __len__(self) -> int:
        return self.num_free_blocks

    def __iter__(self):
        """Head to tail (eviction order). O(n): for tests and debugging."""
        block = self.fake_head.next_free_block
        while block is not self.fake_tail:
            yield block
            block = block.next_free_block


class BlockPool:
    """Owns ``num_blocks`` physical KV blocks (ids 0..num_blocks-1, matching the rows of the
    device KV cache). Contract:

    - Block 0 is the null block: it pads block tables, is never handed out, never freed, never
      cached, and counts as neither free nor used. ``free + used == num_blocks - 1`` always.
    - ``get_new_blocks`` takes blocks from the head of the free queue (least recently freed);
      a taken block that was still in the prefix-cache map is evicted from it first.
    - ``free_blocks`` decrements ref counts; blocks reaching 0 go to the queue's tail and KEEP
      their hash, so a later request can still hit them (``touch`` takes them back out).
    - The prefix-cache map holds only full blocks, each under its chained hash::

          request tokens  | t0 .. t15 | t16 .. t31 | t32 .. t47 | t48 t49 (partial: not cached)
          block hash       h0 = H(ROOT, t0..t15, extra)
                                       h1 = H(h0, t16..t31, extra)
                                                    h2 = H(h1, t32..t47, extra)
          cached_block_hash_to_block = {h0: block 5, h1: block 2, h2: block 9}

      A lookup walks h0, h1, h2 ... and stops at the first miss, so a hit on h_i implies the
      whole prefix up to block i matches. Invariant: ``map[h].block_hash == h`` for every entry.
    - When two requests compute the same block concurrently, the first one cached wins the map
      entry; the second block stays unhashed (a private duplicate, freed like any other block).
    """

    def __init__(self, num_blocks: int, enable_prefix_caching: bool = True):
        if num_blocks < 2:
            raise ValueError(f"num_blocks must be >= 2 (block 0 is the reserved null block), got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [KVCacheBlock(block_id=i) for i in range(num_blocks)]
        self.free_block_queue = FreeKVCacheBlockQueue(self.blocks)
        self.cached_block_hash_to_block: dict[BlockHash, KVCacheBlock] = {}
        # Taken out of the queue for good: padding entries of block tables point at it.
        self.null_block = self.free_block_queue.popleft()
        self.null_block.is_null = True

    # -- allocation -------------------------------------------------------------------------

    def get_num_free_blocks(self) -> int:
        return self.free_block_queue.num_free_blocks

    def get_usage(self) -> float:
        """Fraction of the allocatable blocks (all but the null block) held by requests."""
        return 1.0 - self.get_num_free_blocks() / (self.num_blocks - 1)

    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        """``num_blocks`` blocks with ``ref_cnt == 1``, least recently freed first. Raises
        ``ValueError`` (taking nothing) when fewer are free: callers check first."""
        if num_blocks < 0:
            raise ValueError(f"num_blocks must be >= 0, got {num_blocks}")
        if num_blocks > self.get_num_free_blocks():
            raise RuntimeError(f"cannot get {num_blocks} blocks: only {self.get_num_free_blocks()} are free")
        new_blocks = []
        for _ in range(num_blocks):
            block = self.free_block_queue.popleft()
            # Its contents are about to be overwritten: the old hash must not hit any more.
            self._evict_cached_block(block)
            block.ref_cnt = 1
            new_blocks.append(block)
        return new_blocks

    def free_blocks(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Drop one reference to each block, in the given order; blocks reaching 0 are appended
        to the free queue in that order (so pass a request's blocks reversed: its tail blocks,
        the least shareable, get evicted first). The null block is skipped."""
        for block in blocks:
            if block.is_null:
                continue
            if block.ref_cnt <= 0:
                raise RuntimeError(f"{block!r} freed more often than it was taken")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self.free_block_queue.append(block)

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Take one more reference to each block (prefix-cache hits); a free block leaves the
        free queue, in O(1), so it cannot be handed out while shared."""
        for block in blocks:
            if block.is_null:
                continue
            if block.ref_cnt == 0:
                self.free_block_queue.remove(block)
            block.ref_cnt += 1

    # -- prefix cache -----------------------------------------------------------------------

    def get_cached_block(self, block_hash: BlockHash) -> KVCacheBlock | None:
        if not self.enable_prefix_caching:
            return None
        return self.cached_block_hash_to_block.get(block_hash)

    def cache_full_blocks(
        self,
        blocks: Sequence[KVCacheBlock],
        block_hashes: Sequence[BlockHash],
        num_cached_blocks: int,
        num_full_blocks: int,
    ) -> None:
        """Enter ``blocks[num_cached_blocks:num_full_blocks]`` (a request's blocks, in order) into
        the map under ``block_hashes`` (that request's chained hashes, at least
        ``num_full_blocks`` of them). Blocks before ``num_cached_blocks`` were entered by an
        earlier call or came from a cache hit."""
        if not self.enable_prefix_caching or num_cached_blocks >= num_full_blocks:
            return
        if num_full_blocks > len(blocks) or num_full_blocks > len(block_hashes):
            raise RuntimeError(
                f"num_full_blocks={num_full_blocks} but only {len(blocks)} blocks and {len(block_hashes)} hashes"
            )
        to_cache = range(num_cached_blocks, num_full_blocks)
        for block, block_hash in zip((blocks[i] for i in to_cache), (block_hashes[i] for i in to_cache)):
            if block.block_hash is not None:
                # A hit (it is already under this very hash) or already cached.
                if block.block_hash != block_hash:
                    raise RuntimeError(f"{block!r} is cached under another hash than this request's")
                continue
            if block.is_null:
                raise RuntimeError("the null block cannot be cached")
            if block_hash in self.cached_block_hash_to_block:
                continue  # a concurrent duplicate: the first copy keeps the entry
            block.block_hash = block_hash
            self.cached_block_hash_to_block[block_hash] = block

    def uncache_blocks(self, block_ids: Iterable[int]) -> None:
        """Take these blocks out of the prefix-cache map (their contents are not what their hash
        says: a KV connector's load into them failed). Holders keep them; freed, they are plain
        free blocks."""
        for block_id in block_ids:
            self._evict_cached_block(self.blocks[block_id])

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash. Only allowed while no request holds a block (their hashes
        would otherwise be inconsistent with the map); returns whether it happened."""
        if self.get_num_free_blocks() != self.num_blocks - 1:
            return False
        self.cached_block_hash_to_block.clear()
        for block in self.blocks:
            block.block_hash = None
        return True

    def _evict_cached_block(self, block: KVCacheBlock) -> None:
        if block.block_hash is None:
            return
        if self.cached_block_hash_to_block.get(block.block_hash) is block:
            del self.cached_block_hash_to_block[block.block_hash]
        block.block_hash = None

    # -- checks -----------------------------------------------------------------------------

    def check(self) -> None:
        """Assert the pool's invariants. O(num_blocks): for tests."""
        queued = list(self.free_block_queue)
        assert len(queued) == self.free_block_queue.num_free_blocks
        assert len({b.block_id for b in queued}) == len(queued), "a block is queued twice"
        assert not self.null_block.ref_cnt and self.null_block not in queued
        assert self.null_block.block_hash is None
        for block in self.blocks:
            assert block.ref_cnt >= 0, block
        assert {b.block_id for b in queued} == {b.block_id for b in self.blocks[1:] if b.ref_cnt == 0}
        used = sum(1 for b in self.blocks[1:] if b.ref_cnt > 0)
        assert self.get_num_free_blocks() + used == self.num_blocks - 1
        for block_hash, block in self.cached_block_hash_to_block.items():
            assert block.block_hash == block_hash, (block, block_hash)
        for block in self.blocks:
            if block.block_hash is not None:
                assert self.cached_block_hash_to_block.get(block.block_hash) is block, block
