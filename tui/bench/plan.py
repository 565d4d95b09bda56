"""`servesim bench plan`: `servesim plan` for Llama-3.1-70B on the Azure conversation trace
(TTFT p99 <= 2 s, TPOT p99 <= 100 ms, the trace's own load): the whole default space (A100,
H100, H200; TP 1-8; 1-4 replicas and two routers; two `max_num_seqs`, two token budgets;
chunked and disaggregated, the latter 1:1 only, as it was measured; prefix caching off and on;
DP 1, 2, 4 and PP 1, 2) with N workers, then with one (how it scales).

Wall time on a shared machine says little about scaling, so each run also reports what load
cannot fake: the CPU time of its runs, each worker's busy time over the wall time (its
utilisation: near 1 when the scheduling keeps it fed), the critical path (the longest chain of
runs each chosen from the one before: no number of workers ends the plan sooner), the runs
started ahead that the search did not use, and the load average before and after.

Then its answer against the exhaustive search (no pruning, no bounds carried, every probe on
the whole trace: the ground truth): of a small space around the answer by default (minutes),
or of the whole space with `--exhaustive` (about 40 minutes on two cores; `-o FILE` keeps its
results, and a run again with the same file resumes). The pruned answer must be the same
winner, or one within 2% of its cost per output token.
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
AGREE = 0.02  # the pruned winner's cost within this of the exhaustive winner's


def whole_space() -> P.Space:
    return P.Space(gpus=["a100-80gb", "h100-sxm", "h200"], pd_ratios=[(1, 1)])


def small_space() -> P.Space:
    """A space the exhaustive search runs in minutes, around the whole space's answer: H100 and
    H200 x TP 2, 4 x one or four replicas behind least-outstanding x two `max_num_seqs`."""
    return P.Space(["h100-sxm", "h200"], [2, 4], [1, 4], ["least-outstanding"], [128, 256],
                   [2048], ["chunked"], [False], [1], [1], [False])


def _plan(space: P.Space, prune: bool = True) -> P.Plan:
    """The plan; unpruned, it is the ground truth: every candidate searched on the whole trace."""
    return P.Plan(SCENARIO, P.parse_bounds(BOUNDS), space, P.load_prices(),
                  overrides=list(OVERRIDES), prune=prune)


def _timed(plan: P.Plan, workers: int, journal: str | None = None) -> dict:
    """The plan's summary: its answer, wall time, the work its runs did and the load average
    (1, 5, 15 minutes) before and after."""
    before = os.getloadavg()
    t0 = time.perf_counter()
    with Runner(workers) as runner:
        out = P.run_plan(plan, runner, journal_path=journal)
    wall = time.perf_counter() - t0
    w = out.winner
    counts: dict[str, int] = {}
    for r in out.results:
        counts[r.status] = counts.get(r.status, 0) + 1
    return {"wall_s": wall, "load_before": before, "load_after": os.getloadavg(),
            "candidates": out.candidates, "runs": out.probes, "resumed": out.resumed,
            "statuses": counts, "work": out.work,
            "winner": w.candidate.label() if w else None,
            "winner_usd_per_m_tokens": w.usd_per_m_tokens if w else None,
            "winner_max_load": w.max_load if w else None,
            "ranked": [(r.candidate.label(), r.status, r.max_load) for r in out.results]}


def agreement(pruned: dict, exhaustive: dict) -> dict:
    """Whether the pruned search's winner is the exhaustive one's, or within AGREE of its cost."""
    same = pruned["winner"] == exhaustive["winner"]
    a, b = pruned["winner_usd_per_m_tokens"], exhaustive["winner_usd_per_m_tokens"]
    gap = a / b - 1 if a and b else None
    return {"same_winner": same, "cost_gap": gap,
            "agrees": same or (gap is not None and abs(gap) <= AGREE)}


def run(args) -> dict:
    workers = args.workers or os.cpu_count() or 1
    out = {"machine": machine(), "workers": workers, "scenario": SCENARIO, "bounds": BOUNDS}
    out["full"] = _timed(_plan(whole_space()), workers)
    if not args.skip_scaling and workers > 1:
        out["full_1_worker"] = _timed(_plan(whole_space()), 1)
        out["same_answer"] = out["full"]["ranked"] == out["full_1_worker"]["ranked"]
    space = whole_space() if args.exhaustive else small_space()
    pruned = out["full"] if args.exhaustive else _timed(_plan(space), workers)
    out["pruned"] = pruned
    out["exhaustive"] = _timed(_plan(space, prune=False), workers, args.output)
    out["exhaustive_space"] = "whole" if args.exhaustive else "small"
    out["agreement"] = agreement(pruned, out["exhaustive"])
    for s in (out["full"], out.get("full_1_worker"), pruned, out["exhaustive"]):
        if s is not None:  # (no 1-worker run with --skip-scaling)
            s.pop("ranked", None)
    return out


def _line(name: str, s: dict) -> list[str]:
    st = ", ".join(f"{n} {k}" for k, n in s["statuses"].items())
    w = s["work"]
    util = " ".join(f"{u:.2f}" for u in w["utilisation"])
    return [f"  {name:<24} {s['wall_s']:7.1f} s wall  {s['candidates']:4d} candidates ({st})",
            f"  {'':<24} {s['runs']:,} runs ({w['runs_ahead_unused']:,} more run ahead, unused: "
            f"{w['cpu_s_unused']:.0f} s CPU); CPU {w['cpu_s']:.0f} s; critical path "
            f"{w['critical_path_s']:.0f} s CPU",
            f"  {'':<24} utilisation (busy / wall) per worker: {util}; load average "
            + "/".join(f"{x:.2f}" for x in s["load_before"]) + " before, "
            + "/".join(f"{x:.2f}" for x in s["load_after"]) + " after"]


def text(r: dict) -> str:
    f = r["full"]
    lines = [f"bench plan: {SCENARIO} with Llama-3.1-70B, {', '.join(r['bounds'])}, "
             f"on {r['machine']}"]
    lines += _line(f"whole space, {r['workers']} workers", f)
    if "full_1_worker" in r:
        one = r["full_1_worker"]
        lines += _line("whole space, 1 worker", one)
        lines.append(f"  {'speed-up':<24} {one['wall_s'] / f['wall_s']:.2f} x wall with "
                     f"{r['workers']} workers; the same answer: "
                     f"{'yes' if r['same_answer'] else 'NO'}")
    if r["exhaustive_space"] == "small":
        lines += _line(f"small space, {r['workers']} wkrs", r["pruned"])
    lines += _line(f"{r['exhaustive_space']} space, exhaustive", r["exhaustive"])
    lines.append(f"  winner (whole space)     {f['winner']}: {f['winner_max_load']:.3g} req/s, "
                 f"${f['winner_usd_per_m_tokens']:.3f}/M tokens" if f["winner"] else
                 "  winner (whole space)     none")
    e = r["exhaustive"]
    if e["winner"]:
        lines.append(f"  winner (exhaustive)      {e['winner']}: {e['winner_max_load']:.3g} "
                     f"req/s, ${e['winner_usd_per_m_tokens']:.3f}/M tokens")
    a = r["agreement"]
    gap = "-" if a["cost_gap"] is None else f"{100 * a['cost_gap']:+.2f}%"
    lines.append(f"  pruned vs exhaustive     "
                 f"{'same winner' if a['same_winner'] else 'other winner'}, cost {gap}: "
                 f"{'AGREE' if a['agrees'] else 'DISAGREE'}")
    return "\n".join(lines)
