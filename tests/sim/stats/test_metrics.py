"""Metrics: the rolling figures of a live screen; the floors a run in progress proves."""

import math

import pytest

from sim import Engine, rolling
from sim.deploy.build import build
from sim.engine import timeline
from sim.inputs.scenario import load_scenario
from sim.stats.metrics import floors, summarize
from tests.helpers import small_scenario, workload_of


def test_rolling_figures_without_history_equal_those_with_it(monkeypatch):
    # A run that keeps no history (the dashboard's) holds the timeline rows of the last
    # ROLLING_S seconds, so its rolling figures are those of a run that keeps everything, at
    # every point of a run many chunks long, while the rows it holds stay a window's worth.
    monkeypatch.setattr(timeline, "CHUNK", 256)
    monkeypatch.setattr(timeline, "_STAGE", 64)
    monkeypatch.setattr(Engine, "ROLLING_S", 4.0)
    sc = small_scenario("workload.duration_s=60")
    full, bounded = Engine(sc), Engine(sc, keep_history=False)
    held = []
    for k in range(1, 130):
        t = k * 0.5
        full.run_until(t)
        bounded.run_until(t)
        for window in (4.0, 1.0):
            a, b = rolling(full, window), rolling(bounded, window)
            assert a.keys() == b.keys()
            for key in a:
                assert a[key] == b[key] or (a[key] is not None and math.isnan(a[key])
                                            and math.isnan(b[key])), (t, window, key)
        held.append(bounded.timeline.n - bounded.timeline.first)
    assert full.timeline.n > 20 * 256
    assert max(held) < 6 * 256
    assert not any(r.state.is_done for r in bounded.requests.values())  # (live ones only)


FLOOR_CASES = [
    ("chat", ["workload.rate=40", "workload.duration_s=8"]),  # overloaded: the queue grows
    ("chat", ["workload.rate=30", "workload.duration_s=6", "engine.preset=vllm-v1"]),  # API server
    ("chat", ["workload.rate=40", "workload.duration_s=8", "admission.max_waiting=20"]),
    ("replicas", ["workload.rate=60", "workload.duration_s=4"]),
    ("disaggregated", ["workload.rate=30", "workload.duration_s=4"]),
    ("concurrency", ["workload.num_requests=150"]),
    ("multiturn", []),
    ("data-parallel", ["workload.duration_s=4"]),
    ("pipeline", ["workload.duration_s=4"]),
]


@pytest.mark.parametrize("spec, sets", FLOOR_CASES)
def test_floors_bound_the_final_percentiles_and_reach_them(spec, sets):
    # At every point of a run, each floor is at most the figure the whole run reports; once
    # the run is over, it is that figure. A floor that overestimated a request in flight
    # (its time spent counted from a later start, or a request counted twice) breaks the
    # first; one that ignored the requests in flight stays far below along the way.
    engine = build(load_scenario(spec, sets), record_events=False, keep_history=False)
    seen = []
    while not engine.done:
        engine.run(29)
        f = floors(engine)
        assert f is not None
        seen.append(f)
    final = summarize(engine)
    want = {f"{m}_{p}_ms": final[f"{m}_ms"][p] or 0.0
            for m in ("ttft", "tpot", "e2e") for p in ("p50", "p90", "p99")}
    assert len(seen) > 5
    for f in seen:
        for col, v in want.items():
            assert f[col] <= v * (1 + 1e-12), (col, f[col], v)
    assert seen[-1] == pytest.approx(want, rel=1e-12, abs=1e-9)


def test_a_request_waiting_counts_the_time_it_has_waited():
    # 40 requests at t = 0, served one at a time: while most still wait, every TTFT and E2E
    # percentile is at least the time they have waited, and TPOT at least the gap the one
    # decoding has run so far over its tokens to come.
    engine = Engine(small_scenario("scheduler.max_num_seqs=1"),
                    workload=workload_of([(0.0, 64, 50)] * 40), keep_history=False)
    engine.run(120)
    f = floors(engine)
    waited_ms = engine.now * 1e3
    assert engine.counts["finished"] < 10 and waited_ms > 0
    for p in ("p50", "p90", "p99"):
        assert f[f"ttft_{p}_ms"] == pytest.approx(waited_ms)
        assert f[f"e2e_{p}_ms"] == pytest.approx(waited_ms)
    (busy,) = [r for r in engine.requests.values() if r.num_output_tokens]
    assert f["tpot_p99_ms"] >= (engine.now - busy.first_token_time) / 49 * 1e3 > 0


def test_no_floor_where_a_request_in_flight_may_still_leave():
    # A cancelled request leaves the population; its time spent bounds nothing.
    engine = build(load_scenario("chat", ["workload.cancel_fraction=0.2"]),
                   record_events=False, keep_history=False)
    engine.run(50)
    assert floors(engine) is None
