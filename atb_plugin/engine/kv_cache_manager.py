"""``KVCacheManager``: which KV blocks each request holds, with prefix caching (vLLM v1 semantics)."""

from __future__ import annotations

from atb_plugin.engine.block_pool import BlockHash, BlockPool, KVCacheBlock, hash_request_tokens
from atb_plugin.engine.request import Request
from atb_plugin.utils import cdiv


def _extra_keys(request: Request):
    """What besides its tokens names a request's blocks: its ``cache_salt``, and its LoRA
    adapter (id and path: the same tokens through two adapters have different KV)."""
    salt = getattr(request, "cache_salt", None)
    lora = getattr(request, "lora_request", None)
    return salt if lora is None else (salt, "lora", *lora.key)


def request_block_hashes(request: Request, block_size: int, num_tokens: int | None = None,
                         known: list[BlockHash] = ()) -> list[BlockHash]:
    """The prefix-cache hashes of ``request``'s full blocks (of its first ``num_tokens`` tokens):
    the names the KV cache manager caches them under, for a KV connector that keeps blocks by
    the same names (sha256 over pickled ids: the same in every process and run). ``known``: its
    leading hashes computed already (only the blocks after them are hashed)."""
    tokens = request.all_token_ids if num_tokens is None else request.all_token_ids[:num_tokens]
    if len(known) >= len(tokens) // block_size:
        return list(known[:len(tokens) // block_size])
    return hash_request_tokens(tokens, block_size, extra_keys=_extra_keys(request), parent_hashes=known)


class KVCacheManager:
    """Maps requests to block lists over a ``BlockPool``. Contract:

    - A request's i-th block holds the KV of token positions ``[i*block_size, (i+1)*block_size)``;
      the block table row the input batch builds is ``get_block_ids(request_id)``, padded with
      the null block (id 0)::

          positions   0 ........ 15 | 16 ....... 31 | 32 .. 37 ...... 47
          blocks      [ block 5    ] [ block 2     ] [ block 9 (partial) ]
          block table  5, 2, 9, 0, 0, 0 ...          (0 = null block: padding)
          slot of position p = block_table[p // block_size] * block_size + p % block_size

    - Scheduling a WAITING request (fresh or preempted)::

          computed_ids, num_cached = kv.get_computed_blocks(request)  # prefix-cache hits
          new_ids = kv.allocate_slots(request, num_new_tokens, computed_ids)
          if new_ids is None: the pool is full; nothing was taken (retry later / preempt)
          block_ids = computed_ids + new_ids     # == kv.get_block_ids(request.request_id)
          request.num_computed_tokens = num_cached   (the scheduler's job, before this step)

      A RUNNING request (decode or the next prefill chunk) calls ``allocate_slots(request,
      num_new_tokens)`` with ``request.num_computed_tokens`` already counting its past tokens.
    - Prefix-cache hits never cover a request's last token: its logits must be computed, so a
      hit is capped at ``num_tokens - 1`` tokens rounded down to whole blocks (for a fresh
      request ``num_tokens == num_prompt_tokens``; a preempted request also reuses the blocks of
      its earlier output tokens, as vLLM does).
    - Blocks are hashed and cached as soon as they are allocated for a full block of known tokens
      (``request.all_token_ids``), before the forward pass writes their KV: a request that hits
      them later is scheduled in a later step, or in the same step after the writer, whose KV the
      paged-attention kernels write before they read.
    - Identity of a block = chained hash of its token ids (media handles included) and the
      request's ``cache_salt`` attribute when it has one (vLLM's name; requests with different
      salts never share blocks) and its LoRA adapter (two adapters never share blocks), see
      ``block_pool.hash_block_tokens``.
    - ``free`` releases a request's blocks (finished or preempted); blocks nobody else holds go
      to the free queue still hashed, and stay hittable until the pool hands them out again.
    """

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.block_pool = BlockPool(num_blocks, enable_prefix_caching)
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        # How many leading blocks of the request are already in the prefix-cache map (or were
        # considered for it): the next cache_full_blocks starts there.
        self.num_cached_blocks: dict[str, int] = {}
        # Chained hashes of the request's full blocks, extended as its tokens grow.
        self.req_to_block_hashes: dict[str, list[BlockHash]] = {}

    @property
    def num_blocks(self) -> int:
        return self.block_pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.block_pool.get_num_free_blocks()

    @property
    def usage(self) -> float:
        """Fraction of the allocatable blocks (all but the null block) held by requests."""
        return self.block_pool.get_usage()

    def get_block_ids(self, request_id: str) -> list[int]:
        return [block.block_id for block in self.req_to_blocks.get(request_id, ())]

    # -- prefix cache -----------------------------------------------------------------------

    def _block_hashes(self, request: Request, num_tokens: int) -> list[BlockHash]:
        """The request's block hashes covering at least its first ``num_tokens // block_size``
        full blocks (hashes of blocks already known are reused)."""
        known = self.req_to_block_hashes.get(request.request_id, [])
        if len(known) < num_tokens // self.block_size:
            known = hash_request_tokens(
                request.all_token_ids[:num_tokens],
                self.block_size,
                extra_keys=_extra_keys(request),
                parent_hashes=known,
            )
            self.req_to_block_hashes[request.request_id] = known
        return known

    def get_computed_blocks(self, request: Request) -> tuple[list[int], int]:
        """The longest cached prefix of a request that holds no blocks: its block ids and the
        number of tokens they cover (a multiple of block_size, at most ``num_tokens - 1``; none
        for a request that needs its prompt logprobs). Takes no reference: pass the ids straight to ``allocate_slots``."""
        if request.request_id in self.req_to_blocks:
            raise RuntimeError(
                f"request {request.request_id} already holds blocks; only a waiting request looks up the cache"
            )
        # A request still owing its prompt logprobs needs the logits of every prompt position,
        # which a cached position would not have (vLLM skips the lookup too); it still publishes
        # its own blocks for others.
        if not self.enable_prefix_caching or request.needs_prompt_logprobs:
            return [], 0
        max_cache_hit_tokens = request.num_tokens - 1
        block_hashes = self._block_hashes(request, max_cache_hit_tokens)
        computed_block_ids = []
        for block_hash in block_hashes[: max_cache_hit_tokens // self.block_size]:
            block = self.block_pool.get_cached_block(block_hash)
            if block is None:
                break  # the chain means every later block misses too
            computed_block_ids.append(block.block_id)
        return computed_block_ids, len(computed_block_ids) * self.block_size

    # -- allocation -------------------------------------------------------------------------

    def allocate_slots(
        self, request: Request, num_new_tokens: int, computed_block_ids: list[int] | None = None,
        delay_cache: bool = False,
    ) -> list[int] | None:
        """Make the request's blocks cover ``request.num_computed_tokens + len(computed_block_ids)
        * block_size + num_new_tokens`` tokens: take a reference on the computed (cache-hit)
        blocks, then allocate what is missing. Returns the ids of the newly allocated blocks (not
        the computed ones; possibly []), or None — having changed nothing — when the pool has too
        few free blocks. Afterwards every full block of known tokens is hashed and cached, unless
        ``delay_cache`` (a KV connector fills them asynchronously: ``cache_blocks`` once it did)."""
        if num_new_tokens < 0:
            raise RuntimeError(f"num_new_tokens must be >= 0, got {num_new_tokens}")
        computed_blocks = [self.block_pool.blocks[i] for i in computed_block_ids or ()]
        req_blocks = self.req_to_blocks.get(request.request_id, [])
        if computed_blocks and (req_blocks or request.num_computed_tokens):
            raise RuntimeError(
                f"request {request.request_id}: cache-hit blocks go only to a request that holds no blocks "
                f"and has computed no tokens (holds {len(req_blocks)}, computed {request.num_computed_tokens})"
            )
        if computed_blocks:
            # A block handed out between get_computed_blocks and here holds other KV now; using
            # it would be a silent wrong answer, so refuse loudly.
            expected = self._block_hashes(request, len(computed_blocks) * self.block_size)
            if any(block.block_hash != h for block, h in zip(computed_blocks, expected)):
                raise RuntimeError(f"request {request.request_id}: stale computed_block_ids {computed_block_ids}")
        num_computed_tokens = request.num_computed_tokens + len(computed_blocks) * self.block_size
        num_total_tokens = num_computed_tokens + num_new_tokens
        num_new_blocks = cdiv(num_total_tokens, self.block_size) - len(req_blocks) - len(computed_blocks)
        # Hit blocks sitting in the free queue leave it when touched: they count against the
        # free blocks just like new ones.
        num_free_hits = sum(1 for block in computed_blocks if block.ref_cnt == 0)
        if max(num_new_blocks, 0) + num_free_hits > self.block_pool.get_num_free_blocks():
            return None

        self.block_pool.touch(computed_blocks)
        new_blocks = self.block_pool.get_new_blocks(num_new_blocks) if num_new_blocks > 0 else []
        req_blocks = self.req_to_blocks.setdefault(request.request_id, req_blocks)
        req_blocks.extend(computed_blocks)
        req_blocks.extend(new_blocks)
        if computed_blocks:
            self.num_cached_blocks[request.request_id] = len(computed_blocks)
        if not delay_cache:
            self.cache_blocks(request, num_total_tokens)
        return [block.block_id for block in new_blocks]

    def cache_blocks(self, request: Request, num_tokens: int) -> None:
        """Hash and cache the request's full blocks of known tokens among its first ``num_tokens``."""
        if not self.enable_prefix_caching:
            return
        num_full_blocks = min(num_tokens, request.num_tokens) // self.block_size
        num_cached_blocks = self.num_cached_blocks.get(request.request_id, 0)
        if num_full_blocks > num_cached_blocks:
            block_hashes = self._block_hashes(request, num_full_blocks * self.block_size)
            self.block_pool.cache_full_blocks(self.req_to_blocks[request.request_id], block_hashes,
                                              num_cached_blocks, num_full_blocks)
            self.num_cached_blocks[request.request_id] = num_full_blocks

    def free(self, request: Request) -> None:
        """Release every block the request holds (it finished or was preempted). Tail blocks are
        freed first so they are evicted before the shared-prefix blocks in front of them."""
        blocks = self.req_to_blocks.pop(request.request_id, [])
        self.block_pool.free_blocks(reversed(blocks))
        self.num_cached_blocks.pop(request.request_id, None)
        # Dropped so a finished request leaves nothing behind; a preempted one rehashes (cheap).
        self.req_to_block_hashes.pop(request.request_id, None)

    def uncache_blocks(self, block_ids) -> None:
        """Forget the prefix-cache entries of these blocks (a failed KV load left them garbage)."""
        self.block_pool.uncache_blocks(block_ids)

    def reset_prefix_cache(self) -> bool:
        """Forget all cached prefixes; refused (False) while any request holds blocks."""
        return self.block_pool.reset_prefix_cache()
