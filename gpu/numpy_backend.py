"""NumPy backend: paged attention and KV writes on the CPU, vectorised over the batch.

Both attention kinds walk the keys in tiles of whole blocks: a tile's K/V blocks are gathered
for every sequence at once (`np.take` along the block axis into reused buffers) and scored with
one batched matmul. Prefill (`_attend`) folds each tile into an online softmax (running max,
running sum, unnormalised output). Decode (`_decode`) scores every tile into one score matrix,
takes the softmax once, then weights V tile by tile: per tile only a gather and a product, with
the views they use set up once per shape (`_DecodePlan`), since at small batches the Python
work per call costs as much as the arithmetic. Tiles are sized to stay in cache and, for
decode, to keep each GEMM under OpenBLAS's threading threshold. There is no Python loop over
tokens or sequences, only over tiles. (A two-thread split of the keys was tried and dropped: on
two cores it fought OpenBLAS's own threads and made timings erratic.)

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
# Decode plans kept per thread (`_DecodePlan`); past this many the cache starts over.
MAX_PLANS = 64


class _Workspace(threading.local):
    """Flat gather buffers reused across tiles and calls, one set per calling thread, and the
    decode plans (`_DecodePlan`) built on them.

    A fresh multi-MiB array per tile is mapped and page-faulted in by the OS every time, which
    costs more than the gather itself (measured: 4x slower at batch 1, context 512).
    """

    def __init__(self) -> None:
        self.buffers: dict[tuple[str, np.dtype], np.ndarray] = {}
        self.gathers: dict[tuple[str, np.dtype], tuple[np.ndarray, int]] = {}
        self.plans: dict[tuple, _DecodePlan] = {}

    def get(self, name: str, size: int, dtype: np.dtype) -> np.ndarray:
        buf = self.buffers.get((name, dtype))
        if buf is None or buf.size < size:
            self.plans.clear()  # they hold views of the old buffer: let it go
            buf = self.buffers[(name, dtype)] = np.empty(size, dtype=dtype)
        return buf

    def gather(self, name: str, cache: np.ndarray, size: int) -> np.ndarray:
        """A flat buffer of `size` elements to gather blocks of `cache` into (`_take_blocks`),
        placed so that every block's copy lands half a period (of block offsets modulo
        PAGE_BYTES) away from its source, clear of memmove's slow case."""
        key, slack = (name, cache.dtype), PAGE_BYTES // cache.itemsize
        entry = self.gathers.get(key)
        if entry is None or entry[0].size < size + slack:
            self.plans.clear()
            buf = np.empty(size + slack, dtype=cache.dtype)
            entry = self.gathers[key] = (buf, _address(buf))
        buf, address = entry
        period = math.gcd(cache.strides[0], PAGE_BYTES)
        start = (_address(cache) + period // 2 - address) % period // cache.itemsize
        return buf[start:start + size]

    def decode_plan(self, qg, k_cache, v_cache, num_blocks) -> _DecodePlan:
        """The plan for this call's shapes; the caches' addresses (modulo a page) are part of
        the key because they decide where the gathers go."""
        key = (qg.shape, qg.dtype, k_cache.shape, k_cache.strides, v_cache.strides, k_cache.dtype, num_blocks,
               TILE_BYTES, _address(k_cache) % PAGE_BYTES, _address(v_cache) % PAGE_BYTES)
        plan = self.plans.get(key)
        if plan is None:
            if len(self.plans) >= MAX_PLANS:
                self.plans.clear()
            plan = _DecodePlan(qg, k_cache, v_cache, num_blocks)
            self.plans[key] = plan  # after building: a buffer grown meanwhile cleared the dict
        return plan


_workspace = _Workspace()


_FLOAT32, _FLOAT64 = np.dtype(np.float32), np.dtype(np.float64)
_CACHE_DTYPES = frozenset(map(np.dtype, (np.float32, np.float16, np.float64)))


def _accum_dtype(q: np.ndarray) -> np.dtype:
    return _FLOAT64 if q.dtype == _FLOAT64 else _FLOAT32


def _check_cache(k_cache: np.ndarray, v_cache: np.ndarray) -> None:
    if k_cache.shape != v_cache.shape or k_cache.dtype != v_cache.dtype or k_cache.ndim != 4:
        raise ValueError(f"k_cache {k_cache.shape} {k_cache.dtype} and v_cache {v_cache.shape} {v_cache.dtype}: "
                         "want equal [num_blocks, block_size, num_kv_heads, head_dim] arrays")
    if k_cache.dtype not in _CACHE_DTYPES:
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

    The kernels walk every sequence of a call up to the longest one's length (shorter ones are
    masked), so one 8k-token sequence in a batch of 3k-token ones would make the whole batch
    cost 8k each; grouping bounds that waste at 2x for a few extra calls.
    """
    if len(seq_lens) <= 1:
        return [np.arange(len(seq_lens))]
    order = np.argsort(seq_lens, kind="stable")
    bucket = np.ceil(np.log2(np.maximum(seq_lens[order], 1))).astype(np.int64)
    cuts = np.flatnonzero(np.diff(bucket)) + 1
    return np.split(order, cuts)


def _unit_blocks(num_blocks: int, max_unit: int) -> tuple[int, int]:
    """Blocks per GEMM unit for `num_blocks` blocks, at most `max_unit`, and the blocks the
    units cover: the largest divisor of `num_blocks` from `max_unit` down to half of it, else
    `num_blocks` shared evenly with the last unit padded."""
    for unit in range(min(max_unit, num_blocks), max(1, max_unit // 2) - 1, -1):
        if num_blocks % unit == 0:
            return unit, num_blocks
    units = -(-num_blocks // max_unit)
    unit = -(-num_blocks // units)
    return unit, units * unit


class _DecodePlan:
    """Everything `_decode` can set up once for a shape, as views of workspace buffers: the
    tiles of blocks and, per tile, the gather destinations of its K and V blocks, the same
    memory as the products' operands (cast to the accumulation dtype in buffers of their own
    when the cache stores another), and the parts of the score matrix and of the partial
    outputs it fills. A decode step calls with the same shapes for every layer, so the per-call
    Python work (a good part of a small batch's time) is a look-up.

    A tile holds about TILE_BYTES of K. Its keys are cut into units of equal length, each one
    GEMM per sequence and kv head, short enough to stay under OpenBLAS's threading threshold;
    one batched product covers all units of a tile (each product call costs ~8 us of its own
    here). When no divisor of the block count makes a good unit, the last unit runs past the
    last block (padding, masked like the slots past a sequence's end).
    """

    def __init__(self, qg, k_cache, v_cache, num_blocks):
        num_seqs, num_kv_heads, rows, head_dim = qg.shape
        block_size = k_cache.shape[1]
        cap = max(1, TILE_BYTES // (num_seqs * block_size * num_kv_heads * head_dim * k_cache.itemsize))
        max_tokens = max(MIN_TILE_TOKENS, (BLAS_SINGLE_THREAD_WORK - 1) // (rows * head_dim))
        unit, self.blocks = _unit_blocks(num_blocks, max(1, min(cap, max_tokens // block_size)))
        self.keys = keys = self.blocks * block_size
        num_units = self.blocks // unit
        num_tiles = -(-num_units // max(1, cap // unit))
        per_tile = -(-num_units // num_tiles)  # units per tile, evened out
        unit_tokens = unit * block_size
        size = num_seqs * per_tile * unit * block_size * num_kv_heads * head_dim
        acc = qg.dtype
        # K and V share one buffer (a tile's K is used up before its V is gathered), each placed
        # for its own cache.
        k_buf, v_buf = _workspace.gather("kv", k_cache, size), _workspace.gather("kv", v_cache, size)
        cast = k_cache.dtype != acc
        if cast:
            # NumPy's matmul of mixed dtypes leaves BLAS for a slow generic loop (4x slower than
            # a cast into a reused buffer followed by the BLAS product).
            k_acc, v_acc = _workspace.get("k_acc", size, acc), _workspace.get("v_acc", size, acc)
        s_size = num_seqs * num_kv_heads * rows * keys
        self.scores = _workspace.get("scores", s_size, acc)[:s_size].reshape(num_seqs, num_kv_heads, rows, keys)
        # [S, units, KVH, R, unit tokens]: the score matrix as the products write it
        by_unit = self.scores.reshape(num_seqs, num_kv_heads, rows, num_units, unit_tokens).transpose(0, 3, 1, 2, 4)
        self.parts = None
        if num_units > 1:
            p_size = num_units * qg.size
            self.parts = _workspace.get("parts", p_size, acc)[:p_size].reshape(
                num_seqs, num_units, num_kv_heads, rows, head_dim)
        self.positions = np.arange(keys)
        self.k_tiles, self.v_tiles = [], []
        for j0 in range(0, num_units, per_tile):
            j1 = min(j0 + per_tile, num_units)
            b0, b1 = j0 * unit, j1 * unit
            n = num_seqs * (b1 - b0) * block_size * num_kv_heads * head_dim
            blocks = (num_seqs, b1 - b0) + k_cache.shape[1:]
            tokens = (num_seqs, (b1 - b0) * block_size, num_kv_heads, head_dim)
            units = (num_seqs, j1 - j0, unit_tokens, num_kv_heads, head_dim)
            k_dst, v_dst = k_buf[:n].reshape(blocks), v_buf[:n].reshape(blocks)
            k_op = (k_acc[:n] if cast else k_buf[:n]).reshape(units)
            v_op = (v_acc[:n] if cast else v_buf[:n]).reshape(units)
            self.k_tiles.append((b0, b1, k_dst, k_op if cast else None, k_op.transpose(0, 1, 3, 4, 2),
                                 by_unit[:, j0:j1]))
            self.v_tiles.append((b0, b1, b0 * block_size, b1 * block_size, v_dst, v_dst.reshape(tokens),
                                 v_op if cast else None, v_op.transpose(0, 1, 3, 2, 4), by_unit[:, j0:j1],
                                 None if self.parts is None else self.parts[:, j0:j1]))


def _decode(qg, k_cache, v_cache, block_tables, seq_lens, o, min_len, max_len):
    """Decode attention of `qg` [S, KVH, R, D] (scaled, accumulation dtype) into `o` (same shape).

    Two passes over the keys instead of `_attend`'s online softmax: each tile of K blocks is
    gathered and scored straight into one score matrix [S, KVH, R, keys] (a workspace buffer,
    which the caller keeps within SCORE_BYTES), the softmax runs once over all of it, then each
    tile of V blocks is gathered and weighted into its own slots of a partial-output buffer,
    summed at the end. A tile costs a gather and a product, with none of the online softmax's
    per-tile max, rescale and mask work; the views it needs come from a `_DecodePlan`. A
    sequence of length 0 gives zeros. `min_len` and `max_len` are `seq_lens`' extremes.
    """
    if max_len <= 0:
        o[...] = 0
        return
    plan = _workspace.decode_plan(qg, k_cache, v_cache, -(-max_len // k_cache.shape[1]))
    if block_tables.shape[1] < plan.blocks:
        # The last unit runs past the table: any id serves there (its slots are masked).
        ids = np.zeros((len(block_tables), plan.blocks), dtype=block_tables.dtype)
        ids[:, :block_tables.shape[1]] = block_tables
        block_tables = ids
    s, q_units = plan.scores, qg[:, None]
    for b0, b1, k_dst, k_acc, k_op, s_tile in plan.k_tiles:
        k_cache.take(block_tables[:, b0:b1], axis=0, out=k_dst, mode="clip")  # see `_take_blocks`
        if k_acc is not None:
            np.copyto(k_acc, k_dst.reshape(k_acc.shape), casting="same_kind")
        np.matmul(q_units, k_op, out=s_tile)
    if min_len < plan.keys:
        # Slots past a sequence's end were never written for it: their scores go to -inf here
        # and their V to zero below, so that stale (even NaN) data cannot leak into the output.
        stale = plan.positions[None, :] >= seq_lens[:, None]
        np.copyto(s, -np.inf, where=stale[:, None, None, :])
    m = np.maximum.reduce(s, axis=-1, keepdims=True)  # (as s.max, without its Python wrapper)
    if min_len <= 0:
        m = np.where(np.isfinite(m), m, 0.0)  # a row with no key: shift by 0, not inf - inf
    s -= m
    np.exp(s, out=s)
    l = np.add.reduce(s, axis=-1, keepdims=True)
    for b0, b1, t0, t1, v_dst, v_tokens, v_acc, v_op, s_tile, part in plan.v_tiles:
        v_cache.take(block_tables[:, b0:b1], axis=0, out=v_dst, mode="clip")
        if t1 > min_len:
            stale = plan.positions[None, t0:t1] >= seq_lens[:, None]
            np.copyto(v_tokens, 0, where=stale[:, :, None, None])
        if v_acc is not None:
            np.copyto(v_acc, v_tokens.reshape(v_acc.shape), casting="same_kind")
        # A single unit writes straight to `o`; more write their partial sums side by side.
        np.matmul(s_tile, v_op, out=o[:, None] if part is None else part)
    if plan.parts is not None:
        np.sum(plan.parts, axis=1, out=o)
    if min_len <= 0:
        np.divide(o, l, out=o, where=l > 0)
        np.copyto(o, 0, where=l == 0)
    else:
        o /= l


def _decode_grouped(qg, k_cache, v_cache, block_tables, seq_lens, o):
    """`_decode` into `o`, by groups of similar length (see `_length_groups`), each cut into
    chunks of sequences whose score matrix fits SCORE_BYTES; a sequence too long for that on
    its own goes through `_attend`'s online softmax."""
    if not len(seq_lens):
        return
    key_bytes = qg.shape[1] * qg.shape[2] * qg.itemsize
    block_size = k_cache.shape[1]
    if len(seq_lens) <= 64:  # Python's min and max of a short list: a third of NumPy's time
        lens = seq_lens.tolist()
        lo, hi = min(lens), max(lens)
    else:
        lo, hi = int(seq_lens.min()), int(seq_lens.max())
    # One group and one chunk (the usual decode batch): `_length_groups`' buckets, ceil(log2(n)),
    # from the two extremes alone.
    if ((max(lo, 1) - 1).bit_length() == (max(hi, 1) - 1).bit_length()
            and SCORE_BYTES // max(1, -(-hi // block_size) * block_size * key_bytes) >= len(seq_lens)):
        _decode(qg, k_cache, v_cache, block_tables, seq_lens, o, lo, hi)
        return
    for idx in _length_groups(seq_lens):
        keys = -(-int(seq_lens[idx].max()) // block_size) * block_size
        chunk = SCORE_BYTES // max(1, keys * key_bytes)
        for c0 in range(0, len(idx), max(1, chunk)):
            sel = idx[c0:c0 + max(1, chunk)]
            q_sel, tables, lens = qg[sel], block_tables[sel], seq_lens[sel]
            if chunk:
                dest = np.empty_like(q_sel)
                _decode(q_sel, k_cache, v_cache, tables, lens, dest, int(lens.min()), int(lens.max()))
            else:
                row_pos = np.repeat((lens - 1)[:, None], qg.shape[2], axis=1)
                dest = _attend(q_sel, row_pos, k_cache, v_cache, tables, lens)
            o[sel] = dest


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
    seq_lens = np.asarray(seq_lens)
    if seq_lens.dtype.kind != "i":
        seq_lens = seq_lens.astype(np.int64)
    scale = 1.0 / math.sqrt(head_dim) if scale is None else scale
    acc = _accum_dtype(q)
    grouped = (num_seqs, num_heads // group, group, head_dim)
    qg = q.reshape(grouped)
    qg = (qg if qg.dtype == acc else qg.astype(acc)) * acc.type(scale)
    direct = out.dtype == acc and out.flags.c_contiguous
    o = out.reshape(grouped) if direct else np.empty(grouped, dtype=acc)
    _decode_grouped(qg, k_cache, v_cache, np.asarray(block_tables), seq_lens, o)
    if not direct:
        out[...] = o.reshape(q.shape)
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
