"""The paged KV pool of the tiny model, on the device, and its host pool for swapping.

    k, v        [num_layers, num_blocks, block_size, num_kv_heads, head_dim]   (device)
    host_k/v    [num_layers, num_host_blocks, block_size, num_kv_heads, head_dim]   (host)

`k[layer]` / `v[layer]` are the per-layer caches the kernels take (contiguous views). Block
moves act on all layers at once. Pools start zeroed, so their contents are a function of the
work done, never of what the allocator handed out. `versions[block]` (host, int64) changes
whenever a block's content may have: every block move here bumps it, and so must whoever writes
K/V into the pool (`mark_written`); copies derived from the pool (`gpu.cpu_attention`) use it to
know what to read again.
"""

from __future__ import annotations

import numpy as np

from .backend import Backend
from .dtypes import Storage


def kv_bytes_per_block(block_size: int, *, num_layers: int, num_kv_heads: int, head_dim: int,
                       itemsize: int) -> int:
    """Bytes one block takes across all layers, K and V together."""
    return 2 * num_layers * block_size * num_kv_heads * head_dim * itemsize


class PagedKVCache:
    """Device K/V blocks for every layer, plus `num_host_blocks` host slots for swapped blocks."""

    def __init__(self, backend: Backend, storage: Storage, *, num_layers: int, num_blocks: int,
                 block_size: int, num_kv_heads: int, head_dim: int, num_host_blocks: int = 0) -> None:
        self.backend = backend
        self.storage = storage
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.num_host_blocks = num_host_blocks
        shape = (num_layers, num_blocks, block_size, num_kv_heads, head_dim)
        host_shape = (num_layers, num_host_blocks, block_size, num_kv_heads, head_dim)
        self.k = backend.xp.zeros(shape, dtype=storage.array_dtype)
        self.v = backend.xp.zeros(shape, dtype=storage.array_dtype)
        self.host_k = np.zeros(host_shape, dtype=storage.array_dtype)
        self.host_v = np.zeros(host_shape, dtype=storage.array_dtype)
        self.versions = np.zeros(num_blocks, dtype=np.int64)
        self.version = 0  # the latest value in `versions`

    def mark_written(self, blocks) -> None:
        """Records that the content of `blocks` (device block ids, host ints) changed."""
        self.version += 1
        self.versions[np.asarray(blocks, dtype=np.int64)] = self.version

    @property
    def bytes_per_block(self) -> int:
        num_layers, _, block_size, num_kv_heads, head_dim = self.k.shape
        return kv_bytes_per_block(block_size, num_layers=num_layers, num_kv_heads=num_kv_heads,
                                  head_dim=head_dim, itemsize=self.storage.itemsize)

    def _check(self, ids, limit: int, what: str) -> np.ndarray:
        ids = np.asarray(ids, dtype=np.int64)
        if ids.size and (ids.min() < 0 or ids.max() >= limit):
            raise ValueError(f"{what} {ids.tolist()} outside 0..{limit - 1}")
        return ids

    def copy_blocks(self, pairs) -> None:
        """Copies device block src to dst in every layer, for each (src, dst); all sources are
        read before any destination is written."""
        if not pairs:
            return
        src, dst = (self._check(ids, self.num_blocks, "copy block") for ids in zip(*pairs))
        xp = self.backend.xp
        self.mark_written(dst)
        src, dst = xp.asarray(src), xp.asarray(dst)
        self.k[:, dst] = self.k[:, src]
        self.v[:, dst] = self.v[:, src]

    def swap_out(self, pairs) -> None:
        """Copies device block -> host slot in every layer, for each (device_block, host_slot)."""
        if not pairs:
            return
        blocks, slots = zip(*pairs)
        blocks = self._check(blocks, self.num_blocks, "swap_out block")
        slots = self._check(slots, self.num_host_blocks, "swap_out host slot")
        xp = self.backend.xp
        self.host_k[:, slots] = self.backend.to_host(self.k[:, xp.asarray(blocks)])
        self.host_v[:, slots] = self.backend.to_host(self.v[:, xp.asarray(blocks)])

    def swap_in(self, pairs) -> None:
        """Copies host slot -> device block in every layer, for each (host_slot, device_block)."""
        if not pairs:
            return
        slots, blocks = zip(*pairs)
        slots = self._check(slots, self.num_host_blocks, "swap_in host slot")
        blocks = self._check(blocks, self.num_blocks, "swap_in block")
        xp = self.backend.xp
        self.k[:, xp.asarray(blocks)] = self.backend.asarray(self.host_k[:, slots])
        self.v[:, xp.asarray(blocks)] = self.backend.asarray(self.host_v[:, slots])
        self.mark_written(blocks)

    def read_blocks(self, ids):
        """Copies of device blocks `ids` in every layer: (K, V), each
        [num_layers, len(ids), block_size, num_kv_heads, head_dim] (to send to another pool)."""
        ids = self.backend.xp.asarray(self._check(ids, self.num_blocks, "read block"))
        return self.k[:, ids].copy(), self.v[:, ids].copy()

    def write_blocks(self, ids, k, v) -> None:
        """Stores (K, V) as `read_blocks` gives them into device blocks `ids` of this pool."""
        host_ids = self._check(ids, self.num_blocks, "write block")
        ids = self.backend.xp.asarray(host_ids)
        self.k[:, ids] = self.backend.asarray(k)
        self.v[:, ids] = self.backend.asarray(v)
        self.mark_written(host_ids)

    def gather(self, block_table, num_tokens: int) -> tuple[np.ndarray, np.ndarray]:
        """Returns the stored K and V of positions 0..num_tokens-1 of a sequence, on the host:
        [num_layers, num_tokens, num_kv_heads, head_dim] each, in the storage array dtype."""
        pos = np.arange(num_tokens)
        table = np.asarray(block_table, dtype=np.int64)
        slots = self.backend.asarray(table[pos // self.block_size] * self.block_size + pos % self.block_size)
        rows = self.k.shape[3:]
        k = self.k.reshape(self.k.shape[0], -1, *rows)[:, slots]
        v = self.v.reshape(self.v.shape[0], -1, *rows)[:, slots]
        return self.backend.to_host(k), self.backend.to_host(v)
