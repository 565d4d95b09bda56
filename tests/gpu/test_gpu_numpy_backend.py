"""NumPy kernels against the dense float64 reference, on scattered pools poisoned with NaN."""

import math

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import gpu
from gpu import numpy_backend
from gpu.reference import dense_attention
from gpu.synthetic import random_paged_batch, random_values

TOLERANCE = {"float32": 1e-5, "float16": 2e-3}
DTYPES = {"float32": np.float32, "float16": np.float16}


@st.composite
def shapes(draw):
    block_size = draw(st.sampled_from([8, 16, 32]))
    # Lengths include 1, exact block multiples, and odd ones.
    length = st.one_of(st.just(1), st.sampled_from([block_size, 2 * block_size, 3 * block_size]),
                       st.integers(1, 5 * block_size))
    return {
        "group": draw(st.sampled_from([1, 2, 4, 8])),
        "num_kv_heads": draw(st.sampled_from([1, 2])),
        "head_dim": draw(st.sampled_from([32, 64, 128])),
        "block_size": block_size,
        "seq_lens": draw(st.lists(length, min_size=1, max_size=5)),
        "dtype": draw(st.sampled_from(["float32", "float16"])),
        "seed": draw(st.integers(0, 2**32 - 1)),
    }


# Small tiles force the multi-tile online softmax.
TILINGS = {"one_tile": {}, "many_tiles": {"TILE_BYTES": 1 << 12}}


@pytest.fixture(params=sorted(TILINGS))
def tiling(request):
    saved = {name: getattr(numpy_backend, name) for name in TILINGS[request.param]}
    for name, value in TILINGS[request.param].items():
        setattr(numpy_backend, name, value)
    yield request.param
    for name, value in saved.items():
        setattr(numpy_backend, name, value)


def relative_error(got, ref):
    return float(np.abs(got.astype(np.float64) - ref).max() / max(np.abs(ref).max(), 1e-30))


def batch_for(c, rng):
    return random_paged_batch(rng, c["seq_lens"], block_size=c["block_size"], num_kv_heads=c["num_kv_heads"],
                              head_dim=c["head_dim"], storage_name=c["dtype"])


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(c=shapes())
def test_decode_matches_dense_reference(c, tiling):
    rng = np.random.default_rng(c["seed"])
    batch = batch_for(c, rng)
    num_heads = c["num_kv_heads"] * c["group"]
    q = random_values(rng, (len(c["seq_lens"]), num_heads, c["head_dim"]), c["dtype"])
    out = np.full_like(q, np.nan)
    got = gpu.paged_decode_attention(q, batch.k_cache, batch.v_cache, batch.block_tables, batch.seq_lens, out=out)
    assert got is out and not np.isnan(out).any()
    for s in range(len(c["seq_lens"])):
        k, v = batch.contiguous(s)
        ref = dense_attention(q[s:s + 1], k, v)[0]
        assert relative_error(out[s], ref) < TOLERANCE[c["dtype"]]


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(c=shapes(), data=st.data())
def test_prefill_matches_dense_causal_reference(c, data, tiling):
    rng = np.random.default_rng(c["seed"])
    batch = batch_for(c, rng)
    # Each chunk is the tail of its sequence; what precedes it is cached context.
    q_lens = [data.draw(st.integers(1, n)) for n in c["seq_lens"]]
    cu = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    num_heads = c["num_kv_heads"] * c["group"]
    q = random_values(rng, (int(cu[-1]), num_heads, c["head_dim"]), c["dtype"])
    out = np.full_like(q, np.nan)
    gpu.paged_prefill_attention(q, batch.k_cache, batch.v_cache, batch.block_tables, cu, batch.seq_lens, out=out)
    assert not np.isnan(out).any()
    for s in range(len(q_lens)):
        k, v = batch.contiguous(s)
        ref = dense_attention(q[cu[s]:cu[s + 1]], k, v)
        assert relative_error(out[cu[s]:cu[s + 1]], ref) < TOLERANCE[c["dtype"]]


def test_prefill_of_whole_prompt_equals_decode_at_each_position():
    rng = np.random.default_rng(3)
    batch = random_paged_batch(rng, [37], block_size=8, num_kv_heads=2, head_dim=32)
    q = random_values(rng, (37, 4, 32), "float32")
    prefill = gpu.paged_prefill_attention(q, batch.k_cache, batch.v_cache, batch.block_tables,
                                          np.array([0, 37], dtype=np.int32), batch.seq_lens)
    for p in (0, 7, 8, 36):
        decode = gpu.paged_decode_attention(q[p:p + 1], batch.k_cache, batch.v_cache, batch.block_tables,
                                            np.array([p + 1], dtype=np.int32))
        np.testing.assert_allclose(prefill[p], decode[0], rtol=1e-5, atol=1e-6)


def test_decode_with_zero_length_sequence_gives_zeros():
    rng = np.random.default_rng(4)
    batch = random_paged_batch(rng, [5, 3], block_size=4, num_kv_heads=1, head_dim=32)
    q = random_values(rng, (2, 2, 32), "float32")
    out = gpu.paged_decode_attention(q, batch.k_cache, batch.v_cache, batch.block_tables,
                                     np.array([5, 0], dtype=np.int32))
    assert np.all(out[1] == 0) and np.isfinite(out[0]).all()


@pytest.mark.parametrize("dtype", sorted(DTYPES))
def test_write_kv_writes_slots_and_skips_negatives(dtype):
    rng = np.random.default_rng(5)
    k_cache = random_values(rng, (6, 4, 2, 32), dtype)
    v_cache = random_values(rng, (6, 4, 2, 32), dtype)
    before_k, before_v = k_cache.copy(), v_cache.copy()
    k = random_values(rng, (5, 2, 32), dtype)
    v = random_values(rng, (5, 2, 32), dtype)
    slots = np.array([3, -1, 22, 0, -7], dtype=np.int64)
    gpu.write_kv(k, v, k_cache, v_cache, slots)
    expect_k, expect_v = before_k.reshape(-1, 2, 32).copy(), before_v.reshape(-1, 2, 32).copy()
    for t, slot in enumerate(slots):
        if slot >= 0:
            expect_k[slot], expect_v[slot] = k[t], v[t]
    np.testing.assert_array_equal(k_cache.reshape(-1, 2, 32), expect_k)
    np.testing.assert_array_equal(v_cache.reshape(-1, 2, 32), expect_v)


def test_write_kv_refuses_a_non_contiguous_cache():
    cache = np.zeros((2, 4, 4, 2, 32), dtype=np.float32)[:, :, ::2]
    with pytest.raises(ValueError, match="contiguous"):
        gpu.write_kv(np.zeros((1, 2, 32), np.float32), np.zeros((1, 2, 32), np.float32), cache[0], cache[1],
                     np.array([0]))


def test_float64_queries_accumulate_in_float64():
    rng = np.random.default_rng(6)
    batch = random_paged_batch(rng, [300, 41], block_size=16, num_kv_heads=2, head_dim=64)
    q = rng.standard_normal((2, 8, 64))
    out = gpu.paged_decode_attention(q, batch.k_cache, batch.v_cache, batch.block_tables, batch.seq_lens)
    assert out.dtype == np.float64
    for s in range(2):
        k, v = batch.contiguous(s)
        assert relative_error(out[s], dense_attention(q[s:s + 1], k, v)[0]) < 1e-12


@pytest.mark.parametrize("score_bytes", [1 << 13, 1 << 10])
def test_decode_in_chunks_and_past_the_score_budget_matches_reference(monkeypatch, score_bytes):
    # 8 KiB of scores holds one 256-token sequence (a length group cut into chunks) but not the
    # 300-token one, which goes through the online softmax alone; 1 KiB holds only the shortest.
    monkeypatch.setattr(numpy_backend, "SCORE_BYTES", score_bytes)
    rng = np.random.default_rng(7)
    lens = [130, 97, 0, 1, 120, 300, 256]
    batch = random_paged_batch(rng, lens, block_size=16, num_kv_heads=2, head_dim=32)
    q = random_values(rng, (len(lens), 8, 32), "float32")
    out = gpu.paged_decode_attention(q, batch.k_cache, batch.v_cache, batch.block_tables, batch.seq_lens)
    for s, n in enumerate(lens):
        if n == 0:
            assert np.all(out[s] == 0)
            continue
        k, v = batch.contiguous(s)
        assert relative_error(out[s], dense_attention(q[s:s + 1], k, v)[0]) < TOLERANCE["float32"]


def test_decode_plans_kept_between_calls_read_each_cache_afresh():
    # Decode keeps its per-shape views between calls (`_DecodePlan`), never the data: another
    # pool of the same shape is read, and so is a pool changed in place since the last call.
    rng = np.random.default_rng(8)
    pools = [random_paged_batch(rng, [70, 45], block_size=8, num_kv_heads=2, head_dim=32) for _ in range(2)]
    q = random_values(rng, (2, 4, 32), "float32")
    outs = [gpu.paged_decode_attention(q, b.k_cache, b.v_cache, b.block_tables, b.seq_lens).copy() for b in pools]
    for b, out in zip(pools, outs):
        for s in range(2):
            k, v = b.contiguous(s)
            assert relative_error(out[s], dense_attention(q[s:s + 1], k, v)[0]) < TOLERANCE["float32"]
    a = pools[0]
    a.v_cache *= -1
    again = gpu.paged_decode_attention(q, a.k_cache, a.v_cache, a.block_tables, a.seq_lens)
    assert np.array_equal(again, -outs[0])


@pytest.mark.parametrize("extra_columns", [0, 1])
def test_decode_with_a_padded_last_unit_matches_reference(extra_columns):
    # 67 blocks (a prime) have no divisor near the longest unit (here 42 blocks: 1 MiB of K for
    # 3 sequences): two units of 34 blocks, the last running past the table (when it has no
    # spare column) and past every sequence.
    assert numpy_backend._unit_blocks(67, 42) == (34, 68)
    assert numpy_backend._unit_blocks(128, 63) == (32, 128)
    rng = np.random.default_rng(10)
    lens = [1065, 1070, 1060]
    batch = random_paged_batch(rng, lens, block_size=16, num_kv_heads=2, head_dim=64,
                               extra_table_columns=extra_columns)
    q = random_values(rng, (len(lens), 8, 64), "float32")
    out = gpu.paged_decode_attention(q, batch.k_cache, batch.v_cache, batch.block_tables, batch.seq_lens)
    for s in range(len(lens)):
        k, v = batch.contiguous(s)
        assert relative_error(out[s], dense_attention(q[s:s + 1], k, v)[0]) < TOLERANCE["float32"]


@pytest.mark.parametrize("offset", [0, 4, 16, 28, 2048, 4092])
def test_gathers_land_half_a_period_from_their_source(offset):
    # memmove is slow when the destination sits just past the source modulo 4 KiB; the gather
    # buffer is placed so that it never does, wherever the cache starts.
    rng = np.random.default_rng(9)
    raw = np.empty((6 * 8 * 2 * 32 * 4) + 2 * numpy_backend.PAGE_BYTES, dtype=np.uint8)
    skip = (offset - raw.ctypes.data) % numpy_backend.PAGE_BYTES
    cache = raw[skip:skip + 6 * 8 * 2 * 32 * 4].view(np.float32).reshape(6, 8, 2, 32)
    cache[:] = rng.standard_normal(cache.shape, dtype=np.float32)
    dst = numpy_backend._workspace.gather("test", cache, 3 * cache[0].size)
    period = math.gcd(cache.strides[0], numpy_backend.PAGE_BYTES)
    assert (dst.ctypes.data - cache.ctypes.data) % period == period // 2
    tile = numpy_backend._take_blocks(cache, np.array([[4, 0, 5]]), dst)
    np.testing.assert_array_equal(tile[0], cache[[4, 0, 5]].reshape(-1, 2, 32))
