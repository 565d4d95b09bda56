"""The policy interface: a scheduler owns the waiting queue and the running batch and decides,
each engine step, which requests compute how many tokens.

A policy speaks in requests and budgets; memory goes through the engine's KVCacheManager
(`allocate_slots`), and preemption through `engine.preempt`, which frees the victim's blocks and
records the transition. Adding a policy is one new module with a `Policy` subclass registered in
`sim.policies.POLICIES`.
"""

from __future__ import annotations

import math

import weakref
from collections import deque
from typing import Any, ClassVar

from mypy_extensions import mypyc_attr

from sim.policies import batch
from sim.policies.batch import PolicyState, SchedulerOutput
from sim.engine.kv import arrival_blocks
from sim.engine.request import Request, RequestState


def prefill_chunk(policy: Any, scheduler_cfg: Any, engine_cfg: Any) -> int:
    """The most of a prompt one step computes under the policy class `policy`, its
    `[scheduler]` and `[engine]` sections: the token budget where the policy chunks prompts
    (`chunks_prompts`) and the engine chunks prefills (`engine.chunked_prefill`), else 0 (a
    prompt is computed whole, in one step)."""
    if policy.chunks_prompts and engine_cfg.chunked_prefill:
        return int(scheduler_cfg.max_num_batched_tokens)
    return 0


@mypyc_attr(allow_interpreted_subclasses=True)
class Policy(PolicyState):
    """Base scheduler: FCFS queue order, most recently admitted request as preemption victim."""

    name: ClassVar[str] = "base"
    description: ClassVar[str] = ""
    # Whether a decode-only step stays the policy's choice until the next arrival, finish,
    # cancel or block shortage (true when admission depends only on those).
    skip_ahead_safe: ClassVar[bool] = True
    # Whether the policy models vLLM V1's scheduler: it then takes `scheduler.async_scheduling`,
    # `reserve_full_sequence` and the watermark as vLLM V1 applies them.
    models_v1: ClassVar[bool] = False
    # Whether a prompt may be computed in chunks of at most max_num_batched_tokens (else whole),
    # where the engine chunks prefills (`engine.chunked_prefill`): `prefill_chunk`
    chunks_prompts: ClassVar[bool] = False

    def __init__(self, engine) -> None:
        # A proxy, not a reference: no engine <-> policy cycle, so a dropped engine is freed
        # by reference counting alone (the engine runs with the cyclic collector paused).
        self.engine = weakref.proxy(engine)
        self.kv = engine.kv
        self.cfg = engine.scenario.scheduler
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        # With async scheduling a request that finished in the last step stays in `running`
        # (FINISHED), holding its blocks and seat, until the engine has scheduled the next one.
        self.async_scheduling = self.models_v1 and self.cfg.async_scheduling
        # After preempting itself for lack of blocks, a running request lets the requests after
        # it in the batch try (only `priority` can have any: others preempt the last one).
        self.continue_after_self_preemption = (self.models_v1
                                               and self.cfg.continue_after_self_preemption)
        # The most of a prompt one step computes (0: the whole prompt)
        self.chunk_tokens = prefill_chunk(type(self), self.cfg, engine.scenario.engine)
        # TensorRT-LLM's capacity scheduler (GUARANTEED_NO_EVICT): admission reserves the
        # blocks a request will hold at its last token (`fits_to_completion`)
        self.no_evict: bool = bool(engine.scenario.engine.guaranteed_no_evict)
        # Whether requests leave this engine after their first token (a disaggregated
        # deployment's prefill instance, which hands them off): their last token here is that
        # one, and so is what admission reserves for
        self.hands_off: bool = False

    # --- queue management (called by the engine) ------------------------------------------------
    def add(self, req: Request) -> None:
        """A new arrival joins the queue."""
        self.waiting.append(req)

    def add_sample(self, req: Request) -> None:
        """A further sample of a request (`num_samples`) that could not start beside it joins
        the queue where vLLM's `n` requests wait, queued together when their request arrived:
        behind the requests preempted back to the front and those that arrived before it,
        ahead of later arrivals. (Policies whose queue is ordered by a key place it by its
        key, which holds its request's arrival time.)"""
        key = (req.arrival_time, req.parent_id)
        for i, w in enumerate(self.waiting):
            if w.state is RequestState.WAITING and (
                    w.arrival_time, w.req_id if w.parent_id is None else w.parent_id) > key:
                self.waiting.insert(i, req)
                return
        self.waiting.append(req)

    def remove(self, req: Request) -> None:
        """Take `req` out of the queue or the batch (cancel, finish)."""
        if req in self.running:
            self.running.remove(req)
        else:
            self.waiting.remove(req)

    def finished(self, req: Request) -> None:
        self.running.remove(req)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def adopt(self, other: "Policy") -> None:
        """Take over another policy's queue and batch (a live policy switch)."""
        self.running.extend(other.running)
        self.hands_off = other.hands_off
        for r in other.waiting_in_order():
            self.add(r)

    def waiting_in_order(self) -> list[Request]:
        """The queue in the order the policy would admit it."""
        return list(self.waiting)

    def next_waiting(self) -> Request:
        """The request the policy would admit next (the queue is not empty)."""
        return self.waiting[0]

    def take_waiting(self, req: Request) -> None:
        """Remove `req`, just admitted, from the queue."""
        if self.waiting[0] is req:
            self.waiting.popleft()
        else:
            self.waiting.remove(req)

    def decodes_alone(self) -> bool:
        """Whether `schedule()`, with the queue empty and every running request decoding, would
        schedule each of them for one token in `running` order as `schedule_running` does
        (the engine then runs such steps without asking it again)."""
        return False

    def next_change_time(self) -> float:
        """The next simulated time at which the policy's queue order changes by itself (aging);
        a run of identical decode steps must not cross it."""
        return math.inf

    # --- helpers for subclasses -----------------------------------------------------------------
    def plan_waiting(self, req: Request, budget: Any) -> tuple[Any, list[int]]:
        """For a queued request: the tokens to compute within `budget` after the prefix the
        cache already holds, and the cached blocks of that prefix (see `allocate_slots`)."""
        hits = self.kv.match_prefix(req)
        n = req.num_tokens - req.num_computed_tokens - len(hits) * self.kv.block_size
        return min(n, budget), hits


    def completion_blocks(self, req: Request) -> int:
        """The blocks `req` holds at its last token on this engine (`sim.engine.kv.
        arrival_blocks`: its prompt and every output token but the last; its prompt alone where
        it is handed off after its first, `hands_off`)."""
        kv = self.kv
        out = 1 if self.hands_off else req.max_output_tokens
        return arrival_blocks(req.prompt_len, out, kv.block_size, kv.groups, self.chunk_tokens)

    def reserved_blocks(self) -> int:
        """Under `engine.guaranteed_no_evict`, the blocks the running requests will hold at
        their last tokens, whatever they hold now; 0 without it."""
        if not self.no_evict:
            return 0
        return sum([self.completion_blocks(r) for r in self.running])

    def reserve(self, req: Request, reserved: int) -> int:
        """`reserved` with `req`, just admitted, added: its blocks at its last token under
        `engine.guaranteed_no_evict`, nothing without it (`reserved_blocks` is then 0)."""
        return reserved + self.completion_blocks(req) if self.no_evict else reserved

    def fits_to_completion(self, req: Request, reserved: int) -> bool:
        """Whether `req` may be admitted beside `reserved` blocks (`reserved_blocks`): under
        `engine.guaranteed_no_evict` only when the blocks it will hold at its last token fit
        in the pool beside them, so that no running request ever runs short (TensorRT-LLM's
        GUARANTEED_NO_EVICT); always without it."""
        return not self.no_evict or reserved + self.completion_blocks(req) <= self.kv.num_blocks

    def pick_victim(self) -> Request:
        """The running request to preempt when blocks run short: the most recently admitted."""
        return self.running[-1]

    def watermark_blocks(self) -> int:
        """Blocks a waiting request must leave free when admitted while others run: the
        fraction `scheduler.watermark` of the pool (vLLM V1's pool counts its null block,
        block 0, too)."""
        return int(self.cfg.watermark * (self.kv.num_blocks + (1 if self.models_v1 else 0)))

    def schedule_admitted(self, out: SchedulerOutput, req: Request, n: int) -> None:
        """`req`, given its blocks, leaves the queue for the batch and computes `n` tokens."""
        self.take_waiting(req)
        self.running.append(req)
        out.scheduled.append((req, n))
        if self.kv.register_at_allocation:
            self.kv.cache_scheduled(req, n)

    def preempt_one(self, out: SchedulerOutput, victim: Request | None = None) -> tuple[Request, int]:
        """Preempt `victim` (default: `pick_victim()`) and requeue it. If it was already
        scheduled in this step, unschedule it. Returns the victim and the tokens given back.
        (A victim that has finished, its last step's output not yet processed under async
        scheduling, gives its blocks back and is not requeued, as in vLLM.)"""
        victim = victim or self.pick_victim()
        given_back = 0
        for k, (r, m) in enumerate(out.scheduled):
            if r is victim:
                del out.scheduled[k]
                given_back = m
                break
        self.running.remove(victim)
        self.engine.preempt(victim)
        if not victim.state.is_done:
            self.requeue(victim)
        out.preempted.append(victim)
        return victim, given_back

    def requeue(self, req: Request) -> None:
        """A preempted request goes back to the front of the queue."""
        self.waiting.appendleft(req)

    def schedule_running(self, out: SchedulerOutput, budget: Any) -> Any:
        """Advance the running batch in order within `budget` tokens: one decode token each, or
        the next prefill chunk of a request still prefilling. While blocks run short, preempt a
        victim (possibly the request itself, which ends the pass unless
        `continue_after_self_preemption`). Sets `out.decode_only` when every running request
        decodes exactly one token. Returns the budget left.
        """
        return batch.schedule_running(self, out, budget)  # (compiled where it could be)

    def schedule(self) -> SchedulerOutput:  # pragma: no cover - abstract
        raise NotImplementedError
