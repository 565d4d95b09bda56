"""`servesim bench scale`: how servesim's cost grows with the run, measured side by side in one
run: each run of `chat` with N requests in a subprocess of its own (wall time, the child's max
RSS from the kernel, the memory the engine still holds after the run, and the workload it was
given); the full Azure conversation trace's wall time; and the memory one request in flight
holds."""

from __future__ import annotations

import time
import types

from sim import Engine, RequestState, build, load_scenario, summarize
from tui.bench import sim as sim_bench
from tui.bench.common import machine, run_in_child
from tui.bench.memory import peak_rss_bytes, reachable_bytes


def child(scenario: str, n: int, keep_history: bool) -> dict:
    """One run of `scenario` with n requests (0: only build it), as `servesim sim` runs it."""
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
                                                 e.itl_extra, e.timeline.itl, e.client_ttft,
                                                 e.client_tpot, e.client_e2e,
                                                 e.client_itl_extra, e.timeline.client_itl))
    return {"requests": n, "wall_s": wall if n else 0.0, "steps": engine.step_count,
            "engine_bytes_after": held, "workload_bytes": reachable_bytes(engine.workload),
            "exact_percentiles": exact, "max_rss_bytes": peak_rss_bytes()}


def run_child(scenario: str, n: int, keep_history: bool) -> dict:
    """`child` in a fresh Python process: its peak memory is the run's own."""
    return run_in_child("tui.bench.scale", "child", scenario, n, keep_history)


def in_flight_bytes(scenario: str = "chat") -> dict:
    """Mean bytes held per live request, queued and running, in an overloaded run stopped
    halfway (each request's own objects: not the timeline or engine it points to)."""
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


def run(args) -> dict:
    ns = list(args.requests)
    runs = [run_child(args.scenario, 0, False)]
    for n in ns:
        runs.append(run_child(args.scenario, n, False))
    if args.with_history:
        for n in ns:
            if n <= args.with_history:
                runs.append({**run_child(args.scenario, n, True), "keep_history": True})
    azure = sim_bench.run(types.SimpleNamespace(scenario="azure-conv", policy="chunked",
                                                repeat=args.repeat))
    return {"machine": machine(), "scenario": args.scenario, "runs": runs,
            "azure_conv": {"wall_s": azure["wall_s"], "runs": azure["runs"],
                           "requests": azure["requests"], "steps": azure["steps"]},
            "in_flight": in_flight_bytes(args.scenario)}


def text(r: dict) -> str:
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
