"""The dashboard over a deployment of several instances: a row per instance, queues and event log
tagged with where each request is, the router's decisions listed, keys acting on the whole
deployment, and a deployment's session log played back."""

from __future__ import annotations

from sim import build, load_scenario
from sim.session.log import read_log, write_log
from sim.session.replay import Replayer, verify
from tests.tui.test_app import SIZE, pilot_test, until
from tui.app import Dashboard
from tui.widgets.queues import COLUMNS


def deployment(*overrides, until: float = 15.0):
    sc = load_scenario("chat", ["kv.num_blocks=1500", "workload.duration_s=60", *overrides])
    c = build(sc)
    c.run_until(until)
    return c


@pilot_test
async def test_replicas_side_by_side_and_routes_in_the_event_log():
    c = deployment("cluster.replicas=3", 'cluster.router="least-outstanding"')
    app = Dashboard(c, paused=True)
    async with app.run_test(size=SIZE) as pilot:
        assert app.instance_rows.display
        rows = app.instance_rows._text.plain.splitlines()
        assert len(rows) == 3 and rows[0].startswith("▶ 0 run")
        for row, e in zip(rows, c.instances):
            assert f"run {len(e.policy.running):>3} wait {len(e.policy.waiting):>3}" in row
        assert app.instance_rows.region.height == 3 + 2  # a line each, inside the border
        assert "chunked x3 (least-outstanding)" in app.instance_rows.border_title
        routes = [text for _, kind, text in app.event_log.lines if kind == "route"]
        assert routes and all("(least outstanding" in t for t in routes)
        # a queue row says where its request is
        snap = app.snap
        shown = app.tables["running"]._text(snap.running[0])[0].strip()
        assert shown == f"{snap.running[0].replica}:{snap.running[0].req_id}"
        await pilot.press("r")
        assert c.focus == 1 and app.instance_rows._text.plain.splitlines()[1].startswith("▶")
        before = c.counts["injected"]
        await pilot.press("i")
        assert c.counts["injected"] == before + 1
        rid = max(c.requests)
        assert any(kind == "route" and text.startswith(f"#{rid} ")
                   for _, kind, text in app.event_log.lines)
        assert any(text.startswith(f"{c.get(rid).replica} #{rid} arrives")
                   for _, _, text in app.event_log.lines)


@pilot_test
async def test_disaggregated_pair_shows_hand_offs():
    c = deployment('scheduler.policy="disaggregated"', "scheduler.kv_link_gbps=1")
    app = Dashboard(c, paused=True)
    async with app.run_test(size=SIZE) as pilot:
        rows = app.instance_rows._text.plain.splitlines()
        assert rows[0].lstrip("▶ ").startswith("P prefill") and "D decode" in rows[1]
        lines = [text for _, kind, text in app.event_log.lines if kind == "handoff"]
        assert any(t.startswith("D ") and "K/V transfer" in t for t in lines)
        assert any(t.startswith("P ") and "first token" in t for t in lines)
        # step until a request is between the two instances: it is listed as such
        for _ in range(200):
            if any(v.state == "transferring" for v in app.snap.running):
                break
            await pilot.press("n")
        moving = [v for v in app.snap.running if v.state == "transferring"]
        assert moving
        assert app.tables["running"]._text(moving[0])[1].strip().startswith("K/V to decode")
        # cancelling it (the user's `c` on the selected request) frees both sides
        table = app.tables["running"]
        table.focus()
        table.action_cursor_to(app.snap.running.index(moving[0]))
        await pilot.pause()
        assert app.selected_id == moving[0].req_id
        await pilot.press("c")
        assert c.get(moving[0].req_id).state.value == "cancelled"
        assert c.handoff_blocks() == [h for h in c.handoff_blocks()
                                      if h[0] != moving[0].req_id]


@pilot_test
async def test_two_prefill_and_three_decode_instances_each_get_a_row_and_r_visits_each():
    c = deployment('scheduler.policy="disaggregated"', "cluster.prefill_instances=2",
                   "cluster.decode_instances=3")
    app = Dashboard(c, paused=True)
    async with app.run_test(size=SIZE) as pilot:
        rows = app.instance_rows._text.plain.splitlines()
        assert [r.lstrip("▶ ").split()[:2] for r in rows] == [
            ["P0", "prefill"], ["P1", "prefill"], ["D2", "decode"], ["D3", "decode"],
            ["D4", "decode"]]
        assert "disaggregated 2:3" in app.instance_rows.border_title
        for row, e in zip(rows, c.instances):
            assert f"run {len(e.policy.running):>3} wait {len(e.policy.waiting):>3}" in row
        assert all(e.counts["finished"] for e in c.instances[2:])  # each decode one serves
        for i in range(1, 6):
            await pilot.press("r")
            assert c.focus == i % 5
            marked = [r for r in app.instance_rows._text.plain.splitlines() if r.startswith("▶")]
            assert marked == [app.instance_rows._text.plain.splitlines()[i % 5]]


@pilot_test
async def test_a_deployment_log_plays_back(tmp_path):
    c = deployment("cluster.replicas=2", until=5.0)
    c.inject(200, 20)
    c.run_until(8.0)
    path = write_log(tmp_path / "r.msgpack", c)
    replayer = Replayer(read_log(path))
    app = Dashboard(replayer=replayer, replay_name="r.msgpack", paused=True)
    async with app.run_test(size=SIZE) as pilot:
        for _ in range(5):
            await pilot.press("n")
        assert app.instance_rows.display and len(app.snap.instances) == 2
        app.driver.set_paused(False)
        app.driver.set_speed(64)
        await until(pilot, lambda: replayer.done)
        assert replayer.engine.position() == c.position()


def test_a_disaggregated_snapshot_lists_each_request_once_and_waits_on_its_own_clock():
    """During a hand-off a request is listed once (not also as its hand-off), and a queued
    request's wait is measured on the clock of the instance it waits on (the deployment's
    clock is the furthest-behind instance's, which can be before its arrival there)."""
    c = build(load_scenario("disaggregated", []))
    wait = next(col for col in COLUMNS["waiting"] if col.title == "wait")
    handoffs = waits = 0
    for _ in range(3000):
        c.step()
        s = c.snapshot()
        ids = [v.req_id for v in s.running]
        assert len(ids) == len(set(ids))
        handoffs += s.transferring
        for v in s.waiting:
            assert v.clock is not None and v.clock >= v.arrival_time
            assert not wait.cell(v, s.now).startswith("-")
            waits += 1
    assert handoffs > 100 and waits > 100


@pilot_test
async def test_a_deployment_whose_events_went_to_disk_lists_new_ones_and_exports_whole(tmp_path):
    c = deployment("cluster.replicas=2", until=5.0)
    app = Dashboard(c, paused=True, log_dir=tmp_path)
    async with app.run_test(size=SIZE) as pilot:
        app.spool.keep = 10  # (fewer than the 20 routing events of the deployment's own stream)
        app.spool_events()
        assert set(app.spool.spooled) == {-1, 0, 1}
        assert all(app._event_at[i] == len(events) for i, events in c.tagged_events())
        await pilot.press("n", "e")
        await pilot.pause()
        assert all(app._event_at[i] == len(events) for i, events in c.tagged_events())
        logs = list(tmp_path.glob("*.msgpack"))
    log = read_log(logs[0])
    assert verify(log)[1] is None
