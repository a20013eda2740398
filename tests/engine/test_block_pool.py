"""Block pool and KV cache manager: reference counts, prefix caching, eviction order.

The stateful test keeps an independent shadow of what each block holds (the exact token
prefix whose KV was written there), so a prefix-cache hit on wrong content, a write into
a shared block, or a leaked reference is caught without trusting the manager's hashes.
"""

from dataclasses import dataclass

import hypothesis.strategies as st
from hypothesis import HealthCheck, settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from mrv2_jax.engine.block_pool import BlockPool, hash_block_tokens
from mrv2_jax.engine.kv_cache_manager import KVCacheManager

BLOCK_SIZE = 4


@dataclass
class FakeRequest:
    request_id: str
    all_token_ids: list[int]
    num_computed_tokens: int = 0

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    def token_ids_between(self, start: int, end: int) -> list[int]:
        return self.all_token_ids[start:end]


def admit(manager: KVCacheManager, request: FakeRequest, num_new: int | None = None):
    """Prefix lookup + first allocation, as the scheduler does it. Returns hit tokens."""
    hits, num_hit = manager.get_computed_blocks(request)
    if num_new is None:
        num_new = request.num_tokens - num_hit
    if manager.allocate_slots(request, num_new, hits) is None:
        return None
    request.num_computed_tokens = num_hit + num_new
    return num_hit


# ---- property-based: random allocate / compute / append / fork / free sequences ----------

# Few distinct tokens and shared stems make prefix sharing frequent.
STEMS = [[1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12], [1, 2, 3, 4, 9, 9, 9, 9, 2, 2], [5] * 12]


class KVCacheMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.manager = KVCacheManager(num_blocks=12, block_size=BLOCK_SIZE)
        self.live: dict[str, FakeRequest] = {}
        self.next_id = 0
        # block id -> the token prefix whose KV fills it, or None if not full/unknown.
        self.shadow: dict[int, tuple[int, ...] | None] = {}

    # -- helpers --
    def _write_kv(self, request: FakeRequest, start: int, end: int) -> None:
        """Plays the model: writes KV for positions [start, end) of the request."""
        blocks = self.manager.get_block_ids(request.request_id)
        assert len(blocks) == -(-end // BLOCK_SIZE)
        for position in range(start, end):
            block = blocks[position // BLOCK_SIZE]
            # Writing into a block someone else also reads would corrupt their KV.
            assert self.manager.pool.ref_counts[block] == 1, "write into a shared block"
            block_end = (position // BLOCK_SIZE + 1) * BLOCK_SIZE
            full = position == block_end - 1
            self.shadow[block] = tuple(request.all_token_ids[:block_end]) if full else None

    def _new_request(self, tokens: list[int], chunk: int) -> None:
        request = FakeRequest(f"r{self.next_id}", tokens)
        self.next_id += 1
        free_before = self.manager.num_free_blocks
        refs_before = list(self.manager.pool.ref_counts)
        hits, num_hit = self.manager.get_computed_blocks(request)
        assert num_hit < request.num_tokens, "the last token must always be recomputed"
        for index, block in enumerate(hits):
            assert self.shadow.get(block) == tuple(tokens[:(index + 1) * BLOCK_SIZE])
        num_new = min(chunk, request.num_tokens - num_hit)
        new_blocks = self.manager.allocate_slots(request, num_new, hits)
        if new_blocks is None:
            assert self.manager.num_free_blocks == free_before
            assert self.manager.pool.ref_counts == refs_before
            self.manager.free(request)  # drops the lookup's hash memo; holds no blocks
            return
        for block in new_blocks:
            assert refs_before[block] == 0, "handed out a referenced block"
        request.num_computed_tokens = num_hit + num_new
        self.live[request.request_id] = request
        self._write_kv(request, num_hit, num_hit + num_new)

    def _snapshot(self, request: FakeRequest):
        pool = self.manager.pool
        return (self.manager.get_block_ids(request.request_id), dict(self.manager._num_cached_blocks),
                list(pool.ref_counts), pool.free_block_ids(), dict(pool._cached), list(pool.block_hashes))

    # -- rules --
    @rule(stem=st.sampled_from(STEMS), cut=st.integers(0, 12),
          tail=st.lists(st.integers(0, 3), max_size=6), chunk=st.integers(1, 20))
    def add(self, stem, cut, tail, chunk):
        tokens = stem[:cut] + tail
        if tokens:
            self._new_request(tokens, chunk)

    @precondition(lambda self: self.live)
    @rule(data=st.data(), tail=st.lists(st.integers(0, 3), max_size=4), chunk=st.integers(1, 20))
    def fork(self, data, tail, chunk):
        """A new request sharing a prefix of a live one (e.g. the same system prompt)."""
        parent = self.live[data.draw(st.sampled_from(sorted(self.live)))]
        cut = data.draw(st.integers(1, parent.num_computed_tokens or 1))
        self._new_request(parent.all_token_ids[:cut] + tail, chunk)

    @precondition(lambda self: self.live)
    @rule(data=st.data(), chunk=st.integers(1, 8), token=st.integers(0, 3))
    def step(self, data, chunk, token):
        """Compute the next prefill chunk, or append a sampled token and decode it."""
        request = self.live[data.draw(st.sampled_from(sorted(self.live)))]
        if request.num_computed_tokens == request.num_tokens:
            request.all_token_ids.append(token)
            chunk = 1
        chunk = min(chunk, request.num_tokens - request.num_computed_tokens)
        free_before = self.manager.num_free_blocks
        # Below the manager's `no_change_below` (the scheduler then skips the call) the call changes nothing.
        skippable = request.num_computed_tokens + chunk < self.manager.no_change_below[request.request_id]
        before = self._snapshot(request)
        new_blocks = self.manager.allocate_slots(request, chunk)
        if skippable:
            assert new_blocks == [] and self._snapshot(request) == before
        if new_blocks is None:
            assert self.manager.num_free_blocks == free_before
            return
        start = request.num_computed_tokens
        request.num_computed_tokens += chunk
        self._write_kv(request, start, request.num_computed_tokens)

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def free(self, data):
        request = self.live.pop(data.draw(st.sampled_from(sorted(self.live))))
        self.manager.free(request)

    @rule()
    def reset_cache(self):
        self.manager.reset_prefix_cache()

    # -- invariants --
    @invariant()
    def reference_counts_match_holders(self):
        pool = self.manager.pool
        expected = [0] * pool.num_blocks
        for request in self.live.values():
            blocks = self.manager.get_block_ids(request.request_id)
            assert len(set(blocks)) == len(blocks)
            assert len(blocks) == -(-request.num_computed_tokens // BLOCK_SIZE)
            for block in blocks:
                expected[block] += 1
        assert pool.ref_counts == expected
        free = pool.free_block_ids()
        assert len(set(free)) == len(free)
        assert set(free) == {b for b in range(pool.num_blocks) if expected[b] == 0}

    @invariant()
    def no_change_below_is_kept_for_the_holders_only(self):
        assert set(self.manager.no_change_below) == {r for r in self.live if self.manager.get_block_ids(r)}

    @invariant()
    def cache_index_is_consistent(self):
        pool = self.manager.pool
        for block_hash, block in pool._cached.items():
            assert pool.block_hashes[block] == block_hash
        assert sum(h is not None for h in pool.block_hashes) == pool.num_cached_blocks

    def teardown(self):
        for request in self.live.values():
            self.manager.free(request)
        assert self.manager.num_free_blocks == self.manager.num_blocks
        assert all(count == 0 for count in self.manager.pool.ref_counts)
        assert self.manager.usage == 0.0


TestKVCacheMachine = KVCacheMachine.TestCase
TestKVCacheMachine.settings = settings(
    max_examples=150, stateful_step_count=40, deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)


# ---- hashing -----------------------------------------------------------------------------

def test_block_hash_is_chained_on_the_parent():
    first = hash_block_tokens(None, [1, 2, 3, 4])
    assert first == hash_block_tokens(None, [1, 2, 3, 4])
    assert hash_block_tokens(first, [5, 6, 7, 8]) != hash_block_tokens(None, [5, 6, 7, 8])
    other_parent = hash_block_tokens(None, [1, 2, 3, 9])
    assert hash_block_tokens(first, [5, 6, 7, 8]) != hash_block_tokens(other_parent, [5, 6, 7, 8])


def test_same_block_after_a_different_prefix_is_not_a_hit():
    manager = KVCacheManager(num_blocks=10, block_size=BLOCK_SIZE)
    admit(manager, FakeRequest("a", [1, 2, 3, 4, 5, 6, 7, 8, 0]))
    # Block 1 is identical, block 0 differs: the chain breaks at block 0, nothing hits.
    assert admit(manager, FakeRequest("b", [9, 9, 9, 9, 5, 6, 7, 8, 0])) == 0
    # The full shared prefix hits both blocks.
    assert admit(manager, FakeRequest("c", [1, 2, 3, 4, 5, 6, 7, 8, 3])) == 8


def test_fully_cached_prompt_recomputes_its_last_token():
    manager = KVCacheManager(num_blocks=10, block_size=BLOCK_SIZE)
    prompt = [1, 2, 3, 4, 5, 6, 7, 8]
    admit(manager, FakeRequest("a", list(prompt)))
    again = FakeRequest("b", list(prompt))
    hits, num_hit = manager.get_computed_blocks(again)
    assert num_hit == 4  # the second block holds the last token, which must be computed
    assert hits == manager.get_block_ids("a")[:1]
    assert admit(manager, FakeRequest("c", prompt + [9])) == 8


def test_only_final_tokens_are_cached():
    """KV scheduled for positions whose tokens are not known yet (async placeholders)
    must not be cached until those tokens arrive."""
    manager = KVCacheManager(num_blocks=10, block_size=BLOCK_SIZE)
    request = FakeRequest("a", [1, 2, 3])
    admit(manager, request)
    # Decode with the sampled token still in flight: position 3 is a placeholder.
    assert manager.allocate_slots(request, 1) == []
    request.num_computed_tokens = 4
    assert manager.pool.num_cached_blocks == 0
    request.all_token_ids.append(7)  # the value arrives
    manager.allocate_slots(request, 1)  # next decode
    assert manager.pool.num_cached_blocks == 1
    assert admit(manager, FakeRequest("b", [1, 2, 3, 7, 0])) == 4


# ---- allocation, eviction ----------------------------------------------------------------

def test_failed_allocation_changes_nothing():
    manager = KVCacheManager(num_blocks=4, block_size=BLOCK_SIZE)
    admit(manager, FakeRequest("a", [1, 2, 3, 4, 5]))
    manager.free(FakeRequest("a", []))  # block [1,2,3,4] stays cached, free
    big = FakeRequest("b", [1, 2, 3, 4] + [0] * 13)  # 1 hit + 4 new blocks > 4 free - 1
    hits, num_hit = manager.get_computed_blocks(big)
    assert num_hit == 4
    assert manager.allocate_slots(big, big.num_tokens - num_hit, hits) is None
    assert manager.num_free_blocks == 4 and manager.pool.num_cached_blocks == 1
    assert manager.get_block_ids("b") == []
    assert manager.get_computed_blocks(FakeRequest("c", [1, 2, 3, 4, 5]))[1] == 4


def test_lru_eviction_order():
    manager = KVCacheManager(num_blocks=6, block_size=BLOCK_SIZE)
    requests = {
        name: FakeRequest(name, [base + i for i in range(8)] + [0])
        for name, base in (("a", 10), ("b", 20), ("c", 30))
    }
    for request in requests.values():
        admit(manager, request, num_new=8)  # two full, cached blocks each
    blocks = {name: manager.get_block_ids(name) for name in requests}
    for request in requests.values():  # freed a, then b, then c
        manager.free(request)
    # Least recently freed first; within a request its last block first.
    order = manager.pool.free_block_ids()
    assert order == [blocks["a"][1], blocks["a"][0], blocks["b"][1], blocks["b"][0],
                     blocks["c"][1], blocks["c"][0]]
    # Taking two blocks evicts all of a's prefix; b and c still hit.
    admit(manager, FakeRequest("d", [99] * 8), num_new=8)
    assert manager.pool.num_evictions == 2
    def num_hit(name):
        return manager.get_computed_blocks(FakeRequest(name + "2", requests[name].all_token_ids))[1]

    assert (num_hit("a"), num_hit("b"), num_hit("c")) == (0, 8, 8)


def test_uncached_free_blocks_are_used_before_evicting():
    manager = KVCacheManager(num_blocks=2, block_size=BLOCK_SIZE)
    cached, uncached = FakeRequest("a", [1, 2, 3, 4, 0]), FakeRequest("b", [5, 6])
    admit(manager, cached, num_new=4)  # one full block, cached
    admit(manager, uncached)  # one partial block, not cached
    manager.free(cached)
    manager.free(uncached)  # freed later, yet it must be handed out first
    admit(manager, FakeRequest("c", [7]))
    assert manager.pool.num_evictions == 0
    assert manager.get_computed_blocks(FakeRequest("d", [1, 2, 3, 4, 5]))[1] == 4


def test_hit_on_a_free_cached_block_counts_against_free_space():
    pool = BlockPool(3)
    (block,) = pool.allocate(1)
    assert pool.cache_block(block, b"h")
    pool.free([block])
    assert pool.num_free_blocks == 3
    pool.touch([block])  # a cache hit revives it
    assert pool.num_free_blocks == 2 and pool.ref_counts[block] == 1
    assert pool.lookup(b"h") == block
    assert not pool.cache_block(pool.allocate(1)[0], b"h")  # duplicate content stays private


def test_usage_hit_counters_and_reset():
    manager = KVCacheManager(num_blocks=8, block_size=BLOCK_SIZE)
    admit(manager, FakeRequest("a", list(range(9))))
    assert manager.usage == 3 / 8
    admit(manager, FakeRequest("b", list(range(8)) + [42]))
    assert manager.prefix_cache_queries == 18 and manager.prefix_cache_hits == 8
    assert manager.prefix_cache_hit_rate == 8 / 18
    manager.reset_prefix_cache()
    assert manager.pool.num_cached_blocks == 0
    assert admit(manager, FakeRequest("c", list(range(9)))) == 0


def test_prefix_caching_off_never_hits():
    manager = KVCacheManager(num_blocks=8, block_size=BLOCK_SIZE, enable_prefix_caching=False)
    admit(manager, FakeRequest("a", list(range(9))))
    assert admit(manager, FakeRequest("b", list(range(9)))) == 0
    assert manager.pool.num_cached_blocks == 0 and manager.prefix_cache_queries == 0
