"""`servesim bench plan`: `servesim plan` for Llama-3.1-70B on the Azure conversation trace
(TTFT p99 <= 2 s, TPOT p99 <= 100 ms, the trace's own load): the whole default space (A100,
H100, H200; TP 1-8; 1-4 replicas and two routers; two `max_num_seqs`, two token budgets;
chunked and disaggregated; prefix caching off and on; DP 1, 2, 4 and PP 1, 2) with every local
worker, then with one (how it scales); the small space below with N workers and with one,
alternating, twice each (the machine may be shared: each run records the load average
before it); and a small space around the answer, pruned and searched exhaustively (no pruning, no bounds carried, every probe on the whole trace: the ground
truth), whose answer the pruned search must match: the same winner, or one within 2% of its
cost per output token.
"""

from __future__ import annotations

import os
import time

from sim.deploy import plan as P
from sim.deploy.sweep import Runner
from tui.bench.common import machine

SCENARIO = "azure-conv"
OVERRIDES = ['model.preset="llama-3.1-70b"']
BOUNDS = ["ttft_p99=2000", "tpot_p99=100"]


def small_space() -> P.Space:
    """A space the exhaustive search runs in minutes, around the whole space's answer: H100 and
    H200 x TP 2, 4 x one or four replicas behind least-outstanding x two `max_num_seqs`."""
    return P.Space(["h100-sxm", "h200"], [2, 4], [1, 4], ["least-outstanding"], [128, 256],
                   [2048], ["chunked"], [False], [1], [1], [False])


def _plan(space: P.Space, prune: bool = True) -> P.Plan:
    """The plan; unpruned, it is the ground truth: every candidate searched on the whole trace."""
    return P.Plan(SCENARIO, P.parse_bounds(BOUNDS), space, P.load_prices(),
                  overrides=list(OVERRIDES), prune=prune,
                  probe_requests=1000 if prune else None)


def _timed(plan: P.Plan, workers: int) -> tuple[P.Outcome, float, float]:
    """(the outcome, its wall time, the 1-minute load average before it)."""
    load = os.getloadavg()[0]
    t0 = time.perf_counter()
    with Runner(workers) as runner:
        out = P.run_plan(plan, runner)
    return out, time.perf_counter() - t0, load


def _summary(out: P.Outcome, wall: float, load: float) -> dict:
    w = out.winner
    counts: dict[str, int] = {}
    for r in out.results:
        counts[r.status] = counts.get(r.status, 0) + 1
    return {"wall_s": wall, "load_average": load, "candidates": out.candidates, "runs": out.probes,
            "statuses": counts, "winner": w.candidate.label() if w else None,
            "winner_usd_per_m_tokens": w.usd_per_m_tokens if w else None,
            "winner_max_load": w.max_load if w else None}


def run(args) -> dict:
    workers = args.workers or os.cpu_count() or 1
    out = {"machine": machine(), "workers": workers, "scenario": SCENARIO,
           "bounds": BOUNDS}
    whole = P.Space(gpus=["a100-80gb", "h100-sxm", "h200"])
    out["full"] = _summary(*_timed(_plan(whole), workers))
    if not args.skip_scaling and workers > 1:
        out["full_1_worker"] = _summary(*_timed(_plan(whole), 1))
    out["small"] = _summary(*_timed(_plan(small_space()), workers))
    if not args.skip_scaling and workers > 1:
        out["alternating"] = [_summary(*_timed(_plan(small_space()), n))
                              for n in (1, workers, 1, workers)]
    out["exhaustive"] = _summary(*_timed(_plan(small_space(), prune=False), workers))
    a, b = out["small"], out["exhaustive"]
    same = a["winner"] == b["winner"]
    gap = (a["winner_usd_per_m_tokens"] / b["winner_usd_per_m_tokens"] - 1
           if a["winner"] and b["winner"] else None)
    out["agreement"] = {"same_winner": same, "cost_gap": gap,
                        "agrees": same or (gap is not None and abs(gap) <= 0.02)}
    # The whole space holds the small one: its answer is no dearer (within the 2%).
    whole = out["full"]["winner_usd_per_m_tokens"]
    out["whole_no_dearer"] = bool(whole and b["winner_usd_per_m_tokens"]
                                  and whole <= b["winner_usd_per_m_tokens"] * 1.02)
    return out


def text(r: dict) -> str:
    def line(name: str, s: dict) -> str:
        st = ", ".join(f"{n} {k}" for k, n in s["statuses"].items())
        return (f"  {name:<22} {s['wall_s']:7.1f} s wall  {s['candidates']:4d} candidates "
                f"({st})  {s['runs']:,} runs")
    f = r["full"]
    lines = [f"bench plan: {SCENARIO} with Llama-3.1-70B, {', '.join(r['bounds'])}, "
             f"on {r['machine']}",
             line(f"whole space, {r['workers']} workers", f)]
    if "full_1_worker" in r:
        lines.append(line("whole space, 1 worker", r["full_1_worker"]))
        lines.append(f"  {'speed-up':<22} {r['full_1_worker']['wall_s'] / f['wall_s']:.2f} x "
                     f"with {r['workers']} workers")
    lines.append(line(f"small space, {r['workers']} wkrs", r["small"]))
    for s, n in zip(r.get("alternating", []), (1, r["workers"], 1, r["workers"])):
        lines.append(line(f"  small, {n} worker{'s' if n > 1 else ''}", s)
                     + f"  (load avg {s['load_average']:.2f} before)")
    lines.append(line("small, exhaustive", r["exhaustive"]))
    lines.append(f"  winner (whole space)   {f['winner']}: {f['winner_max_load']:.3g} req/s, "
                 f"${f['winner_usd_per_m_tokens']:.3f}/M tokens" if f["winner"] else
                 "  winner (whole space)   none")
    a = r["agreement"]
    gap = "-" if a["cost_gap"] is None else f"{100 * a['cost_gap']:+.2f}%"
    lines.append(f"  pruned vs exhaustive   {'same winner' if a['same_winner'] else 'other winner'}"
                 f", cost {gap}: {'AGREE' if a['agrees'] else 'DISAGREE'}")
    lines.append(f"  whole space's winner   {'no dearer' if r['whole_no_dearer'] else 'DEARER'} "
                 "than the small space's exhaustive one")
    return "\n".join(lines)
