"""Deployments of several engines: replicas behind a router (`[cluster]`), or prefill and
decode instances (`scheduler.policy = "disaggregated"`, as in DistServe and Splitwise:
`cluster.prefill_instances` of one, `decode_instances` of the other, 1 and 1 by default).

Each instance is a whole `Engine` (one modeled GPU, or `tensor_parallel` of them) with its own
clock, block pool, policy, timeline and event stream. The instances interact only here: the
router sends each arrival to one replica (or prefill instance), and a disaggregated request is
handed from its prefill instance to its decode instance after its first token.

Lockstep. Every instance advances one scheduling decision at a time (a step, a run of identical
decode steps, or an idle advance), and the one whose clock is furthest behind goes next, so that
when an instance decides at its step boundary `b`, everything the others can send it with a time
at or before `b` has already been sent. An instance's decision is bounded by the next thing that
can reach it (the next arrival, hand-off or cancellation, or the earliest time another instance
could still send it something), so a run of decode steps ends at the first step boundary at or
after it, and a delivery lands there, as a request reaching a real instance mid-step waits for
the step to end. An arrival is routed once every busy replica has reached its first step
boundary at or after the arrival's time (an idle one simply jumps there). An instance that
finds nothing it can schedule (its blocks held by hand-offs) idles until the next thing that
can reach it, and the others go meanwhile; with more than two instances, what can reach it
includes what a third may set off (a transfer started on one decode instance frees a prefill
instance's blocks, which then hands a request to another decode instance). Where an
instance's boundaries fall does not depend on how a caller slices time, so sliced and unsliced
runs give the same event streams; a session log records where each instance stood at each
user action and whether it had applied there what it found, and a replay brings every instance
there, applying that as it arrives, before applying the action.

Disaggregation. Every instance schedules as `chunked`. An arrival goes to a prefill instance
(by `cluster.router` when there are several) and, at the same moment, is given its decode
instance: the one with the fewest outstanding requests (in its batch or queue, or on their
way to it; ties: the lowest index). So do SGLang's PD router (a prefill and a decode worker
chosen together for each request, each by its own policy), llm-d's scheduler and Dynamo; the
decode instances' loads are read where they stand at the arrival. A request that samples its
first token leaves its prefill batch (TRANSFERRING) and waits, holding its prefill blocks,
until its decode instance has room for it (an empty queue there, free blocks for its context
above the watermark when it is running anything, a free sequence slot). Then the decode
instance allocates those blocks and the K/V travels for `context tokens * kv_bytes_per_token_gpu / (kv_link_gbps * 1e9)`
seconds (each transfer has the whole link; concurrent transfers are not modeled as sharing it).
When it has arrived, the decode instance takes the request into its batch at its next step
boundary and the prefill instance frees its blocks at its own; a cancellation in between frees
both sides. Each hand-off is costed alone, whatever the ratio. With real compute the K/V is
copied from the prefill executor's pool to the decode executor's (`export_kv` / `import_kv`).
"""

from __future__ import annotations

import heapq
import math
import time
import weakref
from collections import deque
from functools import partial
from dataclasses import dataclass, field

import numpy as np

from sim.engine import events as ev
from sim.engine import stepping
from sim.model.costmodel import CostModel
from sim.engine.engine import (Engine, EngineSnapshot, StepObserver, _view, cancellable,
                               checked_injection)
from sim.errors import EngineError, ScenarioError, UnknownRequestError
from sim.gcpause import paused_gc
from sim.stats.metrics import KVPeak
from sim.policies import POLICIES
from sim.stats.quantiles import Samples
from sim.engine.frontend import FrontEnd, chat_requests, open_loop
from sim.engine.request import Request, RequestState
from sim.deploy.routers import ROUTERS
from sim.inputs.workload import Workload, build_workload

RS = RequestState
INF = math.inf


# ================================================================================ disaggregation
class _FirstTokens(StepObserver):
    """A prefill instance's observer in a disaggregated deployment: a request that samples its
    first token leaves the batch at once for the decode instance (`on_first_token`)."""

    def __init__(self, on_first_token) -> None:
        self.on_first_token = on_first_token

    def stepped(self, engine, sched) -> None:
        for req, _ in sched:
            # Nothing decodes here, so one output token means it was sampled in this step.
            if req.num_output_tokens == 1 and req.state is RS.RUNNING:
                self.on_first_token(req)


@dataclass(slots=True, eq=False)
class Handoff:
    """One request on its way from a prefill instance to a decode instance."""

    req: Request
    ready: float                     # its first token's time: it left the prefill batch
    src: list[int]                   # its blocks on the prefill instance, held until `end`
    p: int                           # the prefill instance (index) it leaves
    d: int                           # the decode instance it goes to (chosen at its arrival)
    start: float | None = None       # the decode instance allocated `dst`; the K/V is on the link
    end: float | None = None
    dst: list[int] = field(default_factory=list)
    sent: bool = False               # the prefill instance has freed `src`
    joined: bool = False             # the decode instance took it into its batch


@dataclass(slots=True)
class InstanceView:
    """One instance's line on a screen."""

    index: int
    role: str                # "replica", "prefill", "decode"
    policy: str
    now: float
    step: int
    running: int
    waiting: int
    used_blocks: int
    num_blocks: int
    output_tokens: int
    finished: int
    routed: int              # requests routed to it (or handed to it)


ROLES = ("replica", "prefill", "decode", "rank", "virtual-engine")
# A deployment's mode and the role of each of its instances (but a disaggregated deployment's).
MODES = {"replicas": "replica", "disaggregated": None, "data-parallel": "rank",
         "pipeline": "virtual-engine"}


def deployment_header(policy: str, router: str | None, replicas: int,
                      mode: str = "replicas", prefill: int = 1, decode: int = 1) -> dict:
    """A deployment as its session log's header describes it (`cluster`): for policy
    "disaggregated", `prefill` prefill then `decode` decode instances, all chunked, behind
    `router` when there are several prefill instances (else none); else `replicas` instances
    of `policy` in `mode` (replicas, data-parallel ranks, pipeline virtual engines) behind
    `router`. The log reader checks a header against this."""
    if policy == "disaggregated":
        return {"mode": "disaggregated", "router": router if prefill > 1 else None,
                "instances": [{"role": r, "policy": "chunked"}
                              for r in ["prefill"] * prefill + ["decode"] * decode]}
    return {"mode": mode, "router": router,
            "instances": [{"role": MODES[mode], "policy": policy} for _ in range(replicas)]}


@dataclass(slots=True)
class ClusterSnapshot(EngineSnapshot):
    """An EngineSnapshot of the whole deployment (queues merged, `replica` set on each view;
    the block map is instance `focus`'s) plus a line per instance."""

    instances: list = field(default_factory=list)
    focus: int = 0
    transferring: int = 0    # requests between a prefill and a decode instance


# ======================================================================================= cluster
class Cluster:
    """Several engines advanced in lockstep (see the module docstring), with the Engine's public
    surface: `run`, `run_until`, `step`, `done`, `now`, `inject`, `cancel`, `cancel_waiting`,
    `switch_policy`, `snapshot`, `events` (the deployment's own), `counts`, `requests`, `get`,
    `scenario`; `summarize` and the session logs take it as they take an Engine.
    """

    RECENT = Engine.RECENT
    PRUNE_AT = 4096  # (keep_history off) `requests` is swept of ended ones from this size on

    def __init__(self, scenario, *, policy: str | None = None, make_executor=None,
                 workload: Workload | None = None, record_events: bool = True,
                 skip_ahead: bool = True, clock: str | None = None,
                 keep_history: bool = True) -> None:
        """`keep_history=False` bounds memory by what is in flight, as for an Engine."""
        name = policy or scenario.scheduler.policy
        self.disaggregated = name == "disaggregated"
        cl = scenario.cluster
        # Disaggregation: instances [0, num_prefill) prefill, the rest decode.
        self.num_prefill = cl.prefill_instances if self.disaggregated else 0
        n = (cl.prefill_instances + cl.decode_instances if self.disaggregated
             else self._size(scenario))
        if self.disaggregated and cl.replicas > 1:
            raise ScenarioError(
                f"{scenario.source}: cluster.replicas = {cl.replicas}: scheduler.policy = "
                "\"disaggregated\" counts its instances in cluster.prefill_instances and "
                "decode_instances; set cluster.replicas = 1")
        if scenario.workload.num_samples > 1:
            raise ScenarioError("workload.num_samples > 1: parallel sampling is not modeled "
                                "across several instances")
        self.scenario = scenario
        if self.disaggregated:
            self.mode = "disaggregated"
        self.initial_policy = name
        self.workload = workload if workload is not None else build_workload(scenario)
        self.record_events = record_events
        w = self.workload
        empty = Workload(arrival=np.zeros(0), prompt=np.zeros(0, np.int64),
                         output=np.zeros(0, np.int64), priority=np.zeros(0, np.int64),
                         cancel_at=np.zeros(0), hash_ids=None, hash_block_size=w.hash_block_size,
                         prefix_tokens=w.prefix_tokens)
        # No cluster <-> engine cycle (runs freeze what they made: a cycle would never be
        # collected): the instances' callbacks hold a proxy (a bound method, even one taken
        # through the proxy, holds the cluster itself).
        me = weakref.proxy(self)
        cls = type(self)
        self.instances: list[Engine] = []
        for i in range(n):
            kw = dict(policy="chunked" if self.disaggregated else name, workload=empty,
                      executor=make_executor(scenario) if make_executor else None,
                      record_events=record_events, skip_ahead=skip_ahead, clock=clock,
                      keep_history=keep_history)
            if i < self.num_prefill:
                kw["observers"] = [_FirstTokens(partial(cls._on_first_token, me))]
            e = self._instance(i, scenario, kw)
            e.policy.hands_off = i < self.num_prefill
            e.records_settled = False  # (this deployment's actions say it for each instance)
            self.instances.append(e)
        # One table of prefix chain ids for every instance, so that a request's block keys mean
        # the same on each (the router compares them, a hand-off carries them).
        for e in self.instances[1:]:
            e.kv._chains = self.instances[0].kv._chains
        # The instances an arrival is routed to: the prefill ones of a disaggregated deployment.
        self._entry = self.instances[:self.num_prefill] if self.disaggregated else self.instances
        self.roles = ([ROLES[1]] * self.num_prefill + [ROLES[2]] * (n - self.num_prefill)
                      if self.disaggregated else [MODES[self.mode]] * n)
        # (a disaggregated deployment routes arrivals over its prefill instances, if several)
        self.router = (ROUTERS[self._router_name(scenario)](cl)
                       if not self.disaggregated or self.num_prefill > 1 else None)
        self.clock = self.instances[0].clock
        self.executor = self.instances[0].executor
        self.block_size = scenario.kv.block_size
        self.events: list[ev.Event] = []
        self.requests: dict[int, Request] = {}
        self.keep_history = keep_history
        self._prune_at = self.PRUNE_AT
        # The peak of blocks in use over all instances: their rows merged in time order.
        self.kv_peak = KVPeak([e.timeline for e in self.instances])
        self._merging = False
        for e in self.instances:
            e.timeline.hold_kv = True
            e.timeline.on_seal = partial(cls._merge_kv, me)
        self.routed = [0] * n  # requests sent to each instance (routed, or handed off)
        self.wall_s = 0.0
        self.focus = 0  # the instance whose block map a snapshot carries
        # The workload, routed here (the instances' own workloads are empty): when each
        # request reaches the deployment, after the API server in front of it (sim.engine.frontend).
        self.frontend = FrontEnd.of(scenario.engine, chat_requests(scenario))
        times, sent = open_loop(self.frontend, w.arrival, w.prompt)
        self._w_arrival = times.tolist()
        self._w_sent = None if sent is None else sent.tolist()
        self._w_next = 0
        self._next_id = len(w)
        self._injected = 0
        # Disaggregation, by instance index: hand-offs waiting for room on a decode instance
        # (in order), in flight toward it (end, id), and not yet freed on a prefill instance
        # (end, id); the requests routed to a decode instance that have not joined it yet.
        self._handoffs: dict[int, Handoff] = {}
        self._ready: list[deque[Handoff]] = [deque() for _ in range(n)]
        self._inbound: list[list[tuple[float, int]]] = [[] for _ in range(n)]
        self._unsent: list[list[tuple[float, int]]] = [[] for _ in range(n)]
        self._bound_for: list[dict[int, Request]] = [{} for _ in range(n)]
        self._cancels: list[tuple[float, int]] = []  # client cancels of requests in hand-off
        # (ready, start, end) of each transfer (kept with the history); its figures
        self.transfers: list[tuple[float, float, float]] = []
        self.transfer_wait = Samples()
        self.transfer_time = Samples()
        # (steps, clock) at which an instance found nothing it could schedule; cleared by any
        # delivery, after which it may again.
        self._stuck: list[tuple | None] = [None] * n
        # (steps, clock) at which each instance last applied what it finds at a decision's
        # start (arrivals, cancellations, deliveries), and whether the deployment has routed
        # what was due since its last decision or user action: see `settled`.
        self._settled: list[tuple | None] = [None] * n
        self._routed = False
        self.cancelled_in_transfer = 0
        if self.disaggregated:
            cost = CostModel(scenario)
            self._s_per_token = (cost.kv_bytes_per_token_gpu
                                 / (scenario.scheduler.kv_link_gbps * 1e9))
            watermark = scenario.scheduler.watermark
            self._reserve = int(watermark * scenario.kv.num_blocks)

    # ================================== what a kind of deployment (sim.deploy.parallel) overrides
    mode = "replicas"

    def _size(self, scenario) -> int:
        """How many instances (a disaggregated deployment aside)."""
        return scenario.cluster.replicas

    def _router_name(self, scenario) -> str:
        return scenario.cluster.router

    def _instance(self, i: int, scenario, kw: dict) -> Engine:
        """Instance `i`: an Engine with the Cluster's arguments `kw`."""
        return Engine(scenario, **kw)

    @property
    def gpus(self) -> int:
        """GPUs the deployment uses."""
        return len(self.instances) * self.scenario.model.tensor_parallel

    def deployment_figures(self) -> dict:
        """What the summary's `deployment` adds for this kind of deployment."""
        return {}

    # ============================================================================ public API
    @property
    def prefill(self) -> Engine:
        """The (first) prefill instance of a disaggregated deployment."""
        return self.instances[0]

    @property
    def decode(self) -> Engine:
        """The (first) decode instance of a disaggregated deployment."""
        return self.instances[self.num_prefill]

    @property
    def policy(self):
        """The first instance's policy (every instance runs the same one)."""
        return self.instances[0].policy

    @property
    def policy_label(self) -> str:
        p = self.instances[0].policy.name
        if self.disaggregated:
            n = len(self.instances)
            label = "disaggregated" + (f" {self.num_prefill}:{n - self.num_prefill}"
                                       if n > 2 else "")
            return label if p == "chunked" else f"{label} ({p})"
        return f"{p} x{len(self.instances)} ({self.router.name})"

    @property
    def now(self) -> float:
        """The simulated time up to which the whole deployment has run: the clock of the busy
        instance furthest behind (or, when none is busy, the latest clock)."""
        busy = [e.now for i, e in enumerate(self.instances) if self._busy(i)]
        return min(busy) if busy else max(e.now for e in self.instances)

    @property
    def step_count(self) -> int:
        return sum(e.step_count for e in self.instances)

    @property
    def counts(self) -> dict:
        """The instances' counters summed; `arrived` and `injected` count each request once."""
        out: dict = {}
        for e in self.instances:
            for k, v in e.counts.items():
                out[k] = out.get(k, 0) + v
        out["injected"] = self._injected
        out["cancelled"] += self.cancelled_in_transfer
        return out

    @property
    def done(self) -> bool:
        return (self._w_next >= len(self._w_arrival) and not self._handoffs
                and all(e.done for e in self.instances))

    def position(self) -> list[list]:
        """Where each instance stands: [steps run, clock]."""
        return [[e.step_count, e.now] for e in self.instances]

    @property
    def settled(self) -> list[bool]:
        """Whether the deployment has routed what was due (the arrivals and the cancellations
        between instances that every instance concerned has reached) since its last decision
        or user action, then whether each instance has applied, where it stands, what its
        next decision would first (the arrivals, cancellations and deliveries due by its
        clock). A session log records it with each position: an instance whose last decision
        applied them and found nothing more to do stands where one cut before them does, and
        a deployment run up to t = 0 where one never run does."""
        return [self._routed] + [p == (e.step_count, e.now)
                                 for p, e in zip(self._settled, self.instances)]

    def settle(self, settled: list[bool] | None) -> None:
        """Apply what `settled` (a recorded session's, or None: nothing) says the session had
        applied where the deployment stands (a replay, at a recorded position)."""
        engines = self.instances
        if type(settled) is not list or len(settled) != len(engines) + 1:
            return  # (a log written before logs said)
        if settled[0] and not self._routed:
            self._global()
        mine = self.settled
        for i in sorted(range(len(engines)), key=lambda i: (engines[i].now, i)):
            if settled[i + 1] and not mine[i + 1]:
                self._settle_one(i)
                if settled[0]:
                    self._global()

    def _settle_one(self, i: int) -> bool:
        """Instance `i` applies what its decision would first, and runs no step (a replay, at
        a recorded position). Returns whether anything was delivered."""
        delivered = self._prologue(i)
        self.instances[i].settle()  # (its decision, which ran no step)
        return delivered

    def get(self, req_id: int) -> Request:
        try:
            return self.requests[req_id]
        except KeyError:
            raise UnknownRequestError(f"no request with id {req_id}") from None

    def step(self) -> int:
        """One decision of the instance furthest behind. Returns engine steps taken.
        Raises EngineError when requests remain that nothing can move."""
        with paused_gc():
            n = self._decide(INF, 1)
            self._global()
        if n is None and not self.done:
            self._stalled()
        return n or 0

    def run(self, max_steps: int | None = None) -> int:
        """Run until every request has ended; then every instance's clock is brought to the
        latest (the deployment's duration)."""
        n = self.run_until(INF, max_steps)
        if self.done:
            end = max(e.now for e in self.instances)
            for e in self.instances:
                e.idle_until(end)
        return n

    def run_until(self, t: float, max_steps: int | None = None, *,
                  caps: list | None = None, settled: list | None = None) -> int:
        """Run every instance to its first step boundary at or after `t` (idle ones to `t`).
        `caps` ([steps, clock] per instance, a replay's) are positions no instance passes, and
        `settled` (the recorded `settled` there) says which had applied there what it found.
        Returns the engine steps taken."""
        start = self.step_count
        budget = max_steps if max_steps is not None else 1 << 62
        t0 = time.perf_counter()
        stalls, before = 0, None
        with paused_gc():
            n = 0
            while self.step_count - start < budget:
                n = self._decide(t, budget - (self.step_count - start), caps, settled)
                if n is None:
                    break
                key = (self.step_count, tuple(e.now for e in self.instances), self._w_next,
                       *map(len, self._ready), *map(len, self._inbound),
                       *map(len, self._unsent))
                stalls = stalls + 1 if key == before else 0
                before = key
                if stalls > 3:
                    raise EngineError(f"deployment stalled at t={self.now:.6f}")
            self._global()
            if n is None and caps is None and not math.isfinite(t) and not self.done:
                self._stalled()
            if n is None and math.isfinite(t) and caps is None:
                for i, e in enumerate(self.instances):
                    if not self._busy(i):
                        e.idle_until(t)
        self.wall_s += time.perf_counter() - t0
        return self.step_count - start

    def _merge_kv(self) -> None:
        """Merge the instances' KV use up to where it is final, so that their timelines may
        drop those rows (called when an instance's timeline seals a chunk)."""
        if self._merging:  # (reading a timeline may seal another's chunk)
            return
        self._merging = True
        busy = [e.now for i, e in enumerate(self.instances) if self._busy(i)]
        # No instance adds a row ending before its clock; one idle now gets work no earlier
        # than the next arrival, or a hand-off from a busy one.
        try:
            self.kv_peak.advance(min(busy + [self._next_arrival()]))
        finally:
            self._merging = False

    def _stalled(self):
        raise EngineError(f"deployment stalled at t={self.now:.6f}: {len(self._handoffs)} "
                          "requests between instances, nothing can move")

    def advance_to(self, at: list, settled: list | None = None) -> None:
        """Bring every instance to exactly `at` ([steps, clock] each; a recorded action's;
        `settled`, the recorded `settled` there).
        Raises EngineError if the run cannot land there. Already there, nothing runs (as a
        single engine's `advance_to`): a log exported before the first step has routed none
        of the arrivals due at t = 0, and its replay must not either."""
        if self.position() == [list(p) for p in at]:
            return
        self.run_until(INF, caps=at, settled=settled)
        for (step, t), e in zip(at, self.instances):
            if e.step_count == step and e.now < t and not e.policy.has_work():
                e.idle_until(t)
        if self.position() != [list(p) for p in at]:
            raise EngineError(f"replay diverged: expected instances at {at}, "
                              f"got {self.position()}")

    def inject(self, prompt_len: int | None = None, max_output_tokens: int = 128, *,
               priority: int = 0, prompt_text: str | bytes | None = None,
               count: int = 1) -> list[int]:
        """Add `count` requests arriving now, each routed at once. Returns their ids.
        Raises EngineError on a non-positive length or count."""
        prompt_len, prompt_text = checked_injection(prompt_len, max_output_tokens, prompt_text,
                                                    count, priority)
        self._action("inject", prompt_len=prompt_len, max_output_tokens=max_output_tokens,
                     priority=priority, count=count,
                     prompt_text=None if prompt_text is None else prompt_text.decode("latin-1"))
        now = self.now
        ids = []
        for _ in range(count):
            req = Request(self._next_id, now, prompt_len, max_output_tokens, priority=priority,
                          prompt_text=prompt_text, injected=True)
            self._next_id += 1
            self._injected += 1
            self._route(req)
            ids.append(req.req_id)
        return ids

    def cancel(self, req_id: int) -> None:
        """Cancel a request in any live state (TRANSFERRING included). Raises
        UnknownRequestError / EngineError. (A request that finished in its instance's last step
        but still holds its blocks, under async scheduling, gives them back now, as a single
        engine's does.)"""
        for inst in self.instances:
            if stepping.releasing_request(inst, req_id) is not None:
                self._action("cancel", req_id=req_id)
                inst.cancel(req_id)
                return
        req = cancellable(self.requests, req_id)
        self._action("cancel", req_id=req_id)
        h = self._handoffs.get(req_id)
        if h is not None and not h.joined:
            self._cancel_handoff(h, self.now, "user")
        else:
            self.instances[req.replica].cancel(req_id)

    def cancel_waiting(self) -> list[int]:
        """Cancel every queued request on every instance. Returns their ids."""
        self._action("cancel_waiting")
        ids = []
        for e in self.instances:
            ids += e.cancel_waiting()
        return ids

    def switch_policy(self, name: str) -> None:
        """Every instance hands its queue and batch to policy `name` from its next step."""
        if name not in POLICIES or (self.disaggregated and name == "contiguous"):
            known = [p for p in POLICIES if not (self.disaggregated and p == "contiguous")]
            raise EngineError(f"switch_policy: {name!r} is not a policy for this deployment "
                              f"(known: {', '.join(known)})")
        self._action("switch_policy", policy=name, previous=self.policy.name)
        for e in self.instances:
            e.switch_policy(name)

    # Re-apply a recorded user action (replay): the Engine's dispatch, over this class's
    # methods (a deployment's actions also carry the instances' positions, `at`, unused here).
    apply_action = Engine.apply_action

    def snapshot(self, with_tokens: bool = False,
                 waiting_limit: int | None = None) -> ClusterSnapshot:
        """The deployment's queues merged (each view's `replica` says where it is; at most
        `waiting_limit` queued per instance), the block map of instance `focus`, and a line per
        instance."""
        snaps = [e.snapshot(with_tokens, waiting_limit) for e in self.instances]
        for i, s in enumerate(snaps):
            for v in (*s.waiting, *s.running, *s.recent):
                v.replica = i
                v.clock = s.now
        running = [v for s in snaps for v in s.running]
        listed = {v.req_id for v in running}
        for h in self._handoffs.values():
            if h.req.req_id in listed:  # (the decode instance has it in its batch already)
                continue
            v = _view(h.req, with_tokens)
            v.replica = h.d if h.start is not None else h.p
            v.num_blocks = len(h.src) + len(h.dst)
            running.append(v)
        recent = sorted((v for s in snaps for v in s.recent),
                        key=lambda v: -(v.finish_time or 0.0))[:self.RECENT]
        f = snaps[self.focus]
        owner = f.block_owner
        for h in self._handoffs.values():  # blocks held for a hand-off are its request's
            held = (h.src if self.focus == h.p and not h.sent else []) + (
                h.dst if self.focus == h.d and not h.joined else [])
            if held:
                owner[held] = h.req.req_id
        views = [InstanceView(i, self.roles[i], e.policy.name, e.now, e.step_count,
                              len(e.policy.running), len(e.policy.waiting),
                              e.kv.num_used_blocks, e.kv.num_blocks,
                              e.counts["output_tokens"], e.counts["finished"], self.routed[i])
                 for i, e in enumerate(self.instances)]
        return ClusterSnapshot(
            now=self.now, step=self.step_count, policy=self.policy_label, done=self.done,
            waiting=[v for s in snaps for v in s.waiting], running=running, recent=recent,
            num_blocks=f.num_blocks, block_size=f.block_size, used_blocks=f.used_blocks,
            block_owner=owner, block_refs=f.block_refs, free_cached_blocks=f.free_cached_blocks,
            token_slots_used=f.token_slots_used, counters=self.counts,
            block_cached=f.block_cached, num_waiting=sum(s.num_waiting for s in snaps),
            instances=views, focus=self.focus, transferring=len(self._handoffs))

    def tagged_events(self):
        """Every stream as (instance, events): the deployment's own (-1), then each
        instance's."""
        yield -1, self.events
        for i, e in enumerate(self.instances):
            yield i, e.events

    def log_events(self):
        """The events as a session log stores them: each stream opened by a `stream` event."""
        for i, events in self.tagged_events():
            yield ev.Stream(0.0, i)
            yield from events

    def log_header(self) -> dict:
        router = self.router.name if self.router is not None else None
        n = len(self.instances)
        return deployment_header(self.initial_policy, router, n, self.mode,
                                 self.num_prefill, n - self.num_prefill)

    # ============================================================================== lockstep
    def _action(self, action: str, **args) -> None:
        self._unstick()  # the action may give a stuck instance something it can schedule
        if self.record_events:
            args["at"] = self.position()
            args["settled"] = self.settled
            self.events.append(ev.UserAction(self.now, self.step_count, action, args))
        self._routed = False

    def _busy(self, i: int) -> bool:
        """Whether instance `i` has anything to do: requests, or a hand-off to serve."""
        if self.instances[i].policy.has_work():
            return True
        if not self.disaggregated:
            return False
        return bool(self._unsent[i] or self._ready[i] or self._inbound[i])

    def _senders(self, i: int) -> range:
        """The instances that can send instance `i` something directly: for a prefill
        instance the decode instances (a transfer's start), for a decode instance the prefill
        instances (a hand-off); none between replicas."""
        if not self.disaggregated:
            return range(0)
        p = self.num_prefill
        return range(p, len(self.instances)) if i < p else range(p)

    def _horizon(self, i: int, to: int, frozen=()) -> float:
        """A time before which instance `i` cannot send instance `to` anything (`frozen`
        instances send nothing more)."""
        h = self._own_horizon(i)
        if h > self.instances[i].now and len(self.instances) > 2:
            # Idle or stuck, it may be woken by a third, busy instance: a decode instance
            # starting a transfer frees a prefill instance's blocks, which then hands a request
            # to another decode instance. (`to` sends nothing while it runs: it starts
            # transfers and takes hand-offs only at a decision's start. An idle one is woken
            # by an arrival, or by a busy one, no earlier.)
            for k in range(len(self.instances)):
                if k != i and k != to and k not in frozen and self._busy(k):
                    h = min(h, max(self._own_horizon(k), self.instances[i].now))
        return h

    def _own_horizon(self, i: int) -> float:
        """A time before which instance `i` cannot send another instance anything unless a
        third sends it something first."""
        e = self.instances[i]
        if e.policy.has_work() and self._stuck[i] != (e.step_count, e.now):
            return e.now
        if not self._busy(i):
            # Nothing to act on: it sends nothing before an arrival reaches it (a client
            # cancellation left in its engine concerns a request that has ended there).
            return max(self._next_arrival(), e.now)
        # Stuck (nothing fits until blocks come back), or waiting on a hand-off: it acts again
        # when something reaches it.
        nxt = min(self._next_arrival(), e.next_event(),
                  self._cancels[0][0] if self._cancels else INF)
        if i < self.num_prefill:
            nxt = min(nxt, self._unsent[i][0][0] if self._unsent[i] else INF)
        else:  # it starts transfers when hand-offs reach it, or room frees up
            nxt = min(nxt, self._ready[i][0].ready if self._ready[i] else INF,
                      self._inbound[i][0][0] if self._inbound[i] else INF)
        return max(nxt, e.now)  # at its next boundary, at the earliest where it is

    def _next_arrival(self) -> float:
        return self._w_arrival[self._w_next] if self._w_next < len(self._w_arrival) else INF

    def _bound(self, i: int, until: float, frozen=()) -> float:
        """How far instance `i` may run before something can reach it (`frozen` instances, at
        a replay's recorded position, send nothing more before it)."""
        b = min(until, self._cancels[0][0] if self._cancels else INF)
        p = self.num_prefill
        # (several decode instances: an arrival's decode instance is chosen from their loads
        # where they stand at its arrival)
        if i < p or not self.disaggregated or len(self.instances) - p > 1:
            b = min(b, self._next_arrival())
        if self.disaggregated:
            # (an idle prefill instance too: an arrival at its horizon may be handed off here
            # one prefill step later, and step by step this instance would be there to take it)
            for j in self._senders(i):
                if j not in frozen:
                    b = min(b, self._horizon(j, i, frozen))
            if i < p:
                b = min(b, self._unsent[i][0][0] if self._unsent[i] else INF)
            else:
                b = min(b, self._inbound[i][0][0] if self._inbound[i] else INF)
                e = self.instances[i]
                for h in self._ready[i]:  # the next hand-off not yet due here
                    if h.ready > e.now:
                        b = min(b, h.ready)
                        break
        return b

    def _global(self) -> None:
        """Route the arrivals and apply the client cancellations (of requests between two
        instances) that every instance concerned has reached, in time order."""
        # (arrivals: the instances whose state the routing reads: a disaggregated deployment's
        # prefill instances, and its decode instances when it chooses among several)
        routes = range(len(self.instances))
        if self.disaggregated and len(self.instances) - self.num_prefill == 1:
            routes = range(self.num_prefill)
        while True:
            ta = self._next_arrival()
            tc = self._cancels[0][0] if self._cancels else INF
            t = min(ta, tc)
            if t == INF:
                self._routed = True
                return
            concerned = routes if ta <= tc else range(len(self.instances))
            if any(self.instances[i].now < t and self._busy(i) for i in concerned):
                self._routed = True
                return
            if ta <= tc:
                self._arrive(self._w_next)
            else:
                _, rid = heapq.heappop(self._cancels)
                h = self._handoffs.get(rid)
                if h is not None and not h.joined:  # (once joined, its instance cancels it)
                    self._cancel_handoff(h, t, "client")

    def _decide(self, until: float, max_steps: int, caps: list | None = None,
                settled: list | None = None) -> int | None:
        """One decision of the instance furthest behind that may decide: its steps (0 for an
        idle advance), or None when no instance has anything to do before `until` (or within
        `caps`; `settled` as `run_until`'s)."""
        self._global()
        self._routed = False  # (whatever this decision does may let more be routed)
        engines = self.instances
        delivered = False
        # Instances at a replay's recorded position: they take no further decision, and what
        # they sent before it has all been sent.
        frozen = () if caps is None else {
            i for i, (e, (step, t)) in enumerate(zip(engines, caps))
            if e.step_count > step or (e.step_count == step and e.now >= t)}
        for i in sorted(range(len(engines)), key=lambda i: (engines[i].now, i)):
            e = engines[i]
            if e.now >= until or not self._busy(i):
                continue
            if any(self._busy(j) and j not in frozen and self._horizon(j, i, frozen) < e.now
                   for j in self._senders(i)):
                continue  # another may still send it something from before its clock
            if i in frozen:
                # It decides no more, but what the session had applied where it stands, its
                # decision there applied before the others went on (what it delivered may
                # let an arrival be routed to another, whose recorded position needs it).
                if (type(settled) is list and len(settled) == len(engines) + 1
                        and settled[i + 1] and self._settled[i] != (e.step_count, e.now)
                        and [e.step_count, e.now] == list(caps[i])):
                    self._settle_one(i)
                    delivered = True
                continue
            steps, idle_cap = max_steps, INF
            if caps is not None:
                cap_step, cap_now = caps[i]
                steps = min(steps, cap_step - e.step_count)
                if steps == 0:
                    # At its recorded step with its clock behind the recorded one: it found
                    # nothing to schedule meanwhile (a step now would be a divergence).
                    steps, idle_cap = 1, cap_now
            delivered |= self._prologue(i)
            bound = min(self._bound(i, until, frozen), idle_cap)
            if e.policy.has_work():
                if (self._ready[i] and self._ready[i][0].ready <= e.now
                        and e.has_finishing()):
                    steps = 1  # finishing requests give blocks back after it: room for a hand-off
                before = (e.step_count, e.now, e.counts["preemptions"], e.counts["cancelled"])
                n = e.decide(bound, steps)
                if n or before != (e.step_count, e.now, e.counts["preemptions"],
                                   e.counts["cancelled"]):
                    self._stuck[i] = None
                    return n
                # Nothing fits (its blocks wait on a hand-off): it is stuck, and idles until
                # something can reach it while the other goes.
                self._stuck[i] = (e.step_count, e.now)
                bound = min(bound, e.next_event())
            if e.now < bound < INF:
                e.idle_until(bound)
                return 0
        # A delivery that let no instance move yet still changed what the others may do.
        return 0 if delivered else None

    def _prologue(self, i: int) -> bool:
        """What instance `i` finds at the start of a decision: the arrivals and cancellations
        due by its clock, then deliveries (`_deliver`, whose result it returns)."""
        e = self.instances[i]
        e.arrive_due()  # (a cancellation here may make room for a hand-off)
        delivered = self._deliver(i)
        self._settled[i] = (e.step_count, e.now)
        return delivered

    # ================================================================================ routing
    def _arrive(self, i: int) -> None:
        """Workload request `i` arrives: route it."""
        w = self.workload
        self._w_next += 1
        c = float(w.cancel_at[i])
        req = Request(i, self._w_arrival[i], int(w.prompt[i]), int(w.output[i]),
                      priority=int(w.priority[i]),
                      hash_ids=w.hash_ids[i] if w.hash_ids else None,
                      cancel_at=None if c != c else c)
        if w.prefix_group is not None:
            req.shared_prefix = (int(w.prefix_group[i]), w.prefix_tokens)
        if self._w_sent is not None:
            self.frontend.mark(req, self._w_sent[i])
        self._route(req)

    def _route(self, req: Request) -> None:
        if not self.keep_history and len(self.requests) >= self._prune_at:  # forget ended ones
            self.requests = {k: r for k, r in self.requests.items() if not r.state.is_done}
            self._prune_at = max(self.PRUNE_AT, 2 * len(self.requests))
        self.requests[req.req_id] = req
        if self.router is None:
            k, why = 0, "prefill"
        else:
            k, why = self.router.choose(req, self._entry)
        if len(self.instances) - self.num_prefill > 1 and self.disaggregated:
            d, load = self._choose_decode()
            self._bound_for[d][req.req_id] = req
            why += f"; decode {d} (least outstanding {load})"
        req.replica = k
        self.routed[k] += 1
        if self.record_events:
            self.events.append(ev.Route(req.arrival_time, req.req_id, k, why))
        e = self.instances[k]
        e.idle_until(req.arrival_time)  # an idle instance jumps to the arrival
        e.receive(req)
        self._unstick()

    # ========================================================================= disaggregation
    def _choose_decode(self) -> tuple[int, int]:
        """The decode instance for an arriving request, and its load: the one with the fewest
        outstanding requests (in its batch or queue, or routed to it and not yet joined it;
        ties: lowest index). As SGLang's PD router, llm-d and Dynamo do, the decode instance
        is chosen with the prefill instance when the request arrives."""
        loads = []
        for d in range(self.num_prefill, len(self.instances)):
            bound = self._bound_for[d]
            for rid in [rid for rid, r in bound.items() if r.state.is_done]:
                del bound[rid]  # (ended before it joined: cancelled or rejected)
            e = self.instances[d]
            loads.append(len(bound) + len(e.policy.running) + len(e.policy.waiting))
        i = loads.index(min(loads))
        return self.num_prefill + i, loads[i]

    def _decode_for(self, req: Request) -> int:
        """The decode instance chosen for `req` at its arrival."""
        for d in range(self.num_prefill, len(self.instances) - 1):
            if req.req_id in self._bound_for[d]:
                return d
        return len(self.instances) - 1

    def _on_first_token(self, req: Request) -> None:
        """A prefill instance sampled `req`'s first token: it leaves for its decode instance."""
        p = self.instances[req.replica]
        h = Handoff(req, p.now, p.hand_off(req), req.replica, self._decode_for(req))
        self._handoffs[req.req_id] = h
        self._ready[h.d].append(h)
        if req.cancel_at is not None:
            # A cancellation due while its last prefill step ran applies at that step's end,
            # as a single engine's would, not before its first token.
            heapq.heappush(self._cancels, (max(req.cancel_at, h.ready), req.req_id))
        if self.record_events:
            p.events.append(ev.Handoff(p.now, req.req_id, "ready", len(h.src)))

    def _deliver(self, i: int) -> bool:
        """What instance `i` finds at its step boundary: transfers that ended, and (a decode
        instance) hand-offs it now has room for. Returns whether there was any."""
        if not self.disaggregated:
            return False
        e = self.instances[i]
        done = False
        if i < self.num_prefill:
            unsent = self._unsent[i]
            while unsent and unsent[0][0] <= e.now:
                _, rid = heapq.heappop(unsent)
                self._send(self._handoffs[rid])
                done = True
            if done:
                self._unstick()
            return done
        inbound, ready = self._inbound[i], self._ready[i]
        while inbound and inbound[0][0] <= e.now:
            done = True
            _, rid = heapq.heappop(inbound)
            h = self._handoffs[rid]
            h.joined = True
            req = h.req
            req.replica = i
            self.routed[i] += 1
            self._bound_for[i].pop(rid, None)
            e.take_over(req, h.dst)
            if self.record_events:
                e.events.append(ev.Handoff(e.now, req.req_id, "joined", len(h.dst)))
            self._forget(h)
        cfg = self.scenario.scheduler
        # (the blocks its running and inbound requests will hold at their last tokens, under
        # its admission rule: each hand-off started here added as it joins them)
        held = self._reserved_on(e, inbound) if ready else 0
        while ready and ready[0].ready <= e.now:
            h = ready[0]
            busy = len(e.policy.running) + len(inbound)
            # (the watermark keeps room for the batch to grow; an empty instance takes any)
            reserve = self._reserve if busy else 0
            if (e.policy.waiting or e.kv.num_free_blocks - len(h.src) < reserve
                    or busy >= cfg.max_num_seqs or not e.policy.fits_to_completion(h.req, held)):
                break
            ready.popleft()
            self._start(h, e)
            held = e.policy.reserve(h.req, held)
            done = True
        if done:
            self._unstick()
        return done

    def _reserved_on(self, e: Engine, inbound) -> int:
        """What decode instance `e`'s admission rule holds back before taking a hand-off in
        (`Policy.fits_to_completion`): under `engine.guaranteed_no_evict`, the blocks its running
        requests and those `inbound` (transfers under way) will hold at their last tokens; 0
        without it."""
        pol = e.policy
        if not pol.no_evict:
            return 0
        return pol.reserved_blocks() + sum(
            [pol.completion_blocks(self._handoffs[rid].req) for _, rid in inbound])

    def _unstick(self) -> None:
        self._stuck = [None] * len(self.instances)

    def _start(self, h: Handoff, d: Engine) -> None:
        req = h.req
        h.dst = d.kv.pool.allocate(len(h.src))
        h.start = d.now
        h.end = d.now + req.num_computed_tokens * self._s_per_token
        p = self.instances[h.p]
        if p.executor is not None:  # the K/V really moves
            d.executor.import_kv(req.req_id, h.dst, p.executor.export_kv(req.req_id, h.src))
        heapq.heappush(self._inbound[h.d], (h.end, req.req_id))
        heapq.heappush(self._unsent[h.p], (h.end, req.req_id))
        if self.keep_history:
            self.transfers.append((h.ready, h.start, h.end))
        self.transfer_wait.add(h.start - h.ready)
        self.transfer_time.add(h.end - h.start)
        if self.record_events:
            d.events.append(ev.Handoff(d.now, req.req_id, "start", len(h.dst), h.end))

    def _send(self, h: Handoff) -> None:
        """The prefill side of a finished transfer: free its blocks."""
        p = self.instances[h.p]
        h.sent = True
        p.handed_off(h.req, h.src)
        if self.record_events:
            p.events.append(ev.Handoff(p.now, h.req.req_id, "sent", len(h.src)))
        self._forget(h)

    def _forget(self, h: Handoff) -> None:
        if h.sent and h.joined:
            del self._handoffs[h.req.req_id]

    def _cancel_handoff(self, h: Handoff, t: float, by: str) -> None:
        """Cancel a request between two instances: free its blocks on both sides. It ends
        at `t`, or where it got to if later (a user's, at the deployment's clock, may be behind
        the instance that handed it off)."""
        req = h.req
        rid = req.req_id
        t = max(t, h.ready, h.ready if h.start is None else h.start)
        if h.start is None:
            self._ready[h.d].remove(h)
        else:
            self._inbound[h.d] = [x for x in self._inbound[h.d] if x[1] != rid]
            heapq.heapify(self._inbound[h.d])
            self.instances[h.d].kv.pool.free(reversed(h.dst))
        if not h.sent:
            self._unsent[h.p] = [x for x in self._unsent[h.p] if x[1] != rid]
            heapq.heapify(self._unsent[h.p])
            self.instances[h.p].handed_off(req, h.src)
        del self._handoffs[rid]
        self._bound_for[h.d].pop(rid, None)
        self._cancels = [x for x in self._cancels if x[1] != rid]
        heapq.heapify(self._cancels)
        self._unstick()
        req.transition(RS.CANCELLED)
        req.cancelled_in = RS.TRANSFERRING
        req.finish_time = t
        self.cancelled_in_transfer += 1
        if self.record_events:
            self.events.append(ev.Cancel(t, rid, RS.TRANSFERRING.value, by))

    def handoff_blocks(self) -> list[tuple[int, list[int], list[int], int, int]]:
        """(request id, prefill blocks still held, decode blocks held before it joined, prefill
        instance, decode instance) of every request between two instances (for invariant
        checks)."""
        return [(rid, [] if h.sent else h.src, [] if h.joined else h.dst, h.p, h.d)
                for rid, h in self._handoffs.items()]
