"""`servesim serve --tui`: the dashboard and the HTTP server in Textual's one event loop."""

from __future__ import annotations

import asyncio
import os
import signal

import aiohttp
import pytest

from sim import load_scenario
from sim.session.log import read_log
from sim.session.replay import verify
from tui.serve.app import build_frontend
from tui.serve.dashboard import ServeDashboard
from tests.tui.test_app import pilot_test, until


async def _stream(http, url: str, n: int) -> list[bytes]:
    """A streamed completion of `n` tokens: its non-empty lines."""
    async with http.post(url, json={"prompt": "x" * 100, "max_tokens": n, "stream": True}) as r:
        assert r.status == 200
        return [line async for line in r.content if line.strip()]


@pilot_test
async def test_http_requests_on_the_dashboard_cancel_key_and_export_replays(tmp_path):
    fe = build_frontend(load_scenario("chat"))
    app = ServeDashboard(fe, "127.0.0.1", 0, log_dir=tmp_path)
    async with app.run_test(size=(150, 40)) as pilot:
        url = f"http://127.0.0.1:{app.server.port}/v1/completions"
        async with aiohttp.ClientSession() as http:
            long = asyncio.create_task(_stream(http, url, 100_000))
            await until(pilot, lambda: app.snap is not None and app.snap.running)
            [row] = app.snap.running
            assert row.tag.startswith("127.0.0.1:")
            _, rest = app.tables["running"]._text(row)
            assert row.tag in rest  # the queue's client column
            short = await _stream(http, url, 5)
            assert short[-1] == b"data: [DONE]\n" and len(short) == 5 + 1
            # `c` on the selected (running) request ends its stream: finish_reason abort
            await pilot.press("home")  # nothing is selected until the user moves
            await until(pilot, lambda: app.selected_id == row.req_id)
            await pilot.press("c")
            lines = await asyncio.wait_for(long, 5)
            assert b'"finish_reason": "abort"' in lines[-2] and lines[-1] == b"data: [DONE]\n"
            await pilot.press("e")
            await pilot.pause()
        logs = list(tmp_path.glob("*.msgpack"))
        assert len(logs) == 1
    log = read_log(logs[0])
    actions = [e.action for e in log.events if e.kind == "action"]
    assert actions == ["inject", "inject", "cancel"]
    _, divergence = verify(log)
    assert divergence is None


@pilot_test
async def test_pause_holds_tokens_and_n_steps(tmp_path):
    fe = build_frontend(load_scenario("chat"))
    app = ServeDashboard(fe, "127.0.0.1", 0, log_dir=tmp_path)
    async with app.run_test(size=(150, 40)) as pilot:
        url = f"http://127.0.0.1:{app.server.port}/v1/completions"
        await pilot.press("space")  # paused: no step starts, no token leaves
        assert fe.clock.paused
        async with aiohttp.ClientSession() as http:
            async def complete() -> dict:
                async with http.post(url, json={"prompt": "hello", "max_tokens": 3}) as r:
                    return await r.json()

            task = asyncio.create_task(complete())
            await pilot.pause(0.3)
            assert not task.done() and fe.engine.step_count == 0
            for _ in range(3):  # the prefill (first token), then two decodes
                await pilot.press("n")
            body = await asyncio.wait_for(task, 5)
        assert body["usage"]["completion_tokens"] == 3 and fe.engine.step_count == 3


@pilot_test
async def test_at_80x24_the_header_has_the_url_and_the_queues_their_client_column(tmp_path):
    fe = build_frontend(load_scenario("chat"))
    app = ServeDashboard(fe, "127.0.0.1", 0, log_dir=tmp_path)
    async with app.run_test(size=(80, 24)) as pilot:
        await pilot.pause()
        app.refresh_frame()
        await pilot.pause()
        header = next(iter(app.screen._compositor.render_strips())).text
        assert f"http://127.0.0.1:{app.server.port}/v1" in header
        for table in app.tables.values():
            client, width = table.fitted()[-1]
            assert client.title == "client" and width >= len("127.0.0.1:65535")
            assert sum(w for _, w in table.fitted()) + len(table.fitted()) - 1 \
                <= table.scrollable_content_region.width
        await pilot.press("q")


async def _stream_then(app, pilot, act) -> list[bytes]:
    """Open a long stream, wait until it decodes, `await act()`; the stream's lines."""
    url = f"http://127.0.0.1:{app.server.port}/v1/completions"
    async with aiohttp.ClientSession() as http:
        async def stream() -> list[bytes]:
            async with http.post(url, json={"prompt": "x" * 10, "max_tokens": 100_000,
                                            "stream": True}) as r:
                return [line async for line in r.content if line.strip()]

        task = asyncio.create_task(stream())
        await until(pilot, lambda: app.snap is not None and app.snap.running)
        await act()
        return await asyncio.wait_for(task, 30)  # (a hang guard)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP])  # (SIGHUP: the terminal closed)
@pilot_test
async def test_sigterm_ends_streams_with_done_and_saves_the_session(tmp_path, sig):
    fe = build_frontend(load_scenario("chat"))
    app = ServeDashboard(fe, "127.0.0.1", 0, log_dir=tmp_path)
    previous = signal.signal(sig, lambda *a: None)  # (unhandled, not the test process's end)
    try:
        async with app.run_test(size=(150, 40)) as pilot:
            async def send() -> None:
                os.kill(os.getpid(), sig)

            lines = await _stream_then(app, pilot, send)
            await until(pilot, lambda: app.return_code is not None)
    finally:
        signal.signal(sig, previous)
    assert lines[-1] == b"data: [DONE]\n" and b'"finish_reason": "abort"' in lines[-2]
    assert app.return_code == 128 + sig
    [saved] = tmp_path.glob("*.msgpack")
    assert app.saved == str(saved)
    log = read_log(saved)
    assert [e.action for e in log.events if e.kind == "action"] == ["inject"]
    assert verify(log)[1] is None


@pilot_test
async def test_quit_writes_the_log_named_by_log(tmp_path):
    fe = build_frontend(load_scenario("chat"))
    app = ServeDashboard(fe, "127.0.0.1", 0, log_dir=tmp_path, log=str(tmp_path / "s.msgpack"))
    async with app.run_test(size=(150, 40)) as pilot:
        async def quit_() -> None:
            await pilot.press("q")

        lines = await _stream_then(app, pilot, quit_)
    assert lines[-1] == b"data: [DONE]\n" and app.return_code == 0
    assert [p.name for p in tmp_path.iterdir()] == ["s.msgpack"]
    assert verify(read_log(tmp_path / "s.msgpack"))[1] is None


@pilot_test
async def test_streams_complete_while_the_dashboard_spools_the_events_to_disk(tmp_path):
    # The dashboard moves the engine's events to disk as it runs; the server reads the same
    # list by position, so each move must shift the server's place too, or tokens are lost.
    fe = build_frontend(load_scenario("chat"), bounded=True, keep_events=True)
    app = ServeDashboard(fe, "127.0.0.1", 0, log_dir=tmp_path, log=str(tmp_path / "s.msgpack"))
    async with app.run_test(size=(150, 40)) as pilot:
        app.spool.keep = 1  # (move all but the latest event at every trim)
        url = f"http://127.0.0.1:{app.server.port}/v1/completions"
        async with aiohttp.ClientSession() as http:
            for n in (3, 7, 4, 9):
                lines = await asyncio.wait_for(_stream(http, url, n), 5)
                assert lines[-1] == b"data: [DONE]\n" and len(lines) == n + 1, lines
                app.spool_events()
                assert sum(app.spool.spooled.values()) > 0
                assert not fe.engine.requests  # (no history: only what is in flight)
            await pilot.press("e")  # an export, then `q` writes `--log`: both whole
            await pilot.pause()
            await pilot.press("q")
    assert app.return_code == 0
    logs = sorted(tmp_path.glob("*.msgpack"))
    assert len(logs) == 2
    for log in logs:
        log = read_log(log)
        assert [e.action for e in log.events if e.kind == "action"] == ["inject"] * 4
        assert verify(log)[1] is None
