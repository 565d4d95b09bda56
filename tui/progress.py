"""A progress line for long headless runs (`sim`, `compare`, `replay --verify`, `export`).

A background thread reads the engine being run (its clock and counters: plain attribute reads,
so the run itself is untouched) and redraws one line on a terminal: simulated time, requests
ended of all, requests per wall second, elapsed and estimated time left. Nothing is drawn for
the first `delay` seconds, so short runs stay silent, and the line is erased at the end so that
what the command prints next starts clean.
"""

from __future__ import annotations

import threading
import time

from sim.deploy.sweep import clock_text


class RunProgress:
    """Use as a context manager around the run; `watch(engine, label)` names what runs now
    (compare: each policy in turn). `enabled=False` draws nothing (a pipe, --quiet)."""

    DELAY = 2.0      # seconds before the first draw
    INTERVAL = 0.5   # seconds between draws

    def __init__(self, stream, enabled: bool = True, delay: float | None = None,
                 interval: float | None = None) -> None:
        self.stream = stream
        self.enabled = enabled
        self.delay = self.DELAY if delay is None else delay
        self.interval = self.INTERVAL if interval is None else interval
        self.engine = None
        self.label = ""
        self._t0 = self._t_engine = time.monotonic()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._width = 0

    def watch(self, engine, label: str) -> None:
        """Report on `engine` from now on, under `label`."""
        self.engine, self.label = engine, label
        self._t_engine = time.monotonic()

    def __enter__(self) -> "RunProgress":
        self._t0 = time.monotonic()
        if not self.enabled:
            return self
        self._thread = threading.Thread(target=self._loop, name="servesim-progress",
                                        daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        if self._width:  # erase the line
            self.stream.write("\r" + " " * self._width + "\r")
            self.stream.flush()

    def _loop(self) -> None:
        if self._stop.wait(self.delay):
            return
        while True:
            self.draw()
            if self._stop.wait(self.interval):
                return

    def line(self) -> str | None:
        """The progress line for the engine watched now (None before `watch`)."""
        e = self.engine
        if e is None:
            return None
        c = e.counts
        done = c["finished"] + c["cancelled"] + c["rejected"]
        total = len(e.workload) + c["injected"]
        wall = time.monotonic() - self._t_engine
        rate = done / wall if wall > 0 else 0.0
        share = f" ({100 * done / total:.1f}%)" if total else ""
        left = (f"  ~{clock_text((total - done) / rate)} left"
                if rate > 0 and 0 < done < total else "")
        return (f"{self.label}: t={e.now:,.1f} s simulated  {done:,}/{total:,} requests{share}"
                f"  {rate:,.0f} req/s  {clock_text(time.monotonic() - self._t0)} elapsed{left}")

    def draw(self) -> None:
        line = self.line()
        if line is None:
            return
        self.stream.write("\r" + line.ljust(self._width))
        self.stream.flush()
        self._width = len(line)

