"""The pass over the running batch that every policy's `schedule()` starts with, and the
policy fields it reads. Compiled with the engine's hot path (sim/native/compiled.py): it runs at every
scheduling decision. The rules it applies that a policy may change are the policy's methods,
called here: `pick_victim` (who is preempted when blocks run short) and `preempt_one`.
"""

from __future__ import annotations

import math
from typing import Any, Final

from mypy_extensions import mypyc_attr

from sim.engine.kv import KVCacheManager
from sim.engine.request import Request, RequestState

INF = math.inf
RUNNING: Final = RequestState.RUNNING
FINISHED: Final = RequestState.FINISHED
UNBOUNDED: Final = 1 << 62  # a token budget that no step reaches


@mypyc_attr(allow_interpreted_subclasses=True)
class PolicyState:
    """A policy's fields that the pass over the batch and the engine's hot path read, declared
    with their types: `Policy` subclasses this, and compiled code reads them as native fields."""

    engine: Any
    kv: KVCacheManager
    cfg: Any
    waiting: Any  # (a deque, or a policy's own queue)
    running: list[Request]
    async_scheduling: bool
    continue_after_self_preemption: bool
    chunk_tokens: int


class SchedulerOutput:
    """One step's plan: (request, tokens to compute) in batch order, and who was preempted.
    `decode_only` is True when every running request decodes one token and nothing else
    happens: the engine may then run identical steps back to back until the next event."""

    __slots__ = ("scheduled", "preempted", "decode_only")

    def __init__(self) -> None:
        self.scheduled: list[tuple[Request, int]] = []
        self.preempted: list[Request] = []
        self.decode_only = False


def schedule_running(p: Any, out: Any, tokens: Any) -> Any:
    """`Policy.schedule_running` of policy `p`: the running batch advanced in order within
    `tokens` (an int, or inf: no budget), one decode token each or the next prefill chunk,
    preempting `p.pick_victim()` (through `p.preempt_one`) while blocks run short. Returns the
    budget left."""
    ps: PolicyState = p
    # (an int budget, so that the arithmetic below is machine arithmetic; no budget is one
    # that nothing reaches)
    unbounded = not isinstance(tokens, int)
    budget: int = UNBOUNDED if unbounded and tokens == INF else int(tokens)
    kv: KVCacheManager = ps.kv
    bs = kv.block_size
    running: list[Request] = ps.running
    sched: list[tuple[Request, Any]] = out.scheduled
    register = kv.register_at_allocation
    # Async scheduling: a request that sampled in the last step has a token the scheduler
    # has not seen yet, and one that finished then is skipped (it holds its seat).
    lagging: bool = ps.async_scheduling
    engine = ps.engine
    g: int = engine.step_count if register and lagging else 0
    # (`Engine.has_finishing`, read through the proxy: the method call costs 4x)
    skip_finished: bool = lagging and len(engine._releasing) > 0
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
        n = total - c
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
                if ps.continue_after_self_preemption:
                    continue
                break
        sched.append((req, n))
        if register:
            unseen = (1 if lagging and req.run_open and req.run_start + req.run_len == g
                      else 0)
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
                       and not (finishing and ps.waiting))
    return INF if unbounded and tokens == INF else budget
