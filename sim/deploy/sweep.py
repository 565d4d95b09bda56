"""Parameter sweeps: a grid of scenario overrides, each point run headless over several seeds in
parallel (a local process pool, or a Ray cluster), flattened to one row per point and seed; and
the search for the highest request rate that still meets the SLOs.

A grid axis is `KEY=V1,V2,...`, KEY a scenario field path as `--set` takes it and each value read
as `--set` reads it (TOML, else a string). Points are the cartesian product in the order the axes
are given (the last axis varies fastest). Every point's scenario is loaded and checked before
anything runs, so a bad key or value fails at once.

A run depends only on its scenario (seed included): rows come back in grid order then seed
whichever executor ran them, and only `wall_s` differs between executors.

`find_max_rate` follows DistServe's definition of goodput: the highest `workload.rate` at which
at least `target` of the requests meet every SLO. Per configuration it probes the scenario's own
rate, doubles (or halves) until the outcome flips, then bisects to a relative tolerance. A
probe's attainment is the mean over seeds of each seed's share of finished requests that met
the SLOs.
"""

from __future__ import annotations

import copy
import csv
import dataclasses
import difflib
import io
import itertools
import math
import multiprocessing
import os
import signal
import time
from contextlib import contextmanager
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass
from typing import Any, Callable

from sim.errors import ScenarioError, ServesimError, cut
from sim.limits import check_memory
from sim.inputs.scenario import SLOConfig, Scenario, find_scenario, load_scenario, parse_override
from sim.deploy.build import build
from sim.gcpause import collect_frozen
from sim.stats.metrics import floors, summarize

Progress = Callable[[int, int], None]  # (runs done, runs expected in all)
BYTES_PER_RUN = 16_000  # a planned run: its checked scenario (about 4 KB), task and row


class SweepError(ServesimError):
    """A sweep that cannot run: an executor that is missing or unreachable, or a failed run."""


# --- the grid ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Axis:
    """One grid axis: a scenario field path and its values, as written and as parsed."""

    key: str
    texts: tuple[str, ...]
    values: tuple[Any, ...]


@dataclass
class Point:
    """One grid point: its axis values (for the output) and its checked scenario."""

    values: dict[str, Any]
    scenario: Scenario

    def label(self, **more) -> str:
        """`key=value, ...` of the point's values and `more` (for messages)."""
        return ", ".join(f"{k}={_cell(v)}" for k, v in {**self.values, **more}.items())


@dataclass
class Plan:
    """What a sweep runs: its axes, its checked points, and the seeds run at every point
    (None: each point's own scenario seed)."""

    axes: list[Axis]
    points: list[Point]
    seeds: list[int] | None


def split_values(text: str) -> list[str]:
    """Split `V1,V2,...` at the commas outside quotes, brackets and braces (TOML arrays and
    inline tables keep theirs)."""
    parts, depth, quote, start = [], 0, "", 0
    for i, ch in enumerate(text):
        if quote:
            if ch == quote:
                quote = ""
        elif ch in "\"'":
            quote = ch
        elif ch in "[{":
            depth += 1
        elif ch in "]}":
            depth -= 1
        elif ch == "," and depth == 0:
            parts.append(text[start:i].strip())
            start = i + 1
    parts.append(text[start:].strip())
    return parts


def parse_axis(text: str) -> Axis:
    """`KEY=V1,V2,...` -> Axis. Raises ScenarioError on a missing key, `=` or value."""
    where = f"--grid {cut(text, 80)}"
    if "=" not in text:
        raise ScenarioError(f"{where}: expected KEY=V1,V2,...")
    key_text, _, values_text = text.partition("=")
    texts = split_values(values_text)
    if not values_text.strip() or not all(texts):
        raise ScenarioError(f"{where}: empty value (expected KEY=V1,V2,...)")
    if len(set(texts)) != len(texts):
        raise ScenarioError(f"{where}: a value is listed twice")
    values, key = [], ""
    for t in texts:
        parts, value = parse_override(f"{key_text}={t}", where)
        key = ".".join(parts)
        values.append(value)
    return Axis(key, tuple(texts), tuple(values))


def parse_grid(specs: list[str]) -> list[Axis]:
    """Every `--grid` axis, in order. Raises ScenarioError on a malformed or repeated axis."""
    axes = [parse_axis(s) for s in specs]
    seen = set()
    for a in axes:
        if a.key in seen:
            raise ScenarioError(f"--grid {a.key}: given twice (list all its values in one --grid)")
        seen.add(a.key)
    return axes


def slo_overrides(text: str) -> list[str]:
    """`--slo ttft_ms=..,tpot_ms=..` -> `--set` overrides that replace the whole `[slo]` section:
    a bound not named is removed (0). Raises ScenarioError on a malformed or unknown bound."""
    names = [f.name for f in dataclasses.fields(SLOConfig)]
    given = {}
    for item in split_values(text):
        parts, _ = parse_override(item, f"--slo {text}")
        if len(parts) != 1 or parts[0] not in names:
            hint = difflib.get_close_matches(parts[-1], names, n=1)
            raise ScenarioError(f"--slo {item}: unknown bound (known: {', '.join(names)})"
                                + (f" (did you mean {hint[0]!r}?)" if hint else ""))
        given[parts[0]] = item.partition("=")[2].strip()
    return [f"slo.{n}={given.get(n, '0')}" for n in names]


def plan(spec: str | None, axes: list[Axis], *, seeds: list[int] | None = None,
         overrides: list[str] = ()) -> Plan:
    """Load and check the scenario of every grid point (`overrides` first, then the point's
    values). Raises ScenarioError naming the point at the first one that does not load."""
    if seeds is not None and any(a.key == "seed" for a in axes):
        raise ScenarioError("--grid seed: cannot be combined with --seeds (use one)")
    n_points = math.prod(len(a.values) for a in axes)
    runs = n_points * (len(seeds) if seeds is not None else 1)
    check_memory(f"--grid ({n_points:,} points)"
                 + (f" x --seeds {len(seeds):,}" if seeds is not None else ""),
                 runs * BYTES_PER_RUN, f" for the {runs:,} runs planned up front")
    find_scenario(spec)  # a missing file is named once, not as the first point's problem
    points = []
    for combo in itertools.product(*(range(len(a.values)) for a in axes)):
        sets = [f"{a.key}={a.texts[i]}" for a, i in zip(axes, combo)]
        values = {a.key: a.values[i] for a, i in zip(axes, combo)}
        try:
            sc = load_scenario(spec, [*overrides, *sets])
        except ScenarioError as e:
            where = f"grid point {', '.join(cut(t, 80) for t in sets)}: " if sets else ""
            raise ScenarioError(f"{where}{e}") from None
        points.append(Point(values, sc))
    return Plan(axes, points, seeds)


def variant(sc: Scenario, *, seed: int | None = None, rate: float | None = None) -> Scenario:
    """A copy of a checked scenario with another seed or request rate (both always valid)."""
    sc = copy.deepcopy(sc)
    if seed is not None:
        sc.seed = seed
    if rate is not None:
        sc.workload.rate = rate
    return sc


# --- one run -------------------------------------------------------------------------------------
# (column, path into the summary) for every metric of a row, in output order.
METRICS: list[tuple[str, tuple[str, ...]]] = [
    ("requests_finished", ("requests", "finished")),
    ("duration_s", ("duration_s",)),
    ("throughput_requests_per_s", ("throughput", "requests_per_s")),
    ("throughput_output_tokens_per_s", ("throughput", "output_tokens_per_s")),
    ("throughput_total_tokens_per_s", ("throughput", "total_tokens_per_s")),
    *((f"{m}_{p}_ms", (f"{m}_ms", p)) for m in ("ttft", "itl", "tpot", "e2e")
      for p in ("p50", "p90", "p99")),
    ("goodput_requests_per_s", ("goodput_requests_per_s",)),
    ("slo_attainment", ("slo_attainment",)),
    ("preemptions", ("preemptions",)),
    ("kv_mean_usage", ("kv", "mean_usage")),
    ("energy_j_per_output_token", ("energy_j_per_output_token",)),
]


def flatten(summary: dict) -> dict[str, Any]:
    """The sweep's metric columns of one `summarize` result."""
    out = {}
    for column, path in METRICS:
        v = summary
        for k in path:
            v = v[k]
        out[column] = v
    return out


# Steps between two looks at a run given bounds to stop at (`run_scenario`).
STOP_CHECK_STEPS = 2048


def run_scenario(sc: Scenario, stop: tuple[tuple[str, float], ...] = ()) -> dict[str, Any]:
    """Run one scenario headless: its metric columns plus `wall_s` and `cpu_s` (build, run and
    summary) and the `worker` process that ran it (RUN_ONLY).

    `stop`: (column, limit in ms) pairs, such as ("ttft_p99_ms", 500.0). The run ends as soon
    as one column's final value is proven above its limit (`metrics.floors`), looked at every
    `STOP_CHECK_STEPS` steps or more; its row then has `stopped_s` (the simulated time it ended
    at) and, in place of the figures, the lower bounds of the TTFT, TPOT and E2E percentiles
    proven then (None for the rest). A run that ends by itself gives the same row as without
    `stop`.

    Raises ServesimError when the run fails (an engine that stalls, an unreadable trace)."""

    t0, c0 = time.perf_counter(), time.process_time()
    engine = build(sc, record_events=False, keep_history=False)
    row = _stopped(engine, stop) if stop else None
    if row is None:
        engine.run()
        row = flatten(summarize(engine))
    del engine
    collect_frozen()  # (a worker runs thousands, one after another)
    row["wall_s"] = time.perf_counter() - t0
    row["cpu_s"] = time.process_time() - c0  # (what load cannot stretch, unlike wall_s)
    row["worker"] = os.getpid()
    return row


def _stopped(engine, stop: tuple[tuple[str, float], ...]) -> dict[str, Any] | None:
    """Run `engine` a few steps at a time until it is done (None) or a `stop` bound is proven
    broken: the row of the run stopped there."""
    parts = getattr(engine, "instances", None) or [engine]
    while not engine.done:
        # (a look visits every request in flight: at most one per 8 steps run)
        if not engine.run(max(STOP_CHECK_STEPS, 8 * sum(len(e.requests) for e in parts))):
            return None  # (no step: let the whole run end it, or say why it cannot)
        floor = floors(engine)
        # (a margin of float rounding: the client's figures are summed in another order)
        if floor is not None and any(floor.get(c, 0.0) > limit * (1 + 1e-9) for c, limit in stop):
            return {**{c: None for c, _ in METRICS}, **floor, "stopped_s": engine.now}
    return None


# What a run's row says of the run alone (`Runner.submit`'s rows; `Runner.run` leaves them out).
RUN_ONLY = ("cpu_s", "worker")


def _run_task(sc: Scenario, stop: tuple[tuple[str, float], ...] = ()) -> tuple[bool, Any]:
    # Errors travel back as text: they pickle whatever the executor, and keep Ray's wrapping
    # out of the one-line message.
    try:
        return True, run_scenario(sc, stop)
    except ServesimError as e:
        return False, str(e)


# --- executors -----------------------------------------------------------------------------------
class Runner:
    """Runs scenarios and returns their rows in the order given. Use as a context manager: the
    pool or the Ray connection starts at the first run and ends with the block.

    `workers=1` runs in this process; more use a local process pool of that size (default: the
    CPU count); `ray_address` (None: no Ray; "": a local instance, or the one RAY_ADDRESS names)
    runs on a Ray cluster instead."""

    def __init__(self, workers: int | None = None, ray_address: str | None = None) -> None:
        if workers is not None and workers < 1:
            raise SweepError(f"--workers {workers}: must be at least 1")
        self.workers = workers or os.cpu_count() or 1
        self.ray_address = ray_address
        self._pool: ProcessPoolExecutor | None = None
        self._ray = None
        self._ray_started = False
        self._remote = None

    def __enter__(self) -> "Runner":
        return self

    def __exit__(self, *exc) -> None:
        if self._pool is not None:
            if exc[0] is not None:  # Ctrl-C, SIGTERM, a failed run: stop the workers now
                _stop_workers(self._pool)
            manager = getattr(self._pool, "_executor_manager_thread", None)
            self._pool.shutdown(wait=exc[0] is None, cancel_futures=True)
            if exc[0] is not None and manager is not None:
                # (the pool's thread closes its wake-up pipe as it ends; the interpreter's
                # exit handler writes to that pipe unless it is closed, and a close between
                # its check and its write prints a traceback: let the thread end first, its
                # workers gone, within a bound)
                manager.join(timeout=5.0)
            self._pool = None
        if self._ray_started:
            self._ray.shutdown()
            self._ray_started = False

    def run(self, tasks: list[tuple[str, Scenario]],
            progress: Progress | None = None) -> list[dict]:
        """Run every (label, scenario); rows in task order. `progress(done, len(tasks))` after
        each. Raises SweepError naming the first failed task (in task order)."""
        if not tasks:
            return []
        if self.ray_address is not None:
            if self._remote is None:
                self._start_ray()
            results = self._run_ray([sc for _, sc in tasks], progress)
        elif self.workers == 1 or len(tasks) == 1:
            results = []
            for sc in (sc for _, sc in tasks):
                results.append(_run_task(sc))
                if progress:
                    progress(len(results), len(tasks))
        else:
            results = self._run_pool([sc for _, sc in tasks], progress)
        for (label, _), (ok, value) in zip(tasks, results):
            if not ok:
                raise SweepError(f"{label}: {value}")
        # (a sweep's rows differ between executors in wall_s alone)
        return [{k: v for k, v in value.items() if k not in RUN_ONLY} for _, value in results]

    # --- one run at a time: the caller keeps at most `slots` in flight and picks the next
    @property
    def slots(self) -> int:
        """How many runs make every worker busy (Ray: the cluster's CPUs)."""
        if self.ray_address is not None:
            if self._remote is None:
                self._start_ray()
            return max(1, int(self._ray.cluster_resources().get("CPU", self.workers)))
        return self.workers

    def submit(self, sc: Scenario, stop: tuple[tuple[str, float], ...] = ()):
        """Start one run (`stop`: as `run_scenario`'s); a handle for `wait` and `outcome`. With
        one local worker the run happens here, now."""
        if self.ray_address is not None:
            if self._remote is None:
                self._start_ray()
            return self._remote.remote(sc, stop)
        if self.workers == 1:
            return _Ran(_run_task(sc, stop))
        with _signals_held():
            return self._local_pool().submit(_run_task, sc, stop)

    def wait(self, handles) -> list:
        """Block until at least one of `handles` has ended; those that have."""
        ran = [h for h in handles if isinstance(h, _Ran)]
        if ran:
            return ran
        if self.ray_address is not None:
            return self._ray.wait(list(handles), num_returns=1)[0]
        try:
            done = wait(handles, return_when=FIRST_COMPLETED)[0]
            for h in done:
                h.result()
        except BrokenProcessPool as e:
            raise SweepError(f"--workers {self.workers}: a worker process died: {e}") from None
        return list(done)

    def outcome(self, handle) -> tuple[bool, Any]:
        """(True, row with RUN_ONLY) or (False, why) of an ended run."""
        if isinstance(handle, _Ran):
            return handle.value
        return self._ray.get(handle) if self.ray_address is not None else handle.result()

    def _local_pool(self) -> ProcessPoolExecutor:
        if self._pool is None:
            # forkserver: workers are forked from a clean process that has imported the engine,
            # never from this one's threads (a Ray driver), and start faster than spawned ones.
            if "forkserver" in multiprocessing.get_all_start_methods():
                ctx = multiprocessing.get_context("forkserver")
                ctx.set_forkserver_preload(["sim.engine.engine", "sim.stats.metrics",
                                            "sim.deploy.sweep"])
            else:
                ctx = multiprocessing.get_context("spawn")
            self._pool = ProcessPoolExecutor(max_workers=self.workers, mp_context=ctx,
                                             initializer=_worker_init,
                                             initargs=(os.getpid(),))
        return self._pool

    def _run_pool(self, scenarios: list[Scenario], progress: Progress | None) -> list:
        pool = self._local_pool()
        with _signals_held():  # workers start inside submit(): none may escape the clean-up
            index = {pool.submit(_run_task, sc): i for i, sc in enumerate(scenarios)}
        try:
            return _collect(index, len(scenarios), progress,
                            lambda pending: wait(pending, return_when=FIRST_COMPLETED)[0],
                            lambda fut: fut.result())
        except BrokenProcessPool as e:  # a worker killed (out of memory) or unable to start
            raise SweepError(f"--workers {self.workers}: a worker process died: {e}") from None

    def _start_ray(self) -> None:
        try:
            import ray
        except ImportError:
            raise SweepError("--ray needs Ray: pip install 'servesim[ray]'") from None
        self._ray = ray
        if not ray.is_initialized():
            import logging

            kw: dict[str, Any] = {"logging_level": logging.WARNING, "log_to_driver": False}
            if self.ray_address:
                kw["address"] = self.ray_address
            else:
                kw["include_dashboard"] = False
            try:
                ray.init(**kw)
            except Exception as e:  # Ray raises several types for an unreachable cluster
                where = self.ray_address or "(local)"
                first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
                raise SweepError(f"--ray {where}: cannot start or reach Ray: {first}") from None
            self._ray_started = True
        self._remote = ray.remote(_run_task)

    def _run_ray(self, scenarios: list[Scenario], progress: Progress | None) -> list:
        ray = self._ray
        index = {self._remote.remote(sc): i for i, sc in enumerate(scenarios)}
        return _collect(index, len(scenarios), progress,
                        lambda pending: ray.wait(list(pending), num_returns=1)[0], ray.get)


@dataclass(eq=False)
class _Ran:
    """A run that has already ended (one local worker runs in the caller's process)."""

    value: tuple[bool, Any]


@contextmanager
def _signals_held():
    """Hold Ctrl-C and SIGTERM until the block ends (they arrive then), so that a worker the
    pool is starting is registered before the interrupt's clean-up looks for workers to stop."""
    held = {signal.SIGINT, signal.SIGTERM}
    try:
        old = signal.pthread_sigmask(signal.SIG_BLOCK, held)
    except (AttributeError, ValueError, OSError):  # no pthread_sigmask here
        yield
        return
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


def _worker_init(sweep_pid: int) -> None:
    """In a pool worker: leave Ctrl-C to the sweep (which stops every worker itself), and exit
    within half a second of the sweep's process ending however it ends (even SIGKILL), so
    that no worker outlives it holding its pipes. (The forkserver that forked the worker lives
    as long as its workers do, so the worker watches the sweep itself.)"""
    import threading

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    try:  # (a forkserver started while the sweep held them passes the mask on)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT, signal.SIGTERM})
    except (AttributeError, ValueError, OSError):
        pass

    def watch() -> None:
        while not _ended(sweep_pid):
            time.sleep(0.5)
        os._exit(1)

    threading.Thread(target=watch, name="sweep-watch", daemon=True).start()


def _ended(pid: int) -> bool:
    """Whether process `pid` has exited: gone, or a zombie its parent has not reaped yet (a
    killed process closes its pipes at once, but its pid lives on until reaped)."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except FileNotFoundError:
        return True
    except (OSError, IndexError):  # no /proc: ask the kernel whether the pid exists
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        except OSError:
            pass
        return False


def _stop_workers(pool: ProcessPoolExecutor) -> None:
    """Kill a pool's workers mid-run (they hold no state worth saving) and reap them."""
    procs = list((getattr(pool, "_processes", None) or {}).values())
    for p in procs:
        if p.is_alive():
            p.kill()
    for p in procs:
        p.join(timeout=1.0)


def _collect(index: dict, n: int, progress: Progress | None, next_done, result) -> list:
    """Results of submitted tasks (`index`: handle -> position) as they finish, in position
    order; `next_done(pending)` blocks until some finish and returns them."""
    out: list = [None] * n
    pending, done = set(index), 0
    while pending:
        for h in next_done(pending):
            pending.discard(h)
            out[index[h]] = result(h)
            done += 1
            if progress:
                progress(done, n)
    return out


# --- sweep and search ----------------------------------------------------------------------------
@dataclass
class Table:
    """Rows of plain values under named columns: a sweep's or a search's output."""

    columns: list[str]
    rows: list[dict[str, Any]]
    key_columns: list[str]  # the leading columns that say which run a row is
    probes: "Table | None" = None  # find_max_rate: a row per probe run (its rate, its seed)

    def to_csv(self) -> str:
        buf = io.StringIO()
        w = csv.writer(buf, lineterminator="\n")
        w.writerow(self.columns)
        for r in self.rows:
            w.writerow(["" if r.get(c) is None else _cell(r.get(c)) for c in self.columns])
        return buf.getvalue()

    def to_text(self, columns: list[str] | None = None) -> str:
        """An aligned text table of `columns` (default all), headed by their short labels."""
        columns = columns or self.columns
        head = [SHORT.get(c, c) for c in columns]
        body = [[_fmt(r.get(c)) for c in columns] for r in self.rows]
        widths = [max(len(x) for x in col) for col in zip(head, *body)]
        return "\n".join("  ".join(x.rjust(w) for x, w in zip(line, widths))
                         for line in [head, *body])


SHORT = {
    "requests_finished": "finished", "throughput_requests_per_s": "req/s",
    "throughput_output_tokens_per_s": "out tok/s", "ttft_p50_ms": "TTFT p50 ms",
    "ttft_p99_ms": "TTFT p99 ms", "tpot_p50_ms": "TPOT p50 ms", "e2e_p99_ms": "E2E p99 ms",
    "goodput_requests_per_s": "goodput", "slo_attainment": "SLO att.",
    "preemptions": "preempt", "kv_mean_usage": "KV usage", "wall_s": "wall s",
}
# What `servesim sweep` prints without -o (the CSV has every metric).
TEXT_METRICS = ["requests_finished", "throughput_requests_per_s", "throughput_output_tokens_per_s",
                "ttft_p50_ms", "ttft_p99_ms", "tpot_p50_ms", "e2e_p99_ms",
                "goodput_requests_per_s", "slo_attainment", "preemptions", "kv_mean_usage",
                "wall_s"]


def _cell(v) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    return str(v)


def _fmt(v) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        a = abs(v)
        return f"{v:,.0f}" if a >= 1000 else f"{v:.1f}" if a >= 10 else f"{v:.3f}"
    return _cell(v)


def run_sweep(p: Plan, runner: Runner, progress: Progress | None = None) -> Table:
    """Every point at every seed: one row per point and seed, in grid order then seed."""
    tasks, keys = [], []
    for point in p.points:
        for seed in p.seeds if p.seeds is not None else [point.scenario.seed]:
            tasks.append((point.label(seed=seed), variant(point.scenario, seed=seed)))
            keys.append({**point.values, "seed": seed})
    rows = runner.run(tasks, progress)
    key_columns = [a.key for a in p.axes]
    key_columns += [] if "seed" in key_columns else ["seed"]  # a grid may sweep seed itself
    columns = key_columns + [c for c, _ in METRICS] + ["wall_s"]
    return Table(columns, [{**k, **r} for k, r in zip(keys, rows)], key_columns)


@dataclass
class RateSearch:
    """The search for one configuration's highest passing rate: grow, then bisect."""

    start: float
    target: float
    tolerance: float
    max_doublings: int = 12
    passed: tuple[float, float] | None = None  # (highest passing rate, its attainment)
    failed: tuple[float, float] | None = None  # (lowest failing rate, its attainment)
    probes: int = 0

    def next_rate(self) -> float | None:
        """The rate to probe next, or None when the search is over."""
        lo, hi = self.passed, self.failed
        if lo and hi:
            if hi[0] - lo[0] <= self.tolerance * lo[0]:
                return None
            mid = float(f"{(lo[0] + hi[0]) / 2:.4g}")  # short rates read well in the output
            return mid if lo[0] < mid < hi[0] else (lo[0] + hi[0]) / 2
        if lo:
            return None if lo[0] >= self.start * 2 ** self.max_doublings else lo[0] * 2
        if hi:
            return None if hi[0] <= self.start / 2 ** self.max_doublings else hi[0] / 2
        return self.start

    def record(self, rate: float, attainment: float) -> None:
        self.probes += 1
        if attainment >= self.target:
            if self.passed is None or rate > self.passed[0]:
                self.passed = (rate, attainment)
        elif self.failed is None or rate < self.failed[0]:
            self.failed = (rate, attainment)

    def probes_left(self) -> int:
        """A guess at the probes still to come (for a progress estimate)."""
        if self.next_rate() is None:
            return 0
        lo, hi = self.passed, self.failed
        gap = (hi[0] - lo[0]) / lo[0] if lo and hi else 1.0
        steps = 0
        while gap > self.tolerance:
            gap, steps = gap / 2, steps + 1
        return steps + (0 if lo and hi else 1)


def find_max_rate(p: Plan, runner: Runner, *, target: float = 0.9, tolerance: float = 0.05,
                  progress: Progress | None = None) -> Table:
    """For each point, the highest `workload.rate` whose mean SLO attainment over the seeds is
    at least `target`. Probes of different points run together, one round at a time.

    Raises ScenarioError when the grid sets `workload.rate`, a point has no SLO, replays a
    trace or is a closed loop, or `target` / `tolerance` are out of range."""
    if not 0 < target <= 1:
        raise ScenarioError(f"--attainment {target}: must be in (0, 1]")
    if not 1e-3 <= tolerance < 1:  # (finer would bisect for ever at no gain)
        raise ScenarioError(f"--tolerance {tolerance}: must be from 0.001 to below 1")
    if any(a.key == "workload.rate" for a in p.axes):
        raise ScenarioError("--grid workload.rate: --find-max-rate searches the rate itself")
    for point in p.points:
        sc = point.scenario
        if not (sc.slo.ttft_ms or sc.slo.tpot_ms or sc.slo.e2e_ms):
            raise ScenarioError(f"{sc.source}: [slo]: --find-max-rate needs an SLO "
                                "(--slo ttft_ms=...,tpot_ms=... or [slo] in the scenario)")
        if sc.workload.arrival == "trace":
            raise ScenarioError(f"{sc.source}: workload.arrival = \"trace\": --find-max-rate "
                                "needs synthetic arrivals (poisson, gamma, constant)")
        if sc.workload.concurrency:  # the users set the load; workload.rate is not read
            raise ScenarioError(f"{sc.source}: workload.concurrency = {sc.workload.concurrency}: "
                                "a closed loop ignores the rate --find-max-rate varies; search "
                                "the users with `servesim plan --slo ...` or "
                                "--grid workload.concurrency=...")
    searches = [RateSearch(pt.scenario.workload.rate, target, tolerance) for pt in p.points]
    done = 0
    probe_rows = []
    while True:
        probes = [(s, pt, s.next_rate()) for s, pt in zip(searches, p.points)]
        probes = [x for x in probes if x[2] is not None]
        if not probes:
            break
        tasks, keys = [], []
        for _, pt, rate in probes:
            for seed in p.seeds if p.seeds is not None else [pt.scenario.seed]:
                tasks.append((pt.label(**{"workload.rate": rate, "seed": seed}),
                              variant(pt.scenario, seed=seed, rate=rate)))
                keys.append({**pt.values, "workload.rate": rate, "seed": seed})
        per_probe = len(tasks) // len(probes)
        later = per_probe * sum(s.probes_left() for s in searches) - len(tasks)
        report = (lambda d, n: progress(done + d, done + n + max(later, 0))) if progress else None
        rows = runner.run(tasks, report)
        probe_rows += [{**k, **r} for k, r in zip(keys, rows)]
        done += len(tasks)
        for i, (search, _, rate) in enumerate(probes):
            got = rows[i * per_probe:(i + 1) * per_probe]
            search.record(rate, sum(r["slo_attainment"] or 0.0 for r in got) / len(got))
    key_columns = [a.key for a in p.axes] + ["seeds"]
    columns = key_columns + ["max_rate", "attainment", "fail_rate", "fail_attainment", "probes"]
    out = []
    for pt, s in zip(p.points, searches):
        out.append({**pt.values, "seeds": len(p.seeds) if p.seeds is not None else 1,
                    "max_rate": s.passed and s.passed[0], "attainment": s.passed and s.passed[1],
                    "fail_rate": s.failed and s.failed[0],
                    "fail_attainment": s.failed and s.failed[1], "probes": s.probes})
    probe_keys = [a.key for a in p.axes] + ["workload.rate", "seed"]
    probe_table = Table(probe_keys + [c for c, _ in METRICS] + ["wall_s"], probe_rows, probe_keys)
    return Table(columns, out, key_columns, probes=probe_table)


# --- progress ------------------------------------------------------------------------------------
class ProgressBar:
    """A one-line bar on a text stream: runs done of expected, elapsed and time left.

    Call it as a Progress callback; `close()` ends the line."""

    WIDTH = 24

    def __init__(self, stream, label: str = "sweep") -> None:
        self.stream, self.label = stream, label
        self.t0 = time.monotonic()
        self._last = 0.0
        self._width = 0  # of the line drawn last; 0 before the first

    def __call__(self, done: int, total: int) -> None:
        now = time.monotonic()
        if done < total and now - self._last < 0.1:  # at most ten redraws a second
            return
        self._last = now
        elapsed = now - self.t0
        filled = self.WIDTH * done // max(total, 1)
        left = f"~{clock_text(elapsed / done * (total - done))} left" if 0 < done < total else ""
        line = (f"{self.label} [{'#' * filled}{'.' * (self.WIDTH - filled)}] "
                f"{done}/{total} runs  {clock_text(elapsed)} elapsed  {left}")
        # pad over what a longer previous line left behind
        self.stream.write(f"\r{line.ljust(self._width)}")
        self.stream.flush()
        self._width = len(line)

    def close(self) -> None:
        if self._width:
            self.stream.write("\n")
            self.stream.flush()


def clock_text(s: float) -> str:
    """Seconds as m:ss, or h:mm:ss from an hour on."""
    s = int(round(s))
    h, m = divmod(s // 60, 60)
    return f"{h}:{m:02d}:{s % 60:02d}" if h else f"{m}:{s % 60:02d}"
