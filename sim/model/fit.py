"""Fitting the service-time model's coefficients to measured latencies.

Two pieces, shared by `servesim calibrate` and the fitted engine profiles:

- `record_run` runs a scenario once and keeps, for every engine step, what the cost model was
  asked (prefill and decode quantities, sequences, sampled rows) and when the step could start
  at the earliest (the arrival it waited for, if the engine was idle), and for every request its
  arrival, when its client sent it and the steps of its first and last token.
  `RunRecord.replay` then re-times the same schedule under other coefficients in a few
  vectorised NumPy passes: a step starts when the previous one ends or when it could start,
  whichever is later. The schedule itself depends on the timing only through arrivals (under
  a saturated or fixed batch it does not at all), so a fit alternates: fit on the recorded
  schedules, re-simulate, fit again.
- `least_squares` minimises a sum of squared residuals over bounded coefficients
  (Levenberg-Marquardt in a log or logit space, so every trial value is valid).
"""

from __future__ import annotations

import math
import weakref
from dataclasses import dataclass

from typing import Any

import numpy as np

from sim.deploy.build import is_deployment
from sim.model.costmodel import CostModel
from sim.engine.engine import Engine, StepObserver
from sim.engine.frontend import FrontEnd
from sim.errors import ScenarioError
from sim.stats.metrics import summarize


class RecordingCost(StepObserver):
    """A service-time model (`sim.model.costmodel.ServiceTime`) that times steps with `model` and
    keeps the arguments of every step it is asked to time; as the engine's observer it also
    keeps each admission's step and arrival. Give it to one engine as both
    (`Engine(scenario, cost=rec, observers=[rec])`) and `bind` it to that engine.

    The engine times a run of decode steps before it knows how many it will take (it cuts the
    run at the next event), so a step index may be timed twice: the later record wins, and
    records past the engine's last step are dropped (`features`)."""

    def __init__(self, model: CostModel) -> None:
        self.model = model
        self._engine: Any = None
        self._count = -1
        self._offset = 0
        self._idle = 0.0
        self.records: list[tuple] = []  # (first step index, start or None, args)
        self.swaps: list[tuple[int, float]] = []  # (step index, seconds of block copies)
        self.admitted_at: list[tuple[int, float]] = []  # (step index, arrival) per admission

    def bind(self, engine) -> None:
        """Record the steps of `engine` (whose cost model this is)."""
        # A proxy, not a reference: no engine <-> observer cycle, so a dropped engine is freed
        # by reference counting alone (the engine runs with the cyclic collector paused).
        self._engine = weakref.proxy(engine)
        self._idle = engine.idle_time

    # --- StepObserver
    def admitted(self, engine, req) -> None:
        # A request cannot be computed before it arrives, however fast earlier steps run.
        self.admitted_at.append((engine.step_count, req.arrival_time))

    def _index(self, n: int) -> int:
        e = self._engine
        if e.step_count != self._count:
            self._count, self._offset = e.step_count, 0
        i = self._count + self._offset
        self._offset += n
        return i

    def _record(self, n: int, args: tuple) -> None:
        """Keep the arguments of the next `n` steps (arrays of length n, or scalars)."""
        i = self._index(n)
        # A step the engine idled for starts no earlier than its clock (the arrival it waited
        # for); any other follows its predecessor, whatever that one's duration.
        e = self._engine
        start = None
        if i == self._count and e.idle_time > self._idle:
            start, self._idle = e.now, e.idle_time
        self.records.append((i, start, args))

    # --- ServiceTime: every method the engine times steps with records what it is asked (a
    # step missed here would replay as an empty step: tests/sim/model/test_calibrate.py replays
    # runs under their own cost model)
    @property
    def window(self) -> int:
        """The model's sliding window: the engine counts what its layers skip for it too."""
        return self.model.window

    def step(self, p_tokens, p_attended, p_cached, d_seqs, d_cached, num_seqs, sampled,
             p_beyond=0, p_skip=0, d_beyond=0):
        args = (p_tokens, p_attended, p_cached, d_seqs, d_cached, num_seqs, sampled, p_beyond,
                p_skip, d_beyond)
        self._record(1, args)
        return self.model.step(*args)

    # (a run of decode steps stays within the window: nothing beyond it)
    def decode_steps(self, b, d_cached):
        self._record(len(d_cached), (0, 0, 0, b, np.asarray(d_cached), b, b, 0, 0, 0))
        return self.model.decode_steps(b, d_cached)

    def decode_times(self, b, c0, n, t, t_ext):
        ends, durs, ens = self.model.decode_times(b, c0, n, t, t_ext)
        cached = c0 + b * np.arange(len(ends), dtype=np.int64)
        self._record(len(ends), (0, 0, 0, b, cached, b, b, 0, 0, 0))
        return ends, durs, ens

    def swap_time(self, num_blocks):
        # (added to the duration of the step just timed: copies over the host link, which
        # no engine coefficient changes)
        t = self.model.swap_time(num_blocks)
        self.swaps.append((self._count + self._offset - 1, t))
        return t

    def idle_energy(self, seconds):
        return self.model.idle_energy(seconds)

    def num_blocks(self):
        return self.model.num_blocks()

    def num_host_blocks(self):
        return self.model.num_host_blocks()

    def features(self, num_steps: int):
        """Per-step arrays of the 10 cost-model arguments (`CostModel.step`'s), each step's
        earliest start, and the seconds of swap copies added to it."""
        cols = np.zeros((10, num_steps), dtype=np.float64)
        ready = np.full(num_steps, -np.inf)
        for i, start, args in self.records:
            n = len(args[4]) if isinstance(args[4], np.ndarray) else 1
            hi = min(i + n, num_steps)
            if hi <= i:
                continue
            for k, a in enumerate(args):
                cols[k, i:hi] = a[: hi - i] if isinstance(a, np.ndarray) else a
            ready[i:hi] = -np.inf
            if start is not None:
                ready[i] = start
        for i, t in self.admitted_at:
            if i < num_steps:
                ready[i] = max(ready[i], t)
        extra = np.zeros(num_steps, dtype=np.float64)
        for i, t in self.swaps:
            if i < num_steps:
                extra[i] += t
        return cols, ready, extra


@dataclass
class RunRecord:
    """One simulated run's schedule (see the module docstring)."""

    features: np.ndarray  # (10, steps): the cost model's arguments per step
    ready: np.ndarray  # earliest start of each step (-inf: right after the previous one)
    arrival: np.ndarray  # per finished request: when it reached the engine
    first: np.ndarray  # step index of its first token
    last: np.ndarray  # step index of its last token
    num_output: np.ndarray
    summary: dict  # the simulation's own summary (sim.stats.metrics.summarize)
    swap: np.ndarray  # seconds of swap copies each step adds (no coefficient changes them)
    # per finished request: when its client sent it; its TTFT and E2E count from here, as its
    # client measures them (sim.engine.request.Request.client_ttft)
    since: np.ndarray
    # behind an API server that spends time on each output token (sim.engine.frontend): that
    # time (s), and the tokens each step sampled; its tokens reach the clients when the server
    # has handed them out
    token_s: float = 0.0
    sampled: np.ndarray | None = None
    # with one loop taking in requests and streaming tokens (`FrontEnd.one_loop`): its intake's
    # busy spells, which the tokens of steps ending in them wait out
    spells: Any = None  # (array('d'), or None without them)

    def durations(self, cost) -> np.ndarray:
        """Each step's duration under `cost` (a sim.model.costmodel.CostModel)."""
        return np.asarray(cost.steps(*self.features)[0], dtype=np.float64) * np.ones(
            self.features.shape[1]) + self.swap

    def replay(self, cost) -> dict:
        """Per-request TTFT, TPOT and E2E (s), the output tokens and the duration of the same
        schedule timed by `cost`."""
        d = self.durations(cost)
        s = np.cumsum(d)
        prev = s - d  # time spent before step k if never idle
        ends = s + np.maximum.accumulate(np.maximum(self.ready - prev, 0.0))
        if self.spells is not None and len(self.spells):  # (step by step: the server's rule)
            fe = FrontEnd(0.0, 0.0, self.token_s * 1e6, one_loop=True)
            fe.wait_out(self.spells)
            out = np.array([fe.deliver(t, int(n)) for t, n in zip(ends.tolist(),
                                                                 self.sampled.tolist())])
        else:
            out = ends if self.token_s == 0 else _delivered(ends, self.sampled * self.token_s)
        tf = out[self.first]
        tl = out[self.last]
        n = self.num_output
        with np.errstate(invalid="ignore", divide="ignore"):
            tpot = np.where(n > 1, (tl - tf) / np.maximum(n - 1, 1), np.nan)
        return {"ttft": tf - self.since, "tpot": tpot, "e2e": tl - self.since,
                "output_tokens": int(n.sum()),
                # (as `summarize` counts throughput: until the last token reached its client)
                "duration": float(out[-1]) if len(out) else 0.0}


def record_run(scenario) -> RunRecord:
    """Run `scenario` (one engine) and keep its schedule. Raises ServesimError as `sim.build`
    does."""
    if is_deployment(scenario):
        raise ScenarioError(f"{scenario.source}: calibration replays one engine instance "
                            "(cluster.replicas = 1, no disaggregation)")
    rec = RecordingCost(CostModel(scenario))
    engine = Engine(scenario, cost=rec, observers=[rec])
    rec.bind(engine)
    if engine.frontend is not None:
        engine.frontend.keep_spells = True  # (the replay waits every delivery out as it did)
    engine.run()
    cols, ready, swap = rec.features(engine.step_count)
    reqs = [r for r in engine.requests.values()
            if r.parent_id is None and r.token_segments and r.finish_time is not None]
    reqs.sort(key=lambda r: r.req_id)
    first = np.array([r.token_segments[0][0] for r in reqs], dtype=np.int64)
    last = np.array([r.token_segments[-1][0] + r.token_segments[-1][1] - 1 for r in reqs],
                    dtype=np.int64)
    return RunRecord(cols, ready, np.array([r.arrival_time for r in reqs], dtype=np.float64),
                     first, last, np.array([r.num_output_tokens for r in reqs], dtype=np.int64),
                     summarize(engine), swap,
                     np.array([r.sent_time for r in reqs], dtype=np.float64),
                     0.0 if engine.frontend is None else engine.frontend.token_s,
                     np.asarray(engine.timeline.column("sampled"), dtype=np.float64),
                     None if engine.frontend is None else engine.frontend.spells)


def _delivered(ends: np.ndarray, cost: np.ndarray) -> np.ndarray:
    """When an API server that takes `cost` seconds over each step's tokens, one step after
    the other in the order they end (`sim.engine.frontend.FrontEnd.deliver`), has handed out
    the tokens of steps ending at `ends`, for every step at once: with A the running sum of
    the costs, d[k] - A[k] = max(ends[k] - A[k-1], d[k-1] - A[k-1]), a running maximum.
    (Equal to the engine's step-by-step sums up to float rounding.)"""
    spent = np.cumsum(cost)
    return spent + np.maximum(np.maximum.accumulate(ends - (spent - cost)), 0.0)


# --- least squares -------------------------------------------------------------------------------
# How a coefficient is searched: "eff" in (0, 1] through a logit, "pos" >= 0 through a log.
_FLOOR = 1e-3


def _to_x(kind: str, v: float) -> float:
    if kind == "eff":
        v = min(max(v, 1e-4), 0.9999)
        return math.log(v / (1.0 - v))
    return math.log(max(v, _FLOOR))


def _from_x(kind: str, x: float) -> float:
    x = min(max(x, -30.0), 30.0)
    if kind == "eff":
        return 1.0 / (1.0 + math.exp(-x))
    return math.exp(x)


def least_squares(residuals, start: dict[str, float], kinds: dict[str, str],
                  max_iter: int = 60, tol: float = 1e-10,
                  diff_step: float = 1e-5) -> tuple[dict[str, float], np.ndarray]:
    """The coefficients near `start` minimising `sum(residuals(coeffs) ** 2)`.

    `residuals` takes a dict of coefficients and returns a 1-D array; `kinds` names each
    coefficient's range ("eff": (0, 1), "pos": >= 0). Returns the coefficients and the
    residuals there. Levenberg-Marquardt with a forward-difference Jacobian of step
    `diff_step` in the search space (raise it for residuals that move in small jumps, such as a
    simulation's).
    """
    names = list(start)
    x = np.array([_to_x(kinds[k], start[k]) for k in names])

    def coeffs(xv):
        return {k: _from_x(kinds[k], float(v)) for k, v in zip(names, xv)}

    def resid(xv):
        # A trial the model cannot evaluate counts as a very bad fit, never as a crash.
        with np.errstate(all="ignore"):
            out = np.asarray(residuals(coeffs(xv)), dtype=np.float64)
        return np.where(np.isfinite(out), out, 1e3)

    r = resid(x)
    cost = float(r @ r)
    lam = 1e-2
    for _ in range(max_iter):
        jac = np.empty((len(r), len(x)))
        for j in range(len(x)):
            h = diff_step * max(1.0, abs(x[j]))
            xj = x.copy()
            xj[j] += h
            jac[:, j] = (resid(xj) - r) / h
        g = jac.T @ r
        a = jac.T @ jac
        improved = False
        while lam < 1e10:
            step = np.linalg.solve(a + lam * np.diag(np.diag(a) + 1e-12), -g)
            xn = np.clip(x + step, -30.0, 30.0)
            rn = resid(xn)
            cn = float(rn @ rn)
            if np.isfinite(cn) and cn < cost:
                improved = cost - cn > tol * max(cost, 1e-30)
                x, r, cost = xn, rn, cn
                lam = max(lam / 3.0, 1e-9)
                break
            lam *= 4.0
        if not improved:
            break
    return coeffs(x), r


def nelder_mead(objective, start: dict[str, float], kinds: dict[str, str], max_evals: int = 200,
                scale: float = 0.3, tol: float = 1e-4) -> tuple[dict[str, float], float]:
    """The coefficients near `start` minimising the scalar `objective(coeffs)`, searched with
    the Nelder-Mead simplex in the same log / logit space as `least_squares`.

    For objectives that move in jumps (a simulation's latencies: a request waits for one more
    step or not), where finite differences mislead. `scale` is the first simplex's size.
    Returns the coefficients and the objective there.
    """
    names = list(start)
    x0 = np.array([_to_x(kinds[k], start[k]) for k in names])

    def f(xv):
        with np.errstate(all="ignore"):
            v = float(objective({k: _from_x(kinds[k], float(x)) for k, x in zip(names, xv)}))
        return v if math.isfinite(v) else 1e300

    n = len(x0)
    simplex = [x0] + [x0 + scale * np.eye(n)[i] for i in range(n)]
    values = [f(x) for x in simplex]
    evals = n + 1
    while evals < max_evals:
        order = np.argsort(values)
        simplex = [simplex[i] for i in order]
        values = [values[i] for i in order]
        if values[-1] - values[0] <= tol * (abs(values[0]) + 1e-12):
            break
        centroid = np.mean(simplex[:-1], axis=0)
        worst = simplex[-1]
        xr = centroid + (centroid - worst)
        fr = f(xr)
        evals += 1
        if fr < values[0]:
            xe = centroid + 2.0 * (centroid - worst)
            fe = f(xe)
            evals += 1
            simplex[-1], values[-1] = (xe, fe) if fe < fr else (xr, fr)
        elif fr < values[-2]:
            simplex[-1], values[-1] = xr, fr
        else:
            xc = centroid + 0.5 * (worst - centroid) if fr >= values[-1] else \
                centroid + 0.5 * (xr - centroid)
            fc = f(xc)
            evals += 1
            if fc < min(fr, values[-1]):
                simplex[-1], values[-1] = xc, fc
            else:  # shrink toward the best
                for i in range(1, n + 1):
                    simplex[i] = simplex[0] + 0.5 * (simplex[i] - simplex[0])
                    values[i] = f(simplex[i])
                evals += n
    best = int(np.argmin(values))
    return ({k: _from_x(kinds[k], float(x)) for k, x in zip(names, simplex[best])},
            float(values[best]))
