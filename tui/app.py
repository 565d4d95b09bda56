"""The live dashboard: composes the panels, and routes keys to the engine's public API and
snapshots to the panels, while a worker thread (`tui.driver.EngineDriver`) drives the engine.

The worker advances the engine in slices of a few milliseconds, holding `EngineDriver.lock`.
The UI takes a snapshot under the same lock on its refresh timers (skipping a tick while a slow
real-compute step holds it) and every key action that touches the engine takes it too, so one
thread at a time touches the engine, drawing never waits for the simulation, and a recorded
action lands between two steps.

The session is never lost: an action that fails is shown and the app goes on; an unexpected
error writes the session log to a recovery file before the app exits, and says where; SIGTERM
(and SIGHUP) quits as `q` does (the terminal restored). Exports never overwrite one another.
"""

from __future__ import annotations

import asyncio
import ctypes
import datetime as _dt
import functools
import gc
import re
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from textual import events
from textual.app import App, ComposeResult
from textual.containers import Horizontal, Vertical
from textual.widgets import Footer

from sim import POLICIES, Engine, ServesimError, build, rolling
from sim.fileio import check_writable
from sim.inputs.workload import sample_lengths
from sim.session.log import read_log, write_log
from sim.session.replay import Replayer
from sim.session.spool import Spool
from tui import keymap
from tui.driver import EngineDriver, stop_signals
from tui.widgets import (BlockMap, Charts, EventLog, HeaderInfo, HelpScreen, InjectDialog,
                         InjectSpec, InstanceRows, RequestTable, StatusHeader)
from tui.widgets.eventlog import describe
from tui.widgets.instances import instance_tags

INJECT_STREAM = 0x1A  # seed stream of the `i` / `b` keys' length draws


def heap_trimmer():
    """The C allocator's call that returns the free pages of its heaps to the system (glibc's
    `malloc_trim`, given the bytes to keep at the top of the heap), or None where there is
    none."""
    try:
        return ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError, TypeError):  # (another C library, or no CDLL(None))
        return None


class FrozenHeap:
    """Keeps Python's cyclic collections out of the dashboard's frames.

    Drawing makes thousands of cyclic garbage objects a second (Textual's strips cache
    themselves), and the engine's thread allocates too. Left automatic, a collection starts
    wherever an allocation crosses a threshold: inside a frame, or in the engine's thread while
    the UI thread waits for the GIL, so a frame that happens to pay for one runs 10-50 ms longer.
    So automatic collection is off (threshold 0: the engine thread's `paused_gc` toggles
    `gc.enable`, not the thresholds) and the UI thread collects at each frame tick, before it
    draws (`between_frames`): the youngest generation every tick, the middle one every
    GEN1_EVERY ticks, the oldest every GEN2_EVERY ticks. The frozen objects (`gc.freeze`) are
    scanned only by `reclaim`, every RECLAIM_S: everything is unfrozen, collected once, and what
    survives is frozen, so the ticks' collections scan only what came since. The ticks freeze
    nothing (a cycle frozen alive is held until the next reclaim). Strips a widget holds for a
    second or so are cycles that outlive the middle generation: left to the reclaim, a minute of
    them took tens of megabytes of Python's heap, which stayed resident (its arenas part-used)
    after they were freed. So cyclic garbage is held at most GEN2_EVERY ticks, or RECLAIM_S
    when it was frozen alive by a reclaim.

    After each collection of the oldest generation the C allocator hands its free pages back
    to the system (`trim`: glibc's `malloc_trim`; a few milliseconds, the GIL released). The
    engine thread's NumPy arrays (with real compute, each request's contiguous K/V, grown as
    it runs) come and go in many sizes, and the free space they leave between live blocks of
    the heap stays resident otherwise.
    """

    RECLAIM_S = 60.0
    GEN1_EVERY = 5  # frame ticks between collections of the middle generation
    GEN2_EVERY = 75  # frame ticks between collections of the oldest (what came since a freeze)

    def __init__(self) -> None:
        self._ticks = 0
        self.trim = heap_trimmer()
        self._partial = False  # a collection of the oldest generation that leaves it unfrozen

    def start(self) -> None:
        # (one dashboard a process: a heap never stopped, its app gone without unmounting, would
        # freeze alive what this one's tick collections leave unfrozen)
        for cb in list(gc.callbacks):
            if getattr(cb, "__func__", None) is FrozenHeap._collected:
                cb.__self__.stop()  # (its thresholds back, then this one's saved)
        self._thresholds = gc.get_threshold()
        gc.set_threshold(0, *self._thresholds[1:])
        gc.collect()  # (start-up's garbage is not frozen)
        gc.freeze()
        gc.callbacks.append(self._collected)

    def between_frames(self) -> None:
        self._ticks += 1
        if self._ticks % self.GEN2_EVERY:
            gc.collect(1 if self._ticks % self.GEN1_EVERY == 0 else 0)
            return
        self._partial = True
        try:
            gc.collect(2)
        finally:
            self._partial = False
        self._trim()

    def _collected(self, phase: str, info: dict) -> None:
        if phase == "stop" and info["generation"] == 2 and not self._partial:
            gc.freeze()

    def reclaim(self) -> None:
        gc.unfreeze()
        gc.collect()  # (freezes what survives, through `_collected`)
        self._trim()

    def _trim(self) -> None:
        if self.trim is not None:
            self.trim(0)

    def stop(self) -> None:
        if self._collected in gc.callbacks:
            gc.callbacks.remove(self._collected)
            gc.set_threshold(*self._thresholds)
        gc.unfreeze()  # (an app run in-process, as the tests do, leaves nothing frozen behind)


def guarded(action):
    """An action whose failure is shown on screen instead of ending the session."""
    @functools.wraps(action)
    def run(self, *args, **kwargs):
        try:
            return action(self, *args, **kwargs)
        except Exception as e:  # noqa: BLE001 - shown; the session goes on
            self.action_failed(action.__name__, e)
    return run


class Dashboard(App[int]):
    """The servesim dashboard over one engine or one deployment of several (`sim.Cluster`:
    its instances get a row each, the queues and the event log say where each request is),
    live or through a replayer (`--replay`)."""

    CSS_PATH = str(Path(__file__).with_name("dashboard.tcss"))  # (whichever module subclasses it)
    TITLE = "servesim"
    ENABLE_COMMAND_PALETTE = False
    BINDINGS = keymap.APP_BINDINGS
    FRAME_HZ = 15
    CHART_HZ = 4
    CHART_WINDOW_S = 10.0
    EVENTS_AT_START = 200

    def __init__(self, engine: Engine | None = None, *, replayer=None,
                 replay_name: str | None = None, speed: float = 1.0, paused: bool = False,
                 log_dir: str | Path = ".", driver=None, spool: bool = True) -> None:
        """`driver`: what moves the engine's clock, when not an `EngineDriver` of its own
        (`servesim serve --tui`: the HTTP server's, with the same methods). `spool`: keep a
        live session's events on disk as it runs (`sim.session.spool`), not in memory."""
        super().__init__()
        self.replayer = replayer
        self.engine: Engine = replayer.engine if replayer is not None else engine
        self.driver = driver or EngineDriver(replayer or engine, self.engine, speed, paused)
        self.replay_name = replay_name
        ex = self.engine.executor
        self.compute = f"{ex.name} on {ex.device}" if ex is not None else "none (modeled)"
        self.log_dir = Path(log_dir).resolve()
        self.selected_id: int | None = None
        self.snap = None
        self.url: str | None = None  # shown in the header (`servesim serve`)
        self._flash: tuple[str, float] | None = None  # the header's feedback, and when
        self.heap = FrozenHeap()
        self._frames = 0  # frame timer ticks (`_frame_tick`)
        self.clustered = hasattr(self.engine, "instances")
        self._event_i = max(0, len(self.engine.events) - self.EVENTS_AT_START)
        self._event_at: dict[int, int] = {}  # a deployment's: events listed, per stream
        self._tags: list[str] = []
        if self.clustered:
            for i, events in self.engine.tagged_events():
                self._event_at[i] = max(0, len(events) - self.EVENTS_AT_START)
        self._chart_key = None
        self._ttft: dict[int, float | None] = {}  # each instance's rolling TTFT p50, ms
        self._table: RequestTable | None = None
        self._error_shown = False
        self.main_screen = None  # the screen the panels are on (set on mount)
        self.recovery: str | None = None  # where an unexpected error saved the session
        self._failures = 0
        try:  # exports go here, or to the temporary directory when it cannot be written
            check_writable(self.log_dir / ".servesim-export-probe")
            self._export_note = None
        except ServesimError as e:
            self._export_note = f"{e}; session logs go to {tempfile.gettempdir()}"
            self.log_dir = Path(tempfile.gettempdir())
        # (unnamed files beside the exports)
        self.spool = (Spool(self.engine, dir=str(self.log_dir))
                      if spool and replayer is None else None)

    # --- composition ---------------------------------------------------------------------------
    def compose(self) -> ComposeResult:
        yield StatusHeader(id="header")
        with Horizontal(id="body"):
            with Vertical(id="queues"):
                yield RequestTable("running")
                yield RequestTable("waiting")
                yield RequestTable("recent")
            with Vertical(id="right"):
                yield InstanceRows(id="instances")
                yield BlockMap(id="kv")
                yield Charts(self.CHART_WINDOW_S, id="charts")
        yield EventLog(id="events")
        yield Footer(compact=True)

    def on_mount(self) -> None:
        # The panels live on the main screen; `query_one` would search a dialog when one is open.
        self.main_screen = self.screen
        self.header = self.query_one(StatusHeader)
        self.tables = {t.kind: t for t in self.query(RequestTable)}
        self.block_map = self.query_one(BlockMap)
        self.charts = self.query_one(Charts)
        self.event_log = self.query_one(EventLog)
        self.instance_rows = self.query_one(InstanceRows)
        self.instance_rows.display = self.clustered
        if self.clustered:
            with self.driver.lock:
                self._tags = instance_tags(self.engine.snapshot().instances)
            for table in self.tables.values():
                table.set_tags(self._tags)
        self._fit(self.size.width, self.size.height)
        self.refresh_frame()
        self.sample_charts()
        self.tables["running"].focus_quietly()  # nothing is selected until the user moves
        self.set_interval(1 / self.FRAME_HZ, self._frame_tick)
        self.set_interval(1 / self.CHART_HZ, self.sample_charts)
        if self.spool is not None:
            self.set_interval(1.0, self.spool_events)
        if self._export_note:
            self._note(self._export_note)
        self._signals = []  # SIGTERM and SIGHUP quit as `q` does, so the terminal is restored
        for sig in stop_signals():
            try:
                asyncio.get_running_loop().add_signal_handler(sig, self._terminated, sig)
                self._signals.append(sig)
            except (NotImplementedError, RuntimeError, ValueError):  # not the main thread
                break
        self.heap.start()
        self.set_interval(self.heap.RECLAIM_S, self.heap.reclaim)
        self.driver.start()

    def on_unmount(self) -> None:
        try:
            self.driver.stop()
        finally:
            self.heap.stop()
        for sig in getattr(self, "_signals", ()):
            try:
                asyncio.get_running_loop().remove_signal_handler(sig)
            except (RuntimeError, ValueError):
                pass

    def _terminated(self, signum: int) -> None:
        self.driver.stop(wait_s=0.5)
        self.exit(return_code=128 + signum)

    # --- failures ------------------------------------------------------------------------------
    def action_failed(self, name: str, error: Exception) -> None:
        """An action (or a refresh) raised: say so and go on."""
        self._failures += 1
        what = str(error) if isinstance(error, ServesimError) else f"{type(error).__name__}: {error}"
        if self._failures <= 20:  # a refresh failing every frame would flood the screen
            self.notify(f"{name.removeprefix('action_')} failed: {what}", severity="error",
                        timeout=10)
        try:
            self._note(f"{name.removeprefix('action_')} failed: {what}")
        except Exception:  # noqa: BLE001 - the event log itself may be what failed
            pass

    def _handle_exception(self, error: Exception) -> None:
        """An error nothing handled ends the app (Textual's rule); first save the session."""
        self.recovery = self.save_recovery()
        super()._handle_exception(error)

    def save_recovery(self) -> str:
        """Write the session log to a recovery file. Returns where, or why it could not."""
        self.driver.stop(wait_s=1.0)
        got = self.driver.lock.acquire(timeout=2.0)
        try:
            return str(self._write_new_log("recovery"))
        except Exception as e:  # noqa: BLE001 - reported in the exit message instead
            return f"(not saved: {type(e).__name__}: {e})"
        finally:
            if got:
                self.driver.lock.release()

    def _log_records(self):
        """The session's event records for `write_log`: the spool's (the file's, then those in
        memory), or None when the engine's lists hold them all."""
        return self.spool.records() if self.spool else None

    def _write_new_log(self, kind: str) -> Path:
        """Write the session log under a name no other file has (two exports within one
        second get -2, -3, ...). Returns its path."""
        stamp = _dt.datetime.now().strftime("%Y%m%d-%H%M%S")
        # the scenario's name is the user's text: in a file name only its plain characters
        name = re.sub(r"[^A-Za-z0-9._-]+", "_", self.engine.scenario.name)[:48].strip(".") or "x"
        base = f"servesim-{name}-{kind + '-' if kind else ''}{stamp}"
        for n in range(1, 1000):
            path = self.log_dir / (f"{base}.msgpack" if n == 1 else f"{base}-{n}.msgpack")
            try:
                return write_log(path, self.engine, exclusive=True, records=self._log_records())
            except FileExistsError:
                continue
        raise ServesimError(f"{self.log_dir}: no free name for {base}.msgpack")

    def on_resize(self, event: events.Resize) -> None:
        self._fit(event.size.width, event.size.height)

    def _fit(self, width: int, height: int) -> None:
        """Small terminals: narrower queues, no event log, one-row charts."""
        screen = self.main_screen or self.screen  # a resize can come before the mount
        screen.set_class(width < 110, "-narrow")
        screen.set_class(height < 34, "-short")

    # --- refresh -------------------------------------------------------------------------------
    # While the engine runs behind its clock (real compute on a busy CPU), the timer draws only
    # every LAGGING_FRAME_DIVISOR-th frame: drawing takes the CPU and the GIL that the engine
    # needs to catch up. Key actions still draw at once.
    LAGGING_S = 0.25
    LAGGING_FRAME_DIVISOR = 3

    def _frame_tick(self) -> None:
        self._frames += 1
        self.heap.between_frames()
        if self.driver.lag > self.LAGGING_S and self._frames % self.LAGGING_FRAME_DIVISOR:
            return
        self.refresh_frame()

    @guarded
    def refresh_frame(self) -> None:
        """Snapshot the engine and hand the pieces to the panels."""
        if not self.is_running:  # a tick that lands while the app shuts down
            return
        d = self.driver
        # Skip the tick rather than wait while the worker is inside a slow (real-compute) step:
        # the screen keeps its last frame and the keys stay live.
        if not d.lock.acquire(timeout=0.02):
            return
        try:
            # (a deployment's queue is its instances' queues one after another: all of it)
            snap = self.engine.snapshot(waiting_limit=None if self.clustered
                                        else self.tables["waiting"].rows_wanted())
            if self.clustered:
                new_events = []
                for i, events in self.engine.tagged_events():
                    new_events += [(i, e) for e in events[self._event_at[i]:]]
                    self._event_at[i] = len(events)
            else:
                new_events = self.engine.events[self._event_i:]
                self._event_i += len(new_events)
            info = HeaderInfo(self.engine.scenario.name, snap.policy, self.compute, snap.now,
                              snap.step, d.speed, d.paused, d.lag, self.replay_name, d.finished,
                              d.achieved, self._header_note(), self.url,
                              snap.load)
            error = d.error
        finally:
            d.lock.release()
        self.snap = snap
        self.header.show(info)
        for kind, rows in (("running", snap.running), ("waiting", snap.waiting),
                           ("recent", snap.recent)):
            self.tables[kind].update_rows(rows, snap.now,
                                          snap.num_waiting if kind == "waiting" else None)
        self.block_map.show(snap, self.selected_id)
        if self.clustered:
            self.instance_rows.show(snap, self._ttft)
            self.event_log.add_tagged(new_events, self._tags)
        else:
            self.event_log.add_events(new_events)
        if error and not self._error_shown:
            self._error_shown = True
            self.notify(f"the engine stopped: {error}", severity="error", timeout=30)

    @guarded
    def sample_charts(self) -> None:
        """One `sim.rolling` sample, when the simulated clock has moved since the last."""
        if not self.is_running or not self.driver.lock.acquire(timeout=0.02):
            return
        try:
            key = (self.engine.now, self.engine.step_count)
            if key == self._chart_key:
                return
            self._chart_key = key
            sample_ = rolling(self.engine, self.CHART_WINDOW_S)
            preemptions = self.engine.counts["preemptions"]
            if self.clustered:  # each instance's own TTFT, for its row
                self._ttft = {i: rolling(e, self.CHART_WINDOW_S)["ttft_p50_ms"]
                              for i, e in enumerate(self.engine.instances)}
        finally:
            self.driver.lock.release()
        self.charts.add_sample(sample_, preemptions)

    @guarded
    def spool_events(self) -> None:
        """Move all but the latest events to the spool on disk; the event log's places in the
        engine's lists move with them."""
        if not self.is_running or not self.driver.lock.acquire(timeout=0.02):
            return
        before = dict(self.spool.spooled)
        try:
            self.spool.trim(self._unread_events())
        finally:  # (what moved, if the spool failed part way too)
            for stream, n in self.spool.spooled.items():
                self._events_moved(stream, n - before.get(stream, 0))
            self.driver.lock.release()

    def _unread_events(self) -> int:
        """Latest events another reader of the engine's lists has yet to see (kept in memory)."""
        return 0

    def _events_moved(self, stream, n: int) -> None:
        """`n` events left the start of `stream`'s list for the spool: places in it move."""
        if stream is None:
            self._event_i = max(0, self._event_i - n)
        else:
            self._event_at[stream] = max(0, self._event_at[stream] - n)

    def on_request_table_want_rows(self, message: RequestTable.WantRows) -> None:
        self.refresh_frame()

    @guarded
    def on_request_table_highlighted(self, message: RequestTable.Highlighted) -> None:
        # Only the user's moves arrive here (see RequestTable): that request is the selection.
        self._table = message.table
        self.selected_id = message.req_id
        if self.snap is not None:
            self.block_map.show(self.snap, self.selected_id)

    # Feedback on an action: a line in the event log, and for FLASH_S seconds in the header while
    # the event log is hidden (a short terminal).
    FLASH_S = 4.0

    def _note(self, text: str) -> None:
        self.event_log.add_note(self.engine.now, text)
        self.flash(text)

    def flash(self, text: str) -> None:
        """Say `text` in the header (while the event log is hidden), for FLASH_S seconds."""
        self._flash = (text, time.monotonic())  # (drawn by the caller's or the next refresh)

    def _tell(self, text: str, **kw) -> None:
        """A notification that the header repeats while the event log is hidden."""
        self.notify(text, **kw)
        self.flash(text)

    def _header_note(self) -> str | None:
        if self._flash is None or self.event_log.display:
            return None
        text, at = self._flash
        return text if time.monotonic() - at < self.FLASH_S else None

    def _changed(self) -> None:
        """After an action: draw its effect now rather than at the next tick."""
        self.refresh_frame()
        self.sample_charts()

    # --- actions -------------------------------------------------------------------------------
    def _read_only(self) -> bool:
        if self.replayer is not None:
            self._tell("replay: the session is read-only (inject, cancel and policy keys are "
                        "off)", severity="warning")
            return True
        return False

    def draw_lengths(self) -> tuple[int, int]:
        """Prompt and output lengths from the scenario's workload, seeded by the count of
        injections so far (a session's `i` presses draw the same lengths every run)."""
        sc = self.engine.scenario
        rng = np.random.default_rng([sc.seed, INJECT_STREAM, self.engine.counts["injected"]])
        prompt, output = sample_lengths(sc, 1, rng)
        return int(prompt[0]), int(output[0])

    def inject(self, spec: InjectSpec) -> str | None:
        """Inject through the engine. Returns the engine's error message, or None (an
        unexpected error too is returned, and shown, rather than ending the session)."""
        with self.driver.lock:
            try:
                self.engine.inject(spec.prompt_len, spec.max_output_tokens,
                                   priority=spec.priority, prompt_text=spec.prompt_text,
                                   count=spec.count)
            except ServesimError as e:
                return str(e)
            except Exception as e:  # noqa: BLE001 - shown; the session goes on
                self.action_failed("inject", e)
                return f"{type(e).__name__}: {e}"
            self._flash_action()
        self._changed()
        return None

    def _flash_action(self) -> None:
        """Flash the user action the engine just recorded, as the event log words it."""
        if self.engine.events and self.engine.events[-1].kind == "action":
            self.flash(describe(self.engine.events[-1]))

    @guarded
    def action_help(self) -> None:
        self.push_screen(HelpScreen())

    def _drawn_spec(self, count: int = 1) -> InjectSpec:
        with self.driver.lock:
            prompt, output = self.draw_lengths()
        return InjectSpec(prompt, None, output, count=count)

    @guarded
    def action_inject(self) -> None:
        if not self._read_only():
            self.inject(self._drawn_spec())

    @guarded
    def action_inject_dialog(self) -> None:
        if not self._read_only():
            self.push_screen(InjectDialog(self.inject, self._drawn_spec()))

    @guarded
    def action_burst(self) -> None:
        if not self._read_only():
            self.inject(self._drawn_spec(keymap.BURST_SIZE))

    @guarded
    def action_cancel(self) -> None:
        if self._read_only():
            return
        if self.selected_id is None:
            self._tell("no request selected (use the arrow keys in a queue)", severity="warning")
            return
        target, self.selected_id = self.selected_id, None  # one cancel per selection
        with self.driver.lock:
            try:
                self.engine.cancel(target)
            except ServesimError as e:
                self._tell(str(e), severity="warning")
                return
            self._flash_action()
        self._changed()

    @guarded
    def action_cancel_waiting(self) -> None:
        if self._read_only():
            return
        with self.driver.lock:
            ids = self.engine.cancel_waiting()
        self._tell(f"cancelled {len(ids)} waiting requests")
        self._changed()

    @guarded
    def action_pause(self) -> None:
        d = self.driver
        d.set_paused(not d.paused)
        self._note("paused" if d.paused else "resumed")
        self.refresh_frame()

    @guarded
    def action_step(self) -> None:
        d = self.driver
        if not d.paused:
            d.set_paused(True)
            self._note("paused")
        d.step()
        self._changed()

    def _set_speed(self, speed: float) -> None:
        self.driver.set_speed(speed)
        self._note(f"speed x{self.driver.speed:g}")
        self.refresh_frame()

    @guarded
    def action_faster(self) -> None:
        self._set_speed(self.driver.speed * 2)

    @guarded
    def action_slower(self) -> None:
        self._set_speed(self.driver.speed / 2)

    @guarded
    def action_next_instance(self) -> None:
        """Show the next instance's KV blocks (a deployment of several)."""
        if not self.clustered:
            self._tell("one engine: there is no other instance", severity="warning")
            return
        with self.driver.lock:
            e = self.engine
            e.focus = (e.focus + 1) % len(e.instances)
            self._note(f"KV block map: instance {self._tags[e.focus]}")
        self._changed()

    @guarded
    def action_cycle_policy(self) -> None:
        if self._read_only():
            return
        # (a disaggregated pair's instances grow block tables as they go: no contiguous)
        names = [n for n in POLICIES
                 if not (getattr(self.engine, "disaggregated", False) and n == "contiguous")]
        with self.driver.lock:
            current = self.engine.policy.name
            new = names[(names.index(current) + 1) % len(names)]
            self.engine.switch_policy(new)
        self._tell(f"policy {current} -> {new} (from the next step)")
        self._changed()

    @guarded
    def action_export(self) -> None:
        with self.driver.lock:
            try:
                path = self._write_new_log("")
            except ServesimError as e:
                self._tell(str(e), severity="error", timeout=10)
                return
        self._note(f"session log written to {path}")
        self.notify(f"session log written to {path}", timeout=10)

    async def action_quit(self) -> None:
        self.driver.stop(wait_s=0.5)
        self.exit(0)


def live_engine(scenario, make_executor=None):
    """The engine (or deployment) a live dashboard runs on `scenario`: one that keeps no
    history (`keep_history=False`), so its memory follows what is in flight and the last
    `Engine.ROLLING_S` simulated seconds the charts read, not how long the session has run.
    The panels read only live requests, the engine's `recent` ones and `sim.rolling`; the
    summary an export carries is the same either way. Raises ScenarioError (`sim.build`)."""
    return build(scenario, make_executor=make_executor, keep_history=False)


def run_dashboard(scenario, *, speed: float = 1.0, replay: str | None = None,
                  make_executor=None) -> int:
    """Open the dashboard on `scenario` (or play the session log `replay` back). Returns the
    exit code. Raises ServesimError (a log that does not load, a backend that is missing)."""
    if replay:
        app = Dashboard(replayer=Replayer(read_log(replay)), replay_name=Path(replay).name,
                        speed=speed)
    else:
        app = Dashboard(live_engine(scenario, make_executor), speed=speed)
    try:
        app.run()
    finally:
        app.driver.stop()
    if app.recovery is not None:  # after Textual's own report of the error
        print(f"servesim: the dashboard stopped on an unexpected error; the session log was "
              f"saved to {app.recovery}", file=sys.stderr)
    return app.return_code or 0
