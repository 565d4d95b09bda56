"""`servesim bench sim`: the full Azure conversation trace under `chunked`, Llama-3.1-8B on one
H100: wall time, engine steps and output tokens per wall second."""

from __future__ import annotations

import json
import time

from sim import Engine, load_scenario, summarize
from sim.inputs.workload import build_workload
from tui.bench.common import machine


def run(args) -> dict:
    sc = load_scenario(args.scenario, [f"scheduler.policy={json.dumps(args.policy)}"])
    best = None
    for _ in range(max(1, args.repeat)):
        t0 = time.perf_counter()
        workload = build_workload(sc)
        engine = Engine(sc, workload=workload, record_events=False)
        engine.run()
        wall = time.perf_counter() - t0
        if best is None or wall < best[0]:
            best = (wall, engine)
    wall, engine = best
    t0 = time.perf_counter()
    s = summarize(engine)
    summary_s = time.perf_counter() - t0
    return {
        "scenario": sc.name, "policy": engine.policy.name, "machine": machine(),
        "requests": s["requests"]["total"], "output_tokens": s["output_tokens"],
        "wall_s": wall, "summary_s": summary_s, "simulated_s": s["duration_s"],
        "steps": engine.step_count, "steps_per_s": engine.step_count / wall,
        "output_tokens_per_wall_s": s["output_tokens"] / wall,
        "runs": max(1, args.repeat),
    }


def text(r: dict) -> str:
    return "\n".join([
        f"bench sim: {r['scenario']} under {r['policy']} on {r['machine']}",
        f"  requests             {r['requests']:,}",
        f"  output tokens        {r['output_tokens']:,}",
        f"  wall (best of {r['runs']})     {r['wall_s']:.2f} s  "
        f"(+ {r['summary_s']:.2f} s for the summary)",
        f"  simulated            {r['simulated_s']:,.1f} s",
        f"  engine steps         {r['steps']:,}  ({r['steps_per_s']:,.0f} per wall s)",
        f"  output tokens/wall s {r['output_tokens_per_wall_s']:,.0f}",
    ])
