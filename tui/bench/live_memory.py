"""`servesim bench live-memory`: the dashboard's resident memory against simulated time, with
real compute and without, and with real compute keeping the session's events in memory instead
of on disk (`sim.session.spool`), side by side; each run in a fresh process."""

from __future__ import annotations

import asyncio
import gc

import numpy as np

from sim import load_scenario
from tui.app import Dashboard, live_engine
from tui.bench.common import run_in_child
from tui.bench.memory import status_bytes
from tui.compute import make_executor


async def _sample_memory(app, sim_seconds: float, every: float) -> list[tuple[float, float]]:
    rows = []
    async with app.run_test(size=(200, 60)) as pilot:
        next_at = 0.0
        while app.engine.now < sim_seconds and not app.engine.done:
            await pilot.pause(0.2)
            if app.engine.now >= next_at:
                rows.append((app.engine.now, status_bytes("VmRSS") / 2**20))
                next_at = app.engine.now + every
        rows.append((app.engine.now, status_bytes("VmRSS") / 2**20))
        app.driver.set_paused(True)
    return rows


def run(args) -> dict:
    """The dashboard as `servesim run chat` opens it (its own engine, the session log kept for
    export: its events spooled to disk), headless at 200x60, with real compute (`auto`: NumPy
    here) and without, and with real compute and every event kept in memory: resident memory
    against simulated time, each in a fresh process (Linux: /proc/self/status); with
    `--no-compare` the first alone. `--set` overrides the scenario (an hour of arrivals)."""
    kinds = (("auto", True), ("auto", False), ("none", True)) if args.compare else (
        ("auto", True),)
    runs = [run_in_child("tui.bench.live_memory", "child", args.scenario, backend,
                         args.speed, args.sim_seconds, spool, args.overrides)
            for backend, spool in kinds]
    return {"scenario": args.scenario, "speed": args.speed, "sim_seconds": args.sim_seconds,
            "overrides": args.overrides, "runs": runs}


def child(scenario: str, backend: str, speed: float, sim_seconds: float,
          spool: bool = True, overrides: list[str] = ()) -> dict:
    sc = load_scenario(scenario, [*overrides,
                                  f"compute.backend={backend!r}".replace("'", '"')])
    engine = live_engine(sc, make_executor)
    app = Dashboard(engine, speed=speed, spool=spool)
    every = max(1.0, sim_seconds / 30)
    frozen = gc.get_freeze_count()  # (what the process froze before: none in a fresh one)
    rows = asyncio.run(_sample_memory(app, sim_seconds, every))
    frozen = gc.get_freeze_count() - frozen
    t = np.array([r[0] for r in rows])
    mb = np.array([r[1] for r in rows])
    late = t >= min(60.0, t[-1] / 2)  # (past start-up: imports, first pages of the pool)
    slope = float(np.polyfit(t[late], mb[late], 1)[0]) if late.sum() >= 3 else float("nan")
    # (and over the second half alone: a long run's slope once the pool's pages are all in)
    half = t >= t[-1] / 2
    slope_2 = float(np.polyfit(t[half], mb[half], 1)[0]) if half.sum() >= 3 else float("nan")
    spooled = sum(app.spool.spooled.values()) if app.spool else 0
    return {"backend": engine.executor.name if engine.executor else "none", "spool": spool,
            "samples": [[round(a, 1), round(b, 1)] for a, b in rows],
            "mb_per_sim_s": slope, "mb_per_sim_s_second_half": slope_2, "gc_frozen": frozen,
            # (past start-up: from the first late sample to the last)
            "growth_mb": float(mb[late][-1] - mb[late][0]) if late.any() else float("nan"),
            "events": len(engine.events) + spooled, "events_spooled": spooled,
            "spool_mb": app.spool.bytes / 2**20 if app.spool else 0.0,
            "steps": engine.step_count,
            # what the engine holds at the end: the requests it knows, its timeline rows
            "requests_held": len(engine.requests), "arrived": engine.counts["arrived"],
            "rows_held": engine.timeline.n - engine.timeline.first}


def text(r: dict) -> str:
    sets = "".join(f" --set {o}" for o in r.get("overrides", ()))
    lines = [f"dashboard memory: {r['scenario']}{sets} at x{r['speed']:g}, "
             f"{r['sim_seconds']:g} simulated seconds (RSS, MB)"]
    for x in r["runs"]:
        s = x["samples"]
        kept = (f"{x['events_spooled']:,} of {x['events']:,} events on disk "
                f"({x['spool_mb']:.1f} MB)" if x.get("spool", True)
                else f"{x['events']:,} events in memory")
        lines.append(f"  compute {x['backend']:<6} {s[0][1]:7.1f} MB at {s[0][0]:5.1f} s -> "
                     f"{s[-1][1]:7.1f} MB at {s[-1][0]:6.1f} s: {x['mb_per_sim_s']:.3f} MB per "
                     f"simulated second after start-up ({x['growth_mb']:+.1f} MB), "
                     f"{x.get('mb_per_sim_s_second_half', float('nan')):.3f} over the second "
                     "half; "
                     f"{x['steps']:,} steps, {kept}; {x['gc_frozen']} objects frozen; "
                     f"held at the end: {x['requests_held']:,} of {x['arrived']:,} requests, "
                     f"{x['rows_held']:,} of {x['steps']:,} timeline rows")
    return "\n".join(lines)
