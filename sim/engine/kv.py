"""KV cache memory: a pool of fixed-size blocks and the per-request block tables over it.

`BlockPool` speaks only in blocks: reference counts, an LRU free queue, and (for prefix caching)
the hash of each full block. `KVCacheManager` speaks in requests and tokens: it grows a request's
append-only block table as its tokens are computed (nothing is reserved up front) and frees it on
finish, cancel or preemption. Neither knows about kernels or scheduling.

A model with sliding-window layers (`KVGroups`) keeps, as vLLM V1's hybrid KV cache manager
does, one table per group of layers over the one pool: a block then holds `block_size` tokens of
one group's layers. A request's `block_table` is the first full-attention group's (the table the
attention kernels read); its `group_tables` the other full-attention groups' and then the window
groups'. All grow together; a window group's blocks that every later query's window has passed
are freed after each step (`slide`) and their places left as NULL. A run of decode steps
computed at once (sim.engine.stepping) stays short of every window: a block boundary it crosses
takes a block in each table.

The free queue keeps vLLM V1's order (its `FreeKVCacheBlockQueue` is an intrusive doubly linked
list: reused from the head, cached blocks evicted in LRU order), and a cached free block hit by a
new request leaves it in O(1).
"""

from __future__ import annotations

from typing import Hashable, Iterable

import numpy as np

from sim.errors import ScenarioError
from sim.engine.request import Request


class OutOfBlocks(Exception):
    """Raised by BlockPool.allocate when fewer blocks are free than asked for."""


class BlockPool:
    """`num_blocks` blocks with reference counts and a queue of free blocks.

    A block is free when its ref count is 0. Free blocks that still hold a cached prefix (a hash)
    stay reusable until `allocate` takes them from the head of the queue, which evicts the hash.

    Where a freed block joins the queue follows vLLM V1's `BlockPool.free_blocks`: with
    `uncached_first`, a block holding no cached prefix goes to the head (it can never be hit, so
    it is reused first) and a cached one to the tail (LRU eviction); without, every freed block
    goes to the tail. `duplicates` lets a second block holding the same prefix register as a
    further holder (a lookup returns the first), as vLLM's `BlockHashToBlockMap` does; without,
    only the first block to register a prefix holds it.

    The queue is a stack of blocks put at the head (`_front`, its top reused first) followed by
    a list of blocks consumed from `_head`. Taking a free block out of the middle (a prefix-cache
    hit) leaves its entry behind as stale: an entry is live only while its block is free and
    `_pos` records that entry's position (-1 - i for index i of the stack, base + i in the list),
    so the queue keeps exact order with O(1) removal, and while nothing is stale an allocation
    is one or two list slices.
    """

    def __init__(self, num_blocks: int, sharing: bool = False, *,
                 uncached_first: bool = False, duplicates: bool = False) -> None:
        if num_blocks <= 0:
            raise ScenarioError(f"kv.num_blocks: must be positive, got {num_blocks}")
        self.num_blocks = num_blocks
        # Without sharing no entry ever goes stale, and blocks move in bulk (C-level map/slice).
        self.sharing = sharing
        self.uncached_first = uncached_first
        self.duplicates = duplicates
        self.ref_cnt = [0] * num_blocks
        self.block_hash: list[Hashable | None] = [None] * num_blocks
        self.cached: dict[Hashable, int] = {}  # hash -> first block holding it
        self._more: dict[Hashable, list[int]] = {}  # hash -> further holders, in registration order
        self._front: list[int] = []
        self._queue = list(range(num_blocks))
        self._pos = list(range(num_blocks))  # queue position of each block's live entry
        self._base = 0  # absolute position of _queue[0]
        self._head = 0
        self._stale = 0
        self.num_free = num_blocks

    def free_block_ids(self) -> list[int]:
        """Free blocks in queue order, head (next to allocate) first. O(queue length)."""
        if not self.sharing:  # no entry is ever stale
            return self._front[::-1] + self._queue[self._head:]
        ref, pos, base = self.ref_cnt, self._pos, self._base
        f = self._front
        front = [b for i, b in reversed(list(enumerate(f))) if ref[b] == 0 and pos[b] == -1 - i]
        return front + [b for i, b in enumerate(self._queue[self._head:], self._head)
                        if ref[b] == 0 and pos[b] == base + i]

    def allocate(self, n: int) -> list[int]:
        """Take `n` blocks from the head of the free queue, each with ref count 1.

        Raises OutOfBlocks (and allocates nothing) when fewer than `n` are free.
        """
        if n > self.num_free:
            raise OutOfBlocks(f"need {n} blocks, {self.num_free} free")
        q, ref, f = self._queue, self.ref_cnt, self._front
        h = self._head
        if not self._stale:
            k = min(n, len(f))  # from the front stack, the rest from the queue
            if k:
                out = f[-1:-k - 1:-1]
                del f[-k:]
                if k < n:
                    out += q[h:h + n - k]
            else:
                out = q[h:h + n]
            # (a plain loop: map(ref.__setitem__, ...) calls a slot wrapper per block, 5x
            # slower)
            for b in out:
                ref[b] = 1
            h += n - k
        else:
            out = []
            pos, base = self._pos, self._base
            while f and len(out) < n:
                b = f.pop()
                if ref[b] == 0 and pos[b] == -1 - len(f):
                    ref[b] = 1
                    out.append(b)
                else:
                    self._stale -= 1
            while len(out) < n:
                b = q[h]
                if ref[b] == 0 and pos[b] == base + h:
                    ref[b] = 1
                    out.append(b)
                else:
                    self._stale -= 1
                h += 1
        if self.cached:  # evict the cached prefixes these blocks held
            bh = self.block_hash
            for b in out:
                if bh[b] is not None:
                    self._evict(b)
        self.num_free -= n
        if h > 4096 and h * 2 > len(q):
            del q[:h]
            self._base += h
            h = 0
        self._head = h
        return out

    def free(self, blocks: Iterable[int]) -> None:
        """Drop one reference to each block; blocks that reach 0 join the free queue (see the
        class docstring for which end).

        Callers pass a request's blocks tail-first: at the tail its last blocks, the least
        likely to be shared, are evicted first; at the head they are reused first. Raises
        AssertionError on a block already free.
        """
        ref, q = self.ref_cnt, self._queue
        if not self.sharing:
            table = list(blocks)
            table.reverse()
            self._free_unshared(table)
            return
        pos, bh, first = self._pos, self.block_hash, self.uncached_first
        start = p = self._base + len(q)
        front = []
        for b in blocks:
            rc = ref[b]
            if rc == 1:
                ref[b] = 0
                if first and bh[b] is None:
                    front.append(b)
                else:
                    pos[b] = p
                    p += 1
                    q.append(b)
            elif rc > 1:
                ref[b] = rc - 1
            else:
                raise AssertionError(f"block {b} freed twice")
        if front:
            f = self._front
            for b in reversed(front):
                pos[b] = -1 - len(f)
                f.append(b)
        self.num_free += p - start + len(front)

    def free_table(self, table: list[int]) -> None:
        """`free(reversed(table))`: a request's blocks, tail first (without a copy)."""
        if self.sharing:
            self.free(reversed(table))
        else:
            self._free_unshared(table)

    def _free_unshared(self, table: list[int]) -> None:
        """Free `table`'s blocks, each held once (no sharing), tail first."""
        self._release(table)
        if self.uncached_first:  # without sharing no block holds a cached prefix
            self._front.extend(table)
        else:
            self._queue.extend(reversed(table))
        self.num_free += len(table)

    def _release(self, table: list[int]) -> None:
        """`table`'s reference counts from 1 to 0; AssertionError, nothing changed, on a
        block not held once."""
        ref = self.ref_cnt
        i = 0
        for b in table:
            if ref[b] != 1:
                for b2 in table[:i]:  # (nothing freed: the pool stays as it was)
                    ref[b2] = 1
                raise AssertionError(f"block {b} freed twice")
            ref[b] = 0
            i += 1

    def enable_sharing(self) -> None:
        """Switch a pool made without sharing to the mode that tracks queue positions."""
        if self.sharing:
            return
        pos, base = self._pos, self._base
        for i, b in enumerate(self._queue[self._head:], self._head):
            pos[b] = base + i
        for i, b in enumerate(self._front):
            pos[b] = -1 - i
        self.sharing = True

    def free_runs(self):
        """(start, length) of every run of consecutive free blocks, as two NumPy arrays."""
        free = np.zeros(self.num_blocks + 2, dtype=np.int8)
        free[1:-1] = np.asarray(self.ref_cnt, dtype=np.int64) == 0
        d = np.diff(free)
        starts = np.flatnonzero(d == 1)
        return starts, np.flatnonzero(d == -1) - starts

    def share(self, b: int) -> None:
        """Take one more reference to block `b`, pulling it out of the free queue if needed."""
        if not self.sharing:
            raise AssertionError("this pool was made without sharing")
        if self.ref_cnt[b] == 0:
            self.num_free -= 1
            self._stale += 1  # its queue entry stays behind
        self.ref_cnt[b] += 1

    # --- prefix cache ----------------------------------------------------------------------------
    def set_hash(self, b: int, h) -> None:
        """Mark full block `b` (in use) as holding the prefix keyed `h`. A block holds one
        prefix; a further block holding an already cached prefix becomes a second holder with
        `duplicates`, and stays unmarked without."""
        if self.block_hash[b] is not None:
            return
        first = self.cached.get(h)
        if first is None:
            self.cached[h] = b
        elif not self.duplicates:
            return
        else:
            self._more.setdefault(h, []).append(b)
        self.block_hash[b] = h

    def _evict(self, b: int) -> None:
        """Block `b` is being reused: it no longer holds its prefix; a further holder of the
        same prefix, if any, answers lookups from now on."""
        h = self.block_hash[b]
        assert h is not None, f"block {b} holds no prefix"
        self.block_hash[b] = None
        more = self._more.get(h)
        if self.cached[h] == b:
            if more:
                self.cached[h] = more.pop(0)
            else:
                del self.cached[h]
        else:
            assert more is not None, f"block {b} is not a holder of its prefix"
            more.remove(b)
        if more is not None and not more:
            del self._more[h]

    def cached_block_ids(self) -> list[int]:
        """Every block holding a cached prefix (in use or free)."""
        out = list(self.cached.values())
        for more in self._more.values():
            out.extend(more)
        return out

    @property
    def num_used(self) -> int:
        return self.num_blocks - self.num_free


def blocks_for(num_tokens: int, block_size: int) -> int:
    """Blocks needed to hold `num_tokens` tokens."""
    return -(-num_tokens // block_size)


NULL = -1  # a window group's place whose block has been freed (vLLM's null block)

# (full-attention groups, window groups, window in tokens): how a model's layers share the pool
# (sim.model.costmodel.kv_groups); None when every layer keeps the whole context.
KVGroups = tuple[int, int, int]


def window_start(num_tokens: int, window: int, block_size: int) -> int:
    """The first block a window group keeps once `num_tokens` tokens are computed: the one
    holding the earliest position the next query's window reaches (`slide` frees those
    before it)."""
    return max(num_tokens + 1 - window, 0) // block_size


def blocks_held(num_tokens: int, block_size: int, groups: KVGroups | None) -> int:
    """Blocks a request holds once `num_tokens` tokens are computed and its window groups have
    slid: the whole context in each full-attention group, in each window group only the blocks
    from `window_start` on."""
    n = blocks_for(num_tokens, block_size)
    if groups is None:
        return n
    full, win, window = groups
    return full * n + win * (n - min(window_start(num_tokens, window, block_size), n))


def arrival_blocks(prompt_len: int, max_output_tokens: int, block_size: int,
                   groups: KVGroups | None, chunk_tokens: int) -> int:
    """The blocks a request must be able to hold at once, or it could never run (rejected on
    arrival): those of its prompt and all but its last output token (never held), and with
    layer groups its peak, a step's chunk sitting whole in each window group until the step
    ends, beside the blocks that group keeps of one window. The largest chunk is of a
    recompute after a preemption, which computes the prompt and the outputs so far: at most
    `chunk_tokens` of them (0: all of them, in one step)."""
    total = prompt_len + max_output_tokens - 1
    n = blocks_for(total, block_size)
    if groups is None:
        return n
    full, win, window = groups
    chunk = min(total, chunk_tokens) if chunk_tokens else total
    span = blocks_for(window - 1, block_size)
    return full * n + win * min(n, span + 2 + blocks_for(chunk, block_size))


class KVCacheManager:
    """Grows and frees requests' block tables over a BlockPool.

    A request's `block_table` always covers its `num_computed_tokens` (plus the tokens of the
    step being scheduled) and nothing more than one partial block beyond.
    """

    def __init__(self, num_blocks: int, block_size: int, sharing: bool = False,
                 num_host_blocks: int = 0, prefix_caching: bool = False,
                 hash_block_size: int = 512, *, register_at_allocation: bool = False,
                 uncached_first: bool = False, duplicates: bool = False,
                 groups: KVGroups | None = None) -> None:
        """`register_at_allocation`, `uncached_first` and `duplicates` are vLLM V1's behaviours
        (see `BlockPool` and `cache_scheduled`); a scenario's `[kv]` section turns them on by
        default, this class does not. `groups`: the layer groups of a model with sliding-window
        layers (module docstring); None: one table per request holds every layer."""
        self.block_size = block_size
        self.groups = groups
        self.hybrid = groups is not None
        full, win, window = groups if groups is not None else (1, 0, 0)
        self.num_tables = full + win  # tables per request
        self.full_groups = full
        self.window = window
        # A prefix-cache hit ends with this many cached blocks in each window group (the
        # positions the next query's window reaches, itself aside: vLLM's rule).
        self.window_span = blocks_for(window - 1, block_size) if window else 0
        self.prefix_caching = prefix_caching
        self.pool = BlockPool(num_blocks, sharing or prefix_caching,
                              uncached_first=uncached_first, duplicates=duplicates)
        # Whether full blocks enter the prefix cache when the step filling them is scheduled
        # (else after it has run): the policy then calls `cache_scheduled`.
        self.register_at_allocation = prefix_caching and register_at_allocation
        self.hash_block_size = hash_block_size
        self._chains: dict[tuple, int] = {}  # (parent chain id, hash id) -> chain id
        self.hit_tokens = 0
        self.query_tokens = 0
        # Host memory for preemption by swap; None when there is none.
        self.host = BlockPool(num_host_blocks) if num_host_blocks > 0 else None

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free

    @property
    def num_used_blocks(self) -> int:
        return self.pool.num_used

    def allocate_slots(self, req: Request, num_new_tokens: int, reserve: int = 0,
                       prefix: list[int] | None = None, full_sequence: bool = False) -> bool:
        """Grow `req.block_table` to hold `num_new_tokens` more tokens.

        `prefix` (from `match_prefix`, for a request with nothing computed) are cached blocks
        that become the start of its table, their tokens counted as computed. Returns False,
        changing nothing, if that would leave fewer than `reserve` blocks free, or, with
        `full_sequence` (vLLM's admission gate), if the blocks for all of `req`'s tokens so far
        would not fit while leaving `reserve` free.
        """
        if self.hybrid:
            return self._allocate_groups(req, num_new_tokens, reserve, prefix or [],
                                         full_sequence)
        if full_sequence:
            pool = self.pool
            hits = prefix or ()
            need = blocks_for(req.num_tokens, self.block_size) - len(hits) - len(req.block_table)
            # Hit blocks that sit free in the cache stop being free when taken.
            taken_free = sum(1 for b in hits if pool.ref_cnt[b] == 0)
            if max(need, 0) + taken_free + reserve > pool.num_free:
                return False
        if prefix:
            return self._allocate_with_prefix(req, num_new_tokens, reserve, prefix)
        need = (-(-(req.num_computed_tokens + num_new_tokens) // self.block_size)
                - len(req.block_table))
        if need <= 0:
            return True
        if need + reserve > self.pool.num_free:
            return False
        req.block_table.extend(self.pool.allocate(need))
        return True

    def _allocate_with_prefix(self, req: Request, n: int, reserve: int,
                              prefix: list[int]) -> bool:
        pool = self.pool
        cached = len(prefix) * self.block_size
        need = blocks_for(cached + n, self.block_size) - len(prefix)
        taken_free = sum(1 for b in prefix if pool.ref_cnt[b] == 0)
        if need + reserve > pool.num_free - taken_free:
            return False
        for b in prefix:
            pool.share(b)
        req.block_table = list(prefix)
        req.block_table.extend(pool.allocate(need))
        req.num_computed_tokens = cached
        req.num_cached_tokens += cached
        req.cached_upto = len(prefix)
        self.hit_tokens += cached
        return True

    # --- layer groups (a model with sliding-window layers) ---------------------------------------
    def _allocate_groups(self, req: Request, n: int, reserve: int, prefix: list[int],
                         full_sequence: bool) -> bool:
        """`allocate_slots` over every group's table: each grows by the blocks the first one
        does (a window group's freed places included), all or nothing."""
        pool, bs, k = self.pool, self.block_size, self.num_tables
        hits: list[list[int]] = self._group_hits(req, len(prefix)) if prefix else []
        held = len(req.block_table)
        start = len(prefix) if prefix else held
        computed = len(prefix) * bs if prefix else req.num_computed_tokens
        need = max(blocks_for(computed + n, bs) - start, 0)
        taken_free = 0
        if prefix:
            ref = pool.ref_cnt
            taken_free = sum(1 for b in prefix if ref[b] == 0)
            for t in hits:
                taken_free += sum(1 for b in t if b >= 0 and ref[b] == 0)
        if full_sequence:  # (what it will hold once its tokens so far are in, windows slid)
            now = (len(prefix) * self.full_groups + sum(1 for t in hits for b in t if b >= 0)
                   if prefix else len(self.held_blocks(req)))
            ahead = blocks_held(req.num_tokens, bs, self.groups) - now
            if max(need * k, ahead) + taken_free + reserve > pool.num_free:
                return False
        if need * k + taken_free + reserve > pool.num_free:
            return False
        if prefix:
            for b in prefix:
                pool.share(b)
            for t in hits:
                for b in t:
                    if b >= 0:
                        pool.share(b)
            req.block_table = list(prefix)
            req.group_tables = hits
            cached = len(prefix) * bs
            req.num_computed_tokens = cached
            req.num_cached_tokens += cached
            req.cached_upto = len(prefix)
            self.hit_tokens += cached
        elif req.group_tables is None:
            req.group_tables = [[] for _ in range(k - 1)]
        if need:
            req.block_table.extend(pool.allocate(need))
            for t in req.group_tables:
                t.extend(pool.allocate(need))
        return True

    def slide(self, req: Request) -> None:
        """Free the blocks of `req`'s window groups that hold no position the window of its
        next query reaches (its place becomes NULL), nearest first, as vLLM's
        `remove_skipped_blocks`. Full-attention tables keep everything."""
        first = window_start(req.num_computed_tokens, self.window, self.block_size)
        tables = req.group_tables
        if first <= 0 or tables is None:
            return
        gone: list[int] = []
        for t in tables[self.full_groups - 1:]:
            i = min(first, len(t)) - 1
            while i >= 0 and t[i] != NULL:
                gone.append(t[i])
                t[i] = NULL
                i -= 1
        if gone:
            self.pool.free(gone)

    def held_blocks(self, req: Request) -> list[int]:
        """The blocks `req` holds in every group (NULL places left out)."""
        out = list(req.block_table)
        for t in req.group_tables or ():
            out.extend([b for b in t if b != NULL])
        return out

    def token_slots(self, req: Request) -> tuple[int, int]:
        """(slots of the blocks `req` holds, tokens they hold), over every group, its window
        groups slid (`slide`: their first places NULL, as many in each)."""
        bs, c = self.block_size, req.num_computed_tokens
        n = len(req.block_table)
        if req.group_tables is None:
            return n * bs, c
        full = self.full_groups
        win = self.num_tables - full
        gone = min(window_start(c, self.window, bs), n)
        return ((full * n + win * (n - gone)) * bs,
                full * c + win * max(c - gone * bs, 0))

    def _group_key(self, req: Request, g: int, j: int):
        """The prefix-cache key of block `j` in group `g` (group 0: `block_key`'s)."""
        keys = req.block_keys
        key = keys[j] if keys is not None and j < len(keys) else self.block_key(req, j)
        return key if g == 0 else (g, key)

    def _group_hits(self, req: Request, n: int) -> list[list[int]]:
        """The other groups' tables of a hit of `n` blocks (`hybrid_hit` found them cached)."""
        cached, span, out = self.pool.cached, self.window_span, []
        for g in range(1, self.num_tables):
            if g < self.full_groups:
                out.append([cached[self._group_key(req, g, j)] for j in range(n)])
            else:
                lo = max(n - span, 0)
                out.append([NULL] * lo + [cached[self._group_key(req, g, j)]
                                          for j in range(lo, n)])
        return out

    def hybrid_hit(self, req: Request, n: int) -> int:
        """Of a hit of `n` blocks in the first group, the longest every group shares: the
        other full-attention groups hold its every block, the window groups its last
        `window_span` (vLLM's hybrid coordinator: the window type searched right to left)."""
        cached = self.pool.cached
        for g in range(1, self.full_groups):
            for j in range(n):
                if self._group_key(req, g, j) not in cached:
                    n = j
                    break
        span = self.window_span
        if span <= 0:
            return n
        run = 0
        for j in range(n - 1, -1, -1):
            if all(self._group_key(req, g, j) in cached
                   for g in range(self.full_groups, self.num_tables)):
                run += 1
                if run >= span:
                    return j + run
            else:
                run = 0
        return run

    # --- prefix cache ------------------------------------------------------------------------
    def block_key(self, req: Request, j: int, chains: list[int] | None = None):
        """The content key of full block `j` of `req`: equal keys mean equal tokens in this
        block and every block before it (what vLLM's chained block hash stands for).
        `chains` are the request's `hash_chains()`, when already at hand."""
        bs = self.block_size
        end = (j + 1) * bs
        if end <= req.prompt_len:
            text = req.prompt_text
            if text is not None:
                if end <= len(text):
                    return ("t", text[:end])
            else:
                sp = req.shared_prefix
                if sp is not None and sp[0] >= 0 and end <= sp[1]:  # group -1: none
                    return ("s", sp[0], j)
                h = req.hash_ids
                if h:
                    seg = (end - 1) // self.hash_block_size
                    if seg < len(h):
                        if chains is None:
                            chains = self.hash_chains(h)
                        return ("h", chains[seg], j)
        if req.session >= 0:  # a conversation's turns share its stream, outputs included
            return ("c", req.session, j)
        if end <= req.prompt_len and req.parent_id is not None:
            return ("u", req.parent_id, j)  # a further sample shares its request's prompt
        return ("u", req.req_id, j)

    def hash_chains(self, h: tuple) -> list[int]:
        """An id per prefix h[0..s] of a request's 512-token hash blocks: equal ids, equal
        prefixes."""
        table = self._chains
        out, cid = [], -1
        for x in h:
            k = (cid, x)
            nxt = table.get(k)
            if nxt is None:
                nxt = table[k] = len(table)
            cid = nxt
            out.append(cid)
        return out

    def match_prefix(self, req: Request) -> list[int]:
        """Cached blocks holding the longest prefix of `req`'s tokens (none when caching is off
        or the request already has tokens computed). Leaves at least one token to compute, so
        the step that completes the prompt can sample. Takes nothing yet."""
        if not self.prefix_caching or req.num_computed_tokens:
            return []
        bs = self.block_size
        keys = req.block_keys
        if keys is None:
            chains = self.hash_chains(req.hash_ids) if req.hash_ids else None
            keys = req.block_keys = [self.block_key(req, j, chains)
                                     for j in range((req.prompt_len - 1) // bs)]
        cached = self.pool.cached
        hits = []
        # Past the prompt (a request re-prefilling after preemption), its own output blocks.
        for j in range((req.num_tokens - 1) // bs):
            b = cached.get(keys[j] if j < len(keys) else self.block_key(req, j))
            if b is None:
                break
            hits.append(b)
        if self.hybrid and hits:
            del hits[self.hybrid_hit(req, len(hits)):]
        return hits

    def cache_blocks(self, req: Request, num_tokens: int) -> None:
        """Register the full blocks among `req`'s first `num_tokens` tokens in the prefix
        cache (those not registered yet)."""
        full = num_tokens // self.block_size
        j = req.cached_upto
        if j >= full:
            return
        keys, table, set_hash = req.block_keys, req.block_table, self.pool.set_hash
        if self.hybrid:
            for g, t in enumerate(req.group_tables or (), 1):
                for i in range(j, full):
                    if t[i] != NULL:
                        set_hash(t[i], self._group_key(req, g, i))
        for j in range(j, full):
            set_hash(table[j], keys[j] if keys is not None and j < len(keys)
                     else self.block_key(req, j))
        req.cached_upto = full

    def cache_scheduled(self, req: Request, num_new_tokens: int, num_unknown: int = 0) -> None:
        """`req` is scheduled to compute `num_new_tokens` tokens: register the blocks they
        fill now (vLLM V1 caches at allocation, so a request admitted later in the same step
        shares them), except blocks holding any of its last `num_unknown` tokens, which the
        scheduler has not seen yet (with async scheduling, the token sampled by the step still
        running)."""
        self.cache_blocks(req, min(req.num_computed_tokens + num_new_tokens,
                                   req.num_tokens - num_unknown))

    def free(self, req: Request) -> None:
        """Release every block `req` holds, on the device (tail first) and on the host, and
        empty its tables. Cached blocks stay in the cache until evicted."""
        req.cached_upto = 0
        if req.block_table:
            self.pool.free_table(req.block_table)
            req.block_table = []
        if req.group_tables is not None:
            for t in req.group_tables:
                if t and t[0] == NULL:  # (a window group's slid places hold nothing)
                    self.pool.free([b for b in reversed(t) if b != NULL])
                elif t:
                    self.pool.free_table(t)
            req.group_tables = None
        if req.host_table:
            self._host().free(req.host_table)
            req.host_table = []

    def _host(self) -> BlockPool:
        """The host swap pool (a request holds host blocks only where there is one)."""
        assert self.host is not None, "no host swap space"
        return self.host

    def reserve_contiguous(self, req: Request, num_tokens: int) -> bool:
        """Give `req` (holding nothing) a run of consecutive blocks for `num_tokens` tokens,
        first fit, as systems before PagedAttention did. Returns False when no run is long
        enough, however many blocks are free in total (external fragmentation)."""
        n = blocks_for(num_tokens, self.block_size)
        starts, lengths = self.pool.free_runs()
        fit = np.flatnonzero(lengths >= n)
        if not len(fit):
            return False
        self.pool.enable_sharing()
        first = int(starts[fit[0]])
        for b in range(first, first + n):
            self.pool.share(b)
        req.block_table = list(range(first, first + n))
        return True

    def swap_out(self, req: Request) -> list[tuple[int, int]] | None:
        """Move `req`'s blocks to host memory. Returns the (device, host) block pairs to copy,
        or None (nothing moved) when the host pool lacks room."""
        n = len(req.block_table)
        need = blocks_for(req.num_computed_tokens, self.block_size)
        if n > need + 1:  # a contiguous reservation: only the blocks holding its K/V move
            n = need
        if self.host is None or n > self.host.num_free:
            return None
        host = self.host.allocate(n)
        pairs = list(zip(req.block_table, host))
        req.cached_upto = 0  # back on other device blocks, registered again as they fill
        self.pool.free(reversed(req.block_table))
        req.block_table = []
        req.host_table = host
        return pairs

    def swap_in(self, req: Request) -> list[tuple[int, int]]:
        """After `allocate_slots` gave a swapped request device blocks again: release its host
        blocks. Returns the (host, device) block pairs to copy back."""
        pairs = list(zip(req.host_table, req.block_table))
        self._host().free(req.host_table)
        req.host_table = []
        return pairs
