"""NumPy backend: paged attention and KV writes on the CPU, vectorised over the batch.

Both attention kinds run through one routine, `_attend`, that walks the keys in tiles of whole
blocks: it gathers one tile of K/V blocks for every sequence at once (`np.take` along the block
axis into reused buffers), scores it with one batched matmul, and folds it into an online
softmax (running max, running sum, unnormalised output). Tiles are sized to stay in cache and,
for decode, to keep each GEMM under OpenBLAS's threading threshold. There is no Python loop
over tokens or sequences, only over tiles. (A two-thread split of the keys was tried and
dropped: on two cores it fought OpenBLAS's own threads and made timings erratic.)

Accumulation is float32, or float64 when `q` is float64: the tiny model passes float64 queries so
that the reduction order (tile boundaries follow the batch size) cannot move a result by more
than ~1e-16 before it is rounded to a coarse grid (see `gpu.model`).
"""

from __future__ import annotations

import math
import threading
import weakref

import numpy as np

# Bytes of gathered K (per tile) to aim for: a fraction of this machine's L2/L3 cache.
TILE_BYTES = 1 << 20
# OpenBLAS runs a GEMM on one thread while m * n * k < 4 * 65536. Decode tiles stay under that
# ([rows x head_dim] @ [head_dim x tokens]): waking BLAS threads for such small products costs
# more than it gains. A tile never gets fewer than MIN_TILE_TOKENS tokens (long prefill chunks).
BLAS_SINGLE_THREAD_WORK = 4 * 65536
MIN_TILE_TOKENS = 256
# Upper bound on one tile's score matrix, which matters for long prefill chunks.
SCORE_BYTES = 8 << 20
# Prefill query tokens per call of `_attend`: each block of a chunk reads keys only up to its
# own last position (the causal mask hides the rest), and a sequence whose chunk ended before
# the block is left out, not padded. Halves a fresh prompt's attention work.
PREFILL_ROW_BLOCK = 256
# glibc's memmove (np.take copies each block with it) runs ~8x slower when the destination sits
# 1-31 bytes past the source modulo 4 KiB (measured here: 150 us instead of 17 us to gather
# 256 KiB; stores alias the next loads), so gathers place their tile in the buffer away from that.
PAGE_BYTES = 4096


class _Workspace(threading.local):
    """Flat gather buffers reused across tiles and calls, one set per calling thread.

    A fresh multi-MiB array per tile is mapped and page-faulted in by the OS every time, which
    costs more than the gather itself (measured: 4x slower at batch 1, context 512).
    """

    def __init__(self) -> None:
        self.buffers: dict[tuple[str, np.dtype], np.ndarray] = {}
        self.gathers: dict[tuple[str, np.dtype], tuple[np.ndarray, int]] = {}

    def get(self, name: str, size: int, dtype: np.dtype) -> np.ndarray:
        buf = self.buffers.get((name, dtype))
        if buf is None or buf.size < size:
            buf = self.buffers[(name, dtype)] = np.empty(size, dtype=dtype)
        return buf

    def gather(self, name: str, cache: np.ndarray, size: int) -> np.ndarray:
        """A flat buffer of `size` elements to gather blocks of `cache` into (`_take_blocks`),
        placed so that every block's copy lands half a period (of block offsets modulo
        PAGE_BYTES) away from its source, clear of memmove's slow case."""
        key, slack = (name, cache.dtype), PAGE_BYTES // cache.itemsize
        entry = self.gathers.get(key)
        if entry is None or entry[0].size < size + slack:
            buf = np.empty(size + slack, dtype=cache.dtype)
            entry = self.gathers[key] = (buf, _address(buf))
        buf, address = entry
        period = math.gcd(cache.strides[0], PAGE_BYTES)
        start = (_address(cache) + period // 2 - address) % period // cache.itemsize
        return buf[start:start + size]


_workspace = _Workspace()
def _accum_dtype(q: np.ndarray) -> np.dtype:
    return np.dtype(np.float64) if q.dtype == np.float64 else np.dtype(np.float32)


def _check_cache(k_cache: np.ndarray, v_cache: np.ndarray) -> None:
    if k_cache.shape != v_cache.shape or k_cache.dtype != v_cache.dtype or k_cache.ndim != 4:
        raise ValueError(f"k_cache {k_cache.shape} {k_cache.dtype} and v_cache {v_cache.shape} {v_cache.dtype}: "
                         "want equal [num_blocks, block_size, num_kv_heads, head_dim] arrays")
    if k_cache.dtype not in (np.float32, np.float16, np.float64):
        raise ValueError(f"cache dtype {k_cache.dtype}: the NumPy backend stores float32 or float16")


# Data addresses of live arrays, by id: reading one costs ~3 us (`ndarray.ctypes`), a look-up
# here ~0.3 us. An entry leaves when its array is freed. (An array moved by an in-place
# `resize` keeps a stale entry, which only places its gathers less well.)
_addresses: dict[int, tuple[weakref.ref, int]] = {}


def _address(a: np.ndarray) -> int:
    """`a`'s data address."""
    key = id(a)
    entry = _addresses.get(key)
    if entry is not None and entry[0]() is a:
        return entry[1]
    address = a.ctypes.data
    _addresses[key] = (weakref.ref(a, lambda _, key=key: _addresses.pop(key, None)), address)
    return address


def _take_blocks(cache, ids, dst):
    """Copies the blocks `ids` [S, n] of `cache` into `dst` (from `_Workspace.gather`); returns
    the copy as [S, n * block_size, ...].

    mode="clip": table entries past a sequence's last block are padding and may hold any value;
    clipping keeps them in range (their slots are zeroed afterwards). It is also 3x faster than
    the default "raise", which gathers into a temporary and then copies that into `out`.
    """
    shape = ids.shape + cache.shape[1:]
    tile = cache.take(ids, axis=0, out=dst[:math.prod(shape)].reshape(shape), mode="clip")
    return tile.reshape(ids.shape[0], -1, *cache.shape[2:])


def _cast(a, dtype, name):
    """`a` converted to `dtype` in the workspace buffer `name` (no fresh allocation)."""
    out = _workspace.get(name, a.size, np.dtype(dtype))[:a.size].reshape(a.shape)
    np.copyto(out, a, casting="same_kind")
    return out


def _attend(qg, row_pos, k_cache, v_cache, block_tables, seq_lens):
    """Softmax attention of grouped query rows over each sequence's paged keys.

    qg: [S, KVH, R, D] queries already multiplied by the scale, in the accumulation dtype.
    row_pos: [S, R] the last key position each row may see (causal limit), < seq_lens[s].
    Returns [S, KVH, R, D] in qg's dtype; a row that sees no key gives zeros.
    """
    num_seqs, num_kv_heads, rows, head_dim = qg.shape
    block_size = k_cache.shape[1]
    key_end = int(row_pos.max()) + 1 if row_pos.size else 0
    if key_end <= 0:
        return np.zeros_like(qg)
    min_pos, min_len = int(row_pos.min()), int(seq_lens.min())
    num_blocks = -(-key_end // block_size)
    col_bytes = num_seqs * block_size * num_kv_heads * head_dim * k_cache.itemsize
    score_bytes = num_seqs * num_kv_heads * rows * block_size * qg.itemsize
    max_tokens = max(MIN_TILE_TOKENS, (BLAS_SINGLE_THREAD_WORK - 1) // (rows * head_dim))
    tile_blocks = min(num_blocks, max(1, min(TILE_BYTES // col_bytes, SCORE_BYTES // score_bytes,
                                             max_tokens // block_size)))
    size = num_seqs * tile_blocks * block_size * num_kv_heads * head_dim
    k_buf = _workspace.gather("k", k_cache, size)
    v_buf = _workspace.gather("v", v_cache, size)
    for b0 in range(0, num_blocks, tile_blocks):
        ids = block_tables[:, b0:min(b0 + tile_blocks, num_blocks)]
        kt = _take_blocks(k_cache, ids, k_buf)
        vt = _take_blocks(v_cache, ids, v_buf)
        key_pos = np.arange(b0 * block_size, b0 * block_size + kt.shape[1])
        if key_pos[-1] >= min_len:
            # Slots past a sequence's end were never written for it: zero V there so that stale
            # (even NaN) data cannot leak into the output through 0 * NaN. Their scores are
            # masked to -inf below (a slot past the end is past every row's limit), so stale K
            # needs no zeroing.
            stale = (key_pos[None, :] >= seq_lens[:, None])[:, :, None, None]
            np.copyto(vt, 0, where=stale)
        if kt.dtype != qg.dtype:
            # NumPy's matmul of mixed dtypes leaves BLAS for a slow generic loop (4x slower
            # than a cast into a reused buffer followed by the BLAS product).
            kt = _cast(kt, qg.dtype, "k_acc")
            vt = _cast(vt, qg.dtype, "v_acc")
        s = np.matmul(qg, kt.transpose(0, 2, 3, 1))  # [S, KVH, R, tokens]
        if key_pos[-1] > min_pos:
            visible = key_pos[None, None, :] <= row_pos[:, :, None]  # [S, R, tokens]
            np.copyto(s, -np.inf, where=~visible[:, None])
        tile_max = s.max(axis=-1, keepdims=True)
        if b0 == 0:
            m = tile_max
        else:
            m_prev, m = m, np.maximum(m, tile_max)
        # A row with no visible key yet (a sequence of length 0) keeps m = -inf: shift it by 0,
        # not by inf - inf. Every other row sees key 0 in the first tile.
        m_safe = np.where(np.isfinite(m), m, 0.0) if min_pos < 0 else m
        s -= m_safe
        np.exp(s, out=s)
        pv = np.matmul(s, vt.transpose(0, 2, 1, 3))
        if b0 == 0:
            l, o = s.sum(axis=-1, keepdims=True), pv
        else:
            corr = np.exp(m_prev - m_safe)
            l = l * corr + s.sum(axis=-1, keepdims=True)
            o = o * corr + pv
    if min_pos < 0:
        with np.errstate(invalid="ignore", divide="ignore"):
            return np.where(l > 0, o / l, 0.0).astype(qg.dtype, copy=False)
    o /= l
    return o


def _length_groups(seq_lens: np.ndarray) -> list[np.ndarray]:
    """Sequence indices grouped by length within a factor of two.

    `_attend` walks every sequence up to the longest one's length (shorter ones are masked), so
    one 8k-token sequence in a batch of 3k-token ones would make the whole batch cost 8k each;
    grouping bounds that waste at 2x for a few extra calls.
    """
    if len(seq_lens) <= 1:
        return [np.arange(len(seq_lens))]
    order = np.argsort(seq_lens, kind="stable")
    bucket = np.ceil(np.log2(np.maximum(seq_lens[order], 1))).astype(np.int64)
    cuts = np.flatnonzero(np.diff(bucket)) + 1
    return np.split(order, cuts)


def _attend_grouped(qg, row_pos, k_cache, v_cache, block_tables, seq_lens):
    """`_attend` over groups of similar length (see `_length_groups`), results in batch order."""
    groups = _length_groups(seq_lens)
    if len(groups) == 1:
        return _attend(qg, row_pos, k_cache, v_cache, block_tables, seq_lens)
    out = np.empty_like(qg)
    for idx in groups:
        out[idx] = _attend(qg[idx], row_pos[idx], k_cache, v_cache, block_tables[idx],
                           seq_lens[idx])
    return out


def _prepare_out(out, shape, dtype):
    if out is None:
        return np.empty(shape, dtype=dtype)
    if out.shape != shape or out.dtype != dtype:
        raise ValueError(f"out is {out.shape} {out.dtype}, want {shape} {dtype}")
    return out


def _grouped(q, k_cache):
    num_heads, num_kv_heads = q.shape[1], k_cache.shape[2]
    if q.shape[2] != k_cache.shape[3] or num_heads % num_kv_heads:
        raise ValueError(f"q {q.shape} does not fit cache {k_cache.shape} (head_dim, or heads not a multiple of kv heads)")
    return num_heads // num_kv_heads


def paged_decode_attention(q, k_cache, v_cache, block_tables, seq_lens, scale=None, *, out=None,
                           max_seq_len=None, split_k=None, partition_size=None):
    """Decode attention over the paged cache; see `gpu` for shapes. Returns `out`.

    `max_seq_len`, `split_k` and `partition_size` exist for parity with the CuPy backend and
    change nothing here.
    """
    _check_cache(k_cache, v_cache)
    num_seqs, num_heads, head_dim = q.shape
    group = _grouped(q, k_cache)
    out = _prepare_out(out, q.shape, q.dtype)
    seq_lens = np.asarray(seq_lens, dtype=np.int64)
    scale = 1.0 / math.sqrt(head_dim) if scale is None else scale
    acc = _accum_dtype(q)
    qg = q.reshape(num_seqs, -1, group, head_dim).astype(acc) * acc.type(scale)
    row_pos = np.repeat((seq_lens - 1)[:, None], group, axis=1)
    o = _attend_grouped(qg, row_pos, k_cache, v_cache, np.asarray(block_tables), seq_lens)
    out[...] = o.reshape(num_seqs, num_heads, head_dim)
    return out


def paged_prefill_attention(q, k_cache, v_cache, block_tables, cu_seqlens_q, seq_lens, scale=None, *,
                            out=None, max_q_len=None):
    """Causal prefill attention over the paged cache; see `gpu` for shapes. Returns `out`."""
    _check_cache(k_cache, v_cache)
    total, num_heads, head_dim = q.shape
    group = _grouped(q, k_cache)
    num_kv_heads = num_heads // group
    out = _prepare_out(out, q.shape, q.dtype)
    cu = np.asarray(cu_seqlens_q, dtype=np.int64)
    seq_lens = np.asarray(seq_lens, dtype=np.int64)
    q_lens = np.diff(cu)
    num_seqs = len(q_lens)
    if total == 0 or num_seqs == 0:
        return out
    scale = 1.0 / math.sqrt(head_dim) if scale is None else scale
    acc = _accum_dtype(q)
    width = int(q_lens.max())
    j = np.arange(width)
    is_query = j[None, :] < q_lens[:, None]                        # [S, width]
    rows = np.where(is_query, cu[:-1, None] + j[None, :], 0)      # padded rows read row 0
    qp = q[rows].reshape(num_seqs, width, num_kv_heads, group, head_dim)
    qg = qp.transpose(0, 2, 1, 3, 4).reshape(num_seqs, num_kv_heads, width * group, head_dim)
    qg = qg.astype(acc) * acc.type(scale)
    # Padded rows get a harmless in-range limit; their results are discarded below.
    pos = np.minimum((seq_lens - q_lens)[:, None] + j[None, :], (seq_lens - 1)[:, None])
    row_pos = np.repeat(pos, group, axis=1)
    block_tables = np.asarray(block_tables)
    o = np.empty_like(qg)
    for j0 in range(0, width, PREFILL_ROW_BLOCK):
        live = np.flatnonzero(q_lens > j0)
        r0, r1 = j0 * group, min(width, j0 + PREFILL_ROW_BLOCK) * group
        o[live, :, r0:r1] = _attend(qg[live, :, r0:r1], row_pos[live, r0:r1], k_cache, v_cache,
                                    block_tables[live], seq_lens[live])
    o = o.reshape(num_seqs, num_kv_heads, width, group, head_dim).transpose(0, 2, 1, 3, 4)
    out[rows[is_query]] = o.reshape(num_seqs, width, num_heads, head_dim)[is_query]
    return out


def write_kv(k, v, k_cache, v_cache, slot_mapping) -> None:
    """Writes rows of `k` / `v` to their slots in the caches, in place; negative slots are skipped.

    Raises:
        ValueError: shapes or dtypes do not fit, or a cache is not C-contiguous (a reshape of
            it would be a copy and the write would be lost).
    """
    _check_cache(k_cache, v_cache)
    if k.shape != v.shape or k.shape[1:] != k_cache.shape[2:]:
        raise ValueError(f"k {k.shape} / v {v.shape} do not fit cache {k_cache.shape}")
    if not (k_cache.flags.c_contiguous and v_cache.flags.c_contiguous):
        raise ValueError("write_kv needs C-contiguous caches")
    slots = np.asarray(slot_mapping, dtype=np.int64)
    keep = slots >= 0
    row_shape = (-1,) + k_cache.shape[2:]
    k_cache.reshape(row_shape)[slots[keep]] = k[keep]
    v_cache.reshape(row_shape)[slots[keep]] = v[keep]
