"""`servesim bench ...`: benchmarks that print measured figures (never timed assertions).

- `bench sim`: the full Azure conversation trace under `chunked`, Llama-3.1-8B on one H100.
- `bench log`: session-log size per output token and the time to write and to replay-verify it.
- `bench tui`: the dashboard driven headless; frames drawn, frame times, engine steps per second.
- `bench kernel`: NumPy paged decode attention against a dense contiguous computation.
- `bench compute`: engine steps per wall second on the default scenario with real attention.
- `bench sweep`: a 16-point sweep of `chat` with 1 and with 2 local workers, and the speed-up.
- `bench serve`: `servesim serve` under many concurrent streams (see `serve.bench`).
- `bench scale`: runs of N requests (wall, max RSS, memory after the run), the Azure trace's
  wall time and the memory per request in flight, side by side (tui/bench_scale.py).
- `bench hotpath`: a profiled run: time and calls per scheduling decision, by function.
- `bench queue`: whole runs with 10k and 50k requests queued at once, per queue policy.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import time


def _count(text: str) -> int:
    """A positive whole number (argparse turns the error into one line)."""
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected a whole number") from None
    if v < 1:
        raise argparse.ArgumentTypeError(f"{v}: must be at least 1")
    return v


def _positive(what: str):
    """A parser of a positive, finite number (argparse turns the error into one line)."""
    def parse(text: str) -> float:
        try:
            v = float(text)
        except ValueError:
            v = math.nan
        if not 0 < v < math.inf:
            raise argparse.ArgumentTypeError(f"{text!r}: expected a positive {what}")
        return v
    return parse


_seconds = _positive("number of seconds")
_speed = _positive("speed")  # simulated seconds per wall second


def _list(kind):
    """A comma-separated list of `kind` (a type function) or of policy names."""
    def parse(text: str) -> list:
        items = [x.strip() for x in text.split(",") if x.strip()]
        if not items:
            raise argparse.ArgumentTypeError(f"{text!r}: expected a comma-separated list")
        if kind == "policy":
            from sim.policies import POLICIES

            bad = [x for x in items if x not in POLICIES]
            if bad:
                raise argparse.ArgumentTypeError(
                    f"{bad[0]!r}: not a policy (known: {', '.join(POLICIES)})")
            return items
        return [kind(x) for x in items]
    return parse


def add_arguments(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="bench", required=True, parser_class=type(p))
    s = sub.add_parser("sim", help="simulate the full Azure conversation trace")
    s.add_argument("--scenario", default="azure-conv")
    s.add_argument("--policy", default="chunked")
    s.add_argument("--repeat", type=_count, default=3, help="runs; the best is reported")
    s.add_argument("--json", action="store_true")
    s = sub.add_parser("log", help="session log size and write / replay-verify speed")
    s.add_argument("--scenario", default="azure-conv")
    s.add_argument("--repeat", type=_count, default=3, help="rounds; the best time of each phase")
    s.add_argument("--json", action="store_true")
    s = sub.add_parser("tui", help="the dashboard, headless, on the default scenario")
    s.add_argument("--sim-seconds", type=_seconds, default=60.0,
                   help="simulated seconds to run (default 60)")
    s.add_argument("--json", action="store_true")
    s = sub.add_parser("live-memory", help="the dashboard's memory against simulated time, "
                                           "with real compute and without")
    s.add_argument("--scenario", default="chat")
    s.add_argument("--speed", type=_speed, default=4.0, help="dashboard speed (default x4)")
    s.add_argument("--sim-seconds", type=_seconds, default=300.0,
                   help="simulated seconds to run (default 300)")
    s.add_argument("--json", action="store_true")
    s = sub.add_parser("compute", help="engine steps per second with real attention")
    s.add_argument("--scenario", default="chat")
    s.add_argument("--backend", default="numpy", choices=["numpy", "cupy", "auto"])
    s.add_argument("--warmup", type=_count, default=600, help="steps before measuring")
    s.add_argument("--steps", type=_count, default=600, help="steps measured")
    s.add_argument("--json", action="store_true")
    s = sub.add_parser("kernel", help="NumPy paged decode attention vs dense")
    s.add_argument("--json", action="store_true")
    s.add_argument("--repeat", type=_count, default=5)
    s.add_argument("--static", action="store_true",
                   help="CUDA kernels without a GPU: registers, spills, occupancy, main-loop SASS "
                        "instructions per 16 B (needs nvcc and cuobjdump)")
    s.add_argument("--before", default="main", help="git ref of the kernels to compare with (--static)")
    s.add_argument("--block-sizes", default="16", help="block sizes to instantiate (--static)")
    s = sub.add_parser("sweep", help="a 16-point sweep with 1 and with 2 local workers")
    s.add_argument("--duration", type=_seconds, default=300.0,
                   help="simulated seconds of arrivals per point (default 300)")
    s.add_argument("--json", action="store_true")
    from tui.serve import bench as serve_bench

    serve_bench.add_arguments(sub)
    s = sub.add_parser("scale", help="wall time and memory against the number of requests")
    s.add_argument("--scenario", default="chat")
    s.add_argument("--requests", type=_list(_count), default=[10000, 100000, 1000000], metavar="N1,N2,...",
                   help="workload.num_requests of each run (default 10000,100000,1000000)")
    s.add_argument("--with-history", type=_count, default=0, metavar="N",
                   help="also run those up to N requests keeping every request (the old way)")
    s.add_argument("--repeat", type=_count, default=3, help="Azure trace runs; the best counts")
    s.add_argument("--json", action="store_true")
    s = sub.add_parser("hotpath", help="where the time goes per scheduling decision")
    s.add_argument("--scenario", default="azure-conv")
    s.add_argument("--policy", default="chunked")
    s.add_argument("--top", type=_count, default=25, help="functions listed (default 25)")
    s.add_argument("--json", action="store_true")
    s = sub.add_parser("queue", help="runs with 10k and 50k requests queued at once")
    s.add_argument("--queued", type=_list(_count), default=[10000, 50000],
                   help="queue lengths (comma-separated; default 10000,50000)")
    s.add_argument("--policies", type=_list("policy"), default=["chunked", "sjf"],
                   help="policies (comma-separated; default chunked,sjf)")
    s.add_argument("--json", action="store_true")


def _machine() -> str:
    from sim import _compiled

    return (f"{platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}"
            f", hot path {'compiled (mypyc)' if _compiled.COMPILED else 'pure Python'}")


def bench_sim(args) -> dict:
    from sim import Engine, load_scenario, summarize
    from sim.inputs.workload import build_workload

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


def bench_log(args) -> dict:
    import tempfile

    from sim import Engine, load_scenario, summarize
    from sim.session.log import read_log, write_log
    from sim.session.replay import verify
    from sim.inputs.workload import build_workload

    sc = load_scenario(args.scenario)
    t_run = t_write = t_verify = math.inf
    with tempfile.TemporaryDirectory() as d:
        path = f"{d}/session.msgpack"
        for _ in range(max(1, args.repeat)):  # best of N for each phase, side by side
            t0 = time.perf_counter()
            engine = Engine(sc, workload=build_workload(sc))
            engine.run()
            summary = summarize(engine)
            t_run = min(t_run, time.perf_counter() - t0)
            t0 = time.perf_counter()
            write_log(path, engine, summary)
            t_write = min(t_write, time.perf_counter() - t0)
            del engine
            t0 = time.perf_counter()
            log = read_log(path, check_events=False)  # as `replay --verify` reads it
            _, div = verify(log)
            t_verify = min(t_verify, time.perf_counter() - t0)
    tokens = summary["output_tokens"]
    return {
        "scenario": sc.name, "machine": _machine(), "events": len(log.records),
        "output_tokens": tokens, "log_bytes": log.size_bytes,
        "bytes_per_output_token": log.size_bytes / tokens,
        "run_s": t_run, "write_s": t_write, "original_s": t_run + t_write,
        "replay_verify_s": t_verify, "verify_over_original": t_verify / (t_run + t_write),
        "verified": div is None,
    }


def bench_compute(args) -> dict:
    from sim import Engine, load_scenario
    from tui.cli import make_executor

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
    return {"scenario": sc.name, "machine": _machine(), "executor": executor.describe(),
            "steps": steps, "wall_s": wall, "steps_per_s": steps / wall,
            "cpu_s": cpu, "steps_per_cpu_s": steps / cpu if cpu else 0.0,
            "steps_per_simulated_s": needed, "headroom_at_x1": steps / wall / needed,
            "running_at_end": len(engine.policy.running), "simulated_s": engine.now}


def text_compute(r: dict) -> str:
    return "\n".join([
        f"bench compute: {r['scenario']} on {r['machine']}",
        f"  {r['executor']}",
        f"  {r['steps']} steps in {r['wall_s']:.2f} s: {r['steps_per_s']:.1f} engine steps per "
        f"wall second ({r['running_at_end']} requests running, {r['simulated_s']:.1f} s simulated)",
        f"  {r['steps_per_cpu_s']:.1f} steps per CPU second of this process; x1 needs "
        f"{r['steps_per_simulated_s']:.1f} steps per second here: headroom {r['headroom_at_x1']:.2f}x",
    ])


def text_sim(r: dict) -> str:
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


def text_log(r: dict) -> str:
    return "\n".join([
        f"bench log: {r['scenario']} on {r['machine']}",
        f"  events               {r['events']:,}",
        f"  log size             {r['log_bytes']:,} bytes "
        f"({r['bytes_per_output_token']:.2f} per output token)",
        f"  original run         {r['original_s']:.2f} s (simulate {r['run_s']:.2f} s "
        f"+ write {r['write_s']:.2f} s)",
        f"  replay --verify      {r['replay_verify_s']:.2f} s "
        f"({r['verify_over_original']:.2f} x the original), "
        f"{'identical' if r['verified'] else 'DIVERGED'}",
    ])


def text_tui(r: dict) -> str:
    lines = [f"bench tui: {_machine()}"]
    for k, v in r.items():
        lines.append(f"  {k:<22} {v:,.2f}" if isinstance(v, float) else f"  {k:<22} {v}")
    return "\n".join(lines)


def text_kernel(rows) -> str:
    if isinstance(rows, dict):  # --static
        from gpu.kernel_static import format_comparison

        return format_comparison(rows)
    lines = [f"bench kernel: NumPy paged decode attention vs dense, {_machine()}",
             f"{'batch':>6} {'context':>8} {'paged GB/s':>11} {'dense GB/s':>11} {'ratio':>6}"]
    for r in rows:
        lines.append(f"{r['batch']:>6} {r['context']:>8} {r['paged_gbps']:>11.2f} "
                     f"{r['dense_gbps']:>11.2f} {r['ratio_to_dense']:>6.2f}")
    return "\n".join(lines)


def _tui_bench():
    from tui import bench_tui

    return bench_tui


def bench_tui(args) -> dict:
    from tui.bench_tui import bench_tui as run

    return run(args)


def bench_kernel(args):
    if args.static:
        from pathlib import Path

        from gpu import kernel_static

        from subprocess import CalledProcessError

        from sim.errors import ServesimError

        from gpu.cupy_backend import BLOCK_SIZES

        try:
            sizes = tuple(int(s) for s in args.block_sizes.split(","))
        except ValueError:
            sizes = ()
        if not sizes or any(b not in BLOCK_SIZES for b in sizes):
            raise ServesimError(f"bench kernel --block-sizes {args.block_sizes!r}: want block sizes like 8,16 "
                                f"(powers of two from {BLOCK_SIZES[0]} to {BLOCK_SIZES[-1]})")
        try:
            return kernel_static.compare(args.before, ".", Path(__file__).resolve().parents[1], sizes)
        except (kernel_static.ToolMissing, RuntimeError, CalledProcessError, OSError) as e:
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise ServesimError(f"bench kernel --static: {first}") from None
    from gpu.bench import kernel_bench

    return kernel_bench(repeat=args.repeat)


# 4 rates x 4 block sizes: points of about 0.2-1.2 s each on the development machine.
SWEEP_GRID = ["workload.rate=4,6,8,10", "kv.block_size=8,16,32,64"]


def bench_sweep(args) -> dict:
    from sim.deploy import sweep
    p = sweep.plan("chat", sweep.parse_grid(SWEEP_GRID),
                   overrides=[f"workload.duration_s={args.duration}"])
    walls, tables = {}, {}
    for workers in (1, 2):
        t0 = time.perf_counter()
        with sweep.Runner(workers) as runner:
            tables[workers] = sweep.run_sweep(p, runner)
        walls[workers] = time.perf_counter() - t0
    same = [[r[c] for c in tables[1].columns if c != "wall_s"] for r in tables[1].rows] == \
        [[r[c] for c in tables[2].columns if c != "wall_s"] for r in tables[2].rows]
    return {
        "machine": _machine(), "points": len(p.points), "grid": SWEEP_GRID,
        "duration_s": args.duration, "run_s_sum": sum(r["wall_s"] for r in tables[1].rows),
        "wall_s_1_worker": walls[1], "wall_s_2_workers": walls[2],
        "speedup": walls[1] / walls[2], "identical": same,
    }


def text_sweep(r: dict) -> str:
    return "\n".join([
        f"bench sweep: chat, {' x '.join(r['grid'])} ({r['points']} points, "
        f"{r['duration_s']:g} s of arrivals each) on {r['machine']}",
        f"  runs, summed         {r['run_s_sum']:.2f} s",
        f"  1 worker             {r['wall_s_1_worker']:.2f} s wall",
        f"  2 workers            {r['wall_s_2_workers']:.2f} s wall "
        f"(speed-up {r['speedup']:.2f} x)",
        f"  rows                 {'identical' if r['identical'] else 'DIFFER'} (wall_s aside)",
    ])


def bench_scale(args) -> dict:
    from tui.bench_scale import bench_scale as run

    return run(args)


def bench_hotpath(args) -> dict:
    from tui.bench_scale import bench_hotpath as run

    return run(args)


def text_scale(r: dict) -> str:
    from tui.bench_scale import text_scale as text

    return text(r)


def text_hotpath(r: dict) -> str:
    from tui.bench_scale import text_hotpath as text

    return text(r)


def bench_queue(args) -> dict:
    from sim import Engine, load_scenario
    from sim.inputs.workload import build_workload

    rows = []
    for n in args.queued:
        # every request arrives within a few milliseconds: the queue starts n long and drains
        sc = load_scenario("chat", [f"workload.num_requests={n}", "workload.rate=1e6",
                                    'workload.arrival="constant"'])
        workload = build_workload(sc)
        for policy in args.policies:
            engine = Engine(sc, policy=policy, workload=workload, record_events=False)
            spent = _time_decisions(engine.policy)
            t0 = time.perf_counter()
            engine.run()
            wall = time.perf_counter() - t0
            rows.append({"queued": n, "policy": policy, "wall_s": wall,
                         "steps": engine.step_count, "finished": engine.counts["finished"],
                         "decisions": spent[1], "decision_us": 1e6 * spent[0] / max(1, spent[1])})
    return {"machine": _machine(), "scenario": "chat", "rows": rows}


def _time_decisions(policy) -> list:
    """Time every scheduling decision of `policy` (schedule() and the aging look-ahead) into
    the returned [seconds, decisions]."""
    spent = [0.0, 0]

    def timed(fn, count):
        def run():
            t0 = time.perf_counter()
            out = fn()
            spent[0] += time.perf_counter() - t0
            spent[1] += count
            return out
        return run

    policy.schedule = timed(policy.schedule, 1)
    policy.next_change_time = timed(policy.next_change_time, 0)
    return spent


def text_queue(r: dict) -> str:
    lines = [f"bench queue: chat, every request queued at once, on {r['machine']}"]
    base = {x["queued"]: x["wall_s"] for x in r["rows"] if x["policy"] == r["rows"][0]["policy"]}
    for x in r["rows"]:
        lines.append(f"  {x['queued']:>7,} queued  {x['policy']:<10} {x['wall_s']:8.2f} s wall "
                     f"({x['wall_s'] / base[x['queued']]:.2f} x), {x['steps']:,} steps, "
                     f"{x['decision_us']:,.0f} us a decision ({x['decisions']:,})")
    return "\n".join(lines)


BENCHES = {
    "sim": (bench_sim, text_sim),
    "log": (bench_log, text_log),
    "tui": (bench_tui, text_tui),
    "live-memory": (lambda a: _tui_bench().bench_live_memory(a),
                    lambda r: _tui_bench().text_live_memory(r)),
    "kernel": (bench_kernel, text_kernel),
    "compute": (bench_compute, text_compute),
    "sweep": (bench_sweep, text_sweep),
    "scale": (bench_scale, text_scale),
    "hotpath": (bench_hotpath, text_hotpath),
    "queue": (bench_queue, text_queue),
}


def _serve_bench():
    from tui.serve.bench import bench_serve, text_serve

    return bench_serve, text_serve


def main(args) -> int:
    if getattr(args, "scenario", None) is not None:  # one line now, not a child's traceback later
        from sim import load_scenario

        load_scenario(args.scenario)
    run, text = _serve_bench() if args.bench == "serve" else BENCHES[args.bench]
    result = run(args)
    print(json.dumps(result, indent=2) if args.json else text(result))
    return 0
