"""`servesim bench tui`: the dashboard, headless, on the default scenario with a 4,096-block KV
pool and 500 requests waiting at the start, for `--sim-seconds` simulated seconds.

A frame is all the UI thread's work for one refresh tick: the refresh callback (snapshot under
the engine lock, queue tables, block map, event log), a chart sample when one is due, and the
compositor's render of what changed, encoded to terminal bytes as a real terminal would get
them. The engine runs in its worker thread meanwhile, so frame times include sharing the GIL.
"""

from __future__ import annotations

import asyncio
import time

import numpy as np

from sim import Engine, load_scenario
from sim.inputs.workload import sample_lengths
from tui.app import Dashboard
from tui.bench_scale import run_in_child, status_bytes

NUM_BLOCKS = 4096
WAITING = 500
SIZE = (160, 50)
WALL_S = 10.0  # the run's target wall time: speed = sim seconds / WALL_S (at least x1)


class _TimedDashboard(Dashboard):
    """The dashboard with its UI work timed, frame by frame."""

    def __init__(self, *a, **kw) -> None:
        super().__init__(*a, **kw)
        self.frames: list[float] = []   # seconds of UI work per frame
        self.updates: list[float] = []  # of which the refresh callback
        self.waiting_seen: list[int] = []

    def _add(self, seconds: float) -> None:
        if self.frames:
            self.frames[-1] += seconds

    def refresh_frame(self) -> None:
        t0 = time.perf_counter()
        super().refresh_frame()
        dt = time.perf_counter() - t0
        self.frames.append(dt)
        self.updates.append(dt)
        if self.snap is not None:
            self.waiting_seen.append(len(self.snap.waiting))

    def sample_charts(self) -> None:
        t0 = time.perf_counter()
        super().sample_charts()
        self._add(time.perf_counter() - t0)

    def time_rendering(self) -> None:
        # Headless, Textual composes each update but writes nothing: encode it to terminal bytes
        # here so the frame includes what a terminal would cost. (Private hook: benchmark only.)
        compositor = self.screen._compositor
        render_update = compositor.render_update

        def timed(*a, **kw):
            t0 = time.perf_counter()
            update = render_update(*a, **kw)
            if update is not None:
                update.render_segments(self.console)
            self._add(time.perf_counter() - t0)
            return update

        compositor.render_update = timed


def _engine() -> Engine:
    sc = load_scenario("chat", [f"kv.num_blocks={NUM_BLOCKS}"])
    engine = Engine(sc)
    rng = np.random.default_rng([sc.seed, 0xBE, 0xAC])
    prompts, outputs = sample_lengths(sc, WAITING, rng)
    for p, o in zip(prompts.tolist(), outputs.tolist()):
        engine.inject(p, o)
    return engine


async def _drive(app: _TimedDashboard, sim_seconds: float) -> float:
    async with app.run_test(size=SIZE) as pilot:
        app.time_rendering()
        app.frames.clear()
        app.updates.clear()
        t0 = time.perf_counter()
        while app.engine.now < sim_seconds:
            await pilot.pause(0.05)
        wall = time.perf_counter() - t0
        app.driver.set_paused(True)
    return wall


def _ms(values: list[float], q: float | None = None) -> float:
    if not values:
        return float("nan")
    a = np.asarray(values) * 1e3
    return float(a.mean() if q is None else np.percentile(a, q, method="inverted_cdf"))


def bench_tui(args) -> dict:
    sim_seconds = float(args.sim_seconds)
    engine = _engine()
    speed = max(1.0, sim_seconds / WALL_S)
    app = _TimedDashboard(engine, speed=speed)
    steps0 = engine.step_count
    wall = asyncio.run(_drive(app, sim_seconds))
    frames = app.frames[1:]  # the first includes the initial layout
    return {
        "scenario": engine.scenario.name,
        "terminal": f"{SIZE[0]}x{SIZE[1]}",
        "kv_blocks": engine.kv.num_blocks,
        "waiting_at_start": WAITING,
        "waiting_mean": float(np.mean(app.waiting_seen)) if app.waiting_seen else 0.0,
        "speed": speed,
        "sim_seconds": engine.now,
        "wall_s": wall,
        "frames": len(frames),
        "frames_per_s": len(frames) / wall if wall else 0.0,
        "frame_ms_mean": _ms(frames),
        "frame_ms_p50": _ms(frames, 50),
        "frame_ms_p99": _ms(frames, 99),
        "frame_ms_max": max(frames) * 1e3 if frames else float("nan"),
        "update_ms_mean": _ms(app.updates[1:]),
        "update_ms_p99": _ms(app.updates[1:], 99),
        "steps": engine.step_count - steps0,
        "steps_per_s": (engine.step_count - steps0) / wall if wall else 0.0,
    }


# --- `servesim bench live-memory` ------------------------------------------------------------

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


def bench_live_memory(args) -> dict:
    """The dashboard as `servesim run chat` opens it (its own engine, the session log kept for
    export), headless at 200x60, with real compute (`auto`: NumPy here) and without: resident
    memory against simulated time, each in a fresh process (Linux: /proc/self/status)."""
    runs = [run_in_child("tui.bench_tui", "live_memory_child", args.scenario, backend,
                         args.speed, args.sim_seconds) for backend in ("auto", "none")]
    return {"scenario": args.scenario, "speed": args.speed, "sim_seconds": args.sim_seconds,
            "runs": runs}


def live_memory_child(scenario: str, backend: str, speed: float, sim_seconds: float) -> dict:
    import gc

    from sim import build
    from tui.cli import make_executor

    sc = load_scenario(scenario, [f"compute.backend={backend!r}".replace("'", '"')])
    engine = build(sc, make_executor=make_executor)
    app = Dashboard(engine, speed=speed)
    every = max(1.0, sim_seconds / 30)
    frozen = gc.get_freeze_count()  # (what the process froze before: none in a fresh one)
    rows = asyncio.run(_sample_memory(app, sim_seconds, every))
    frozen = gc.get_freeze_count() - frozen
    t = np.array([r[0] for r in rows])
    mb = np.array([r[1] for r in rows])
    late = t >= min(60.0, t[-1] / 2)  # (past start-up: imports, first pages of the pool)
    slope = float(np.polyfit(t[late], mb[late], 1)[0]) if late.sum() >= 3 else float("nan")
    return {"backend": engine.executor.name if engine.executor else "none",
            "samples": [[round(a, 1), round(b, 1)] for a, b in rows],
            "mb_per_sim_s": slope, "gc_frozen": frozen,
            "events": len(engine.events), "steps": engine.step_count}


def text_live_memory(r: dict) -> str:
    lines = [f"dashboard memory: {r['scenario']} at x{r['speed']:g}, {r['sim_seconds']:g} "
             "simulated seconds (RSS, MB)"]
    for x in r["runs"]:
        s = x["samples"]
        lines.append(f"  compute {x['backend']:<6} {s[0][1]:7.1f} MB at {s[0][0]:5.1f} s -> "
                     f"{s[-1][1]:7.1f} MB at {s[-1][0]:6.1f} s: {x['mb_per_sim_s']:.3f} MB per "
                     f"simulated second after start-up; {x['steps']:,} steps, "
                     f"{x['events']:,} events kept; {x['gc_frozen']} objects frozen")
    return "\n".join(lines)
