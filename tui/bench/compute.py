"""`servesim bench compute`: engine steps per wall second on a scenario with real attention,
and the headroom that leaves at x1."""

from __future__ import annotations

import json
import math
import time

from sim import Engine, load_scenario
from tui.bench.common import machine
from tui.compute import make_executor


def run(args) -> dict:
    sc = load_scenario(args.scenario, [f"compute.backend={json.dumps(args.backend)}"])
    executor = make_executor(sc)
    engine = Engine(sc, executor=executor, record_events=False)
    engine.run_until(math.inf, args.warmup)
    sim_start = engine.now
    t0, c0 = time.perf_counter(), time.process_time()
    steps = engine.run_until(math.inf, args.steps)
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    # x1 needs as many steps per wall second as the run took per simulated second.
    needed = steps / max(engine.now - sim_start, 1e-9)
    return {"scenario": sc.name, "machine": machine(), "executor": executor.describe(),
            "steps": steps, "wall_s": wall, "steps_per_s": steps / wall,
            "cpu_s": cpu, "steps_per_cpu_s": steps / cpu if cpu else 0.0,
            "steps_per_simulated_s": needed, "headroom_at_x1": steps / wall / needed,
            "running_at_end": len(engine.policy.running), "simulated_s": engine.now}


def text(r: dict) -> str:
    return "\n".join([
        f"bench compute: {r['scenario']} on {r['machine']}",
        f"  {r['executor']}",
        f"  {r['steps']} steps in {r['wall_s']:.2f} s: {r['steps_per_s']:.1f} engine steps per "
        f"wall second ({r['running_at_end']} requests running, {r['simulated_s']:.1f} s simulated)",
        f"  {r['steps_per_cpu_s']:.1f} steps per CPU second of this process; x1 needs "
        f"{r['steps_per_simulated_s']:.1f} steps per second here: headroom {r['headroom_at_x1']:.2f}x",
    ])
