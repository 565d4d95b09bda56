"""`servesim bench sweep`: a 16-point sweep of `chat` with 1 and with 2 local workers, the
speed-up, and whether both gave the same rows."""

from __future__ import annotations

import time

from sim.deploy import sweep
from tui.bench.common import machine

# 4 rates x 4 block sizes: 16 short points.
SWEEP_GRID = ["workload.rate=4,6,8,10", "kv.block_size=8,16,32,64"]


def run(args) -> dict:
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
        "machine": machine(), "points": len(p.points), "grid": SWEEP_GRID,
        "duration_s": args.duration, "run_s_sum": sum(r["wall_s"] for r in tables[1].rows),
        "wall_s_1_worker": walls[1], "wall_s_2_workers": walls[2],
        "speedup": walls[1] / walls[2], "identical": same,
    }


def text(r: dict) -> str:
    return "\n".join([
        f"bench sweep: chat, {' x '.join(r['grid'])} ({r['points']} points, "
        f"{r['duration_s']:g} s of arrivals each) on {r['machine']}",
        f"  runs, summed         {r['run_s_sum']:.2f} s",
        f"  1 worker             {r['wall_s_1_worker']:.2f} s wall",
        f"  2 workers            {r['wall_s_2_workers']:.2f} s wall "
        f"(speed-up {r['speedup']:.2f} x)",
        f"  rows                 {'identical' if r['identical'] else 'DIFFER'} (wall_s aside)",
    ])
