"""CPU kernel benchmark: NumPy paged decode attention against the same math on contiguous K/V.

`kernel_bench` builds, per (batch, context), a paged cache whose blocks are a random permutation
of the pool (scattered, as a long-running server's would be), and a contiguous copy of exactly the
same K/V bytes, then times both decode attentions side by side in one run. Throughput counts the
bytes the attention must read and write: all K and V of every sequence, q and the output.
"""

from __future__ import annotations

import math
import time

import numpy as np

from . import numpy_backend

DEFAULT_SHAPES = tuple((batch, context) for batch in (1, 8, 32) for context in (512, 2048, 8192))
BENCH_HEADS = 8
BENCH_KV_HEADS = 2
BENCH_HEAD_DIM = 64
BENCH_BLOCK_SIZE = 16


def dense_decode_attention(q, k, v, scale=None):
    """Decode attention over contiguous K/V, float32, in one pass: the paged kernel's baseline.

    q: [batch, num_heads, head_dim]; k, v: [batch, context, num_kv_heads, head_dim]; every query
    sees all `context` keys of its sequence. Returns [batch, num_heads, head_dim].
    """
    batch, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[2]
    scale = 1.0 / math.sqrt(head_dim) if scale is None else scale
    qg = q.reshape(batch, num_kv_heads, -1, head_dim) * np.float32(scale)
    s = np.matmul(qg, k.transpose(0, 2, 3, 1))
    s -= s.max(axis=-1, keepdims=True)
    p = np.exp(s)
    p /= p.sum(axis=-1, keepdims=True)
    return np.matmul(p, v.transpose(0, 2, 1, 3)).reshape(batch, num_heads, head_dim)


def _interleaved_medians(fns, repeat: int, min_seconds: float) -> list[float]:
    """Median seconds per call of each function, run in turn so that drift hits all alike."""
    times = [[] for _ in fns]
    start = time.perf_counter()
    while len(times[0]) < repeat or time.perf_counter() - start < min_seconds:
        for fn, ts in zip(fns, times):
            t0 = time.perf_counter()
            fn()
            ts.append(time.perf_counter() - t0)
        if len(times[0]) >= 50 * repeat:
            break
    return [float(np.median(ts)) for ts in times]


def kernel_bench(shapes=None, repeat: int = 7, *, min_seconds: float = 0.2, num_heads: int = BENCH_HEADS,
                 num_kv_heads: int = BENCH_KV_HEADS, head_dim: int = BENCH_HEAD_DIM,
                 block_size: int = BENCH_BLOCK_SIZE, seed: int = 0) -> list[dict]:
    """Times paged vs contiguous NumPy decode attention, float32, for each (batch, context).

    Returns one dict per shape: `batch`, `context`, `num_heads`, `num_kv_heads`, `head_dim`,
    `block_size`, `bytes` (read + written per call), `paged_ms` / `dense_ms` (medians over at
    least `repeat` calls and `min_seconds`, the two alternating, after one warm-up call),
    `paged_gbps` / `dense_gbps`, `ratio_to_dense` (paged / dense throughput) and
    `max_abs_diff` between the two outputs.
    """
    rng = np.random.default_rng(seed)
    results = []
    for batch, context in shapes or DEFAULT_SHAPES:
        blocks_per_seq = -(-context // block_size)
        num_blocks = batch * blocks_per_seq
        shape = (num_blocks, block_size, num_kv_heads, head_dim)
        k_cache = rng.standard_normal(shape, dtype=np.float32)
        v_cache = rng.standard_normal(shape, dtype=np.float32)
        block_tables = rng.permutation(num_blocks).astype(np.int32).reshape(batch, blocks_per_seq)
        seq_lens = np.full(batch, context, dtype=np.int32)
        q = rng.standard_normal((batch, num_heads, head_dim), dtype=np.float32)
        # The contiguous baseline holds the very same K/V, sequence by sequence.
        dense_shape = (batch, blocks_per_seq * block_size, num_kv_heads, head_dim)
        k_dense = k_cache[block_tables].reshape(dense_shape)[:, :context]
        v_dense = v_cache[block_tables].reshape(dense_shape)[:, :context]
        k_dense, v_dense = np.ascontiguousarray(k_dense), np.ascontiguousarray(v_dense)
        out = np.empty_like(q)

        def paged():
            numpy_backend.paged_decode_attention(q, k_cache, v_cache, block_tables, seq_lens, out=out)

        def dense():
            return dense_decode_attention(q, k_dense, v_dense)

        paged()
        diff = float(np.abs(out - dense()).max())
        paged_s, dense_s = _interleaved_medians((paged, dense), repeat, min_seconds)
        nbytes = 2 * k_dense.nbytes + 2 * q.nbytes
        results.append({
            "batch": batch, "context": context, "num_heads": num_heads,
            "num_kv_heads": num_kv_heads, "head_dim": head_dim, "block_size": block_size,
            "bytes": nbytes, "paged_ms": paged_s * 1e3, "dense_ms": dense_s * 1e3,
            "paged_gbps": nbytes / paged_s / 1e9, "dense_gbps": nbytes / dense_s / 1e9,
            "ratio_to_dense": dense_s / paged_s, "max_abs_diff": diff,
        })
    return results


def format_table(results: list[dict]) -> str:
    """Returns the results as a fixed-width text table, one line per shape."""
    lines = [f"{'batch':>5} {'context':>7} {'paged ms':>9} {'dense ms':>9} {'paged GB/s':>10} {'dense GB/s':>10} {'ratio':>6}"]
    for r in results:
        lines.append(f"{r['batch']:>5} {r['context']:>7} {r['paged_ms']:>9.3f} {r['dense_ms']:>9.3f} "
                     f"{r['paged_gbps']:>10.2f} {r['dense_gbps']:>10.2f} {r['ratio_to_dense']:>6.2f}")
    return "\n".join(lines)


if __name__ == "__main__":
    print(format_table(kernel_bench()))
