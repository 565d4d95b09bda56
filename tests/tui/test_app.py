"""The dashboard, driven through Textual's pilot: every key acts on the engine through its public
API, the screen is deterministic while paused (snapshots), and the worker thread stops at exit."""

from __future__ import annotations

import asyncio
import functools
import gc
import math
import os
import signal
import weakref
from collections import deque

import numpy as np
import pytest

from sim import POLICIES, Engine, build, load_scenario, summarize
from sim.session.log import decode, read_log, write_log
from sim.session.replay import Replayer, verify
from sim.session.spool import KEEP
from tui import keymap
from tui.app import Dashboard, FrozenHeap
from tui.driver import EngineDriver
from tui.widgets import HeaderInfo, HelpScreen, InjectDialog, RequestTable, StatusHeader
from tui.widgets import eventlog
from tui.widgets.inject_dialog import BadValue, parse_inject

SIZE = (120, 40)


def pilot_test(fn):
    """Run an async pilot test in its own event loop (no asyncio plugin needed)."""
    @functools.wraps(fn)
    def run(*args, **kwargs):
        return asyncio.run(fn(*args, **kwargs))
    return run


async def until(pilot, cond, timeout: float = 30.0) -> None:
    """Lets the app run until `cond()` holds. The bound only guards against a hang: a fixed
    pause (0.3 s) or a short bound (5 s) could run out on a loaded machine."""
    for _ in range(int(timeout / 0.02)):
        if cond():
            return
        await pilot.pause(0.02)
    raise AssertionError("condition not reached")


def make_engine(until: float = 20.0) -> Engine:
    # (the snapshots show figures of the single roofline's clock)
    sc = load_scenario("chat", ["kv.num_blocks=1500", "workload.duration_s=60",
                                'engine.preset="roofline"'])
    engine = Engine(sc)
    engine.run_until(until)
    return engine


def make_app(tmp_path=None, **kw) -> Dashboard:
    kw.setdefault("paused", True)
    return Dashboard(make_engine(), log_dir=tmp_path or ".", **kw)


def waiting_ids(engine: Engine) -> list[int]:
    return [r.req_id for r in engine.snapshot().waiting]


@pytest.mark.parametrize("key, count", [("i", 1), ("b", keymap.BURST_SIZE)])
@pilot_test
async def test_inject_keys_add_waiting_requests(key, count):
    app = make_app()
    async with app.run_test(size=SIZE) as pilot:
        before = set(waiting_ids(app.engine))
        await pilot.press(key)
        new = set(waiting_ids(app.engine)) - before
        assert len(new) == count == app.engine.counts["injected"]
        assert all(app.engine.get(i).prompt_len >= 1 for i in new)


@pilot_test
async def test_inject_draws_the_same_lengths_every_session():
    drawn = []
    for _ in range(2):
        app = make_app()
        async with app.run_test(size=SIZE) as pilot:
            await pilot.press("i", "i")
            reqs = [app.engine.get(i) for i in sorted(app.engine.requests)[-2:]]
            drawn.append([(r.prompt_len, r.max_output_tokens) for r in reqs])
    assert drawn[0] == drawn[1]
    assert drawn[0][0] != drawn[0][1]  # each press draws anew


@pilot_test
async def test_cancel_frees_exactly_the_blocks_the_selected_request_held():
    app = make_app()
    async with app.run_test(size=SIZE) as pilot:
        await pilot.press("down")  # the second running request
        snap = app.engine.snapshot()
        target = snap.running[1].req_id
        assert app.selected_id == target
        held = set(np.flatnonzero(snap.block_owner == target).tolist())
        assert held and not (snap.block_refs[list(held)] > 1).any()
        await pilot.press("c")
        after = app.engine.snapshot()
        assert after.used_blocks == snap.used_blocks - len(held)
        freed = set(np.flatnonzero((snap.block_owner >= 0) & (after.block_owner < 0)).tolist())
        assert freed == held
        assert app.engine.get(target).state.value == "cancelled"
        assert after.recent[0].req_id == target


@pilot_test
async def test_cancel_all_waiting():
    app = make_app()
    async with app.run_test(size=SIZE) as pilot:
        assert waiting_ids(app.engine)
        running = [r.req_id for r in app.engine.snapshot().running]
        await pilot.press("C")
        assert waiting_ids(app.engine) == []
        assert [r.req_id for r in app.engine.snapshot().running] == running


@pilot_test
async def test_pause_stops_the_clock_and_n_runs_exactly_one_step():
    app = make_app(paused=False, speed=4.0)
    async with app.run_test(size=SIZE) as pilot:
        t0 = app.engine.now
        await until(pilot, lambda: app.engine.now > t0)  # running
        await pilot.press("space")
        assert app.driver.paused
        now, step = app.engine.now, app.engine.step_count
        await pilot.pause(0.3)
        assert (app.engine.now, app.engine.step_count) == (now, step)
        await pilot.press("n")
        assert app.engine.step_count == step + 1
        await pilot.pause(0.2)
        assert app.engine.step_count == step + 1
        await pilot.press("space")
        assert not app.driver.paused


@pilot_test
async def test_speed_keys_double_and_halve():
    app = make_app()
    async with app.run_test(size=SIZE) as pilot:
        await pilot.press("plus", "plus")
        assert app.driver.speed == 4.0
        await pilot.press("minus", "minus", "minus")
        assert app.driver.speed == 0.5


@pytest.mark.parametrize("speed", [1.0, 8.0])
def test_the_target_clock_moves_at_speed(speed):
    engine = make_engine(5.0)
    d = EngineDriver(engine, engine, speed=speed)
    t0 = d.target
    behind = d.advance(0.25)  # a quarter of a wall second
    assert d.target == pytest.approx(t0 + 0.25 * speed)
    while behind:  # slices, the clock standing still, until the engine has caught up
        behind = d.advance(0.0)
    assert d.target == pytest.approx(t0 + 0.25 * speed)
    assert engine.now >= d.target


@pilot_test
async def test_p_cycles_the_policy():
    app = make_app()
    names = list(POLICIES)
    async with app.run_test(size=SIZE) as pilot:
        first = app.engine.policy.name
        await pilot.press("p")
        assert app.engine.policy.name == names[(names.index(first) + 1) % len(names)]
        assert app.engine.events[-1].action == "switch_policy"


def transitions(events) -> list[dict]:
    """Every event but the engine steps (which a log may store as merged runs)."""
    return [e.to_dict() for e in events if e.kind != "steps"]


def steps_covered(events) -> int:
    return sum(len(e.ends) for e in events if e.kind == "steps")


@pilot_test
async def test_export_writes_a_log_that_loads_and_replays(tmp_path):
    app = make_app(tmp_path)
    async with app.run_test(size=SIZE) as pilot:
        await pilot.press("i", "b", "n", "n", "down", "c", "p", "n", "e")
        await pilot.pause()
        logs = list(tmp_path.glob("*.msgpack"))
        assert len(logs) == 1
        recorded = [decode(r, check=False) for r in app.spool.records()]  # (some on disk)
        step, now = app.engine.step_count, app.engine.now
    log = read_log(logs[0])
    assert transitions(log.events) == transitions(recorded)
    assert steps_covered(log.events) == steps_covered(recorded) == step
    assert [e.kind for e in log.events].count("action") == 4
    replayer = Replayer(log)
    replayer.run_until(now + 1.0)
    assert replayer.done
    assert (replayer.engine.step_count, replayer.engine.now) == (step, now)
    assert transitions(replayer.engine.events) == transitions(recorded)


@pilot_test
async def test_inject_dialog_rejects_bad_values_inline_and_stays_open():
    app = make_app()
    async with app.run_test(size=SIZE) as pilot:
        await pilot.press("I")
        dialog = app.screen
        assert isinstance(dialog, InjectDialog)
        for field, bad in (("prompt-tokens", "abc"), ("prompt-tokens", "-5"),
                           ("output-tokens", "0"), ("count", "1e9")):
            dialog.query_one(f"#{field}").value = bad
            await pilot.press("enter")
            assert app.screen is dialog
            assert field.split("-")[0] in str(dialog.query_one("#inject-error").render())
            dialog.query_one(f"#{field}").value = {"count": "1"}.get(field, "64")
        n = len(waiting_ids(app.engine))
        dialog.query_one("#prompt-tokens").value = "100"
        dialog.query_one("#count").value = "3"
        await pilot.click("#inject-ok")
        await pilot.pause()
        assert app.screen is not dialog
        waiting = app.engine.snapshot().waiting
        assert len(waiting) == n + 3
        assert [r.prompt_len for r in waiting[-3:]] == [100] * 3


def test_parse_inject_takes_a_typed_prompt_for_its_length():
    spec = parse_inject({"prompt-tokens": "", "prompt-text": "hello", "output-tokens": "4",
                         "priority": "-1", "count": "2"})
    assert (spec.prompt_len, spec.prompt_text, spec.priority, spec.count) == (None, "hello",
                                                                               -1, 2)
    with pytest.raises(BadValue, match="prompt tokens"):
        parse_inject({"prompt-tokens": "", "prompt-text": "", "output-tokens": "4"})


@pilot_test
async def test_replay_plays_back_and_refuses_changes(tmp_path):
    engine = make_engine(2.0)
    engine.inject(300, 20, count=4)
    engine.run_until(4.0)
    path = write_log(tmp_path / "s.msgpack", engine)
    app = Dashboard(replayer=Replayer(read_log(path)), replay_name="s.msgpack", paused=True)
    notes = []
    app.notify = lambda message, **kw: notes.append(message)
    async with app.run_test(size=SIZE) as pilot:
        await pilot.press("i", "c", "p")
        assert app.engine.counts["injected"] == 0
        assert len(notes) == 3 and all("read-only" in n for n in notes)
        await pilot.press("n")
        assert app.engine.step_count == 1
        await pilot.press("space")
        await until(pilot, lambda: app.engine.now > 0)
        assert app.engine.now <= engine.now


@pilot_test
async def test_help_lists_every_key_and_closes():
    app = make_app()
    async with app.run_test(size=SIZE) as pilot:
        await pilot.press("question_mark")
        assert isinstance(app.screen, HelpScreen)
        text = str(app.screen.query_one("#help-keys").render())
        for k in keymap.APP_KEYS + keymap.TABLE_KEYS:
            assert k.help in text
        await pilot.press("escape")
        assert not isinstance(app.screen, HelpScreen)


@pilot_test
async def test_queues_navigate_and_the_worker_stops_at_exit():
    app = make_app()
    async with app.run_test(size=SIZE) as pilot:
        assert isinstance(app.focused, RequestTable) and app.focused.id == "running"
        await pilot.press("right")
        assert app.focused.id == "waiting"
        assert app.selected_id == app.engine.snapshot().waiting[0].req_id
        await pilot.press("end")
        assert app.selected_id == app.engine.snapshot().waiting[-1].req_id
        assert app.driver.alive
    assert not app.driver.alive


# --- snapshots (a seeded engine, paused: nothing drawn depends on the wall clock) --------------
def test_snapshot_main_screen(snap_compare):
    assert snap_compare(make_app(), terminal_size=SIZE, press=["n", "n", "n", "down"])


def test_snapshot_main_screen_80x24(snap_compare):
    assert snap_compare(make_app(), terminal_size=(80, 24), press=["n"])


def test_snapshot_help_screen(snap_compare):
    assert snap_compare(make_app(), terminal_size=SIZE, press=["question_mark"])


# --- the session is never lost -----------------------------------------------------------------
def notes_of(app) -> list[str]:
    notes = []
    app.notify = lambda message, **kw: notes.append(message)
    return notes


@pilot_test
async def test_c_cancels_only_a_request_the_user_selected():
    app = make_app()
    notes = notes_of(app)
    async with app.run_test(size=SIZE) as pilot:
        cancelled = lambda: app.engine.counts["cancelled"]  # noqa: E731
        await pilot.press("c")  # nothing selected yet, though a queue has the focus
        assert cancelled() == 0 and "no request selected" in notes[-1]
        await pilot.press("down")
        chosen = app.selected_id
        await pilot.press("c")
        assert cancelled() == 1 and app.engine.get(chosen).state.value == "cancelled"
        await pilot.press("c")  # the cursor now rests on a neighbour: not selected
        assert cancelled() == 1 and "no request selected" in notes[-1]
        # a selected request that leaves its queue stays the selection; the row the cursor
        # falls onto is never cancelled in its place
        await pilot.press("right")
        chosen = app.selected_id
        with app.driver.lock:
            app.engine.run_until(app.engine.now + 30)
        app.refresh_frame()
        await pilot.pause()
        await pilot.press("c")
        gone = app.engine.get(chosen).state.value
        assert cancelled() == (2 if gone == "cancelled" else 1)


@pilot_test
async def test_an_export_stays_in_its_directory_whatever_the_scenario_is_called(tmp_path):
    app = make_app(tmp_path)
    app.engine.scenario.name = "../../escape/\n evil" + "x" * 300
    async with app.run_test(size=SIZE) as pilot:
        await pilot.press("e")
        await pilot.pause()
    [log] = tmp_path.iterdir()
    assert log.name.startswith("servesim-_.._escape_evilxxx") and len(log.name) < 100
    assert read_log(log).footer["step"] == app.engine.step_count


@pilot_test
async def test_two_exports_in_one_second_keep_both(tmp_path):
    app = make_app(tmp_path)
    async with app.run_test(size=SIZE) as pilot:
        await pilot.press("e", "n", "e")
        await pilot.pause()
    logs = sorted(tmp_path.glob("*.msgpack"))
    assert len(logs) == 2
    assert [read_log(p).footer["step"] for p in logs] != [None, None]
    assert {read_log(p).footer["step"] for p in logs} == {app.engine.step_count - 1,
                                                          app.engine.step_count}


@pilot_test
async def test_an_injection_past_any_bound_is_refused_and_the_session_still_exports(tmp_path):
    app = make_app(tmp_path)
    async with app.run_test(size=SIZE) as pilot:
        await pilot.press("I")
        dialog = app.screen
        dialog.query_one("#prompt-tokens").value = "99999999999999999999999999999999"
        await pilot.press("enter")
        assert app.screen is dialog and "more than" in str(dialog.query_one("#inject-error").render())
        # the engine refuses what the dialog lets through, inline too
        assert "must be an integer" in app.inject(
            __import__("tui.widgets", fromlist=["InjectSpec"]).InjectSpec(2**70, None, 5))
        await pilot.press("escape", "e")
        await pilot.pause()
    [log] = tmp_path.glob("*.msgpack")
    assert read_log(log).footer["step"] == app.engine.step_count


@pilot_test
async def test_an_action_that_fails_is_shown_and_the_app_goes_on(monkeypatch):
    app = make_app()
    notes = notes_of(app)

    def broken(name):
        raise RuntimeError("the policy module is on fire")

    monkeypatch.setattr(app.engine, "switch_policy", broken)
    async with app.run_test(size=SIZE) as pilot:
        await pilot.press("p")
        assert any("cycle_policy failed: RuntimeError: the policy module is on fire" in n
                   for n in notes)
        await pilot.press("i")
        assert app.engine.counts["injected"] == 1 and app.is_running


@pilot_test
async def test_an_unexpected_error_saves_the_session_to_a_recovery_file(tmp_path, monkeypatch):
    from tui.widgets import BlockMap

    app = make_app(tmp_path)

    def crash(self, *a, **kw):
        raise RuntimeError("a drawing bug")

    with pytest.raises(RuntimeError, match="a drawing bug"):  # (the pilot re-raises it)
        async with app.run_test(size=SIZE) as pilot:
            await pilot.press("i", "n")
            step = app.engine.step_count
            monkeypatch.setattr(BlockMap, "render_line", crash)
            app.block_map.refresh()
            await pilot.pause(0.3)
    assert app.recovery is not None and "recovery" in app.recovery
    log = read_log(app.recovery)
    assert log.footer["step"] == step and [e.kind for e in log.events].count("action") == 1


@pilot_test
async def test_the_inject_dialog_is_usable_at_40x12():
    app = make_app()
    async with app.run_test(size=(40, 12)) as pilot:
        await pilot.press("I")
        dialog = app.screen
        assert isinstance(dialog, InjectDialog)
        screen = dialog.region
        for w in (*dialog.query("Input"), *dialog.query("Button")):
            r = w.region
            assert r.height >= 1 and screen.contains_region(r), (w.id, r, screen)
        n = len(waiting_ids(app.engine))
        dialog.query_one("#prompt-tokens").value = "77"
        dialog.query_one("#count").value = "2"
        await pilot.press("enter")
        await pilot.pause()
        assert app.screen is not dialog and len(waiting_ids(app.engine)) == n + 2


def test_speeds_that_would_stop_or_reverse_the_clock_are_refused():
    from sim.errors import ServesimError

    for bad in (0, -1, float("nan"), float("inf"), 1e9):
        with pytest.raises(ServesimError, match="must be a number from 1/64 to 4096"):
            Dashboard(make_engine(1.0), speed=bad)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP])  # (SIGHUP: the terminal closed)
@pilot_test
async def test_sigterm_quits_as_q_does(sig):
    app = make_app()
    previous = signal.signal(sig, lambda *a: None)  # (unhandled, not the test process's end)
    try:
        async with app.run_test(size=SIZE) as pilot:
            os.kill(os.getpid(), sig)
            await until(pilot, lambda: app.return_code is not None)
    finally:
        signal.signal(sig, previous)
    assert app.return_code == 128 + sig and not app.driver.alive


@pytest.mark.parametrize("size", [(1, 1), (12, 5), (40, 12)])
@pilot_test
async def test_every_key_works_in_a_tiny_terminal(size):
    app = make_app()
    notes = notes_of(app)
    async with app.run_test(size=size) as pilot:
        await pilot.press("n", "down", "right", "i", "b", "question_mark")
        await pilot.pause(0.05)
        await pilot.press("escape", "I")
        await pilot.pause(0.05)
        await pilot.press("escape", "r", "p", "plus", "minus", "c", "C", "space", "space")
        await pilot.pause(0.1)
        assert app.is_running and app.engine.counts["injected"] == 1 + keymap.BURST_SIZE
    assert not any("failed" in n for n in notes), notes
def test_frames_thin_out_while_the_engine_is_behind_its_clock(monkeypatch):
    app = make_app(paused=False)
    drawn = []
    monkeypatch.setattr(app, "refresh_frame", lambda: drawn.append(app.driver.lag))
    for _ in range(6):
        app._frame_tick()
    assert len(drawn) == 6  # on time: every frame
    app.driver.ideal = app.engine.now + 1.5  # 1.5 s behind
    for _ in range(6):
        app._frame_tick()
    assert len(drawn) == 6 + 6 // app.LAGGING_FRAME_DIVISOR


# --- the clock: true lag and the speed achieved --------------------------------------------------
class Crawl:
    """An engine stand-in whose clock covers `share` of the way to each target it is given."""

    def __init__(self, share: float) -> None:
        self.now, self.share = 0.0, share

    def run_until(self, target: float, max_steps: int) -> int:
        self.now += (target - self.now) * self.share
        return 1


def test_lag_is_the_true_lag_and_the_achieved_speed_is_measured():
    crawl = Crawl(0.0)  # compute that cannot move at all
    d = EngineDriver(crawl, crawl, speed=4.0)
    for _ in range(40):  # ten wall seconds, by the caller's clock
        d.advance(0.25)
    assert d.lag == pytest.approx(40.0)  # not held at BACKLOG_S x speed
    assert d.target - crawl.now <= d.BACKLOG_S * 4.0  # (the engine still only runs so far ahead)
    assert d.achieved == 0.0
    crawl.share = 1.0  # compute keeps up again: the lag is over
    d.advance(0.25)
    assert d.lag == 0.0
    for _ in range(20):
        d.advance(0.25)
    assert d.achieved == pytest.approx(4.0)
    crawl.share = 0.5
    for _ in range(20):
        d.advance(0.25)
    assert 0.0 < d.achieved < 4.0
    d.set_paused(True)
    assert d.achieved is None and d.lag == 0.0


def test_header_shows_the_achieved_speed_beside_the_asked_one_and_the_lag():
    info = HeaderInfo("chat", "chunked", "none (modeled)", 12.5, 40, 4.0, False, lag_s=40.0,
                      achieved=2.5)
    text = StatusHeader.render_info(info).plain
    assert "LAG 40.0 s" in text and "x4 got x2.5" in text
    assert "got" not in StatusHeader.render_info(
        HeaderInfo("chat", "chunked", "none", 1.0, 1, 1.0, True)).plain


@pilot_test
async def test_the_header_shows_what_drives_the_arrivals():
    sc = load_scenario("chat", ["workload.concurrency=12", "workload.num_requests=50",
                                'engine.preset="roofline"'])
    for engine, label in ((Engine(sc), "concurrency 12"), (make_engine(), "4 req/s")):
        app = Dashboard(engine, log_dir=".", paused=True)
        async with app.run_test(size=SIZE) as pilot:
            await until(pilot, lambda: app.header._shown is not None)
            assert f" · {label} · " in StatusHeader.render_info(app.header._shown).plain


def screen_text(app) -> str:
    return "\n".join(strip.text for strip in app.screen._compositor.render_strips())


@pilot_test
async def test_the_header_reads_the_drivers_speed_and_lag(monkeypatch):
    monkeypatch.setattr(EngineDriver, "start", lambda self: None)  # the test moves the clock
    app = make_app(paused=False)
    async with app.run_test(size=SIZE) as pilot:
        d = app.driver
        for _ in range(8):
            d.advance(0.125)
        app.refresh_frame()
        shown = app.header._shown
        assert shown.achieved == d.achieved and shown.achieved is not None
        d.ideal = app.engine.now + 30.0
        app.refresh_frame()
        assert "LAG 30.0 s" in screen_text(app)
        await pilot.pause()


# --- 80x24 ---------------------------------------------------------------------------------------
@pilot_test
async def test_80x24_keeps_the_clock_speed_lag_kv_scale_and_feedback(monkeypatch):
    monkeypatch.setattr(EngineDriver, "start", lambda self: None)
    app = make_app(paused=False)
    async with app.run_test(size=(80, 24)) as pilot:
        app.driver.ideal = app.engine.now + 30.0
        await pilot.press("plus")  # the event log is hidden: the header says what happened
        await pilot.pause()
        text = screen_text(app)
        header = text.splitlines()[0]
        for essential in ("LAG 30.0 s", f"t {app.engine.now:,.3f} s", "x2", "speed x2"):
            assert essential in header, (essential, header)
        assert "1 cell = " in text  # the block map's scale
        assert app.block_map.grid.group > 1
        for title in ("TTFT", "tokens", "waiting", "running", "preempt/s"):
            assert title in text, title


@pilot_test
async def test_80x24_shows_each_replicas_ttft_and_tokens():
    engine = build(load_scenario("replicas"))
    engine.run_until(10.0)
    app = Dashboard(engine, paused=True)
    async with app.run_test(size=(80, 24)) as pilot:
        await pilot.press("n")
        await pilot.pause()
        text = screen_text(app)
        assert "TTFT  tok/s" in text  # the instances' columns
        assert " tokens " in text and "TTFT" in text  # the finished queue's, ids tagged
        recent = app.tables["recent"]
        assert [c.title for c, _ in recent.fitted()][-1] == "tokens"


# --- charts --------------------------------------------------------------------------------------
@pilot_test
async def test_queue_and_preemption_charts_follow_the_engine():
    sc = load_scenario("chat", ["kv.num_blocks=300", "workload.duration_s=60",
                                'engine.preset="roofline"'])
    engine = Engine(sc)
    engine.run_until(5.0)
    app = Dashboard(engine, paused=True)
    async with app.run_test(size=SIZE) as pilot:
        app.charts.history = {k: type(v)(maxlen=v.maxlen) for k, v in app.charts.history.items()}
        app.charts._preempted = None
        seen = []
        for _ in range(16):
            with app.driver.lock:
                engine.run_until(engine.now + 1.0)
                seen.append((engine.now, len(engine.policy.waiting), len(engine.policy.running),
                             engine.counts["preemptions"]))
            app.sample_charts()
        await pilot.pause()
    h = app.charts.history
    assert list(h["waiting"]) == [w for _, w, _, _ in seen]
    assert list(h["running"]) == [r for _, _, r, _ in seen]
    rates = [(b[3] - a[3]) / (b[0] - a[0]) for a, b in zip(seen, seen[1:])]
    assert list(h["preemptions_per_s"])[1:] == pytest.approx(rates)
    assert any(rates)  # (the pool is small enough to preempt)


# --- the event log -------------------------------------------------------------------------------
@pilot_test
async def test_the_event_log_scrolls_and_holds_its_place():
    app = make_app()
    async with app.run_test(size=SIZE) as pilot:
        log = app.event_log
        for i in range(100):
            log.add_note(0.0, f"line {i}")
        app.tables["recent"].focus()
        await pilot.press("right")  # the next panel after the queues
        assert app.focused is log
        await pilot.press("home")
        assert log.scroll_offset.y == 0
        top = log.lines[0]
        log.add_note(0.0, "newer")  # scrolled up: the view stays
        assert log.scroll_offset.y == 0 and log.lines[log.scroll_offset.y] == top
        await pilot.press("down", "down", "pagedown")
        assert log.scroll_offset.y == 2 + log.scrollable_content_region.height - 1
        for i in range(eventlog.MAX_LINES):  # lines fall off the top: the view keeps its lines
            shown = log.lines[log.scroll_offset.y]
            log.add_note(0.0, f"more {i}")
            if log.scroll_offset.y == 0:
                break
            assert log.lines[log.scroll_offset.y] == shown
        await pilot.press("end")  # following again
        log.add_note(0.0, "newest")
        assert log.scroll_offset.y == log.max_scroll_y
        assert log.lines[-1][2] == "newest"


# --- the collector -------------------------------------------------------------------------------
class Cycle:
    def __init__(self) -> None:
        self.me = self


def test_full_collections_freeze_survivors_and_reclaim_frees_what_died_frozen():
    heap = FrozenHeap()
    before = gc.get_threshold()
    heap.start()
    try:
        assert gc.get_threshold()[0] == 0  # no automatic collection: only between frames
        young = Cycle()
        gone_young = weakref.ref(young)
        del young
        heap.between_frames()  # the youngest generation, at a frame tick
        assert gone_young() is None
        alive = Cycle()
        gone = weakref.ref(alive)
        gc.collect()  # a full collection: what survives is frozen, later ones do not scan it
        assert all(o is not alive for o in gc.get_objects())
        del alive
        gc.collect()
        assert gone() is not None  # died frozen: held until the reclaim
        heap.reclaim()
        assert gone() is None
    finally:
        heap.stop()
    assert gc.get_freeze_count() == 0 and heap._collected not in gc.callbacks
    assert gc.get_threshold() == before


def test_cycles_that_outlive_the_middle_generation_are_collected_between_frames():
    """Cyclic garbage that lived past a few frame ticks (Textual's strips, held by a widget for a
    while, cache themselves) reaches the oldest generation: the frame ticks' own collections of
    it free it within GEN2_EVERY ticks, not at the next reclaim, and freeze nothing (a cycle
    frozen while alive would be held until the reclaim)."""
    heap = FrozenHeap()
    heap.start()
    try:
        frozen = gc.get_freeze_count()
        lives = 2 * heap.GEN1_EVERY  # ticks each cycle is held: past the middle generation
        held: deque[Cycle] = deque()
        made = []
        for _ in range(10 * heap.GEN2_EVERY):
            held.append(Cycle())
            made.append(weakref.ref(held[-1]))
            if len(held) > lives:
                held.popleft()
            heap.between_frames()
        assert sum(r() is not None for r in made) <= heap.GEN2_EVERY + lives
        assert gc.get_freeze_count() <= frozen
    finally:
        heap.stop()


def test_a_heap_left_running_does_not_freeze_what_the_next_one_collects():
    # an app gone without unmounting (in-process, as tests run them) left its callback, which
    # froze alive, at each collection of the oldest generation, what the next heap's ticks hold
    thresholds = gc.get_threshold()
    try:
        FrozenHeap().start()
        test_cycles_that_outlive_the_middle_generation_are_collected_between_frames()
        assert gc.get_threshold() == thresholds  # (the process's own, back)
    finally:
        gc.set_threshold(*thresholds)
        gc.unfreeze()


def test_collections_of_the_oldest_generation_trim_the_c_heap():
    heap = FrozenHeap()
    trims = []
    heap.trim = trims.append  # (the allocator's call, given the bytes to keep)
    heap.start()
    try:
        for _ in range(heap.GEN2_EVERY - 1):
            heap.between_frames()
        assert trims == []
        heap.between_frames()
        assert trims == [0]
        heap.reclaim()
        assert trims == [0, 0]
    finally:
        heap.stop()


# --- a long queue --------------------------------------------------------------------------------
@pilot_test
async def test_a_long_queue_is_copied_a_screenful_at_a_time_and_end_reaches_its_last():
    engine = make_engine()
    for _ in range(500):
        engine.inject(100, 10)
    app = Dashboard(engine, paused=True)
    async with app.run_test(size=SIZE) as pilot:
        await pilot.pause()
        order = [r.req_id for r in engine.snapshot().waiting]
        table = app.tables["waiting"]
        assert len(app.snap.waiting) < 100 < len(order) == app.snap.num_waiting == table.total
        assert table.border_title == f"Waiting ({len(order)})"
        assert [r.req_id for r in table.rows] == order[:len(table.rows)]
        table.focus()
        await pilot.press("end")
        await until(pilot, lambda: app.selected_id == order[-1])
        assert table.cursor == len(order) - 1


@pilot_test
async def test_a_session_whose_events_went_to_disk_exports_whole_and_replays(tmp_path):
    app = make_app(tmp_path)
    async with app.run_test(size=SIZE) as pilot:
        n = len(app.engine.events)
        app.spool.keep = 50  # (of the KEEP it keeps in a live session)
        app.spool_events()
        assert len(app.engine.events) == 50 < KEEP and app.spool.spooled == {None: n - 50}
        assert app._event_i <= len(app.engine.events)
        await pilot.press("i", "n", "n", "e")
        await pilot.pause()
        logs = list(tmp_path.glob("*.msgpack"))
        step = app.engine.step_count
        assert len(logs) == 1 and not [p for p in tmp_path.iterdir() if p not in logs]
    log = read_log(logs[0])
    assert len(log.records) > n and log.footer["step"] == step
    assert verify(log)[1] is None



def test_the_live_dashboards_engine_holds_what_is_in_flight_not_the_session(monkeypatch):
    # `servesim run` builds an engine that keeps no history: after N simulated seconds it
    # holds the live requests and the timeline rows of the charts' window, however large N.
    from sim.engine import timeline
    from tui import app as app_module
    monkeypatch.setattr(timeline, "CHUNK", 1024)
    built = []
    monkeypatch.setattr(Dashboard, "run", lambda self: built.append(self.engine))
    app_module.run_dashboard(load_scenario("chat", ["workload.duration_s=600"]))
    [engine] = built
    for t in (100.0, 200.0, 400.0):
        engine.run_until(t)
        tl = engine.timeline
        window_rows = tl.n - tl.index(engine.now - Engine.ROLLING_S)
        assert tl.n - tl.first <= window_rows + 2 * 1024, t
        live = (len(engine.policy.running) + len(engine.policy.waiting)
                + len(engine._releasing))
        assert len(engine.requests) <= live, t
    assert engine.counts["arrived"] > 1000 and tl.n > 20 * 1024


@pilot_test
async def test_the_charts_read_a_live_engine_across_many_sealed_chunks(monkeypatch):
    from sim.engine import timeline
    from tui.app import live_engine
    monkeypatch.setattr(timeline, "CHUNK", 256)
    monkeypatch.setattr(Engine, "ROLLING_S", Dashboard.CHART_WINDOW_S)  # (rows go sooner)
    engine = live_engine(load_scenario("chat", ["kv.num_blocks=1500", "workload.duration_s=60"]))
    app = Dashboard(engine, paused=True)
    async with app.run_test(size=SIZE):
        for k in range(1, 41):
            with app.driver.lock:
                engine.run_until(k * 1.5)
            app.sample_charts()
            app.refresh_frame()
        assert app._failures == 0 and engine.timeline.first > 0
        assert not math.isnan(app.charts.history["ttft_p50_ms"][-1])


@pilot_test
async def test_a_live_session_exports_the_log_and_summary_a_full_history_would(tmp_path,
                                                                               monkeypatch):
    # The dashboard's engine keeps no history; its export is still the whole session (its
    # events partly spooled), it replays exactly, and its summary is the one an engine that
    # keeps every request and step computes over the same session.
    from sim.engine import timeline
    from tui.app import live_engine
    monkeypatch.setattr(timeline, "CHUNK", 256)
    monkeypatch.setattr(Engine, "ROLLING_S", Dashboard.CHART_WINDOW_S)
    engine = live_engine(load_scenario("chat", ["kv.num_blocks=1500", "workload.duration_s=60"]))
    app = Dashboard(engine, paused=True, log_dir=tmp_path)
    async with app.run_test(size=SIZE) as pilot:
        for k, key in enumerate(("i", "b", "p", "i")):
            with app.driver.lock:
                engine.run_until(10.0 * (k + 1))
            app.spool.keep = 50
            app.spool_events()
            await pilot.press(key)
        with app.driver.lock:
            engine.run_until(70.0)
        await pilot.press("e")
        await pilot.pause()
        [path] = list(tmp_path.glob("*.msgpack"))
        step, now = engine.step_count, engine.now
    assert engine.timeline.first > 0 and app.spool.spooled[None] > 0
    log = read_log(path)
    assert verify(log)[1] is None
    full = Replayer(log)  # (an engine that keeps its history, through the same session)
    full.run_until(now + 1.0)
    assert full.engine.keep_history and (full.engine.step_count, full.engine.now) == (step, now)
    recorded, replayed = dict(log.footer["summary"]), summarize(full.engine)
    recorded.pop("wall_s"), replayed.pop("wall_s")
    assert recorded == replayed
