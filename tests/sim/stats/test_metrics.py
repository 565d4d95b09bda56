"""Metrics: the rolling figures of a live screen."""

import math

from sim import Engine, rolling
from sim.engine import timeline
from tests.helpers import small_scenario


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
