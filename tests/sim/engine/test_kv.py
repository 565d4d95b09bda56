import pytest
from hypothesis import settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from sim.engine.kv import BlockPool, KVCacheManager, OutOfBlocks
from sim.engine.request import Request


def test_allocate_is_fifo_and_free_returns_to_the_tail():
    pool = BlockPool(6)
    a = pool.allocate(2)
    b = pool.allocate(2)
    assert a == [0, 1] and b == [2, 3]
    pool.free(reversed(a))
    assert pool.free_block_ids() == [4, 5, 1, 0]
    assert pool.allocate(3) == [4, 5, 1]
    assert pool.num_free == 1 and pool.num_used == 5


def test_out_of_blocks_allocates_nothing():
    pool = BlockPool(3)
    pool.allocate(2)
    with pytest.raises(OutOfBlocks):
        pool.allocate(2)
    assert pool.num_free == 1


def test_double_free_is_caught():
    for sharing in (False, True):
        pool = BlockPool(4, sharing=sharing)
        blocks = pool.allocate(2)
        pool.free(blocks)
        with pytest.raises(AssertionError, match="freed twice"):
            pool.free(blocks[:1])


def test_shared_free_block_leaves_the_queue_in_order():
    pool = BlockPool(5, sharing=True)
    blocks = pool.allocate(5)
    pool.free(blocks)                  # queue: 0 1 2 3 4
    pool.share(2)                      # a prefix hit takes block 2 out of the middle
    assert pool.free_block_ids() == [0, 1, 3, 4]
    assert pool.allocate(3) == [0, 1, 3]
    pool.free([2])                     # back at the tail, after 4
    assert pool.free_block_ids() == [4, 2]
    assert pool.allocate(2) == [4, 2]
    assert pool.num_free == 0


def test_manager_grows_tables_as_tokens_are_computed():
    kv = KVCacheManager(10, 4)
    r = Request(0, 0.0, 10, 5)
    assert kv.allocate_slots(r, 5)
    assert len(r.block_table) == 2
    r.num_computed_tokens = 5
    assert kv.allocate_slots(r, 3)           # 8 tokens: still 2 blocks
    assert len(r.block_table) == 2
    assert kv.allocate_slots(r, 4)           # 9 tokens: 3 blocks
    assert len(r.block_table) == 3
    assert not kv.allocate_slots(r, 100)     # would need 23 more: nothing allocated
    assert len(r.block_table) == 3 and kv.num_free_blocks == 7
    # 5 computed + 16 new = 21 tokens = 6 blocks: 3 more, leaving 4 of 7 free
    assert not kv.allocate_slots(r, 16, reserve=5)
    assert len(r.block_table) == 3
    assert kv.allocate_slots(r, 16, reserve=4)
    assert len(r.block_table) == 6 and kv.num_free_blocks == 4
    kv.free(r)
    assert r.block_table == [] and kv.num_free_blocks == 10


class PoolMachine(RuleBasedStateMachine):
    """Random allocate / append / free / cancel / share against a model of ownership."""

    SHARING = True
    KV: dict = {}

    def __init__(self):
        super().__init__()
        self.kv = KVCacheManager(24, 4, sharing=self.SHARING, **self.KV)
        self.reqs: dict[int, Request] = {}
        self.next_id = 0
        self.freed_blocks_log = []

    @rule(prompt=st.integers(1, 40))
    def admit(self, prompt):
        r = Request(self.next_id, 0.0, prompt, 8)
        self.next_id += 1
        if self.kv.allocate_slots(r, prompt):
            r.num_computed_tokens = prompt
            self.reqs[r.req_id] = r
        else:
            assert r.block_table == []

    @precondition(lambda self: self.reqs)
    @rule(data=st.data(), n=st.integers(1, 9))
    def append(self, data, n):
        r = data.draw(st.sampled_from(sorted(self.reqs.values(), key=lambda r: r.req_id)))
        before = list(r.block_table)
        if self.kv.allocate_slots(r, n):
            r.num_computed_tokens += n
            assert r.block_table[: len(before)] == before  # append-only
        else:
            assert r.block_table == before

    @precondition(lambda self: self.reqs)
    @rule(data=st.data())
    def finish_or_cancel(self, data):
        rid = data.draw(st.sampled_from(sorted(self.reqs)))
        r = self.reqs.pop(rid)
        self.kv.free(r)
        assert r.block_table == []

    @precondition(lambda self: self.reqs and self.SHARING)
    @rule(data=st.data())
    def fork(self, data):
        """Share a request's full blocks with a new one (as prefix caching would)."""
        src = data.draw(st.sampled_from(sorted(self.reqs.values(), key=lambda r: r.req_id)))
        full = src.num_computed_tokens // 4
        if not full:
            return
        r = Request(self.next_id, 0.0, full * 4, 8)
        self.next_id += 1
        for b in src.block_table[:full]:
            self.kv.pool.share(b)
        r.block_table = list(src.block_table[:full])
        r.num_computed_tokens = full * 4
        self.reqs[r.req_id] = r

    @precondition(lambda self: self.reqs and self.SHARING)
    @rule(data=st.data(), key=st.integers(0, 3))
    def register(self, data, key):
        """Mark a full block as holding a prefix (few keys: the same prefix computed twice)."""
        r = data.draw(st.sampled_from(sorted(self.reqs.values(), key=lambda r: r.req_id)))
        full = r.num_computed_tokens // 4
        if full:
            self.kv.pool.set_hash(r.block_table[data.draw(st.integers(0, full - 1))], key)

    @invariant()
    def prefix_cache(self):
        pool = self.kv.pool
        holders = [(h, b) for h, b in pool.cached.items()]
        holders += [(h, b) for h, more in pool._more.items() for b in more]
        assert all(pool.block_hash[b] == h for h, b in holders)
        assert sorted(b for _, b in holders) == [b for b in range(pool.num_blocks)
                                                 if pool.block_hash[b] is not None]
        assert all(pool._more.values())

    @invariant()
    def accounting(self):
        pool = self.kv.pool
        refs = {}
        for r in self.reqs.values():
            assert len(set(r.block_table)) == len(r.block_table)  # never twice in one table
            assert len(r.block_table) * 4 >= r.num_computed_tokens
            for b in r.block_table:
                refs[b] = refs.get(b, 0) + 1
        for b in range(pool.num_blocks):
            assert pool.ref_cnt[b] == refs.get(b, 0)
        assert pool.num_free + pool.num_used == pool.num_blocks
        assert pool.num_used == len(refs)
        free = pool.free_block_ids()
        assert len(free) == len(set(free)) == pool.num_free
        assert set(free).isdisjoint(refs)


TestPoolMachine = PoolMachine.TestCase
TestPoolMachine.settings = settings(max_examples=60, stateful_step_count=40, deadline=None)


class PlainPoolMachine(PoolMachine):
    """The same without sharing: the bulk (C-level) allocate and free paths."""

    SHARING = False


TestPlainPoolMachine = PlainPoolMachine.TestCase
TestPlainPoolMachine.settings = settings(max_examples=60, stateful_step_count=40, deadline=None)


# --- vLLM V1's block pool: free-queue order, duplicate holders, caching at allocation ----------
def test_freed_blocks_without_a_cached_prefix_are_reused_first():
    for sharing in (False, True):
        pool = BlockPool(4, sharing=sharing, uncached_first=True)
        a = pool.allocate(2)
        pool.free(reversed(a))                 # tail first: the last block is reused first
        assert pool.free_block_ids() == [1, 0, 2, 3]
        assert pool.allocate(3) == [1, 0, 2]
    # with a cached prefix a block goes to the tail (LRU eviction), the rest to the head
    pool = BlockPool(6, sharing=True, uncached_first=True)
    a = pool.allocate(3)
    pool.set_hash(0, "p0")
    pool.set_hash(1, "p1")
    pool.free(reversed(a))
    assert pool.free_block_ids() == [2, 3, 4, 5, 1, 0]
    pool.share(1)                              # a prefix hit takes block 1 out of the tail
    assert pool.free_block_ids() == [2, 3, 4, 5, 0]
    assert pool.allocate(5) == [2, 3, 4, 5, 0] and pool.cached == {"p1": 1}
    # the older order: every freed block at the tail
    pool = BlockPool(6, sharing=True)
    a = pool.allocate(3)
    pool.set_hash(0, "p0")
    pool.free(reversed(a))
    assert pool.free_block_ids() == [3, 4, 5, 2, 1, 0]


def test_a_prefix_computed_twice_has_two_holders_and_survives_the_first_eviction():
    pool = BlockPool(4, sharing=True, uncached_first=True, duplicates=True)
    a, b = pool.allocate(1), pool.allocate(1)
    pool.set_hash(a[0], "p")
    pool.set_hash(b[0], "p")                   # the same prefix, computed by another request
    assert pool.cached == {"p": 0} and pool.block_hash[1] == "p"
    assert sorted(pool.cached_block_ids()) == [0, 1]
    pool.free(a)
    pool.free(b)                               # both cached: both to the tail, 0 first
    assert pool.allocate(3) == [2, 3, 0]       # evicts block 0's copy ...
    assert pool.cached == {"p": 1}             # ... and block 1 answers lookups now
    # without duplicates only the first holds it: the second is uncached, reused first
    pool = BlockPool(4, sharing=True, uncached_first=True)
    a, b = pool.allocate(1), pool.allocate(1)
    pool.set_hash(a[0], "p")
    pool.set_hash(b[0], "p")
    assert pool.block_hash[1] is None
    pool.free(a)
    pool.free(b)
    assert pool.free_block_ids() == [1, 2, 3, 0]


def _prefixed(rid, prompt, prefix=64):
    r = Request(rid, 0.0, prompt, 8)
    r.shared_prefix = (0, prefix)
    return r


def test_blocks_cached_at_allocation_are_shared_within_the_same_step():
    kv = KVCacheManager(20, 16, prefix_caching=True, register_at_allocation=True)
    a, b = _prefixed(0, 80), _prefixed(1, 80)
    assert kv.allocate_slots(a, 80)
    kv.cache_scheduled(a, 80)                  # a's step is scheduled, not yet run
    hits = kv.match_prefix(b)
    assert hits == a.block_table[:4]           # the 4 blocks of the shared 64-token prefix
    # a token the scheduler has not seen (async scheduling) keeps its block out
    c = Request(2, 0.0, 31, 8)
    c.num_output_tokens = 1                    # 32 tokens: 2 full blocks
    assert kv.allocate_slots(c, 32)
    kv.cache_scheduled(c, 32, num_unknown=1)
    assert c.cached_upto == 1


def test_full_sequence_gate_needs_room_for_every_token_so_far():
    kv = KVCacheManager(10, 4)
    other = Request(0, 0.0, 20, 4)
    assert kv.allocate_slots(other, 20)        # 5 blocks, 5 left
    r = Request(1, 0.0, 30, 4)                 # 8 blocks in all
    assert not kv.allocate_slots(r, 4, full_sequence=True)
    assert r.block_table == []
    assert kv.allocate_slots(r, 4)             # its first chunk alone fits
    kv.free(r)
    r = Request(2, 0.0, 18, 4)                 # 5 blocks: fits, unless 1 must stay free
    assert not kv.allocate_slots(r, 4, reserve=1, full_sequence=True)
    assert kv.allocate_slots(r, 4, full_sequence=True) and len(r.block_table) == 1


class VllmPoolMachine(PoolMachine):
    """vLLM V1's pool: uncached blocks freed to the head, duplicate prefix holders."""

    KV = {"uncached_first": True, "duplicates": True, "prefix_caching": True}


TestVllmPoolMachine = VllmPoolMachine.TestCase
TestVllmPoolMachine.settings = settings(max_examples=60, stateful_step_count=40, deadline=None)


class PlainFrontPoolMachine(PoolMachine):
    """No sharing, freed blocks to the head: the bulk stack paths."""

    SHARING = False
    KV = {"uncached_first": True}


TestPlainFrontPoolMachine = PlainFrontPoolMachine.TestCase
TestPlainFrontPoolMachine.settings = settings(max_examples=60, stateful_step_count=40,
                                              deadline=None)
