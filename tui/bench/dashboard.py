"""`servesim bench tui`: the dashboard, headless, on the default scenario with a 4,096-block KV
pool and 500 requests waiting at the start, for `--sim-seconds` simulated seconds.

A frame is all the UI thread's work for one refresh tick: the refresh callback (snapshot under
the engine lock, queue tables, block map, event log), a chart sample when one is due, and the
compositor's render of what changed, encoded to terminal bytes as a real terminal would get
them. The engine runs in its worker thread meanwhile, so frame times include sharing the GIL.
The cyclic collector's work at each tick, before the frame (`FrozenHeap`), is timed apart.
"""

from __future__ import annotations

import asyncio
import time

import numpy as np

from sim import Engine, load_scenario
from sim.inputs.workload import sample_lengths
from tui.app import Dashboard
from tui.bench.common import machine

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
        self.collects: list[float] = []  # seconds of garbage collection at each frame tick
        collect = self.heap.between_frames

        def timed() -> None:
            t0 = time.perf_counter()
            collect()
            self.collects.append(time.perf_counter() - t0)

        self.heap.between_frames = timed

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
            self.waiting_seen.append(self.snap.num_waiting)

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
        app.collects.clear()
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


def run(args) -> dict:
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
        # (the collector's work at the frame tick, before drawing: not part of a frame)
        "gc_ms_mean": _ms(app.collects),
        "gc_ms_p99": _ms(app.collects, 99),
        "steps": engine.step_count - steps0,
        "steps_per_s": (engine.step_count - steps0) / wall if wall else 0.0,
    }


def text(r: dict) -> str:
    lines = [f"bench tui: {machine()}"]
    for k, v in r.items():
        lines.append(f"  {k:<22} {v:,.2f}" if isinstance(v, float) else f"  {k:<22} {v}")
    return "\n".join(lines)
