"""gpu.cpu_attention: exact-grid attention (batch-independent bits), the float32 exp probe, and
the per-request K/V copies kept coherent with the paged cache."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from gpu import cpu_attention as ca


def _grid(rng, shape, std):
    return np.rint(rng.standard_normal(shape) * std * 256) / 256


def _softmax_attention(q, k, v, scale):
    """float64 softmax attention of q [KVH, G, D] over k, v [n, KVH, D]."""
    s = np.einsum("hgd,nhd->hgn", q, k) * scale
    w = np.exp(s - s.max(axis=-1, keepdims=True))
    return np.einsum("hgn,nhd->hgd", w / w.sum(axis=-1, keepdims=True), v)


def test_attend_last_matches_attend_row_by_row_and_softmax():
    rng = np.random.default_rng(3)
    kvh, group, dim, scale = 2, 3, 16, 0.25
    lens = [1, 5, 64, 300, 17]
    raw = [(_grid(rng, (n, kvh, dim), 0.5), _grid(rng, (n, kvh, dim), 1.0)) for n in lens]
    kvs = [ca.contiguous_kv(k.astype(np.float32), v.astype(np.float32)) for k, v in raw]
    q = _grid(rng, (len(lens), kvh, group, dim), 0.5)
    together = ca.attend_last(q, kvs, scale)
    for i, (k_t, v_t, kmax) in enumerate(kvs):
        alone = ca.attend(q[i:i + 1], k_t, v_t, kmax, scale)[0]
        assert np.array_equal(together[i], alone)  # bits, not closeness
        # and the same row among others of its own sequence, seeing every key
        rows = np.concatenate([q[i:i + 1], _grid(rng, (3, kvh, group, dim), 0.5)])
        assert np.array_equal(ca.attend(rows, k_t, v_t, kmax, scale)[0], alone)
        np.testing.assert_allclose(alone, _softmax_attention(q[i], *raw[i], scale), rtol=0, atol=2e-6)


def test_weights_fall_back_to_float64_exp_when_float32_exp_is_not_elementwise(monkeypatch):
    def position_dependent(x, out=None):
        r = np.exp(x, out=out)
        if r.size > 8:
            r[-1] = np.nextafter(r[-1], np.float32(1))
        return r

    assert ca._exp32_is_elementwise()  # NumPy's float32 exp on this machine
    assert not ca._exp32_is_elementwise(position_dependent)
    shifted = -np.abs(_grid(np.random.default_rng(5), 1000, 8.0)).astype(np.float32)
    monkeypatch.setattr(ca, "_EXP32", False)
    p64 = ca._weights(shifted.copy(), 0.25)
    assert np.array_equal(p64, np.rint(np.exp(np.float64(shifted * np.float32(0.25))) * 2.0**24))
    monkeypatch.setattr(ca, "_EXP32", True)
    p32 = ca._weights(shifted.copy(), 0.25)
    assert np.abs(p32 - p64).max() <= 2  # one float32 rounding of exp apart, on a 2**24 scale


class _Cache:
    """The parts of gpu.kv_cache.PagedKVCache that SequenceKV reads, with its version rule."""

    def __init__(self, rng, layers=1, blocks=8, block_size=4, kvh=1, dim=8):
        self.k = _grid(rng, (layers, blocks, block_size, kvh, dim), 0.5).astype(np.float32)
        self.v = _grid(rng, (layers, blocks, block_size, kvh, dim), 1.0).astype(np.float32)
        self.versions = np.zeros(blocks, dtype=np.int64)
        self.version = 0

    def write(self, rng, block):
        self.k[:, block] = _grid(rng, self.k[:, block].shape, 0.5)
        self.v[:, block] = _grid(rng, self.v[:, block].shape, 1.0)
        self.version += 1
        self.versions[block] = self.version


def _assert_is_gather(kv, cache, table, n):
    k_t, v_t, kmax = kv
    want = ca.contiguous_kv(cache.k[0][table].reshape(-1, *cache.k.shape[3:])[:n],
                            cache.v[0][table].reshape(-1, *cache.v.shape[3:])[:n])
    assert np.array_equal(k_t, want[0]) and np.array_equal(v_t, want[1])
    assert kmax >= want[2]


@pytest.mark.parametrize("change", ["rewritten_block", "other_block_id", "shorter_then_longer"])
def test_sequence_kv_copy_is_always_what_the_block_table_reads(change):
    rng = np.random.default_rng(7)
    cache = _Cache(rng)
    copies = ca.SequenceKV(cache)
    table = np.array([5, 2, 7, 1], dtype=np.int64)
    for n in (3, 9, 13):  # grows across steps: only new positions are copied
        _assert_is_gather(copies.get(0, 0, table, n), cache, table, n)
    if change == "rewritten_block":      # e.g. a swap-in or copy into a block the request holds
        cache.write(rng, 2)
    elif change == "other_block_id":     # e.g. preempted and re-prefilled into other blocks
        table = np.array([5, 3, 7, 1], dtype=np.int64)
    else:                                # recomputed from an earlier position
        _assert_is_gather(copies.get(0, 0, table, 5), cache, table, 5)
        cache.write(rng, 7)
    _assert_is_gather(copies.get(0, 0, table, 14), cache, table, 14)


def test_get_many_refreshes_each_request_from_its_own_table():
    rng = np.random.default_rng(11)
    cache = _Cache(rng, blocks=12)
    copies = ca.SequenceKV(cache)
    tables = [np.array([0, 1, 2], dtype=np.int64), np.array([3, 4, 5], dtype=np.int64),
              np.array([6, 7, 8], dtype=np.int64)]
    copies.get_many([1, 2], 0, tables[:2], [9, 9])
    cache.write(rng, 3)                  # request 2's first block rewritten
    lens = [10, 10, 5]                   # request 3 is new
    for kv, table, n in zip(copies.get_many([1, 2, 3], 0, tables, lens), tables, lens):
        _assert_is_gather(kv, cache, table, n)
    tables[2] = np.array([6, 9, 8], dtype=np.int64)  # request 3's second block replaced
    cache.write(rng, 9)
    lens = [11, 11, 6]
    for kv, table, n in zip(copies.get_many([1, 2, 3], 0, tables, lens), tables, lens):
        _assert_is_gather(kv, cache, table, n)
