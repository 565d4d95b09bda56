"""Replay of a session log: rebuild the engine from the log's header and embedded workload, and
re-apply every recorded user action at the engine step and simulated time it took effect.

`verify` re-runs a session and compares the regenerated event stream with the recorded one.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

import numpy as np

from sim.engine import frontend
from sim.engine.engine import Engine
from sim.errors import LogError, ServesimError
from sim.gcpause import paused_gc
from sim.session.log import KIND_CODE, SessionLog, check_record, decode, encode, is_flags
from sim.inputs.scenario import ENGINE_KEYS_ADDED, scenario_from_dict
from sim.deploy.build import deployment

_ACTION = KIND_CODE["action"]
_STEPS = KIND_CODE["steps"]
_STREAM = KIND_CODE["stream"]


class Replayer:
    """Drives an engine through a recorded session. `run_until`/`step` mirror the engine's."""

    def __init__(self, log: SessionLog, make_executor=None, metrics: bool = True) -> None:
        """`make_executor(scenario)`, when given, builds the real-compute executor to replay
        with (needed to regenerate token ids). `metrics=False` regenerates the events only (a
        single engine then keeps no timeline and no ended request: faster, bounded memory,
        but nothing to summarize or export)."""
        self.log = log
        raw = log.header["scenario"]
        if isinstance(raw, dict) and "engine" not in raw:
            # written before engine profiles: its clock was the single roofline
            raw = {**raw, "engine": {"preset": "roofline"}}
        engine = raw.get("engine") if isinstance(raw, dict) else None
        if isinstance(engine, dict):
            before: dict = {}
            if not any(k in engine for k in frontend.TERMS):
                # written before profiles had an API server: its clients met the engine itself
                before.update(dict.fromkeys(frontend.TERMS, 0.0))
            if "gemm_wave_exposure" not in engine:  # written before the GEMMs' wave factor
                before["gemm_wave_exposure"] = ENGINE_KEYS_ADDED["gemm_wave_exposure"]
            if before:
                raw = {**raw, "engine": {**engine, **before}}
        kv = raw.get("kv") if isinstance(raw, dict) else None
        if isinstance(kv, dict) and "hybrid_kv_cache" not in kv:
            # written before layer groups: every layer kept the whole context
            raw = {**raw, "kv": {**kv, "hybrid_kv_cache": False}}
        try:
            sc = scenario_from_dict(raw, source=log.path, check_workload=False)
        except ServesimError as e:
            why = str(e).removeprefix(f"{log.path}: ")  # (it names the file too: once is enough)
            raise LogError(f"{log.path}: the header's scenario does not load: {why}") from None
        self._next = 0
        self.end_step = int(log.footer["step"])
        self.end_time = float(log.footer["now"])
        # Whether the session had applied the arrivals and cancellations due where it ended
        # (written before logs said so: not).
        self.end_settled = log.footer.get("settled")
        if "cluster" in log.header:  # a deployment of several instances
            self._init_cluster(sc, make_executor)
            return
        self.end_at = None
        executor = make_executor(sc) if make_executor else None
        self.engine = Engine(sc, policy=log.header["policy"], workload=log.workload(),
                             executor=executor, clock=log.header["clock"],
                             record_timeline=metrics, keep_history=metrics)
        if log.header["clock"] == "measured":
            self.engine.duration_override = _durations(log.path, log.records)
        self.actions = [decode(r) for r in log.records if r[0] == _ACTION]

    def _init_cluster(self, sc, make_executor) -> None:
        log = self.log
        try:
            self.engine = deployment(sc, policy=log.header["policy"], workload=log.workload(),
                                  make_executor=make_executor, clock=log.header["clock"])
        except ServesimError as e:
            raise LogError(f"{log.path}: the header's deployment does not load: {e}") from None
        streams = _streams(log)
        if sorted(streams) != list(range(-1, len(self.engine.instances))):
            raise LogError(f"{log.path}: the log's streams {sorted(streams)} do not match its "
                           f"{len(self.engine.instances)} instances")
        if log.header["clock"] == "measured":
            for i, e in enumerate(self.engine.instances):
                e.duration_override = _durations(log.path, streams[i])
        # The deployment's own actions; those its instances recorded follow from them.
        self.actions = [decode(r) for r in streams[-1] if r[0] == _ACTION]
        # (the reader checked the shape of every `at` there is: here, that there is one for
        # each instance)
        n = len(self.engine.instances)
        for a in self.actions:
            if len(a.args.get("at") or ()) != n:
                raise LogError(f"{log.path}: the deployment's {a.action!r} action at "
                               f"t={a.t} lacks where each of its {n} instances stood ('at')")
            if not is_flags(a.args.get("settled", [False] * (n + 1)), n + 1):
                raise LogError(f"{log.path}: the deployment's {a.action!r} action at "
                               f"t={a.t} lacks whether it and each of its {n} instances had "
                               "settled ('settled')")
        at = log.footer.get("at")
        if len(at or ()) != n:
            raise LogError(f"{log.path}: footer lacks where each instance stood ('at')")
        self.end_at = at

    @property
    def done(self) -> bool:
        if self.end_at is not None:
            return (self._next >= len(self.actions)
                    and self.engine.position() == [list(p) for p in self.end_at])
        return (self._next >= len(self.actions) and self.engine.step_count >= self.end_step
                and self.engine.now >= self.end_time)

    def run_until(self, t: float, max_steps: int | None = None) -> int:
        """Advance toward simulated time `t` (never past the recorded end), applying recorded
        actions where they happened. Returns engine steps taken."""
        if self.end_at is not None:
            return self._run_cluster_until(t, max_steps)
        e = self.engine
        start = e.step_count
        t = min(t, self.end_time)
        while self._next < len(self.actions):
            a = self.actions[self._next]
            if a.t > t:
                break
            self._bring(a)
            e.apply_action(a.action, a.args)
            self._next += 1
        limit = self.end_step - e.step_count
        if self._next < len(self.actions):
            limit = min(limit, self.actions[self._next].step - e.step_count)
        if max_steps is not None:
            limit = min(limit, max(0, max_steps - (e.step_count - start)))
        if limit > 0 and e.now < t:
            e.run_until(t, limit)
        if self._next >= len(self.actions) and e.step_count == self.end_step:
            if e.now < t:
                e.advance_to(self.end_step, t)
            if t >= self.end_time and self.end_settled is True:
                e.settle()  # (the session's last decision, which ran no step)
        return e.step_count - start

    def _bring(self, a) -> None:
        """Bring the engine to where action `a` took effect, with what was due there applied
        if it had been (`Engine.settled`)."""
        if self.end_at is not None:
            self.engine.advance_to(a.args["at"], a.args.get("settled"))
            self.engine.settle(a.args.get("settled"))
            return
        self.engine.advance_to(a.step, a.t)
        if a.args.get("settled") is True:
            self.engine.settle()

    def _run_cluster_until(self, t: float, max_steps: int | None) -> int:
        """`run_until` for a deployment: each action at the instances' recorded positions, and
        no instance past the next action's position or the end."""
        c = self.engine
        start = c.step_count
        t = min(t, self.end_time)
        while self._next < len(self.actions) and self.actions[self._next].t <= t:
            a = self.actions[self._next]
            self._bring(a)
            c.apply_action(a.action, a.args)
            self._next += 1
        nxt = self.actions[self._next].args if self._next < len(self.actions) else None
        caps = nxt["at"] if nxt is not None else self.end_at
        settled = nxt.get("settled") if nxt is not None else self.end_settled
        left = None if max_steps is None else max(0, max_steps - (c.step_count - start))
        if left != 0:
            c.run_until(t, left, caps=caps, settled=settled)
        within = max_steps is None or c.step_count - start < max_steps
        if self._next >= len(self.actions) and t >= self.end_time and within:
            self._cluster_to_end()
        return c.step_count - start

    def _cluster_to_end(self) -> None:
        """The instances' last idle stretches, and what was due there applied if it had been."""
        self.engine.advance_to(self.end_at, self.end_settled)
        self.engine.settle(self.end_settled)

    def step(self) -> int:
        """One engine step (the dashboard's `n`), after every action recorded where the engine
        now is (two keys pressed between two steps are two actions at one step: applying only
        the first stepped the replay off the recording)."""
        if self.end_at is not None:
            c = self.engine
            while self._next < len(self.actions):
                a = self.actions[self._next]
                if [e.step_count for e in c.instances] != [p[0] for p in a.args["at"]]:
                    break
                self._bring(a)
                c.apply_action(a.action, a.args)
                self._next += 1
            caps = (self.actions[self._next].args["at"] if self._next < len(self.actions)
                    else self.end_at)
            n = c.run_until(math.inf, 1, caps=caps)
            if self.done:
                self._cluster_to_end()
            return n
        e = self.engine
        while self._next < len(self.actions) and self.actions[self._next].step == e.step_count:
            a = self.actions[self._next]
            self._bring(a)
            e.apply_action(a.action, a.args)
            self._next += 1
        if e.step_count >= self.end_step:
            if self._next >= len(self.actions):
                self.run_until(self.end_time)  # (the idle stretch, and what was due, at the end)
            return 0
        return e.step()

    def run(self) -> None:
        """Replay the whole recorded session. Raises LogError naming the log when the recorded
        actions cannot be applied where they were recorded."""
        try:
            self._run()
        except LogError:
            raise
        except ServesimError as e:
            raise LogError(f"{self.log.path}: the session does not replay: {e}") from None

    def _run(self) -> None:
        if self.end_at is not None:
            while self._next < len(self.actions):
                a = self.actions[self._next]
                self._bring(a)
                self.engine.apply_action(a.action, a.args)
                self._next += 1
            self._cluster_to_end()
            return
        self.run_until(math.inf)
        if self.engine.step_count != self.end_step:
            raise LogError(f"{self.log.path}: replay ended at step {self.engine.step_count}, "
                           f"the log at step {self.end_step}")


def _durations(path: str, records):
    """The measured step durations of a stream's `steps` records, in order (an iterator). One
    past the last raises LogError: a replay that runs more steps than the log recorded has
    diverged from it (`verify` reports where)."""
    durs = [np.frombuffer(r[8], np.float64) for r in records if r[0] == _STEPS and r[8] is not None]
    return itertools.chain(np.concatenate(durs).tolist() if durs else [], _no_more(path))


def _no_more(path: str):
    raise LogError(f"{path}: the replay runs more steps than the log recorded durations for")
    yield  # (a generator: raises when the durations before it are used up)


def _streams(log: SessionLog) -> dict[int, list]:
    """A deployment's log records by stream (-1: the deployment's own; then each instance)."""
    out: dict[int, list] = {}
    current = None
    for r in log.records:
        if r[0] == _STREAM:
            current = out.setdefault(int(r[2]), [])
        elif current is None:
            raise LogError(f"{log.path}: an event before the first stream mark")
        else:
            current.append(r)
    return out


def _differ(a, b) -> bool:
    """a != b, where a regenerated NumPy number compared with what a damaged record holds in
    its place (a list, say) counts as a difference rather than raising."""
    try:
        return bool(a != b)
    except ValueError:
        return True


@dataclass
class Divergence:
    index: int
    expected: dict | None
    got: dict | None

    def describe(self) -> str:
        return f"event {self.index}: expected {self.expected}, got {self.got}"


def _show(rec) -> dict | None:
    if rec is None:
        return None
    d = decode(rec, check=False).to_dict()  # (a recorded one is checked before)
    for k in ("ends", "durs"):
        if isinstance(d.get(k), list) and len(d[k]) > 6:
            d[k] = d[k][:3] + ["..."] + d[k][-2:]
    return d


def verify(log: SessionLog, make_executor=None,
           watch=None) -> tuple[Replayer, Divergence | None]:
    """Replay `log` and compare the regenerated event stream with the recorded one.

    Returns the replayer and the first divergence (None when identical). The replayed engine
    regenerates events only: the summary of a verified session is the one recorded.
    `watch(engine)`, when given, is called with the engine before it runs (a progress line).
    """
    r = Replayer(log, make_executor, metrics=False)
    if watch is not None:
        watch(r.engine)
    with paused_gc(freeze=True):  # (one pause for the run and the records it regenerates)
        try:
            r.run()
        except ServesimError:
            pass  # a divergence shows in the comparison below
        events = r.engine.log_events() if r.end_at is not None else r.engine.events
        got = [encode(e) for e in events]
        if "settled" not in log.footer:  # written before actions said it: compare without
            for rec in got:
                if rec[0] == _ACTION and "settled" in rec[4]:
                    rec[4] = {k: v for k, v in rec[4].items() if k != "settled"}
    want = log.records
    if not _differ(got, want):  # the common case, compared in C
        return r, None
    compare_tokens = r.engine.executor is not None
    for i in range(max(len(got), len(want))):
        a = want[i] if i < len(want) else None
        b = got[i] if i < len(got) else None
        if a is not None and b is not None and not compare_tokens and a[0] == _STEPS:
            a = a[:6] + [None] + a[7:]  # recorded with real compute, replayed without
        if _differ(a, b):
            if a is not None:  # a record that cannot be an event is a damaged log, not a
                try:           # session that replays differently
                    check_record(want[i])
                except ValueError as e:
                    raise LogError(f"{log.path}: event {i}: {e}") from None
            return r, Divergence(i, _show(a), _show(b))
    return r, None
