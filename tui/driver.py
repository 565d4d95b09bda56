"""What moves the dashboard's engine: a worker thread that advances the engine (or, with
`--replay`, a `sim.session.replay.Replayer`) toward a target simulated time moving `speed`
simulated seconds per wall second, in slices of a few milliseconds under `EngineDriver.lock`.
No Textual here: the command line checks `--speed` with it before the dashboard loads."""

from __future__ import annotations

import math
import signal
import threading
import time
from collections import deque

from sim import Engine, ServesimError

MIN_SPEED, MAX_SPEED = 1 / 64, 4096.0


def stop_signals() -> list[int]:
    """The signals that end a session as `q` does, saving what it saves: SIGTERM, and SIGHUP
    (its terminal gone) unless it is ignored (as under nohup)."""
    hup = [] if signal.getsignal(signal.SIGHUP) is signal.SIG_IGN else [signal.SIGHUP]
    return [signal.SIGTERM, *hup]


def check_speed(speed) -> float:
    """`speed` as a float. Raises ServesimError unless it is a number from MIN_SPEED to
    MAX_SPEED (0 would stop the clock for good, a negative or NaN one run it nowhere)."""
    try:
        v = float(speed)
    except (TypeError, ValueError):
        v = math.nan
    if not MIN_SPEED <= v <= MAX_SPEED:  # (NaN fails)
        raise ServesimError(f"--speed {speed}: must be a number from 1/64 to {MAX_SPEED:g} "
                            "(simulated seconds per wall second)")
    return v


class SpeedMeter:
    """The speed achieved: simulated seconds per wall second over the last WINDOW_S wall
    seconds, from (wall, simulated) clock readings."""

    WINDOW_S = 2.0
    MIN_SPAN_S = 0.25  # shorter spans give no figure

    def __init__(self) -> None:
        self._samples: deque[tuple[float, float]] = deque()

    def add(self, wall: float, sim: float) -> None:
        s = self._samples
        s.append((wall, sim))
        while len(s) > 2 and wall - s[1][0] >= self.WINDOW_S:
            s.popleft()

    def reset(self) -> None:
        self._samples.clear()

    @property
    def value(self) -> float | None:
        if len(self._samples) < 2:
            return None
        (w0, s0), (w1, s1) = self._samples[0], self._samples[-1]
        return (s1 - s0) / (w1 - w0) if w1 - w0 >= self.MIN_SPAN_S else None


class EngineDriver:
    """Advances `source` (an Engine or a Replayer) toward a moving target simulated time."""

    SLICE_S = 0.004     # wall time the worker aims to hold the lock per slice
    BACKLOG_S = 2.0     # wall seconds of backlog kept when compute cannot keep up

    def __init__(self, source, engine: Engine, speed: float = 1.0, paused: bool = False,
                 clock=time.perf_counter) -> None:
        """`clock`: the wall clock (seconds) the worker reads."""
        self.source = source
        self.engine = engine
        self.replay = source is not engine
        self.lock = threading.RLock()
        self.speed = check_speed(speed)
        self.paused = paused
        self.clock = clock
        self.target = engine.now
        # Where the clock would be had the engine kept up since it last caught up with its
        # target: `target` stops BACKLOG_S ahead of the engine, this does not (the true lag).
        self.ideal = engine.now
        self.meter = SpeedMeter()
        self._wall = 0.0  # wall seconds spent running (not paused), the meter's clock
        self.error: str | None = None
        self.steps = 0
        self._max_steps = 1  # grows while slices stay short (a real-compute step can be slow)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # --- state the screen shows (read under the lock) ------------------------------------------
    @property
    def finished(self) -> bool:
        """A replay that has reached the end of its log."""
        return self.replay and self.source.done

    @property
    def lag(self) -> float:
        """Simulated seconds the engine's clock is behind where the asked speed would have it
        (since it last kept up), however far that is."""
        return 0.0 if self.paused else max(0.0, self.ideal - self.engine.now)

    @property
    def achieved(self) -> float | None:
        """Simulated seconds per wall second over the last few wall seconds (None while paused
        or before there is a measurement)."""
        return None if self.paused else self.meter.value

    # --- control ---------------------------------------------------------------------------
    # Pause and speed set fields the worker reads between slices, so they need not wait long for
    # the lock (which a slow real-compute step can hold for seconds).
    def set_paused(self, paused: bool) -> None:
        self.paused = paused  # the worker starts no further slice
        # Let a slice in progress end, so that a paused clock stays where it is shown.
        if self.lock.acquire(timeout=0.1):
            self.target = self.ideal = self.engine.now
            self.lock.release()
        self.meter.reset()

    def set_speed(self, speed: float) -> None:
        self.speed = min(MAX_SPEED, max(MIN_SPEED, speed))

    def step(self) -> int:
        """One engine step (the clock then stays there: call while paused)."""
        with self.lock:
            n = self.source.step()
            self.target = self.ideal = self.engine.now
            return n

    @property
    def alive(self) -> bool:
        """The worker thread is running."""
        return self._thread is not None and self._thread.is_alive()

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="servesim-engine", daemon=True)
        self._thread.start()

    def stop(self, wait_s: float = 2.0) -> None:
        """Stop the worker, waiting up to `wait_s` for a step in progress (the thread is a
        daemon: a real-compute step still running at exit does not hold the process)."""
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=wait_s)

    # --- the worker ----------------------------------------------------------------------------
    def _run(self) -> None:
        last = self.clock()
        while not self._stop.is_set():
            now = self.clock()
            with self.lock:
                behind = self.advance(now - last)
            last = now
            # Sleep a little even when behind: the UI thread needs the GIL to draw.
            time.sleep(0.0005 if behind else 0.01)

    def advance(self, wall_dt: float) -> bool:
        """Move the target by `wall_dt` wall seconds times the speed (unless paused) and run one
        slice of the engine toward it. Returns True while the engine is behind the target.
        The worker calls it in a loop; call it under `lock`."""
        e = self.engine
        if self.paused or self.error:
            return False
        if self.finished:
            self.target = self.ideal = e.now
            return False
        self._wall += wall_dt
        self.meter.add(self._wall, e.now)
        self.target += wall_dt * self.speed
        self.ideal += wall_dt * self.speed
        if e.now >= self.target:
            self.ideal = self.target  # on time: no lag
            return False
        t0 = time.perf_counter()
        try:
            n = self.source.run_until(self.target, max_steps=self._max_steps)
        except Exception as err:  # noqa: BLE001 - shown on screen; the worker must not die silently
            self.error = (str(err) if isinstance(err, ServesimError)
                          else f"{type(err).__name__}: {err}")
            self.paused = True
            return False
        spent = time.perf_counter() - t0
        self.steps += n
        if n >= self._max_steps and spent < self.SLICE_S / 2:
            self._max_steps = min(1 << 16, self._max_steps * 2)
        elif spent > self.SLICE_S * 2 and self._max_steps > 1:
            self._max_steps //= 2
        # Keep a bounded backlog: when compute is slower than `speed`, run late, not ever later.
        self.target = min(self.target, e.now + self.BACKLOG_S * max(1.0, self.speed))
        if e.now >= self.target:
            self.ideal = self.target  # caught up with the target: the lag is over
        return e.now < self.target
