"""`servesim bench scale` and `servesim bench hotpath`: how servesim's cost grows with the run.

`bench scale` measures side by side, in one run: each run of `chat` with N requests in a
subprocess of its own (wall time, the child's max RSS from the kernel, the memory the engine
still holds after the run, and the workload it was given); the full Azure conversation trace's
wall time; and the memory one request in flight holds. `bench hotpath` profiles a run
(cProfile) and prints where the time goes per scheduling decision, by function.
"""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
import time
import types

import numpy as np

_SKIP = (type, types.ModuleType, types.FunctionType, types.BuiltinFunctionType,
         types.MethodType, types.CodeType)


def reachable_bytes(root, skip=()) -> int:
    """Bytes of the objects reachable from `root` (sys.getsizeof each, NumPy buffers they own),
    not counting `skip`, classes, modules or functions."""
    seen = {id(x) for x in skip}
    total, stack = 0, [root]
    while stack:
        o = stack.pop()
        if id(o) in seen or isinstance(o, _SKIP):
            continue
        seen.add(id(o))
        if isinstance(o, np.ndarray):
            total += sys.getsizeof(o) if o.base is None else 112
            if o.base is not None:
                stack.append(o.base)
            continue
        total += sys.getsizeof(o)
        stack.extend(gc.get_referents(o))
    return total


def child(scenario: str, n: int, keep_history: bool) -> dict:
    """One run of `scenario` with n requests (0: only build it), as `servesim sim` runs it."""
    from sim import build, load_scenario, summarize

    t0 = time.perf_counter()
    sc = load_scenario(scenario, [f"workload.num_requests={n or 1}", "workload.duration_s=0"])
    engine = build(sc, record_events=False, keep_history=keep_history)
    if n:
        engine.run()
        summarize(engine)
    wall = time.perf_counter() - t0
    # (the workload is the input, counted apart: its arrays too, which the engine reads at
    # arrival through views)
    held = reachable_bytes(engine, skip=[engine.workload, sc, *vars(engine.workload).values()])
    parts = getattr(engine, "instances", [engine])
    exact = all(x.exact for e in parts for x in (e.ttft, e.tpot, e.e2e, e.queue_wait,
                                                 e.itl_extra, e.timeline.itl))
    return {"requests": n, "wall_s": wall if n else 0.0, "steps": engine.step_count,
            "engine_bytes_after": held, "workload_bytes": reachable_bytes(engine.workload),
            "exact_percentiles": exact, "max_rss_bytes": peak_rss_bytes()}


def status_bytes(field: str) -> int | None:
    """A memory figure of this process from Linux's /proc/self/status (`VmRSS`, `VmHWM`...),
    in bytes; None where there is none."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def peak_rss_bytes() -> int:
    """This process's own peak resident memory. Linux: VmHWM of the address space made at
    exec. (Not the ru_maxrss that wait4 reports for a child: Linux carries the parent's RSS at
    fork into it, so a child of a 9 GB test process "peaked" at 9 GB.)"""
    peak = status_bytes("VmHWM")
    if peak is not None:
        return peak
    import resource

    scale = 1 if sys.platform == "darwin" else 1024  # (bytes on macOS, KiB elsewhere)
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale


def run_in_child(module: str, function: str, *args, env: dict | None = None) -> dict:
    """`module.function(*args)` (plain values) in a fresh Python process (`env`: variables
    to set in it): its JSON result, the last line it prints. Raises ServesimError (one line:
    the child's own error, or the last line of its traceback) when the process fails."""
    from sim.errors import ServesimError

    code = (f"import json; from {module} import {function} as f; "
            f"print(json.dumps(f(*{args!r})))")
    p = subprocess.run([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                       env={**os.environ, **env} if env else None)
    if p.returncode:
        lines = p.stderr.decode(errors="replace").strip().splitlines()
        last = lines[-1] if lines else f"exited {p.returncode}"
        if ": " in last and last.split(": ", 1)[0].endswith("Error"):
            last = last.split(": ", 1)[1]  # "sim.errors.ScenarioError: F: field ..." -> the message
        raise ServesimError(f"{function}{args!r} in a subprocess: {last}")
    return json.loads(p.stdout.decode().strip().splitlines()[-1])


def _run_child(scenario: str, n: int, keep_history: bool) -> dict:
    return run_in_child("tui.bench_scale", "child", scenario, n, keep_history)


def in_flight_bytes(scenario: str = "chat") -> dict:
    """Mean bytes held per live request, queued and running, in an overloaded run stopped
    halfway (each request's own objects: not the timeline or engine it points to)."""
    from sim import Engine, RequestState, load_scenario

    sc = load_scenario(scenario, ["workload.rate=30", "workload.duration_s=120"])
    e = Engine(sc, record_events=False, keep_history=False)
    e.run_until(60.0)
    shared = [e, e.timeline, e.workload, *RequestState]
    out = {}
    for name, reqs in (("waiting", list(e.policy.waiting)), ("running", list(e.policy.running))):
        sizes = [reachable_bytes(r, skip=shared) for r in reqs]
        out[name] = {"requests": len(sizes), "bytes_each": sum(sizes) / len(sizes)
                     if sizes else None}
    return out


def bench_scale(args) -> dict:
    from tui.bench import bench_sim

    ns = list(args.requests)
    runs = [_run_child(args.scenario, 0, False)]
    for n in ns:
        runs.append(_run_child(args.scenario, n, False))
    if args.with_history:
        for n in ns:
            if n <= args.with_history:
                runs.append({**_run_child(args.scenario, n, True), "keep_history": True})
    azure = bench_sim(types.SimpleNamespace(scenario="azure-conv", policy="chunked",
                                            repeat=args.repeat))
    return {"machine": _machine(), "scenario": args.scenario, "runs": runs,
            "azure_conv": {"wall_s": azure["wall_s"], "runs": azure["runs"],
                           "requests": azure["requests"], "steps": azure["steps"]},
            "in_flight": in_flight_bytes(args.scenario)}


def text_scale(r: dict) -> str:
    mb = 1 << 20
    lines = [f"bench scale: {r['scenario']} with N requests, each run in a subprocess, "
             f"on {r['machine']}",
             f"{'N':>10} {'history':>8} {'wall s':>8} {'steps':>11} {'max RSS MB':>11} "
             f"{'engine MB after':>16} {'workload MB':>12}  percentiles"]
    for x in r["runs"]:
        n = "(build)" if not x["requests"] else f"{x['requests']:,}"
        pct = "" if not x["requests"] else "exact" if x["exact_percentiles"] else "bounded"
        lines.append(f"{n:>10} {'kept' if x.get('keep_history') else 'no':>8} "
                     f"{x['wall_s']:>8.1f} {x['steps']:>11,} {x['max_rss_bytes'] / mb:>11.0f} "
                     f"{x['engine_bytes_after'] / mb:>16.1f} {x['workload_bytes'] / mb:>12.1f}"
                     f"  {pct}")
    a = r["azure_conv"]
    f = r["in_flight"]
    lines += [
        f"  Azure conversation trace: {a['wall_s']:.2f} s wall (best of {a['runs']}), "
        f"{a['requests']:,} requests, {a['steps']:,} steps",
        "  memory per request in flight: "
        + ", ".join(f"{k} {v['bytes_each']:,.0f} bytes ({v['requests']} requests)"
                    for k, v in f.items() if v["bytes_each"] is not None),
    ]
    return "\n".join(lines)


def bench_hotpath(args) -> dict:
    """A cProfile of one run: per function, its share of the run and its time and calls per
    scheduling decision (`sim.engine.stepping.advance`). Compiled functions are invisible to
    cProfile, so where this process runs the compiled hot path the profile is of the
    pure-Python modules, in a child process."""
    from sim import _compiled

    if _compiled.COMPILED:
        return run_in_child("tui.bench_scale", "profile_hotpath", args.scenario, args.policy,
                            args.top, env={"SERVESIM_PURE": "1"})
    return profile_hotpath(args.scenario, args.policy, args.top)


def profile_hotpath(scenario: str, policy: str, top: int) -> dict:
    import cProfile
    import pstats

    from sim import build, load_scenario

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
    return {"machine": _machine(), "scenario": sc.name, "policy": policy,
            "modules": "pure Python",
            "wall_s_profiled": wall, "decisions": decisions, "steps": engine.step_count,
            "calls_per_decision": sum(v[1] for v in st.stats.values()) / decisions,
            "us_per_decision": total / decisions * 1e6, "functions": rows[:top]}


def text_hotpath(r: dict) -> str:
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


def _machine() -> str:
    from tui.bench import _machine as machine

    return machine()
