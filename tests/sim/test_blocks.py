"""sim/_blocks.c, the compiled build's bulk moves of the block pool, against the Python they
stand in for (BlockPool.allocate's slices and counts, BlockPool._release): the same pool state,
the same errors. (tests/test_compiled.py compares whole runs, compiled and pure.)"""

from contextlib import contextmanager

import pytest
from hypothesis import given, settings, strategies as st

from sim import _compiled

from sim.engine import kv
from sim.engine.kv import BlockPool, OutOfBlocks

blocks = kv._BLOCKS
needs_c = pytest.mark.skipif(blocks is None, reason="no compiled build (pure Python)")


@contextmanager
def in_python():
    """The pool's moves in Python while inside (sim.engine.kv reads its C functions at each move)."""
    saved = kv._take, kv._release_c
    kv._take = kv._release_c = None
    try:
        yield
    finally:
        kv._take, kv._release_c = saved


def state(pool: BlockPool):
    return (pool.ref_cnt, pool._front, pool._queue[pool._head:], pool.num_free)


@needs_c
def test_the_compiled_build_uses_it():
    assert _compiled.COMPILED and blocks is not None


@settings(max_examples=150, deadline=None)
@given(num=st.integers(1, 200), first=st.booleans(), data=st.data())
def test_allocate_and_free_match_python(num, first, data):
    # The same random sequence of allocations and frees on two pools, one moving blocks in C
    # (where built) and one in Python: the same blocks handed out, the same queue after.
    c_pool = BlockPool(num, uncached_first=first)
    py_pool = BlockPool(num, uncached_first=first)
    held: list[list[int]] = []
    for _ in range(data.draw(st.integers(1, 30))):
        if held and data.draw(st.booleans()):
            table = held.pop(data.draw(st.integers(0, len(held) - 1)))
            c_pool.free_table(list(table))
            with in_python():
                py_pool.free_table(list(table))
        else:
            n = data.draw(st.integers(0, num))
            try:
                got = c_pool.allocate(n)
            except OutOfBlocks:
                got = None
            with in_python():
                try:
                    want = py_pool.allocate(n)
                except OutOfBlocks:
                    want = None
            assert got == want
            if got:
                held.append(got)
        assert state(c_pool) == state(py_pool)
        assert c_pool._head == py_pool._head


@needs_c
@given(n=st.integers(1, 40), data=st.data())
def test_release_of_a_block_not_held_once_changes_nothing(n, data):
    # A table with a block already free, or a block twice: AssertionError naming the block
    # met first from the tail, and every count as it was (as BlockPool._release does).
    pool = BlockPool(64)
    table = pool.allocate(n)
    bad = data.draw(st.sampled_from(["free", "twice"]))
    i = data.draw(st.integers(0, n - 1))
    if bad == "free":
        pool.ref_cnt[table[i]] = 0
    else:
        table.insert(data.draw(st.integers(0, n)), table[i])
    py = BlockPool(64)
    py.ref_cnt = list(pool.ref_cnt)
    before = list(pool.ref_cnt)
    with pytest.raises(AssertionError) as c_err:
        blocks.release(pool.ref_cnt, table)
    with pytest.raises(AssertionError) as py_err:
        py._release(table)
    assert str(c_err.value) == str(py_err.value)
    assert pool.ref_cnt == before == py.ref_cnt


@needs_c
def test_bad_arguments_raise_not_crash():
    ref = [0] * 4
    with pytest.raises(IndexError):  # a block outside the pool: nothing changed
        blocks.take([], [0, 9], 0, 2, ref)
    assert ref == [0] * 4
    with pytest.raises(ValueError):  # more than the queue holds
        blocks.take([], [0, 1], 1, 2, ref)
    with pytest.raises(IndexError):
        blocks.release([1, 1], [0, -1])
    with pytest.raises(TypeError):
        blocks.release((1,), [0])
    with pytest.raises(TypeError):
        blocks.take([], [0], 0, 1)


@needs_c
@settings(max_examples=300, deadline=None)
@given(k=st.integers(1, 300), bs=st.sampled_from([1, 2, 4, 16, 32]), data=st.data())
def test_crossings_equal_crossing_order(k, bs, data):
    # A decode run's block crossings in allocation order: C (one sort of every crossing)
    # against the Python (its one-block and round-robin shortcuts), for batches whose first
    # crossings lie within one block's span (the usual case) and spread wide (reservations).
    from sim.engine import stepping
    span = data.draw(st.sampled_from([bs, 4 * bs + 3, 400]))
    first = data.draw(st.lists(st.integers(1, span), max_size=40))
    assert blocks.crossings(first, k, bs) == stepping.crossing_order(first, k, bs)


@needs_c
def test_deal_appends_each_block_to_its_request():
    class Req:
        def __init__(self):
            self.block_table = [7]

    reqs = [Req(), Req(), Req()]
    blocks.deal(reqs, [2, 0, 2], [10, 11, 12])
    assert [r.block_table for r in reqs] == [[7, 11], [7], [7, 10, 12]]
    with pytest.raises(IndexError):
        blocks.deal(reqs, [3], [1])
    with pytest.raises(TypeError):
        blocks.deal(reqs, [0, 1], [1])
    with pytest.raises(ValueError):
        blocks.crossings([0], 4, 16)  # (a table holds the run's first token: j0 >= 1)


@needs_c
def test_hostile_arguments_raise_not_crash():
    # Out-of-range sizes (overflowing C arithmetic), lists changed by the Python code a call
    # would run, and counts that are not ints: an exception each, never a crash.
    with pytest.raises(ValueError):
        blocks.take([], [0], 2**63 - 1, 1, [0])
    with pytest.raises((ValueError, OverflowError, MemoryError)):
        blocks.crossings([1, 1, 1, 1], 2**62 + 2, 1)
    front = [0]
    with pytest.raises(ValueError):  # the counts aliasing a queue
        blocks.take(front, [], 0, 1, front)

    class Index:
        def __index__(self):
            ref.clear()
            return 1

    ref = [Index(), Index()]
    with pytest.raises(TypeError):  # a count that is not an int: refused before any change
        blocks.release(ref, [0, 1])
    with pytest.raises(TypeError):
        blocks.crossings([1, Index()], 4, 16)
    with pytest.raises(AssertionError, match="block 0 freed twice"):
        blocks.release([2**70, 1], [0, 1])  # (a count too large for C: not 1)

    order, taken = [0, 0, 0], [5, 6, 7]

    class Req:
        @property
        def block_table(self):
            order.clear()
            taken.clear()
            return self.table

    r = Req()
    r.table = []
    blocks.deal([r], order, taken)  # (the lists shrank under the call: it stops there)
    assert r.table == [5]
