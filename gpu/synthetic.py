"""Random paged batches for checking kernels: the tests and the GPU self-check build them here.

A batch is a pool whose blocks are handed out in a random order (scattered, as on a server that
has run for a while), block tables padded with junk past each sequence's last block, and every
slot no sequence owns filled with NaN, so a kernel that reads a slot it should not, or leaves
an output unwritten, shows up as NaN. `contiguous(s)` gives sequence s's K/V back in position
order for the dense reference.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .dtypes import storage


@dataclass
class PagedBatch:
    """A pool and its block tables (host arrays). Shapes as documented in `gpu`."""

    k_cache: np.ndarray
    v_cache: np.ndarray
    block_tables: np.ndarray
    seq_lens: np.ndarray
    storage_name: str

    @property
    def block_size(self) -> int:
        return self.k_cache.shape[1]

    def contiguous(self, s: int) -> tuple[np.ndarray, np.ndarray]:
        """Returns sequence s's stored K and V, [seq_len, num_kv_heads, head_dim] float64."""
        pos = np.arange(int(self.seq_lens[s]))
        slots = self.block_tables[s, pos // self.block_size] * self.block_size + pos % self.block_size
        rows = self.k_cache.shape[2:]
        st = storage(self.storage_name)
        k = st.decode(np, self.k_cache.reshape(-1, *rows)[slots]).astype(np.float64)
        v = st.decode(np, self.v_cache.reshape(-1, *rows)[slots]).astype(np.float64)
        return k, v


def random_values(rng: np.random.Generator, shape, storage_name: str) -> np.ndarray:
    """Standard normal values rounded to the storage dtype (bfloat16 as uint16 bits)."""
    return storage(storage_name).encode(np, rng.standard_normal(shape, dtype=np.float32))


def random_paged_batch(rng: np.random.Generator, seq_lens, *, block_size: int, num_kv_heads: int,
                       head_dim: int, storage_name: str = "float32", spare_blocks: int = 2,
                       extra_table_columns: int = 1) -> PagedBatch:
    """Returns a pool holding random K/V for sequences of the given lengths, blocks scattered.

    Slots no sequence owns (the tail of each last block, the spare blocks) hold NaN. Each table
    has `extra_table_columns` more columns than the longest sequence needs, holding junk ids.
    """
    seq_lens = np.asarray(seq_lens, dtype=np.int32)
    blocks_per_seq = -(-seq_lens // block_size)
    num_blocks = int(blocks_per_seq.sum()) + spare_blocks
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = random_values(rng, shape, storage_name)
    v_cache = random_values(rng, shape, storage_name)
    nan = storage(storage_name).encode(np, np.float32(np.nan))
    owned = np.zeros((num_blocks, block_size), dtype=bool)
    order = rng.permutation(num_blocks)
    width = int(blocks_per_seq.max(initial=0)) + extra_table_columns
    # Junk past each sequence's last block: negative, out of range, or another sequence's block.
    block_tables = rng.choice(np.array([-1, num_blocks + 7, 0, num_blocks - 1]), size=(len(seq_lens), width))
    block_tables = block_tables.astype(np.int32)
    start = 0
    for s, (n, length) in enumerate(zip(blocks_per_seq, seq_lens)):
        ids = order[start:start + n]
        start += n
        block_tables[s, :n] = ids
        pos = np.arange(length)
        owned[ids[pos // block_size], pos % block_size] = True
    k_cache[~owned] = nan
    v_cache[~owned] = nan
    return PagedBatch(k_cache, v_cache, block_tables, seq_lens, storage_name)
