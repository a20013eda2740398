"""Which KV blocks each request holds, and the prefix cache on top of the block pool.

A request's KV lives in a list of blocks (its block table): token at position ``p`` is in
block ``blocks[p // block_size]`` at offset ``p % block_size``. The manager grows that list
as the scheduler schedules more tokens, shares full blocks between requests whose prefixes
are identical (prefix caching), and returns the blocks to the pool when the request ends.

Only blocks whose tokens are all *final* are ever cached: prompt tokens and output tokens
whose values the host has received. A block that contains an async placeholder is cached
later, on a following allocation, once its tokens are known.

A block is cached as soon as its KV is *scheduled*, so a request admitted later in the
same step may hit it. That is safe because each attention layer writes the whole step's
K/V into the cache before it reads the cache (``write_kv`` runs before the attention
kernel), and steps run on the device in the order they were scheduled.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from mrv2_jax.engine.block_pool import BlockHash, BlockPool, hash_block_tokens


class _RequestView(Protocol):
    """What the manager reads from a request (``engine.request.Request`` provides it)."""

    request_id: str
    num_computed_tokens: int

    @property
    def num_tokens(self) -> int: ...

    def token_ids_between(self, start: int, end: int) -> list[int]: ...


class KVCacheManager:
    """Allocates, shares and frees KV blocks for requests.

    Prefix-cache counters are in tokens: ``prefix_cache_queries`` counts the tokens of
    every admitted request (including requests resumed after preemption) and
    ``prefix_cache_hits`` the tokens among them served from the cache.
    """

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.pool = BlockPool(num_blocks)
        self._blocks: dict[str, list[int]] = {}
        # Chained hashes of the request's full blocks of known tokens, extended lazily.
        self._hashes: dict[str, list[BlockHash]] = {}
        # How many of the request's leading blocks have been offered to the cache.
        self._num_cached_blocks: dict[str, int] = {}
        # Per request holding blocks: a scheduled end (computed tokens + new ones) below which
        # `allocate_slots` would change nothing, so that the scheduler may skip the call: the end
        # fits the blocks held and fills no block that has not been offered to the prefix cache.
        self.no_change_below: dict[str, int] = {}
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0

    # ---- queries -------------------------------------------------------------------------

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def usage(self) -> float:
        """Fraction of blocks referenced by requests (cached free blocks count as free)."""
        return 1.0 - self.pool.num_free_blocks / self.pool.num_blocks

    @property
    def prefix_cache_hit_rate(self) -> float:
        if self.prefix_cache_queries == 0:
            return 0.0
        return self.prefix_cache_hits / self.prefix_cache_queries

    def get_block_ids(self, request_id: str) -> list[int]:
        """A copy of the request's block table (empty if it holds no blocks)."""
        return list(self._blocks.get(request_id, ()))

    def num_blocks_to_grow(self, request: _RequestView, num_new_tokens: int) -> int:
        """Blocks that ``allocate_slots(request, num_new_tokens)`` would take for a request
        that already holds blocks."""
        num_scheduled_end = request.num_computed_tokens + num_new_tokens
        return max(0, -(-num_scheduled_end // self.block_size) - len(self._blocks.get(request.request_id, ())))

    def get_computed_blocks(self, request: _RequestView) -> tuple[list[int], int]:
        """The longest cached prefix of a request that holds no blocks yet.

        Returns the cached block ids (not yet referenced: pass them to ``allocate_slots``)
        and the number of tokens they cover. At least the last token is always left to
        compute, so the step that finishes the prefill has a logit to sample from.
        """
        if not self.enable_prefix_caching:
            return [], 0
        params = getattr(request, "sampling_params", None)
        if params is not None and params.prompt_logprobs is not None:
            return [], 0  # as vLLM: cached positions would have no logits to return
        hashes = self._block_hashes(request)
        max_hit_blocks = (request.num_tokens - 1) // self.block_size
        hit_blocks = []
        for block_hash in hashes[:max_hit_blocks]:
            block_id = self.pool.lookup(block_hash)
            if block_id is None:
                break
            hit_blocks.append(block_id)
        return hit_blocks, len(hit_blocks) * self.block_size

    # ---- updates -------------------------------------------------------------------------

    def allocate_slots(
        self,
        request: _RequestView,
        num_new_tokens: int,
        new_computed_blocks: Sequence[int] = (),
        num_lookahead_tokens: int = 0,
    ) -> list[int] | None:
        """Makes room for ``num_new_tokens`` more tokens after the computed ones.

        ``new_computed_blocks`` (prefix-cache hits from ``get_computed_blocks``) may only be
        given on a request's first allocation. Returns the newly allocated block ids, which
        the request's block table now ends with (hit blocks are not among them), or None if
        the pool is too small; on None nothing has changed. ``num_lookahead_tokens`` more
        slots are kept allocated past them (speculative decoding writes draft KV there) but are
        not scheduled: they never make a block count as computed for the prefix cache.
        """
        held = self._blocks.get(request.request_id)
        if held is None:
            return self._allocate_first(request, num_new_tokens, new_computed_blocks, num_lookahead_tokens)
        if new_computed_blocks:
            raise ValueError(f"request {request.request_id!r} already holds blocks; cache "
                             "hits can only be taken at its first allocation")
        # The common case, a running request growing: usually no new block at all. (This runs once per
        # running request every step: plain arithmetic, no builtin calls it can do without.)
        num_scheduled_end = request.num_computed_tokens + num_new_tokens
        size = self.block_size
        num_to_allocate = (num_scheduled_end + num_lookahead_tokens + size - 1) // size - len(held)
        if num_to_allocate > 0:
            if num_to_allocate > self.pool.num_free_blocks:
                return None
            new_blocks = self.pool.allocate(num_to_allocate)
            held.extend(new_blocks)
        else:
            new_blocks = []
        # Most decode steps fill no block: skip the call unless one may have become full.
        if self.enable_prefix_caching:
            num_known = request.num_tokens
            num_final = num_scheduled_end if num_scheduled_end < num_known else num_known
            if num_final // size > self._num_cached_blocks[request.request_id]:
                self._cache_final_blocks(request, num_scheduled_end)
        self._set_no_change_below(request.request_id, held)
        return new_blocks

    def _allocate_first(
        self, request: _RequestView, num_new_tokens: int, hit_blocks: Sequence[int], num_lookahead_tokens: int = 0
    ) -> list[int] | None:
        num_hit_tokens = len(hit_blocks) * self.block_size
        num_scheduled_end = num_hit_tokens + num_new_tokens
        num_to_allocate = -(-(num_scheduled_end + num_lookahead_tokens) // self.block_size) - len(hit_blocks)
        # A hit on a free cached block takes that block out of the free queue.
        num_hits_on_free = sum(1 for b in hit_blocks if self.pool.ref_counts[b] == 0)
        if num_to_allocate > self.pool.num_free_blocks - num_hits_on_free:
            return None
        # Reference the hits first so that allocating cannot evict them.
        self.pool.touch(hit_blocks)
        new_blocks = self.pool.allocate(num_to_allocate)
        self._blocks[request.request_id] = list(hit_blocks) + new_blocks
        self._num_cached_blocks[request.request_id] = len(hit_blocks)
        if self.enable_prefix_caching:
            self.prefix_cache_queries += request.num_tokens
            self.prefix_cache_hits += num_hit_tokens
            self._cache_final_blocks(request, num_scheduled_end)
        self._set_no_change_below(request.request_id, self._blocks[request.request_id])
        return new_blocks

    def free(self, request: _RequestView) -> None:
        """Returns all of the request's blocks to the pool (no-op if it holds none)."""
        request_id = request.request_id
        blocks = self._blocks.pop(request_id, [])
        self._hashes.pop(request_id, None)
        self._num_cached_blocks.pop(request_id, None)
        self.no_change_below.pop(request_id, None)
        # Last block first: the tail of a prefix should be evicted before its head.
        self.pool.free(reversed(blocks))

    def reset_prefix_cache(self) -> None:
        """Forgets all cached prefixes; later requests recompute them."""
        self.pool.reset_prefix_cache()

    # ---- internals -----------------------------------------------------------------------

    def _set_no_change_below(self, request_id: str, held: list[int]) -> None:
        # An end E needs no block while E <= len(held) * size, and offers no block to the cache while
        # min(E, known tokens) // size <= the blocks offered, which E < (offered + 1) * size ensures.
        limit = len(held) * self.block_size + 1
        if self.enable_prefix_caching:
            limit = min(limit, (self._num_cached_blocks[request_id] + 1) * self.block_size)
        self.no_change_below[request_id] = limit

    def _block_hashes(self, request: _RequestView) -> list[BlockHash]:
        """Hashes of the request's full blocks of known tokens, extended incrementally."""
        hashes = self._hashes.setdefault(request.request_id, [])
        size = self.block_size
        parent = hashes[-1] if hashes else None
        for index in range(len(hashes), request.num_tokens // size):
            parent = hash_block_tokens(parent, request.token_ids_between(index * size, (index + 1) * size))
            hashes.append(parent)
        return hashes

    def _cache_final_blocks(self, request: _RequestView, num_scheduled_end: int) -> None:
        """Offers to the cache every full block whose KV is scheduled and whose tokens are
        known. Its KV may be written by a step still in flight, but any step that reads it
        for another request runs later on the device, so it will be there."""
        request_id = request.request_id
        num_final_tokens = min(num_scheduled_end, request.num_tokens)
        num_full_blocks = num_final_tokens // self.block_size
        first = self._num_cached_blocks[request_id]
        if num_full_blocks <= first:
            return
        hashes = self._block_hashes(request)
        blocks = self._blocks[request_id]
        for index in range(first, num_full_blocks):
            self.pool.cache_block(blocks[index], hashes[index])
        self._num_cached_blocks[request_id] = num_full_blocks
