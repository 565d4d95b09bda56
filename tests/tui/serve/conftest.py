"""A served engine in a background thread (its own event loop), for tests that drive it with
real HTTP clients."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading

import pytest

from sim import load_scenario
from tui.serve.app import build_frontend
from tui.serve.http import Limits, Server


class Running:
    """A started server: `url`, `frontend`; `call(fn)` runs fn() in the server's loop."""

    def __init__(self, server: Server, loop: asyncio.AbstractEventLoop) -> None:
        self.server, self.loop = server, loop
        self.frontend = server.frontend
        self.url = f"http://127.0.0.1:{server.port}"

    def call(self, fn):
        async def run():
            return fn()
        return asyncio.run_coroutine_threadsafe(run(), self.loop).result(10)


@contextlib.contextmanager
def serving(overrides=(), scenario: str = "chat", api_key: str | None = None,
            limits: Limits = Limits(), **kw):
    sc = load_scenario(scenario, list(overrides))
    box: dict = {}
    ready = threading.Event()

    def main() -> None:
        async def run() -> None:
            try:
                fe = build_frontend(sc, **kw)
                server = Server(fe, "127.0.0.1", 0, api_key, limits)
                await server.start()
            except BaseException as e:  # noqa: BLE001 - reported to the test thread
                box["error"] = e
                ready.set()
                return
            box["stop"] = asyncio.Event()
            box["running"] = Running(server, asyncio.get_running_loop())
            ready.set()
            await box["stop"].wait()
            await server.stop()

        asyncio.run(run())

    thread = threading.Thread(target=main, daemon=True)
    thread.start()
    assert ready.wait(30)
    if "error" in box:
        raise box["error"]
    running = box["running"]
    try:
        yield running
    finally:
        running.loop.call_soon_threadsafe(box["stop"].set)
        thread.join(10)


@pytest.fixture
def server():
    with serving(record_timing=True) as s:
        yield s


def read_until_closed(sock: socket.socket, hang_guard_s: float = 30.0) -> bytes:
    """Everything the server sends on `sock` until it closes it (a reset counts as closed).
    The hang guard fails the test: a server that keeps the connection open."""
    sock.settimeout(hang_guard_s)
    got = b""
    try:
        while chunk := sock.recv(65536):
            got += chunk
    except ConnectionResetError:
        pass
    except socket.timeout:
        pytest.fail(f"the server kept the connection open (got {got[:200]!r})")
    return got
