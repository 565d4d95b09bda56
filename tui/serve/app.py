"""`servesim serve`: build the engine and its front end, then serve headless (asyncio's loop);
`tui.serve.dashboard` serves under the dashboard (Textual's loop: one event loop either way).
"""

from __future__ import annotations

import asyncio
import copy
import math
import signal
import sys

import numpy as np

from sim import Engine, ScenarioError
from sim.errors import CONTROL, shown
from sim.deploy.build import is_deployment
from sim.gcpause import freeze_survivors
from sim.limits import MAX_TIME_S
from sim.inputs.workload import Workload
from sim.session.log import write_log
from tui.driver import MIN_SPEED, stop_signals
from tui.serve.frontend import Frontend
from tui.serve.http import Limits, Server


# A server is meant to run for days: a speed at which the simulated clock would pass the
# simulator's bound (sim.limits.MAX_TIME_S, where the engine stops for good) within a day of
# wall time, idle or not, is refused at startup: 11,574 simulated seconds per wall second.
MAX_SPEED = float(math.floor(MAX_TIME_S / 86400))


def empty_workload() -> Workload:
    """No requests of the scenario's own: HTTP is the only source."""
    f, i = np.zeros(0, dtype=np.float64), np.zeros(0, dtype=np.int64)
    return Workload(arrival=f, prompt=i, output=i.copy(), priority=i.copy(), cancel_at=f.copy())


def model_name_of(scenario) -> str:
    return scenario.model.preset or scenario.name


def build_frontend(scenario, *, background: bool = False, make_executor=None,
                   speed: float = 1.0, model_name: str | None = None,
                   max_waiting: int | None = None, record_timing: bool = False,
                   bounded: bool = False, send_threads: int = 1,
                   keep_events: bool = False) -> Frontend:
    """The engine for `scenario` (its own workload only with `background`) behind a front end.

    `bounded`: memory held by what is in flight, not by how long the server has run (ended
    requests, timeline rows and read events are dropped); for headless serving, where no screen
    reads the history. `keep_events`: the engine's events are kept even so, for a session
    log (`--log`): they grow with the session.

    Raises ScenarioError for what `serve` cannot run: a deployment of several instances, or
    parallel sampling set in the scenario (a request's `n` does that)."""
    if is_deployment(scenario):
        raise ScenarioError(f"{scenario.source}: serve runs one engine instance; "
                            "cluster.replicas, model.data_parallel, model.pipeline_parallel "
                            "and the disaggregated policy are not supported")
    if scenario.workload.num_samples > 1:
        scenario = copy.deepcopy(scenario)
        if background:
            raise ScenarioError(f"{scenario.source}: workload.num_samples = "
                                f"{scenario.workload.num_samples}: serve samples with each "
                                "request's `n`; set it to 1 for background load")
        scenario.workload.num_samples = 1
    if not speed >= MIN_SPEED:  # (NaN fails; slower, a call's tokens would take hours apart)
        raise ScenarioError(f"--speed {speed:g}: must be at least 1/64 (simulated seconds per "
                            "wall second)")
    if model_name is not None and (not model_name.strip() or CONTROL.search(model_name)):
        raise ScenarioError(f"--served-model-name {shown(model_name)}: empty or holding a "
                            "control character (clients name the model with it)")
    if speed > MAX_SPEED:
        raise ScenarioError(f"--speed {speed:g}: the simulated clock would pass its limit of "
                            f"{MAX_TIME_S:g} s within a day of serving; at most {MAX_SPEED:g}")
    executor = make_executor(scenario) if make_executor else None
    engine = Engine(scenario, executor=executor, keep_history=not bounded,
                    workload=None if background else empty_workload())
    name = model_name_of(scenario) if model_name is None else model_name
    return Frontend(engine, model_name=name, speed=speed,
                    max_waiting=max_waiting, record_timing=record_timing,
                    trim_events=bounded and not keep_events, send_threads=send_threads)


def banner(frontend: Frontend, host: str, port: int) -> str:
    e = frontend.engine
    compute = f"{e.executor.name}" if e.executor is not None else "none (filler text)"
    return (f"servesim serve: http://{host}:{port}/v1  model {frontend.model_name!r}, "
            f"scenario {e.scenario.name}, policy {e.policy.name}, speed x{frontend.clock.speed:g}, "
            f"compute {compute}")


def serve_headless(frontend: Frontend, host: str, port: int, ready=None,
                   api_key: str | None = None, limits: Limits = Limits(),
                   log: str | None = None) -> int:
    """Serve until SIGINT, SIGTERM or SIGHUP (`stop_signals`), then end every open call (a
    stream with an `abort` frame and `[DONE]`), write the session log to `log` (atomically;
    the frontend must keep its events: `build_frontend(keep_events=True)`) and return 128 +
    the signal's number.
    `ready(server)` is called once listening.
    Raises ScenarioError when the address cannot be bound, LogError when the log cannot be
    written."""
    async def main() -> None:
        server = Server(frontend, host, port, api_key, limits)
        try:
            await server.start()
        except OSError as e:
            raise ScenarioError(f"--host {host} --port {port}: cannot listen: "
                                f"{e.strerror or e}") from None
        # What start-up made (modules, the engine, the scenario) lives as long as the server:
        # out of the collector's sight, a full collection (which a call of thousands of
        # sequences can set off) scans only what came since, not ~20 ms of it in the loop.
        freeze_survivors()
        print(banner(frontend, host, server.port), file=sys.stderr, flush=True)
        if ready is not None:
            ready(server)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()

        def stopped_by(sig: int) -> None:
            signals.append(sig)
            stop.set()

        for sig in (signal.SIGINT, *stop_signals()):
            try:
                loop.add_signal_handler(sig, stopped_by, sig)
            except (NotImplementedError, RuntimeError):  # not the main thread
                pass
        try:
            await stop.wait()
        finally:
            await server.stop()
            if log is not None:  # (the pump has stopped: the engine is still)
                write_log(log, frontend.engine)

    signals: list[int] = []
    asyncio.run(main())
    return 128 + signals[0] if signals else 0  # (as the shell reports a signal's end)
