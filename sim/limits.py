"""The bounds that keep a simulation computable, and the memory check made before a run.

A value can be legal for its field and still be one the simulator cannot carry out: a clock so
far out that a step no longer moves it, a length past int64, a pool whose bookkeeping alone
needs more memory than the machine has. These are found before anything is allocated and named
as one line (ScenarioError, exit code 2), never as a MemoryError, an overflow or the OOM killer.
"""

from __future__ import annotations

import math
import os
import resource

from sim.errors import ScenarioError

INT64_MAX = 2**63 - 1
# Simulated time: at 1e9 s (31 years) a float64 clock still resolves 0.2 us, so steps of a
# microsecond or more keep moving it. Arrivals, durations and delays stay below this.
MAX_TIME_S = 1e9
# Tokens in one request's prompt or output: far beyond any model's context, far below int64
# (sums of lengths and positions never overflow).
MAX_TOKENS = 10**9
# Requests one injection may add (the dashboard's dialog allows 10,000).
MAX_INJECT_COUNT = 100_000
# Priorities (lower is more urgent): int64 in a workload and a session log, kept well inside.
PRIORITY_RANGE = (-(2**31), 2**31 - 1)
# What a one-token decode step may take under the service-time model: shorter is below what
# the clock resolves, longer is a model or hardware no engine could serve with.
MIN_STEP_S, MAX_STEP_S = 1e-9, 3600.0
# A GPU-hour's price in US dollars (`servesim plan`): a cost per million tokens divides by it, so
# a price too small to divide by (1e-320) is refused with the absurdly large.
USD_PER_GPU_HOUR_RANGE = (1e-6, 1e6)
USD_PER_GPU_HOUR_TEXT = "from {:g} to {:g}".format(*USD_PER_GPU_HOUR_RANGE)  # (in messages)


def usd_per_gpu_hour_ok(v) -> bool:
    """Whether `v` is a price of one GPU-hour servesim takes: a number (not a bool) within
    USD_PER_GPU_HOUR_RANGE (NaN is not)."""
    lo, hi = USD_PER_GPU_HOUR_RANGE
    return not isinstance(v, bool) and isinstance(v, (int, float)) and lo <= v <= hi


# Energy sums stay finite: the deployment's power over MAX_TIME_S must stay far from 1e308 J.
MAX_ENERGY_J = 1e300

# Host memory per unit, measured with tracemalloc (Python 3.11, 64-bit), with margin: a KV
# block's bookkeeping (reference count, hash, free queue entry and position, snapshot arrays),
# and a request's (workload columns, the engine's lists, the Request object, its events).
BYTES_PER_BLOCK = 160
BYTES_PER_REQUEST = 1600
# An engine step's records (a timeline row, its end time in the events), with the slack of
# growing arrays: a request of n output tokens takes at least n steps.
BYTES_PER_STEP = 220


# What no machine that runs servesim lacks: the guard is against absurd values, not these.
SMALL_BYTES = 16 << 20


def available_memory() -> float | None:
    """Bytes this process may still allocate: the least of MemAvailable, the cgroup's limit
    less its usage, and the address-space limit. None when none is known."""
    found = []
    try:
        with open("/proc/meminfo") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    found.append(int(line.split()[1]) * 1024)
    except (OSError, ValueError, IndexError):
        pass
    try:
        with open("/sys/fs/cgroup/memory.max") as fh:
            limit = fh.read().strip()
        if limit != "max":
            with open("/sys/fs/cgroup/memory.current") as fh:
                found.append(int(limit) - int(fh.read().strip()))
    except (OSError, ValueError):
        pass
    soft, _ = resource.getrlimit(resource.RLIMIT_AS)
    if soft != resource.RLIM_INFINITY:
        found.append(soft)
    if not found:
        try:
            found.append(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))
        except (OSError, ValueError):
            return None
    return float(max(0, min(found)))


def _gb(n: float) -> str:
    if n >= 1e15:
        return f"{n / 1e9:.3g} GB"
    return f"{n / 1e9:,.1f} GB" if n >= 1e8 else f"{n / 1e6:,.0f} MB"


def check_memory(what: str, needed: float, detail: str = "") -> None:
    """Raise ScenarioError naming `what` when `needed` bytes exceed the memory available
    (or cannot be counted at all). Sizes under SMALL_BYTES pass without reading what the
    machine has (/proc and cgroup files: a server checks every request it is sent)."""
    if needed < SMALL_BYTES:
        return
    avail = available_memory()
    if needed > (avail if avail is not None else 1 << 62) or needed != needed:
        shown = _gb(avail) if avail is not None else "memory"
        raise ScenarioError(f"{what}: needs about {_gb(needed)} of memory{detail}, more than "
                            f"the {shown} available")


def check_deployment(sc, cost, num_blocks: int) -> None:
    """The checks of a scenario's model, hardware and pool that no single field shows: a step
    the clock can carry, and block pools (device and host) whose bookkeeping fits in memory.
    `cost` is the scenario's CostModel. Raises ScenarioError naming the fields."""
    src, h = sc.source, sc.hardware
    dur, _ = cost.step(0, 0, 0, 1, 1, 1, 1)  # one sequence decoding one token
    if not MIN_STEP_S <= dur <= MAX_STEP_S:
        raise ScenarioError(
            f"{src}: [hardware]: a one-token decode step would take {dur:.3g} s under "
            f"model.preset = {sc.model.preset!r} on hardware.preset = {h.preset!r} with these "
            f"sizes, outside {MIN_STEP_S:g} to {MAX_STEP_S:g} s; check "
            "hardware.mem_bandwidth_gbps, peak_tflops, step_overhead_ms, model.num_params and "
            "the [engine] coefficients")
    if sc.scheduler.policy == "disaggregated":  # one block's K/V over the hand-off link
        t = cost.kv_bytes_per_block_gpu() / (sc.scheduler.kv_link_gbps * 1e9)
        if not t <= MAX_STEP_S:
            raise ScenarioError(f"{src}: scheduler.kv_link_gbps = {sc.scheduler.kv_link_gbps:g}: "
                                f"one block's K/V would take {t:.3g} s to hand off")
    cl = sc.cluster
    instances = (cl.prefill_instances + cl.decode_instances
                 if sc.scheduler.policy == "disaggregated" else max(1, cl.replicas))
    watts = max(h.tdp_w, h.idle_w) * sc.model.tensor_parallel * instances
    if not watts * 2 * MAX_TIME_S < MAX_ENERGY_J:
        raise ScenarioError(f"{src}: hardware.tdp_w = {h.tdp_w:g}, idle_w = {h.idle_w:g}: "
                            "energies this large overflow")
    check_memory(f"{src}: kv.num_blocks = {num_blocks}", num_blocks * BYTES_PER_BLOCK,
                 " for the block pool's bookkeeping")
    if sc.scheduler.preemption == "swap":
        host = sc.kv.swap_space_gb * 1e9 / cost.kv_bytes_per_block_gpu()
        check_memory(f"{src}: kv.swap_space_gb = {sc.kv.swap_space_gb:g}",
                     host * BYTES_PER_BLOCK, f" for a host pool of {host:.3g} blocks")
