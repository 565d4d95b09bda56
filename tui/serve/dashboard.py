"""`servesim serve --tui`: the dashboard of `servesim run` over the served engine, in Textual's
event loop, with the HTTP server and its pump in that same loop.

The pump moves the engine (there is no worker thread); the dashboard's clock keys act on the
server's clock through `ServeDriver`, and its other keys (inject, cancel, policy, export) go
through the engine's API as in `servesim run`, so an exported log holds the HTTP arrivals as
injections with their times and replays exactly. SIGTERM (or SIGHUP: the terminal closed) ends
every open call as `q` does and saves the session log (to `--log FILE`, else a new file in the
log directory, as `e` names it).
"""

from __future__ import annotations

import sys
import time

from sim import ScenarioError
from sim.session.log import write_log
from tui.app import Dashboard
from tui.driver import MAX_SPEED, MIN_SPEED, SpeedMeter
from tui.serve.app import banner
from tui.serve.frontend import Frontend
from tui.serve.http import Limits, Server


class ServeDriver:
    """The dashboard's driver (`tui.driver.EngineDriver`'s methods) over the server's clock."""

    replay = False
    finished = False

    def __init__(self, frontend: Frontend) -> None:
        self.fe = frontend
        self.engine = frontend.engine
        self.lock = frontend.lock
        self.steps = 0
        self.meter = SpeedMeter()

    @property
    def paused(self) -> bool:
        return self.fe.clock.paused

    @property
    def speed(self) -> float:
        return self.fe.clock.speed

    @property
    def error(self) -> str | None:
        return self.fe.error

    @property
    def lag(self) -> float:
        """Simulated seconds the engine is behind the clock while it has work."""
        e = self.engine
        if self.paused or not e.policy.has_work():
            return 0.0
        return max(0.0, self.fe.clock.now() - e.now)

    @property
    def achieved(self) -> float | None:
        """Simulated seconds per wall second over the last few wall seconds, measured as the
        dashboard reads it (each frame)."""
        if self.paused:
            self.meter.reset()
            return None
        self.meter.add(time.perf_counter(), self.engine.now)
        return self.meter.value

    def set_paused(self, paused: bool) -> None:
        """Freeze or restart the clock: no token is sent and no step starts while paused."""
        self.fe.clock.set(paused=paused)
        self.fe.wake()

    def set_speed(self, speed: float) -> None:
        self.fe.clock.set(speed=min(MAX_SPEED, max(MIN_SPEED, speed)))
        self.fe.wake()

    def step(self) -> int:
        """One engine step (while paused); the clock moves to its end, so its tokens go out."""
        with self.lock:
            n = self.engine.step()
            self.fe.clock.set(max(self.fe.clock.now(), self.engine.now), paused=True)
        self.fe.wake()
        return n

    def start(self) -> None:
        pass  # the server starts the pump

    def stop(self, wait_s: float = 0.0) -> None:
        pass


class ServeDashboard(Dashboard):
    """The dashboard with the HTTP server running in its event loop."""

    def __init__(self, frontend: Frontend, host: str, port: int, log_dir=".",
                 api_key: str | None = None, limits: Limits = Limits(),
                 log: str | None = None) -> None:
        super().__init__(frontend.engine, driver=ServeDriver(frontend), log_dir=log_dir)
        self.server = Server(frontend, host, port, api_key, limits)
        self.listen_error: str | None = None
        self.log_path = log  # the session log written at exit (None: on SIGTERM, in log_dir)
        self.saved: str | None = None  # where it went, or why it could not

    async def on_mount(self) -> None:
        super().on_mount()
        self.main_screen.add_class("-serve")
        for table in self.tables.values():
            table.show_clients()
        try:
            await self.server.start()
        except OSError as e:
            self.listen_error = (f"--host {self.server.host} --port {self.server.port}: "
                                 f"cannot listen: {e.strerror or e}")
            self.exit(2)
            return
        text = banner(self.server.frontend, self.server.host, self.server.port)
        self._note(text.removeprefix("servesim serve: "))
        self.url = f"http://{self.server.host}:{self.server.port}/v1"

    # The server reads the engine's event list by position too: what it has not read stays in
    # memory, and its place moves with what the spool takes.
    def _unread_events(self) -> int:
        return self.server.frontend.unread_events()

    def _events_moved(self, stream, n: int) -> None:
        super()._events_moved(stream, n)
        self.server.frontend.events_moved(n)

    def _changed(self) -> None:
        """After a key acted on the engine (inject, cancel, policy): the pump looks now."""
        self.server.frontend.wake()
        super()._changed()

    async def action_quit(self) -> None:
        await self._close(save=self.log_path is not None)
        self.exit(0)

    def _terminated(self, signum: int) -> None:
        """SIGTERM or SIGHUP: end every open call, save the session, exit with 128 + the
        signal's number."""
        async def close() -> None:
            await self._close(save=True)
            self.exit(return_code=128 + signum)

        self.run_worker(close(), exclusive=True, group="terminate")

    async def _close(self, save: bool) -> None:
        """Stop the server (open streams end with `abort` and `[DONE]`), then, with `save`,
        write the session log: to `log_path`, else under a new name in the log directory."""
        await self.server.stop()
        if not save:
            return
        try:
            self.saved = str(write_log(self.log_path, self.engine, records=self._log_records())
                             if self.log_path else self._write_new_log(""))
        except Exception as e:  # noqa: BLE001 - reported at exit; the app must still close
            self.saved = f"(not saved: {e})"


def serve_dashboard(frontend: Frontend, host: str, port: int, api_key: str | None = None,
                    limits: Limits = Limits(), log: str | None = None) -> int:
    """Serve under the live dashboard; `q` quits (and writes `log`), SIGTERM too and saves the
    session. Returns the exit code."""
    app = ServeDashboard(frontend, host, port, api_key=api_key, limits=limits, log=log)
    app.run()
    if app.listen_error:
        raise ScenarioError(app.listen_error)
    if app.saved is not None:  # (after Textual has given the terminal back)
        print(f"servesim serve: session log: {app.saved}", file=sys.stderr)
    return app.return_code or 0
