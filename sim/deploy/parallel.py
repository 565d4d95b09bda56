"""Parallelism as serving engines run it: data-parallel ranks in lockstep, and pipeline stages
with micro-batches in flight. Both are deployments of several engines (`Cluster` subclasses),
so routing, cancellation, snapshots (a line and a block map per rank or virtual engine), the
summary and session logs work as for replicas; only how the instances' clocks move differs.

Data parallelism (`model.data_parallel`; vLLM's DP, SGLang's DP attention). Each rank is an
Engine on `tensor_parallel` GPUs with its own scheduler, queue, batch and KV pool (sized from
its GPUs' memory, as any instance's). A router sends each arrival to one rank (vLLM's load
balancing by default: `routers.QueueLength`). The ranks step in lockstep, as vLLM's do for MoE
models (the expert layers synchronise every forward pass): every step starts on every rank at
once and lasts as long as the slowest rank's step; a rank with nothing scheduled runs a dummy
step (a one-token forward pass, in the step's maximum too) and its clock moves with the others.

How a lockstep step is run without a second copy of the step: each rank's service-time model
(`_RankTime`) times the rank's own batch with the CostModel, then, before returning, has every
later rank schedule and run its step (which times itself the same way, nested); the innermost
sees every rank's time and sets the step's duration, the maximum, which every rank's step then
returns. So each rank's step runs the engine's own code, and its batch is decided from its own
state at the step's start, as a real rank's is.

Pipeline parallelism (`model.pipeline_parallel` stages, `model.virtual_engines` micro-batches,
default one per stage: vLLM's virtual engines). Each virtual engine is an Engine with its own
scheduler and a 1/V share of the block pool (vLLM V0 divides `num_gpu_blocks` by the pipeline
size per virtual engine's scheduler); the pool is sized from one stage's GPUs, which hold
num_layers / PP layers and their KV (`sim.inputs.scenario.pipeline_stage`). A virtual engine's
step passes through the stages in order: on each stage it takes the CostModel's time for its
batch over the whole model divided by PP (every stage an equal share of the layers), starting
when its previous stage has finished and the activations (tokens x hidden x activation bytes)
have crossed the link, and when that stage has finished the micro-batch before it (first come,
first served, `_Stages`). One micro-batch alone therefore takes the whole model's time plus
PP - 1 sends per step (no faster than PP = 1: the bubble), and V micro-batches in flight keep
every stage busy, up to PP times the throughput.
"""

from __future__ import annotations

import dataclasses
import weakref

from sim.deploy.cluster import INF, Cluster
from sim.engine.engine import Engine
from sim.errors import ScenarioError
from sim.model.costmodel import CostModel


class _TimedBy:
    """A ServiceTime that is the CostModel `model` in all but `step` (subclasses)."""

    def __init__(self, model: CostModel) -> None:
        self.model = model

    def __getattr__(self, name: str):
        return getattr(self.model, name)


# ================================================================================ data parallel
class _RankTime(_TimedBy):
    """One data-parallel rank's service time: its own step's, stretched to the lockstep
    step's (the slowest rank's); the wait costs idle power."""

    def __init__(self, model: CostModel, group) -> None:
        super().__init__(model)
        self.group = group

    def step(self, *args):
        dur, energy = self.model.step(*args)
        lock = self.group.lockstep(dur)
        return lock, energy + self.model.idle_energy(lock - dur)


class DataParallel(Cluster):
    """`model.data_parallel` ranks stepping in lockstep (see the module docstring)."""

    mode = "data-parallel"

    def __init__(self, scenario, **kw) -> None:
        self._pending: list[int] = []  # ranks still to schedule in the step being run
        self._times: list[float] = []  # the step times of the ranks that scheduled a batch
        self._lock: float | None = None  # the step's duration, once every rank has scheduled
        self.lockstep_steps = 0
        self.dummy_steps = 0  # rank-steps run with an empty batch while another rank worked
        super().__init__(scenario, **kw)
        # vLLM's dummy batch: one token, no context, nothing sampled
        self._dummy = self.instances[0].cost.model.step(0.0, 0.0, 0.0, 1.0, 0.0, 1.0, 0.0)[0]

    def _size(self, scenario) -> int:
        return scenario.model.data_parallel

    def _router_name(self, scenario) -> str:
        return scenario.cluster.dp_router

    def _instance(self, i: int, scenario, kw: dict) -> Engine:
        # (one step at a time: every step is a lockstep step)
        cost = _RankTime(CostModel(scenario), weakref.proxy(self))
        return Engine(scenario, cost=cost, **{**kw, "skip_ahead": False})

    @property
    def policy_label(self) -> str:
        return f"{self.policy.name} dp{len(self.instances)} ({self.router.name})"

    def deployment_figures(self) -> dict:
        return {"lockstep_steps": self.lockstep_steps, "dummy_steps": self.dummy_steps}

    def lockstep(self, dur: float) -> float:
        """A rank's step took `dur` on its own: let every later rank schedule and run its step,
        then return the lockstep step's duration."""
        self._times.append(dur)
        self._run_pending()
        assert self._lock is not None
        return self._lock

    def _run_pending(self) -> None:
        while self._pending:
            # A rank that schedules a batch calls `lockstep` from its step, which runs the
            # rest of the list before the step ends; one that schedules nothing returns here.
            self.instances[self._pending.pop(0)].decide(INF, 1)
        if self._lock is None:  # (the innermost call: every rank has scheduled)
            dummies = len(self.instances) > len(self._times)
            self._lock = max(self._times + ([self._dummy] if dummies else []), default=0.0)

    def _decide(self, until: float, max_steps: int, caps: list | None = None,
                settled: list | None = None) -> int | None:
        """One lockstep step of every rank (0 for an idle advance), or None when there is
        nothing to do before `until` (or a replay's `caps` is reached; the ranks settle
        together, after it, so `settled` is not needed here)."""
        self._global()
        self._routed = False
        engines = self.instances
        if caps is not None and any(e.step_count > s or (e.step_count == s and e.now >= t)
                                    for e, (s, t) in zip(engines, caps)):
            return None
        now = max(e.now for e in engines)
        if now >= until:
            return None
        for e in engines:  # (a rank an arrival found idle jumped to it)
            e.idle_until(now)
        for i in range(len(engines)):
            self._prologue(i)
        busy = [i for i, e in enumerate(engines) if e.policy.has_work()]
        if not busy:
            nxt = min([until, self._next_arrival(), *(e.next_event() for e in engines),
                       *(t for _, t in caps or ())])
            if now < nxt < INF:
                for e in engines:
                    e.idle_until(nxt)
                return 0
            return None
        before = self.step_count
        self._pending, self._times, self._lock = busy, [], None
        try:
            self._run_pending()
        finally:
            self._pending, self._lock = [], None
        end = max(e.now for e in engines)
        for e in engines:  # ranks that ran a dummy step (and any a swap made wait)
            e.idle_until(end)
        n = self.step_count - before
        if n:
            self.lockstep_steps += 1
            self.dummy_steps += len(engines) - n
        return n


# ============================================================================ pipeline parallel
class _Stages:
    """When each pipeline stage is next free, and how busy the stages have been."""

    def __init__(self, stages: int, send_bytes_per_token: float, link_bytes_per_s: float):
        self.free = [0.0] * stages
        self.send_s_per_token = send_bytes_per_token / link_bytes_per_s
        self.busy = 0.0  # stage-seconds of work
        self.sends = 0

    def pass_through(self, start: float, dur: float, tokens: float) -> float:
        """A micro-batch of `tokens` tokens, ready at `start`, whose whole-model time is `dur`,
        through every stage in order, each after the one before it (first come, first
        served). Returns when it leaves the last stage."""
        share = dur / len(self.free)
        t = start
        for s in range(len(self.free)):
            if s:
                t += tokens * self.send_s_per_token  # the activations to the next stage
                self.sends += 1
            t = max(t, self.free[s]) + share
            self.free[s] = t
        self.busy += dur
        return t


class _StageTime(_TimedBy):
    """One virtual engine's service time: its batch's pass through the stages."""

    def __init__(self, model: CostModel, stages: _Stages) -> None:
        super().__init__(model)
        self.stages = stages
        self.engine = None  # (set once the engine exists: the step starts at its clock)

    def step(self, p_tokens, p_attended, p_cached, d_seqs, d_cached, num_seqs, sampled,
             *beyond):
        dur, energy = self.model.step(p_tokens, p_attended, p_cached, d_seqs, d_cached,
                                      num_seqs, sampled, *beyond)
        start = self.engine.now
        end = self.stages.pass_through(start, dur, p_tokens + d_seqs)
        # (the energy of its work, once: the stages' GPUs are shared by the virtual engines)
        return end - start, energy


class PipelineParallel(Cluster):
    """`model.pipeline_parallel` stages with `model.virtual_engines` micro-batches in flight,
    each virtual engine an instance (see the module docstring)."""

    mode = "pipeline"

    def __init__(self, scenario, **kw) -> None:
        m = scenario.model
        link = (m.pipeline_send_gbps or scenario.hardware.interconnect_gbps) * 1e9
        self.stages = _Stages(m.pipeline_parallel, m.hidden_size * m.act_dtype_bytes, link)
        super().__init__(scenario, **kw)

    def _size(self, scenario) -> int:
        return scenario.model.virtual_engines or scenario.model.pipeline_parallel

    def _router_name(self, scenario) -> str:
        # vLLM V0 adds a request to the virtual engine with the fewest unfinished ones
        # (`LLMEngine._add_processed_request`)
        return "least-outstanding"

    def _instance(self, i: int, scenario, kw: dict) -> Engine:
        v = self._size(scenario)
        kv = scenario.kv
        if kv.num_blocks // v < 1:
            raise ScenarioError(
                f"{scenario.source}: model.virtual_engines = {v}: more than the "
                f"{kv.num_blocks} blocks of kv.num_blocks (each takes a share of the pool)")
        share = dataclasses.replace(kv, num_blocks=kv.num_blocks // v,
                                    swap_space_gb=kv.swap_space_gb / v)
        own = dataclasses.replace(scenario, kv=share)
        cost = _StageTime(CostModel(own), self.stages)
        # (one step at a time: each step takes its turn on the stages)
        e = Engine(own, cost=cost, **{**kw, "skip_ahead": False})
        cost.engine = weakref.proxy(e)
        return e

    @property
    def gpus(self) -> int:
        return self.scenario.model.pipeline_parallel * self.scenario.model.tensor_parallel

    @property
    def policy_label(self) -> str:
        return (f"{self.policy.name} pp{self.scenario.model.pipeline_parallel} "
                f"x{len(self.instances)} micro-batches")

    def deployment_figures(self) -> dict:
        """The stages' busy share of the run (1 - the bubble) and the activation sends."""
        span = self.now * len(self.stages.free)
        return {"stages": len(self.stages.free), "virtual_engines": len(self.instances),
                "stage_utilization": self.stages.busy / span if span > 0 else 0.0,
                "sends": self.stages.sends}
