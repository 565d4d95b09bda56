"""The engine's stepping hot path: a single step, a run of identical decode steps, their block
allocation, timeline rows and step times.

These are `Engine` methods moved out of the class so that the install can compile them with
mypyc (`sim/_compiled.py`; a compiled class could not be subclassed, wrapped or patched as
`Engine` is). Each takes the engine as `e` and reaches the rest of it through attributes, so a
subclass's override (`sim.cluster`'s engines) or a patched method still takes effect; `Engine`
calls them through its own methods of the same names. The requests' fields are typed, which is
what compiled code reads fast. The results are the same bits either way
(tests/test_compiled.py runs both).
"""

from __future__ import annotations

import math
import time
from itertools import accumulate
from typing import Any

import numpy as np

from sim import events as ev
from sim.request import Request, RequestState

RS = RequestState
INF = math.inf


def schedule_decodes(e: Any) -> list[Request] | None:
    """What the policy would schedule once `_decodes_follow`: the running batch, each
    request whose table is full given the block its next token needs, in batch order as
    `schedule_running` allocates them. None, changing nothing, when blocks are short."""
    bs = e.block_size
    running = e.policy.running
    # (async scheduling: requests that finished in the last step hold their seats until
    # the run's first step is scheduled, as schedule_running skips them)
    reqs = ([r for r in running if r.state is RS.RUNNING] if e._releasing
            else list(running))
    if not reqs:
        return None
    full = [r for r in reqs if len(r.block_table) * bs == r.num_computed_tokens]
    if full:
        if len(full) > e.kv.num_free_blocks:
            return None
        for r, blk in zip(full, e.kv.pool.allocate(len(full))):
            r.block_table.append(blk)
    return reqs


def single_step(e: Any, sched: list[tuple[Request, int]], num_waiting: int) -> int:
    # What the service-time model needs: prefill chunks and decodes apart (separate
    # attention kernels), and the rows that sample (the LM head runs on those only).
    tokens = p_tokens = p_attended = p_cached = d_seqs = d_cached = sampling = 0
    is_prefill = []
    for req, n in sched:
        c = req.num_computed_tokens
        tokens += n
        chunk = n > 1 or req.num_output_tokens == 0 or c + n < req.num_tokens or req.recomputing
        is_prefill.append(chunk)
        if chunk:
            p_tokens += n
            p_attended += n * c + n * (n + 1) // 2
            p_cached += c
        else:
            d_seqs += 1
            d_cached += c
        if c + n >= req.num_tokens:
            sampling += 1
    dur, energy = e.cost.step(p_tokens, p_attended, p_cached, d_seqs, d_cached,
                                 len(sched), sampling)
    swapped = len(e._swap_out) + len(e._swap_in)
    if swapped:  # block copies over the host link delay the step
        extra = e.cost.swap_time(swapped)
        dur += extra
        energy += e.cost.idle_energy(extra)
    sampled_ids = None
    if e.executor is not None:
        t0 = time.perf_counter()
        sampled_ids = e.executor.execute(e._build_work(sched))
        measured = time.perf_counter() - t0
        e._freed = []
        if e.clock == "measured":
            dur, energy = measured, energy * measured / dur
    if e.duration_override is not None:
        dur = next(e.duration_override)
    e._swap_out, e._swap_in, e._copies = [], [], []
    start = e.now
    end = start + dur
    g = e.step_count  # this step's row on the timeline
    sampled = itl = 0
    prefilling = False
    prefill_chunks, decodes, first, recomputed, finished = [], [], [], [], []
    tokens_out: dict[int, list[int]] = {}  # (with real compute)
    caching = e.prefix_caching and not e.kv.register_at_allocation
    for (req, n), chunk in zip(sched, is_prefill):
        c = req.num_computed_tokens
        total = req.prompt_len + req.num_output_tokens  # (num_tokens, without the call)
        req.num_computed_tokens = c + n
        if caching:  # blocks enter the cache once computed (else when scheduled)
            e.kv.cache_blocks(req, c + n)
        if chunk:
            req.prefill_chunks.append((end, c, n))
            prefill_chunks.append((req.req_id, c, n))
        else:
            decodes.append(req.req_id)
        if c + n < total:
            prefilling = True
            continue
        sampled += 1
        if sampled_ids is not None:
            tok = sampled_ids[req.req_id]
            req.output_token_ids.append(tok)
            tokens_out[req.req_id] = [tok]
        req.num_output_tokens += 1
        segs = req.token_segments
        if req.num_output_tokens == 1:
            req.first_token_time = end
            if req.parent_id is None:
                e.ttft.add(end - req.arrival_time)
                e._recent(e.recent_ttfts, end, end - req.arrival_time)
            first.append(req)
            segs.append([g, 1])
            # (preempted before its first token: counted as re-prefilling until the next)
            prefilling = prefilling or req.recomputing
        else:
            last = segs[-1]
            if last[0] + last[1] == g:
                last[1] += 1
                itl += 1
            else:
                e._gap(end, end - req.last_token_time)
                segs.append([g, 1])
            if req.recomputing:  # its re-prefill after a preemption is done
                req.recomputing = False
                recomputed.append(req)
        req.last_token_time = end
        if req.num_output_tokens >= req.max_output_tokens:
            finished.append(req)
    # Every request of the batch (finishing aside) decodes in the next step, as the
    # policy's `schedule_running` tests it.
    e._batch_decodes = (not prefilling and len(sched) + len(e._releasing)
                           == len(e.policy.running))
    if e.num_samples > 1:
        for req in first:
            if req.parent_id is None and req not in finished:
                sampled += e._fork(req, end, g)
    if e.record_timeline:
        e.timeline.add_row(end, dur, tokens, p_tokens, len(sched), sampled, itl,
                              e.kv.num_used_blocks, empty_slots(e), energy,
                              num_waiting)
    e.now = end
    e.step_count += 1
    e.counts["output_tokens"] += sampled
    if e.record_events:
        e._emit_steps(ev.Steps(start, g, np.array([end]), tuple(prefill_chunks),
                                  tuple(decodes),
                                  tokens_out if sampled_ids is not None else None,
                                  e.kv.num_used_blocks,
                                  np.array([dur]) if e.clock == "measured" else None))
        for req in first:
            e.events.append(ev.FirstToken(end, req.req_id))
        for req in recomputed:
            e.events.append(ev.Recomputed(end, req.req_id))
    if e._releasing:
        e._release()
    if finished:
        e._finish_step(finished, end)
    return 1


def decode_run(e: Any, reqs: list[Request], until: float, max_steps: int) -> int:
    """Run identical decode-only steps of `reqs` (the first one scheduled, its blocks
    allocated), up to the next event, all at once."""
    bs = e.block_size
    b = len(reqs)
    # Block boundaries crossed in steps 1..kmax-1 (step 0's blocks are already allocated):
    # a request needs a new block at step j when its token computed + j lies past the end
    # of its table, which holds at least step 0's token (a contiguous reservation holds
    # far more), then every bs steps. (One loop: three comprehensions cost twice.)
    kmax = min(max_steps, e.RUN_STEPS_MAX)
    c0 = 0  # tokens the batch holds
    first_cross: list[int] = []
    add = first_cross.append
    for r in reqs:
        c = r.num_computed_tokens
        c0 += c
        add(len(r.block_table) * bs - c)
        left = r.max_output_tokens - r.num_output_tokens
        if left < kmax:
            kmax = left
    # Requests that finished in the last step (async scheduling) give their blocks back
    # once this run's first step is scheduled: before step 1 allocates.
    pending = e._releasing
    if kmax > 1:
        free = e.kv.num_free_blocks
        need = sum([(kmax - 1 - j) // bs + 1 for j in first_cross if j < kmax])
        if need > free and pending:
            free += e._blocks_freed_by(pending)
        if need > free:
            cross = sorted([j for j0 in first_cross for j in range(j0, kmax, bs)])
            kmax = cross[free]  # the step whose allocation would fail is scheduled alone
    if kmax == 1:
        return e._single_step([(r, 1) for r in reqs], len(e.policy.waiting))
    # (within a multi-step window, arrivals and cancellations do not end the run)
    t_ext = min(INF if e._window else e._next_external(), until,
                e.policy.next_change_time())
    ends, dur, energy = run_times(e, b, c0, kmax, t_ext)
    k = len(ends)
    used_first = e.kv.num_used_blocks
    empty_first = 0  # the step-0 slots of the finishing requests, beyond their freed blocks
    if pending:
        empty_first = sum([len(r.block_table) * bs - r.num_computed_tokens for r in pending])
        e._release()
        empty_first -= bs * (used_first - e.kv.num_used_blocks)
    used = e.kv.num_used_blocks
    kv_used = allocate_run(e, reqs, first_cross, k)
    # Empty slots after the run over the batch (every request holding blocks): those its
    # tables had beyond its tokens, plus the blocks taken, less the tokens computed.
    used_end = kv_used[-1]
    empty_end = sum(first_cross) + bs * (used_end - used) - b * k
    kv_used[0] = used_first  # (a run of one step: kv_used[-1] is this row too)
    g = e.step_count  # the run's first row on the timeline
    end = ends[-1]
    first_end = ends[0]
    itl0 = 0
    finished = []
    caching = e.prefix_caching
    # Registered when scheduled, a block holding the run's last token waits, under async
    # scheduling, for the next step (the scheduler has not seen that token yet).
    unseen = 1 if e.kv.register_at_allocation and e.policy.async_scheduling else 0
    for r in reqs:
        r.num_computed_tokens += k
        r.num_output_tokens += k
        if caching:
            e.kv.cache_blocks(r, r.num_computed_tokens - unseen)
        last = r.token_segments[-1]
        if last[0] + last[1] == g:
            last[1] += k
            itl0 += 1
        else:
            e._gap(first_end, first_end - r.last_token_time)
            r.token_segments.append([g, k])
        r.last_token_time = end
        if r.num_output_tokens >= r.max_output_tokens:
            finished.append(r)
    if e.record_timeline:
        record_run(e, ends, dur, energy, kv_used, b, itl0, empty_end - bs * used_end,
                         empty_first)
    if e.record_events:
        e._emit_steps(ev.Steps(e.now, g, np.asarray(ends), (),
                                  tuple([r.req_id for r in reqs]), None, kv_used[-1]))
    e.now = end
    e.step_count += k
    e.counts["output_tokens"] += b * k
    if finished:
        e._finish_step(finished, end)
    return k


def allocate_run(e: Any, reqs: list[Request], first_cross: list[int], k: int) -> list[int]:
    """Allocate the blocks the `k` steps of a decode run cross (request i first at step
    `first_cross[i]`, then every block_size steps) in the order step-by-step scheduling
    would: by step, then batch order. Returns the used blocks after each step's
    allocation."""
    bs = e.block_size
    used = e.kv.num_used_blocks
    first = sorted([(j0, i) for i, j0 in enumerate(first_cross) if j0 < k])
    if not first:
        return [used] * k
    if k <= bs:  # (the common case: one block each at most)
        blocks = e.kv.pool.allocate(len(first))
        for (_, i), blk in zip(first, blocks):
            reqs[i].block_table.append(blk)
    elif first[-1][0] - first[0][0] < bs:
        # First crossings within one block's span (always, short of contiguous
        # reservations): the order is round by round (a round is every request's next
        # crossing), each round in (first crossing, batch) order, only the last one cut
        # short; so the request ranked p of the m that cross takes blocks p, p + m, ...
        blocks = e.kv.pool.allocate(sum([(k - 1 - j0) // bs + 1 for j0, _ in first]))
        m = len(first)
        for p, (_, i) in enumerate(first):
            reqs[i].block_table.extend(blocks[p::m])
    else:
        cross = sorted([(j, i) for j0, i in first for j in range(j0, k, bs)])
        blocks = e.kv.pool.allocate(len(cross))
        for (_, i), blk in zip(cross, blocks):
            reqs[i].block_table.append(blk)
    # Blocks taken at step j: those first crossing at j, j - bs, j - 2 bs, ...
    if k <= e.SCALAR_STEPS:  # (NumPy's per-call cost would dominate)
        at = [0] * k
        for j0, _ in first:
            at[j0] += 1
        for j in range(bs, k):
            at[j] += at[j - bs]
        at[0] += used
        return list(accumulate(at))
    rounds = -(-k // bs)
    taken = np.zeros(rounds * bs, dtype=np.int64)  # (np.pad costs 0.3 ms a call)
    taken[:k] = np.bincount([j0 for j0, _ in first], minlength=k)
    taken = taken.reshape(rounds, bs).cumsum(axis=0).ravel()[:k]
    return (used + np.cumsum(taken)).tolist()


def record_run(e: Any, ends, dur, energy, kv_used: list, b: int, itl0: int,
                empty_less_used: int, empty_first: int = 0) -> None:
    """The timeline rows of a decode run of `len(ends)` steps of `b` sequences, which end
    with `empty_less_used` + block_size * (blocks used) empty slots (`empty_first` more in
    its first step, held by requests released after it)."""
    k, bs = len(ends), e.block_size
    waiting = len(e.policy.waiting)
    # Empty slots after step j: those at the end, plus the tokens of later steps, minus
    # the slots of blocks allocated later.
    if k <= e.SCALAR_STEPS:
        e0 = empty_less_used + b * (k - 1)  # (step j: e0 - b*j + bs*used_j)
        rows = [(ends[j], dur[j], b, 0, b, b, itl0 if j == 0 else b, kv_used[j],
                 e0 - b * j + bs * kv_used[j], energy[j], waiting) for j in range(k)]
        if empty_first:  # step 0 also counts the finishing requests' slots
            rows[0] = (*rows[0][:8], rows[0][8] + empty_first, *rows[0][9:])
        e.timeline.add_rows(rows)
    else:
        itl = np.full(k, b, dtype=np.int64)
        itl[0] = itl0
        used = np.asarray(kv_used, dtype=np.int64)
        empty = empty_less_used + b * np.arange(k - 1, -1, -1) + bs * used
        empty[0] += empty_first
        e.timeline.append(end=ends, dur=dur, tokens=b, prefill_tokens=0, batch=b,
                             sampled=b, itl_count=itl, kv_used=used, kv_empty=empty,
                             energy=energy, waiting=waiting)


def run_times(e: Any, b: int, c0: int, kmax: int, t_ext: float):
    """End times, durations and energies of the steps of a decode run of `b` sequences
    holding `c0` cached tokens, at most `kmax` steps, none starting at or after `t_ext`.

    Step j reads c0 + b*j cached tokens. The clock advances by sequential addition in both
    the scalar and the NumPy part, so the times equal those of single steps exactly.
    """
    ends, durs, ens = e.cost.decode_times(b, c0, min(kmax, e.SCALAR_STEPS), e.now,
                                             t_ext)
    j = len(ends)
    t = ends[-1]
    if j == kmax or t >= t_ext:  # (the next step would start at or after the next event)
        return ends, durs, ens
    d, en = e.cost.decode_steps(b, c0 + b * np.arange(j, kmax, dtype=np.int64))
    e = np.cumsum(np.concatenate(([t], d)))[1:]
    m = len(d)
    if m > 1 and e[m - 2] >= t_ext:
        m = 1 + int(np.searchsorted(e[: m - 1], t_ext, side="left"))
    return (np.concatenate((ends, e[:m])), np.concatenate((durs, d[:m])),
            np.concatenate((ens, en[:m])))


def empty_slots(e: Any) -> int:
    """Allocated slots holding no token, over every request holding device blocks.
    (A shared block is full, so counting it once per sharer adds nothing.)"""
    slots = tokens = 0
    for r in e.policy.running:
        slots += len(r.block_table)
        tokens += r.num_computed_tokens
    return slots * e.block_size - tokens
