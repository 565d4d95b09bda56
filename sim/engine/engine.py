"""The engine: the step loop of a continuous-batching server, and its public API for live use.

One step: admit the arrivals and client cancellations due by the clock, let the policy schedule,
hand the work to the executor (if real compute is on), advance the clock by the step time, then
record tokens, finish requests and free their blocks.

When the policy schedules a decode-only step and no executor runs, the engine computes the whole
run of identical steps up to the next event (an arrival, a cancellation, a request finishing, a
block shortage, or the caller's time limit) at once, with NumPy over the run. The result is
bit-identical to stepping one by one (the same block ids, times and tokens; a test checks it),
so the cost of a simulation grows with the number of events, not of tokens.
"""

from __future__ import annotations

import heapq
import math
import time
import weakref
from collections import Counter, deque
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import numpy as np

from sim.native import compiled
from sim.engine import events as ev
from sim.engine import stepping
from sim.model.costmodel import CostModel, kv_groups
from sim.errors import EngineError, UnknownRequestError
from sim.gcpause import paused_gc
from sim.engine.executor import SeqWork, StepWork
from sim.engine.kv import NULL, KVCacheManager
from sim.limits import (BYTES_PER_STEP, MAX_INJECT_COUNT, MAX_TOKENS,
                        PRIORITY_RANGE, check_memory)
from sim.policies import POLICIES
from sim.stats.quantiles import Samples
from sim.engine.request import Request, RequestState
from sim.engine.stepping import EngineState
from sim.engine.observer import StepObserver
from sim.engine.timeline import Timeline
from sim.engine.users import ClosedLoop
from sim.engine.frontend import FrontEnd, chat_requests, open_loop
from sim.engine.admission import Admission
from sim.engine.clients import ClientFigures
from sim.engine.tokens import prompt_token_ids
from sim.inputs.scenario import pipeline_stage
from sim.inputs.workload import Workload, build_workload, load_label

RS = RequestState
INF = math.inf


@dataclass(slots=True)
class RequestView:
    """A plain, immutable-by-convention view of one request for screens and tests."""

    req_id: int
    state: str
    prompt_len: int
    max_output_tokens: int
    num_computed_tokens: int
    num_output_tokens: int
    num_blocks: int
    priority: int
    arrival_time: float
    admitted_time: float | None
    first_token_time: float | None
    finish_time: float | None
    num_preemptions: int
    is_prefill: bool
    tokens: tuple[int, ...] = ()
    replica: int = 0  # the instance it is on, in a deployment of several (sim.deploy.cluster)
    tag: str | None = None  # who sent it (servesim serve: the client's address)
    # that instance's clock where it is not the snapshot's (each instance of a deployment runs
    # on its own clock: a queue wait is measured on the one the request waits on)
    clock: float | None = None


@dataclass(slots=True)
class EngineSnapshot:
    """Everything a screen draws, copied out of the engine (no references into it)."""

    now: float
    step: int
    policy: str
    done: bool
    waiting: list[RequestView]
    running: list[RequestView]
    recent: list[RequestView]
    num_blocks: int
    block_size: int
    used_blocks: int
    block_owner: np.ndarray      # int64 per block: owning request id, -1 when free
    block_refs: np.ndarray       # int32 per block: reference count (>1 = shared)
    free_cached_blocks: int      # free blocks that still hold a reusable cached prefix
    token_slots_used: int        # tokens held in allocated blocks (for fragmentation)
    counters: dict = field(default_factory=dict)
    block_cached: np.ndarray | None = None  # bool per block: free but holding a cached prefix
    num_waiting: int = 0         # the whole queue, however much of it `waiting` holds
    load: str = ""               # what drives the arrivals: "concurrency 8", "4 req/s"


def _view(r: Request, with_tokens: bool = False) -> RequestView:
    # (with layer groups, the blocks of every group's table: sim.engine.kv)
    held = len(r.block_table) + sum([len(t) - t.count(NULL) for t in r.group_tables or ()])
    return RequestView(
        r.req_id, r.state.value, r.prompt_len, r.max_output_tokens, r.num_computed_tokens,
        r.num_output_tokens, held, r.priority, r.arrival_time, r.admitted_time,
        r.first_token_time, r.finish_time, r.num_preemptions, r.is_prefill,
        tuple(r.output_token_ids[-16:]) if with_tokens else (), r.replica, r.tag,
    )


def checked_injection(prompt_len: int | None, max_output_tokens: int,
                      prompt_text: str | bytes | None, count: int,
                      priority: int = 0) -> tuple[int, bytes | None]:
    """The prompt length and bytes of an injection (a typed prompt gives its length).

    Raises EngineError on a length, count or priority that is not an integer in its range
    (lengths 1 to MAX_TOKENS, count 1 to MAX_INJECT_COUNT); ScenarioError (sim.limits) when
    the output's per-step records would not fit in memory."""
    if isinstance(prompt_text, str):
        prompt_text = prompt_text.encode()
    if prompt_text is not None and not isinstance(prompt_text, bytes):
        raise EngineError(f"inject: prompt_text = {prompt_text!r:.40}: must be text")
    if prompt_text is not None and prompt_len is None:
        prompt_len = len(prompt_text)
    for name, v, lo, hi in (("prompt_len", prompt_len, 1, MAX_TOKENS),
                            ("max_output_tokens", max_output_tokens, 1, MAX_TOKENS),
                            ("count", count, 1, MAX_INJECT_COUNT),
                            ("priority", priority, *PRIORITY_RANGE)):
        if not isinstance(v, int) or isinstance(v, bool) or not lo <= v <= hi:
            shown = f"{v!r:.40}"
            raise EngineError(f"inject: {name} = {shown}: must be an integer from {lo:,} "
                              f"to {hi:,}")
    check_memory(f"inject: max_output_tokens = {max_output_tokens}",
                 max_output_tokens * BYTES_PER_STEP, " for its per-step records")
    assert prompt_len is not None  # (checked above)
    return prompt_len, prompt_text


def cancellable(requests: dict, req_id: int, recent=()) -> Request:
    """The live request `req_id` a user asked to cancel (`recent`: requests that have ended,
    where `requests` may have forgotten them).

    Raises UnknownRequestError for an id never seen, EngineError for one already ended."""
    req = requests.get(req_id)
    if req is None:
        req = next((r for r in recent if r.req_id == req_id), None)
    if req is None:
        raise UnknownRequestError(f"cancel: no request with id {req_id}")
    if req.state.is_done:
        raise EngineError(f"cancel: request {req_id} is already {req.state.value}")
    return req


class _Continued:
    """The timeline of a request whose first tokens were sampled on another engine: this
    engine's step end times, and those tokens' times, so that one list of token segments names
    both (the earlier tokens are the segment [-k - 1, k], below every row here)."""

    __slots__ = ("timeline", "earlier")

    def __init__(self, timeline: Timeline, earlier: np.ndarray) -> None:
        self.timeline = timeline
        self.earlier = earlier

    def ends(self, start: int, count: int) -> np.ndarray:
        """End times of rows [start, start + count); a negative start names the earlier ones."""
        if start < 0:
            return self.earlier[:count]
        return self.timeline.ends(start, count)


def _first_token_row(engine: Engine) -> float:
    """The first timeline row a live request's token times point into (math.inf: none)."""
    return min((s for r in engine.requests.values() for s, _ in r.token_segments[:2] if s >= 0),
               default=INF)


class Engine(EngineState):
    """A simulated serving engine over one scenario.

    `executor` (optional) runs real attention each step; `skip_ahead=False` forces one step at a
    time even without one (for tests that compare the two paths).
    """

    RECENT = 64
    ARRIVAL_WINDOW = 1 << 16  # arrival times held as a Python list at a time
    ROLLING_S = 60.0  # simulated seconds of first tokens and gaps kept for `sim.rolling`

    def __init__(self, scenario, *, policy: str | None = None, executor=None,
                 workload: Workload | None = None, record_events: bool = True,
                 skip_ahead: bool = True, clock: str | None = None,
                 record_timeline: bool = True, keep_history: bool = True,
                 cost: Any = None, observers: list[StepObserver] | None = None) -> None:
        """`record_timeline=False` keeps no per-step figures: the events are the same, but
        metrics (`sim.summarize`, `sim.rolling`) cannot be computed; for verifying a replay.

        `keep_history=False` bounds memory by what is in flight: a request is dropped when it
        ends (`requests` and `get` know only live ones; the last RECENT stay in `recent`) and
        timeline rows once folded into the summary's totals, but for the last ROLLING_S
        simulated seconds that `rolling` reads (the token times of ended requests and the
        exports need the default). The summary is the same either way.

        `cost` is the service-time model that times each step (a `sim.model.costmodel.ServiceTime`;
        default the scenario's `CostModel`); `observers` are told what each step scheduled."""
        self.scenario = scenario
        self.record_timeline = record_timeline
        self.keep_history = keep_history
        self.cost: Any = cost if cost is not None else CostModel(scenario)
        self.observers = list(observers or ())
        self.workload = workload if workload is not None else build_workload(scenario)
        self.kv = KVCacheManager(
            scenario.kv.num_blocks, scenario.kv.block_size,
            num_host_blocks=(self.cost.num_host_blocks()
                             if scenario.scheduler.preemption == "swap" else 0),
            prefix_caching=scenario.kv.enable_prefix_caching,
            hash_block_size=self.workload.hash_block_size,
            sharing=scenario.workload.num_samples > 1,
            register_at_allocation=scenario.kv.register_at_allocation,
            uncached_first=scenario.kv.free_uncached_first,
            duplicates=scenario.kv.duplicate_cached_blocks,
            groups=kv_groups(pipeline_stage(scenario)))
        self.num_samples = scenario.workload.num_samples
        self._copies: list[tuple[int, int]] = []  # copy-on-write block copies of the coming step
        self.prefix_caching = scenario.kv.enable_prefix_caching
        self.preemption = scenario.scheduler.preemption
        self._swap_out: list[tuple[int, int]] = []  # block moves of the coming step
        self._swap_in: list[tuple[int, int]] = []
        self.block_size = scenario.kv.block_size
        self.executor = executor
        self.clock = clock or scenario.compute.clock
        # Multi-step scheduling (vLLM's --num-scheduler-steps): a decode batch runs this many
        # steps per scheduling decision; arrivals and cancellations wait for the window's end.
        self.scheduler_steps = scenario.engine.num_scheduler_steps
        self._window = 0  # decode steps left in the current window
        self.skip_ahead = skip_ahead
        self.record_events = record_events
        self.events: list[ev.Event] = []
        w = self.workload
        # The API server in front (None: the engine's times are the client's). An open-loop
        # workload's arrival column holds when its clients send; _w_times holds when each
        # request reaches the engine, and _w_sent the sent times (None without a front end).
        # (a closed loop's users send through the front end themselves: sim.engine.users)
        self.frontend = FrontEnd.of(scenario.engine, chat_requests(scenario))
        self._w_times, sent = open_loop(None if scenario.workload.concurrency else self.frontend,
                                        w.arrival, w.prompt)
        self._w_sent = (None if sent is None
                        else memoryview(np.ascontiguousarray(sent, dtype=np.float64)))
        # The next arrival times as a Python list (scalar reads in the hot loop are several
        # times faster than from an array), a window of them at a time so that the list does
        # not hold 32 bytes for every request of a long run; _w_next indexes the window, which
        # holds workload rows from _w_base on. (The other columns are read once per arrival,
        # through memoryviews of the arrays: a scalar read from an array costs ~15 times more.)
        self._w_base = 0
        self._w_next = 0
        # Closed loop: the users' arrival list, which they extend as requests end.
        self._feed = ClosedLoop(self) if scenario.workload.concurrency else None
        self._w_arrival = (self._feed.arrivals if self._feed is not None
                           else self._w_times[:self.ARRIVAL_WINDOW].tolist())
        self._w_cols = tuple(memoryview(np.ascontiguousarray(col, dtype=t)) for col, t in (
            (w.prompt, np.int64), (w.output, np.int64), (w.priority, np.int64),
            (w.cancel_at, np.float64)))
        self._next_id = len(w)
        if self._feed is not None:
            self.observers.append(self._feed)
        self._admission = Admission.of(scenario.admission)
        slo = scenario.slo
        self._slo = (slo.ttft_ms, slo.tpot_ms, slo.e2e_ms)
        self._w_tags, self._slo_of, self.clients = None, None, None
        if w.client is not None:  # a client mix: requests tagged, each held to its SLO class
            mix = scenario.workload.clients
            names = [c["name"] for c in mix]
            self._w_tags = [names[k] for k in w.client.tolist()]
            self._slo_of = {c["name"]: tuple(c.get(k, d) for k, d in zip(
                ("ttft_ms", "tpot_ms", "e2e_ms"), self._slo)) for c in mix}
            self.clients = ClientFigures(names)
            self.observers.append(self.clients)
        self._cancels: list[tuple[float, int]] = []
        self.max_model_len = scenario.model.max_model_len
        self.requests: dict[int, Request] = {}
        self.recent: deque[Request] = deque(maxlen=self.RECENT)
        self.now = 0.0
        self.step_count = 0
        self.idle_time = 0.0
        # Through a proxy, not a bound method or the requests (which point at the timeline):
        # no cycle, as for the policy's.
        self.timeline = Timeline(keep=keep_history,
                                 pinned=partial(_first_token_row, weakref.proxy(self)),
                                 window_s=self.ROLLING_S)
        self.timeline.client = self.frontend is not None  # (its ITL as the clients see it too)
        self.policy = POLICIES[policy or scenario.scheduler.policy](self)
        self.initial_policy = self.policy.name
        self._freed: list[int] = []
        # Async scheduling: requests finished by the last step, whose blocks and seats come back
        # once the next step is scheduled (vLLM processes step k's output after scheduling k+1).
        self._releasing: list[Request] = []
        self._prompt_ids: dict[int, np.ndarray] = {}
        self.duration_override: Any = None  # an iterator of step durations (replay of measured runs)
        # Running figures for the summary.
        self.counts = dict(arrived=0, finished=0, cancelled=0, rejected=0, preemptions=0,
                           swaps=0, output_tokens=0, injected=0, finished_samples=0,
                           cancelled_samples=0, fragmentation_stalls=0)
        # Per-request figures, folded as they happen (sim.stats.metrics reads them;
        # sim.stats.quantiles says when their percentiles stop being exact).
        self.queue_wait = Samples()
        self.ttft = Samples()  # of every request's first token (not further samples')
        self.tpot = Samples()  # of finished requests with at least two tokens
        self.e2e = Samples()   # of finished requests
        self.itl_extra = Samples()  # ITL gaps across non-adjacent steps (the timeline has the rest)
        # As the client measures them, with a front end (TTFT of first tokens, TPOT and E2E of
        # finished requests; without one they are ttft, tpot and e2e)
        self.client_ttft = Samples()
        self.client_itl_extra = Samples()  # itl_extra as the clients received the tokens
        self.client_tpot = Samples()
        self.client_e2e = Samples()
        self.finished_prompt_tokens = 0  # of finished requests and samples
        self.finished_output_tokens = 0  # of finished requests
        self.slo_met = 0  # finished requests that met every SLO
        # (time, value) of the last ROLLING_S simulated seconds, for sim.rolling
        self.recent_ttfts: deque[tuple[float, float]] = deque()
        self.recent_gaps: deque[tuple[float, float]] = deque()
        self.wall_s = 0.0
        self._batch_decodes = False  # set by each single step (see stepping.decodes_follow)
        self._load_constants()

    # ================================================================================ public API
    @property
    def queue_waits(self) -> np.ndarray:
        """Every queue wait so far (s), in admission order (while they are held exactly)."""
        return self.queue_wait.values()

    @property
    def done(self) -> bool:
        """True when no request is queued, running or still to arrive."""
        return stepping.done(self)

    @property
    def settled(self) -> bool:
        """Whether `settle` has nothing to do. A session log records it at each user action
        and at its end: a session that ends (or a screen that pauses) just after a decision
        that ran no step stands where one cut before that decision does, and only this tells
        a replay which."""
        return not (self._due() or stepping.only_finishing(self))

    def settle(self) -> None:
        """Do what the next decision does before it schedules anything: apply the arrivals
        and client cancellations due by the clock (unless a multi-step window holds them),
        then, if only requests finished by the last step are left, release them (a replay,
        where the session's last decision ran no step)."""
        self.arrive_due()
        if stepping.only_finishing(self):
            self._release()

    def _due(self) -> bool:
        """Whether the next decision starts by applying arrivals or client cancellations."""
        # (a cancellation of a request that has ended since, blocks given back, does nothing
        # when it comes due: dropped here, so that whether anything is due does not depend on
        # whether an idle decision has passed over it, which a replay cannot know)
        cancels = self._cancels
        while cancels and self._spent_cancel(cancels[0][1]):
            heapq.heappop(cancels)
        return (self._next_external() <= self.now
                and not (self._window and self.policy.running))

    def _spent_cancel(self, req_id: int) -> bool:
        req = self.requests.get(req_id)
        return ((req is None or req.state.is_done)
                and stepping.releasing_request(self, req_id) is None)

    def step(self) -> int:
        """Run exactly one engine step (or one idle advance). Returns steps taken (0 or 1)."""
        self._load_constants()
        return self._advance(INF, 1)

    def run_until(self, t: float, max_steps: int | None = None) -> int:
        """Run steps that start before simulated time `t`; idle time moves the clock to `t`.

        Returns the number of engine steps taken.
        """
        start = self.step_count
        budget = max_steps if max_steps is not None else 1 << 62
        t0 = time.perf_counter()
        self._load_constants()
        with paused_gc():
            stepping.run_loop(self, t, budget)  # (raises EngineError on a stalled engine)
            if self.done and self.now < t and math.isfinite(t):
                self._idle_to(t)
        self.timeline.flush()  # (between calls the engine holds its rows in columns only)
        self.wall_s += time.perf_counter() - t0
        return self.step_count - start

    def run(self, max_steps: int | None = None) -> int:
        """Run until every request has finished, been cancelled or rejected."""
        return self.run_until(INF, max_steps)

    def advance_to(self, step: int, t: float) -> None:
        """Bring the engine to exactly `step` steps run and the clock at `t` (replaying a
        recorded action). Raises EngineError if the run cannot land there."""
        if step > self.step_count:
            self.run_until(t, step - self.step_count)
        self._load_constants()
        while self.step_count == step and self.now < t:
            before = self.now
            self._advance(t, 1)
            if self.now == before:  # (a decision that ran no step and did not move the clock:
                # on to the next arrival or cancellation, decided at its time as the session
                # did, or to `t`)
                nxt = self.next_event()
                self._idle_to(nxt if before < nxt < t else t)
        if self.step_count != step or self.now != t:
            raise EngineError(f"replay diverged: expected step {step} at t={t:.9f}, "
                              f"got step {self.step_count} at t={self.now:.9f}")

    def _idle_to(self, t: float) -> None:
        self.idle_time += t - self.now
        self.now = t

    def inject(self, prompt_len: int | None = None, max_output_tokens: int = 128, *,
               priority: int = 0, prompt_text: str | bytes | None = None,
               count: int = 1, arrival_time: float | None = None,
               tag: str | None = None) -> list[int]:
        """Add `count` requests arriving now, or at `arrival_time` (not after now: a request
        that arrived while a step was running joins the queue at this step boundary, its
        latencies timed from when it arrived). `tag` names who sent them (shown on screens).
        Returns their ids.

        Raises EngineError on a length, count or priority out of range (`checked_injection`),
        or an arrival time after now; ScenarioError on an output so long its per-step records
        would not fit in memory.
        """
        prompt_len, prompt_text = checked_injection(prompt_len, max_output_tokens, prompt_text,
                                                    count, priority)
        extra: dict[str, Any] = {}
        if arrival_time is not None:
            if not 0.0 <= arrival_time <= self.now:
                raise EngineError(f"inject: arrival_time = {arrival_time!r}: must be between 0 "
                                  f"and now ({self.now!r})")
            extra["arrival_time"] = arrival_time
        if tag is not None:
            extra["tag"] = tag
        self._action("inject", prompt_len=prompt_len, max_output_tokens=max_output_tokens,
                     priority=priority, count=count,
                     prompt_text=None if prompt_text is None else prompt_text.decode("latin-1"),
                     **extra)
        ids = []
        t = self.now if arrival_time is None else arrival_time
        for _ in range(count):
            req = Request(self._next_id, t, prompt_len, max_output_tokens,
                          priority=priority, prompt_text=prompt_text, injected=True)
            req.tag = tag
            self._next_id += 1
            self.counts["injected"] += 1
            self._on_arrival(req)
            ids.append(req.req_id)
        return ids

    def cancel(self, req_id: int) -> None:
        """Cancel a request in any live state. Raises UnknownRequestError / EngineError.
        (A request that finished in the last step but still holds its blocks, under async
        scheduling, gives them back now, as vLLM's abort of it would.)"""
        req = stepping.releasing_request(self, req_id)
        if req is not None:
            self._action("cancel", req_id=req_id)
            self._release_now(req)
            return
        req = cancellable(self.requests, req_id, self.recent)
        self._action("cancel", req_id=req_id)
        self._cancel(req, by="user")

    def cancel_waiting(self) -> list[int]:
        """Cancel every queued request (not those running). Returns their ids."""
        ids = [r.req_id for r in self.policy.waiting_in_order()]
        self._action("cancel_waiting")
        for i in ids:
            req = self.requests.get(i)  # (a sample goes with its request, and may be forgotten)
            if req is not None and not req.state.is_done:
                self._cancel(req, by="user")
        return ids

    def switch_policy(self, name: str) -> None:
        """Hand the queue and batch to another policy, from the next step on."""
        if name not in POLICIES:
            raise EngineError(f"switch_policy: unknown policy {name!r} "
                              f"(known: {', '.join(POLICIES)})")
        self._action("switch_policy", policy=name, previous=self.policy.name)
        self._release()
        new = POLICIES[name](self)
        new.adopt(self.policy)
        self.policy = new

    def apply_action(self, action: str, args: dict) -> None:
        """Re-apply a recorded user action (replay)."""
        if action == "inject":
            text = args.get("prompt_text")
            # (only an engine's own injections carry these; a deployment's `inject` has none)
            extra = {k: args[k] for k in ("arrival_time", "tag") if k in args}
            self.inject(args["prompt_len"], args["max_output_tokens"],
                        priority=args.get("priority", 0), count=args.get("count", 1),
                        prompt_text=None if text is None else text.encode("latin-1"), **extra)
        elif action == "cancel":
            self.cancel(args["req_id"])
        elif action == "cancel_waiting":
            self.cancel_waiting()
        elif action == "switch_policy":
            self.switch_policy(args["policy"])
        else:
            raise EngineError(f"unknown action {action!r}")

    def snapshot(self, with_tokens: bool = False, waiting_limit: int | None = None
                 ) -> EngineSnapshot:
        """A cheap copy of the engine's state for a screen (about 1 ms for 500 queued).

        `waiting_limit` copies only the first N of the queue (in admission order);
        `num_waiting` always counts all of it.
        """
        nb = self.kv.num_blocks
        owner = np.full(nb, -1, dtype=np.int64)
        running = self.policy.running
        hybrid = self.kv.hybrid
        for r in running:
            if r.block_table:
                owner[self.kv.held_blocks(r) if hybrid else r.block_table] = r.req_id
        pool = self.kv.pool
        slots = pool.num_used * self.block_size - stepping.empty_slots(self)
        refs = np.asarray(pool.ref_cnt, dtype=np.int32)
        cached = np.zeros(nb, dtype=bool)
        if pool.cached:
            cached[pool.cached_block_ids()] = True
            cached &= refs == 0  # free, but still holding a reusable prefix
        waiting = self.policy.waiting_in_order()
        shown = waiting if waiting_limit is None else waiting[:waiting_limit]
        return EngineSnapshot(
            now=self.now, step=self.step_count, policy=self.policy.name, done=self.done,
            waiting=[_view(r) for r in shown],
            running=[_view(r, with_tokens) for r in running],
            recent=[_view(r, with_tokens) for r in reversed(self.recent)],
            num_blocks=nb, block_size=self.block_size, used_blocks=pool.num_used,
            block_owner=owner, block_refs=refs, free_cached_blocks=int(cached.sum()),
            block_cached=cached, token_slots_used=slots, counters=dict(self.counts),
            num_waiting=len(waiting), load=load_label(self.scenario.workload),
        )

    def get(self, req_id: int) -> Request:
        """The request with this id. Raises UnknownRequestError."""
        try:
            return self.requests[req_id]
        except KeyError:
            raise UnknownRequestError(f"no request with id {req_id}") from None

    # ============================================ hooks for sim.deploy.cluster (several instances)
    # A deployment of several engines (replicas, a prefill/decode pair) routes arrivals itself,
    # advances each engine one decision at a time, and moves requests between instances; these
    # methods are the only ways it changes an engine.
    def decide(self, until: float, max_steps: int) -> int:
        """One scheduling decision: a step, a run of identical decode steps that ends at the
        first step boundary at or after `until` (or after `max_steps` steps), or an idle advance
        toward `until`. Returns the engine steps taken."""
        # (not fused: a deployment routes, hands off and cancels between any two decisions)
        self._load_constants()
        return self._advance(until, max_steps, fuse=False)

    def next_event(self) -> float:
        """The time of the next arrival or client cancellation this engine knows of."""
        return self._next_external()

    def arrive_due(self) -> None:
        """Apply the arrivals and client cancellations due by now, as the next decision would
        first (a deployment looks at the engine's room after them): not within a multi-step
        window, whose steps they wait for as they do on a single engine."""
        if self._due():
            self._arrive(self.now)

    def idle_until(self, t: float) -> None:
        """Move the clock of an engine with nothing to run forward to `t` (no-op if past it)."""
        if t > self.now:
            self._idle_to(t)

    def receive(self, req: Request) -> None:
        """A request routed here from outside, arriving at `req.arrival_time` (at or before
        `now`): it joins the queue at this step boundary, or is rejected."""
        self._on_arrival(req)

    def hand_off(self, req: Request) -> list[int]:
        """`req`, running with its prompt prefilled, leaves this engine for another: it leaves
        the batch and this engine's pending cancellations and moves to TRANSFERRING. Its blocks
        stay allocated (their K/V is being sent) until `handed_off`. Returns them."""
        self.policy.remove(req)
        req.transition(RS.TRANSFERRING)
        if req.cancel_at is not None:
            self._cancels = [c for c in self._cancels if c[1] != req.req_id]
            heapq.heapify(self._cancels)
        blocks, req.block_table = req.block_table, []
        req.cached_upto = 0
        return blocks

    def handed_off(self, req: Request, blocks: list[int]) -> None:
        """The K/V of `req`, handed off, has left (or the request was cancelled on its way):
        free the `blocks` it held here and forget it."""
        self.kv.pool.free(reversed(blocks))
        self.requests.pop(req.req_id, None)
        self._drop(req)

    def take_over(self, req: Request, blocks: list[int]) -> None:
        """`req`, handed off by another engine, joins this engine's running batch from the next
        step, the K/V of its computed tokens in `blocks` (allocated here by the caller)."""
        # Its earlier tokens are on the other engine's timeline: the segment naming them starts
        # below 0, so no step here is adjacent to it and its next gap is timed from its last
        # token (the hand-off included).
        earlier = req.token_times()
        req._timeline = _Continued(self.timeline, earlier)
        req.token_segments = [[-len(earlier) - 1, len(earlier)]]
        req.block_table = blocks
        self.requests[req.req_id] = req
        if req.cancel_at is not None:
            heapq.heappush(self._cancels, (req.cancel_at, req.req_id))
        req.transition(RS.RUNNING)
        self.policy.running.append(req)
        if self.prefix_caching:
            self.kv.cache_blocks(req, req.num_computed_tokens)

    # ============================================================ transitions used by policies
    def has_finishing(self) -> bool:
        """Whether requests finished by the last step still hold blocks and seats in the batch
        (async scheduling: vLLM processes a step's output after scheduling the next)."""
        return bool(self._releasing)

    def preempt(self, req: Request) -> None:
        """Preempt a running request: by swap (its blocks go to host memory and come back
        when it resumes) when `scheduler.preemption = "swap"` and the host pool has room,
        else by recompute (its blocks are freed; it re-prefills every token it had). A request
        that finished in the last step, still holding its blocks (async scheduling), frees
        them and stays finished (vLLM counts a preemption; it is none here)."""
        if req.state is RS.FINISHED:
            self._release_now(req)
            return
        pairs = self.kv.swap_out(req) if self.preemption == "swap" else None
        if pairs is not None:
            req.transition(RS.SWAPPED)
            self._swap_out.extend(pairs)
            self.counts["swaps"] += 1
            mode = "swap"
        else:
            req.transition(RS.PREEMPTED)
            self.kv.free(req)
            req.num_computed_tokens = 0
            req.recomputing = True
            if self.executor is not None:
                self._freed.append(req.req_id)
            mode = "recompute"
        req.num_preemptions += 1
        self.counts["preemptions"] += 1
        if self.record_events:
            self.events.append(ev.Preempt(self.now, req.req_id, mode))

    # ====================================================================== internals: events
    # Whether a user action records `settled`: an instance of a deployment does not (the
    # deployment's own action says it for every instance, and a replay reads that one).
    records_settled = True

    def _action(self, action: str, **args) -> None:
        if self.record_events:
            if self.records_settled:
                args["settled"] = self.settled
            self.events.append(ev.UserAction(self.now, self.step_count, action, args))

    def _next_external(self) -> float:
        """When the next arrival or client cancellation is due (math.inf: none)."""
        return stepping.next_external(self)

    def _arrive(self, now: float) -> None:
        stepping.arrive(self, now)

    def _on_arrival(self, req: Request) -> None:
        stepping.on_arrival(self, req)

    def _cancel(self, req: Request, by: str) -> None:
        if req.parent_id is None and self.num_samples > 1:  # the request's other samples too
            for child in [r for r in self.requests.values()
                          if r.parent_id == req.req_id and not r.state.is_done]:
                self._cancel(child, by)
        old = req.state
        self.policy.remove(req)
        self.kv.free(req)
        req.transition(RS.CANCELLED)
        req.cancelled_in = old
        req.finish_time = self.now
        self.counts["cancelled" if req.parent_id is None else "cancelled_samples"] += 1
        self.recent.append(req)
        self._drop(req)
        if self.record_events:
            self.events.append(ev.Cancel(self.now, req.req_id, old.value, by))
        for o in self.observers:
            o.ended(self, req)

    def _release(self) -> None:
        """Async scheduling: the step scheduled after the one that finished these requests
        has been; their output is processed now, their blocks freed and seats given back."""
        stepping.release(self)

    def _blocks_freed_by(self, reqs: list[Request]) -> int:
        """How many blocks freeing `reqs` would return (those no other request shares)."""
        kv = self.kv
        if not kv.pool.sharing:
            return sum([len(kv.held_blocks(r)) if kv.hybrid else len(r.block_table)
                        for r in reqs])
        ref = kv.pool.ref_cnt
        held = Counter([blk for r in reqs
                        for blk in (kv.held_blocks(r) if kv.hybrid else r.block_table)])
        return sum([1 for blk, c in held.items() if ref[blk] == c])

    def _release_now(self, req: Request) -> None:
        """Free a finished request's blocks and seat before its output is processed (it was
        preempted, or its client went away)."""
        self._releasing.remove(req)
        self.kv.free(req)
        if req in self.policy.running:  # (a victim has left it already)
            self.policy.finished(req)

    def _drop(self, req: Request) -> None:
        stepping.drop(self, req)

    def _load_constants(self) -> None:
        """Copy the class constants the hot path reads into native fields (a subclass or a
        test may change them); done each time a run starts (`run_until`, `step`, `decide`,
        `advance_to`)."""
        self._scalar_steps, self._run_steps_max = self.SCALAR_STEPS, self.RUN_STEPS_MAX

    # ===================================================================== internals: stepping
    def _advance(self, until: float, max_steps: int, fuse: bool = True) -> int:
        """One scheduling decision: a step, a run of identical decode steps, or an idle advance;
        with `fuse`, followed by the runs of decode steps that need no decision (see
        `sim.engine.stepping.decodes_follow`). Returns the number of engine steps taken.
        (`sim.engine.stepping.advance`, compiled where the install could.)"""
        return stepping.advance(self, until, max_steps, fuse)

    def _fork(self, parent: Request, t: float, g: int, seats: int) -> list[Request]:
        """Start the further samples of `parent`, which has just sampled its first token: each
        shares the parent's full blocks (by reference count) and gets a copy of its partial last
        block, and samples on its own from the next step. Each is a sequence of its own in
        `max_num_seqs` (vLLM V1 fans `n` out into `n` requests): a sample that finds none of
        the `seats` free in the next step, or no free block for its copy, waits in the queue
        where vLLM's would (`Policy.add_sample`) and will prefill from scratch, as does one
        that does not fit to its last token under `engine.guaranteed_no_evict`. Returns the
        samples that started (each has its first token and takes a seat; with a one-token
        output it ends with the parent)."""
        started: list[Request] = []
        bs = self.block_size
        full = parent.num_computed_tokens // bs
        pool = self.kv.pool
        # (under engine.guaranteed_no_evict, the running requests' blocks at their last tokens,
        # each sample started here added as it joins them; 0 without the rule)
        reserved = self.policy.reserved_blocks()
        for _ in range(self.num_samples - 1):
            child = Request(self._next_id, parent.arrival_time, parent.prompt_len,
                            parent.max_output_tokens, priority=parent.priority,
                            hash_ids=parent.hash_ids, prompt_text=parent.prompt_text)
            self._next_id += 1
            child.parent_id = parent.req_id
            child.shared_prefix = parent.shared_prefix
            child.sent_time = parent.sent_time
            child._timeline = self.timeline
            self.requests[child.req_id] = child
            if self.record_events:
                self.events.append(ev.Fork(t, parent.req_id, child.req_id))
            partial = len(parent.block_table) - full
            # (under engine.guaranteed_no_evict a sample starts only if it fits to its end)
            if (len(started) >= seats or partial > pool.num_free
                    or not self.policy.fits_to_completion(child, reserved)):
                self.policy.add_sample(child)
                continue
            for b in parent.block_table[:full]:
                pool.share(b)
            child.block_table = parent.block_table[:full]
            if partial:
                [dst] = pool.allocate(1)
                self._copies.append((parent.block_table[full], dst))
                child.block_table.append(dst)
            child.transition(RS.RUNNING)
            child.admitted_time = parent.admitted_time
            child.num_computed_tokens = parent.num_computed_tokens
            child.num_output_tokens = 1
            child.output_token_ids = list(parent.output_token_ids)
            child.first_token_time = child.last_token_time = t
            child.token_segments = [[g, 1]]
            self.policy.running.append(child)
            started.append(child)
            reserved = self.policy.reserve(child, reserved)
        return started

    # Steps of a decode run computed one by one before switching to NumPy for the rest: most
    # runs end within a few steps (at the next arrival), where NumPy's per-call cost would
    # dominate; compiled, a step costs a few hundred instructions, so NumPy pays only for long
    # runs. (Either way the same bits: tests/test_compiled.py.)
    SCALAR_STEPS = 256 if compiled.COMPILED else 24
    # Steps of one decode run at most (its NumPy columns stay a few MB); a longer stretch is
    # several runs, whose events and timeline rows are the same as one run's.
    RUN_STEPS_MAX = 1 << 20

    def _build_work(self, sched) -> StepWork:
        seqs = []
        vocab = self.scenario.compute.vocab_size
        for req, n in sched:
            c = req.num_computed_tokens
            ids = self._prompt_ids.get(req.req_id)
            if ids is None:
                ids = prompt_token_ids(self.scenario.seed, req, vocab,
                                       self.workload.hash_block_size)
                self._prompt_ids[req.req_id] = ids
            p = req.prompt_len
            if c + n <= p:
                chunk = ids[c:c + n]
            elif c >= p:  # decode: only the newest outputs (not the whole history every step)
                chunk = np.asarray(req.output_token_ids[c - p:c - p + n], dtype=np.int32)
            else:
                out = np.asarray(req.output_token_ids, dtype=np.int32)
                chunk = np.concatenate((ids, out))[c:c + n]
            seqs.append(SeqWork(req.req_id, chunk, c, req.block_table,
                                c + n == req.num_tokens))
        work = StepWork(self.step_count, seqs, copies=self._copies, swap_out=self._swap_out,
                        swap_in=self._swap_in, freed=self._freed)
        return work

