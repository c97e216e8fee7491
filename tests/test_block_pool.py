"""Tests for ``atb_plugin/engine/block_pool.py`` and ``kv_cache_manager.py``: the null block, the
LRU free queue, ref counts, hash-chained prefix caching and the allocation contract.

The state-machine test at the end drives random admit / schedule / decode / preempt / finish
sequences over several requests against a fake KV cache (one token id per slot), so a block
handed out while still held, or a cache hit on a block whose contents changed, shows up as a
request reading tokens that are not its own.
"""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
from hypothesis import event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from atb_plugin.engine.block_pool import (
    BlockPool,
    FreeKVCacheBlockQueue,
    KVCacheBlock,
    hash_block_tokens,
    hash_request_tokens,
)
from atb_plugin.engine.kv_cache_manager import KVCacheManager
from atb_plugin.engine.request import Request
from atb_plugin.engine.sampling_params import SamplingParams

BLOCK_SIZE = 4


def make_request(request_id: str, prompt: list[int], cache_salt: str | None = None) -> Request:
    request = Request(request_id, list(prompt), SamplingParams())
    if cache_salt is not None:
        request.cache_salt = cache_salt
    return request


def schedule_prefill(kv: KVCacheManager, request: Request) -> list[int] | None:
    """What the scheduler does for a waiting request: look up hits, allocate the rest, advance."""
    computed_ids, num_cached = kv.get_computed_blocks(request)
    new_ids = kv.allocate_slots(request, request.num_tokens - num_cached, computed_ids)
    if new_ids is None:
        return None
    request.num_computed_tokens = request.num_tokens
    request.num_cached_tokens = num_cached
    return computed_ids + new_ids


def pool_state(pool: BlockPool):
    return (
        [b.block_id for b in pool.free_block_queue],
        [(b.ref_cnt, b.block_hash) for b in pool.blocks],
        dict(pool.cached_block_hash_to_block),
    )


# -- null block and free queue --------------------------------------------------------------


def test_null_block_is_never_handed_out_or_freed():
    pool = BlockPool(num_blocks=8)
    assert pool.null_block.block_id == 0 and pool.null_block.is_null
    assert pool.get_num_free_blocks() == 7
    blocks = pool.get_new_blocks(7)
    assert sorted(b.block_id for b in blocks) == list(range(1, 8))
    with pytest.raises(RuntimeError, match="only 0 are free"):
        pool.get_new_blocks(1)
    pool.free_blocks([pool.null_block, *blocks])  # padding entries of a block table: skipped
    pool.touch([pool.null_block])
    assert pool.null_block.ref_cnt == 0 and pool.null_block not in list(pool.free_block_queue)
    assert 0 not in {b.block_id for b in pool.get_new_blocks(7)}
    pool.check()


def test_pool_needs_room_besides_the_null_block():
    with pytest.raises(ValueError, match="num_blocks must be >= 2"):
        BlockPool(num_blocks=1)


def test_free_queue_is_lru_freed_blocks_go_to_the_tail():
    pool = BlockPool(num_blocks=6)
    b1, b2, b3, b4, b5 = pool.get_new_blocks(5)
    assert [b.block_id for b in (b1, b2, b3, b4, b5)] == [1, 2, 3, 4, 5]  # head first
    pool.free_blocks([b3, b1, b4])
    assert [b.block_id for b in pool.free_block_queue] == [3, 1, 4]
    pool.free_blocks([b2])
    assert [b.block_id for b in pool.get_new_blocks(3)] == [3, 1, 4]  # least recently freed first
    assert [b.block_id for b in pool.free_block_queue] == [2]
    pool.check()


def test_free_queue_removal_from_the_middle_keeps_order():
    blocks = [KVCacheBlock(i) for i in range(6)]
    queue = FreeKVCacheBlockQueue(blocks)
    queue.remove(blocks[3])
    queue.remove(blocks[0])  # the head
    queue.remove(blocks[5])  # the tail
    assert [b.block_id for b in queue] == [1, 2, 4] and len(queue) == 3
    assert blocks[3].prev_free_block is None and blocks[3].next_free_block is None
    with pytest.raises(RuntimeError, match="not in the free queue"):
        queue.remove(blocks[3])
    with pytest.raises(RuntimeError, match="already in the free queue"):
        queue.append(blocks[1])
    queue.append(blocks[3])
    assert [queue.popleft().block_id for _ in range(4)] == [1, 2, 4, 3]
    with pytest.raises(RuntimeError, match="no free blocks left"):
        queue.popleft()


def test_free_queue_removal_from_the_middle_relinks_only_the_neighbours():
    # O(1) by construction: removal rewires the two neighbours and nothing else (no timing here:
    # tests check behaviour, speed claims live in benchmarks/).
    blocks = [KVCacheBlock(i) for i in range(200_000)]
    queue = FreeKVCacheBlockQueue(blocks)
    for block in blocks[99_000:101_000]:
        queue.remove(block)
    assert len(queue) == 198_000
    assert blocks[98_999].next_free_block is blocks[101_000]
    assert blocks[101_000].prev_free_block is blocks[98_999]


# -- ref counts -----------------------------------------------------------------------------


def test_two_requests_sharing_a_prefix_share_blocks_with_ref_counts():
    kv = KVCacheManager(num_blocks=16, block_size=BLOCK_SIZE)
    prefix = [11, 12, 13, 14, 15, 16, 17, 18]  # two full blocks
    a = make_request("a", prefix + [1, 2, 3])
    b = make_request("b", prefix + [4, 5])
    blocks_a = schedule_prefill(kv, a)
    assert len(blocks_a) == 3 and kv.num_free_blocks == 12
    blocks_b = schedule_prefill(kv, b)
    assert b.num_cached_tokens == 8
    assert blocks_b[:2] == blocks_a[:2] and blocks_b[2] != blocks_a[2]
    assert kv.get_block_ids("b") == blocks_b
    pool = kv.block_pool
    assert [pool.blocks[i].ref_cnt for i in blocks_a] == [2, 2, 1]
    assert kv.num_free_blocks == 11 and kv.usage == pytest.approx(4 / 15)

    kv.free(a)
    assert [pool.blocks[i].ref_cnt for i in blocks_b] == [1, 1, 1]
    queued = [blk.block_id for blk in pool.free_block_queue]
    assert blocks_a[2] in queued and blocks_a[0] not in queued and blocks_a[1] not in queued
    kv.free(b)
    # b's blocks freed tail first: its private block, then the prefix blocks, are evicted in that order.
    assert [blk.block_id for blk in pool.free_block_queue][-3:] == [blocks_b[2], blocks_b[1], blocks_b[0]]
    assert kv.num_free_blocks == 15 and kv.usage == 0
    assert kv.get_block_ids("a") == [] and kv.get_block_ids("b") == []
    pool.check()


def test_double_free_of_a_block_is_refused():
    pool = BlockPool(num_blocks=4)
    (block,) = pool.get_new_blocks(1)
    pool.free_blocks([block])
    with pytest.raises(RuntimeError, match="freed more often"):
        pool.free_blocks([block])


# -- hash chain -----------------------------------------------------------------------------


def test_block_hashes_chain_on_the_prefix():
    tokens = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13]
    hashes = hash_request_tokens(tokens, BLOCK_SIZE)
    assert len(hashes) == 3  # the partial block (13) has no hash
    assert hashes[0] == hash_block_tokens(None, [1, 2, 3, 4])
    assert hashes[1] == hash_block_tokens(hashes[0], [5, 6, 7, 8])
    # Equal tokens after a different prefix: a different hash.
    assert hash_block_tokens(hash_block_tokens(None, [0, 2, 3, 4]), [5, 6, 7, 8]) != hashes[1]
    # Incremental hashing equals hashing from scratch.
    assert hash_request_tokens(tokens, BLOCK_SIZE, parent_hashes=hashes[:1]) == hashes
    # Extra keys are part of the identity.
    assert hash_block_tokens(None, [1, 2, 3, 4], extra_keys="salt") != hashes[0]


def test_block_hash_is_stable_across_processes():
    # Python's hash() is salted per process; ours must not be (hashes may be logged / compared).
    code = (
        "from atb_plugin.engine.block_pool import hash_request_tokens as h; "
        "print(h([1, -2, 3, 4, 5, 6, 7, 8], 4, 'x')[-1].hex())"
    )
    outputs = set()
    for seed in ("1", "2"):
        env = dict(os.environ, PYTHONHASHSEED=seed)
        run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
        outputs.add(run.stdout)
    outputs.add(hash_request_tokens([1, -2, 3, 4, 5, 6, 7, 8], 4, "x")[-1].hex() + "\n")
    assert len(outputs) == 1


def test_same_prefix_hits_every_full_block():
    kv = KVCacheManager(num_blocks=32, block_size=BLOCK_SIZE)
    prompt = list(range(100, 113))  # 3 full blocks + 1 token
    blocks_a = schedule_prefill(kv, make_request("a", prompt))
    computed, num_cached = kv.get_computed_blocks(make_request("b", prompt + [7, 7]))
    assert computed == blocks_a[:3] and num_cached == 12


def test_a_different_token_in_the_first_block_misses_every_later_block():
    kv = KVCacheManager(num_blocks=32, block_size=BLOCK_SIZE)
    prompt = list(range(100, 113))
    schedule_prefill(kv, make_request("a", prompt))
    changed = [999] + prompt[1:]  # blocks 1 and 2 have identical tokens, but not the same prefix
    assert kv.get_computed_blocks(make_request("b", changed)) == ([], 0)
    changed_second_block = prompt[:5] + [999] + prompt[6:]
    computed, num_cached = kv.get_computed_blocks(make_request("c", changed_second_block))
    assert len(computed) == 1 and num_cached == BLOCK_SIZE


def test_a_different_media_handle_misses():
    # Two prompts with the same image placeholders but different shm handle slots (negative ids):
    # the second image must not be served the first image's KV.
    image_a = [-4611686018427387901, -2305843009213693950, 7, 7]
    image_b = [-4611686018427387909, -2305843009213693950, 7, 7]
    text = [1, 2, 3, 4]
    kv = KVCacheManager(num_blocks=32, block_size=BLOCK_SIZE)
    schedule_prefill(kv, make_request("a", text + image_a + [5, 6, 7, 8, 9]))
    computed, num_cached = kv.get_computed_blocks(make_request("b", text + image_b + [5, 6, 7, 8, 9]))
    assert len(computed) == 1 and num_cached == BLOCK_SIZE  # only the text block before the image
    computed, num_cached = kv.get_computed_blocks(make_request("c", text + image_a + [5, 6, 7, 8, 9]))
    assert len(computed) == 3 and num_cached == 3 * BLOCK_SIZE  # the same image hits


def test_different_extra_keys_miss():
    kv = KVCacheManager(num_blocks=32, block_size=BLOCK_SIZE)
    prompt = list(range(100, 113))
    schedule_prefill(kv, make_request("a", prompt, cache_salt="tenant-1"))
    assert kv.get_computed_blocks(make_request("b", prompt, cache_salt="tenant-2")) == ([], 0)
    assert kv.get_computed_blocks(make_request("c", prompt)) == ([], 0)
    assert len(kv.get_computed_blocks(make_request("d", prompt, cache_salt="tenant-1"))[0]) == 3


def test_freed_blocks_keep_their_hash_until_reallocated():
    kv = KVCacheManager(num_blocks=5, block_size=BLOCK_SIZE)  # 4 usable blocks
    pool = kv.block_pool
    prompt = list(range(100, 109))  # 2 full blocks + 1 token
    a = make_request("a", prompt)
    blocks_a = schedule_prefill(kv, a)
    kv.free(a)
    assert kv.num_free_blocks == 4 and len(pool.cached_block_hash_to_block) == 2

    # Hit again after the free: the free blocks leave the queue from its middle/tail.
    b = make_request("b", prompt)
    computed, num_cached = kv.get_computed_blocks(b)
    assert computed == blocks_a[:2] and num_cached == 8
    assert kv.allocate_slots(b, 1, computed) is not None
    assert [pool.blocks[i].ref_cnt for i in computed] == [1, 1]
    kv.free(b)

    # Reallocate everything: the old hashes are evicted as their blocks are handed out.
    c = make_request("c", list(range(200, 216)))
    assert len(schedule_prefill(kv, c)) == 4
    for old_hash in hash_request_tokens(prompt, BLOCK_SIZE):
        assert old_hash not in pool.cached_block_hash_to_block
    assert kv.get_computed_blocks(make_request("d", prompt)) == ([], 0)
    assert set(pool.cached_block_hash_to_block) == set(hash_request_tokens(c.all_token_ids, BLOCK_SIZE))
    pool.check()


def test_eviction_takes_the_least_recently_freed_block_first():
    kv = KVCacheManager(num_blocks=5, block_size=BLOCK_SIZE)
    a, b = make_request("a", [1, 2, 3, 4, 9]), make_request("b", [5, 6, 7, 8, 9])
    schedule_prefill(kv, a)  # blocks 1, 2
    schedule_prefill(kv, b)  # blocks 3, 4
    kv.free(a)
    kv.free(b)
    # One new block: taken from a's freed tail block first (it holds no cached hash), then a's
    # first block, so a's prefix is evicted and b's survives.
    schedule_prefill(kv, make_request("c", [0, 0, 0, 0, 0, 0, 0]))  # needs 2 blocks
    assert kv.get_computed_blocks(make_request("a2", [1, 2, 3, 4, 9])) == ([], 0)
    assert len(kv.get_computed_blocks(make_request("b2", [5, 6, 7, 8, 9]))[0]) == 1


def test_lookup_stops_at_the_first_evicted_block():
    # h0 and h2 stay cached but h1 is evicted: computed tokens are a contiguous prefix, so with
    # block 1 to recompute, block 2 cannot be used even though it is still cached.
    kv = KVCacheManager(num_blocks=5, block_size=BLOCK_SIZE)
    pool = kv.block_pool
    prompt = list(range(100, 113))  # 3 full blocks + 1 token
    a = make_request("a", prompt)
    b0, b1, b2, b3 = (pool.blocks[i] for i in schedule_prefill(kv, a))
    kv.free(a)  # queue: b3, b2, b1, b0
    pool.touch([b2])
    pool.free_blocks([b2])  # queue: b3, b1, b0, b2
    pool.free_blocks(pool.get_new_blocks(2))  # evicts b3 (unhashed) and b1
    assert b1.block_hash is None and b0.block_hash is not None and b2.block_hash is not None
    computed, num_cached = kv.get_computed_blocks(make_request("b", prompt))
    assert computed == [b0.block_id] and num_cached == BLOCK_SIZE


def test_media_handle_slots_are_not_normalised_away():
    # A block of handle slots differs from a block of the same shape but other (even
    # non-negative) ids: handles are hashed as they are.
    placeholders = [7, 7, 7, 7]
    handles = [-5, -6, 7, 7]
    assert hash_block_tokens(None, handles) != hash_block_tokens(None, placeholders)
    assert hash_block_tokens(None, handles) != hash_block_tokens(None, [0, 0, 7, 7])
    assert hash_block_tokens(None, handles) != hash_block_tokens(None, [5, 6, 7, 7])


def test_computed_blocks_never_cover_the_whole_prompt():
    kv = KVCacheManager(num_blocks=32, block_size=BLOCK_SIZE)
    prompt = list(range(100, 108))  # exactly 2 full blocks
    schedule_prefill(kv, make_request("a", prompt))
    computed, num_cached = kv.get_computed_blocks(make_request("b", prompt))
    assert len(computed) == 1 and num_cached == 4  # the last token must be recomputed for logits
    computed, num_cached = kv.get_computed_blocks(make_request("c", prompt + [1]))
    assert len(computed) == 2 and num_cached == 8
    # A one-token prompt cannot hit at all.
    assert kv.get_computed_blocks(make_request("d", prompt[:1])) == ([], 0)


def test_prefix_caching_disabled_never_hits_or_hashes():
    kv = KVCacheManager(num_blocks=16, block_size=BLOCK_SIZE, enable_prefix_caching=False)
    prompt = list(range(100, 113))
    schedule_prefill(kv, make_request("a", prompt))
    assert kv.get_computed_blocks(make_request("b", prompt)) == ([], 0)
    assert not kv.block_pool.cached_block_hash_to_block


# -- allocation -----------------------------------------------------------------------------


def test_decode_allocates_at_block_boundaries_and_caches_filled_blocks():
    kv = KVCacheManager(num_blocks=16, block_size=BLOCK_SIZE)
    request = make_request("a", [1, 2, 3, 4, 5, 6])
    assert len(schedule_prefill(kv, request)) == 2
    assert len(kv.block_pool.cached_block_hash_to_block) == 1
    allocated = []
    for token in (7, 8, 9, 10, 11):
        request.append_output_token(token)
        new_ids = kv.allocate_slots(request, 1)
        request.num_computed_tokens += 1
        allocated.append(len(new_ids))
    assert allocated == [0, 0, 1, 0, 0]  # positions 6, 7 fit block 2; position 8 opens block 3
    assert len(kv.get_block_ids("a")) == 3
    # Blocks filled by output tokens are cached too: a request continuing the conversation hits them.
    assert len(kv.block_pool.cached_block_hash_to_block) == 2
    computed, _ = kv.get_computed_blocks(make_request("b", request.all_token_ids + [12]))
    assert computed == kv.get_block_ids("a")[:2]


def test_chunked_prefill_allocates_per_chunk():
    kv = KVCacheManager(num_blocks=16, block_size=BLOCK_SIZE)
    request = make_request("a", list(range(10)))
    assert kv.allocate_slots(request, 5) == [1, 2]
    request.num_computed_tokens = 5
    assert kv.allocate_slots(request, 5) == [3]
    assert kv.get_block_ids("a") == [1, 2, 3]
    assert kv.allocate_slots(request, 0) == []


def test_allocate_slots_returns_none_and_changes_nothing_when_blocks_run_out():
    kv = KVCacheManager(num_blocks=6, block_size=BLOCK_SIZE)  # 5 usable blocks
    pool = kv.block_pool
    shared = make_request("shared", [1, 2, 3, 4, 5, 6, 7, 8, 9])
    schedule_prefill(kv, shared)  # 3 blocks, 2 hashed
    kv.free(shared)
    hog = make_request("hog", [50, 51, 52, 53, 54, 55, 56])
    schedule_prefill(kv, hog)  # 2 blocks, taken from the queue head: shared's tail block + 1 fresh
    assert kv.num_free_blocks == 3

    # b hits shared's two free hashed blocks and needs 2 new ones: 4 > 3 free.
    b = make_request("b", [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13])
    computed, num_cached = kv.get_computed_blocks(b)
    assert len(computed) == 2
    before = pool_state(pool)
    assert kv.allocate_slots(b, b.num_tokens - num_cached, computed) is None
    assert pool_state(pool) == before and kv.get_block_ids("b") == [] and "b" not in kv.num_cached_blocks

    # A running request that cannot grow keeps what it holds.
    hog.num_computed_tokens = hog.num_tokens
    before = pool_state(pool)
    assert kv.allocate_slots(hog, 100) is None
    assert pool_state(pool) == before and len(kv.get_block_ids("hog")) == 2

    # Exactly enough: succeeds.
    assert kv.allocate_slots(b, 3 * BLOCK_SIZE - num_cached, computed) is not None
    assert kv.num_free_blocks == 0
    pool.check()


def test_stale_computed_block_ids_are_refused():
    kv = KVCacheManager(num_blocks=4, block_size=BLOCK_SIZE)
    a = make_request("a", [1, 2, 3, 4, 5])
    schedule_prefill(kv, a)
    kv.free(a)
    b = make_request("b", [1, 2, 3, 4, 5])
    computed, _ = kv.get_computed_blocks(b)
    schedule_prefill(kv, make_request("c", list(range(20, 32))))  # evicts a's cached block
    kv.free(make_request("unknown", [0]))  # freeing a request that holds nothing is a no-op
    with pytest.raises(RuntimeError, match="stale"):
        kv.allocate_slots(b, 1, computed)


def test_cache_hits_only_for_a_request_without_blocks():
    kv = KVCacheManager(num_blocks=16, block_size=BLOCK_SIZE)
    a = make_request("a", [1, 2, 3, 4, 5])
    schedule_prefill(kv, a)
    with pytest.raises(RuntimeError, match="already holds blocks"):
        kv.get_computed_blocks(a)
    b = make_request("b", [1, 2, 3, 4, 5])
    computed, _ = kv.get_computed_blocks(b)
    b.num_computed_tokens = 1
    with pytest.raises(RuntimeError, match="holds no blocks and has computed no tokens"):
        kv.allocate_slots(b, 1, computed)


def test_reset_prefix_cache_only_when_no_request_holds_blocks():
    kv = KVCacheManager(num_blocks=16, block_size=BLOCK_SIZE)
    a = make_request("a", list(range(9)))
    schedule_prefill(kv, a)
    assert kv.reset_prefix_cache() is False
    assert kv.block_pool.cached_block_hash_to_block
    kv.free(a)
    assert kv.reset_prefix_cache() is True
    assert not kv.block_pool.cached_block_hash_to_block
    assert kv.get_computed_blocks(make_request("b", list(range(9)))) == ([], 0)
    kv.block_pool.check()


# -- random sequences -----------------------------------------------------------------------

# Prompts are built from a few shared prefixes (so the cache hits) with media-handle-like
# negative ids, then a random tail.
PREFIXES = [[], [1, 2, 3, 4, 5, 6], [1, 2, 3, 4, -7, -8, 9, 9], [1, 2, 3, 4, -7, -9, 9, 9, 10]]


class BlockManagerMachine(RuleBasedStateMachine):
    """Random admit / prefill-chunk / decode / preempt / finish over a small pool, with a fake KV
    cache recording which token each slot holds. After every step: the pool invariants hold, and
    every request reads its own tokens at all its computed positions."""

    NUM_BLOCKS = 12
    BLOCK_SIZE = 3

    @initialize(prefix_caching=st.booleans())
    def setup(self, prefix_caching):
        self.kv = KVCacheManager(self.NUM_BLOCKS, self.BLOCK_SIZE, enable_prefix_caching=prefix_caching)
        self.kv_slots = np.full((self.NUM_BLOCKS, self.BLOCK_SIZE), np.iinfo(np.int64).min, dtype=np.int64)
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        self.next_id = 0

    def _write_kv(self, request: Request, num_new_tokens: int) -> None:
        """The forward pass: the KV of positions [num_computed, +num_new) lands in their slots."""
        block_ids = self.kv.get_block_ids(request.request_id)
        for pos in range(request.num_computed_tokens, request.num_computed_tokens + num_new_tokens):
            self.kv_slots[block_ids[pos // self.BLOCK_SIZE], pos % self.BLOCK_SIZE] = request.all_token_ids[pos]
        request.num_computed_tokens += num_new_tokens

    @rule(prefix=st.sampled_from(PREFIXES), tail=st.lists(st.integers(-3, 20), min_size=1, max_size=10))
    def admit(self, prefix, tail):
        self.waiting.append(make_request(f"r{self.next_id}", prefix + tail))
        self.next_id += 1

    @precondition(lambda self: self.waiting)
    @rule(data=st.data())
    def schedule_waiting(self, data):
        request = self.waiting[0]
        computed, num_cached = self.kv.get_computed_blocks(request)
        assert num_cached == len(computed) * self.BLOCK_SIZE < request.num_tokens
        num_left = request.num_tokens - num_cached
        chunk = data.draw(st.integers(1, num_left), label="chunk")
        free_before = self.kv.num_free_blocks
        new_ids = self.kv.allocate_slots(request, chunk, computed)
        event("prefix-cache hit" if computed else "no prefix-cache hit")
        if new_ids is None:
            event("allocation refused")
            assert self.kv.num_free_blocks == free_before and not self.kv.get_block_ids(request.request_id)
            return
        assert self.kv.get_block_ids(request.request_id) == computed + new_ids
        self.waiting.pop(0)
        request.num_computed_tokens = num_cached
        self._write_kv(request, chunk)
        self.running.append(request)

    @precondition(lambda self: self.running)
    @rule(data=st.data(), token=st.integers(-3, 20))
    def step_running(self, data, token):
        request = data.draw(st.sampled_from(self.running), label="request")
        if request.num_computed_tokens == request.num_tokens:  # decode: the sampled token joins
            request.append_output_token(token)
        num_new = request.num_tokens - request.num_computed_tokens
        chunk = data.draw(st.integers(1, num_new), label="chunk")
        if self.kv.allocate_slots(request, chunk) is None:
            self.preempt(request)
            return
        self._write_kv(request, chunk)

    def preempt(self, request: Request) -> None:
        event("preempted")
        self.kv.free(request)
        request.num_computed_tokens = 0
        self.running.remove(request)
        self.waiting.insert(0, request)

    @precondition(lambda self: self.running)
    @rule(data=st.data(), finish=st.booleans())
    def free_running(self, data, finish):
        request = data.draw(st.sampled_from(self.running), label="request")
        if finish:
            self.kv.free(request)
            self.running.remove(request)
        else:
            self.preempt(request)

    @invariant()
    def pool_is_consistent(self):
        if not hasattr(self, "kv"):
            return
        pool = self.kv.block_pool
        pool.check()  # free + used == total - 1, ref counts >= 0, map[h].block_hash == h, ...
        held = {}
        for request in self.running:
            for block_id in self.kv.get_block_ids(request.request_id):
                held[block_id] = held.get(block_id, 0) + 1
        assert 0 not in held
        for block in pool.blocks[1:]:
            assert block.ref_cnt == held.get(block.block_id, 0), block
        assert self.kv.num_free_blocks + len(held) == self.NUM_BLOCKS - 1
        for request in self.waiting:
            assert not self.kv.get_block_ids(request.request_id)

    @invariant()
    def every_request_reads_its_own_tokens(self):
        if not hasattr(self, "kv"):
            return
        for request in self.running:
            block_ids = self.kv.get_block_ids(request.request_id)
            assert len(block_ids) * self.BLOCK_SIZE >= request.num_computed_tokens
            positions = np.arange(request.num_computed_tokens)
            rows = np.asarray(block_ids, dtype=np.int64)[positions // self.BLOCK_SIZE]
            slots = self.kv_slots[rows, positions % self.BLOCK_SIZE]
            assert slots.tolist() == request.all_token_ids[: request.num_computed_tokens], request.request_id

    @invariant()
    def cached_blocks_hold_their_tokens(self):
        if not hasattr(self, "kv"):
            return
        # Every hashed block of a running request holds exactly the tokens its hash names.
        for request in self.running:
            hashes = hash_request_tokens(request.all_token_ids, self.BLOCK_SIZE)
            for i, block_id in enumerate(self.kv.get_block_ids(request.request_id)):
                block = self.kv.block_pool.blocks[block_id]
                if block.block_hash is not None:
                    assert block.block_hash == hashes[i]


TestBlockManagerMachine = BlockManagerMachine.TestCase
TestBlockManagerMachine.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
