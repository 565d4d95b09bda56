"""The engine's hot path: each scheduling decision (`advance`), its single step or run of
identical decode steps, their block allocation, timeline rows and step times, arrivals and
finishes.

These are `Engine` methods moved out of the class so that the install can compile them with
mypyc (`sim/native/compiled.py`), while `Engine` stays a Python class. Each takes the engine as `e`;
the fields it reads are declared on `EngineState` (a compiled base of `Engine`: native fields,
as the requests' are). Every scheduling rule is the policy's: the decision asks the policy
(`schedule`, `has_work`, `add`, `finished`, `decodes_alone`, `skip_ahead_safe`,
`next_change_time`) and never decides in its place. What a step scheduled is told to the
engine's observers (`sim.engine.engine.StepObserver`); the step times come from the engine's
service-time model (`sim.model.costmodel.ServiceTime`).
"""

from __future__ import annotations

import heapq
import math
import time
from collections import deque
from itertools import accumulate
from typing import Any, Final

from mypy_extensions import mypyc_attr

import numpy as np

from sim.native import compiled

from sim.engine import events as ev
from sim.model.costmodel import CostModel, beyond_window
from sim.errors import EngineError
from sim.engine.frontend import FrontEnd
from sim.engine.kv import KVCacheManager, blocks_for
from sim.engine.kv import arrival_blocks as kv_arrival_blocks
from sim.policies.batch import PolicyState
from sim.limits import MAX_TIME_S
from sim.engine.request import Request, RequestState
from sim.stats.quantiles import Samples
from sim.engine.timeline import Timeline

RS = RequestState
INF = math.inf
# (module constants: compiled code reads these without an attribute lookup on the enum)
RUNNING: Final = RS.RUNNING
WAITING: Final = RS.WAITING
SWAPPED: Final = RS.SWAPPED
FINISHED: Final = RS.FINISHED
REJECTED: Final = RS.REJECTED


# sim/native/_rows.c (a decode run's per-step rows written into the timeline's staging columns) with
# the compiled build, else None: the same in Python
_ROWS: Any = compiled.c_module("sim.native._rows")
# (its functions bound once: a call through the module looks the name up in it every time)
_decode_rows: Any = None if _ROWS is None else _ROWS.decode_rows
_used_rows: Any = None if _ROWS is None else _ROWS.used_rows
_deliver_rows: Any = None if _ROWS is None else _ROWS.deliver_rows


@mypyc_attr(allow_interpreted_subclasses=True)
class EngineState:
    """The engine's fields that the hot path reads and writes, declared with their types:
    `Engine` subclasses this, and compiled code reads them as native fields (a field of a
    plain Python object costs an attribute lookup in its dict, ~10x as much). Everything else
    (the class constants, what only the public API uses) stays on `Engine`."""

    now: float
    step_count: int
    block_size: int
    scheduler_steps: int
    max_model_len: int
    num_samples: int
    record_events: bool
    record_timeline: bool
    keep_history: bool
    skip_ahead: bool
    prefix_caching: bool
    clock: str
    kv: KVCacheManager
    timeline: Timeline
    policy: Any
    cost: Any  # a ServiceTime (sim.model.fit's recorder, or the CostModel)
    executor: Any
    duration_override: Any
    scenario: Any
    workload: Any
    events: list
    requests: dict[int, Request]
    recent: deque
    counts: dict[str, int]
    # arrivals (see Engine.__init__)
    _w_base: int
    _w_next: int
    _w_arrival: list[float]
    _w_times: Any  # every workload row's arrival time at the engine (an array)
    _w_cols: tuple
    _w_tags: Any  # a client mix: each workload row's client name (Request.tag), else None
    _slo_of: Any  # a client mix: its SLO classes, {client name: (ttft_ms, tpot_ms, e2e_ms)}
    _slo: tuple  # [slo]'s (ttft_ms, tpot_ms, e2e_ms)
    _feed: Any  # closed loop (sim.engine.users.ClosedLoop), or None: arrivals from the workload
    frontend: Any  # the API server in front (sim.engine.frontend.FrontEnd), or None
    _w_sent: Any  # an open loop behind a front end: each workload row's sent time, else None
    _admission: Any  # admission control (sim.engine.admission.Admission), or None
    _cancels: list[tuple[float, int]]
    # the step being scheduled and the ones before it
    _window: int
    _batch_decodes: bool
    _releasing: list[Request]
    _swap_out: list[tuple[int, int]]
    _swap_in: list[tuple[int, int]]
    _copies: list[tuple[int, int]]
    _freed: list[int]
    _prompt_ids: dict
    observers: list  # StepObserver: told what each step scheduled
    # the class's SCALAR_STEPS and RUN_STEPS_MAX (copied by `Engine._load_constants` when a run
    # starts: a native field reads in a few instructions, a class attribute in hundreds)
    _scalar_steps: int
    _run_steps_max: int
    # running figures
    queue_wait: Samples
    ttft: Samples
    tpot: Samples
    e2e: Samples
    itl_extra: Samples
    client_ttft: Samples
    client_itl_extra: Samples
    client_tpot: Samples
    client_e2e: Samples
    finished_prompt_tokens: int
    finished_output_tokens: int
    slo_met: int
    recent_ttfts: deque
    recent_gaps: deque


def done(e: Any) -> bool:
    """`Engine.done`: no request is queued, running or still to arrive."""
    s: EngineState = e
    policy: Any = s.policy
    return s._w_next >= len(s._w_arrival) and not policy.has_work()  # (the cheap test first)


def schedule_decodes(e: Any) -> list[Request] | None:
    """What the policy would schedule once `decodes_follow`: the running batch, each
    request whose table is full given the block its next token needs, in batch order as
    `schedule_running` allocates them. None, changing nothing, when blocks are short."""
    s: EngineState = e
    ps: PolicyState = s.policy
    kv: KVCacheManager = s.kv
    bs: int = s.block_size
    running: list[Request] = ps.running
    # (async scheduling: requests that finished in the last step hold their seats until
    # the run's first step is scheduled, as schedule_running skips them)
    reqs = ([r for r in running if r.state is RUNNING] if s._releasing
            else list(running))
    if not reqs:
        return None
    full = [r for r in reqs if len(r.block_table) * bs == r.num_computed_tokens]
    if full:
        tables: int = kv.num_tables
        if len(full) * tables > kv.num_free_blocks:
            return None
        blocks: Any = kv.pool.allocate(len(full) * tables)  # (Any: the same int objects move)
        if tables == 1:
            for r, blk in zip(full, blocks):
                r.block_table.append(blk)
        else:
            append_groups(full, blocks)
    return reqs


def advance(e: Any, until: float, max_steps: int, fuse: bool) -> int:
    """`Engine._advance` (which see): one scheduling decision, and the runs of decode steps
    that follow it with no choice in them."""
    s: EngineState = e
    ps: PolicyState = s.policy
    now = s.now
    if now > MAX_TIME_S:  # a service-time model whose steps outrun any session
        raise EngineError(f"simulated time passed {MAX_TIME_S:g} s at step {s.step_count} "
                          f"(t = {now:.3g} s): steps or hand-offs take too long under this "
                          "scenario's [hardware] and [model]")
    policy: Any = s.policy
    if not ps.running:
        s._window = 0
    if not s._window and (
            (s._w_next < len(s._w_arrival) and s._w_arrival[s._w_next] <= now)
            or (s._cancels and s._cancels[0][0] <= now)):
        arrive(e, now)
    if not policy.has_work():
        target = min(next_external(e), until)
        if target > now and target != INF:
            e._idle_to(target)
        return 0
    out = policy.schedule()
    sched: list[tuple[Request, int]] = out.scheduled
    if not sched and s._releasing:
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
            admit(e, req)
    if s.scheduler_steps > 1:
        s._window = (s._window or s.scheduler_steps) if out.decode_only else 0
        if s._window:
            max_steps = min(max_steps, s._window)
    # (Swap copies still to make are charged to the next single step: a request can join a
    # running batch from outside, sim.deploy.cluster's hand-off, right after a preemption by swap.)
    # (A measured clock records each step's duration, which a run of steps does not: with no
    # executor it times nothing and keeps the modeled durations, but one per step.)
    # The policy's `next_change_time`, asked at most once: it depends on the queue alone,
    # which this decision's runs of decode steps leave as it is (-1: not asked yet).
    change_at = -1.0
    if (out.decode_only and s.executor is None and s.skip_ahead and max_steps > 1
            and policy.skip_ahead_safe and s.duration_override is None
            and s.clock != "measured" and not (s._swap_out or s._swap_in)):
        change_at = policy.next_change_time()
        taken = decode_run(e, [r for r, _ in sched], until, max_steps, change_at)
        decoding = True  # (what is left of a run's batch decodes on)
    else:
        taken = single_step(e, sched, len(ps.waiting))
        decoding = s._batch_decodes
    if s._window:
        s._window = max(s._window - taken, 0)
    # Decisions with no choice in them follow within this one: while nothing arrives and
    # the queue is empty, the batch left after a prefill step or a run that ended with
    # requests finishing decodes on, and the policy would only say so again.
    while fuse and taken < max_steps - 1 and decodes_follow(e, until, decoding):
        if change_at < 0:
            change_at = policy.next_change_time()
        if change_at <= s.now:
            break
        reqs = schedule_decodes(e)
        if reqs is None:  # blocks are short: the policy decides (and preempts)
            break
        taken += decode_run(e, reqs, until, max_steps - taken, change_at)
        decoding = True
    return taken


def next_external(e: Any) -> float:
    """`Engine._next_external`: when the next arrival or client cancellation is due."""
    s: EngineState = e
    arr: list = s._w_arrival
    i: int = s._w_next
    t: Any = arr[i] if i < len(arr) else INF
    cancels: list = s._cancels
    if cancels and cancels[0][0] < t:
        t = cancels[0][0]
    return t


def decodes_follow(e: Any, until: float, decoding: bool) -> bool:
    """Whether the next decision is sure to be a run of decode steps of the whole running
    batch: nothing is due by now, the queue is empty, every running request decodes one
    token (`decoding`, as the last step left it), and the policy schedules such a batch
    as it stands (`Policy.decodes_alone`). (The caller checks `next_change_time`.)"""
    s: EngineState = e
    ps: PolicyState = s.policy
    policy: Any = s.policy
    now = s.now
    return not (not decoding or now >= until or ps.waiting or not ps.running
                or now > MAX_TIME_S or next_external(e) <= now
                or not policy.skip_ahead_safe
                or not policy.decodes_alone()
                or s.executor is not None or s.clock == "measured"
                or not s.skip_ahead or s.duration_override is not None
                or s._swap_out or s._swap_in or s.scheduler_steps > 1
                # (blocks cached when scheduled are registered by schedule_running)
                or s.kv.register_at_allocation)


def arrive(e: Any, now: float) -> None:
    """The workload's requests due by `now` arrive, and the client cancellations due by
    then take effect."""
    s: EngineState = e
    arr = s._w_arrival
    w = s.workload
    prompt, output, priority, cancel_at = s._w_cols
    feed: Any = s._feed
    tags: Any = s._w_tags
    while s._w_next < len(arr) and arr[s._w_next] <= now:
        i = s._w_base + s._w_next  # the request's row in the workload
        t = arr[s._w_next]
        s._w_next += 1
        if feed is not None:  # closed loop: the users make the request (and extend `arr`)
            req = feed.request(e, t)
            if req is not None:  # (None: a request sent to the front end)
                on_arrival(e, req)
            continue
        if s._w_next == len(arr) and i + 1 < len(w):  # the window's end: the next one
            s._w_base = i + 1
            s._w_arrival = arr = s._w_times[i + 1:i + 1 + e.ARRIVAL_WINDOW].tolist()
            s._w_next = 0
        c = cancel_at[i]
        req = Request(i, t, prompt[i], output[i], priority=priority[i],
                      hash_ids=w.hash_ids[i] if w.hash_ids else None,
                      cancel_at=None if c != c else c)
        if w.prefix_group is not None:
            req.shared_prefix = (w.prefix_group[i].item(), w.prefix_tokens)
        if tags is not None:
            req.tag = tags[i]
        if s._w_sent is not None:
            fe: Any = s.frontend
            fe.mark(req, s._w_sent[i])
        on_arrival(e, req)
    while s._cancels and s._cancels[0][0] <= now:
        _, rid = heapq.heappop(s._cancels)
        due = s.requests.get(rid)  # (gone: it ended, and keep_history is off)
        if due is not None and not due.state.is_done:
            e._cancel(due, by="client")
            continue
        # Finished, its output not yet processed (async scheduling): freed now.
        finishing = releasing_request(e, rid)
        if finishing is not None:
            e._release_now(finishing)


def releasing_request(e: Any, rid: int) -> Request | None:
    """Request `rid` if it finished in the last step and still holds its blocks and seat
    (async scheduling), else None. (Looked up among those, not in `requests`: a run that
    keeps no history has forgotten it.)"""
    s: EngineState = e
    for r in s._releasing:
        if r.req_id == rid:
            return r
    return None


def on_arrival(e: Any, req: Request) -> None:
    """`req` arrives: recorded, rejected if it could never fit, else queued."""
    s: EngineState = e
    kv: KVCacheManager = s.kv
    req._timeline = s.timeline
    s.requests[req.req_id] = req
    s.counts["arrived"] += 1
    if s.record_events:
        s.events.append(ev.Arrival(req.arrival_time, req.req_id, req.prompt_len,
                                      req.max_output_tokens, req.priority, req.injected))
    reason = None
    need = arrival_blocks(e, req.prompt_len, req.max_output_tokens)
    if need > kv.num_blocks:
        reason = f"needs {need} blocks, the pool has {kv.num_blocks}"
    elif s.max_model_len and req.prompt_len + req.max_output_tokens > s.max_model_len:
        reason = f"longer than max_model_len = {s.max_model_len}"
    elif s._admission is not None:
        ps: PolicyState = s.policy
        reason = s._admission.refuse(req.arrival_time, len(ps.waiting))
    if reason:
        req.transition(REJECTED)
        req.reject_reason = reason
        req.finish_time = s.now
        s.counts["rejected"] += 1
        s.recent.append(req)
        if not s.keep_history:
            del s.requests[req.req_id]
        if s.record_events:
            s.events.append(ev.Reject(s.now, req.req_id, reason))
        for o in s.observers:
            o.ended(e, req)
        return
    if req.cancel_at is not None:
        heapq.heappush(s._cancels, (req.cancel_at, req.req_id))
    policy: Any = s.policy
    policy.add(req)


def arrival_blocks(e: Any, prompt_len: int, max_output_tokens: int) -> int:
    """`sim.engine.kv.arrival_blocks` under this engine's pool and policy: the blocks a
    request must be able to hold at once, or it is rejected on arrival."""
    s: EngineState = e
    kv: KVCacheManager = s.kv
    ps: PolicyState = s.policy
    return kv_arrival_blocks(prompt_len, max_output_tokens, s.block_size, kv.groups,
                             ps.chunk_tokens)


def finish(e: Any, req: Request, t: float) -> None:
    """`req` has sampled its last token at `t`: it ends, its blocks and seat given back
    (after the next step is scheduled, under async scheduling)."""
    s: EngineState = e
    ps: PolicyState = s.policy
    policy: Any = s.policy
    kv: KVCacheManager = s.kv
    req.transition(FINISHED)
    req.finish_time = t
    if ps.async_scheduling:
        s._releasing.append(req)
    else:
        kv.free(req)
        policy.finished(req)
    s.recent.append(req)
    drop(e, req)
    s.finished_prompt_tokens += req.prompt_len
    if req.parent_id is not None:  # a further sample: its tokens count, not its latency
        s.counts["finished_samples"] += 1
        if s.record_events:
            s.events.append(ev.Finish(t, req.req_id))
        return
    s.counts["finished"] += 1
    fold_finished(e, req, t)
    if s.record_events:
        s.events.append(ev.Finish(t, req.req_id))
    for o in s.observers:
        o.ended(e, req)


def drop(e: Any, req: Request) -> None:
    """`Engine._drop`: an ended request leaves the engine's books (the executor is told; it
    is forgotten unless the engine keeps its history)."""
    s: EngineState = e
    if s.executor is not None:
        s._freed.append(req.req_id)
    s._prompt_ids.pop(req.req_id, None)
    if not s.keep_history:
        s.requests.pop(req.req_id, None)


def emit_steps(e: Any, steps: ev.Steps) -> None:
    """Record steps, extending the previous `steps` event when the two are one run of
    identical decode steps, so the event stream does not depend on how a caller sliced
    time (a live screen's ticks, a stale cancellation) and a replay can match it."""
    s: EngineState = e
    events = s.events
    last: Any = events[-1] if events else None
    if (type(last) is ev.Steps and not last.prefill and not steps.prefill
            and last.decode == steps.decode and last.tokens is None and steps.tokens is None
            and steps.durs is None and last.durs is None
            and steps.step == last.step + len(last.ends) and steps.t == last.ends[-1]):
        last.ends = np.concatenate((last.ends, steps.ends))
        last.kv_used = steps.kv_used
    else:
        events.append(steps)


def run_loop(e: Any, t: float, budget: int) -> None:
    """`Engine.run_until`'s loop: decisions while the clock is before `t`, work is left and
    fewer than `budget` steps have run."""
    s: EngineState = e
    ps: PolicyState = s.policy
    start = s.step_count
    stalls = 0
    while s.now < t and s.step_count - start < budget:
        if done(e):
            break
        before_step, before_now = s.step_count, s.now
        advance(e, t, budget - (s.step_count - start), True)
        if s.step_count == before_step and s.now == before_now:
            stalls += 1
            if stalls > 3:
                raise EngineError(f"engine stalled at t={s.now:.6f}: "
                                  f"{len(ps.waiting)} waiting, nothing schedulable")
        else:
            stalls = 0


def fold_finished(e: Any, req: Request, t: float) -> None:
    """Add a finished request (not a further sample) to the run's latency figures."""
    s: EngineState = e
    tpot = req.tpot
    s.e2e.add(t - req.arrival_time)
    if tpot is not None:
        s.tpot.add(tpot)
    s.finished_output_tokens += req.num_output_tokens
    if s.frontend is not None:
        e2e = req.client_e2e
        assert e2e is not None  # (it has finished)
        s.client_e2e.add(e2e)
        tpot = req.client_tpot
        if tpot is not None:
            s.client_tpot.add(tpot)
    if met_slo(e, req):
        s.slo_met += 1


def met_slo(e: Any, req: Request) -> bool:
    """Whether finished `req` met the bounds it is held to, judged on what its client saw
    (behind a front end, its TTFT, TPOT and E2E as the client measures them)."""
    ttft, e2e = req.client_ttft, req.client_e2e
    assert ttft is not None and e2e is not None  # (a finished request has sampled)
    return meets_slo(slo_bounds(e, req), ttft, req.client_tpot, e2e)


def slo_bounds(e: Any, req: Request) -> tuple:
    """The (ttft_ms, tpot_ms, e2e_ms) bounds `req` is held to: its client's SLO class in a
    client mix, else `[slo]`'s."""
    s: EngineState = e
    if s._slo_of is not None and req.tag in s._slo_of:
        return s._slo_of[req.tag]
    return s._slo


def meets_slo(bounds: tuple, ttft: float, tpot: float | None, e2e: float) -> bool:
    """Whether a finished request's latencies (s) meet every bound (ms) given (0: none)."""
    ttft_ms, tpot_ms, e2e_ms = bounds
    return bool((not ttft_ms or ttft * 1e3 <= ttft_ms)
                and (not tpot_ms or tpot is None or tpot * 1e3 <= tpot_ms)
                and (not e2e_ms or e2e * 1e3 <= e2e_ms))


def delivered(e: Any, t: float, end: float, first: list[Request], handed: list[Request],
              prevs: list[float]) -> None:
    """Behind an API server, which has handed out at `t` the tokens that the step ending at
    `end` sampled for `handed`: the first tokens of `first` among them, and tokens whose
    previous one, from a step before the last, reached its client at `prevs`."""
    s: EngineState = e
    for req in first:
        req.client_first_time = t
        if req.parent_id is None:
            ttft = t - req.sent_time
            s.client_ttft.add(ttft)
            recent(e, s.recent_ttfts, end, ttft)  # (the rolling figure is the client's too)
    for req in handed:
        req.client_last_time = t
    for prev in prevs:
        s.client_itl_extra.add(t - prev)


def gap(e: Any, t: float, gap_s: float) -> None:
    """An ITL gap across steps that are not adjacent, its token sampled at `t`."""
    s: EngineState = e
    s.itl_extra.add(gap_s)
    recent(e, s.recent_gaps, t, gap_s)


def recent(e: Any, q: deque, t: float, v: float) -> None:
    """Add `(t, v)` to the rolling window `q` (the last ROLLING_S seconds)."""
    q.append((t, v))
    while q[0][0] < t - e.ROLLING_S:
        q.popleft()


def finish_step(e: Any, finished: list[Request], t: float) -> None:
    """The requests whose last token the step ending at `t` computed end."""
    for req in finished:
        finish(e, req, t)
    if only_finishing(e):
        # Nothing else runs or waits: the next step would schedule nothing but let vLLM
        # process this one's output, at once (short of an arrival at exactly `t`).
        release(e)


def only_finishing(e: Any) -> bool:
    """Whether nothing but requests finished by the last step (async scheduling) runs or
    waits: the next decision schedules nothing but releases them."""
    s: EngineState = e
    ps: PolicyState = s.policy
    return bool(s._releasing and not ps.waiting and len(ps.running) == len(s._releasing))


def release(e: Any) -> None:
    """Async scheduling: the step scheduled after the one that finished these requests
    has been; their output is processed now, their blocks freed and seats given back."""
    s: EngineState = e
    policy: Any = s.policy
    kv: KVCacheManager = s.kv
    if not s._releasing:
        return
    done: list[Request] = s._releasing
    s._releasing = []
    for req in done:
        if kv.register_at_allocation:  # the blocks its last step filled
            kv.cache_blocks(req, req.num_computed_tokens)
        kv.free(req)
        policy.finished(req)


def admit(e: Any, req: Request) -> None:
    """`req` joins the batch: blocks swapped out come back, its queue wait is recorded."""
    s: EngineState = e
    kv: KVCacheManager = s.kv
    resumed = req.state is not WAITING
    if req.state is SWAPPED:  # allocate_slots gave it device blocks: copy back
        s._swap_in.extend(kv.swap_in(req))
    elif s.prefix_caching:  # its prompt (and outputs, re-prefilling) was looked up
        kv.query_tokens += req.num_tokens
    req.transition(RUNNING)
    if req.admitted_time is None:
        req.admitted_time = s.now
        if req.parent_id is None:  # (a further sample's wait is not a request's latency)
            s.queue_wait.add(s.now - req.arrival_time)
    if s.record_events:
        s.events.append(ev.Admit(s.now, req.req_id, resumed))
    for o in s.observers:
        o.admitted(e, req)


def _window(cost: Any) -> int:
    """The service-time model's sliding window (0: none, or a model without one)."""
    if type(cost) is CostModel:
        cm: CostModel = cost
        return cm.window
    return int(getattr(cost, "window", 0))


def single_step(e: Any, sched: list[tuple[Request, int]], num_waiting: int) -> int:
    s: EngineState = e
    ps: PolicyState = s.policy
    tl: Timeline = s.timeline
    kv: KVCacheManager = s.kv
    # What the service-time model needs: prefill chunks and decodes apart (separate
    # attention kernels), and the rows that sample (the LM head runs on those only).
    tokens = p_tokens = p_attended = p_cached = d_seqs = d_cached = sampling = 0
    p_beyond = p_skip = d_beyond = 0  # (beyond a sliding window: CostModel.step)
    cost: Any = s.cost
    win: int = _window(cost)
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
            if win:
                p_beyond += beyond_window(c, n, win)
                p_skip += beyond_window(c, 1, win)
        else:
            d_seqs += 1
            d_cached += c
            if win:
                d_beyond += beyond_window(c, 1, win)
        if c + n >= req.num_tokens:
            sampling += 1
    dur: float
    energy: float
    if type(cost) is CostModel:  # (a native call; sim.model.fit's recorder is called as itself)
        cm: CostModel = cost
        dur, energy = cm.step(p_tokens, p_attended, p_cached, d_seqs, d_cached, len(sched),
                              sampling, p_beyond, p_skip, d_beyond)
    else:  # (what a window skips, passed only where there is one: ServiceTime.step)
        beyond = (p_beyond, p_skip, d_beyond) if win else ()
        dur, energy = cost.step(p_tokens, p_attended, p_cached, d_seqs, d_cached, len(sched),
                                sampling, *beyond)
    swapped = len(s._swap_out) + len(s._swap_in)
    if swapped:  # block copies over the host link delay the step
        extra = s.cost.swap_time(swapped)
        dur += extra
        energy += s.cost.idle_energy(extra)
    sampled_ids = None
    if s.executor is not None:
        t0 = time.perf_counter()
        sampled_ids = s.executor.execute(e._build_work(sched))
        measured = time.perf_counter() - t0
        s._freed = []
        if s.clock == "measured":
            dur, energy = measured, energy * measured / dur
    if s.duration_override is not None:
        dur = next(s.duration_override)
    s._swap_out, s._swap_in, s._copies = [], [], []
    start: float = s.now
    end = start + dur
    g: int = s.step_count  # this step's row on the timeline
    sampled = itl = 0
    prefilling = False
    prefill_chunks, decodes, first, recomputed, finished = [], [], [], [], []
    forked: list[Request] = []  # further samples started by the step
    # behind an API server: the requests that sampled, and the times their previous tokens
    # reached their clients where those came from a step before the last
    client: bool = s.frontend is not None
    handed: list[Request] = []
    prevs: list[float] = []
    tokens_out: dict[int, list[int]] = {}  # (with real compute)
    caching = s.prefix_caching and not kv.register_at_allocation
    events: bool = s.record_events  # (the step's chunk and decode lists are for its event)
    end_obj: Any = end  # (one float object for every request's token times)
    for (req, n), chunk in zip(sched, is_prefill):
        c = req.num_computed_tokens
        total = req.prompt_len + req.num_output_tokens  # (num_tokens, without the call)
        req.num_computed_tokens = c + n
        if caching:  # blocks enter the cache once computed (else when scheduled)
            kv.cache_blocks(req, c + n)
        if kv.hybrid:
            kv.slide(req)
        if chunk:
            req.prefill_chunks.append((end, c, n))
            if events:
                prefill_chunks.append((req.req_id, c, n))
        elif events:
            decodes.append(req.req_id)
        if c + n < total:
            prefilling = True
            continue
        sampled += 1
        if client:
            handed.append(req)
        if sampled_ids is not None:
            tok = sampled_ids[req.req_id]
            req.output_token_ids.append(tok)
            tokens_out[req.req_id] = [tok]
        req.num_output_tokens += 1
        if req.num_output_tokens == 1:
            req.first_token_time = end_obj
            if req.parent_id is None:
                ttft: float = end - req.arrival_time
                s.ttft.add(ttft)
                if s.frontend is None:  # (behind one, the client's, once its tokens are out)
                    recent(e, s.recent_ttfts, end, ttft)
            first.append(req)
            req.open_run(g, 1)
            # (preempted before its first token: counted as re-prefilling until the next)
            prefilling = prefilling or req.recomputing
        else:
            # (it has sampled before: its last run is open)
            if req.run_start + req.run_len == g:
                req.run_len += 1
                itl += 1
            else:
                prev = req.last_token_time
                assert prev is not None
                gap(e, end, end - prev)
                req.open_run(g, 1)
                if client:
                    seen = req.client_last_time
                    assert seen is not None  # (it has received a token)
                    prevs.append(seen)
            if req.recomputing:  # its re-prefill after a preemption is done
                req.recomputing = False
                recomputed.append(req)
        req.last_token_time = end_obj
        if req.num_output_tokens >= req.max_output_tokens:
            finished.append(req)
    # Every request of the batch (finishing aside) decodes in the next step, as the
    # policy's `schedule_running` tests it.
    s._batch_decodes = (not prefilling and len(sched) + len(s._releasing)
                           == len(ps.running))
    if s.num_samples > 1:
        # Seats free in the next step, each further sample one: those free now, plus those
        # of requests that leave the batch before it is scheduled (finished by the last step,
        # released below; finished by this one, unless async scheduling holds their seats).
        seats: int = (ps.cfg.max_num_seqs - len(ps.running) + len(s._releasing)
                      + (0 if ps.async_scheduling else len(finished)))
        for req in first:
            if req.parent_id is None:
                kids: list[Request] = e._fork(req, end, g, seats)
                sampled += len(kids)
                seats -= len(kids)
                forked.extend(kids)
                for kid in kids:  # (a one-token output: each sample ends with its first)
                    if kid.num_output_tokens >= kid.max_output_tokens:
                        finished.append(kid)
    out = 0.0
    if client:
        fe: FrontEnd = s.frontend
        out = fe.deliver(end, sampled)
        delivered(e, out, end, first + forked if forked else first,
                  handed + forked if forked else handed, prevs)
    if s.record_timeline:
        tl.add_row(end, dur, tokens, p_tokens, len(sched), sampled, itl,
                              kv.num_used_blocks, empty_slots(e), energy,
                              num_waiting, out)
    s.now = end
    s.step_count += 1
    s.counts["output_tokens"] += sampled
    if s.record_events:
        emit_steps(e, ev.Steps(start, g, np.array([end]), tuple(prefill_chunks),
                                  tuple(decodes),
                                  tokens_out if sampled_ids is not None else None,
                                  kv.num_used_blocks,
                                  np.array([dur]) if s.clock == "measured" else None))
        for req in first:
            s.events.append(ev.FirstToken(end, req.req_id))
        for req in recomputed:
            s.events.append(ev.Recomputed(end, req.req_id))
    if s._releasing:
        release(e)
    if finished:
        finish_step(e, finished, end)
    for o in s.observers:
        o.stepped(e, sched)
    return 1


def decode_run(e: Any, reqs: list[Request], until: float, max_steps: int,
               change_at: float) -> int:
    """Run identical decode-only steps of `reqs` (the first one scheduled, its blocks
    allocated), up to the next event or the policy's `change_at` (its `next_change_time`),
    all at once."""
    s: EngineState = e
    ps: PolicyState = s.policy
    kv: KVCacheManager = s.kv
    bs: int = s.block_size
    b = len(reqs)
    # Block boundaries crossed in steps 1..kmax-1 (step 0's blocks are already allocated):
    # a request needs a new block at step j when its token computed + j lies past the end
    # of its table, which holds at least step 0's token (a contiguous reservation holds
    # far more), then every bs steps. (One loop: three comprehensions cost twice.)
    kmax: int = min(max_steps, s._run_steps_max)
    c0 = 0  # tokens the batch holds
    c_max = 0
    first_cross: list[int] = []
    cross_sum = 0
    for r in reqs:
        c = r.num_computed_tokens
        c0 += c
        if c > c_max:
            c_max = c
        j0 = len(r.block_table) * bs - c
        first_cross.append(j0)
        cross_sum += j0
        left = r.max_output_tokens - r.num_output_tokens
        if left < kmax:
            kmax = left
    # A run is timed by the batch's total context: with sliding-window layers, only while
    # every sequence stays within the window (beyond it, single steps sum each one's part).
    cost: Any = s.cost
    win: int = _window(cost)
    if win and kmax > win - c_max:
        kmax = max(win - c_max, 1)
    # With layer groups (sim.engine.kv), only while no window group has a block to free: every
    # table then mirrors the first, a crossing takes a block in each.
    tables: int = kv.num_tables
    if tables > 1 and kmax > kv.window - 1 - c_max:
        kmax = max(kv.window - 1 - c_max, 1)
    # Requests that finished in the last step (async scheduling) give their blocks back
    # once this run's first step is scheduled: before step 1 allocates.
    pending: list[Request] = s._releasing
    if kmax > 1:
        free = kv.num_free_blocks
        need = 0
        for j in first_cross:  # (a typed loop: sum() of a list is a call and boxed ints)
            if j < kmax:
                need += (kmax - 1 - j) // bs + 1
        need *= tables
        if need > free and pending:
            free += e._blocks_freed_by(pending)
        if need > free:
            cross = sorted([j for j0 in first_cross for j in range(j0, kmax, bs)])
            kmax = cross[free // tables]  # the step whose allocation would fail, alone
    if kmax == 1:
        return single_step(e, [(r, 1) for r in reqs], len(ps.waiting))
    # (within a multi-step window, arrivals and cancellations do not end the run)
    t_ext = min(INF if s._window else next_external(e), until, change_at)
    tl: Timeline = s.timeline
    # The scalar part of the run straight into the timeline's staging columns (sim/native/_rows.c),
    # unless the service-time model is another than the CostModel (sim.model.fit's recorder
    # times every step it is asked).
    at = -1
    k = 0
    end = first_end = 0.0  # (the run's last and first step's end times)
    ends: Any = None
    dur: Any = None
    energy: Any = None
    if (_decode_rows is not None and s.record_timeline and type(cost) is CostModel
            and not cost.roofline and tables == 1):
        cm: CostModel = cost
        n = kmax if kmax < s._scalar_steps else s._scalar_steps
        at = tl.reserve(n)
        pad = cm.graph_pad(b)
        k, first_end, end = _decode_rows(tl._m_end, tl._m_dur, tl._m_energy, at, n, s.now,
                                         t_ext, b, c0, cm.kernel_coefficients,
                                         cm.wave_factor(b + pad), pad)
        if k == n < kmax and end < t_ext:
            at = -1  # (a run longer than the scalar part: timed as a whole below)
    if at < 0:
        ends, dur, energy = run_times(e, b, c0, kmax, t_ext)
        k = len(ends)
        end = ends[-1]
        first_end = ends[0]
    used_first = kv.num_used_blocks
    empty_first = 0  # the step-0 slots of the finishing requests, beyond their freed blocks
    if pending:
        for r in pending:
            slots, held = kv.token_slots(r)
            empty_first += slots - held
        release(e)
        empty_first -= bs * (used_first - kv.num_used_blocks)
    used = kv.num_used_blocks
    steps = allocate_run(e, reqs, first_cross, k)
    # Empty slots after the run over the batch (every request holding blocks): those its
    # tables had beyond its tokens, plus the blocks taken, less the tokens computed.
    kv_used: list[int] = []
    if at >= 0:
        used_end: int = _used_rows(tl._m_used, at, steps, k, bs, used, used_first)
    else:
        kv_used = _used_by_step(e, steps, k, bs, used) if steps else [used] * k
        used_end = kv_used[-1]
        kv_used[0] = used_first
    used_last = used_first if k == 1 else used_end  # (the blocks used after its last step)
    empty_end = tables * (cross_sum - b * k) + bs * (used_end - used)
    g: int = s.step_count  # the run's first row on the timeline
    itl0 = 0
    finished = []
    end_obj: Any = end  # (one float object for every request's last token time)
    # Behind an API server: when it hands out each step's tokens (the staged rows' straight
    # into the staging column, by sim/native/_rows.c)
    outs: list[float] = []
    out_first = out_last = 0.0
    server: Any = s.frontend
    if server is not None:
        fe: FrontEnd = server
        if at >= 0:
            out_first, out_last, fe.spell_at = _deliver_rows(
                tl._m_end, tl._m_out, at, k, fe.out_free, b * fe.token_s, fe.spells, fe.spell_at)
            fe.out_free = out_last
            fe.seek_spell()
        else:
            outs = fe.deliver_run(np.asarray(ends).tolist(), b)
            out_first, out_last = outs[0], outs[-1]
    caching: bool = s.prefix_caching
    # Registered when scheduled, a block holding the run's last token waits, under async
    # scheduling, for the next step (the scheduler has not seen that token yet).
    unseen = 1 if kv.register_at_allocation and ps.async_scheduling else 0
    for r in reqs:
        r.num_computed_tokens += k
        r.num_output_tokens += k
        if caching:
            kv.cache_blocks(r, r.num_computed_tokens - unseen)
        if r.run_start + r.run_len == g:  # (it has sampled before: its last run is open)
            r.run_len += k
            itl0 += 1
        else:
            prev = r.last_token_time
            assert prev is not None
            gap(e, first_end, first_end - prev)
            r.open_run(g, k)
            if server is not None:
                seen = r.client_last_time
                assert seen is not None  # (it has received a token)
                s.client_itl_extra.add(out_first - seen)
        r.last_token_time = end_obj
        if server is not None:
            r.client_last_time = out_last
        if r.num_output_tokens >= r.max_output_tokens:
            finished.append(r)
    if s.record_events:
        emit_steps(e, ev.Steps(s.now, g, np.asarray(ends) if at < 0
                               else tl._s_end[at:at + k].copy(), (),
                               tuple([r.req_id for r in reqs]), None, used_last))
    if at >= 0:
        tl.commit_decodes(at, k, b, itl0, empty_end - bs * used_end + b * (k - 1), bs,
                          empty_first, len(ps.waiting))
    elif s.record_timeline:
        record_run(e, ends, dur, energy, kv_used, b, itl0, empty_end - bs * used_end,
                   empty_first, tables, outs if server is not None else None)
    s.now = end
    s.step_count += k
    s.counts["output_tokens"] += b * k
    if finished:
        finish_step(e, finished, end)
    for o in s.observers:
        o.decoded(e, reqs, k)
    return k


def allocate_run(e: Any, reqs: list[Request], first_cross: list[int], k: int) -> list[int]:
    """Allocate the blocks the `k` steps of a decode run cross (request i first at step
    `first_cross[i]`, then every block_size steps) in the order step-by-step scheduling
    would: by step, then batch order. Returns the steps at which the requests that cross
    first do, sorted (`_used_by_step` turns them into the blocks used after each step)."""
    s: EngineState = e
    kv: KVCacheManager = s.kv
    bs: int = s.block_size
    steps, order = crossing_order(first_cross, k, bs)
    tables: int = kv.num_tables
    if order:
        blocks: Any = kv.pool.allocate(len(order) * tables)  # (Any: the same int objects move)
        if tables == 1:
            for i, blk in zip(order, blocks):
                reqs[i].block_table.append(blk)
        else:  # (a block in each group's table per crossing: `steps` counts each)
            append_groups([reqs[i] for i in order], blocks)
            steps = [j for j in steps for _ in range(tables)]
    return steps


def append_groups(reqs: list[Request], blocks: list[int]) -> None:
    """Give each of `reqs` in turn (one may come more than once) one block in each of its
    layer groups' tables, the first group's first, as `KVCacheManager.allocate_slots` takes
    them a request at a time."""
    it = iter(blocks)
    for r in reqs:
        r.block_table.append(next(it))
        tables = r.group_tables
        assert tables is not None
        for t in tables:
            t.append(next(it))


def crossing_order(first_cross: list[int], k: int, bs: int) -> tuple[list[int], list[int]]:
    """The block crossings of a decode run's `k` steps, request i of the batch first crossing
    at step `first_cross[i]` (at least 1: its table holds step 0's token), then every `bs`
    steps: the batch index of each block to allocate, in the order step-by-step scheduling
    takes them (by step, then batch index), and the sorted first crossings of the requests
    that cross."""
    # The requests that cross, in (first crossing j0, batch index i) order: sorted as the
    # ints j0 * b + i, which sort as the pairs would, several times faster than tuples.
    b = len(first_cross)
    keys = [j0 * b + i for i, j0 in enumerate(first_cross) if j0 < k]
    if not keys:
        return keys, keys
    keys.sort()
    steps = [key // b for key in keys]  # their first crossings
    if k <= bs:  # (the common case: one block each at most)
        return steps, [key % b for key in keys]
    if steps[-1] - steps[0] < bs:
        # First crossings within one block's span (always, short of contiguous
        # reservations): the order is round by round (a round is every request's next
        # crossing), each round in (first crossing, batch) order, only the last one cut
        # short; so block q goes to the request ranked q mod m of the m that cross.
        total = 0
        for j0 in steps:
            total += (k - 1 - j0) // bs + 1
        m = len(keys)
        return steps, [keys[q % m] % b for q in range(total)]
    return steps, [x % b for x in sorted([j * b + key % b for key in keys
                                          for j in range(key // b, k, bs)])]


def _used_by_step(e: Any, steps: list[int], k: int, bs: int, used: int) -> list[int]:
    """The blocks used after each of the `k` steps of a decode run that starts with `used`,
    requests first crossing a block boundary at `steps` (then every `bs` steps)."""
    # Blocks taken at step j: those first crossing at j, j - bs, j - 2 bs, ...
    if k <= e._scalar_steps:  # (NumPy's per-call cost would dominate)
        at = [0] * k
        for j0 in steps:
            at[j0] += 1
        for j in range(bs, k):
            at[j] += at[j - bs]
        at[0] += used
        return list(accumulate(at))
    rounds = -(-k // bs)
    taken = np.zeros(rounds * bs, dtype=np.int64)  # (np.pad costs 0.3 ms a call)
    taken[:k] = np.bincount(steps, minlength=k)
    taken = taken.reshape(rounds, bs).cumsum(axis=0).ravel()[:k]
    return (used + np.cumsum(taken)).tolist()


def record_run(e: Any, ends, dur, energy, kv_used: list[int], b: int, itl0: int,
                empty_less_used: int, empty_first: int = 0, tables: int = 1,
                outs: list[float] | None = None) -> None:
    """The timeline rows of a decode run of `len(ends)` steps of `b` sequences, which end
    with `empty_less_used` + block_size * (blocks used) empty slots (`empty_first` more in
    its first step, held by requests released after it); each step's token fills a slot in
    each of `tables` layer groups' tables; `outs`: behind an API server, when it handed out
    each step's tokens."""
    s: EngineState = e
    ps: PolicyState = s.policy
    tl: Timeline = s.timeline
    k = len(ends)
    bs: int = s.block_size
    waiting = len(ps.waiting)
    # Empty slots after step j: those at the end, plus the tokens of later steps, minus
    # the slots of blocks allocated later.
    if k <= s._scalar_steps and tables == 1:
        # (step j: e0 - b*j + bs*used_j; step 0 also counts the finishing requests' slots)
        tl.add_decodes(ends, dur, b, itl0, kv_used, empty_less_used + b * (k - 1), bs,
                       empty_first, energy, waiting, outs)
    else:
        itl = np.full(k, b, dtype=np.int64)
        itl[0] = itl0
        used = np.asarray(kv_used, dtype=np.int64)
        empties = empty_less_used + tables * b * np.arange(k - 1, -1, -1) + bs * used
        empties[0] += empty_first
        tl.append(end=ends, dur=dur, tokens=b, prefill_tokens=0, batch=b,
                             sampled=b, itl_count=itl, kv_used=used, kv_empty=empties,
                             energy=energy, waiting=waiting,
                             out=0.0 if outs is None else np.asarray(outs))


def run_times(e: Any, b: int, c0: int, kmax: int, t_ext: float):
    """End times, durations and energies of the steps of a decode run of `b` sequences
    holding `c0` cached tokens, at most `kmax` steps, none starting at or after `t_ext`.

    Step j reads c0 + b*j cached tokens. The clock advances by sequential addition in both
    the scalar and the NumPy part, so the times equal those of single steps exactly.
    """
    s: EngineState = e
    ends, durs, ens = s.cost.decode_times(b, c0, min(kmax, s._scalar_steps), s.now,
                                             t_ext)
    j = len(ends)
    t = ends[-1]
    if j == kmax or t >= t_ext:  # (the next step would start at or after the next event)
        return ends, durs, ens
    d, en = s.cost.decode_steps(b, c0 + b * np.arange(j, kmax, dtype=np.int64))
    tail = np.cumsum(np.concatenate(([t], d)))[1:]
    m = len(d)
    if m > 1 and tail[m - 2] >= t_ext:
        m = 1 + int(np.searchsorted(tail[: m - 1], t_ext, side="left"))
    return (np.concatenate((ends, tail[:m])), np.concatenate((durs, d[:m])),
            np.concatenate((ens, en[:m])))


def empty_slots(e: Any) -> int:
    """Allocated slots holding no token, over every request holding device blocks.
    (A shared block is full, so counting it once per sharer adds nothing.)"""
    s: EngineState = e
    ps: PolicyState = s.policy
    slots = tokens = 0
    running: list[Request] = ps.running
    kv: KVCacheManager = s.kv
    if kv.hybrid:  # (every group's blocks)
        for r in running:
            n, t = kv.token_slots(r)
            slots += n
            tokens += t
        return slots - tokens
    for r in running:
        slots += len(r.block_table)
        tokens += r.num_computed_tokens
    bs: int = s.block_size
    return slots * bs - tokens
