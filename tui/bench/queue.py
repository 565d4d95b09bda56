"""`servesim bench queue`: whole runs of `chat` with 10k and 50k requests queued at once, per
queue policy, and the time of each scheduling decision."""

from __future__ import annotations

import time

from sim import Engine, load_scenario
from sim.inputs.workload import build_workload
from tui.bench.common import machine


def run(args) -> dict:
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
    return {"machine": machine(), "scenario": "chat", "rows": rows}


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


def text(r: dict) -> str:
    lines = [f"bench queue: chat, every request queued at once, on {r['machine']}"]
    base = {x["queued"]: x["wall_s"] for x in r["rows"] if x["policy"] == r["rows"][0]["policy"]}
    for x in r["rows"]:
        lines.append(f"  {x['queued']:>7,} queued  {x['policy']:<10} {x['wall_s']:8.2f} s wall "
                     f"({x['wall_s'] / base[x['queued']]:.2f} x), {x['steps']:,} steps, "
                     f"{x['decision_us']:,.0f} us a decision ({x['decisions']:,})")
    return "\n".join(lines)
