"""The engine's hot path: each scheduling decision (`advance`), its single step or run of
identical decode steps, their block allocation, timeline rows and step times, arrivals and
finishes, and the policy's pass over the running batch (`schedule_running`).

These are `Engine` (and `Policy`) methods moved out of the classes so that the install can
compile them with mypyc (`sim/_compiled.py`; a compiled class could not be subclassed, wrapped
or patched as `Engine` is). Each takes the engine as `e` and reaches the rest of it through
attributes; the engine's methods of the same names call them. Where a subclass overrides or a
caller patches an engine method (`sim.cluster`'s `_single_step`, `sim.fit`'s `_admit`), these
functions call it through the engine (`e._single_step`, `e._decode_run`, `e._admit`, and the
rarer hooks); the others call each other directly. The requests' fields are typed, which is
what compiled code reads fast. The results are the same bits either way
(tests/test_compiled.py runs both).
"""

from __future__ import annotations

import heapq
import math
import time
from collections import deque
from itertools import accumulate
from typing import Any, Final

import numpy as np

from sim import events as ev
from sim.errors import EngineError
from sim.kv import KVCacheManager, blocks_for
from sim.limits import MAX_TIME_S
from sim.request import Request, RequestState
from sim.timeline import Timeline

RS = RequestState
INF = math.inf
# (module constants: compiled code reads these without an attribute lookup on the enum)
RUNNING: Final = RS.RUNNING
WAITING: Final = RS.WAITING
SWAPPED: Final = RS.SWAPPED
FINISHED: Final = RS.FINISHED
REJECTED: Final = RS.REJECTED


def schedule_decodes(e: Any) -> list[Request] | None:
    """What the policy would schedule once `_decodes_follow`: the running batch, each
    request whose table is full given the block its next token needs, in batch order as
    `schedule_running` allocates them. None, changing nothing, when blocks are short."""
    kv: KVCacheManager = e.kv
    bs: int = e.block_size
    running: list[Request] = e.policy.running
    # (async scheduling: requests that finished in the last step hold their seats until
    # the run's first step is scheduled, as schedule_running skips them)
    reqs = ([r for r in running if r.state is RUNNING] if e._releasing
            else list(running))
    if not reqs:
        return None
    full = [r for r in reqs if len(r.block_table) * bs == r.num_computed_tokens]
    if full:
        if len(full) > kv.num_free_blocks:
            return None
        blocks: Any = kv.pool.allocate(len(full))  # (Any: the same int objects move)
        for r, blk in zip(full, blocks):
            r.block_table.append(blk)
    return reqs


def advance(e: Any, until: float, max_steps: int, fuse: bool) -> int:
    """`Engine._advance` (which see): one scheduling decision, and the runs of decode steps
    that follow it with no choice in them."""
    now = e.now
    if now > MAX_TIME_S:  # a service-time model whose steps outrun any session
        raise EngineError(f"simulated time passed {MAX_TIME_S:g} s at step {e.step_count} "
                          f"(t = {now:.3g} s): steps or hand-offs take too long under this "
                          "scenario's [hardware] and [model]")
    policy = e.policy
    if not policy.running:
        e._window = 0
    if not e._window and (
            (e._w_next < len(e._w_arrival) and e._w_arrival[e._w_next] <= now)
            or (e._cancels and e._cancels[0][0] <= now)):
        arrive(e, now)
    if not policy.has_work():
        target = min(next_external(e), until)
        if target > now and target != INF:
            e._idle_to(target)
        return 0
    out = policy.schedule()
    sched: list[tuple[Request, int]] = out.scheduled
    if not sched and e._releasing:
        # Only requests finishing (async scheduling): their output is processed now, and
        # what their blocks and seats allow is scheduled at once, as vLLM's next iteration
        # would (nothing else arrives meanwhile).
        release(e)
        out = policy.schedule()
        sched = out.scheduled
    if not sched:
        return 0  # everything was preempted; the next decision admits again
    for req, _ in sched:
        if req.state is not RUNNING:
            e._admit(req)
    if e.scheduler_steps > 1:
        e._window = (e._window or e.scheduler_steps) if out.decode_only else 0
        if e._window:
            max_steps = min(max_steps, e._window)
    # (Swap copies still to make are charged to the next single step: a request can join a
    # running batch from outside, sim.cluster's hand-off, right after a preemption by swap.)
    if (out.decode_only and e.executor is None and e.skip_ahead and max_steps > 1
            and policy.skip_ahead_safe and e.duration_override is None
            and not (e._swap_out or e._swap_in)):
        taken = e._decode_run([r for r, _ in sched], until, max_steps)
        decoding = True  # (what is left of a run's batch decodes on)
    else:
        taken = e._single_step(sched, len(policy.waiting))
        decoding = e._batch_decodes
    if e._window:
        e._window = max(e._window - taken, 0)
    # Decisions with no choice in them follow within this one: while nothing arrives and
    # the queue is empty, the batch left after a prefill step or a run that ended with
    # requests finishing decodes on, and the policy would only say so again.
    while fuse and taken < max_steps - 1 and decodes_follow(e, until, decoding):
        reqs = schedule_decodes(e)
        if reqs is None:  # blocks are short: the policy decides (and preempts)
            break
        taken += e._decode_run(reqs, until, max_steps - taken)
        decoding = True
    return taken


def next_external(e: Any) -> float:
    """`Engine._next_external`: when the next arrival or client cancellation is due."""
    arr: list = e._w_arrival
    i: int = e._w_next
    t: Any = arr[i] if i < len(arr) else INF
    cancels: list = e._cancels
    if cancels and cancels[0][0] < t:
        t = cancels[0][0]
    return t


def decodes_follow(e: Any, until: float, decoding: bool) -> bool:
    """Whether the next decision is sure to be a run of decode steps of the whole running
    batch: nothing is due by now, the queue is empty, every running request decodes one
    token (`decoding`, as the last step left it), and the policy schedules such a batch
    as it stands (`Policy.decodes_alone`)."""
    policy = e.policy
    now = e.now
    return not (not decoding or now >= until or policy.waiting or not policy.running
                or now > MAX_TIME_S or next_external(e) <= now
                or policy.next_change_time() <= now or not policy.skip_ahead_safe
                or not policy.decodes_alone() or e.executor is not None
                or not e.skip_ahead or e.duration_override is not None
                or e._swap_out or e._swap_in or e.scheduler_steps > 1
                # (blocks cached when scheduled are registered by schedule_running)
                or e.kv.register_at_allocation)


def arrive(e: Any, now: float) -> None:
    """The workload's requests due by `now` arrive, and the client cancellations due by
    then take effect."""
    arr = e._w_arrival
    w = e.workload
    prompt, output, priority, cancel_at = e._w_cols
    while e._w_next < len(arr) and arr[e._w_next] <= now:
        i = e._w_base + e._w_next  # the request's row in the workload
        t = arr[e._w_next]
        e._w_next += 1
        if e._w_next == len(arr) and i + 1 < len(w):  # the window's end: the next one
            e._w_base = i + 1
            e._w_arrival = arr = w.arrival[i + 1:i + 1 + e.ARRIVAL_WINDOW].tolist()
            e._w_next = 0
        c = cancel_at[i]
        req = Request(i, t, prompt[i], output[i], priority=priority[i],
                      hash_ids=w.hash_ids[i] if w.hash_ids else None,
                      cancel_at=None if c != c else c)
        if w.prefix_group is not None:
            req.shared_prefix = (w.prefix_group[i].item(), w.prefix_tokens)
        on_arrival(e, req)
    while e._cancels and e._cancels[0][0] <= now:
        _, rid = heapq.heappop(e._cancels)
        due = e.requests.get(rid)  # (gone: it ended, and keep_history is off)
        if due is not None and not due.state.is_done:
            e._cancel(due, by="client")
        elif due in e._releasing:  # finished, its output not yet processed: freed now
            e._release_now(due)


def on_arrival(e: Any, req: Request) -> None:
    """`req` arrives: recorded, rejected if it could never fit, else queued."""
    kv: KVCacheManager = e.kv
    req._timeline = e.timeline
    e.requests[req.req_id] = req
    e.counts["arrived"] += 1
    if e.record_events:
        e.events.append(ev.Arrival(req.arrival_time, req.req_id, req.prompt_len,
                                      req.max_output_tokens, req.priority, req.injected))
    total = req.prompt_len + req.max_output_tokens - 1
    reason = None
    if blocks_for(total, e.block_size) > kv.num_blocks:
        reason = (f"needs {blocks_for(total, e.block_size)} blocks, "
                  f"the pool has {kv.num_blocks}")
    elif e.max_model_len and req.prompt_len + req.max_output_tokens > e.max_model_len:
        reason = f"longer than max_model_len = {e.max_model_len}"
    if reason:
        req.transition(REJECTED)
        req.reject_reason = reason
        req.finish_time = e.now
        e.counts["rejected"] += 1
        e.recent.append(req)
        if not e.keep_history:
            del e.requests[req.req_id]
        if e.record_events:
            e.events.append(ev.Reject(e.now, req.req_id, reason))
        return
    if req.cancel_at is not None:
        heapq.heappush(e._cancels, (req.cancel_at, req.req_id))
    e.policy.add(req)


def finish(e: Any, req: Request, t: float) -> None:
    """`req` has sampled its last token at `t`: it ends, its blocks and seat given back
    (after the next step is scheduled, under async scheduling)."""
    kv: KVCacheManager = e.kv
    req.transition(FINISHED)
    req.finish_time = t
    if e.policy.async_scheduling:
        e._releasing.append(req)
    else:
        kv.free(req)
        e.policy.finished(req)
    e.recent.append(req)
    e._drop(req)
    e.finished_prompt_tokens += req.prompt_len
    if req.parent_id is not None:  # a further sample: its tokens count, not its latency
        e.counts["finished_samples"] += 1
        if e.record_events:
            e.events.append(ev.Finish(t, req.req_id))
        return
    e.counts["finished"] += 1
    fold_finished(e, req, t)
    if e.record_events:
        e.events.append(ev.Finish(t, req.req_id))


def fold_finished(e: Any, req: Request, t: float) -> None:
    """Add a finished request (not a further sample) to the run's latency figures."""
    first = req.first_token_time
    assert first is not None  # (a finished request has sampled)
    ttft = first - req.arrival_time
    e2e = t - req.arrival_time
    tpot = req.tpot
    e.e2e.add(e2e)
    if tpot is not None:
        e.tpot.add(tpot)
    e.finished_output_tokens += req.num_output_tokens
    slo = e.scenario.slo
    if ((not slo.ttft_ms or ttft * 1e3 <= slo.ttft_ms)
            and (not slo.tpot_ms or tpot is None or tpot * 1e3 <= slo.tpot_ms)
            and (not slo.e2e_ms or e2e * 1e3 <= slo.e2e_ms)):
        e.slo_met += 1


def gap(e: Any, t: float, gap_s: float) -> None:
    """An ITL gap across steps that are not adjacent, its token sampled at `t`."""
    e.itl_extra.add(gap_s)
    recent(e, e.recent_gaps, t, gap_s)


def recent(e: Any, q: deque, t: float, v: float) -> None:
    """Add `(t, v)` to the rolling window `q` (the last ROLLING_S seconds)."""
    q.append((t, v))
    while q[0][0] < t - e.ROLLING_S:
        q.popleft()


def finish_step(e: Any, finished: list[Request], t: float) -> None:
    """The requests whose last token the step ending at `t` computed end."""
    for req in finished:
        finish(e, req, t)
    if (e._releasing and not e.policy.waiting
            and len(e.policy.running) == len(e._releasing)):
        # Nothing else runs or waits: the next step would schedule nothing but let vLLM
        # process this one's output, at once (short of an arrival at exactly `t`).
        release(e)


def release(e: Any) -> None:
    """Async scheduling: the step scheduled after the one that finished these requests
    has been; their output is processed now, their blocks freed and seats given back."""
    kv: KVCacheManager = e.kv
    if not e._releasing:
        return
    done: list[Request] = e._releasing
    e._releasing = []
    for req in done:
        if kv.register_at_allocation:  # the blocks its last step filled
            kv.cache_blocks(req, req.num_computed_tokens)
        kv.free(req)
        e.policy.finished(req)


def admit(e: Any, req: Request) -> None:
    """`req` joins the batch: blocks swapped out come back, its queue wait is recorded."""
    kv: KVCacheManager = e.kv
    resumed = req.state is not WAITING
    if req.state is SWAPPED:  # allocate_slots gave it device blocks: copy back
        e._swap_in.extend(kv.swap_in(req))
    elif e.prefix_caching:  # its prompt (and outputs, re-prefilling) was looked up
        kv.query_tokens += req.num_tokens
    req.transition(RUNNING)
    if req.admitted_time is None:
        req.admitted_time = e.now
        e.queue_wait.add(e.now - req.arrival_time)
    if e.record_events:
        e.events.append(ev.Admit(e.now, req.req_id, resumed))


def single_step(e: Any, sched: list[tuple[Request, int]], num_waiting: int) -> int:
    tl: Timeline = e.timeline
    kv: KVCacheManager = e.kv
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
    start: float = e.now
    end = start + dur
    g: int = e.step_count  # this step's row on the timeline
    sampled = itl = 0
    prefilling = False
    prefill_chunks, decodes, first, recomputed, finished = [], [], [], [], []
    tokens_out: dict[int, list[int]] = {}  # (with real compute)
    caching = e.prefix_caching and not kv.register_at_allocation
    for (req, n), chunk in zip(sched, is_prefill):
        c = req.num_computed_tokens
        total = req.prompt_len + req.num_output_tokens  # (num_tokens, without the call)
        req.num_computed_tokens = c + n
        if caching:  # blocks enter the cache once computed (else when scheduled)
            kv.cache_blocks(req, c + n)
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
                recent(e, e.recent_ttfts, end, end - req.arrival_time)
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
                gap(e, end, end - req.last_token_time)
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
        tl.add_row(end, dur, tokens, p_tokens, len(sched), sampled, itl,
                              kv.num_used_blocks, empty_slots(e), energy,
                              num_waiting)
    e.now = end
    e.step_count += 1
    e.counts["output_tokens"] += sampled
    if e.record_events:
        e._emit_steps(ev.Steps(start, g, np.array([end]), tuple(prefill_chunks),
                                  tuple(decodes),
                                  tokens_out if sampled_ids is not None else None,
                                  kv.num_used_blocks,
                                  np.array([dur]) if e.clock == "measured" else None))
        for req in first:
            e.events.append(ev.FirstToken(end, req.req_id))
        for req in recomputed:
            e.events.append(ev.Recomputed(end, req.req_id))
    if e._releasing:
        release(e)
    if finished:
        finish_step(e, finished, end)
    return 1


def decode_run(e: Any, reqs: list[Request], until: float, max_steps: int) -> int:
    """Run identical decode-only steps of `reqs` (the first one scheduled, its blocks
    allocated), up to the next event, all at once."""
    kv: KVCacheManager = e.kv
    bs: int = e.block_size
    b = len(reqs)
    # Block boundaries crossed in steps 1..kmax-1 (step 0's blocks are already allocated):
    # a request needs a new block at step j when its token computed + j lies past the end
    # of its table, which holds at least step 0's token (a contiguous reservation holds
    # far more), then every bs steps. (One loop: three comprehensions cost twice.)
    kmax: int = min(max_steps, e.RUN_STEPS_MAX)
    c0 = 0  # tokens the batch holds
    first_cross: list[int] = []
    for r in reqs:
        c = r.num_computed_tokens
        c0 += c
        first_cross.append(len(r.block_table) * bs - c)
        left = r.max_output_tokens - r.num_output_tokens
        if left < kmax:
            kmax = left
    # Requests that finished in the last step (async scheduling) give their blocks back
    # once this run's first step is scheduled: before step 1 allocates.
    pending: list[Request] = e._releasing
    if kmax > 1:
        free = kv.num_free_blocks
        need = sum([(kmax - 1 - j) // bs + 1 for j in first_cross if j < kmax])
        if need > free and pending:
            free += e._blocks_freed_by(pending)
        if need > free:
            cross = sorted([j for j0 in first_cross for j in range(j0, kmax, bs)])
            kmax = cross[free]  # the step whose allocation would fail is scheduled alone
    if kmax == 1:
        return e._single_step([(r, 1) for r in reqs], len(e.policy.waiting))
    # (within a multi-step window, arrivals and cancellations do not end the run)
    t_ext = min(INF if e._window else next_external(e), until,
                e.policy.next_change_time())
    ends, dur, energy = run_times(e, b, c0, kmax, t_ext)
    k = len(ends)
    used_first = kv.num_used_blocks
    empty_first = 0  # the step-0 slots of the finishing requests, beyond their freed blocks
    if pending:
        empty_first = sum([len(r.block_table) * bs - r.num_computed_tokens for r in pending])
        release(e)
        empty_first -= bs * (used_first - kv.num_used_blocks)
    used = kv.num_used_blocks
    kv_used = allocate_run(e, reqs, first_cross, k)
    # Empty slots after the run over the batch (every request holding blocks): those its
    # tables had beyond its tokens, plus the blocks taken, less the tokens computed.
    used_end = kv_used[-1]
    empty_end = sum(first_cross) + bs * (used_end - used) - b * k
    kv_used[0] = used_first  # (a run of one step: kv_used[-1] is this row too)
    g: int = e.step_count  # the run's first row on the timeline
    end = ends[-1]
    first_end = ends[0]
    itl0 = 0
    finished = []
    caching: bool = e.prefix_caching
    # Registered when scheduled, a block holding the run's last token waits, under async
    # scheduling, for the next step (the scheduler has not seen that token yet).
    unseen = 1 if kv.register_at_allocation and e.policy.async_scheduling else 0
    for r in reqs:
        r.num_computed_tokens += k
        r.num_output_tokens += k
        if caching:
            kv.cache_blocks(r, r.num_computed_tokens - unseen)
        last = r.token_segments[-1]
        if last[0] + last[1] == g:
            last[1] += k
            itl0 += 1
        else:
            gap(e, first_end, first_end - r.last_token_time)
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
        finish_step(e, finished, end)
    return k


def allocate_run(e: Any, reqs: list[Request], first_cross: list[int], k: int) -> list[int]:
    """Allocate the blocks the `k` steps of a decode run cross (request i first at step
    `first_cross[i]`, then every block_size steps) in the order step-by-step scheduling
    would: by step, then batch order. Returns the used blocks after each step's
    allocation."""
    kv: KVCacheManager = e.kv
    bs: int = e.block_size
    used = kv.num_used_blocks
    first = sorted([(j0, i) for i, j0 in enumerate(first_cross) if j0 < k])
    if not first:
        return [used] * k
    if k <= bs:  # (the common case: one block each at most)
        blocks: Any = kv.pool.allocate(len(first))  # (Any: the same int objects move)
        for (_, i), blk in zip(first, blocks):
            reqs[i].block_table.append(blk)
    elif first[-1][0] - first[0][0] < bs:
        # First crossings within one block's span (always, short of contiguous
        # reservations): the order is round by round (a round is every request's next
        # crossing), each round in (first crossing, batch) order, only the last one cut
        # short; so the request ranked p of the m that cross takes blocks p, p + m, ...
        blocks = kv.pool.allocate(sum([(k - 1 - j0) // bs + 1 for j0, _ in first]))
        m = len(first)
        for p, (_, i) in enumerate(first):
            reqs[i].block_table.extend(blocks[p::m])
    else:
        cross = sorted([(j, i) for j0, i in first for j in range(j0, k, bs)])
        blocks = kv.pool.allocate(len(cross))
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


def record_run(e: Any, ends, dur, energy, kv_used: list[int], b: int, itl0: int,
                empty_less_used: int, empty_first: int = 0) -> None:
    """The timeline rows of a decode run of `len(ends)` steps of `b` sequences, which end
    with `empty_less_used` + block_size * (blocks used) empty slots (`empty_first` more in
    its first step, held by requests released after it)."""
    tl: Timeline = e.timeline
    k = len(ends)
    bs: int = e.block_size
    waiting = len(e.policy.waiting)
    # Empty slots after step j: those at the end, plus the tokens of later steps, minus
    # the slots of blocks allocated later.
    if k <= e.SCALAR_STEPS:
        e0 = empty_less_used + b * (k - 1)  # (step j: e0 - b*j + bs*used_j)
        empty = [e0 - b * j + bs * kv_used[j] for j in range(k)]
        empty[0] += empty_first  # step 0 also counts the finishing requests' slots
        tl.add_decodes(ends, dur, b, itl0, kv_used, empty, energy, waiting)
    else:
        itl = np.full(k, b, dtype=np.int64)
        itl[0] = itl0
        used = np.asarray(kv_used, dtype=np.int64)
        empties = empty_less_used + b * np.arange(k - 1, -1, -1) + bs * used
        empties[0] += empty_first
        tl.append(end=ends, dur=dur, tokens=b, prefill_tokens=0, batch=b,
                             sampled=b, itl_count=itl, kv_used=used, kv_empty=empties,
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
    running: list[Request] = e.policy.running
    for r in running:
        slots += len(r.block_table)
        tokens += r.num_computed_tokens
    bs: int = e.block_size
    return slots * bs - tokens


def schedule_running(p: Any, out: Any, budget: Any) -> Any:
    """`Policy.schedule_running` (which see) of policy `p`: the running batch advanced in
    order within `budget` tokens, preempting while blocks run short. Returns the budget left.
    (Here to be compiled: the policy's pass over the batch every decision.)"""
    kv: KVCacheManager = p.kv
    bs = kv.block_size
    running: list[Request] = p.running
    sched: list[tuple[Request, Any]] = out.scheduled
    register = kv.register_at_allocation
    # Async scheduling: a request that sampled in the last step has a token the scheduler
    # has not seen yet, and one that finished then is skipped (it holds its seat).
    lagging: bool = p.async_scheduling
    engine = p.engine
    g: int = engine.step_count if register and lagging else 0
    skip_finished: bool = lagging and engine.has_finishing()
    all_decode = True
    finishing = 0
    i = 0
    while i < len(running) and budget > 0:
        req = running[i]
        if skip_finished and req.state is FINISHED:
            finishing += 1
            i += 1
            continue
        c = req.num_computed_tokens
        total = req.prompt_len + req.num_output_tokens
        n: Any = total - c
        if n > budget:
            n = budget
        if -(-(c + n) // bs) > len(req.block_table):
            while not kv.allocate_slots(req, n):
                victim = p.pick_victim()
                before = victim is not running[-1] and running.index(victim) < i
                _, given_back = p.preempt_one(out, victim)
                if victim is req:
                    break
                budget += given_back
                if before:  # a request earlier in the batch (priority): the index shifts
                    i -= 1
            if req.state is not RUNNING:
                all_decode = False
                if p.continue_after_self_preemption:
                    continue
                break
        sched.append((req, n))
        if register:
            segs = req.token_segments
            unseen = 1 if lagging and segs and segs[-1][0] + segs[-1][1] == g else 0
            kv.cache_scheduled(req, n, unseen)
        if n != 1 or c + 1 != total or total == req.prompt_len or req.recomputing:
            all_decode = False
        budget -= n
        i += 1
    if register and lagging:
        # The output of the last step, processed after this one is scheduled, registers
        # the blocks its tokens filled for requests this step leaves out.
        for req in running[i:]:
            kv.cache_blocks(req, req.num_computed_tokens)
    # (Requests finishing may stay beside a run of decode steps, which gives their blocks
    # back after its first step, unless that could let a waiting request in.)
    out.decode_only = (all_decode and not out.preempted
                       and len(sched) + finishing == len(running)
                       and not (finishing and p.waiting))
    return budget


def admit_waiting(p: Any, out: Any, budget: Any) -> None:
    """`ChunkedPolicy.admit_waiting` of policy `p` (which see)."""
    kv: KVCacheManager = p.kv
    full = p.cfg.reserve_full_sequence
    watermark = p.watermark_blocks()
    while p.waiting and budget > 0 and len(p.running) < p.cfg.max_num_seqs:
        req = p.next_waiting()
        n, hits = p.plan_waiting(req, budget)
        if not kv.allocate_slots(req, n, reserve=watermark if p.running else 0,
                                 prefix=hits, full_sequence=full):
            given_back = p.make_room(out, req)
            if given_back is None:
                break
            budget += given_back
            continue
        p.schedule_admitted(out, req, n)
        budget -= n
