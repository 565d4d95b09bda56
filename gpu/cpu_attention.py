"""The tiny model's attention on the CPU: exact on the activation grid, so its bits never depend
on the batch, the chunking or the code path; and per-request contiguous K/V kept coherent with
the paged cache, so a decode step reads each context once, without gathering it.

Exactness (why any batching, any BLAS kernel, decode or prefill give the same bits)
------------------------------------------------------------------------------------
Queries, keys and values are multiples of 2**-8 (`gpu.model` rounds every activation to that
grid; float32/float16 storage holds such values exactly). For one query row:

1. Scores s_j = q . k_j are multiples of 2**-16. Computed in float32 they are exact whenever
   sum_d |q_d| |k_jd| < 2**8 (every product and partial sum is then an integer below 2**24 in
   units of 2**-16), whatever order the BLAS kernel sums in. `attend` checks that bound per call
   from the rows' L1 norms and an upper bound of |k|; past it (never seen with the tiny model's
   weights) it computes the exact score in float64 and rounds it to float32, which is what the
   float32 path would give when exact: either way s is fl32(exact score).
2. m = max_j s_j is exact. The weight of key j is p_j = rint(2**24 * exp((s_j - m) * scale))
   (float32 subtraction and product, float32 exp, all element-wise): an integer in [0, 2**24]
   that depends only on (s_j, m), never on where the row sits in an array. (NumPy's float32
   exp is element-wise in that sense; `_exp32_is_elementwise` checks it at import and the
   weights fall back to float64 exp where it does not hold.)
3. l = sum_j p_j and o = sum_j p_j v_j are computed in float64 in one product (V carries a
   row of ones for l). In units of 2**-8 every term is an integer below 2**24 * 2**8 * max|v|, so
   every partial sum is exact while n * max|v| < 2**21 (e.g. 262,144 tokens with |v| < 8): any
   summation order gives the same o and l.
4. The output o / l is one correctly rounded division per element.

So a row's output is a function of its sequence's K/V alone, computed exactly up to the final
division: decode, the last row of a prefill chunk, any batch, any tiling agree bit for bit. The
weights differ from exact softmax by at most 2**-25 of the largest weight (plus exp's rounding),
far below the float32 noise of the CUDA kernels, with which tokens are compared by measurement.

Per-request K/V (`SequenceKV`)
------------------------------
A decode step must read every context's K and V. Gathering them out of scattered blocks each
step cost more than the attention itself, so each request keeps, per layer, a contiguous copy:
K transposed in float32, V transposed in float64 with a row of ones, in the layouts the two
products read (a decode row's weights times V is then a matrix-vector product over contiguous
rows: ~2x faster than NumPy's small-M matrix product over [n, D + 1], the largest cost of a step).
Before use it is refreshed from the paged cache through the step's block table: the blocks
whose id changed, or whose content changed since they were copied (the cache bumps a version
per block on every write, copy, swap-in and import), and the new positions are gathered again.
The copy is therefore always what reading the paged cache through the block table would give:
a wrong block table, or a block overwritten by another request, shows up in the output exactly
as it would without the copy.
"""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass, field

import numpy as np

P_BITS = 24
_P_SCALE = float(2**P_BITS)
# float32 scores are exact while sum_d |q_d k_d| stays below this (2**24 units of 2**-16).
SCORE_LIMIT = 2.0**8
# Query rows per GEMM in `attend_rows`: bounds the score matrix of a long prefill chunk.
ROW_BLOCK = 256


def attend(q, k_t, v_t, kmax: float, scale: float, row_end=None):
    """Exact attention of query rows of one sequence over that sequence's keys.

    q: [R, KVH, G, D] float64 on the 2**-8 grid (query head h reads kv head h // G).
    k_t: [KVH, D, n] float32, the keys transposed; v_t: [KVH, D + 1, n] float64, the values
    transposed and a last row of ones. kmax: an upper bound of |k| over the keys. row_end: [R] ints,
    row r sees keys [0, row_end[r]) (1 <= row_end[r] <= n); None: every row sees all n keys.
    Returns [R, KVH, G, D] float64: the same bits for a row whatever the other rows and n
    beyond its row_end (see the module docstring).
    """
    num_rows, num_kv_heads, group, head_dim = q.shape
    n = k_t.shape[2]
    rows = q.transpose(1, 0, 2, 3).reshape(num_kv_heads, num_rows * group, head_dim)
    s = _scores(rows, k_t, kmax, float(np.abs(rows).sum(axis=-1).max()))
    if row_end is not None and int(np.min(row_end)) < n:
        hidden = np.arange(n)[None, :] >= np.repeat(np.asarray(row_end), group)[:, None]
        np.copyto(s, np.float32(-np.inf), where=hidden[None])
    s -= s.max(axis=-1, keepdims=True)
    p = _weights(s, scale)
    o = np.matmul(p.reshape(s.shape), v_t.transpose(0, 2, 1))
    out = o[..., :head_dim] / o[..., head_dim:]
    return out.reshape(num_kv_heads, num_rows, group, head_dim).transpose(1, 0, 2, 3)


def _exp32_is_elementwise(exp=np.exp) -> bool:
    """Whether NumPy's float32 exp gives every element the bits it gives that value alone,
    wherever it sits in a contiguous array (SIMD body, masked tail, in place or not). NumPy's
    kernels are written that way; this probe checks it on this machine, so that `_weights` never
    relies on it where it does not hold."""
    x = -np.linspace(0.0, 20.0, 67, dtype=np.float32)
    alone = np.concatenate([exp(x[i:i + 1]) for i in range(len(x))])
    for start in range(0, 9):
        for stop in (start + 1, start + 7, start + 17, len(x)):
            y = x[start:stop].copy()
            exp(y, out=y)
            if not (np.array_equal(exp(x[start:stop]).view(np.int32), alone[start:stop].view(np.int32))
                    and np.array_equal(y.view(np.int32), alone[start:stop].view(np.int32))):
                return False
    return True


# float32 exp is ~3x faster than float64 exp, and exp is the largest element-wise cost of a step.
_EXP32 = _exp32_is_elementwise()


def _weights(shifted, scale: float, out=None) -> np.ndarray:
    """Softmax weights rint(2**24 * exp(t)), t = fl32(shifted * scale), of float32 scores already
    shifted by their row maximum (contiguous; overwritten), as float64: element-wise only, so a
    weight never depends on its neighbours. exp is NumPy's float32 exp (an element-wise function
    of t, probed at import) or, where that probe fails, float64 exp. Into `out` (float64,
    shifted's size) when given."""
    shifted *= np.float32(scale)
    p = np.empty(shifted.shape) if out is None else out.reshape(shifted.shape)
    if _EXP32:
        np.exp(shifted, out=shifted)
        np.multiply(shifted, _P_SCALE, out=p)
    else:
        np.copyto(p, shifted)
        np.exp(p, out=p)
        p *= _P_SCALE
    np.rint(p, out=p)
    return p


def _scores(q, k_t, kmax: float, bound: float, out=None):
    """fl32(q @ k_t), exactly (see the module docstring): float32 when provably exact."""
    if bound * kmax < SCORE_LIMIT:
        return np.matmul(q.astype(np.float32), k_t, out=out)
    s = np.matmul(q, k_t.astype(np.float64)).astype(np.float32)
    if out is None:
        return s
    out[...] = s
    return out


def attend_last(q, kvs, scale: float):
    """`attend` for one row per sequence that sees all of its sequence's keys (a decode step,
    or the last row of a prefill chunk), for many sequences in one pass: the element-wise
    steps run once over all of them. Same bits as `attend` row by row.

    q: [N, KVH, G, D] float64; kvs: N (k_t, v_t, kmax) as `attend` takes them.
    Returns [N, KVH, G, D] float64.
    """
    num, num_kv_heads, group, head_dim = q.shape
    rows = num_kv_heads * group
    lens = [k_t.shape[2] for k_t, _, _ in kvs]
    starts = [0, *np.cumsum(np.repeat(np.array(lens, dtype=np.int64), rows)).tolist()]
    total = starts[-1]
    scores = _workspace.get("scores", total, np.float32)
    bounds = np.abs(q).sum(axis=-1).max(axis=(1, 2)).tolist() if num else []
    q32 = q.astype(np.float32)
    for i, (k_t, _, kmax) in enumerate(kvs):
        out = scores[starts[i * rows]:starts[(i + 1) * rows]].reshape(num_kv_heads, group, -1)
        if bounds[i] * kmax < SCORE_LIMIT:  # `_scores`, inlined: this loop runs per sequence
            np.matmul(q32[i], k_t, out=out)
        else:
            _scores(q[i], k_t, kmax, bounds[i], out=out)
    if total:
        # Every row's maximum in one pass: rows are consecutive runs of their sequence's length.
        row_max = np.maximum.reduceat(scores, starts[:-1])
        scores -= np.repeat(row_max, np.diff(starts))
    p = _weights(scores, scale, _workspace.get("weights", total, np.float64))
    o = np.empty((num, num_kv_heads, group, head_dim + 1))
    for i, (_, v_t, _) in enumerate(kvs):
        pi = p[starts[i * rows]:starts[(i + 1) * rows]].reshape(num_kv_heads, group, -1)
        for h in range(num_kv_heads):  # matrix-vector products (BLAS gemv), one per query row
            for g in range(group):
                np.matmul(v_t[h], pi[h, g], out=o[i, h, g])
    return o[..., :head_dim] / o[..., head_dim:]


def attend_rows(q, k_t, v_t, kmax: float, scale: float, positions):
    """`attend` for causal rows at `positions` (row r sees keys 0 .. positions[r]), in blocks
    of ROW_BLOCK rows, each reading keys only up to its own last position."""
    positions = np.asarray(positions)
    if len(positions) <= ROW_BLOCK:
        end = int(positions.max()) + 1
        return attend(q, k_t[:, :, :end], v_t[:, :, :end], kmax, scale, positions + 1)
    out = np.empty_like(q)
    for r0 in range(0, len(positions), ROW_BLOCK):
        r1 = min(r0 + ROW_BLOCK, len(positions))
        out[r0:r1] = attend_rows(q[r0:r1], k_t, v_t, kmax, scale, positions[r0:r1])
    return out


def contiguous_kv(k, v):
    """A sequence's K/V [n, KVH, D] (storage dtype) in `attend`'s layouts: (k_t, v_t, kmax)."""
    n, num_kv_heads, head_dim = k.shape
    k_t = np.ascontiguousarray(k.transpose(1, 2, 0), dtype=np.float32)
    v_t = np.ones((num_kv_heads, head_dim + 1, n))
    v_t[:, :head_dim] = v.transpose(1, 2, 0)
    return k_t, v_t, float(np.abs(k_t).max()) if n else 0.0


class _Workspace(threading.local):
    """Flat buffers reused across steps (a fresh array of a few MiB is page-faulted in by the OS
    on every use, which costs as much as the arithmetic on it)."""

    def __init__(self) -> None:
        self.buffers: dict[str, np.ndarray] = {}

    def get(self, name: str, size: int, dtype) -> np.ndarray:
        buf = self.buffers.get(name)
        if buf is None or buf.size < size or buf.dtype != dtype:
            buf = self.buffers[name] = np.empty(max(size, 1 << 16), dtype=dtype)
        return buf[:size]


_workspace = _Workspace()


@dataclass
class _LayerCopy:
    """One request's contiguous K/V of one layer, valid for positions [0, n)."""

    k_t: np.ndarray                # [KVH, D, capacity] float32
    v_t: np.ndarray                # [KVH, D + 1, capacity] float64, last row ones
    n: int = 0
    kmax: float = 0.0              # upper bound of |k| over [0, n)
    ids: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))  # blocks copied
    seen: int = 0                  # the cache's version counter at the copy


class SequenceKV:
    """Per-request contiguous copies of the paged K/V, refreshed through block tables.

    `cache` is a `gpu.kv_cache.PagedKVCache` on NumPy: its arrays `k`, `v` [layers, blocks,
    block_size, KVH, D] and `versions` [blocks] (bumped whenever a block's content changes).
    """

    def __init__(self, cache) -> None:
        self.cache = cache
        self._copies: dict[int, list[_LayerCopy | None]] = {}

    def forget(self, req_id: int) -> None:
        """Drops a request's copies (it left the engine)."""
        self._copies.pop(req_id, None)

    def __len__(self) -> int:
        return len(self._copies)

    def get(self, req_id: int, layer: int, block_table: np.ndarray, seq_len: int) -> tuple:
        """(k_t, v_t, kmax) of positions [0, seq_len) of `req_id` in `layer`, as read through
        `block_table` (int64 ids, at least ceil(seq_len / block_size) of them) right now."""
        return self.get_many([req_id], layer, [block_table], [seq_len])[0]

    def get_many(self, req_ids, layer: int, block_tables, seq_lens) -> list[tuple]:
        """`get` for several requests (distinct ids) at once: the staleness check and the
        gather of what must be read again run once for all of them."""
        cache = self.cache
        block_size = cache.k.shape[2]
        copies, tables, firsts = [], [], []
        for req_id, block_table, seq_len in zip(req_ids, block_tables, seq_lens):
            layers = self._copies.get(req_id)
            if layers is None:
                layers = self._copies[req_id] = [None] * cache.k.shape[0]
            c = layers[layer]
            if c is None or c.k_t.shape[2] < seq_len:
                c = layers[layer] = self._grow(c, seq_len)
            table = block_table[:-(-seq_len // block_size)]
            copies.append(c)
            tables.append(table)
            # Blocks before the one holding position c.n were copied whole; usually all of them
            # are still valid and only that block on (new tokens) is read.
            firsts.append(min(c.n // block_size, len(table)))
        # A copied block must be read again when its id or its content changed since the copy
        # (versions only grow, so a block written since has a version above the copy's `seen`).
        if any(firsts):
            old = np.concatenate([c.ids[:f] for c, f in zip(copies, firsts)])
            new = np.concatenate([t[:f] for t, f in zip(tables, firsts)])
            seen = np.repeat(np.array([c.seen for c in copies], dtype=np.int64), firsts)
            stale = (old != new) | (cache.versions[new] > seen)
            if stale.any():
                offset = 0
                for i, f in enumerate(firsts):
                    hit = stale[offset:offset + f]
                    offset += f
                    if hit.any():
                        firsts[i] = int(hit.argmax())
        # Every position from block `first` on, for all requests in one gather.
        counts = [len(t) - f for t, f in zip(tables, firsts)]
        if sum(counts):
            blocks = np.concatenate([t[f:] for t, f in zip(tables, firsts)])
            _, _, _, num_kv_heads, head_dim = cache.k.shape
            k = cache.k[layer][blocks].reshape(-1, num_kv_heads, head_dim)
            v = cache.v[layer][blocks].reshape(-1, num_kv_heads, head_dim)
        out, row = [], 0
        for c, table, first, count, seq_len in zip(copies, tables, firsts, counts, seq_lens):
            start = first * block_size
            if count:
                n = seq_len - start
                kk, vv = k[row:row + n], v[row:row + n]
                row += count * block_size
                c.k_t[:, :, start:seq_len] = kk.transpose(1, 2, 0)
                c.v_t[:, :head_dim, start:seq_len] = vv.transpose(1, 2, 0)
                kmax = float(np.abs(kk).max())
                c.kmax = kmax if start == 0 else max(c.kmax, kmax)
            c.n = seq_len
            c.ids = table.copy()
            c.seen = cache.version
            out.append((c.k_t[:, :, :seq_len], c.v_t[:, :, :seq_len], c.kmax))
        return out

    def _grow(self, c: _LayerCopy | None, seq_len: int) -> _LayerCopy:
        _, _, _, num_kv_heads, head_dim = self.cache.k.shape
        capacity = max(64, 1 << math.ceil(math.log2(seq_len)))
        new = _LayerCopy(np.empty((num_kv_heads, head_dim, capacity), np.float32),
                         np.ones((num_kv_heads, head_dim + 1, capacity)))
        if c is not None and c.n:
            new.k_t[:, :, :c.n] = c.k_t[:, :, :c.n]
            new.v_t[:, :, :c.n] = c.v_t[:, :, :c.n]
            new.n, new.kmax, new.ids, new.seen = c.n, c.kmax, c.ids, c.seen
        return new
