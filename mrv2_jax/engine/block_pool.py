"""The pool of KV-cache blocks: reference counts, a free queue, and the prefix-cache index.

A block is either *referenced* (``ref_count > 0``: some running request's KV lives there)
or *free* (in the free queue). A free block may still be *cached*: it holds the KV of a
full block of known tokens and is findable by its hash, so a later request with the same
prefix can reuse it instead of recomputing. Allocation takes the block at the head of the
free queue and drops its cache entry if it had one (eviction).

Free-queue order is the eviction order:
  * uncached free blocks sit at the head (they hold nothing worth keeping), so they are
    handed out before any cached block is evicted;
  * cached free blocks follow in least-recently-freed order; the caller frees a request's
    blocks last-block-first, so the tail of a prefix is evicted before its head (a prefix
    is only useful from its first block on).
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Iterable, Sequence

BlockHash = bytes


def hash_block_tokens(parent_hash: BlockHash | None, token_ids: Sequence[int]) -> BlockHash:
    """Hash of one full block, chained on the hash of the block before it.

    Chaining makes the hash identify the whole prefix up to the end of this block, which
    is what the KV of the block depends on. SHA-256 rather than Python's ``hash`` so that
    crafted prompts cannot collide with another user's prefix.
    """
    digest = hashlib.sha256(parent_hash or b"")
    digest.update(array("q", token_ids).tobytes())
    return digest.digest()


class BlockPool:
    """Owns every KV block id in ``range(num_blocks)``; see the module docstring."""

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.ref_counts = [0] * num_blocks
        self.block_hashes: list[BlockHash | None] = [None] * num_blocks
        # An OrderedDict is a queue with O(1) removal from the middle (a cache hit on a
        # free block takes it out of the queue).
        self._free_queue: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._cached: dict[BlockHash, int] = {}
        self.num_evictions = 0

    @property
    def num_free_blocks(self) -> int:
        return len(self._free_queue)

    @property
    def num_cached_blocks(self) -> int:
        return len(self._cached)

    def free_block_ids(self) -> list[int]:
        """Free blocks in eviction order (next handed out first). For tests and debugging."""
        return list(self._free_queue)

    def allocate(self, num_blocks: int) -> list[int]:
        """Takes ``num_blocks`` blocks off the free queue with a reference each."""
        if num_blocks > len(self._free_queue):
            raise ValueError(
                f"cannot allocate {num_blocks} blocks, only {len(self._free_queue)} free"
            )
        allocated = []
        for _ in range(num_blocks):
            block_id, _ = self._free_queue.popitem(last=False)
            self._drop_cache_entry(block_id)
            self.ref_counts[block_id] = 1
            allocated.append(block_id)
        return allocated

    def touch(self, block_ids: Iterable[int]) -> None:
        """Takes one more reference to each block (used for prefix-cache hits)."""
        for block_id in block_ids:
            if self.ref_counts[block_id] == 0:
                del self._free_queue[block_id]
            self.ref_counts[block_id] += 1

    def free(self, block_ids: Iterable[int]) -> None:
        """Drops one reference from each block; pass them in the order they should be evicted."""
        for block_id in block_ids:
            ref_count = self.ref_counts[block_id] - 1
            if ref_count < 0:
                raise RuntimeError(f"block {block_id} freed more often than referenced")
            self.ref_counts[block_id] = ref_count
            if ref_count == 0:
                self._free_queue[block_id] = None
                if self.block_hashes[block_id] is None:
                    self._free_queue.move_to_end(block_id, last=False)

    def lookup(self, block_hash: BlockHash) -> int | None:
        """The block holding the KV of this hash, if it is cached."""
        return self._cached.get(block_hash)

    def cache_block(self, block_id: int, block_hash: BlockHash) -> bool:
        """Makes a referenced full block findable by hash. False if the hash is already
        cached in another block (two requests computed the same prefix at once): the
        first copy stays the canonical one and this block stays private."""
        if self.ref_counts[block_id] == 0:
            raise RuntimeError(f"block {block_id} must be referenced to be cached")
        if block_hash in self._cached or self.block_hashes[block_id] is not None:
            return False
        self._cached[block_hash] = block_id
        self.block_hashes[block_id] = block_hash
        return True

    def reset_prefix_cache(self) -> None:
        """Forgets every cached hash (e.g. after new weights make cached KV stale).
        Blocks in use keep their data; they are just no longer found by later requests."""
        for block_id in self._cached.values():
            self.block_hashes[block_id] = None
            if self.ref_counts[block_id] == 0:
                # Now worthless: hand it out before any block that is still cached.
                self._free_queue.move_to_end(block_id, last=False)
        self._cached.clear()

    def _drop_cache_entry(self, block_id: int) -> None:
        block_hash = self.block_hashes[block_id]
        if block_hash is not None:
            del self._cached[block_hash]
            self.block_hashes[block_id] = None
            self.num_evictions += 1
