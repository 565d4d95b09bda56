"""`servesim bench ...`: benchmarks that print measured figures (never timed assertions).

- `bench sim`: the full Azure conversation trace under `chunked`, Llama-3.1-8B on one H100.
- `bench tui`: the dashboard driven headless; frames drawn, frame times, engine steps per second.
- `bench kernel`: NumPy paged decode attention against a dense contiguous computation.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time


def add_arguments(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="bench", required=True, parser_class=type(p))
    s = sub.add_parser("sim", help="simulate the full Azure conversation trace")
    s.add_argument("--scenario", default="azure-conv")
    s.add_argument("--policy", default="chunked")
    s.add_argument("--repeat", type=int, default=3, help="runs; the best is reported")
    s.add_argument("--json", action="store_true")
    s = sub.add_parser("tui", help="the dashboard, headless, on the default scenario")
    s.add_argument("--sim-seconds", type=float, default=60.0,
                   help="simulated seconds to run (default 60)")
    s.add_argument("--json", action="store_true")
    s = sub.add_parser("kernel", help="NumPy paged decode attention vs dense")
    s.add_argument("--json", action="store_true")
    s.add_argument("--repeat", type=int, default=5)


def _machine() -> str:
    return f"{platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}"


def bench_sim(args) -> dict:
    from sim import Engine, load_scenario, summarize
    from sim.workload import build_workload

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
        "scenario": sc.name, "policy": engine.policy.name, "machine": _machine(),
        "requests": s["requests"]["total"], "output_tokens": s["output_tokens"],
        "wall_s": wall, "summary_s": summary_s, "simulated_s": s["duration_s"],
        "steps": engine.step_count, "steps_per_s": engine.step_count / wall,
        "output_tokens_per_wall_s": s["output_tokens"] / wall,
        "runs": max(1, args.repeat),
    }


def main(args) -> int:
    if args.bench == "sim":
        r = bench_sim(args)
        if args.json:
            print(json.dumps(r, indent=2))
        else:
            print(f"bench sim: {r['scenario']} under {r['policy']} on {r['machine']}")
            print(f"  requests             {r['requests']:,}")
            print(f"  output tokens        {r['output_tokens']:,}")
            print(f"  wall (best of {r['runs']})     {r['wall_s']:.2f} s  "
                  f"(+ {r['summary_s']:.2f} s for the summary)")
            print(f"  simulated            {r['simulated_s']:,.1f} s")
            print(f"  engine steps         {r['steps']:,}  ({r['steps_per_s']:,.0f} per wall s)")
            print(f"  output tokens/wall s {r['output_tokens_per_wall_s']:,.0f}")
        return 0
    if args.bench == "tui":
        from tui.bench_tui import bench_tui

        r = bench_tui(args)
        if args.json:
            print(json.dumps(r, indent=2))
        else:
            print(f"bench tui: {_machine()}")
            for k, v in r.items():
                print(f"  {k:<22} {v:,.2f}" if isinstance(v, float) else f"  {k:<22} {v}")
        return 0
    if args.bench == "kernel":
        from gpu.bench import kernel_bench

        rows = kernel_bench(repeat=args.repeat)
        if args.json:
            print(json.dumps(rows, indent=2))
        else:
            print(f"bench kernel: NumPy paged decode attention vs dense, {_machine()}")
            print(f"{'batch':>6} {'context':>8} {'paged GB/s':>11} {'dense GB/s':>11} {'ratio':>6}")
            for r in rows:
                print(f"{r['batch']:>6} {r['context']:>8} {r['paged_gbps']:>11.2f} "
                      f"{r['dense_gbps']:>11.2f} {r['ratio_to_dense']:>6.2f}")
        return 0
    return 2
