"""`servesim bench hotpath`: a profiled run (cProfile): where the time goes per scheduling
decision, by function."""

from __future__ import annotations

import cProfile
import json
import os
import pstats
import time

from sim.native import compiled
from sim import build, load_scenario
from tui.bench.common import machine, run_in_child


def run(args) -> dict:
    """A cProfile of one run: per function, its share of the run and its time and calls per
    scheduling decision (`sim.engine.stepping.advance`). Compiled functions are invisible to
    cProfile, so where this process runs the compiled hot path the profile is of the
    pure-Python modules, in a child process."""
    if compiled.COMPILED:
        return run_in_child("tui.bench.hotpath", "profile_hotpath", args.scenario, args.policy,
                            args.top, env={"SERVESIM_PURE": "1"})
    return profile_hotpath(args.scenario, args.policy, args.top)


def profile_hotpath(scenario: str, policy: str, top: int) -> dict:
    sc = load_scenario(scenario, [f"scheduler.policy={json.dumps(policy)}"])
    engine = build(sc, record_events=False, keep_history=False)
    prof = cProfile.Profile()
    t0 = time.perf_counter()
    prof.enable()
    engine.run()
    prof.disable()
    wall = time.perf_counter() - t0
    st = pstats.Stats(prof)
    # (every decision is a call of sim.engine.stepping.advance, from the run loop or Engine._advance)
    decisions = sum(v[1] for k, v in st.stats.items()
                    if k[2] == "advance" and os.path.basename(k[0]) == "stepping.py")
    total = sum(v[2] for v in st.stats.values())
    rows = []
    for (path, line, name), (_, ncalls, tottime, cumtime, _) in st.stats.items():
        rows.append({"function": f"{os.path.basename(path)}:{line}({name})",
                     "share": tottime / total, "us_per_decision": tottime / decisions * 1e6,
                     "cum_us_per_decision": cumtime / decisions * 1e6,
                     "calls_per_decision": ncalls / decisions})
    rows.sort(key=lambda x: -x["share"])
    return {"machine": machine(), "scenario": sc.name, "policy": policy,
            "modules": "pure Python",
            "wall_s_profiled": wall, "decisions": decisions, "steps": engine.step_count,
            "calls_per_decision": sum(v[1] for v in st.stats.values()) / decisions,
            "us_per_decision": total / decisions * 1e6, "functions": rows[:top]}


def text(r: dict) -> str:
    lines = [f"bench hotpath: {r['scenario']} under {r['policy']}, profiled ({r['modules']} "
             f"modules), on {r['machine']}",
             f"  {r['decisions']:,} decisions, {r['steps']:,} steps, "
             f"{r['wall_s_profiled']:.2f} s under the profiler: "
             f"{r['us_per_decision']:.1f} us and {r['calls_per_decision']:.0f} calls "
             "per decision",
             f"  {'share':>6} {'us/dec':>7} {'cum us':>7} {'calls/dec':>9}  function"]
    for f in r["functions"]:
        lines.append(f"  {100 * f['share']:>5.1f}% {f['us_per_decision']:>7.2f} "
                     f"{f['cum_us_per_decision']:>7.1f} {f['calls_per_decision']:>9.2f}  "
                     f"{f['function']}")
    return "\n".join(lines)
