import pytest
from hypothesis import settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from sim.kv import BlockPool, KVCacheManager, OutOfBlocks
from sim.request import Request


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

    def __init__(self):
        super().__init__()
        self.kv = KVCacheManager(24, 4, sharing=self.SHARING)
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
